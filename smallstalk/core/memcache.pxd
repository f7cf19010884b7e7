# The compiled build's declarations (see model.pxd): the memcache parser's own
# fields, read by no one else (as the text parser's, parser.pxd).

cdef class Parser:
    cdef public object _buf, _mode, _set, _skip, max_job_size, _last_set, _last_get, more
