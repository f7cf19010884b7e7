# The compiled build's declarations (see core/model.pxd): the open segment's
# fields (a `__dict__` beside them: tests put a failing `write` on one).

cdef class SegmentWriter:
    cdef dict __dict__
    cdef public object directory, first_seq, path, fd, size, allocated, preallocate
    cdef public object records, last_seq, durable, pending_records
    cdef public object pending_last_seq, needs_cut, pending_bytes
    cdef public list pending
