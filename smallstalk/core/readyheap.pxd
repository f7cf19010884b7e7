# The compiled build's declarations (see model.pxd): an entry's parts, which
# the compiled state and read side call as C functions.
cpdef entry_of(pri, id, gen)
cpdef entry_id(entry)
cpdef entry_pri(entry)
cpdef bint entry_has_gen(entry, gen) except -1
