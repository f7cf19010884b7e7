# The compiled build's declarations of its twin's writers (fixedcbor.pyx),
# which encoder.py's LiveEncoder, compiled, calls as C functions.
cpdef put(code, seq, time, conn, id, tube, pri, delay, ttr, body)
cpdef job(code, seq, time, conn, id)
cpdef put_unique(code, seq, time, conn, tube, key, unique_for, keys_max, id, pri, delay, ttr,
                 body)
