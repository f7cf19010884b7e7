# The compiled build's declarations (see model.pxd).
from smallstalk.core cimport readyheap
from smallstalk.core.model cimport Conn, Job, Tube
from smallstalk.core.moves cimport Moves

cdef class State(Moves):
    # The live path's state changes, called by the loop as C functions. (Their
    # ints are left unannotated in state.py: see storage/aof.pxd.)
    cpdef apply_put(self, seq, time, conn, id, str tube, pri, delay, ttr, body)
    cpdef apply_put_unique(self, seq, time, conn, str tube, str key, unique_for, keys_max, id,
                           pri, delay, ttr, body)
    cpdef apply_reserve(self, seq, time, conn, id)
    cpdef apply_delete(self, seq, time, conn, id)
