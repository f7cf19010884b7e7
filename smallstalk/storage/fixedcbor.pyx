# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled build's writer of the everyday records' CBOR: a put, a
reserve or delete, a keyed put, written byte by byte into one buffer.

`storage/encoder.py` is the reference and what the pure build runs (cbor2's
encoder: a hand-written one is twice as slow interpreted). Compiled, cbor2's
per-item type dispatch and the reused buffer's method calls are most of a
record's encoding, and this writer does without both. Each function returns
exactly `cbor2.dumps` of the record's list, or None for what it does not
write (an int outside 0..2**64-1, a spilled body's int, a text that is not
ASCII or longer than a tube name may be): the caller then encodes with cbor2.
Not built by `pip install`; tools/compile.py builds it with the compiled
modules, and tests/unit/test_put_fastpath.py holds both builds to cbor2."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.string cimport memcpy


cdef extern from "Python.h":
    # CPython's macros over a str's compact storage (every str made since 3.3).
    bint PyUnicode_IS_ASCII(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    void* PyUnicode_DATA(object o)

# What comes before a body: at most 13 heads of at most 9 bytes and two
# texts of at most MAX_TEXT bytes (a tube name is at most 200).
cdef enum:
    MAX_TEXT = 255
    HEAD_ROOM = 13 * 9 + 2 * MAX_TEXT

# One buffer for every caller: each call holds the GIL from start to end (it
# runs no Python code and allocates only bytes, which start no collection),
# so no other thread can write here in the middle of it.
cdef unsigned char _buf[HEAD_ROOM]


cdef inline Py_ssize_t _head(Py_ssize_t i, unsigned char major,
                             unsigned long long n) noexcept:
    """CBOR's head of major type `major` and argument n at _buf[i]; the next index."""
    cdef int k
    if n < 24:
        _buf[i] = major | <unsigned char>n
        return i + 1
    if n < 0x100:
        _buf[i] = major | 24
        _buf[i + 1] = <unsigned char>n
        return i + 2
    if n < 0x10000:
        _buf[i] = major | 25
        _buf[i + 1] = <unsigned char>(n >> 8)
        _buf[i + 2] = <unsigned char>n
        return i + 3
    if n < 0x100000000:
        _buf[i] = major | 26
        for k in range(4):
            _buf[i + 1 + k] = <unsigned char>(n >> (24 - 8 * k))
        return i + 5
    _buf[i] = major | 27
    for k in range(8):
        _buf[i + 1 + k] = <unsigned char>(n >> (56 - 8 * k))
    return i + 9


cdef inline Py_ssize_t _heads(Py_ssize_t i, unsigned long long* n, int start,
                              int stop) noexcept:
    """The unsigned ints n[start:stop] at _buf[i]; the next index."""
    cdef int k
    for k in range(start, stop):
        i = _head(i, 0, n[k])
    return i


cdef inline Py_ssize_t _text(Py_ssize_t i, str t) noexcept:
    """An ASCII text (checked by the caller: `_writable`) at _buf[i]; the next
    index. An ASCII str's characters are its UTF-8 bytes, one each."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(t)
    i = _head(i, 0x60, n)
    memcpy(&_buf[i], PyUnicode_DATA(t), n)
    return i + n


cdef inline bytes _with_body(Py_ssize_t i, bytes body):
    """_buf[:i] then the body's head and bytes, as one bytes object."""
    cdef Py_ssize_t n = len(body)
    i = _head(i, 0x40, n)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, i + n)
    cdef char* p = PyBytes_AS_STRING(out)
    memcpy(p, _buf, i)
    memcpy(p + i, PyBytes_AS_STRING(body), n)
    return out


cdef inline bint _writable(object s) noexcept:
    """Is s an ASCII str a buffer's text has room for? (C macros: `isascii`
    and `encode` were a method call and a bytes object each.)"""
    return (type(s) is str and PyUnicode_IS_ASCII(s)
            and PyUnicode_GET_LENGTH(s) <= MAX_TEXT)


cpdef put(code, seq, time, conn, id, tube, pri, delay, ttr, body):
    """cbor2.dumps([code, seq, time, conn, id, tube, pri, delay, ttr, body]), or None."""
    cdef unsigned long long n[9]
    if not (type(code) is int and type(seq) is int and type(time) is int
            and type(conn) is int and type(id) is int and type(pri) is int
            and type(delay) is int and type(ttr) is int and type(body) is bytes):
        return None
    try:  # a negative int or one past 64 bits raises, and cbor2 writes it
        n[0] = code; n[1] = seq; n[2] = time; n[3] = conn; n[4] = id
        n[5] = pri; n[6] = delay; n[7] = ttr
    except OverflowError:
        return None
    if not _writable(tube):
        return None
    _buf[0] = 0x8A  # an array of 10
    return _with_body(_heads(_text(_heads(1, n, 0, 5), <str>tube), n, 5, 8), body)


cpdef job(code, seq, time, conn, id):
    """cbor2.dumps([code, seq, time, conn, id]), or None."""
    cdef unsigned long long n[5]
    if not (type(code) is int and type(seq) is int and type(time) is int
            and type(conn) is int and type(id) is int):
        return None
    try:
        n[0] = code; n[1] = seq; n[2] = time; n[3] = conn; n[4] = id
    except OverflowError:
        return None
    _buf[0] = 0x85  # an array of 5
    return PyBytes_FromStringAndSize(<char*>_buf, _heads(1, n, 0, 5))


cpdef put_unique(code, seq, time, conn, tube, key, unique_for, keys_max, id, pri, delay, ttr,
               body):
    """cbor2.dumps([code, seq, time, conn, tube, key, unique_for, keys_max, id, pri,
    delay, ttr, body]), or None."""
    cdef unsigned long long n[10]
    if not (type(code) is int and type(seq) is int and type(time) is int
            and type(conn) is int and type(unique_for) is int and type(keys_max) is int
            and type(id) is int and type(pri) is int and type(delay) is int
            and type(ttr) is int and type(body) is bytes):
        return None
    try:
        n[0] = code; n[1] = seq; n[2] = time; n[3] = conn; n[4] = unique_for
        n[5] = keys_max; n[6] = id; n[7] = pri; n[8] = delay; n[9] = ttr
    except OverflowError:
        return None
    if not (_writable(tube) and _writable(key)):
        return None
    _buf[0] = 0x8D  # an array of 13
    return _with_body(_heads(_text(_text(_heads(1, n, 0, 4), <str>tube), <str>key), n, 4, 10),
                      body)
