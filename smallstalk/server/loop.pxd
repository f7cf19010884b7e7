# The compiled build's declarations (see core/model.pxd): the fields are on
# roles.pxd's Roles, the root.
cimport cython
from smallstalk.core.commands cimport Delete, Put, PutUnique, Reserve
from smallstalk.core.state cimport State
from smallstalk.server cimport dispatch, timers
from smallstalk.server.roles cimport Roles
from smallstalk.server.session cimport Session

cdef class MutationLoop(Roles):
    # Called only by the loop's own methods: a C call, not a method lookup.
    # Its counts as C integers: a reply's bytes added make no int object.
    @cython.locals(owed="long long", limit="long long", bound="long long", share="long long",
                   i=Py_ssize_t, end=Py_ssize_t)
    cdef _run(self, Session s)
    cdef _turn_on_inbox_now(self)
    cdef _turn_ended(self)
    cdef _alarm_earlier(self, tops)
    # The poller's end of a pass, each wake-up.
    cpdef tuple end_batch_now(self)
    # Dispatch's everyday calls (declared on roles.pxd's Roles).
    cpdef log_put(self, conn, str tube, pri, delay, ttr, bytes body)
    cpdef log_put_unique(self, conn, str tube, str key, unique_for, keys_max, pri, delay, ttr,
                         bytes body)
    cpdef log_job(self, type cls, conn, job_id)
    cpdef body_of(self, job)
    cpdef submit(self, Session s, list events, long long size=*)
