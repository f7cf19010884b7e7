# The compiled build's declarations (see model.pxd): a keyed put asks `find`
# and then `add` (a delete of a keyed job `release`), as C calls from the
# compiled state and dispatch. (Their ints are left unannotated in keys.py:
# see storage/aof.pxd.)

cdef class TubeKeys:
    cdef public dict live, gone
    cdef public object window, keys_max, dropped_n
    cpdef object holder(self, str key, now)
    cpdef prune(self, now)

cdef class KeyHold:
    cdef public str tube, key
    cdef public object seq

cdef class KeyIndex:
    cdef public dict tubes, of_job
    cpdef object find(self, str tube, str key, now)
    cpdef add(self, str tube, str key, jid, window, keys_max, now, seq=*)
    cpdef release(self, jid, now)
