# The compiled build's declarations (see model.pxd).
from smallstalk.core.model cimport Conn, Job, Tube
from smallstalk.core.queries cimport Queries

cdef class Moves(Queries):
    pass
