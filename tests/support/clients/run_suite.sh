#!/bin/sh
# Run a public beanstalkd client's own test suite against beanstalkd (default)
# or smallstalk (SERVER=smallstalk). See run_suite.py for the details.
#   tests/support/clients/run_suite.sh --list
#   tests/support/clients/run_suite.sh pystalk
#   SERVER=smallstalk tests/support/clients/run_suite.sh fivebeans -v --json out.json
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$(dirname "$(dirname "$here")")")
py=$repo/.venv/bin/python
[ -x "$py" ] || py=python3
exec "$py" "$here/run_suite.py" "$@"
