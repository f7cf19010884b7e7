# The compiled build's declarations (see core/model.pxd): a polled
# connection's fields, which only its own methods read.
from smallstalk.core.parser cimport Parser
from smallstalk.server.session cimport Session

cdef class _Connection:
    cdef public object lp, sock, stream, fd, poller, parser, read_bytes, submitted_bytes
    cdef public object unsent, done, closing, broken, closed, eof, feed, paused, sending
    cdef public object waiter, woken, room, slow_logged
    cdef public Session session
