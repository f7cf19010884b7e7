# The compiled build's declarations (see model.pxd): the parser's own fields,
# read by no one else, so compiling it costs nothing at its boundary. The
# everyday commands it makes are extension types (commands.pxd).
from smallstalk.core.commands cimport Bury, Delete, Put, Release, Reserve, Touch

cdef class Parser:
    cdef public object _buf, _mode, _put, _skip, max_job_size, _last, _skip_reply
    cdef public object _last_unique

cpdef parse_line(bytes line, max_job_size)
