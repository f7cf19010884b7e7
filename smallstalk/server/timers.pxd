# The compiled build's declarations (see core/model.pxd): each turn's timer
# pass takes the loop typed (its fields on roles.pxd's Roles).
from smallstalk.core.state cimport State
from smallstalk.server.roles cimport Roles

cpdef run(Roles lp)
cpdef tuple heap_tops(State st)
cpdef maybe_earlier(Roles lp, tuple tops)
cpdef seconds_to_next_deadline(Roles lp)
