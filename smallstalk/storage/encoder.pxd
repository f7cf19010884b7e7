# The compiled build's declarations (see core/model.pxd): the encoder's own fields.

cdef class LiveEncoder:
    cdef object _buf, _enc
