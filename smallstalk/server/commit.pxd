# The compiled build's declarations (see core/model.pxd): the group commit's
# fields, read by the loop's turn and by the handlers through it.
from smallstalk.server.session cimport Session
from smallstalk.storage.encoder cimport LiveEncoder
from smallstalk.storage.journal cimport Journal

cdef class GroupCommit:
    cdef dict __dict__
    cdef public dict feeds, touched
    cdef public list turn_payloads, granted
    cdef public Journal journal
    cdef public object owner, min_replica_acks, replica_ack_timeout
    cdef public object failed_until, stale, awaiting_acks, unsynced, track_needs, must_sync
    cdef public object put_lows, put_ids, put_seqs, kick_seq, revealed
    cdef public LiveEncoder _encoder
    cdef public object turn_seq0, turn_puts, holds
    # Each turn's start and its replies' collection, from the loop and the
    # commit's own end of a turn: C calls.
    cpdef begin_turn(self, seq0, bint leased)
    cpdef bint finish_turn_now(self, list calls)
    cpdef _committed(self, list calls)
    cpdef _commit_failed(self, list calls, e)
    cpdef _end_turn(self, list calls, committed)
    cpdef list _collect(self, send=*)
    # The everyday records, staged from the loop: C calls.
    cpdef stage_put(self, bytes payload, seq, job_id)
    cpdef stage_job(self, type kind, conn, job_id, now, bint ready)
    cpdef job_need(self, job_id)
