# The compiled build's declarations (see core/model.pxd): the open segment's
# fields (a `__dict__` beside them: tests put a failing `write` on one).
from smallstalk.storage cimport framehead

cdef class SegmentWriter:
    cdef dict __dict__
    cdef public object directory, first_seq, path, fd, size, allocated, preallocate
    cdef public object records, last_seq, durable, pending_records
    cdef public object pending_last_seq, needs_cut, pending_bytes
    cdef public list pending
    # Staging a frame, from the journal: a C call. (Its seq, and the seqs and
    # ids of journal.pxd's and commit.pxd's like methods, are left unannotated in
    # the .py: an `int` annotation is a signature of its own, checked each call.)
    cpdef append(self, bytes payload, seq)
    # Writing the staged frames, from the journal each turn: a C call too (a
    # test's `write` put on the instance still overrides it: the `__dict__`).
    cpdef write(self)
