# cython: language_level=3
# distutils: libraries = z
"""The compiled build's header of a segment's frame (aof.py's FRAME): a
payload's length and CRC-32, little-endian, written in C with zlib's crc32.

aof.py is the reference and what the pure build runs: `_FRAME_PACK(n,
crc32(payload))`, two calls from compiled code, the struct's parsing of its
arguments and an int made for the checksum, which cost more than the
checksum itself. `head` returns exactly those bytes, or None for a payload
the header cannot describe (4 GiB or more: the struct's error is then the
caller's to raise). Not built by `pip install`; tools/compile.py builds it
with the compiled modules, and tests/unit/test_aof_frames.py holds both
builds to struct's bytes."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE


cdef extern from "zlib.h":
    unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int len) nogil


cpdef bytes head(bytes payload):
    """FRAME.pack(len(payload), zlib.crc32(payload)), or None."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(payload)
    if n > 0xFFFFFFFF:
        return None
    cdef unsigned long c = crc32(0, <const unsigned char*>PyBytes_AS_STRING(payload),
                                 <unsigned int>n)
    cdef unsigned char out[8]
    out[0] = n & 0xFF
    out[1] = (n >> 8) & 0xFF
    out[2] = (n >> 16) & 0xFF
    out[3] = (n >> 24) & 0xFF
    out[4] = c & 0xFF
    out[5] = (c >> 8) & 0xFF
    out[6] = (c >> 16) & 0xFF
    out[7] = (c >> 24) & 0xFF
    return PyBytes_FromStringAndSize(<char*>out, 8)
