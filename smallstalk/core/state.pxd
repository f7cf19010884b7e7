# The compiled build's declarations (see model.pxd).
from smallstalk.core.model cimport Conn, Job, Tube
from smallstalk.core.moves cimport Moves

cdef class State(Moves):
    pass
