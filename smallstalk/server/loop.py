"""The mutation loop: its turns, one at a time, are the only code that changes queue state.

Connections hand it whole batches of parsed commands (one inbox item per
received chunk, not per command). The poller (poller.py) reads every readable
socket in one pass and then runs the turn for what it read itself
(`end_batch`), so a request/response command costs no wake-up of the loop's
own task; that task runs the turns of everything else (timers, calls,
connections read by their own tasks), and one turn runs at a time. Each turn:

1. takes every item waiting in its inbox (commands, end-of-input, close);
2. runs each session's commands in order through `dispatch`, which logs a
   record per change: the record is staged in the AOF's buffer (commit.py),
   *then* applied to the state; a reserve with nothing to take blocks the session;
3. runs the timers (timers.py): delayed jobs whose time came, reservations
   whose TTR ran out, waiting reserves to grant, to time out, or to warn;
4. commits the AOF once for the whole turn and only then sends every session
   its replies, one blob per session (group commit: `GroupCommit.finish_turn`,
   which also says when replies wait past the turn, and what a disk error does).

Time enters here: `now` is read from the injected clock once per turn and
stamped on every record of the turn. See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from math import inf  # read each turn (see commit.py)
from pathlib import Path

import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.commands import Delete, Put, PutUnique, Reserve
from smallstalk.core.state import READY, State
from smallstalk.server import dispatch, holdback, timers
from smallstalk.server.admin import AdminPolicy
from smallstalk.server.commit import GroupCommit, Unavailable
from smallstalk.server.policy import Policies
from smallstalk.server.roles import Replication, Roles
from smallstalk.server.search import Searches
from smallstalk.server.session import (
    OUT_BOUND,
    SHARED_FROM,
    SLICE_BYTES,
    UNSENT_BUDGET,
    Session,
    turn_share,
)
from smallstalk.server.unsent import Unsent
from smallstalk.storage.aof import FSYNC_ALWAYS
from smallstalk.storage.bodies import BodyError, spill_record
from smallstalk.storage.encoder import LiveEncoder
from smallstalk.storage.journal import Journal

log = logging.getLogger("smallstalk.server.loop")

class ReadOnly(Exception):
    """This server does not accept changes from clients (a replica)."""


wall_clock: Callable[[], int] = time.time_ns  # the loop's clock (tests inject another)


# What a handler may answer instead of reply bytes (module globals: the
# loop's `_run` compares every reply with them).
BLOCK, CLOSE, NOREPLY = dispatch.BLOCK, dispatch.CLOSE, dispatch.NOREPLY
HANDLERS = dispatch.HANDLERS
RESERVE = r.Reserve  # (log_job's test: compiled, a global of this module is one lookup)

# A replica's own sessions take ids far above its primary's connection ids,
# which arrive in the primary's records: sharing one would let a local
# client's `use` or hang-up change (or release the reservations of) the
# primary's connection in the replica's state. Each process takes a range of
# its own up there (REPLICA_RANGE ids from a random start): a promoted
# replica's connections, which go on in its range, must not share ids with
# the local clients of the other replicas either (HA: every member starts as
# a replica, and any may be promoted).
REPLICA_SESSIONS = 1 << 48
REPLICA_RANGE = 1 << 24


class MutationLoop(Roles):
    """The queue state, the sessions, and the turns that change them (see above)."""

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
        # When this server last began taking changes (its start, a promotion,
        # a renewed HA lease): schedule firings due before it were missed by
        # every member, and count as after downtime (schedules.firings).
        self.serving_since = self.now
        self.sessions: dict[int, Session] = {}
        self.counters: dict[str, int] = {}
        self.tube_counters: dict[str, dict[str, int]] = {}  # volatile, per tube
        self.total_connections = 0
        self.refused = 0  # connections turned away past --max-connections
        self.draining = False
        self.read_only: str | None = None  # reason, when clients may not change state
        # HA (replication/ha.py): no change is acknowledged at or after this
        # trio time, the last moment our leader lease is surely ours.
        self.lease_until = inf
        self.instance_id = os.urandom(8).hex()
        self._next_conn = state.next_conn_id
        self._replica_next = REPLICA_SESSIONS + int.from_bytes(os.urandom(3)) * REPLICA_RANGE
        self._seq = state.last_seq  # used when there is no journal
        self._id_floor = 0  # ids below this were given out (or burned) already
        self._encoder = LiveEncoder()  # the everyday puts' records
        # The inbox: what connections hand the loop, taken whole by the next
        # turn. The loop task sleeps in `_wait_for_input` (`_waiter`) until an
        # item comes or a timer is due; while the poller passes over the
        # readable sockets (`batching`), items wake nobody: the poller runs
        # their turn itself when its pass ends (`end_batch`).
        self._inbox: deque = deque()
        self._waiter = None  # the loop task, asleep until input or its deadline
        # That sleep's cancel scope: a poller turn moves its deadline to the
        # next timer instead of waking the task to look (`_alarm_earlier`).
        self._sleep: trio.CancelScope | None = None
        self._waits_turn = False  # it sleeps until a running turn ends
        self._turning = False  # a turn is running (it may await: one at a time)
        self.batching = False
        # Sessions that used up their slice of a turn with commands left: they
        # go on next turn, which starts without waiting for input.
        self.runnable: dict[int, Session] = {}
        self._resume_cb = self._resume  # one bound method for every session
        self.unsent = 0  # reply bytes queued in connections (note_unsent)
        self._unsent = Unsent()  # its log line and the memory a flood leaves
        self.slice_commands, self.slice_bytes = turn_share(0)  # this turn's (turn)
        # Replication: feeds to replicas (primary), or what we follow (replica).
        self.role = "primary"
        self.feeds: dict[int, object] = {}  # session id -> replication.Feed
        self.follower = None  # replication.Follower, on a replica
        self.replication: Replication | None = None  # installed by cli.py
        self.ha = None  # replication.ha.HAMember under --ha-etcd (cli.py; the console reads it)
        # Per-tube policy (limits, expiry, fanout): configuration, reloadable.
        self.policies = Policies()
        # When this server first loaded each schedule (ns): a schedule that
        # never fired fires first after that (schedules.py).
        self.schedules_loaded: dict[str, int] = {}
        self.config_path: Path | None = None
        self.bodies = None  # the read-behind body store (bodies.py), when there is a budget
        self.commit = GroupCommit(self, journal, self.feeds, min_replica_acks,
                                  replica_ack_timeout)
        self.admin = AdminPolicy()  # the admin token and addresses (cli.py sets them)
        self.extended_stats = False  # --extended-stats: stats, stats-tube carry ours too
        # Replies answered later by a timer (a failed `auth`): a heap of
        # (trio time due, session id, session, reply).
        self.deferred: list[tuple[float, int, Session, bytes]] = []
        self.searches = Searches()  # search-jobs, bulk-jobs: a slice per turn (search.py)

    # --- the connection side (called from connection tasks) ----------------------

    def open_session(self, deliver: Callable, peer: str | None = None,
                     transport: str = "local", dialect=None) -> Session:
        """A new connection's session; `peer` and `transport` decide whether it
        may run admin commands without `auth` (server/admin.py); `dialect`:
        another protocol's (Session.dialect)."""
        if self.role == "replica":
            sid = self._replica_next
            self._replica_next = sid + 1
        else:
            sid = self._next_conn
            self._next_conn = sid + 1
        s = Session(sid, deliver, self._resume_cb, peer, transport, dialect)
        s.admin = self.admin.trusts(peer, transport)
        self._post(("open", s))
        return s

    def _post(self, item: tuple) -> None:
        self._inbox.append(item)
        if not self.batching:
            self._wake()

    def _wake(self) -> None:
        task = self._waiter
        if task is not None:
            self._waiter = None
            trio.lowlevel.reschedule(task)

    def note_unsent(self, n: int) -> None:
        """Reply bytes connections queued because their sockets did not take
        them (n > 0), or sent or dropped (n < 0): counted against UNSENT_BUDGET."""
        before = self.unsent
        self.unsent = before + n
        self._unsent.changed(before, before + n, trio.current_time())

    def _resume(self, s: Session) -> None:
        """A held session's replies drained (session.sent): run its commands again."""
        self._post(("run", s))

    def submit(self, s: Session, events: list, size=0) -> None:
        """Commands for the loop; `size` counts toward the session's backpressure."""
        s.inflight += size
        self._inbox.append(("cmds", s, events, size))  # _post, inlined
        if not self.batching:
            self._wake()

    def end_of_input(self, s: Session) -> None:
        self._post(("eof", s))

    def close_session(self, s: Session) -> None:
        self._post(("close", s))

    async def call(self, fn: Callable, *args):
        """Run fn(*args) inside a loop turn (so it may touch state); return its result."""
        done = trio.Event()
        box: list = []
        self._post(("call", (fn, args, box, done)))
        await done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def has_leftover(self) -> bool:
        """Some session used up its slice with commands left (the next turn runs them)."""
        return bool(self.runnable or self.searches.running)

    @property
    def min_replica_acks(self) -> int:
        return self.commit.min_replica_acks

    def replica_acked(self, s: Session, seq: int) -> None:
        """The replica fed on `s`'s connection has `seq` on disk."""
        self.commit.replica_acked(s, seq)

    def replicated(self, seq: int) -> bool:
        """Whether record `seq` is as replicated as --min-replica-acks asks (a
        repeated keyed put may confirm its job only then: dispatch.put_unique)."""
        return not self.commit.min_replica_acks or seq <= self.commit.acked_seq()

    # --- what handlers call -----------------------------------------------------

    def take_job_id(self) -> int:
        job_id, floor = self.state.next_job_id, self._id_floor
        if floor > job_id:  # a comparison: max() costs more, on every put
            job_id = floor
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
        j = self.journal
        if j is not None:
            c = self.commit
            if c.failed_until or c.stale:  # the common case costs no call
                c.check_available()
            rec = cls(j.take_seq(), self.now, *fields)
            c.stage(rec)
        else:
            self._seq += 1
            rec = cls(self._seq, self.now, *fields)
        self.state.apply(rec)
        return rec

    def log_job(self, cls: type, conn, job_id) -> None:  # ints unannotated: roles.pxd
        """`log(cls, conn, job_id)` of a Reserve or Delete, no record made: its
        state change by State.apply_reserve or apply_delete, staged by
        `commit.stage_job` with a journal; `log` itself where it checks."""
        c = self.commit
        if self.journal is None and not self.read_only:
            self._seq += 1
            seq = self._seq
        elif self.read_only or c.failed_until or c.stale:
            self.log(cls, conn, job_id)
            return
        else:
            seq = c.stage_job(cls, conn, job_id, self.now,
                              cls is RESERVE and self.state.jobs[job_id].state == READY)
        if cls is RESERVE:
            self.state.apply_reserve(seq, self.now, conn, job_id)
        else:
            self.state.apply_delete(seq, self.now, conn, job_id)

    def log_put(self, conn, tube: str, pri, delay, ttr, body: bytes) -> int:
        """`log(r.Put, ...)` for the everyday put, with the job id it takes
        (`take_job_id`, inlined), without making the record (the loop's
        `LiveEncoder`): the same bytes staged, the same state change. Returns
        the job's id."""
        st = self.state
        job_id, floor = st.next_job_id, self._id_floor
        if floor > job_id:
            job_id = floor
        self._id_floor = job_id + 1
        j = self.journal
        if j is None and not self.read_only:
            # In memory: nothing to stage; the state change `log` would make.
            self._seq += 1
            st.apply_put(self._seq, self.now, conn, job_id, tube, pri, delay, ttr, body)
            return job_id
        # Through `log`, with its record object: to spill its body after the
        # commit (a memory budget), or for what `log` checks (a replica, a
        # failing disk).
        store = self.bodies
        if self.read_only is not None or self.commit.failed_until or (store is not None and (
                store.max_memory or self.policies.memory_budgets)):
            self.log(r.Put, conn, job_id, tube, pri, delay, ttr, body)
            return job_id
        seq = j.take_seq()
        now = self.now
        payload = self._encoder.put(seq, now, conn, job_id, tube, pri, delay, ttr, body)
        self.commit.stage_put(payload, seq, job_id)
        st.apply_put(seq, now, conn, job_id, tube, pri, delay, ttr, body)
        return job_id

    def log_put_unique(self, conn, tube: str, key: str, unique_for, keys_max, pri, delay,
                       ttr, body: bytes) -> int:  # ints unannotated: roles.pxd
        """`log(r.PutUnique, ...)` for the everyday keyed put (one job in the
        tube put into, nothing dropped, no expiry; the caller found the key
        free), as `log_put` for a put. Returns the job's id."""
        st = self.state
        job_id, floor = st.next_job_id, self._id_floor  # take_job_id(), inlined
        if floor > job_id:
            job_id = floor
        self._id_floor = job_id + 1
        j = self.journal
        if j is None and not self.read_only:
            self._seq += 1
            st.apply_put_unique(self._seq, self.now, conn, tube, key, unique_for, keys_max,
                                job_id, pri, delay, ttr, body)
            return job_id
        store = self.bodies  # through `log`, when log_put would
        if self.read_only is not None or self.commit.failed_until or (store is not None and (
                store.max_memory or self.policies.memory_budgets)):
            self.log(r.PutUnique, conn, tube, key, unique_for, keys_max, ((job_id, tube),),
                     pri, delay, ttr, 0, (), body)
            return job_id
        seq = j.take_seq()
        now = self.now
        payload = self._encoder.put_unique(seq, now, conn, tube, key, unique_for, keys_max,
                                           job_id, pri, delay, ttr, body)
        self.commit.stage_put(payload, seq, job_id)
        st.apply_put_unique(seq, now, conn, tube, key, unique_for, keys_max, job_id, pri, delay,
                            ttr, body)
        return job_id

    def apply_replicated(self, records: list) -> None:
        """A replica's way in: the primary's records, with the primary's seqs."""
        st = self.state
        for rec in records:
            if rec.seq <= st.last_seq:
                continue  # already here (a resent tail): never apply twice
            if rec.seq != st.last_seq + 1:
                raise ValueError(f"gap in the feed: have {st.last_seq}, got {rec.seq}")
            self.journal.expect_seq(rec.seq)
            self.commit.stage(rec)
            st.apply(rec)

    def use_bodies(self, store) -> None:
        """Read-behind: bodies past `store`'s budget (and the tubes' max-memory) go to disk."""
        self.bodies = store
        store.tube_budget = self._tube_memory
        self.state.on_body_dropped = store.drop

    def _tube_memory(self, tube: str) -> int:
        return self.policies.of(tube).max_memory

    def peer_of(self, cid: int) -> str | None:
        """Connection `cid`'s address as it connected ("unix" or "local" without one)."""
        s = self.sessions.get(cid)
        return None if s is None else (s.peer or s.transport)

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

    def spill(self, puts: list) -> None:
        """After a commit: bodies of the turn's `puts` (GroupCommit.turn_puts) past
        a memory budget go to disk, newest first (their records are in the file now)."""
        store, st = self.bodies, self.state
        if not (store.max_memory and st.body_bytes - st.spilled_bytes > store.max_memory) \
                and not self.policies.memory_budgets:
            return  # under the server budget, and no tube has one
        keys: dict = {}
        for rec, path, offset in reversed(puts):
            spill_record(store, st, rec, path, offset, keys)

    def volatile(self, cls: type, *fields) -> None:
        self.state.apply(cls(0, self.now, *fields))

    # --- the loop ----------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        j = self.journal
        if j is None or j.fsync != FSYNC_ALWAYS:
            task_status.started()
            await self._run_turns()
            return
        async with trio.open_nursery() as nursery:
            await nursery.start(self.commit.run_fsync_thread)
            task_status.started()
            await self._run_turns()

    async def _run_turns(self) -> None:
        inbox = self._inbox
        while True:
            if self._turning:
                # The poller's turn awaits (a rotation, an fsync in a thread):
                # its end wakes this task.
                await self._wait_for_input(None)
                continue
            # (`searches.running`, a dict: its truth is a C check, where any
            # method of the interpreted Searches would be a Python call a turn.)
            wait = 0 if self.runnable or self.searches.running \
                else timers.seconds_to_next_deadline(self)
            if not inbox and wait != 0:
                await self._wait_for_input(wait)
            else:
                # Input waits, a deadline is due now, or a session has commands
                # left: still let the connections run first (a turn may not
                # await at all: small commits fsync inline).
                await trio.lowlevel.checkpoint()
            if not self._turning:
                await self._turn_on_inbox()

    # --- the poller's pass (server/poller.py) -----------------------------------

    def begin_batch(self) -> None:
        """The poller starts a pass over the readable sockets: what they hand
        the loop wakes nobody until `end_batch`."""
        self.batching = True

    async def end_batch(self) -> None:
        """The poller's pass ended: run the turn for what it read, in the
        poller's task (a wake-up of the loop task saved per pass). The loop
        task still runs the turns of everything else, one turn at a time.
        The poller calls its two halves, `end_batch_now` and, where that
        hands back a turn, `end_batch_wait`: most passes then cost no coroutine."""
        waiting = self.end_batch_now()
        if waiting is not None:
            await self.end_batch_wait(waiting)

    def end_batch_now(self) -> tuple | None:
        """`end_batch` where its turn need not wait: None, done. Else the
        turn, run up to a commit that must wait: the caller passes it to
        `end_batch_wait`, which ends it."""
        self.batching = False
        if self._turning:
            return None  # the running turn's end wakes the loop task for this input
        if not self._inbox:
            return None
        tops = timers.heap_tops(self.state)
        calls = self._turn_on_inbox_now()
        if calls is not None:
            return calls, tops
        self._alarm_earlier(tops)
        return None

    async def end_batch_wait(self, waiting: tuple) -> None:
        """End the turn `end_batch_now` handed back: its commit, then the alarm."""
        calls, tops = waiting
        await self._finish_turn(calls)
        self._alarm_earlier(tops)

    def _alarm_earlier(self, tops) -> None:
        """The loop task sleeps until the next timer as it was before this
        turn (`tops`): if the turn made an earlier one (a delay, a TTR, a lazy
        fsync), move its alarm there, without a task switch. A later one is
        left alone: moving a deadline costs trio more than the rare early
        wake-up, which finds nothing due and sleeps again."""
        sleep = self._sleep
        if sleep is not None and not self._waits_turn and timers.maybe_earlier(self, tops):
            wait = timers.seconds_to_next_deadline(self)
            if wait is not None:
                at = trio.current_time() + wait
                if at < sleep.deadline:
                    sleep.deadline = at

    async def _turn_on_inbox(self) -> None:
        calls = self._turn_on_inbox_now()
        if calls is not None:
            await self._finish_turn(calls)

    def _turn_on_inbox_now(self) -> list | None:
        """The turn of what the inbox holds: None, ended; or its calls, the
        turn run up to a commit that must wait (`_finish_turn` ends it)."""
        inbox = self._inbox
        batch = list(inbox)
        inbox.clear()
        self._turning = True
        calls = None
        try:
            calls = self.turn(batch)
        finally:
            if calls is None:
                self._turn_ended()
        return calls

    async def _finish_turn(self, calls: list) -> None:
        try:
            await self.commit.finish_turn(calls)
        finally:
            self._turn_ended()

    def _turn_ended(self) -> None:
        self._turning = False
        if self._inbox or self.runnable or self.searches.running or self._waits_turn:
            self._wake()  # what came while the turn awaited, a slice left over

    async def _wait_for_input(self, wait: float | None) -> None:
        """Sleep until `_post` wakes the loop task or `wait` seconds pass
        (None: no timer; while a turn runs elsewhere, until it ends)."""
        self._waiter = trio.lowlevel.current_task()
        self._waits_turn = self._turning
        deadline = inf if wait is None else trio.current_time() + wait
        try:
            with trio.CancelScope(deadline=deadline) as self._sleep:
                await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
        finally:
            self._sleep = None
            self._waits_turn = False

    def _abort_wait(self, _raise_cancel) -> trio.lowlevel.Abort:
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def turn(self, batch: list) -> list | None:
        """One turn over `batch` (and the sessions left runnable), ended where
        its commit need not wait: None. Else its calls: the caller awaits
        `commit.finish_turn(calls)` (`_finish_turn`), which ends it."""
        self.now = self.clock()
        leased = self.lease_until != inf
        if leased and not self.read_only and trio.current_time() >= self.lease_until:
            self.fence("ha: the leader lease ran out")  # e.g. after a pause of the process
        c = self.commit
        calls: list[tuple[list, trio.Event]] = []
        c.begin_turn(self.state.last_seq, leased)
        # Each session runs at most one slice per turn: those left over from
        # the last turn run after the batch, not also in it.
        runnable, self.runnable = self.runnable, {}
        busy = len(runnable) + len(batch)
        if busy > SHARED_FROM or self.slice_bytes != SLICE_BYTES:  # most turns: neither
            self.slice_commands, self.slice_bytes = turn_share(busy)
        s: Session  # (compiled: its fields read directly)
        for item in batch:
            kind = item[0]
            if kind == "call":
                fn, args, box, done = item[1]
                try:
                    box.append(fn(*args))
                except Exception as e:  # handed back to the caller
                    box.append(e)
                calls.append((box, done))
                continue
            s = item[1]
            if kind == "cmds":
                if s.pending:
                    s.pending.extend(item[2])
                else:
                    s.pending = item[2]  # the parser's list, the session's from here on
                s.pending_bytes += item[3]
                if s.id not in runnable:
                    self._run(s)
            elif kind == "run":
                if s.id not in runnable and s.id in self.sessions:
                    self._run(s)
            elif kind == "open":
                self.sessions[s.id] = s
                self.total_connections += 1
                self.volatile(r.Connect, s.id)
            elif kind == "eof":
                s.halfclosed = True
                if s.blocked and not s.deferred:
                    self.answer_wait(s, p.TIMED_OUT)
            elif kind == "close":
                self._close(s)
        sessions = self.sessions
        for s in runnable.values():
            if s.id in sessions:
                self._run(s)
        if self.searches.running:
            self.searches.run(self)
        timers.run(self)
        # Grants made possible by this turn's commands (a put for a waiter).
        if self.state.waiting_n and not self.read_only and not c.failed_until:
            try:
                self.grant_waiters()
            except Unavailable:
                pass
        return None if c.finish_turn_now(calls) else calls

    def _run(self, s: Session) -> None:
        """Run a session's pending commands in order until one blocks, its
        slice of the turn is used up, or too many of its replies are unsent."""
        c = self.commit
        c.touched[s.id] = s  # c.touch(s), inlined
        handlers = HANDLERS
        st = self.state
        track = c.track_needs
        holds = c.holds
        owed = s.owed
        # Stop past OUT_BOUND unsent, or past this turn's slice: checked
        # before each command, so one reply of any size may go over. Past
        # the budget of all sessions' unsent replies, once its replies are
        # all out (session.UNSENT_BUDGET says why).
        if self.unsent <= UNSENT_BUDGET:
            bound = OUT_BOUND
            share = self.slice_bytes
            limit = owed + share if owed < OUT_BOUND - share else OUT_BOUND  # (no min())
        else:
            bound = limit = 0
        # A list read from the front: most often it holds one command, and a
        # deque of it would cost more than the command's whole dispatch.
        pending = s.pending  # cleared in place on quit, never replaced while this runs
        i = 0
        end = self.slice_commands
        if len(pending) < end:
            end = len(pending)
        while i < end and not s.blocked and not s.closing and owed <= limit:
            cmd = pending[i]
            i += 1
            if holds:
                seq0 = st.last_seq
            if track:
                must0 = c.begin_command()
            try:
                if self.read_only and type(cmd) in dispatch.MUTATING:
                    raise ReadOnly(self.read_only)
                kind = type(cmd)
                # The everyday four called by name: compiled, a C call
                # instead of a call through the table.
                if kind is Put:
                    reply = dispatch.put(self, s, cmd)
                elif kind is Delete:
                    reply = dispatch.delete(self, s, cmd)
                elif kind is Reserve:
                    reply = dispatch.reserve(self, s, cmd)
                elif kind is PutUnique:
                    reply = dispatch.put_unique(self, s, cmd)
                else:
                    reply = handlers[kind](self, s, cmd)
            except Unavailable:
                reply = p.INTERNAL_ERROR
            except ReadOnly:
                reply = p.READ_ONLY
            except BodyError as e:
                log.error("answering INTERNAL_ERROR: %s", e)
                reply = p.INTERNAL_ERROR
            if reply is BLOCK:
                s.blocked = True
                s.wait_deadline = st.conns[s.id].wait_deadline
            elif reply is CLOSE:
                s.closing = True
                s.pending.clear()
            elif reply is not NOREPLY:
                s.out.append(reply)
                if holds:
                    s.out_mut.append(st.last_seq != seq0)
                owed += len(reply)
            if track:
                c.note_need(s, must0)
        s.owed = owed
        if len(pending) > i:
            del pending[:i]  # (a slice's run ends at most SLICE_COMMANDS in)
            if not s.blocked and not s.closing:
                if owed > bound:
                    s.held = True  # session.sent resumes it once the socket took enough
                else:
                    self.runnable[s.id] = s
        else:
            if s.pending_bytes:
                s.inflight -= s.pending_bytes
                s.pending_bytes = 0
            s.pending = ()

    def _answer(self, s: Session, reply: bytes, logged: bool = False) -> None:
        """End `s`'s wait (a reserve, a deferred reply) with `reply`, queued
        and counted like any reply (`logged`: its command logged a record),
        and run the commands the wait held up."""
        s.blocked = False
        s.out.append(reply)
        if self.commit.holds:
            s.out_mut.append(logged)
        s.owed += len(reply)
        self._run(s)

    def answer_wait(self, s: Session, reply: bytes) -> None:
        """End the wait of `s`'s reserve with `reply` (TIMED_OUT, DEADLINE_SOON)."""
        self.commit.note_seen(s)
        self.volatile(r.WaitStop, s.id)
        s.batch = 0
        if s.dialect is not None:
            reply = s.dialect.wait_ended(reply)
        self._answer(s, reply)

    def answer_later(self, s: Session, reply: bytes, seconds: float) -> None:
        """Answer `s` with `reply` after `seconds` (timers.py), running nothing
        of it meanwhile; the loop goes on with everyone else."""
        s.blocked = s.deferred = True
        heapq.heappush(self.deferred, (trio.current_time() + seconds, s.id, s, reply))

    def answer_deferred(self, s: Session, reply: bytes, logged: bool = False) -> None:
        """The time of a reply `answer_later` (or a search) held came: send it."""
        s.deferred = False
        if self.sessions.get(s.id) is not s:
            s.blocked = False
            return  # the connection closed meanwhile
        self.commit.note_seen(s)
        self._answer(s, reply, logged)

    def _close(self, s: Session) -> None:
        if self.sessions.pop(s.id, None) is None:
            return
        if self.feeds.pop(s.id, None) is not None:
            self.commit.release_acked()
        self.commit.forget(s)
        self.runnable.pop(s.id, None)
        self.searches.drop(s.id)
        if s.blocked:
            self.volatile(r.WaitStop, s.id)
        if self.state.conn_logged(s.id) and not self.read_only:
            try:
                holdback.before_disconnect(self, s.id)
                self.log(r.Disconnect, s.id)
                return
            except Unavailable:
                pass  # not logged: the next start's Restart record releases them
        # Seq 0: applied, not logged (the connection left no trace in the log).
        self.state.apply(r.Disconnect(0, self.now, s.id))

    def grant_waiters(self) -> None:
        st = self.state
        c = self.commit
        while True:
            grant = st.next_grant(self.now)
            if grant is None:
                return
            cid, job = grant
            s = self.sessions.get(cid)
            if s is None:  # cannot happen: closing a session stops its wait
                self.volatile(r.WaitStop, cid)
                continue
            must0 = c.begin_command()
            if s.dialect is not None:
                # Another protocol's wait: it takes the job its own way (its
                # records end the wait) and answers in its own words.
                reply = s.dialect.granted(self, s, job)
            else:
                try:
                    if s.batch:
                        reply, s.batch = dispatch.batch_reply(self, cid, job, s.batch), 0
                    else:
                        reply = dispatch.hand_out(self, cid, job)
                except BodyError as e:
                    log.error("answering INTERNAL_ERROR: %s", e)
                    reply = p.INTERNAL_ERROR
            if c.track_needs:
                c.note_need(s, must0)
            c.granted_first(s)
            self._answer(s, reply, logged=True)

