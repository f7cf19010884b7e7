# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled build's ready heap: `readyheap.py`'s ListHeap, the reference,
over a C array of 128-bit entries instead of a list of ints.

An entry is the pure build's int split in two words, `hi = pri << 32 | id >>
32` and `lo = id << 32 | gen`, compared as (hi, lo): the same order as the
int. Reading the top's id and gen, a push and a pop are C arithmetic and
compares (the pure heap's were int objects made and compared, and heapq's
calls); the methods the rest of the code uses on a list (`len`, indexing,
iteration) give the same ints. The array's slots follow heapq's algorithms,
so both builds keep their entries in the same places.
Not built by `pip install`; tools/compile.py builds it with the compiled
modules, and tests/unit/test_readyheap.py holds it to the reference."""

from cpython.mem cimport PyMem_Free, PyMem_Realloc

cdef enum:
    SMALLEST = 16  # slots an array never shrinks below


cdef inline bint _lt(Entry a, Entry b) noexcept nogil:
    return a.hi < b.hi or (a.hi == b.hi and a.lo < b.lo)


cdef class ReadyHeap:
    """Entries in heapq's order, in a C array that grows by half and shrinks
    when three quarters are free."""

    def __cinit__(self):
        self.n = 0
        self.cap = 0
        self.a = NULL

    def __init__(self, keys=()):
        for key in keys:
            self._append(key)
        self._heapify()

    def __dealloc__(self):
        PyMem_Free(self.a)

    cdef int _resize(self, Py_ssize_t cap) except -1:
        cdef Entry* a = <Entry*>PyMem_Realloc(self.a, cap * sizeof(Entry))
        if a == NULL:
            raise MemoryError()
        self.a = a
        self.cap = cap
        return 0

    cdef int _append(self, key) except -1:
        if self.n == self.cap:
            self._resize(max(SMALLEST, self.cap + (self.cap >> 1)))
        self.a[self.n].hi = <unsigned long long>(key >> 64)
        self.a[self.n].lo = <unsigned long long>(key & 0xFFFFFFFFFFFFFFFF)
        self.n += 1
        return 0

    cpdef push(self, unsigned int pri, unsigned long long id, unsigned long long gen):
        """Add the entry of a job that is ready now (gen: the job's, unmasked)."""
        self.add_unordered(pri, id, gen)
        self._sift_down(0, self.n - 1)

    cpdef add_unordered(self, unsigned int pri, unsigned long long id,
                        unsigned long long gen):
        """Add an entry without keeping the heap's order, for a snapshot's
        load of many: `reorder` before the heap is read or pushed to again."""
        if self.n == self.cap:
            self._resize(max(SMALLEST, self.cap + (self.cap >> 1)))
        self.a[self.n].hi = (<unsigned long long>pri << 32) | (id >> 32)
        self.a[self.n].lo = (id << 32) | (gen & 0xFFFFFFFF)
        self.n += 1

    cpdef reorder(self):
        """Restore the heap's order after `add_unordered` (one heapify)."""
        self._heapify()

    cpdef unsigned long long top_id(self) noexcept:
        """The id of the top entry's job; 0 (no job's id) when empty."""
        if self.n == 0:
            return 0
        return (self.a[0].hi << 32) | (self.a[0].lo >> 32)

    cpdef bint top_has_gen(self, unsigned long long gen) except -1:
        """Was the top entry pushed with this gen (a job's, unmasked)? Where
        not, the job has left the state the entry put it in: the entry is stale."""
        if self.n == 0:
            raise IndexError("index out of range")
        return (gen & 0xFFFFFFFF) == (self.a[0].lo & 0xFFFFFFFF)

    cpdef drop_top(self):
        """Drop the top entry."""
        if self.n == 0:
            raise IndexError("index out of range")
        self.n -= 1
        if self.n:
            self.a[0] = self.a[self.n]
            self._sift_up(0)
        if self.cap > SMALLEST and self.n < self.cap >> 2:
            self._resize(max(SMALLEST, self.cap >> 1))

    # heapq's two sifts (its _siftdown and _siftup), over the array.
    cdef void _sift_down(self, Py_ssize_t start, Py_ssize_t pos) noexcept:
        cdef Entry* a = self.a
        cdef Entry item = a[pos]
        cdef Py_ssize_t parent
        while pos > start:
            parent = (pos - 1) >> 1
            if _lt(item, a[parent]):
                a[pos] = a[parent]
                pos = parent
                continue
            break
        a[pos] = item

    cdef void _sift_up(self, Py_ssize_t pos) noexcept:
        cdef Entry* a = self.a
        cdef Py_ssize_t end = self.n, start = pos, child = 2 * pos + 1
        cdef Entry item = a[pos]
        while child < end:
            if child + 1 < end and not _lt(a[child], a[child + 1]):
                child += 1
            a[pos] = a[child]
            pos = child
            child = 2 * pos + 1
        a[pos] = item
        self._sift_down(start, pos)

    cdef void _heapify(self) noexcept:
        cdef Py_ssize_t i
        for i in reversed(range(self.n // 2)):
            self._sift_up(i)

    def __len__(self):
        return self.n

    def __bool__(self):
        return self.n != 0

    def __getitem__(self, Py_ssize_t i):
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError("index out of range")
        return (<object>self.a[i].hi << 64) | <object>self.a[i].lo

    def __iter__(self):
        cdef Py_ssize_t i = 0
        while i < self.n:  # a push or pop between two steps is the caller's to avoid, as with a list
            yield (<object>self.a[i].hi << 64) | <object>self.a[i].lo
            i += 1

    def __repr__(self):
        return f"ReadyHeap({list(self)!r})"

    def __reduce__(self):
        return (ReadyHeap, (list(self),))
