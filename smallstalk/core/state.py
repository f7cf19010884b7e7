"""The queue state machine: tubes, jobs, reservations and waiting reservers.

Pure and synchronous: no trio, no sockets, no clock. `apply(record)` is the only
way to change it, and time enters only through the records' `time` field, so
the same records in the same order always give the same state. The query
methods (`best_ready`, `next_grant`, `due_*`) read it and take the
current time as an argument where an answer depends on it.

Invariants (checked by `check()` in tests):
- every job is in exactly one of ready, delayed, reserved, buried, and the
  counters of its tube and of the whole state agree with the contents;
- a reserved job is in its reserver's `reserved` set and nowhere else;
- a tube exists while it is "default", holds a job, or a connection uses or
  watches it (beanstalkd's reference counting); tube order follows
  beanstalkd's array with swap-removal, which `list-tubes` shows.

Heaps hold `(key, id, gen)` entries and are cleaned lazily: an entry is live
only while the job still has that `gen`, which every state change bumps.

Big tubes: a job's `body` is bytes, or an int reference that the mutation
loop put there after the body reached the AOF (`spill`): read-behind keeps
memory bounded. The state never reads a body; it only keeps the byte counts
(`bytes_n`, `spilled_n`) and calls `on_body_dropped(ref)` when a spilled
job goes, so the body store (which lives beside the state, never in it) can
close files nobody refers to. A reference's low 32 bits are the body's length.

The state is cut in four: its parts (model.py), the moves records are made
of (moves.py), the queries (queries.py), and here the records themselves.
Its snapshot codec is storage/snapshot_codec.py, its stats data stats.py.

Fanout: a tube named `parent+child` is registered as a copy target of
`parent` when it comes into existence, and stays registered (even while the
tube itself is dropped for lack of references) until a DeleteTube record.
"""

from __future__ import annotations

from collections import deque
from heapq import heapify, heappush

from smallstalk.core import readyheap
from smallstalk.core import records as r
from smallstalk.core.model import (
    BURIED,
    DEFAULT_TUBE,
    DELAYED,
    M32,
    NS,
    READY,
    RESERVED,
    URGENT_THRESHOLD,
    ZERO_COUNTS,
    Conn,
    Job,
    Limit,
    ReadyHeap,
    StateError,
    Tube,
    body_len,
    fanout_parent,
    share,
    swap_remove,
)
from smallstalk.core.moves import Moves

# Which build runs: the pure-Python reference (what `pip install` gives), or
# the extension modules tools/compile.py makes (`make compiled`), this one among them.
BUILD = "pure Python" if __file__.endswith(".py") else "compiled"

# The names callers import from here: the state and what its answers are made of.
# (Job, Tube and Conn come from model.py: in the compiled build they are
# types this module declares, not names it holds.)
__all__ = [
    "BUILD", "BURIED", "DEFAULT_TUBE", "DELAYED", "NS", "READY", "RESERVED",
    "URGENT_THRESHOLD", "State", "StateError", "body_len",
]


class State(Moves):
    """The queue state: `apply` a record to change it (the moves it is made of
    are moves.py's), ask it through the queries (queries.py)."""

    def __init__(self) -> None:
        super().__init__()
        self._apply = {
            r.Put: self._put, r.Reserve: self._reserve, r.Delete: self._delete,
            r.Release: self._release, r.Bury: self._bury, r.Touch: self._touch,
            r.Kick: self._kick, r.Use: self._use, r.Watch: self._watch,
            r.Ignore: self._ignore, r.PauseTube: self._pause, r.Disconnect: self._disconnect,
            r.Promote: self._promote, r.Timeout: self._timeout, r.Restart: self._restart,
            r.NewEpoch: self._new_epoch, r.PutJobs: self._put_jobs, r.Expire: self._expire,
            r.DeleteTube: self._delete_tube, r.FlushTube: self._flush_tube,
            r.PutUnique: self._put_unique,
            r.Requeue: self._requeue, r.Limits: self._limits, r.Fire: self._fire,
            r.Move: self._move, r.Connect: self._connect, r.WaitStart: self._wait_start, r.WaitStop: self._wait_stop,
        }

    def apply(self, rec: r.Record) -> None:
        """Change the state by one record. Raises StateError if it cannot apply."""
        if rec.seq:  # seq 0: applied without being logged (volatile)
            if rec.seq <= self.last_seq:
                raise StateError(f"record seq {rec.seq} is not after {self.last_seq}")
            self.last_seq = rec.seq
            if rec.time > self.time:
                self.time = rec.time
            if not rec.seq & 0xFFFF:
                self.compact_heaps()
        self._apply[type(rec)](rec)

    def apply_put(self, seq, time, conn, id, tube: str, pri, delay, ttr,
                  body: bytes | int) -> None:
        """`apply(Put(seq, time, conn, id, tube, pri, delay, ttr, body))`, with
        the same effect and errors, without the record.

        Replaying a log is mostly puts, and a restart's time is mostly this:
        building each Put and the generic dispatch cost a third of a replay,
        hence `_put` inlined here. `_put` stays the reference; tests hold the
        two to the same result.
        """
        if seq:
            if seq <= self.last_seq:
                raise StateError(f"record seq {seq} is not after {self.last_seq}")
            self.last_seq = seq
            if time > self.time:
                self.time = time
            if not seq & 0xFFFF:
                self.compact_heaps()
        c: Conn = self.conns.get(conn)
        if c is None or not c.logged or conn >= self.next_conn_id:
            self._conn(conn)
        jobs = self.jobs
        if id in jobs:
            raise StateError(f"job id {id} reused")
        t: Tube = self.tubes.get(tube)
        if t is None:
            t = self.add_tube(tube)
        # Job(id, t, pri, delay, max(ttr, 1), body, time), without the call
        # to __init__ (a third of the cost of making a job); `Job.__new__`
        # spelled out, which the compiled build makes a direct allocation.
        j: Job = Job.__new__(Job)
        j.id = id
        j.tube = t
        # share(self.ints, ...), inlined: a restart makes a million of these.
        ints = self.ints
        if pri > 256:
            pri = ints.get(pri) or share(ints, pri)
        j.pri = pri
        if ttr > 256:
            ttr = ints.get(ttr) or share(ints, ttr)
        j.ttr = 1 if 1 > ttr else ttr
        j.body = body
        j.created = time
        j.state = READY
        j.deadline = j.gen = 0
        j.counts = ZERO_COUNTS if not delay else (0, 0, 0, 0, 0, delay, 0)  # counts_for
        jobs[id] = j
        if id >= self.next_job_id:  # (below it: a put whose line took its id first)
            self.next_job_id = id + 1
        # _arrive
        if type(body) is bytes:
            n = len(body)
        elif isinstance(body, int):
            n = body & M32
            t.spilled_n += n
            self.spilled_bytes += n
        else:
            n = len(body)
        t.jobs_n += 1
        t.bytes_n += n
        self.body_bytes += n
        if t.arrivals is not None:
            t.arrivals.append(id)
        t.total_jobs += 1
        self.total_jobs += 1
        if delay:
            self.enter_delayed(j, time + delay * NS)
            return
        # _enter_ready for a new job: state READY, deadline 0 and gen 0 are
        # Job's defaults, and no expiry (a Put has none; the id is new).
        t.ready.push(pri, id, 0)
        t.ready_n += 1
        self.ready_n += 1
        if pri < URGENT_THRESHOLD:
            t.urgent_n += 1
            self.urgent_n += 1

    def apply_reserve(self, seq, time, conn, id) -> None:
        """`apply(Reserve(seq, time, conn, id))`, with the same effect and
        errors, without the record: `_reserve` with a ready job's way out of
        its state and the job's counts (reserves, reserver) set in one tuple.
        `_reserve` stays the reference; tests hold the two to the same result."""
        if seq:  # as `apply` does, inlined (a call costs more than these lines)
            if seq <= self.last_seq:
                raise StateError(f"record seq {seq} is not after {self.last_seq}")
            self.last_seq = seq
            if time > self.time:
                self.time = time
            if not seq & 0xFFFF:
                self.compact_heaps()
        j: Job = self.jobs.get(id)
        if j is None:
            raise StateError(f"job {id} does not exist")
        st = j.state
        if st == RESERVED:
            raise StateError(f"job {id} is already reserved")
        c: Conn = self.conns.get(conn)
        if c is None or not c.logged or conn >= self.next_conn_id:
            c = self._conn(conn)
        if c.waiting:
            self._stop_waiting(c)
        t: Tube = j.tube
        if st == READY:  # _leave, the everyday case
            t.ready_n -= 1
            self.ready_n -= 1
            if j.pri < URGENT_THRESHOLD:
                t.urgent_n -= 1
                self.urgent_n -= 1
            j.gen += 1
        else:
            self._leave(j)
        k = j.counts  # j.reserves += 1, then enter_reserved's j.reserver = c.id
        j.counts = (k[0] + 1, k[1], k[2], k[3], k[4], k[5], conn)
        deadline = time + j.ttr * NS
        j.state = RESERVED
        j.deadline = deadline
        c.reserved.add(id)
        heappush(self.ttr_heap, (deadline, id, j.gen))
        t.reserved_n += 1
        self.reserved_n += 1
        if self.limits:
            lim = self.limits.get(t.name)
            if lim is not None and lim.rate:
                lim.tat = max(lim.tat, time) + lim.interval

    def apply_delete(self, seq, time, conn, id) -> None:
        """`apply(Delete(seq, time, conn, id))`, with the same effect and
        errors, without the record; a reserved job's way out inlined."""
        if seq:  # as `apply` does, inlined (a call costs more than these lines)
            if seq <= self.last_seq:
                raise StateError(f"record seq {seq} is not after {self.last_seq}")
            self.last_seq = seq
            if time > self.time:
                self.time = time
            if not seq & 0xFFFF:
                self.compact_heaps()
        j: Job = self.jobs.get(id)
        if j is None:
            raise StateError(f"job {id} does not exist")
        c: Conn = self.conns.get(conn)
        if c is None or not c.logged or conn >= self.next_conn_id:
            c = self._conn(conn)
        t: Tube
        if j.state != RESERVED:
            t = self._remove(j)
        else:
            k = j.counts
            if k[6] != conn:
                raise StateError(f"job {id} is reserved by another connection")
            t = j.tube  # _remove: _leave, _depart, forget
            t.reserved_n -= 1
            self.reserved_n -= 1
            c.reserved.discard(id)
            j.counts = (k[0], k[1], k[2], k[3], k[4], k[5], 0)
            j.gen += 1
            body = j.body
            n = len(body) if type(body) is bytes else body_len(body)
            t.jobs_n -= 1
            t.bytes_n -= n
            self.body_bytes -= n
            if type(body) is not bytes and isinstance(body, int):
                t.spilled_n -= n
                self.spilled_bytes -= n
            del self.jobs[id]
            if self.expires:
                self.expires.pop(id, None)
            if self.keys.of_job:
                self.keys.release(id, self.time)
            if self.holds:
                self.holds.pop(id, None)
            if type(body) is not bytes and isinstance(body, int) \
                    and self.on_body_dropped is not None:
                self.on_body_dropped(body)
        t.cmd_delete += 1
        if not t.jobs_n:
            self._maybe_drop(t)

    def _put(self, rec: r.Put) -> None:
        self._conn(rec.conn)
        self._new_job(rec.id, rec.tube, rec, rec.body, 0)

    def _put_jobs(self, rec: r.PutJobs) -> None:
        self._conn(rec.conn)
        for jid in rec.dropped:
            j = self._job(jid)
            if j.state != READY:
                raise StateError(f"job {jid} is not ready: it cannot be discarded")
            t = self._remove(j)
            t.discarded_n += 1
            self._maybe_drop(t)
        for jid, tube in rec.jobs:
            self._new_job(jid, tube, rec, rec.body, rec.expires)

    def apply_put_unique(self, seq, time, conn, tube: str, key: str, unique_for, keys_max, id,
                         pri, delay, ttr, body: bytes | int) -> None:
        """`apply(PutUnique(...))` of the everyday keyed put (one job in `tube`,
        nothing dropped, no expiry), with the same effect, without the record.
        The key first: `add` refuses a taken key before anything changes."""
        self.keys.add(tube, key, id, unique_for * NS, keys_max, time, seq)
        self.apply_put(seq, time, conn, id, tube, pri, delay, ttr, body)

    def _put_unique(self, rec: r.PutUnique) -> None:
        if not rec.jobs:
            raise StateError("a keyed put made no job")
        keys = self.keys
        if keys.find(rec.tube, rec.key, rec.time) is not None:
            raise StateError(f"key {rec.key!r} of tube {rec.tube!r} is taken: "
                             "the put was a duplicate")
        if len(rec.jobs) == 1 and not rec.dropped and not rec.expires:
            # One job, as a Put makes it: apply_put's inlined path (seq 0: `apply`
            # has done the seq and time already).
            jid, tube = rec.jobs[0]
            self.apply_put(0, rec.time, rec.conn, jid, tube, rec.pri, rec.delay, rec.ttr,
                           rec.body)
        else:
            self._put_jobs(rec)
        keys.add(rec.tube, rec.key, rec.jobs[0][0], rec.unique_for * NS, rec.keys_max, rec.time,
                 rec.seq)

    def _expire(self, rec: r.Expire) -> None:
        for jid, to, expires in rec.moves:
            j = self._job(jid)
            if j.state not in (READY, DELAYED):
                raise StateError(f"job {jid} is neither ready nor delayed: it cannot expire")
            if not to:
                t = self._remove(j)
                t.expired_n += 1
                self._maybe_drop(t)
                continue
            self._leave(j)
            old = self._depart(j)
            old.expired_n += 1
            if expires:
                self.expires[jid] = expires
            else:
                self.expires.pop(jid, None)
            self._arrive(j, self.add_tube(to))
            self._enter_ready(j)
            self._maybe_drop(old)

    def _move(self, rec: r.Move) -> None:
        self._conn(rec.conn)
        j = self._job(rec.id)
        st = j.state
        if st == RESERVED or rec.tube == j.tube.name:
            raise StateError(f"job {rec.id} is reserved or already in tube {rec.tube!r}")
        deadline, hold = j.deadline, self.holds.get(j.id)
        self._leave(j)  # which drops a hold; the job keeps it where it goes
        old = self._depart(j)
        self._arrive(j, self.add_tube(rec.tube))
        if st == READY:
            self._enter_ready(j)
        elif st == DELAYED:
            self.enter_delayed(j, deadline)
        else:
            self.enter_buried(j)
        if hold is not None:
            self.holds[j.id] = hold
        self._maybe_drop(old)

    def _delete_tube(self, rec: r.DeleteTube) -> None:
        self._conn(rec.conn)
        if not self.is_fanout_tube(rec.tube):
            raise StateError(f"tube {rec.tube!r} is not a fanout tube")
        parent = fanout_parent(rec.tube)
        children = self.fanout[parent]
        children.remove(rec.tube)
        if not children:
            del self.fanout[parent]

    def _flush_tube(self, rec: r.FlushTube) -> None:
        self._conn(rec.conn)
        tube = self.tubes.get(rec.tube)
        for jid in rec.ids:
            j = self._job(jid)
            if j.tube is not tube or j.state == RESERVED:
                raise StateError(f"job {jid} is not an unreserved job of tube {rec.tube!r}")
            self._remove(j)
        if tube is not None:
            self._maybe_drop(tube)

    def _reserve(self, rec: r.Reserve) -> None:
        j = self._job(rec.id)
        if j.state == RESERVED:
            raise StateError(f"job {rec.id} is already reserved")
        c = self._conn(rec.conn)
        if c.waiting:
            self._stop_waiting(c)
        self._leave(j)
        j.reserves += 1
        self.enter_reserved(j, c, rec.time + j.ttr * NS)
        if self.limits:
            lim = self.limits.get(j.tube.name)
            if lim is not None and lim.rate:
                lim.tat = max(lim.tat, rec.time) + lim.interval

    def _requeue(self, rec: r.Requeue) -> None:
        cause = rec.cause
        if cause not in (r.REQUEUE_TIMEOUT, r.REQUEUE_RELEASE, r.REQUEUE_DISCONNECT):
            raise StateError(f"unknown requeue cause {cause}")
        if cause != r.REQUEUE_TIMEOUT:
            self._conn(rec.conn)
        for jid, until, to, reason in rec.outcomes:
            j = self._job(jid)
            if j.state != RESERVED or (cause != r.REQUEUE_TIMEOUT and j.reserver != rec.conn):
                raise StateError(f"job {jid} is not reserved by connection {rec.conn}")
            self._leave(j)
            if cause == r.REQUEUE_TIMEOUT:
                j.timeouts += 1
                self.job_timeouts += 1
            elif cause == r.REQUEUE_RELEASE:
                j.pri = rec.pri
                j.releases += 1
            if not reason:
                if until:
                    self.enter_delayed(j, until)
                    self.holds[jid] = "backoff"
                else:
                    self._enter_ready(j)
                continue
            self.holds[jid] = reason
            if not to:
                j.buries += 1
                self.enter_buried(j)
                continue
            old = self._depart(j)
            self._arrive(j, self.add_tube(to))
            self._enter_ready(j)
            self._maybe_drop(old)

    def _limits(self, rec: r.Limits) -> None:
        if rec.rate < 0 or rec.max_reserved < 0 or (rec.rate and rec.period <= 0):
            raise StateError(f"bad limits for tube {rec.tube!r}")
        old = self.limits.pop(rec.tube, None)
        if rec.max_reserved or rec.rate:
            tat = old.tat if old is not None and old.rate else 0
            self.limits[rec.tube] = Limit(rec.max_reserved, rec.rate, rec.period, tat)

    def _fire(self, rec: r.Fire) -> None:
        last = self.schedules.get(rec.schedule)
        if last is not None and rec.at <= last[0]:
            raise StateError(f"schedule {rec.schedule!r} fired at {rec.at} after {last[0]}")
        # A skipped firing keeps the last job made: skip-if-pending asks after it.
        self.schedules[rec.schedule] = (rec.at, rec.id or (last[1] if last else 0))
        if rec.id:
            self._new_job(rec.id, rec.tube, rec, rec.body, 0)

    def _delete(self, rec: r.Delete) -> None:
        j = self._job(rec.id)
        self._conn(rec.conn)
        if j.state == RESERVED and j.reserver != rec.conn:
            raise StateError(f"job {rec.id} is reserved by another connection")
        t = self._remove(j)
        t.cmd_delete += 1
        self._maybe_drop(t)

    def _release(self, rec: r.Release) -> None:
        j = self._reserved_by(rec.id, rec.conn)
        self._conn(rec.conn)
        self._leave(j)
        j.pri = rec.pri
        j.delay = rec.delay
        j.releases += 1
        self._enqueue(j, rec.delay, rec.time)

    def _bury(self, rec: r.Bury) -> None:
        j = self._reserved_by(rec.id, rec.conn)
        self._conn(rec.conn)
        self._leave(j)
        j.pri = rec.pri
        j.buries += 1
        self.enter_buried(j)

    def _touch(self, rec: r.Touch) -> None:
        j = self._reserved_by(rec.id, rec.conn)
        self._conn(rec.conn)
        j.gen += 1
        j.deadline = rec.time + j.ttr * NS
        heappush(self.ttr_heap, (j.deadline, j.id, j.gen))

    def _kick(self, rec: r.Kick) -> None:
        self._conn(rec.conn)
        for jid in rec.ids:
            j = self._job(jid)
            if j.state not in (BURIED, DELAYED):
                raise StateError(f"job {jid} is neither buried nor delayed")
            self._leave(j)
            j.kicks += 1
            self._enter_ready(j)

    def _use(self, rec: r.Use) -> None:
        c = self._conn(rec.conn)
        new = self.add_tube(rec.tube)
        new.using_n += 1
        old = self.tubes[c.use]
        old.using_n -= 1
        c.use = rec.tube
        self._maybe_drop(old)

    def _watch(self, rec: r.Watch) -> None:
        c = self._conn(rec.conn)
        t = self.add_tube(rec.tube)
        if rec.tube not in c.watch:
            c.watch.append(rec.tube)
            t.watching_n += 1

    def _ignore(self, rec: r.Ignore) -> None:
        c = self._conn(rec.conn)
        if rec.tube in c.watch:
            if len(c.watch) < 2:
                raise StateError(f"connection {rec.conn} cannot ignore its last tube")
            swap_remove(c.watch, rec.tube)
            t = self.tubes[rec.tube]
            t.watching_n -= 1
            self._maybe_drop(t)

    def _pause(self, rec: r.PauseTube) -> None:
        self._conn(rec.conn)
        t = self.tubes.get(rec.tube)
        if t is None:
            raise StateError(f"tube {rec.tube!r} does not exist")
        # beanstalkd pauses for at least 1 ns, so that a waiting reserve wakes up.
        t.pause = rec.delay * NS or 1
        t.unpause_at = rec.time + t.pause
        t.cmd_pause += 1
        self.paused.add(t.name)

    def _disconnect(self, rec: r.Disconnect) -> None:
        c = self.conns.pop(rec.conn, None)
        if c is None:
            return  # never seen: nothing to undo
        if c.waiting:
            self._stop_waiting(c)
        for jid in sorted(c.reserved):
            j = self.jobs[jid]
            self._leave(j)
            self._enter_ready(j)
        t = self.tubes[c.use]
        t.using_n -= 1
        self._maybe_drop(t)
        for name in c.watch:
            t = self.tubes[name]
            t.watching_n -= 1
            self._maybe_drop(t)

    def _promote(self, rec: r.Promote) -> None:
        for jid in rec.ids:
            j = self._job(jid)
            if j.state != DELAYED:
                raise StateError(f"job {jid} is not delayed")
            self._leave(j)
            self._enter_ready(j)

    def _timeout(self, rec: r.Timeout) -> None:
        for jid in rec.ids:
            j = self._job(jid)
            if j.state != RESERVED:
                raise StateError(f"job {jid} is not reserved")
            self._leave(j)
            j.timeouts += 1
            self.job_timeouts += 1
            self._enter_ready(j)

    def _restart(self, rec: r.Restart) -> None:
        for cid in sorted(self.conns):
            self._disconnect(r.Disconnect(0, rec.time, cid))

    def _new_epoch(self, rec: r.NewEpoch) -> None:
        if self.epochs and rec.epoch <= self.epochs[-1][0]:
            raise StateError(f"epoch {rec.epoch} does not follow {self.epochs[-1][0]}")
        self.epochs.append((rec.epoch, rec.history, rec.seq))

    @property
    def epoch(self) -> tuple[int, str]:
        return self.epochs[-1][:2] if self.epochs else (0, "")

    def _connect(self, rec: r.Connect) -> None:
        self._conn(rec.conn, logged=False)

    def _wait_start(self, rec: r.WaitStart) -> None:
        self.start_wait(rec.conn, rec.deadline)

    def start_wait(self, conn: int, deadline: int | None) -> None:
        """`apply(WaitStart(0, time, conn, deadline))` without the record: a
        wait is volatile (seq 0, never logged) and its time unused, so the
        loop starts one without making the record (dispatch.reserve)."""
        c = self._conn(conn, logged=False)
        if c.waiting:
            return
        c.waiting = True
        c.wait_deadline = deadline
        self.waiting_n += 1
        self.waiters[c.id] = c
        for name in c.watch:
            self.tubes[name].waiting.append(c.id)
            self.waited.add(name)
        if c.reserved:
            self.waiters_holding.add(c.id)
        if deadline is not None:
            h = self.wait_heap
            if len(h) > 2 * self.waiting_n + 64:  # mostly waits that ended: keep the live
                h[:] = [(w.wait_deadline, w.id) for w in self.waiters.values()
                        if w.wait_deadline is not None]
                heapify(h)
            heappush(h, (deadline, c.id))

    def _wait_stop(self, rec: r.WaitStop) -> None:
        c = self.conns.get(rec.conn)
        if c is not None and c.waiting:
            self._stop_waiting(c)

    def compact_heaps(self) -> None:
        """Drop stale heap entries once they outnumber live ones.

        Heaps are cleaned lazily from the top, so entries of jobs that left a
        state deep in a heap stay until reached; a replay of a long log (which
        never pops) would otherwise grow them with history instead of with the
        live jobs. Called every 65,536 records; it changes no answer.
        """
        jobs = self.jobs

        def live(heap: list, st: int, count: int) -> list:
            return heap if len(heap) <= 2 * count + 1024 else self.live_entries(heap, st)

        def live_ready(heap: ReadyHeap, count: int) -> ReadyHeap:
            if len(heap) <= 2 * count + 1024:
                return heap
            return ReadyHeap(k for k in heap
                             if (j := jobs.get(readyheap.entry_id(k))) is not None
                             and readyheap.entry_has_gen(k, j.gen) and j.state == READY)

        self.ttr_heap = live(self.ttr_heap, RESERVED, self.reserved_n)
        if len(self.expiry_heap) > 2 * (self.ready_n + self.delayed_n) + 1024:
            self.expiry_heap = [e for e in self.expiry_heap
                                if (j := jobs.get(e[1])) is not None and j.gen == e[2]
                                and j.state in (READY, DELAYED)]
            heapify(self.expiry_heap)
        for t in self.tubes.values():
            if t.arrivals is not None and len(t.arrivals) > 2 * t.jobs_n + 1024:
                t.arrivals = deque(i for i in t.arrivals
                                   if (j := jobs.get(i)) is not None and j.tube is t)
        self.delay_heap = live(self.delay_heap, DELAYED, self.delayed_n)
        for t in self.tubes.values():
            t.ready = live_ready(t.ready, t.ready_n)
            t.delayed = live(t.delayed, DELAYED, t.delayed_n)
