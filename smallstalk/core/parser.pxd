# The compiled build's declarations (see model.pxd): the parser's own fields,
# read by no one else, so compiling it costs nothing at its boundary. The
# everyday commands it makes are extension types (commands.pxd).
cimport cython
from smallstalk.core cimport keyscan, lines
from smallstalk.core.commands cimport Delete, Put, PutUnique

cdef class Parser:
    cdef public object _buf, _mode, _put, _skip, max_job_size, _last, _skip_reply
    cdef public object _last_unique, _exact_cmd
    cdef public bint more, _heard
    cdef public bytes _exact_read
    # The put (and keyed put) a fast path makes, typed (parser.py's annotations are not: see
    # its first line), so its fields are stored in the object; a read as
    # bytes, so its bytes are read in place, and as a char pointer (`raw`), whose
    # slices are made without the slice object and two ints Cython's bytes slice makes.
    @cython.locals(put=Put, keyed=PutUnique, n=Py_ssize_t, stop=Py_ssize_t, end=Py_ssize_t,
                   raw="const char*")
    cpdef take(self, bytes data)
    @cython.locals(same=Put)
    cpdef events(self, Py_ssize_t limit=*)

# The exact lines as whole reads (`take`'s first lookup): a dict the C code
# calls directly, where an untyped global's `.get` is an attribute lookup.
cdef dict _EXACT_READS
