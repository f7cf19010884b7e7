# The compiled build's INSERTED and RESERVED writers (jobreply.pyx), which
# server/dispatch.py, compiled, calls as C functions.
cpdef bytes inserted(unsigned long long job_id)
cpdef bytes reserved(unsigned long long job_id, bytes body)
