# The compiled build's declarations (see core/model.pxd): the fields are on
# roles.pxd's Roles, the root.
from smallstalk.core.state cimport State
from smallstalk.server.roles cimport Roles
from smallstalk.server.session cimport Session

cdef class MutationLoop(Roles):
    pass
