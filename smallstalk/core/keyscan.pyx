# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled build's scan of a keyed put's key: how far a run of key
characters goes, in C.

`core/parser.py`'s `_PUT_UNIQUE_KEY` regex is the reference and what the pure
build runs (`put-unique ` then 1 to 200 of `-A-Za-z0-9+/;.$_()`): compiled,
the regex's call, its match object and `end()` were most of a keyed put's
parse. Not built by `pip install`; tools/compile.py builds it with the
compiled modules, and tests/unit/test_protocol.py holds the parser to the
same events in both builds and tests/unit/test_twins.py the scan to
the regex."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE

cdef enum:
    KEY_MAX = 200  # the regex's {1,200}

# 1 where a byte may be in a key: beanstalkd's tube-name characters.
cdef unsigned char _KEY[256]
cdef bytes _KEY_CHARS = b"-+/;.$_()0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
cdef Py_ssize_t _i
for _i in range(len(_KEY_CHARS)):
    _KEY[<unsigned char>_KEY_CHARS[_i]] = 1


cpdef Py_ssize_t key_end(bytes data, Py_ssize_t start):
    """The end of the key that starts at `start` (at most KEY_MAX bytes, as
    the regex's match takes): `start` itself where no key character is there."""
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t stop = min(PyBytes_GET_SIZE(data), start + KEY_MAX)
    cdef Py_ssize_t i = start
    while i < stop and _KEY[p[i]]:
        i += 1
    return i
