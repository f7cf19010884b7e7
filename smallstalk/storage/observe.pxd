# The compiled build's declarations (see core/model.pxd): a commit observes
# its batch each turn, from the journal: a C call.

cdef class Histogram:
    cdef public tuple bounds
    cdef public list counts
    cdef public object sum, count
    cpdef observe(self, value)

cdef class StorageMetrics:
    cdef public Histogram fsync_seconds, commit_records
    cdef public object last_compaction, compactions
