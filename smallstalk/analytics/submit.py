"""Entry script for spark-submit (absolute imports: spark-submit runs it as a file).

    spark-submit --master yarn --py-files smallstalk.zip \\
        smallstalk/analytics/submit.py DATA_DIR... --out DIR

The session spark-submit configured is used as it is; see docs/ANALYTICS.md.
"""

import sys

from smallstalk.analytics.command import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
