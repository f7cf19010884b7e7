# The compiled build's declarations (see core/model.pxd): a session's fields,
# read by the loop, the commit, dispatch and the connection, all compiled with it.

cdef class Session:
    cdef public list out, out_mut
    cdef public object id, pending, blocked, halfclosed, closing, producer
    cdef public object worker, deliver, wait_deadline, feed, view_use
    cdef public object need, held, resume, peer, transport, admin
    cdef public object deferred, dialect, batch, put_id
    # The backpressure counts, which every read and every reply add to: C
    # integers, so a count makes no int object.
    cdef public long long inflight, pending_bytes, owed
