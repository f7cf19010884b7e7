# The compiled build's declarations (see core/model.pxd): a session's fields,
# read by the loop, the commit, dispatch and the connection, all compiled with it.

cdef class Session:
    cdef public list out, out_mut
    cdef public object id, pending, blocked, halfclosed, closing, producer
    cdef public object worker, deliver, wait_deadline, feed, view_use, inflight
    cdef public object pending_bytes, need, owed, held, resume, peer, transport, admin
    cdef public object deferred, dialect, batch
