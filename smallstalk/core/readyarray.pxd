# The compiled build's ready heap (readyarray.pyx), which model.pxd's Tube
# holds and queries.pxd, moves.pxd and state.pxd call in C.

cdef struct Entry:
    unsigned long long hi  # pri << 32 | id >> 32
    unsigned long long lo  # id << 32 | gen

cdef class ReadyHeap:
    cdef Entry* a
    cdef Py_ssize_t n, cap
    cdef int _resize(self, Py_ssize_t cap) except -1
    cdef int _append(self, key) except -1
    cpdef push(self, unsigned int pri, unsigned long long id, unsigned long long gen)
    cpdef unsigned long long top_id(self) noexcept
    cpdef bint top_has_gen(self, unsigned long long gen) except -1
    cpdef drop_top(self)
    cpdef add_unordered(self, unsigned int pri, unsigned long long id,
                        unsigned long long gen)
    cpdef reorder(self)
    cdef void _sift_down(self, Py_ssize_t start, Py_ssize_t pos) noexcept
    cdef void _sift_up(self, Py_ssize_t pos) noexcept
    cdef void _heapify(self) noexcept
