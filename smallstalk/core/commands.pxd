# The compiled build's declarations (see model.pxd): the everyday commands as
# extension types with their fields in the object.

cdef class _Everyday:
    pass

cdef class Put(_Everyday):
    cdef public object pri, delay, ttr, body, max_age

cdef class PutRest(Put):
    pass

cdef class PutUnique(_Everyday):
    cdef public object key, pri, delay, ttr, body

cdef class Reserve(_Everyday):
    cdef public object timeout

cdef class Delete(_Everyday):
    cdef public object id

cdef class Release(_Everyday):
    cdef public object id, pri, delay

cdef class Bury(_Everyday):
    cdef public object id, pri

cdef class Touch(_Everyday):
    cdef public object id
