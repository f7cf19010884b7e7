# The compiled build's declaration of its twin's header writer (framehead.pyx),
# which aof.py's SegmentWriter, compiled, calls as a C function.
cpdef bytes head(bytes payload)
