# The compiled build's declarations (see core/model.pxd): the loop's fields,
# set by loop.py's MutationLoop and by these methods, live on this root of it
# (as the state's on core/queries.pxd's); dispatch reads them through it.
from smallstalk.core.state cimport State
from smallstalk.server.commit cimport GroupCommit
from smallstalk.server.session cimport Session
from smallstalk.storage.encoder cimport LiveEncoder
from smallstalk.storage.journal cimport Journal

cdef class Roles:
    cdef dict __dict__
    cdef public State state
    cdef public GroupCommit commit
    cdef public Journal journal
    cdef public object data_dir, clock, max_job_size, now, started_at
    cdef public dict sessions, counters, tube_counters, runnable, feeds
    cdef public object serving_since, total_connections
    cdef public object refused, draining, read_only, lease_until, instance_id, _next_conn
    cdef public object _replica_next, _seq, _id_floor, _inbox, _waiter, _sleep
    cdef public LiveEncoder _encoder
    cdef public long long unsent, slice_commands, slice_bytes
    cdef public object _unsent
    cdef public object _waits_turn, _turning, batching, _resume_cb, role
    cdef public object follower, replication, ha, policies, schedules_loaded, config_path
    cdef public object bodies, admin, extended_stats, deferred, searches
    # The everyday records and bodies, defined by loop.py's MutationLoop and
    # called by dispatch, which sees the loop as this root: C calls (virtual).
    cpdef log_put(self, conn, str tube, pri, delay, ttr, bytes body)
    cpdef log_put_unique(self, conn, str tube, str key, unique_for, keys_max, pri, delay, ttr,
                         bytes body)
    cpdef log_job(self, type cls, conn, job_id)
    cpdef body_of(self, job)
    # A connection's commands (server/connection.py), on every read.
    cpdef submit(self, Session s, list events, long long size=*)
