# The compiled build's declarations (see core/model.pxd): the journal's
# fields, read by the group commit and the loop (a `__dict__` beside them:
# tests put their own fsync thread on one).
cimport cython

from smallstalk.storage.aof cimport SegmentWriter
from smallstalk.storage.observe cimport StorageMetrics

# Final (nothing subclasses it): its cpdef methods are plain C calls, without
# the look for a Python override that a class with a `__dict__` pays each call.
@cython.final
cdef class Journal:
    cdef dict __dict__
    cdef public SegmentWriter segment
    cdef public object aof_dir, fsync, interval, segment_records, segment_bytes, next_seq
    cdef public object committed_seq, written_seq, records_written, _sync_gen, sync_asked
    cdef public object syncer, _dirty, rotated
    cdef public StorageMetrics metrics
    # Staging an encoded record, from the commit: a C call.
    cpdef append_payload(self, bytes payload, seq)
    cpdef take_seq(self)
    # A turn's commit that need not wait, from the commit, and its steps: C calls.
    cpdef bint has_pending(self)
    cpdef bint segment_full(self, records=*, nbytes=*)
    cpdef bint commit_now(self)
    cpdef write_staged(self)
    cpdef _written_is_committed(self, count)
