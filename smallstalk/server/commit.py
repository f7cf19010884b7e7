"""Group commit: a turn's records on their way to disk, and the replies that wait for them.

The mutation loop (loop.py) stages every record of a turn here, then calls
`finish_turn` once: one write, at most one fsync, then the replies. Under
`--fsync always` a turn's replies may wait past the turn: the turn writes its
records, and a turn that answers one connection fsyncs them in this thread; a
busier one hands the fsync to the fsync thread (syncer.py) and the loop goes
on with the next turns meanwhile. Their replies (also of turns that changed
nothing: they may have seen the unsynced records) wait in `unsynced`, in
order, until the fsync answers (`watch_syncs`). Each reply waits only for
what it needs (`Session.need`, see `note_need`). With `--min-replica-acks`,
replies of changes are parked until replicas acknowledge them.

If the commit fails, no reply of that turn is sent as a success: every
command of the turn is answered INTERNAL_ERROR, the staged records are
dropped, and the state is rebuilt from the data directory (which holds
exactly what was acknowledged). See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import logging
import os
from bisect import bisect_left, bisect_right
from collections import deque
from typing import TYPE_CHECKING

import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.state import READY
from smallstalk.server.session import Session, deliver, recount
from smallstalk.storage.bodies import PUTS
from smallstalk.storage.journal import INLINE_SYNC_RECORDS, Journal, JournalError

if TYPE_CHECKING:
    from smallstalk.server.loop import MutationLoop

log = logging.getLogger("smallstalk.server.commit")

RETRY_AFTER_FAILURE = 1.0  # seconds during which mutations are refused after a disk error
# Records whose loss in a crash changes nothing a client was told: a restart
# logs `Restart`, which releases every reservation anyway (beanstalkd does not
# log reserves at all). Under --fsync always the reply to a command that
# logged only these waits for what it reveals (the job's put, see `job_need`),
# not for the record itself; the next fsync covers it, at the latest LAZY_SYNC
# seconds later.
NEED_NO_SYNC = frozenset({r.Reserve})
LAZY_SYNC = 0.005


class Unavailable(Exception):
    """The AOF cannot take records right now (it failed recently: `failed_until`)."""


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


class Parked:
    """Replies held until a replica has acknowledged the turn's records."""

    __slots__ = ("seq", "deadline", "deliveries")

    def __init__(self, seq: int, deadline: float, deliveries: list):
        self.seq, self.deadline, self.deliveries = seq, deadline, deliveries


class GroupCommit:
    """The loop's staged records, their commit, and when each reply may go.

    Owned by one MutationLoop (`lp`), which stages into it from its handlers
    and reads `failed_until`, `must_sync` and `revealed` in its inner loops.
    """

    def __init__(self, lp: MutationLoop, journal: Journal | None, min_replica_acks: int = 0,
                 replica_ack_timeout: float = 5.0):
        self.lp = lp
        self.journal = journal
        self.feeds = lp.feeds  # the loop's dict, shared: session id -> replication feed
        self.min_replica_acks = min_replica_acks
        self.replica_ack_timeout = replica_ack_timeout
        self.failed_until = 0.0  # trio time until which the AOF takes no records
        self.stale = False  # the state could not be read back after a failure: no records
        self.parked: deque[Parked] = deque()
        self.unsynced: deque[Unsynced] = deque()  # turns waiting for the fsync thread
        # Per-session reply needs (Session.need), kept under --fsync always only.
        self.track_needs = False
        # The last seq staged that replies must wait for (not a NEED_NO_SYNC record).
        self.must_sync = lp.state.last_seq
        # What a reserve's reply reveals: puts and kicks not known durable yet.
        # Unsynced puts are the newest jobs, so ids and seqs both ascend.
        self.put_ids: list[int] = []  # highest job id each staged put made
        self.put_seqs: list[int] = []
        self.kick_seq = 0
        self.revealed: int | None = None  # set by staging a NEED_NO_SYNC record
        self.turn_payloads: list[tuple[int, bytes]] = []
        self.turn_seq0 = lp.state.last_seq  # the loop sets it as each turn starts
        self.turn_puts: list = []  # (record, file, body offset) staged this turn, for spilling

    # --- staging (per record) -----------------------------------------------------

    def stage(self, rec: r.Record) -> None:
        """Append a record to the AOF's buffer; the loop applies it."""
        payload = self.journal.append(rec)
        kind = type(rec)
        if kind in NEED_NO_SYNC and not self.min_replica_acks \
                and self.lp.state.jobs[rec.id].state == READY:
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
        if kind in PUTS and self.lp.bodies is not None:
            path, end = self.journal.appended_at()
            self.turn_puts.append((rec, path, end - len(rec.body)))

    def _track(self, rec: r.Record, kind: type) -> None:
        """Remember staged puts and kicks: a reserve's reply waits for them."""
        if kind is r.Put:
            top = rec.id
        elif (kind is r.PutJobs or kind is r.PutUnique) and rec.jobs:
            top = rec.jobs[-1][0]
        else:
            if kind is r.Kick:
                self.kick_seq = rec.seq
            return
        self.put_ids.append(top)
        self.put_seqs.append(rec.seq)

    def job_need(self, job_id: int) -> int:
        """The seq that must be durable before a reply reveals job `job_id`:
        its put, and any unsynced kick (a crash would bury the job again)."""
        ids = self.put_ids
        if not ids or job_id < ids[0]:
            return self.kick_seq  # its put is durable
        i = bisect_left(ids, job_id)
        need = self.put_seqs[i] if i < len(ids) else self.must_sync
        return max(need, self.kick_seq)

    def _forget_durable(self, durable: int) -> None:
        seqs = self.put_seqs
        if seqs and seqs[0] <= durable:
            k = bisect_right(seqs, durable)
            del seqs[:k], self.put_ids[:k]

    def note_need(self, s: Session, must0: int) -> None:
        """After a command of `s` ran: what its reply waits for. A command
        that logged only a reserve waits for the job it reveals; any other for
        everything staged so far that needs an fsync (what it may have seen)."""
        revealed = self.revealed  # reset before each command (loop `_run`, `grant_waiters`)
        need = self.must_sync if revealed is None or self.must_sync != must0 else revealed
        if need > s.need:
            s.need = need

    # --- the end of a turn ----------------------------------------------------------

    async def finish_turn(self, calls: list[tuple[list, trio.Event]]) -> None:
        """Commit the turn's records, then send its replies (and end its calls)."""
        j = self.journal
        if j is not None and j.syncer is not None:
            self._commit_in_two_steps(calls)
            return
        committed = False
        if j is not None and j.has_pending():
            try:
                await j.commit()
            except JournalError as e:
                self._failed(e)
                for box, _done in calls:
                    box[:] = [e]  # what the call staged is not on disk
            else:
                committed = True
                if self.failed_until:
                    self.failed_until = 0.0
                if self.turn_puts:
                    self.lp.spill(self.turn_puts)
        self.turn_puts = []
        payloads = self.turn_payloads
        if payloads:
            self.turn_payloads = []
            if committed:
                for feed in list(self.feeds.values()):
                    feed.push(payloads)
        for _box, done in calls:
            done.set()
        self._reply(self._collect(), self.lp.state.last_seq if committed else self.turn_seq0,
                    self.turn_seq0)

    def seconds_to_deadline(self) -> float | None:
        """Until a parked reply times out or a lazy fsync is due, if any waits."""
        wait = None
        if self.parked:
            wait = max(self.parked[0].deadline - trio.current_time(), 0.0)
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
                self.lp.spill(self.turn_puts)
        self.turn_puts = []
        written = j.written_seq
        # Never past what is written (after a disk error seqs are taken again).
        deliveries = [(min(d[0].need, written), d) for d in self._collect()]
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

    async def watch_syncs(self, fd: int) -> None:
        """Take each answer of the fsync thread (its eventfd) as it comes."""
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                os.eventfd_read(fd)
            except BlockingIOError:
                continue  # answered already (a rotation waited for it)
            self._sync_answered()

    def _sync_written(self) -> None:
        """fsync what is written: here if it is little (the thread hand-off
        would cost more than the loop could do meanwhile), else in the thread,
        also when a session's slice left commands for the next turn: a flood
        goes on while the disk syncs."""
        j = self.journal
        if j.written_seq - j.committed_seq <= INLINE_SYNC_RECORDS and not self.lp.runnable:
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

    def _collect(self) -> list[tuple]:
        """Take every touched session's replies of this turn, one delivery each."""
        lp = self.lp
        touched = lp.touched
        lp.touched = {}
        sessions = lp.sessions
        deliveries = []
        order = touched.values()
        if lp.granted:
            first = {s.id: s for s in lp.granted if s.id in touched}
            lp.granted = []
            order = [*first.values(), *(s for s in order if s.id not in first)]
        for s in order:
            if s.id not in sessions or s.feed is not None:
                continue
            done = not s.blocked and not s.pending
            # A session that just started waiting is told so (done=False, maybe
            # no bytes): its connection then watches the socket meanwhile.
            deliveries.append((s, s.out, s.out_mut, done, s.closing))
            s.out, s.out_mut = [], []
        return deliveries

    def _reply(self, deliveries: list[tuple], turn_seq: int, seq0: int) -> None:
        hold = self.min_replica_acks and turn_seq > seq0
        held = []
        for delivery in deliveries:
            if hold and any(delivery[2]):
                held.append(delivery)
            else:
                deliver(delivery)
        if held:
            self.parked.append(Parked(turn_seq, trio.current_time() + self.replica_ack_timeout,
                                      held))
            self.release_parked()

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
            self.release_parked()

    def release_parked(self) -> None:
        acked = self.acked_seq()
        while self.parked and self.parked[0].seq <= acked:
            for delivery in self.parked.popleft().deliveries:
                deliver(delivery)

    def expire_parked(self) -> None:
        now = trio.current_time()
        while self.parked and self.parked[0].deadline <= now:
            parked = self.parked.popleft()
            log.warning("no replica acknowledged seq %d in %.1fs: answering %s",
                        parked.seq, self.replica_ack_timeout, p.NOT_REPLICATED.strip().decode())
            for s, out, mut, done, closing in parked.deliveries:
                was, out = out, [p.NOT_REPLICATED if m else reply
                                 for reply, m in zip(out, mut, strict=True)]
                recount(s, was, out)
                deliver((s, out, mut, done, closing))

    # --- disk errors --------------------------------------------------------------------

    def _failed(self, e: Exception) -> None:
        """A commit failed: answer the turn with errors and go back to what is on disk."""
        log.error("AOF commit failed, answering INTERNAL_ERROR: %s", e)
        self.journal.discard()
        self.failed_until = trio.current_time() + RETRY_AFTER_FAILURE
        self.turn_payloads = []
        for s in self.lp.touched.values():
            errors = [p.INTERNAL_ERROR] * len(s.out)
            recount(s, s.out, errors)
            s.out[:] = errors
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
            for _need, (s, out, _mut, done, closing) in turn.deliveries:
                errors = [p.INTERNAL_ERROR] * len(out)
                recount(s, out, errors)
                deliver((s, errors, [False] * len(out), done, closing))
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
        from smallstalk.storage.recovery import (
            recover,  # late: recovery is only needed on this path
        )

        lp = self.lp
        old = lp.bodies
        lp.bodies = old.fresh() if old is not None else None
        try:
            lp.state = recover(lp.data_dir, repair=False, bodies=lp.bodies).state
        except OSError as e:
            # The disk cannot be read either: no records until it can (reload_if_stale).
            log.error("could not read the state back after a disk error: %s", e)
            if lp.bodies is not None:
                lp.bodies.close()
            lp.bodies = old
            self.stale = True
            return
        self.stale = False
        if old is not None:
            old.close()  # the references of the state we dropped
        # What was staged and not acknowledged is gone, and its seqs come again.
        self.must_sync = lp.state.last_seq
        self.put_ids, self.put_seqs, self.kick_seq = [], [], 0
        for s in lp.sessions.values():
            s.need = 0
            lp.volatile(r.Connect, s.id)
            if s.blocked:
                lp.volatile(r.WaitStart, s.id, s.wait_deadline)
