# The compiled build's declarations (see core/model.pxd): the poller's own
# fields, read by no one else.

cdef class Poller:
    cdef public object _batcher, _ep
    cdef public dict _conns
