# The compiled build's declarations (see core/model.pxd): a polled
# connection's fields, which only its own methods read.
cimport cython
from smallstalk.core.parser cimport Parser
from smallstalk.server.roles cimport Roles
from smallstalk.server.session cimport Session

cdef class _Connection:
    # The loop as roles.pxd's root: a read's `submit` is a C call.
    cdef public Roles lp
    cdef public object sock, stream, fd, poller, parser
    # Byte counts as C integers: a read adds to them without making int objects.
    cdef public long long read_bytes, submitted_bytes
    cdef public object unsent, done, closing, broken, closed, eof, feed, paused, sending
    cdef public object waiter, woken, room, slow_logged
    cdef public Session session
    # The poller's call on every read (a cpdef: Python calls it as before).
    @cython.locals(held=Py_ssize_t, used="long long", cost="long long")
    cpdef on_readable(self)
