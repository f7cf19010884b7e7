# The compiled build's key scan (keyscan.pyx), which core/parser.py,
# compiled, calls as a C function.
cpdef Py_ssize_t key_end(bytes data, Py_ssize_t start)
