# The compiled build's declarations (see core/model.pxd): the group commit's
# fields, read by the loop's turn and by the handlers through it.
from smallstalk.server.session cimport Session

cdef class GroupCommit:
    cdef dict __dict__
    cdef public object owner, journal, feeds, min_replica_acks, replica_ack_timeout
    cdef public object failed_until, stale, awaiting_acks, unsynced, track_needs, must_sync
    cdef public object put_ids, put_seqs, kick_seq, revealed, turn_payloads, _encoder
    cdef public object turn_seq0, turn_puts, touched, holds, granted
