# The compiled build's declarations (see core/model.pxd): the everyday
# commands' handlers take the loop (its fields declared on roles.pxd's Roles),
# the session and the command typed.
cimport cython
from smallstalk.core cimport jobreply
from smallstalk.core.commands cimport Delete, Put, PutUnique, Reserve
from smallstalk.core.model cimport Conn, Job
from smallstalk.core.state cimport State
from smallstalk.server.roles cimport Roles
from smallstalk.server.session cimport Session

cpdef put(Roles lp, Session s, Put cmd)
@cython.locals(keyed=tuple)  # its policy's (window, bound): read in place
cpdef put_unique(Roles lp, Session s, PutUnique cmd)
cpdef reserve(Roles lp, Session s, Reserve cmd)
cpdef delete(Roles lp, Session s, Delete cmd)
cpdef bytes hand_out(Roles lp, cid, Job job)
