# The compiled build's declarations (see core/model.pxd): `load`, a restart's
# time, makes its jobs as the compiled state's own code does.
from smallstalk.core.model cimport Job, Tube
from smallstalk.core.state cimport State
