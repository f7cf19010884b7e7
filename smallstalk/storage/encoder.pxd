# The compiled build's declarations (see core/model.pxd): the encoder's own fields.

from smallstalk.storage cimport fixedcbor

cdef class LiveEncoder:
    cdef object _buf, _enc
    # The loop and the commit call these with the types below (roles.pxd,
    # commit.pxd): C calls, without a call's arguments packed and parsed.
    cpdef bytes put(self, seq, time, conn, id, tube, pri, delay, ttr, body)
    cpdef bytes job(self, cls, seq, time, conn, id)
    cpdef bytes put_unique(self, seq, time, conn, tube, key, unique_for, keys_max, id, pri,
                           delay, ttr, body)
