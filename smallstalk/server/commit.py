"""Group commit: a turn's records on their way to disk, and the replies that wait for them.

The mutation loop (loop.py) stages every record of a turn here, then calls
`finish_turn_now` once (and awaits `finish_turn` where that says the commit
may wait): one write, at most one fsync, then the replies. Under
`--fsync always` a turn's replies may wait past the turn: the turn writes its
records, and a turn that answers one connection fsyncs them in this thread; a
busier one hands the fsync to the fsync thread (syncer.py) and the loop goes
on with the next turns meanwhile. Their replies (also of turns that changed
nothing: they may have seen the unsynced records) wait in `unsynced`, in
order, until the fsync answers (`watch_syncs`). Each reply waits only for
what it needs (`Session.need`, see `note_need`). With `--min-replica-acks`,
replies of changes are held until replicas acknowledge them (`AwaitingAcks`).

If the commit fails, no reply of that turn is sent as a success: every
command of the turn is answered INTERNAL_ERROR, the staged records are
dropped, and the state is rebuilt from the data directory (which holds
exactly what was acknowledged). See docs/ARCHITECTURE.md.

The commit is a room below the loop: the loop changes it only through the
named methods here (`begin_turn`, `begin_command`, `stage`, `stage_put`,
`touch`, `granted_first`, `forget`, `finish_turn_now`, ...), and it sees the loop
only through `Owner`, so neither writes the other's fields.
"""

from __future__ import annotations

import logging
import os
from bisect import bisect_left, bisect_right
from collections import deque
from math import inf  # read each turn: a global, not an attribute of `math`, when compiled
from typing import Protocol

import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.state import READY, State
from smallstalk.server.session import OUT_BOUND, Delivery, Session, deliver, recount
from smallstalk.storage.bodies import PUTS
from smallstalk.storage.encoder import LiveEncoder
from smallstalk.storage.journal import INLINE_SYNC_RECORDS, Journal, JournalError

log = logging.getLogger("smallstalk.server.commit")

RETRY_AFTER_FAILURE = 1.0  # seconds during which mutations are refused after a disk error
# Records whose loss in a crash changes nothing a client was told: a restart
# logs `Restart`, which releases every reservation anyway (beanstalkd does not
# log reserves at all). Under --fsync always the reply to a command that
# logged only these waits for what it reveals (the job's put, see `job_need`),
# not for the record itself; the next fsync covers it, at the latest LAZY_SYNC
# seconds later.
NEED_NO_SYNC = frozenset({r.Reserve})
RESERVE = r.Reserve  # (stage_job's test: compiled, a global of this module is one lookup)
LAZY_SYNC = 0.005


class Unavailable(Exception):
    """The AOF cannot take records right now (it failed recently: `failed_until`)."""


class Owner(Protocol):
    """What the commit asks of the loop that owns it (loop.MutationLoop)."""

    state: State
    bodies: object | None  # the read-behind body store, if any
    sessions: dict[int, Session]
    lease_until: float  # HA: no change is acknowledged at or after this trio time

    def spill(self, puts: list) -> None:
        """After a commit: bodies of the turn's puts past a budget go to disk."""

    def has_leftover(self) -> bool:
        """Some session has commands left for the next turn."""

    def reload_from_disk(self) -> bool:
        """After a disk error: serve exactly what the data directory holds.
        False if it cannot be read (the state is unchanged)."""


class Unsynced:
    """A turn whose records are written and not yet fsynced: what waits for it."""

    __slots__ = ("seq", "seq0", "at", "payloads", "calls", "deliveries")

    def __init__(self, seq: int, seq0: int, at: float, payloads: list, calls: list,
                 deliveries: list[tuple[int, tuple]]):
        self.seq, self.seq0 = seq, seq0  # last seq written at its end; last seq before it
        self.at = at  # when it was written (trio time): a lazy fsync comes by LAZY_SYNC
        self.payloads, self.calls = payloads, calls  # wait for the whole turn to be durable
        # (need, delivery) not sent yet: each goes once `need` is durable (Session.need).
        self.deliveries = deliveries


class AwaitingAcks:
    """Replies held until enough replicas have acknowledged the turn's records."""

    __slots__ = ("seq", "deadline", "deliveries")

    def __init__(self, seq: int, deadline: float, deliveries: list):
        self.seq, self.deadline, self.deliveries = seq, deadline, deliveries


class GroupCommit:
    """The loop's staged records, their commit, and when each reply may go.

    Owned by one MutationLoop (`owner`), which stages into it from its
    handlers and reads `failed_until` and `min_replica_acks`.
    """

    def __init__(self, owner: Owner, journal: Journal | None, feeds: dict,
                 min_replica_acks: int = 0, replica_ack_timeout: float = 5.0):
        self.owner = owner
        self.journal = journal
        self.feeds = feeds  # the owner's: session id -> replication feed
        self.min_replica_acks = min_replica_acks
        self.replica_ack_timeout = replica_ack_timeout
        self.failed_until = 0.0  # trio time until which the AOF takes no records
        self.stale = False  # the state could not be read back after a failure: no records
        self.awaiting_acks: deque[AwaitingAcks] = deque()
        self.unsynced: deque[Unsynced] = deque()  # turns waiting for the fsync thread
        # Per-session reply needs (Session.need), kept under --fsync always only.
        self.track_needs = False
        # The last seq staged that replies must wait for (not a NEED_NO_SYNC record).
        self.must_sync = owner.state.last_seq
        # What a reserve's reply reveals: puts and kicks not known durable yet.
        # Staged puts as ascending, disjoint ranges of job ids, put_lows[i] to
        # put_ids[i], and the seq each range waits for (ascending too).
        self.put_lows: list[int] = []
        self.put_ids: list[int] = []
        self.put_seqs: list[int] = []
        self.kick_seq = 0
        self.revealed: int | None = None  # set by staging a NEED_NO_SYNC record
        self.turn_payloads: list[tuple[int, bytes]] = []
        self._encoder = LiveEncoder()  # reserves' and deletes' records
        self.turn_seq0 = owner.state.last_seq  # the last seq before this turn
        self.turn_puts: list = []  # (record, file, body offset) staged this turn, for spilling
        self.touched: dict[int, Session] = {}  # sessions with replies this turn
        # Replies this turn may be held (for replica acks) or refused (past
        # the HA lease): only then is each reply's `Session.out_mut` kept.
        self.holds = False
        # ...of which these were granted a job: their replies go out first (a
        # waiting worker gets its job before the producer hears INSERTED, as
        # in beanstalkd; the hand-off is the latency a user feels).
        self.granted: list[Session] = []

    # --- what the loop tells it, per turn, session and command ------------------------

    def begin_turn(self, seq0, leased) -> None:
        """A turn starts after record `seq0` (an int), under a leader lease or
        not (`leased`, a bool): the loop passes both, which it reads typed."""
        self.turn_seq0 = seq0
        self.holds = bool(self.min_replica_acks) or leased

    def touch(self, s: Session) -> None:
        """`s` may have replies this turn: the turn's end collects them."""
        self.touched[s.id] = s

    def granted_first(self, s: Session) -> None:
        """`s` was granted a job this turn: its replies go out before the others'."""
        self.granted.append(s)

    def forget(self, s: Session) -> None:
        """`s` closed: nothing of it is collected."""
        self.touched.pop(s.id, None)

    def begin_command(self) -> int:
        """Before a command that `note_need` will judge: what must be durable so far."""
        self.revealed = None
        return self.must_sync

    def check_available(self) -> None:
        """Raise Unavailable while the AOF takes no records (a recent disk error)."""
        if self.failed_until and trio.current_time() < self.failed_until \
                or not self.reload_if_stale():
            raise Unavailable("the AOF failed recently")

    def has_timers(self) -> bool:
        """Anything here that time may move (`seconds_to_deadline`)."""
        return bool(self.awaiting_acks or self.unsynced or self.failed_until)

    # --- staging (per record) -----------------------------------------------------

    def stage(self, rec: r.Record) -> None:
        """Append a record to the AOF's buffer; the loop applies it."""
        payload = self.journal.append(rec)
        kind = type(rec)
        if kind in NEED_NO_SYNC and not self.min_replica_acks \
                and self.owner.state.jobs[rec.id].state == READY:
            # (reserve-job out of buried or delayed: losing it would put the job back there)
            self.revealed = self.job_need(rec.id)
        else:
            self.must_sync = rec.seq
            if self.track_needs:
                self._track(rec, kind)
        # Kept with or without feeds: a replica that joins later in this turn, or
        # before this turn's fsync, starts from the durable seq and gets the
        # rest from these pushes (skipping them left a gap in its feed).
        self.turn_payloads.append((rec.seq, payload))
        if kind in PUTS and self.owner.bodies is not None:
            path, end = self.journal.appended_at()
            self.turn_puts.append((rec, path, end - len(rec.body)))

    def stage_put(self, payload: bytes, seq, job_id) -> None:
        """`stage` for the everyday put, already encoded (the loop's
        `LiveEncoder`): the same bytes staged and the same bookkeeping,
        without the record."""
        self.journal.append_payload(payload, seq)
        self.must_sync = seq
        if self.track_needs:  # (a new id: above every staged one)
            self.put_lows.append(job_id)
            self.put_ids.append(job_id)
            self.put_seqs.append(seq)
        self.turn_payloads.append((seq, payload))  # also without feeds: see `stage`

    def stage_job(self, kind: type, conn, job_id, now, ready) -> int:
        """`stage(kind(seq, now, conn, job_id))` of a Reserve or a Delete without
        the record (encoded by this commit's `LiveEncoder`): the same bytes
        staged and the same bookkeeping (`_track` keeps nothing of either).
        `ready`: the job is ready (the loop, holding the state, looks: the
        test `stage` makes of a reserve). Returns the seq taken; the loop
        applies the change (`loop.log_job`)."""
        j = self.journal
        seq = j.take_seq()
        payload = self._encoder.job(kind, seq, now, conn, job_id)
        j.append_payload(payload, seq)
        if kind is RESERVE and ready and not self.min_replica_acks:
            self.revealed = self.job_need(job_id)
        else:
            self.must_sync = seq
        self.turn_payloads.append((seq, payload))  # also without feeds: see `stage`
        return seq

    def _track(self, rec: r.Record, kind: type) -> None:
        """Remember staged puts and kicks: a reserve's reply waits for them."""
        if kind is r.Put:
            low = top = rec.id
        elif (kind is r.PutJobs or kind is r.PutUnique) and rec.jobs:
            low, top = rec.jobs[0][0], rec.jobs[-1][0]
        elif kind is r.Fire and rec.id:
            low = top = rec.id
        else:
            if kind is r.Kick:
                self.kick_seq = rec.seq
            return
        lows, ids, seqs = self.put_lows, self.put_ids, self.put_seqs
        if ids and low <= ids[-1]:
            # A put whose line took its id before a put staged earlier did
            # (dispatch.put_heard): it joins the ranges it reaches into, and
            # they all wait for its seq (a reply that reveals one of their
            # jobs waits a little longer, never less).
            i = bisect_left(ids, low)
            if lows[i] < low:
                low = lows[i]
            if ids[-1] > top:
                top = ids[-1]
            del lows[i:], ids[i:], seqs[i:]
        lows.append(low)
        ids.append(top)
        seqs.append(rec.seq)

    def job_need(self, job_id) -> int:  # unannotated: commit.pxd
        """The seq that must be durable before a reply reveals job `job_id`:
        its put, and any unsynced kick (a crash would bury the job again)."""
        ids = self.put_ids
        if not ids or job_id < self.put_lows[0]:
            return self.kick_seq  # its put is durable
        i = bisect_left(ids, job_id)
        if i == len(ids):
            need = self.must_sync
        elif job_id < self.put_lows[i]:
            return self.kick_seq  # between two staged puts' ranges: durable
        else:
            need = self.put_seqs[i]
        return max(need, self.kick_seq)

    def _forget_durable(self, durable: int) -> None:
        seqs = self.put_seqs
        if seqs and seqs[0] <= durable:
            k = bisect_right(seqs, durable)
            del seqs[:k], self.put_ids[:k], self.put_lows[:k]

    def note_need(self, s: Session, must0: int) -> None:
        """After a command of `s` ran (`must0` from `begin_command`): what its
        reply waits for. A command that logged only a reserve waits for the
        job it reveals; any other for everything staged so far that needs an
        fsync (what it may have seen)."""
        revealed = self.revealed
        need = self.must_sync if revealed is None or self.must_sync != must0 else revealed
        if need > s.need:
            s.need = need

    def note_seen(self, s: Session) -> None:
        """`s`'s next reply ends a wait (or answers a deferred command): it
        may have seen everything staged so far, so it waits for all of it."""
        if self.must_sync > s.need:
            s.need = self.must_sync

    # --- the end of a turn ----------------------------------------------------------

    def finish_turn_now(self, calls: list) -> bool:
        """`finish_turn` where it has nothing to wait for (no records staged,
        no journal, --fsync always's two steps, or a write that no rotation
        follows): done, True. False, having done nothing, where the journal's
        commit may wait (a rotation, an fsync): the loop then awaits
        `finish_turn`. (The loop's turn asks this first: an await costs
        coroutines per turn.) `calls` as `finish_turn`'s, `list` for
        commit.pxd's C signature."""
        j = self.journal
        if j is not None and j.syncer is not None:
            self._commit_in_two_steps(calls)
            return True
        if j is None or not j.has_pending():
            self._end_turn(calls, False)
            return True
        try:
            if not j.commit_now():
                return False
        except JournalError as e:
            self._commit_failed(calls, e)
        else:
            self._committed(calls)
        return True

    async def finish_turn(self, calls: list[tuple[list, trio.Event]]) -> None:
        """The turn's end that `finish_turn_now` declined (records staged, no
        fsync thread): commit them, which may wait, then send the replies (and
        end the calls)."""
        try:
            await self.journal.commit()
        except JournalError as e:
            self._commit_failed(calls, e)
        else:
            self._committed(calls)

    def _committed(self, calls: list) -> None:
        if self.failed_until:
            self.failed_until = 0.0
        if self.turn_puts:
            self.owner.spill(self.turn_puts)
        self._end_turn(calls, True)

    def _commit_failed(self, calls: list, e: JournalError) -> None:
        self._failed(e)
        for box, _done in calls:
            box[:] = [e]  # what the call staged is not on disk
        self._end_turn(calls, False)

    def _end_turn(self, calls: list, committed) -> None:
        """After the commit (`committed`: it wrote records): feed the replicas,
        end the calls, send or hold the replies."""
        self.turn_puts = []
        payloads = self.turn_payloads
        if payloads:
            self.turn_payloads = []
            if committed and self.feeds:  # most turns have no replica: no list to make
                for feed in list(self.feeds.values()):
                    feed.push(payloads)
        for _box, done in calls:
            done.set()
        if not self.min_replica_acks and self.owner.lease_until == inf:
            self._collect(send=True)  # nothing to hold: no Delivery to make
            return
        self._reply(self._collect(), self.owner.state.last_seq if committed else self.turn_seq0,
                    self.turn_seq0)

    def seconds_to_deadline(self) -> float | None:
        """Until a reply held for replicas times out or a lazy fsync is due, if any waits."""
        wait = None
        if self.awaiting_acks:
            wait = max(self.awaiting_acks[0].deadline - trio.current_time(), 0.0)
        if self.unsynced and not self.journal.syncing:
            # Only records that needed no fsync wait: their lazy one is due.
            left = max(self.unsynced[0].at + LAZY_SYNC - trio.current_time(), 0.0)
            wait = left if wait is None else min(wait, left)
        return wait

    # --- committing under --fsync always ------------------------------------------

    def _commit_in_two_steps(self, calls: list[tuple[list, trio.Event]]) -> None:
        """Write the turn's records now; fsync them here (a turn for one
        connection or call: nothing to overlap) or in the fsync thread."""
        j = self.journal
        had = j.has_pending()
        try:
            j.write_staged()
        except JournalError as e:
            self._failed(e)
            for box, _done in calls:
                box[:] = [e]
            self.turn_payloads = []
        else:
            if had and self.failed_until:
                self.failed_until = 0.0
            if self.turn_puts:
                self.owner.spill(self.turn_puts)
        self.turn_puts = []
        written = j.written_seq
        # Never past what is written (after a disk error seqs are taken again).
        deliveries = [(min(d.session.need, written), d) for d in self._collect()]
        need = written if calls else max((n for n, _ in deliveries), default=0)
        now = trio.current_time()
        turn = Unsynced(written, self.turn_seq0, now, self.turn_payloads, calls, deliveries)
        self.turn_payloads = []
        if turn.seq <= j.committed_seq:
            self._synced(turn)  # nothing of it or before it waits for the disk
            return
        self.unsynced.append(turn)
        try:
            if not j.syncing and (need > j.committed_seq
                                  or now - self.unsynced[0].at >= LAZY_SYNC):
                # Replies that wait for nothing unsynced (reserves) go before
                # an inline fsync holds this thread for a disk round trip.
                self._release_synced(j.committed_seq)
                self._sync_written()
            # Else the fsync thread is busy (this turn waits for its answer,
            # then for the fsync that covers it: `_sync_answered`), or no
            # reply of the turn waits for its records (only reserves).
            if j.segment_full():
                j.wait_for_syncs()  # rotation needs the old segment durable
                j.rotate_now()  # before the replies, as `Journal.commit` does
        except JournalError as e:
            self._sync_failed(e)
            return
        self._release_synced(j.committed_seq)

    async def run_fsync_thread(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Under --fsync always: start the fsync thread, commit in two steps
        from now on, and take each of the thread's answers (its eventfd) as
        it comes; the thread stops when this task is cancelled."""
        j = self.journal
        fd = j.start_syncer().done_fd
        self.track_needs = True
        try:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(fd)
                try:
                    os.eventfd_read(fd)
                except BlockingIOError:
                    continue  # answered already (a rotation waited for it)
                self._sync_answered()
        finally:
            j.stop_syncer()

    def _sync_written(self) -> None:
        """fsync what is written: here if it is little (the thread hand-off
        would cost more than the loop could do meanwhile), else in the thread,
        also when a session's slice left commands for the next turn: a flood
        goes on while the disk syncs."""
        j = self.journal
        if j.written_seq - j.committed_seq <= INLINE_SYNC_RECORDS and not self.owner.has_leftover():
            j.sync()
        else:
            j.sync_in_background()

    def _sync_answered(self) -> None:
        j = self.journal
        try:
            j.sync_result()
            if self.unsynced and not j.syncing and self.unsynced[-1].seq > j.committed_seq:
                self._sync_written()  # what the turns wrote meanwhile
        except JournalError as e:
            self._sync_failed(e)
            return
        self._release_synced(j.committed_seq)

    def _release_synced(self, durable: int) -> None:
        self._forget_durable(durable)
        q = self.unsynced
        while q and q[0].seq <= durable:
            self._synced(q.popleft())
        for turn in q:  # replies whose need is durable, in turn order
            ready = [d for need, d in turn.deliveries if need <= durable]
            if ready:
                turn.deliveries = [(n, d) for n, d in turn.deliveries if n > durable]
                self._reply(ready, turn.seq, turn.seq0)

    def _synced(self, turn: Unsynced) -> None:
        if turn.payloads:
            for feed in list(self.feeds.values()):
                feed.push(turn.payloads)
        for _box, done in turn.calls:
            done.set()
        if turn.deliveries:
            self._reply([d for _need, d in turn.deliveries], turn.seq, turn.seq0)

    # --- replies ----------------------------------------------------------------------

    def _collect(self, send=False) -> list[Delivery]:
        """Take every touched session's replies of this turn, one delivery each
        (`send`, a bool: send each at once instead, and return none; left
        unannotated for commit.pxd's C signature)."""
        s: Session  # (compiled: its fields read directly)
        touched, self.touched = self.touched, {}
        sessions = self.owner.sessions
        deliveries = []
        if send and self.holds:  # holding ended within the turn: what it kept goes
            for s in touched.values():
                s.out_mut = []
        order = touched.values()
        if self.granted:
            first = {s.id: s for s in self.granted if s.id in touched}
            self.granted = []
            order = [*first.values(), *[s for s in order if s.id not in first]]
        for s in order:
            if s.id not in sessions or s.feed is not None:
                continue
            done = not s.blocked and not s.pending
            # A session that just started waiting is told so (done=False, maybe
            # no bytes): its connection then watches the socket meanwhile.
            out = s.out
            s.out = []
            if send:  # deliver_replies(s, out, done, s.closing), inlined: once per session
                blob = b"".join(out)
                s.owed -= len(blob)
                if s.held and s.owed <= OUT_BOUND:
                    s.held = False
                    s.resume(s)
                s.deliver(blob, done, s.closing)
            elif self.holds:
                deliveries.append(Delivery(s, out, s.out_mut, done, s.closing))
                s.out_mut = []
            else:
                # Holding began within the turn (a lease taken): what its
                # replies changed was not kept, so each counts as a change.
                deliveries.append(Delivery(s, out, [True] * len(out), done, s.closing))
        return deliveries

    def _reply(self, deliveries: list[Delivery], turn_seq: int, seq0: int) -> None:
        hold = self.min_replica_acks and turn_seq > seq0
        held = []
        leased = self.owner.lease_until != inf
        for d in deliveries:
            if hold and any(d.mut):
                held.append(d)
            else:
                deliver(self._within_lease(d) if leased else d)
        if held:
            self.awaiting_acks.append(AwaitingAcks(
                turn_seq, trio.current_time() + self.replica_ack_timeout, held))
            self.release_acked()

    # --- replica acknowledgements -------------------------------------------------------

    def acked_seq(self) -> int:
        """The highest seq that at least `min_replica_acks` replicas have on disk."""
        acks = sorted((f.acked for f in self.feeds.values()), reverse=True)
        n = self.min_replica_acks
        return acks[n - 1] if n and len(acks) >= n else 0

    def replica_acked(self, s: Session, seq: int) -> None:
        feed = self.feeds.get(s.id)
        if feed is not None and seq > feed.acked:
            feed.acked = seq
            self.release_acked()

    def release_acked(self) -> None:
        """Send the held replies that enough replicas have acknowledged (also
        when a replica left: fewer may now be enough, or none may come)."""
        acked = self.acked_seq()
        q = self.awaiting_acks
        while q and q[0].seq <= acked:
            leased = self.owner.lease_until != inf
            for d in q.popleft().deliveries:
                deliver(self._within_lease(d) if leased else d)

    def _within_lease(self, d: Delivery) -> Delivery:
        """HA fencing: past the leader lease (MutationLoop.hold_lease) no change
        is acknowledged; its reply says INTERNAL_ERROR (logged here, and maybe
        set aside when this server rejoins as a replica: the outcome is unknown).
        Asked per delivery, just before its write: a process paused between the
        check and the write (SIGSTOP, a VM stall) still sends what it decided
        before, so the check stands as close to the write as it can."""
        if not any(d.mut) or trio.current_time() < self.owner.lease_until:
            return d
        return d.answered_instead([p.INTERNAL_ERROR if m else reply
                                   for reply, m in zip(d.out, d.mut, strict=True)])

    def expire_unacked(self) -> None:
        """Answer NOT_REPLICATED for the changes no replica acknowledged in time."""
        now = trio.current_time()
        q = self.awaiting_acks
        while q and q[0].deadline <= now:
            held = q.popleft()
            log.warning("no replica acknowledged seq %d in %.1fs: answering %s",
                        held.seq, self.replica_ack_timeout, p.NOT_REPLICATED.strip().decode())
            for d in held.deliveries:
                deliver(d.answered_instead([p.NOT_REPLICATED if m else reply
                                            for reply, m in zip(d.out, d.mut, strict=True)]))

    # --- disk errors --------------------------------------------------------------------

    def _failed(self, e: Exception) -> None:
        """A commit failed: answer the turn with errors and go back to what is on disk."""
        log.error("AOF commit failed, answering INTERNAL_ERROR: %s", e)
        self.journal.discard()
        self.failed_until = trio.current_time() + RETRY_AFTER_FAILURE
        self.turn_payloads = []
        for s in self.touched.values():
            errors = [p.INTERNAL_ERROR] * len(s.out)
            recount(s, s.out, errors)
            s.out[:] = errors
            if self.holds:
                s.out_mut[:] = [False] * len(s.out)
        self._reload_state()

    def _sync_failed(self, e: JournalError) -> None:
        """An fsync failed: every turn waiting for one is answered INTERNAL_ERROR
        (the journal has cut their records off) and the state is read back."""
        log.error("AOF fsync failed, answering INTERNAL_ERROR: %s", e)
        self.failed_until = trio.current_time() + RETRY_AFTER_FAILURE
        turns, self.unsynced = self.unsynced, deque()
        for turn in turns:
            for box, done in turn.calls:
                box[:] = [e]
                done.set()
            for _need, d in turn.deliveries:
                errors = d.answered_instead([p.INTERNAL_ERROR] * len(d.out))
                deliver(errors._replace(mut=[False] * len(d.out)))
        self._reload_state()

    def reload_if_stale(self) -> bool:
        """Before a record after a failed read-back: read the state back now. False: still failing."""
        if self.stale:
            self._reload_state()
            if self.stale:
                self.failed_until = trio.current_time() + RETRY_AFTER_FAILURE
        return not self.stale

    def _reload_state(self) -> None:
        """Back to exactly what the data directory holds, after a disk error."""
        if not self.owner.reload_from_disk():
            self.stale = True  # no records until it can be read (reload_if_stale)
            return
        self.stale = False
        # What was staged and not acknowledged is gone, and its seqs come again.
        self.must_sync = self.owner.state.last_seq
        self.put_ids, self.put_seqs, self.kick_seq = [], [], 0
        for s in self.owner.sessions.values():
            s.need = 0
