# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled build's writer of the two replies every job passes through,
`INSERTED <id>` and `RESERVED <id> <bytes>` with the body: each written into
one new bytes object, the ints' digits in C.

`core/replies.py` is the reference and what the pure build runs (`%`
formatting, which for these two is most of a reply's cost compiled: the
arguments' tuple, the format string's parse, an int object's decimal form).
Where they are built, server/dispatch.py calls them as C functions in
place of that formatting (a put's INSERTED, a reserve's and a grant's
RESERVED: `dispatch.hand_out`). Not built by `pip install`;
tools/compile.py builds it with the compiled modules, and
tests/unit/test_twins.py holds both builds to the reference."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.string cimport memcpy


cdef inline int _digits(unsigned long long v) noexcept:
    cdef int n = 1
    while v >= 10:
        v //= 10
        n += 1
    return n


cdef inline char* _decimal(char* p, unsigned long long v, int n) noexcept:
    """v's n decimal digits at p; the end."""
    cdef char* end = p + n
    cdef char* q = end
    while True:
        q -= 1
        q[0] = <char>(48 + v % 10)
        v //= 10
        if q == p:
            return end


cpdef bytes inserted(unsigned long long job_id):
    """`INSERTED <job_id>\\r\\n`."""
    cdef int d = _digits(job_id)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 9 + d + 2)
    cdef char* p = PyBytes_AS_STRING(out)
    memcpy(p, b"INSERTED ", 9)
    p = _decimal(p + 9, job_id, d)
    p[0] = 13
    p[1] = 10
    return out


cpdef bytes reserved(unsigned long long job_id, bytes body):
    """`RESERVED <job_id> <len(body)>\\r\\n<body>\\r\\n`."""
    cdef Py_ssize_t n = len(body)
    cdef int d = _digits(job_id), e = _digits(<unsigned long long>n)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 9 + d + 1 + e + 2 + n + 2)
    cdef char* p = PyBytes_AS_STRING(out)
    memcpy(p, b"RESERVED ", 9)
    p = _decimal(p + 9, job_id, d)
    p[0] = 32
    p = _decimal(p + 1, <unsigned long long>n, e)
    p[0] = 13
    p[1] = 10
    memcpy(p + 2, PyBytes_AS_STRING(body), n)
    p += 2 + n
    p[0] = 13
    p[1] = 10
    return out
