"""The queue state machine: tubes, jobs, reservations and waiting reservers.

Pure and synchronous: no trio, no sockets, no clock. `apply(record)` is the only
way to change it, and time enters only through the records' `time` field, so
the same records in the same order always give the same state. The query
methods (`best_ready`, `next_grant`, `due_*`, `stats_*`) read it and take the
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
(`bytes_n`, `spilled_n`) and tells `bodies.drop(ref)` when a spilled job
goes, so the loop's body store can close files nobody refers to. A
reference's low 32 bits are the body's length.

Fanout: a tube named `parent+child` is registered as a copy target of
`parent` when it comes into existence, and stays registered (even while the
tube itself is dropped for lack of references) until a DeleteTube record.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from smallstalk.core import records as r
from smallstalk.core.protocol import URGENT_THRESHOLD

READY, DELAYED, RESERVED, BURIED = range(4)
STATE_NAMES = (b"ready", b"delayed", b"reserved", b"buried")
NS = 1_000_000_000
SAFETY_MARGIN = NS  # the last second of a TTR (DEADLINE_SOON)
DEFAULT_TUBE = "default"


def fanout_parent(tube: str) -> str | None:
    """`orders` for `orders+audit`: the tube whose puts a fanout tube copies."""
    parent, plus, child = tube.partition("+")
    return parent if plus and parent and child else None


class StateError(Exception):
    """A record that cannot apply to this state: the log and the state disagree."""


_ZERO_COUNTS = (0, 0, 0, 0, 0)
_M32 = (1 << 32) - 1
_M64 = (1 << 64) - 1


def _counter(i: int) -> property:
    def get(self) -> int:
        return self.counts[i]

    def set_(self, value: int) -> None:
        c = list(self.counts)
        c[i] = value
        self.counts = tuple(c)

    return property(get, set_)


class Job:
    """One job. Kept small: a server may hold millions (see the RSS row in the README).

    The five statistics live in one tuple, shared by every job whose counts
    are all zero, and are read and written through properties.
    """

    __slots__ = (
        "id", "tube", "pri", "delay", "ttr", "body", "state", "created", "deadline",
        "reserver", "gen", "counts",
    )

    def __init__(self, id, tube, pri, delay, ttr, body, created):
        self.id = id
        self.tube = tube
        self.pri = pri
        self.delay = delay
        self.ttr = ttr
        self.body = body
        self.created = created
        self.state = READY
        self.deadline = 0
        self.reserver = 0
        self.gen = 0
        self.counts = _ZERO_COUNTS

    reserves = _counter(0)
    timeouts = _counter(1)
    releases = _counter(2)
    buries = _counter(3)
    kicks = _counter(4)


# Where a million jobs are made (State.apply_put, State.load), Job.__init__ is
# inlined: object.__new__ and the attribute stores, no __init__ call.
# tests/test_put_fastpath.py checks that those places set every slot.
_new_job = object.__new__


def body_len(body: bytes | int) -> int:
    return body & _M32 if isinstance(body, int) else len(body)


def _heap_walk(heap: list, cursor, count: int, live) -> list:
    """Up to `count` live entries of a heap greater than `cursor`, ascending,
    visiting only the entries before them (best-first over the heap's tree)."""
    out: list = []
    frontier = [(heap[0], 0)] if heap else []
    n = len(heap)
    while frontier and len(out) < count:
        entry, i = heapq.heappop(frontier)
        if entry > cursor and live(entry):
            out.append(entry)
        for child in (2 * i + 1, 2 * i + 2):
            if child < n:
                heapq.heappush(frontier, (heap[child], child))
    return out


def _job_key(j: Job | None, state: int, jid: int) -> tuple:
    if not jid:
        return (-1,)
    return (j.deadline if j is not None and j.state == state else 0, jid)


def _after_key(keys: list[tuple], cursor: tuple, count: int) -> list[int]:
    return [k[1] for k in keys if k > cursor][:count]


def _ready_key(j: Job) -> int:
    """A ready-heap entry: one int ordered by (pri, id), carrying the job's gen.

    An int instead of a (pri, id, gen) tuple saves ~30 bytes per ready job.
    """
    return (j.pri << 96) | (j.id << 32) | (j.gen & _M32)


class Tube:
    __slots__ = (
        "name", "ready", "delayed", "buried", "ready_n", "urgent_n", "reserved_n",
        "delayed_n", "jobs_n", "total_jobs", "cmd_delete", "cmd_pause", "pause",
        "unpause_at", "using_n", "watching_n", "waiting", "bytes_n", "spilled_n",
        "expired_n", "discarded_n", "arrivals",
    )

    def __init__(self, name: str):
        self.name = name
        self.ready: list = []  # heap of _ready_key ints: (pri, id, gen) packed
        self.delayed: list = []  # heap of (deadline, id, gen)
        self.buried: dict[int, Job] = {}  # FIFO
        self.ready_n = self.urgent_n = self.reserved_n = self.delayed_n = self.jobs_n = 0
        self.total_jobs = self.cmd_delete = self.cmd_pause = 0
        self.pause = 0  # ns of the last pause-tube
        self.unpause_at = 0  # ns
        self.using_n = self.watching_n = 0
        self.waiting: list[int] = []  # conn ids, oldest first (volatile)
        self.bytes_n = 0  # body bytes of its jobs
        self.spilled_n = 0  # ...of which on disk (read-behind)
        self.expired_n = self.discarded_n = 0
        # Job ids in the order they arrived, cleaned lazily: the oldest ready
        # jobs are the ones discard-old-when-full drops. Kept only once asked
        # for (`oldest_ready`): 10 bytes a job that most tubes never need.
        self.arrivals: deque[int] | None = None

    def paused(self, now: int) -> bool:
        return self.unpause_at > now


class Conn:
    __slots__ = ("id", "use", "watch", "reserved", "logged", "waiting", "wait_deadline")

    def __init__(self, id: int):
        self.id = id
        self.use = DEFAULT_TUBE
        self.watch = [DEFAULT_TUBE]  # beanstalkd order, swap-removal
        self.reserved: set[int] = set()
        self.logged = False  # mentioned by a logged record: part of the durable state
        self.waiting = False
        self.wait_deadline: int | None = None


def _secs(ns: int) -> int:
    """Nanoseconds to whole seconds, truncating toward zero as C does."""
    return ns // NS if ns >= 0 else -(-ns // NS)


def _swap_remove(items: list, item) -> None:
    i = items.index(item)
    items[i] = items[-1]
    items.pop()


class State:
    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self.tubes: dict[str, Tube] = {}
        self.tube_order: list[str] = []
        self.conns: dict[int, Conn] = {}
        self.next_job_id = 1
        self.next_conn_id = 1
        self.last_seq = 0
        self.time = 0  # time of the last logged record applied
        self.total_jobs = 0
        self.job_timeouts = 0
        self.ready_n = self.urgent_n = self.reserved_n = self.delayed_n = self.buried_n = 0
        self.waiting_n = 0
        self.waiters: dict[int, Conn] = {}  # waiting conns, oldest first
        # Histories this log has followed: (epoch, history id, first seq), oldest first.
        self.epochs: list[tuple[int, str, int]] = []
        self.delay_heap: list = []  # (deadline, id, gen) over all tubes
        self.ttr_heap: list = []  # (deadline, id, gen) over all reserved jobs
        self.expiry_heap: list = []  # (expires, id, gen) over ready/delayed jobs that expire
        # Expiry times (ns) of the jobs that have one. A dict, not a Job slot:
        # a 14th slot moves every Job to the next allocation size (+16 bytes).
        self.expires: dict[int, int] = {}
        self.fanout: dict[str, list[str]] = {}  # parent -> fanout tubes, oldest first
        self.body_bytes = 0  # bytes of all bodies
        self.spilled_bytes = 0  # ...of which on disk
        self.bodies = None  # the loop's body store: .drop(ref) when a spilled job goes
        self._tube(DEFAULT_TUBE)
        self._apply = {
            r.Put: self._put, r.Reserve: self._reserve, r.Delete: self._delete,
            r.Release: self._release, r.Bury: self._bury, r.Touch: self._touch,
            r.Kick: self._kick, r.Use: self._use, r.Watch: self._watch,
            r.Ignore: self._ignore, r.PauseTube: self._pause, r.Disconnect: self._disconnect,
            r.Promote: self._promote, r.Timeout: self._timeout, r.Restart: self._restart,
            r.NewEpoch: self._new_epoch, r.PutJobs: self._put_jobs, r.Expire: self._expire,
            r.DeleteTube: self._delete_tube, r.FlushTube: self._flush_tube,
            r.Connect: self._connect, r.WaitStart: self._wait_start, r.WaitStop: self._wait_stop,
        }

    # --- applying records ---------------------------------------------------

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

    def apply_put(self, seq: int, time: int, conn: int, id: int, tube: str, pri: int,
                  delay: int, ttr: int, body: bytes | int) -> None:
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
        c = self.conns.get(conn)
        if c is None or not c.logged or conn >= self.next_conn_id:
            self._conn(conn)
        jobs = self.jobs
        if id in jobs or id < self.next_job_id:
            raise StateError(f"job id {id} reused")
        t = self.tubes.get(tube)
        if t is None:
            t = self._tube(tube)
        # Job(id, t, pri, delay, max(ttr, 1), body, time), without the call
        # to __init__ (a third of the cost of making a job).
        j = _new_job(Job)
        j.id = id
        j.tube = t
        j.pri = pri
        j.delay = delay
        j.ttr = 1 if 1 > ttr else ttr
        j.body = body
        j.created = time
        j.state = READY
        j.deadline = j.reserver = j.gen = 0
        j.counts = _ZERO_COUNTS
        jobs[id] = j
        self.next_job_id = id + 1
        # _arrive
        if type(body) is bytes:
            n = len(body)
        elif isinstance(body, int):
            n = body & _M32
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
            self._enter_delayed(j, time + delay * NS)
            return
        # _enter_ready for a new job: state READY, deadline 0 and gen 0 are
        # Job's defaults, and no expiry (a Put has none; the id is new).
        heapq.heappush(t.ready, (pri << 96) | (id << 32))
        t.ready_n += 1
        self.ready_n += 1
        if pri < URGENT_THRESHOLD:
            t.urgent_n += 1
            self.urgent_n += 1

    def _tube(self, name: str, register: bool = True) -> Tube:
        t = self.tubes.get(name)
        if t is None:
            t = self.tubes[name] = Tube(name)
            self.tube_order.append(name)
            parent = fanout_parent(name) if register else None
            if parent is not None:
                children = self.fanout.setdefault(parent, [])
                if name not in children:
                    children.append(name)
        return t

    def _maybe_drop(self, t: Tube) -> None:
        if t.jobs_n or t.using_n or t.watching_n or t.name == DEFAULT_TUBE:
            return
        del self.tubes[t.name]
        _swap_remove(self.tube_order, t.name)

    def _conn(self, cid: int, logged: bool = True) -> Conn:
        c = self.conns.get(cid)
        if c is None:
            c = self.conns[cid] = Conn(cid)
            default = self.tubes[DEFAULT_TUBE]
            default.using_n += 1
            default.watching_n += 1
        if logged:
            c.logged = True
            # Ids of connections that left no trace in the log may come again.
            if cid >= self.next_conn_id:
                self.next_conn_id = cid + 1
        return c

    def _job(self, jid: int) -> Job:
        j = self.jobs.get(jid)
        if j is None:
            raise StateError(f"job {jid} does not exist")
        return j

    def _leave(self, j: Job) -> None:
        """Take a job out of its current state's sets and counters."""
        t = j.tube
        st = j.state
        if st == READY:
            t.ready_n -= 1
            self.ready_n -= 1
            if j.pri < URGENT_THRESHOLD:
                t.urgent_n -= 1
                self.urgent_n -= 1
        elif st == DELAYED:
            t.delayed_n -= 1
            self.delayed_n -= 1
        elif st == RESERVED:
            t.reserved_n -= 1
            self.reserved_n -= 1
            c = self.conns.get(j.reserver)
            if c is not None:
                c.reserved.discard(j.id)
            j.reserver = 0
        else:
            del t.buried[j.id]
            self.buried_n -= 1
        j.gen += 1  # every heap entry of the old state is now stale

    def _enter_ready(self, j: Job) -> None:
        t = j.tube
        j.state = READY
        j.deadline = 0  # meaningful only while delayed or reserved
        heapq.heappush(t.ready, _ready_key(j))
        if self.expires and j.id in self.expires:
            heapq.heappush(self.expiry_heap, (self.expires[j.id], j.id, j.gen))
        t.ready_n += 1
        self.ready_n += 1
        if j.pri < URGENT_THRESHOLD:
            t.urgent_n += 1
            self.urgent_n += 1

    def _enter_delayed(self, j: Job, deadline: int) -> None:
        t = j.tube
        j.state = DELAYED
        j.deadline = deadline
        entry = (deadline, j.id, j.gen)
        heapq.heappush(t.delayed, entry)
        heapq.heappush(self.delay_heap, entry)
        if self.expires and j.id in self.expires:
            heapq.heappush(self.expiry_heap, (self.expires[j.id], j.id, j.gen))
        t.delayed_n += 1
        self.delayed_n += 1

    def _enter_reserved(self, j: Job, c: Conn, deadline: int) -> None:
        t = j.tube
        j.state = RESERVED
        j.reserver = c.id
        j.deadline = deadline
        c.reserved.add(j.id)
        heapq.heappush(self.ttr_heap, (deadline, j.id, j.gen))
        t.reserved_n += 1
        self.reserved_n += 1

    def _enter_buried(self, j: Job) -> None:
        j.state = BURIED
        j.deadline = 0
        j.tube.buried[j.id] = j
        self.buried_n += 1

    def _enqueue(self, j: Job, delay: int, now: int) -> None:
        if delay:
            self._enter_delayed(j, now + delay * NS)
        else:
            self._enter_ready(j)

    def _reserved_by(self, jid: int, cid: int) -> Job:
        j = self._job(jid)
        if j.state != RESERVED or j.reserver != cid:
            raise StateError(f"job {jid} is not reserved by connection {cid}")
        return j

    def _put(self, rec: r.Put) -> None:
        self._conn(rec.conn)
        self._new_job(rec.id, rec.tube, rec, rec.body, 0)

    def _new_job(self, jid: int, tube: str, rec, body, expires: int) -> None:
        if jid in self.jobs or jid < self.next_job_id:
            raise StateError(f"job id {jid} reused")
        t = self._tube(tube)
        j = Job(jid, t, rec.pri, rec.delay, max(rec.ttr, 1), body, rec.time)
        if expires:
            self.expires[jid] = expires
        self.jobs[jid] = j
        self.next_job_id = jid + 1
        self._arrive(j, t)
        t.total_jobs += 1
        self.total_jobs += 1
        self._enqueue(j, rec.delay, rec.time)

    def _arrive(self, j: Job, t: Tube) -> None:
        n = body_len(j.body)
        j.tube = t
        t.jobs_n += 1
        t.bytes_n += n
        self.body_bytes += n
        if isinstance(j.body, int):
            t.spilled_n += n
            self.spilled_bytes += n
        if t.arrivals is not None:
            t.arrivals.append(j.id)

    def _depart(self, j: Job) -> Tube:
        """Take a job (already out of its state's sets) out of its tube's counts."""
        t = j.tube
        n = body_len(j.body)
        t.jobs_n -= 1
        t.bytes_n -= n
        self.body_bytes -= n
        if isinstance(j.body, int):
            t.spilled_n -= n
            self.spilled_bytes -= n
        return t

    def _remove(self, j: Job) -> Tube:
        """Forget a job entirely; the caller counts why and may drop the tube."""
        self._leave(j)
        t = self._depart(j)
        del self.jobs[j.id]
        if self.expires:
            self.expires.pop(j.id, None)
        if isinstance(j.body, int) and self.bodies is not None:
            self.bodies.drop(j.body)
        return t

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
            self._arrive(j, self._tube(to))
            self._enter_ready(j)
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

    def spill(self, j: Job, ref: int) -> None:
        """The job's body now lives on disk at `ref` (a representation change only)."""
        if isinstance(j.body, int):
            return
        n = len(j.body)
        if ref & _M32 != n:
            raise ValueError(f"reference length {ref & _M32} is not the body's {n}")
        j.body = ref
        j.tube.spilled_n += n
        self.spilled_bytes += n

    def _reserve(self, rec: r.Reserve) -> None:
        j = self._job(rec.id)
        if j.state == RESERVED:
            raise StateError(f"job {rec.id} is already reserved")
        c = self._conn(rec.conn)
        if c.waiting:
            self._stop_waiting(c)
        self._leave(j)
        j.reserves += 1
        self._enter_reserved(j, c, rec.time + j.ttr * NS)

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
        self._enter_buried(j)

    def _touch(self, rec: r.Touch) -> None:
        j = self._reserved_by(rec.id, rec.conn)
        self._conn(rec.conn)
        j.gen += 1
        j.deadline = rec.time + j.ttr * NS
        heapq.heappush(self.ttr_heap, (j.deadline, j.id, j.gen))

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
        new = self._tube(rec.tube)
        new.using_n += 1
        old = self.tubes[c.use]
        old.using_n -= 1
        c.use = rec.tube
        self._maybe_drop(old)

    def _watch(self, rec: r.Watch) -> None:
        c = self._conn(rec.conn)
        t = self._tube(rec.tube)
        if rec.tube not in c.watch:
            c.watch.append(rec.tube)
            t.watching_n += 1

    def _ignore(self, rec: r.Ignore) -> None:
        c = self._conn(rec.conn)
        if rec.tube in c.watch:
            if len(c.watch) < 2:
                raise StateError(f"connection {rec.conn} cannot ignore its last tube")
            _swap_remove(c.watch, rec.tube)
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
        c = self._conn(rec.conn, logged=False)
        if c.waiting:
            return
        c.waiting = True
        c.wait_deadline = rec.deadline
        self.waiting_n += 1
        self.waiters[c.id] = c
        for name in c.watch:
            self.tubes[name].waiting.append(c.id)

    def _wait_stop(self, rec: r.WaitStop) -> None:
        c = self.conns.get(rec.conn)
        if c is not None and c.waiting:
            self._stop_waiting(c)

    def _stop_waiting(self, c: Conn) -> None:
        c.waiting = False
        c.wait_deadline = None
        self.waiting_n -= 1
        del self.waiters[c.id]
        for name in c.watch:
            self.tubes[name].waiting.remove(c.id)

    def compact_heaps(self) -> None:
        """Drop stale heap entries once they outnumber live ones.

        Heaps are cleaned lazily from the top, so entries of jobs that left a
        state deep in a heap stay until reached; a replay of a long log (which
        never pops) would otherwise grow them with history instead of with the
        live jobs. Called every 65,536 records; it changes no answer.
        """
        jobs = self.jobs

        def live(heap: list, st: int, count: int) -> list:
            if len(heap) <= 2 * count + 1024:
                return heap
            kept = [e for e in heap
                    if (j := jobs.get(e[1])) is not None and j.gen == e[2] and j.state == st]
            heapq.heapify(kept)
            return kept

        def live_ready(heap: list, count: int) -> list:
            if len(heap) <= 2 * count + 1024:
                return heap
            kept = [k for k in heap
                    if (j := jobs.get((k >> 32) & _M64)) is not None
                    and (j.gen & _M32) == (k & _M32) and j.state == READY]
            heapq.heapify(kept)
            return kept

        self.ttr_heap = live(self.ttr_heap, RESERVED, self.reserved_n)
        if len(self.expiry_heap) > 2 * (self.ready_n + self.delayed_n) + 1024:
            self.expiry_heap = [e for e in self.expiry_heap
                                if (j := jobs.get(e[1])) is not None and j.gen == e[2]
                                and j.state in (READY, DELAYED)]
            heapq.heapify(self.expiry_heap)
        for t in self.tubes.values():
            if t.arrivals is not None and len(t.arrivals) > 2 * t.jobs_n + 1024:
                t.arrivals = deque(i for i in t.arrivals
                                   if (j := jobs.get(i)) is not None and j.tube is t)
        self.delay_heap = live(self.delay_heap, DELAYED, self.delayed_n)
        for t in self.tubes.values():
            t.ready = live_ready(t.ready, t.ready_n)
            t.delayed = live(t.delayed, DELAYED, t.delayed_n)

    # --- queries --------------------------------------------------------------

    def conn(self, cid: int) -> Conn | None:
        return self.conns.get(cid)

    def use_of(self, cid: int) -> str:
        c = self.conns.get(cid)
        return c.use if c else DEFAULT_TUBE

    def watch_of(self, cid: int) -> list[str]:
        c = self.conns.get(cid)
        return c.watch if c else [DEFAULT_TUBE]

    def conn_logged(self, cid: int) -> bool:
        c = self.conns.get(cid)
        return c is not None and c.logged

    def _top_ready(self, t: Tube) -> Job | None:
        heap = t.ready
        jobs = self.jobs
        while heap:
            key = heap[0]
            j = jobs.get((key >> 32) & _M64)
            if j is not None and (j.gen & _M32) == (key & _M32) and j.state == READY:
                return j
            heapq.heappop(heap)
        return None

    def _heap_top(self, heap: list, *states: int) -> Job | None:
        """The job at the top of a (key, id, gen) heap, dropping stale entries."""
        jobs = self.jobs
        while heap:
            _, jid, gen = heap[0]
            j = jobs.get(jid)
            if j is not None and j.gen == gen and j.state in states:
                return j
            heapq.heappop(heap)
        return None

    def _top_delayed(self, t: Tube) -> Job | None:
        return self._heap_top(t.delayed, DELAYED)

    def peek_ready(self, tube: str) -> Job | None:
        t = self.tubes.get(tube)
        return self._top_ready(t) if t else None

    def peek_delayed(self, tube: str) -> Job | None:
        t = self.tubes.get(tube)
        return self._top_delayed(t) if t else None

    def peek_buried(self, tube: str) -> Job | None:
        t = self.tubes.get(tube)
        if t is None or not t.buried:
            return None
        return next(iter(t.buried.values()))

    def best_ready(self, cid: int, now: int) -> Job | None:
        """The job a reserve by `cid` gets now: lowest (pri, id) in unpaused watched tubes."""
        best = None
        for name in self.watch_of(cid):
            t = self.tubes[name]
            if not t.ready_n or t.paused(now):
                continue
            j = self._top_ready(t)
            if j is not None and (best is None or (j.pri, j.id) < (best.pri, best.id)):
                best = j
        return best

    def has_ready(self, cid: int) -> bool:
        """beanstalkd's conn_ready: a watched tube has ready jobs, paused or not."""
        return any(self.tubes[name].ready_n for name in self.watch_of(cid))

    def deadline_soon(self, cid: int, now: int) -> bool:
        c = self.conns.get(cid)
        if c is None or not c.reserved:
            return False
        soonest = min(self.jobs[jid].deadline for jid in c.reserved)
        return now >= soonest - SAFETY_MARGIN

    def next_grant(self, now: int) -> tuple[int, Job] | None:
        """(waiting conn, job) for the best job any waiter can take now, or None."""
        if not self.waiting_n:
            return None
        best = None
        best_tube = None
        for name in self.tube_order:
            t = self.tubes[name]
            if not t.waiting or not t.ready_n or t.paused(now):
                continue
            j = self._top_ready(t)
            if j is not None and (best is None or (j.pri, j.id) < (best.pri, best.id)):
                best, best_tube = j, t
        if best is None:
            return None
        return best_tube.waiting[0], best

    def kickable(self, tube: str, bound: int) -> list[int]:
        """Ids `kick bound` moves: buried first (FIFO), else delayed (soonest first)."""
        t = self.tubes.get(tube)
        if t is None or bound == 0:
            return []
        if t.buried:
            out = []
            for jid in t.buried:
                if len(out) >= bound:
                    break
                out.append(jid)
            return out
        live = [
            (d, jid) for d, jid, gen in t.delayed
            if (j := self.jobs.get(jid)) is not None and j.gen == gen and j.state == DELAYED
        ]
        return [jid for _, jid in heapq.nsmallest(bound, live)]

    def _pop_due(self, heap: list, until: int, states: tuple[int, ...]) -> list[int]:
        """Pop the entries of a (time, id, gen) heap up to `until` (inclusive); the
        ids of those still live in one of `states`, soonest first."""
        out = []
        jobs = self.jobs
        while heap and heap[0][0] <= until:
            _, jid, gen = heapq.heappop(heap)
            j = jobs.get(jid)
            if j is not None and j.gen == gen and j.state in states:
                out.append(jid)
        return out

    def due_promotions(self, now: int) -> list[int]:
        return self._pop_due(self.delay_heap, now, (DELAYED,))

    def due_timeouts(self, now: int) -> list[int]:
        # beanstalkd: a deadline equal to now keeps the reservation.
        return self._pop_due(self.ttr_heap, now - 1, (RESERVED,))

    def due_expiries(self, now: int) -> list[int]:
        """Ready or delayed jobs whose expiry time has come, soonest first."""
        return self._pop_due(self.expiry_heap, now, (READY, DELAYED))

    def oldest_ready(self, tube: str, count: int, nbytes: int = 0) -> list[int]:
        """The oldest ready jobs of a tube, in arrival order, until `count` jobs
        and `nbytes` body bytes are covered (fewer if the tube has no more)."""
        t = self.tubes.get(tube)
        if t is None:
            return []
        jobs = self.jobs
        if t.arrivals is None:  # first asked: from now on kept as jobs arrive
            t.arrivals = deque(jid for jid, j in jobs.items() if j.tube is t)
        arrivals = t.arrivals
        while arrivals and ((j := jobs.get(arrivals[0])) is None or j.tube is not t):
            arrivals.popleft()  # gone or moved away: stale
        out: list[int] = []
        seen = set()
        for jid in arrivals:
            if len(out) >= count and nbytes <= 0:
                break
            j = jobs.get(jid)
            if j is None or j.tube is not t or j.state != READY or jid in seen:
                continue
            seen.add(jid)
            out.append(jid)
            nbytes -= body_len(j.body)
        return out

    def list_jobs(self, tube: str, state: int, after: int, count: int) -> list[int]:
        """Up to `count` ids of a tube's jobs in `state`, in the order they would
        be handed out (ready: pri then id; delayed: deadline; buried: FIFO;
        reserved: TTR deadline), after job `after` (0: from the start).

        Costs about the jobs listed and skipped, not the tube's size, for ready
        and delayed jobs: the heaps are walked best-first. A job `after` that
        has left the state is placed by its id (and the lowest key).
        """
        t = self.tubes.get(tube)
        if t is None or count <= 0:
            return []
        jobs = self.jobs
        if state == BURIED:
            ids = iter(t.buried)
            if after and after in t.buried:
                for jid in ids:
                    if jid == after:
                        break
            elif after:
                ids = (jid for jid in t.buried if jid > after)
            return [jid for _, jid in zip(range(count), ids, strict=False)]
        if state == RESERVED:
            held = sorted((j.deadline, j.id) for c in self.conns.values() for jid in c.reserved
                          if (j := jobs[jid]).tube is t)
            return _after_key(held, _job_key(jobs.get(after), RESERVED, after), count)
        if state == READY:
            a = jobs.get(after)
            cursor = ((a.pri if a is not None and a.state == READY else 0) << 96
                      | after << 32 | _M32) if after else -1

            def live(key: int) -> bool:
                j = jobs.get((key >> 32) & _M64)
                return j is not None and j.state == READY and (j.gen & _M32) == key & _M32

            return [(k >> 32) & _M64 for k in _heap_walk(t.ready, cursor, count, live)]
        if state == DELAYED:
            a = jobs.get(after)
            dl = a.deadline if a is not None and a.state == DELAYED else 0
            cursor = (dl, after, float("inf")) if after else (-1,)

            def live_d(e: tuple) -> bool:
                j = jobs.get(e[1])
                return j is not None and j.state == DELAYED and j.gen == e[2]

            return [e[1] for e in _heap_walk(t.delayed, cursor, count, live_d)]
        return []

    def is_fanout_tube(self, tube: str) -> bool:
        """Is `tube` registered as a fanout tube (getting copies of its parent's puts)?"""
        return tube in self.fanout.get(fanout_parent(tube), ())

    def next_deadline(self, now: int) -> int | None:
        """The earliest time (ns) at which something changes without a command."""
        times = []
        if self.expiry_heap and self._heap_top(self.expiry_heap, READY, DELAYED) is not None:
            times.append(self.expiry_heap[0][0])
        j = self._heap_top(self.delay_heap, DELAYED)
        if j is not None:
            times.append(j.deadline)
        j = self._heap_top(self.ttr_heap, RESERVED)
        if j is not None:
            times.append(j.deadline + 1)  # a TTR runs out strictly after its deadline
        if self.waiting_n:
            for c in self.waiters.values():
                if c.wait_deadline is not None:
                    times.append(c.wait_deadline)
                if c.reserved:
                    times.append(min(self.jobs[j].deadline for j in c.reserved) - SAFETY_MARGIN)
                for name in c.watch:
                    t = self.tubes[name]
                    if t.unpause_at > now:
                        times.append(t.unpause_at)
        return min(times) if times else None

    def waiters_due(self, now: int) -> list[tuple[int, bytes]]:
        """Waiting conns to answer now: ('deadline', cid) before ('timeout', cid)."""
        out = []
        for c in list(self.waiters.values()):
            if self.deadline_soon(c.id, now):
                out.append((c.id, b"DEADLINE_SOON"))
            elif c.wait_deadline is not None and c.wait_deadline <= now:
                out.append((c.id, b"TIMED_OUT"))
        return out

    # --- stats ---------------------------------------------------------------

    def job_stats(self, j: Job, now: int) -> list[tuple[str, object]]:
        time_left = _secs(j.deadline - now) if j.state in (RESERVED, DELAYED) else 0
        return [
            ("id", j.id), ("tube", j.tube.name.encode()), ("state", STATE_NAMES[j.state]),
            ("pri", j.pri), ("age", _secs(now - j.created)), ("delay", j.delay),
            ("ttr", j.ttr), ("time-left", time_left), ("file", 0), ("reserves", j.reserves),
            ("timeouts", j.timeouts), ("releases", j.releases), ("buries", j.buries),
            ("kicks", j.kicks),
        ]

    def tube_stats(self, t: Tube, now: int) -> list[tuple[str, object]]:
        paused = t.paused(now)
        return [
            ("name", t.name.encode()), ("current-jobs-urgent", t.urgent_n),
            ("current-jobs-ready", t.ready_n), ("current-jobs-reserved", t.reserved_n),
            ("current-jobs-delayed", t.delayed_n), ("current-jobs-buried", len(t.buried)),
            ("total-jobs", t.total_jobs), ("current-using", t.using_n),
            ("current-watching", t.watching_n), ("current-waiting", len(t.waiting)),
            ("cmd-delete", t.cmd_delete), ("cmd-pause-tube", t.cmd_pause),
            ("pause", t.pause // NS if paused else 0),
            ("pause-time-left", _secs(t.unpause_at - now) if paused else 0),
            # smallstalk's own, after beanstalkd's keys:
            ("jobs-expired", t.expired_n), ("jobs-discarded", t.discarded_n),
            ("current-bytes", t.bytes_n), ("bytes-in-memory", t.bytes_n - t.spilled_n),
            ("bytes-on-disk", t.spilled_n),
        ]

    # --- the durable form ------------------------------------------------------

    def dump(self) -> Iterator[list]:
        """The durable state as CBOR-ready items, in a canonical order.

        Volatile parts (waiting reservers, connections no logged record
        mentioned) are left out: a restart forgets them.
        """
        yield ["meta", self.last_seq, self.time, self.next_job_id, self.next_conn_id,
               self.total_jobs, self.job_timeouts]
        for epoch, history, first_seq in self.epochs:
            yield ["epoch", epoch, history, first_seq]
        for name in self.tube_order:
            t = self.tubes[name]
            yield ["tube", name, t.total_jobs, t.cmd_delete, t.cmd_pause, t.pause, t.unpause_at,
                   t.expired_n, t.discarded_n]
        for children in self.fanout.values():
            for child in children:
                yield ["fanout", child]
        for cid in sorted(self.conns):
            c = self.conns[cid]
            if c.logged:
                yield ["conn", cid, c.use, list(c.watch)]
        for jid in sorted(self.jobs):
            j = self.jobs[jid]
            if j.state != BURIED:  # buried jobs follow, in their FIFO order
                yield self._job_item(j)
        for name in self.tube_order:
            for j in self.tubes[name].buried.values():
                yield self._job_item(j)

    def _job_item(self, j: Job) -> list:
        return ["job", j.id, j.tube.name, j.pri, j.delay, j.ttr, j.body, j.state, j.created,
                j.deadline, j.reserver, j.reserves, j.timeouts, j.releases, j.buries, j.kicks,
                self.expires.get(j.id, 0)]

    @classmethod
    def load(cls, items) -> State:
        """Rebuild a state from snapshot items: `dump()` items (a `job` item
        per job, formats 1 and 2) and format 3's `jobs` items (many jobs each).

        A job's body may already be an int reference (a reader that keeps
        bodies on disk puts it there); it is counted as spilled.
        """
        s = cls()
        s.tubes.clear()
        s.tube_order.clear()
        s.fanout.clear()
        jobs = s.jobs
        ready_keys: dict[Tube, list[int]] = {}
        tubes = s.tubes
        expires = s.expires
        expiry_heap = s.expiry_heap
        new_job = _new_job
        # Jobs come in runs of one tube: the tube and its ready keys are looked
        # up when the name changes. Any other item may change the tubes.
        last_tube = t = keys = None
        # The bulk of a big snapshot is job items: this loop is the restart time
        # (see the README's start-up row), so it stays flat and call-free.
        for item in items:
            kind = item[0]
            if kind == "job":
                if len(item) == 17:  # format 2
                    (_, jid, tube, pri, delay, ttr, body, st, created, deadline, reserver,
                     reserves, timeouts, releases, buries, kicks, exp) = item
                else:
                    (_, jid, tube, pri, delay, ttr, body, st, created, deadline, reserver,
                     reserves, timeouts, releases, buries, kicks, *rest) = item
                    exp = rest[0] if rest else 0
                if tube != last_tube or last_tube is None:
                    t = tubes[tube]
                    last_tube = tube
                    keys = ready_keys.get(t)
                    if keys is None:
                        keys = ready_keys[t] = []
                j = new_job(Job)  # Job.__init__, inlined as in apply_put
                j.id = jid
                j.tube = t
                j.pri = pri
                j.delay = delay
                j.ttr = ttr
                j.body = body
                j.created = created
                j.state = READY
                j.deadline = j.reserver = j.gen = 0
                if reserves or timeouts or releases or buries or kicks:
                    j.counts = (reserves, timeouts, releases, buries, kicks)
                else:
                    j.counts = _ZERO_COUNTS
                if exp:
                    expires[jid] = exp
                jobs[jid] = j
                t.jobs_n += 1
                if type(body) is bytes:
                    t.bytes_n += len(body)
                else:
                    n = body_len(body)
                    t.bytes_n += n
                    t.spilled_n += n
                if st == READY:
                    # Collect keys, heapify once below (ready_n from their count).
                    keys.append((pri << 96) | (jid << 32))
                    if pri < URGENT_THRESHOLD:
                        t.urgent_n += 1
                    if exp:
                        expiry_heap.append((exp, jid, 0))
                elif st == DELAYED:
                    s._enter_delayed(j, deadline)
                elif st == RESERVED:
                    s._enter_reserved(j, s.conns[reserver], deadline)
                else:
                    s._enter_buried(j)
                continue
            if kind == "jobs":
                # Format 3. The per-job code is the `job` branch's again: a
                # shared path that made a row of each `job` item cost format-2
                # loads ~10%; turning each `job` item into a one-row `jobs`
                # doubled State.load's time for them (0.25 -> 0.54 s, 300k jobs).
                for (jid, tube, pri, delay, ttr, st, created, deadline, reserver, reserves,
                     timeouts, releases, buries, kicks, exp), body in zip(
                        item[1], item[2], strict=True):
                    if tube != last_tube or last_tube is None:
                        t = tubes[tube]
                        last_tube = tube
                        keys = ready_keys.get(t)
                        if keys is None:
                            keys = ready_keys[t] = []
                    j = new_job(Job)  # Job.__init__, inlined as in apply_put
                    j.id = jid
                    j.tube = t
                    j.pri = pri
                    j.delay = delay
                    j.ttr = ttr
                    j.body = body
                    j.created = created
                    j.state = READY
                    j.deadline = j.reserver = j.gen = 0
                    if reserves or timeouts or releases or buries or kicks:
                        j.counts = (reserves, timeouts, releases, buries, kicks)
                    else:
                        j.counts = _ZERO_COUNTS
                    if exp:
                        expires[jid] = exp
                    jobs[jid] = j
                    t.jobs_n += 1
                    if type(body) is bytes:
                        t.bytes_n += len(body)
                    else:
                        n = body_len(body)
                        t.bytes_n += n
                        t.spilled_n += n
                    if st == READY:
                        # Collect keys, heapify once below (ready_n from their count).
                        keys.append((pri << 96) | (jid << 32))
                        if pri < URGENT_THRESHOLD:
                            t.urgent_n += 1
                        if exp:
                            expiry_heap.append((exp, jid, 0))
                    elif st == DELAYED:
                        s._enter_delayed(j, deadline)
                    elif st == RESERVED:
                        s._enter_reserved(j, s.conns[reserver], deadline)
                    else:
                        s._enter_buried(j)
                continue
            last_tube = None
            if kind == "tube":
                _, name, total, cmd_delete, cmd_pause, pause, unpause_at, *rest = item
                t = s._tube(name, register=False)  # "fanout" items say which are
                t.total_jobs, t.cmd_delete, t.cmd_pause = total, cmd_delete, cmd_pause
                t.pause, t.unpause_at = pause, unpause_at
                if rest:
                    t.expired_n, t.discarded_n = rest
            elif kind == "fanout":
                child = item[1]
                children = s.fanout.setdefault(fanout_parent(child), [])
                if child not in children:
                    children.append(child)
            elif kind == "conn":
                _, cid, use, watch = item
                c = s.conns[cid] = Conn(cid)
                c.logged = True
                c.use = use
                c.watch = list(watch)
                s.tubes[use].using_n += 1
                for name in watch:
                    s.tubes[name].watching_n += 1
            elif kind == "epoch":
                if s.epochs and item[1] <= s.epochs[-1][0]:
                    raise StateError(f"epoch {item[1]} does not follow {s.epochs[-1][0]}")
                s.epochs.append((item[1], item[2], item[3]))
            elif kind == "meta":
                (_, s.last_seq, s.time, s.next_job_id, s.next_conn_id, s.total_jobs,
                 s.job_timeouts) = item
            else:
                raise StateError(f"unknown snapshot item {kind!r}")
        for t, keys in ready_keys.items():  # fresh jobs: state READY, gen 0, as keyed
            t.ready.extend(keys)
            heapq.heapify(t.ready)
            t.ready_n += len(keys)
            s.ready_n += len(keys)
        s.urgent_n = sum(t.urgent_n for t in s.tubes.values())
        heapq.heapify(s.expiry_heap)
        s.body_bytes = sum(t.bytes_n for t in s.tubes.values())
        s.spilled_bytes = sum(t.spilled_n for t in s.tubes.values())
        return s

    def check(self) -> None:
        """Assert the invariants in the module docstring (for tests)."""
        counts = {st: 0 for st in range(4)}
        per_tube: dict[str, list[int]] = {name: [0, 0, 0, 0, 0] for name in self.tubes}
        for j in self.jobs.values():
            counts[j.state] += 1
            pt = per_tube[j.tube.name]
            pt[j.state] += 1
            pt[4] += 1
            if j.state == RESERVED:
                assert j.id in self.conns[j.reserver].reserved
            if j.state == BURIED:
                assert j.id in j.tube.buried
        assert counts[READY] == self.ready_n
        assert counts[DELAYED] == self.delayed_n
        assert counts[RESERVED] == self.reserved_n
        assert counts[BURIED] == self.buried_n
        for name, t in self.tubes.items():
            ready, delayed, reserved, buried, total = per_tube[name]
            assert (t.ready_n, t.delayed_n, t.reserved_n, len(t.buried), t.jobs_n) == (
                ready, delayed, reserved, buried, total), name
            mine = [j for j in self.jobs.values() if j.tube is t]
            assert t.bytes_n == sum(body_len(j.body) for j in mine), name
            assert t.spilled_n == sum(body_len(j.body) for j in mine
                                      if isinstance(j.body, int)), name
        assert self.body_bytes == sum(t.bytes_n for t in self.tubes.values())
        assert self.spilled_bytes == sum(t.spilled_n for t in self.tubes.values())
        assert all(jid in self.jobs for jid in self.expires)
        for parent, children in self.fanout.items():
            assert children and all(fanout_parent(c) == parent for c in children)
        for c in self.conns.values():
            for jid in c.reserved:
                assert self.jobs[jid].reserver == c.id
        assert sorted(self.tube_order) == sorted(self.tubes)
        for name, t in self.tubes.items():
            assert t.using_n == sum(1 for c in self.conns.values() if c.use == name)
            assert t.watching_n == sum(1 for c in self.conns.values() if name in c.watch)
            assert (t.jobs_n or t.using_n or t.watching_n or name == DEFAULT_TUBE)
