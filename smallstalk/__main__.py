"""`python -m smallstalk` runs the command line."""

import sys

from smallstalk.launch import main

sys.exit(main())
