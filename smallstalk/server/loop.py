"""The mutation loop: the one task that changes queue state.

Connection tasks send it whole batches of parsed commands (one channel hop per
received chunk, not per command). Each turn of the loop:

1. takes every item waiting in its inbox (commands, end-of-input, close);
2. runs each session's commands in order through `dispatch`, which logs a
   record per change: the record is appended to the AOF's buffer, *then*
   applied to the state; a reserve with nothing to take parks the session;
3. runs the timers: delayed jobs whose time came (`Promote`), reservations
   whose TTR ran out (`Timeout`), waiting reserves to grant, to time out, or
   to warn with DEADLINE_SOON;
4. commits the AOF once for the whole turn (group commit: one write, at
   most one fsync);
5. only then sends every session its replies, one blob per session.

Under `--fsync always` a turn's replies may wait past the turn: the turn
writes its records, and a turn that answers one connection fsyncs them in
this thread; a busier one hands the fsync to the fsync thread (syncer.py)
and the loop goes on with the next turns meanwhile. Their replies (also of
turns that changed nothing: they may have seen the unsynced records) wait
in `_unsynced`, in order, until the fsync answers (`_watch_syncs`).

If the commit fails, no reply of that turn is sent as a success: every
command of the turn is answered INTERNAL_ERROR, the staged records are
dropped, and the state is rebuilt from the data directory (which holds
exactly what was acknowledged).

Time enters here: `now` is read from the injected clock once per turn and
stamped on every record of the turn.
"""

from __future__ import annotations

import logging
import math
import os
import time
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from pathlib import Path

import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.state import NS, READY, State
from smallstalk.server import dispatch
from smallstalk.server.policy import ConfigError, Policies, load_policies
from smallstalk.storage.aof import FSYNC_ALWAYS
from smallstalk.storage.bodies import PUTS, BodyError, spill_record
from smallstalk.storage.journal import INLINE_SYNC_RECORDS, Journal, JournalError

log = logging.getLogger("smallstalk.server.loop")

RETRY_AFTER_FAILURE = 1.0  # seconds during which mutations are refused after a disk error
# Records whose loss in a crash changes nothing a client was told: a restart
# logs `Restart`, which releases every reservation anyway (beanstalkd does not
# log reserves at all). Under --fsync always the reply to a command that
# logged only these waits for what it reveals (the job's put, see `_job_need`),
# not for the record itself; the next fsync covers it, at the latest LAZY_SYNC
# seconds later.
NEED_NO_SYNC = frozenset({r.Reserve})
LAZY_SYNC = 0.005


class Unavailable(Exception):
    """The AOF cannot take records right now."""


class ReadOnly(Exception):
    """This server does not accept changes from clients (a replica)."""


class Session:
    """One client connection as the loop sees it."""

    __slots__ = (
        "id", "pending", "out", "out_mut", "blocked", "halfclosed", "closing", "producer",
        "worker", "deliver", "wait_deadline", "feed", "view_use", "inflight", "pending_bytes",
        "need",
    )

    def __init__(self, sid: int, deliver: Callable):
        self.id = sid
        self.pending: deque = deque()
        self.out: list[bytes] = []
        self.out_mut: list[bool] = []  # did the command behind each reply log a record?
        self.blocked = False
        self.halfclosed = False
        self.closing = False
        self.producer = False
        self.worker = False
        # deliver(blob, done, close): hands replies to the connection (sync, never
        # blocks); `done` says nothing of what was submitted is left unanswered.
        self.deliver = deliver
        # Backpressure: bytes of commands submitted and not yet run, of which
        # `pending_bytes` are in `pending` (counted until it empties: a waiting
        # reserve holds up everything behind it).
        self.inflight = 0
        self.pending_bytes = 0
        self.wait_deadline = None
        self.feed = None  # a replication feed: the connection streams records instead
        self.view_use: str | None = None  # `use` on a replica: this connection's view only
        # Under --fsync always: the seq that must be durable before its replies
        # so far may go. Never goes down, so its replies leave in order.
        self.need = 0


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


def wall_clock() -> int:
    return time.time_ns()


class MutationLoop:
    def __init__(
        self,
        state: State,
        journal: Journal | None = None,
        data_dir: Path | None = None,
        clock: Callable[[], int] = wall_clock,
        max_job_size: int = p.DEFAULT_MAX_JOB_SIZE,
        min_replica_acks: int = 0,
        replica_ack_timeout: float = 5.0,
    ):
        self.state = state
        self.journal = journal
        self.data_dir = data_dir
        self.clock = clock
        self.max_job_size = max_job_size
        self.now = clock()
        self.started_at = self.now
        self.sessions: dict[int, Session] = {}
        self.counters: dict[str, int] = {}
        self.tube_counters: dict[str, dict[str, int]] = {}  # volatile, per tube
        self.total_connections = 0
        self.draining = False
        self.read_only: str | None = None  # reason, when clients may not change state
        self.instance_id = os.urandom(8).hex()
        self._next_conn = state.next_conn_id
        self._seq = state.last_seq  # used when there is no journal
        self._id_floor = 0  # ids below this were given out (or burned) already
        self._send, self._inbox = trio.open_memory_channel(math.inf)
        self._touched: dict[int, Session] = {}
        self._failed_until = 0.0
        # Replication: feeds to replicas (primary), or what we follow (replica).
        self.role = "primary"
        self.feeds: dict[int, object] = {}  # session id -> replication.Feed
        self.min_replica_acks = min_replica_acks
        self.replica_ack_timeout = replica_ack_timeout
        self._parked: deque[Parked] = deque()
        self._unsynced: deque[Unsynced] = deque()  # turns waiting for the fsync thread
        # Per-session reply needs (Session.need), kept under --fsync always only.
        self._track_needs = False
        # The last seq staged that replies must wait for (not a NEED_NO_SYNC record).
        self._must_sync = state.last_seq
        # What a reserve's reply reveals: puts and kicks not known durable yet.
        # Unsynced puts are the newest jobs, so ids and seqs both ascend.
        self._put_ids: list[int] = []  # highest job id each staged put made
        self._put_seqs: list[int] = []
        self._kick_seq = 0
        self._revealed: int | None = None  # set by staging a NEED_NO_SYNC record
        self._turn_payloads: list[tuple[int, bytes]] = []
        self._turn_seq0 = state.last_seq
        self.follower = None  # replica.Follower, on a replica
        self.promotion_scope: trio.CancelScope | None = None
        # Per-tube policy (limits, expiry, fanout): configuration, reloadable.
        self.policies = Policies()
        self.config_path: Path | None = None
        self.bodies = None  # the read-behind body store (bodies.py), when there is a budget
        self._turn_puts: list = []  # (record, file, body offset) staged this turn, for spilling

    # --- the connection side (called from connection tasks) ----------------------

    def open_session(self, deliver: Callable) -> Session:
        sid = self._next_conn
        self._next_conn += 1
        s = Session(sid, deliver)
        self._send.send_nowait(("open", s))
        return s

    def submit(self, s: Session, events: list, size: int = 0) -> None:
        """Commands for the loop; `size` counts toward the session's backpressure."""
        s.inflight += size
        self._send.send_nowait(("cmds", s, events, size))

    def end_of_input(self, s: Session) -> None:
        self._send.send_nowait(("eof", s))

    def close_session(self, s: Session) -> None:
        self._send.send_nowait(("close", s))

    async def call(self, fn: Callable, *args):
        """Run fn(*args) inside a loop turn (so it may touch state); return its result."""
        done = trio.Event()
        box: list = []
        self._send.send_nowait(("call", (fn, args, box, done)))
        await done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def reload_config(self) -> str | None:
        """Re-read the tube policies from `config_path`; an error message, or None.

        Runs inside a turn (through `call`, or from the admin command): the new
        policies apply from the next decision on; the old ones stay on error.
        """
        if self.config_path is None:
            return "no configuration file (start with --config FILE)"
        try:
            self.policies = load_policies(self.config_path)
        except ConfigError as e:
            log.error("configuration not reloaded: %s", e)
            return str(e)
        log.info("tube policies reloaded from %s", self.config_path)
        return None

    # --- what handlers call -----------------------------------------------------

    def take_job_id(self) -> int:
        job_id = max(self.state.next_job_id, self._id_floor)
        self._id_floor = job_id + 1
        return job_id

    def burn_job_id(self) -> None:
        """Skip an id, as beanstalkd does for a put it refuses after making the job."""
        self.take_job_id()

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def count_tube(self, tube: str, name: str) -> None:
        c = self.tube_counters.setdefault(tube, {})
        c[name] = c.get(name, 0) + 1

    def log(self, cls: type, *fields) -> r.Record:
        """Stage a record in the AOF, then apply it. The reply waits for the commit."""
        if self.read_only:
            raise ReadOnly(self.read_only)
        if self.journal is not None:
            if self._failed_until and trio.current_time() < self._failed_until:
                raise Unavailable("the AOF failed recently")
            rec = cls(self.journal.take_seq(), self.now, *fields)
            self._stage(rec)
        else:
            self._seq += 1
            rec = cls(self._seq, self.now, *fields)
        self.state.apply(rec)
        return rec

    def log_put(self, conn: int, job_id: int, tube: str, pri: int, delay: int, ttr: int,
                body: bytes) -> None:
        """`log(r.Put, ...)` for the everyday put, without making the record
        (a few us of a put's ~20): the same bytes staged, the same state change."""
        j = self.journal
        store = self.bodies
        if j is None or self.read_only or self._failed_until or (store is not None and (
                store.max_memory or self.policies.has_memory_budgets())):
            # The record itself is needed: to spill its body after the commit,
            # or for what `log` checks (no journal, a replica, a failing disk).
            self.log(r.Put, conn, job_id, tube, pri, delay, ttr, body)
            return
        seq = j.take_seq()
        now = self.now
        payload = r.encode_put(seq, now, conn, job_id, tube, pri, delay, ttr, body)
        j.append_payload(payload, seq)
        self._must_sync = seq
        if self._track_needs:
            self._put_ids.append(job_id)
            self._put_seqs.append(seq)
        if self.feeds:
            self._turn_payloads.append((seq, payload))
        self.state.apply_put(seq, now, conn, job_id, tube, pri, delay, ttr, body)

    def _stage(self, rec: r.Record) -> None:
        payload = self.journal.append(rec)
        kind = type(rec)
        if kind in NEED_NO_SYNC and not self.min_replica_acks \
                and self.state.jobs[rec.id].state == READY:
            # (reserve-job out of buried or delayed: losing it would put the job back there)
            self._revealed = self._job_need(rec.id)
        else:
            self._must_sync = rec.seq
            if self._track_needs:
                self._track(rec, kind)
        if self.feeds:
            self._turn_payloads.append((rec.seq, payload))
        if self.bodies is not None and type(rec) in PUTS:
            path, end = self.journal.appended_at()
            self._turn_puts.append((rec, path, end - len(rec.body)))

    def _track(self, rec: r.Record, kind: type) -> None:
        """Remember staged puts and kicks: a reserve's reply waits for them."""
        if kind is r.Put:
            top = rec.id
        elif kind is r.PutJobs and rec.jobs:
            top = rec.jobs[-1][0]
        else:
            if kind is r.Kick:
                self._kick_seq = rec.seq
            return
        self._put_ids.append(top)
        self._put_seqs.append(rec.seq)

    def _job_need(self, job_id: int) -> int:
        """The seq that must be durable before a reply reveals job `job_id`:
        its put, and any unsynced kick (a crash would bury the job again)."""
        ids = self._put_ids
        if not ids or job_id < ids[0]:
            return self._kick_seq  # its put is durable
        i = bisect_left(ids, job_id)
        need = self._put_seqs[i] if i < len(ids) else self._must_sync
        return max(need, self._kick_seq)

    def _forget_durable(self, durable: int) -> None:
        seqs = self._put_seqs
        if seqs and seqs[0] <= durable:
            k = bisect_right(seqs, durable)
            del seqs[:k], self._put_ids[:k]

    def _note_need(self, s: Session, must0: int) -> None:
        """After a command of `s` ran: what its reply waits for. A command
        that logged only a reserve waits for the job it reveals; any other for
        everything staged so far that needs an fsync (what it may have seen)."""
        revealed = self._revealed  # reset before each command (`_run`, `grant_waiters`)
        need = self._must_sync if revealed is None or self._must_sync != must0 else revealed
        if need > s.need:
            s.need = need

    def apply_replicated(self, records: list) -> None:
        """A replica's way in: the primary's records, with the primary's seqs."""
        st = self.state
        for rec in records:
            if rec.seq <= st.last_seq:
                continue  # already here (a resent tail): never apply twice
            if rec.seq != st.last_seq + 1:
                raise ValueError(f"gap in the feed: have {st.last_seq}, got {rec.seq}")
            self.journal.expect_seq(rec.seq)
            self._stage(rec)
            st.apply(rec)

    def use_bodies(self, store) -> None:
        """Read-behind: bodies past `store`'s budget (and the tubes' max-memory) go to disk."""
        self.bodies = store
        store.tube_budget = self._tube_memory
        self.state.bodies = store

    def _tube_memory(self, tube: str) -> int:
        return self.policies.of(tube).max_memory

    def body_of(self, job) -> bytes:
        """A job's body, read back from disk if read-behind keeps it there.

        Raises BodyError if it cannot be read: the command is answered
        INTERNAL_ERROR (see `_run`). After a read, the next body of the
        job's tube is read ahead (a hint to the kernel).
        """
        body = job.body
        if isinstance(body, int):
            data = self.bodies.read(body)
            nxt = self.state.peek_ready(job.tube.name)
            if nxt is not None and nxt is not job and isinstance(nxt.body, int):
                self.bodies.advise(nxt.body)
            return data
        return body

    def _spill(self) -> None:
        """After a commit: bodies of this turn's puts past a memory budget go
        to disk, newest first (their records are in the file now)."""
        puts = self._turn_puts
        self._turn_puts = []
        store, st = self.bodies, self.state
        if not (store.max_memory and st.body_bytes - st.spilled_bytes > store.max_memory) \
                and not self.policies.has_memory_budgets():
            return  # under the server budget, and no tube has one
        keys: dict = {}
        for rec, path, offset in reversed(puts):
            spill_record(store, st, rec, path, offset, keys)

    def volatile(self, cls: type, *fields) -> None:
        self.state.apply(cls(0, self.now, *fields))

    def storage_info(self) -> dict:
        j = self.journal
        if j is None:  # beanstalkd shows its default file size even without -b
            return {"oldest": 0, "current": 0, "migrated": 0, "written": 0,
                    "max_size": 10 << 20}
        closed = j.closed_segments()
        oldest = int(closed[0].stem) if closed else j.segment.first_seq
        return {
            "oldest": oldest, "current": j.segment.first_seq,
            # beanstalkd's count of records copied by its compaction; ours folds
            # into snapshots and copies none.
            "migrated": 0, "written": j.records_written,
            "max_size": j.segment_bytes,
        }

    # --- the loop ----------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        j = self.journal
        if j is None or j.fsync != FSYNC_ALWAYS:
            task_status.started()
            await self._run_turns()
            return
        syncer = j.start_syncer()
        self._track_needs = True
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_syncs, syncer.done_fd)
                task_status.started()
                await self._run_turns()
        finally:
            j.stop_syncer()

    async def _watch_syncs(self, fd: int) -> None:
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                os.eventfd_read(fd)
            except BlockingIOError:
                continue  # answered already (a rotation waited for it)
            self._sync_answered()

    async def _run_turns(self) -> None:
        inbox = self._inbox
        while True:
            wait = self._seconds_to_next_deadline()
            item = None
            if wait is None:
                item = await inbox.receive()
            elif wait > 0:
                with trio.move_on_after(wait):
                    item = await inbox.receive()
            else:
                # A deadline is due now: still let the connections run first
                # (a turn may not await at all: small commits fsync inline).
                await trio.lowlevel.checkpoint()
            batch = [] if item is None else [item]
            while True:
                try:
                    batch.append(inbox.receive_nowait())
                except trio.WouldBlock:
                    break
            await self.turn(batch)

    def _seconds_to_next_deadline(self) -> float | None:
        wait = self._seconds_to_state_deadline()
        if self._parked:
            left = max(self._parked[0].deadline - trio.current_time(), 0.0)
            wait = left if wait is None else min(wait, left)
        if self._unsynced and not self.journal.syncing:
            # Only records that needed no fsync wait: their lazy one is due.
            left = max(self._unsynced[0].at + LAZY_SYNC - trio.current_time(), 0.0)
            wait = left if wait is None else min(wait, left)
        return wait

    def _seconds_to_state_deadline(self) -> float | None:
        now = self.clock()
        deadline = self.state.next_deadline(now)
        if self._failed_until:
            # Timers may not log while the AOF is failing: look again later.
            retry = max(self._failed_until - trio.current_time(), 0.0)
            if deadline is None:
                return retry if retry > 0 else None
            return max((deadline - now) / NS, retry)
        if deadline is None:
            return None
        return max((deadline - now) / NS, 0.0)

    async def turn(self, batch: list) -> None:
        self.now = self.clock()
        self._calls_done: list[tuple[list, trio.Event]] = []
        self._turn_seq0 = self.state.last_seq
        for item in batch:
            kind, s = item[0], item[1]
            if kind == "cmds":
                s.pending.extend(item[2])
                s.pending_bytes += item[3]
                self._run(s)
            elif kind == "open":
                self.sessions[s.id] = s
                self.total_connections += 1
                self.volatile(r.Connect, s.id)
            elif kind == "eof":
                s.halfclosed = True
                if s.blocked:
                    self._answer_wait(s, p.TIMED_OUT)
            elif kind == "close":
                self._close(s)
            elif kind == "call":
                fn, args, box, done = s
                try:
                    box.append(fn(*args))
                except Exception as e:  # handed back to the caller
                    box.append(e)
                self._calls_done.append((box, done))
        self._timers()
        await self._commit_and_reply()

    def _run(self, s: Session) -> None:
        """Run a session's pending commands in order until one blocks."""
        self._touched[s.id] = s
        handlers = dispatch.HANDLERS
        st = self.state
        track = self._track_needs
        while s.pending and not s.blocked and not s.closing:
            cmd = s.pending.popleft()
            seq0 = st.last_seq
            must0 = self._must_sync
            self._revealed = None
            try:
                if self.read_only and type(cmd) in dispatch.MUTATING:
                    raise ReadOnly(self.read_only)
                reply = handlers[type(cmd)](self, s, cmd)
            except Unavailable:
                reply = p.INTERNAL_ERROR
            except ReadOnly:
                reply = p.READ_ONLY
            except BodyError as e:
                log.error("answering INTERNAL_ERROR: %s", e)
                reply = p.INTERNAL_ERROR
            if reply is dispatch.BLOCK:
                s.blocked = True
                s.wait_deadline = st.conns[s.id].wait_deadline
            elif reply is dispatch.CLOSE:
                s.closing = True
                s.pending.clear()
            elif reply is not dispatch.NOREPLY:
                s.out.append(reply)
                s.out_mut.append(st.last_seq != seq0)
            if track:
                self._note_need(s, must0)
        if not s.pending and s.pending_bytes:
            s.inflight -= s.pending_bytes
            s.pending_bytes = 0

    def _answer_wait(self, s: Session, reply: bytes) -> None:
        if self._must_sync > s.need:
            s.need = self._must_sync
        self.volatile(r.WaitStop, s.id)
        s.blocked = False
        s.out.append(reply)
        s.out_mut.append(False)
        self._run(s)

    def _close(self, s: Session) -> None:
        if self.sessions.pop(s.id, None) is None:
            return
        if self.feeds.pop(s.id, None) is not None:
            self._release_parked()
        self._touched.pop(s.id, None)
        if s.blocked:
            self.volatile(r.WaitStop, s.id)
        if self.state.conn_logged(s.id) and not self.read_only:
            try:
                self.log(r.Disconnect, s.id)
                return
            except Unavailable:
                pass  # not logged: the next start's Restart record releases them
        # Seq 0: applied, not logged (the connection left no trace in the log).
        self.state.apply(r.Disconnect(0, self.now, s.id))

    def _timers(self) -> None:
        """Everything that happens because time passed, as records."""
        self._expire_parked()
        if self.read_only or (self._failed_until and trio.current_time() < self._failed_until):
            return
        st = self.state
        now = self.now
        try:
            due = st.due_promotions(now)
            if due:
                self.log(r.Promote, due)
            due = st.due_timeouts(now)
            if due:
                self.log(r.Timeout, due)
            due = st.due_expiries(now)
            if due:
                self.log(r.Expire, self._expiry_moves(due))
            self.grant_waiters()
        except Unavailable:
            return
        for cid, what in st.waiters_due(now):
            s = self.sessions.get(cid)
            if s is not None:
                self._answer_wait(s, p.DEADLINE_SOON if what == b"DEADLINE_SOON" else p.TIMED_OUT)
        self.grant_waiters()

    def _expiry_moves(self, due: list[int]) -> list[tuple[int, str, int]]:
        """Where each expiring job goes (its tube's expire-to, "" = deleted)."""
        moves = []
        for jid in due:
            name = self.state.jobs[jid].tube.name
            to = self.policies.of(name).expire_to
            if to == name:
                to = ""
            age = self.policies.of(to).max_age if to else 0
            moves.append((jid, to, self.now + age * NS if age else 0))
        return moves

    def grant_waiters(self) -> None:
        st = self.state
        while True:
            grant = st.next_grant(self.now)
            if grant is None:
                return
            cid, job = grant
            s = self.sessions.get(cid)
            if s is None:  # cannot happen: closing a session stops its wait
                self.volatile(r.WaitStop, cid)
                continue
            must0 = self._must_sync
            self._revealed = None
            self.log(r.Reserve, cid, job.id)
            if self._track_needs:
                self._note_need(s, must0)
            s.blocked = False
            try:
                s.out.append(p.job_reply(b"RESERVED", job.id, self.body_of(job)))
            except BodyError as e:
                log.error("answering INTERNAL_ERROR: %s", e)
                s.out.append(p.INTERNAL_ERROR)
            s.out_mut.append(True)
            self._run(s)

    async def _commit_and_reply(self) -> None:
        # Grants made possible by this turn's commands (a put for a waiter).
        if not self.read_only and not self._failed_until:
            try:
                self.grant_waiters()
            except Unavailable:
                pass
        j = self.journal
        if j is not None and j.syncer is not None:
            self._commit_in_two_steps()
            return
        committed = False
        if j is not None and j.has_pending():
            try:
                await j.commit()
            except JournalError as e:
                self._failed(e)
                for box, _done in self._calls_done:
                    box[:] = [e]  # what the call staged is not on disk
            else:
                committed = True
                if self._failed_until:
                    self._failed_until = 0.0
                if self._turn_puts:
                    self._spill()
        self._turn_puts = []
        payloads = self._turn_payloads
        if payloads:
            self._turn_payloads = []
            if committed:
                for feed in list(self.feeds.values()):
                    feed.push(payloads)
        for _box, done in self._calls_done:
            done.set()
        self._reply(self._collect(), self.state.last_seq if committed else self._turn_seq0,
                    self._turn_seq0)

    # --- committing under --fsync always ------------------------------------------

    def _commit_in_two_steps(self) -> None:
        """Write the turn's records now; fsync them here (a turn for one
        connection or call: nothing to overlap) or in the fsync thread."""
        j = self.journal
        calls = self._calls_done
        had = j.has_pending()
        try:
            j.write_staged()
        except JournalError as e:
            self._failed(e)
            for box, _done in calls:
                box[:] = [e]
            self._turn_payloads = []
        else:
            if had and self._failed_until:
                self._failed_until = 0.0
            if self._turn_puts:
                self._spill()
        self._turn_puts = []
        written = j.written_seq
        # Never past what is written (after a disk error seqs are taken again).
        deliveries = [(min(d[0].need, written), d) for d in self._collect()]
        need = written if calls else max((n for n, _ in deliveries), default=0)
        now = trio.current_time()
        turn = Unsynced(written, self._turn_seq0, now, self._turn_payloads, calls, deliveries)
        self._turn_payloads = []
        if turn.seq <= j.committed_seq:
            self._synced(turn)  # nothing of it or before it waits for the disk
            return
        self._unsynced.append(turn)
        try:
            if not j.syncing and (need > j.committed_seq
                                  or now - self._unsynced[0].at >= LAZY_SYNC):
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

    def _sync_written(self) -> None:
        """fsync what is written: here if it is little (the thread hand-off
        would cost more than the loop could do meanwhile), else in the thread."""
        j = self.journal
        if j.written_seq - j.committed_seq <= INLINE_SYNC_RECORDS:
            j.sync()
        else:
            j.sync_in_background()

    def _sync_answered(self) -> None:
        j = self.journal
        try:
            j.sync_result()
            if self._unsynced and not j.syncing and self._unsynced[-1].seq > j.committed_seq:
                self._sync_written()  # what the turns wrote meanwhile
        except JournalError as e:
            self._sync_failed(e)
            return
        self._release_synced(j.committed_seq)

    def _release_synced(self, durable: int) -> None:
        self._forget_durable(durable)
        q = self._unsynced
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

    def _sync_failed(self, e: JournalError) -> None:
        """An fsync failed: every turn waiting for one is answered INTERNAL_ERROR
        (the journal has cut their records off) and the state is read back."""
        log.error("AOF fsync failed, answering INTERNAL_ERROR: %s", e)
        self._failed_until = trio.current_time() + RETRY_AFTER_FAILURE
        turns, self._unsynced = self._unsynced, deque()
        for turn in turns:
            for box, done in turn.calls:
                box[:] = [e]
                done.set()
            for _need, (s, out, _mut, done, closing) in turn.deliveries:
                _deliver((s, [p.INTERNAL_ERROR] * len(out), [False] * len(out), done, closing))
        self._reload_state()

    def _collect(self) -> list[tuple]:
        """Take every touched session's replies of this turn, one delivery each."""
        touched = self._touched
        self._touched = {}
        deliveries = []
        for s in touched.values():
            if s.id not in self.sessions or s.feed is not None:
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
                _deliver(delivery)
        if held:
            self._parked.append(Parked(turn_seq, trio.current_time() + self.replica_ack_timeout,
                                       held))
            self._release_parked()

    # --- replication -------------------------------------------------------------

    def acked_seq(self) -> int:
        """The highest seq that at least `min_replica_acks` replicas have on disk."""
        acks = sorted((f.acked for f in self.feeds.values()), reverse=True)
        n = self.min_replica_acks
        return acks[n - 1] if n and len(acks) >= n else 0

    def replica_acked(self, s: Session, seq: int) -> None:
        feed = self.feeds.get(s.id)
        if feed is not None and seq > feed.acked:
            feed.acked = seq
            self._release_parked()

    def _release_parked(self) -> None:
        acked = self.acked_seq()
        while self._parked and self._parked[0].seq <= acked:
            for delivery in self._parked.popleft().deliveries:
                _deliver(delivery)

    def _expire_parked(self) -> None:
        now = trio.current_time()
        while self._parked and self._parked[0].deadline <= now:
            parked = self._parked.popleft()
            log.warning("no replica acknowledged seq %d in %.1fs: answering %s",
                        parked.seq, self.replica_ack_timeout, p.NOT_REPLICATED.strip().decode())
            for s, out, mut, done, closing in parked.deliveries:
                out = [p.NOT_REPLICATED if m else reply for reply, m in zip(out, mut, strict=True)]
                _deliver((s, out, mut, done, closing))

    def _failed(self, e: Exception) -> None:
        """A commit failed: answer the turn with errors and go back to what is on disk."""
        log.error("AOF commit failed, answering INTERNAL_ERROR: %s", e)
        self.journal.discard()
        self._failed_until = trio.current_time() + RETRY_AFTER_FAILURE
        self._turn_payloads = []
        for s in self._touched.values():
            s.out[:] = [p.INTERNAL_ERROR] * len(s.out)
            s.out_mut[:] = [False] * len(s.out)
        self._reload_state()

    def _reload_state(self) -> None:
        """Back to exactly what the data directory holds, after a disk error."""
        from smallstalk.storage.recovery import (
            recover,  # late: recovery is only needed on this path
        )

        old = self.bodies
        self.bodies = old.fresh() if old is not None else None
        self.state = recover(self.data_dir, repair=False, bodies=self.bodies).state
        if old is not None:
            old.close()  # the references of the state we dropped
        # What was staged and not acknowledged is gone, and its seqs come again.
        self._must_sync = self.state.last_seq
        self._put_ids, self._put_seqs, self._kick_seq = [], [], 0
        for s in self.sessions.values():
            s.need = 0
            self.volatile(r.Connect, s.id)
            if s.blocked:
                self.volatile(r.WaitStart, s.id, s.wait_deadline)



def _deliver(delivery: tuple) -> None:
    s, out, _mut, done, closing = delivery
    s.deliver(b"".join(out), done, closing)
