"""`python -m smallstalk.analytics ARGS` is `smallstalk analyze ARGS`."""

import sys

from . import main

sys.exit(main(sys.argv[1:]))
