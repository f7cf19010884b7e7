# The compiled build's declarations (see model.pxd): parser.py, compiled,
# calls `parse_line` as a C function; the everyday commands it makes are
# extension types (commands.pxd).
from smallstalk.core.commands cimport Bury, Delete, Release, Reserve, Touch

cpdef parse_line(bytes line, max_job_size)
