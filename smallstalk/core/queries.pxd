# The compiled build's declarations (see model.pxd): the state's fields, set
# by moves.py's Moves.__init__, live on this root of the State chain.
from smallstalk.core cimport readyheap
from smallstalk.core.keys cimport KeyIndex
from smallstalk.core.model cimport Conn, Job, Limit, Tube

cdef class Queries:
    cdef public dict jobs, tubes, conns, waiters, fanout, ints
    cdef public object tube_order, next_job_id, next_conn_id
    cdef public object last_seq, time
    cdef public object wait_heap, waiters_holding, paused, waited, epochs
    cdef public object delay_heap, ttr_heap, expiry_heap, expires
    cdef public KeyIndex keys
    cdef public object holds, limits, schedules
    # Counts as C integers (see model.pxd's Tube).
    cdef public long long total_jobs, job_timeouts, body_bytes, spilled_bytes
    cdef public long long ready_n, urgent_n, reserved_n, delayed_n, buried_n, waiting_n
    cdef public object on_body_dropped, _apply
    # A reserve's and a grant's choice, from dispatch and the loop each
    # command: C calls (the ints unannotated in queries.py: see storage/aof.pxd).
    cpdef best_ready(self, cid, now)
    cpdef next_grant(self, now)
    cpdef _top_ready(self, Tube t)
    # Each turn's timer pass (server/timers.py) asks these three when nothing
    # is due: C calls.
    cpdef drop_ended_reservations(self)
    cpdef might_be_due(self, now)
    cpdef waiters_maybe_due(self, now)
