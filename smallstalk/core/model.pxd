# Declarations for the optional compiled build (tools/compile.py): with this
# file Cython makes these classes extension types with their fields in the
# object; model.py stays the pure-Python reference (docs/PERFORMANCE.md).
from smallstalk.core cimport readyarray

cdef class Job:
    cdef public object id, tube, pri, ttr, body, state, created, deadline, gen, counts

cdef class Tube:
    cdef public readyarray.ReadyHeap ready
    cdef public object name, delayed, buried, pause, unpause_at, waiting, arrivals
    # Counts: C integers, which a command adds to without making an int object.
    cdef public long long ready_n, urgent_n, reserved_n, delayed_n, jobs_n, total_jobs
    cdef public long long cmd_delete, cmd_pause, using_n, watching_n, bytes_n, spilled_n
    cdef public long long expired_n, discarded_n

cdef class Limit:
    cdef public object max_reserved, rate, period, interval, tolerance, tat

cdef class Conn:
    cdef public object id, use, watch, reserved, logged, waiting, wait_deadline
