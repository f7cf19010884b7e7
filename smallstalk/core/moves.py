"""The state's fields, and the moves that every record is made of: a job
entering or leaving ready, delayed, reserved or buried, arriving in or
departing from a tube, a tube or connection coming and going. Only State
(core/state.py, which names the invariants these keep) calls them, and the
snapshot codec (storage/snapshot_codec.py) when it rebuilds a state.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappush

from smallstalk.core.keys import KeyIndex
from smallstalk.core.model import (
    BURIED,
    DEFAULT_TUBE,
    DELAYED,
    M32,
    NS,
    READY,
    RESERVED,
    URGENT_THRESHOLD,
    Conn,
    Job,
    Limit,
    StateError,
    Tube,
    body_len,
    fanout_parent,
    share,
    swap_remove,
)
from smallstalk.core.queries import Queries


class Moves(Queries):
    """The middle of the State chain (Queries, Moves, State): its fields, and
    the steps that change them."""

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
        # So that a turn need not walk every waiting connection (queries.py,
        # `waiters_maybe_due`): their wait deadlines as a heap of (deadline,
        # conn id), stale entries skipped; the waiters holding jobs (only
        # they can be owed DEADLINE_SOON, and they hold no more while they
        # wait); the tubes ever paused (dropped with the tube). And the tubes
        # someone waits on, so that a grant need not walk every tube.
        self.wait_heap: list[tuple[int, int]] = []
        self.waiters_holding: set[int] = set()
        self.paused: set[str] = set()
        self.waited: set[str] = set()
        # Histories this log has followed: (epoch, history id, first seq), oldest first.
        self.epochs: list[tuple[int, str, int]] = []
        self.delay_heap: list = []  # (deadline, id, gen) over all tubes
        self.ttr_heap: list = []  # (deadline, id, gen) over all reserved jobs
        self.expiry_heap: list = []  # (expires, id, gen) over ready/delayed jobs that expire
        # Expiry times (ns) of the jobs that have one. A dict, not a Job slot:
        # a 14th slot moves every Job to the next allocation size (+16 bytes).
        self.expires: dict[int, int] = {}
        self.fanout: dict[str, list[str]] = {}  # parent -> fanout tubes, oldest first
        self.keys = KeyIndex()  # idempotency keys (core/keys.py)
        # Tube policies that are state because the records say so (format 6):
        # why a job is held back (an attempt limit's reason, "backoff" while
        # a back-off delay runs); each tube's concurrency and rate limits
        # with its token bucket; each schedule's last firing (at ns, job id).
        self.holds: dict[int, str] = {}
        self.limits: dict[str, Limit] = {}
        self.schedules: dict[str, tuple[int, int]] = {}
        # One int object per priority or TTR value seen (up to SHARED_INTS):
        # CPython caches only -5..256, so every job with the usual pri 1024
        # held its own 32-byte int (see `share`).
        self.ints: dict[int, int] = {}
        self.body_bytes = 0  # bytes of all bodies
        self.spilled_bytes = 0  # ...of which on disk
        # Told the reference of a spilled body whose job goes, by whoever owns
        # the body store (it stays beside the state: see `spill`).
        self.on_body_dropped: Callable[[int], None] | None = None
        self.add_tube(DEFAULT_TUBE)

    def add_tube(self, name: str, register: bool = True) -> Tube:
        """The tube `name`, made if missing (and, if `register`, made a fanout copy target)."""
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
        swap_remove(self.tube_order, t.name)

    def _conn(self, cid: int, logged: bool = True) -> Conn:
        c: Conn = self.conns.get(cid)
        if c is None:
            c = self.conns[cid] = Conn(cid)
            default: Tube = self.tubes[DEFAULT_TUBE]
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
        t: Tube = j.tube
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
        if self.holds and st != READY and st != RESERVED:
            self.holds.pop(j.id, None)  # a back-off's end, a kick out of burial
        j.gen += 1  # every heap entry of the old state is now stale

    def _enter_ready(self, j: Job) -> None:
        t: Tube = j.tube
        j.state = READY
        j.deadline = 0  # meaningful only while delayed or reserved
        t.ready.push(j.pri, j.id, j.gen)
        if self.expires and j.id in self.expires:
            heappush(self.expiry_heap, (self.expires[j.id], j.id, j.gen))
        t.ready_n += 1
        self.ready_n += 1
        if j.pri < URGENT_THRESHOLD:
            t.urgent_n += 1
            self.urgent_n += 1

    def enter_delayed(self, j: Job, deadline: int) -> None:
        t: Tube = j.tube
        j.state = DELAYED
        j.deadline = deadline
        entry = (deadline, j.id, j.gen)
        heappush(t.delayed, entry)
        heappush(self.delay_heap, entry)
        if self.expires and j.id in self.expires:
            heappush(self.expiry_heap, (self.expires[j.id], j.id, j.gen))
        t.delayed_n += 1
        self.delayed_n += 1

    def enter_reserved(self, j: Job, c: Conn, deadline: int) -> None:
        t: Tube = j.tube
        j.state = RESERVED
        j.reserver = c.id
        j.deadline = deadline
        c.reserved.add(j.id)
        heappush(self.ttr_heap, (deadline, j.id, j.gen))
        t.reserved_n += 1
        self.reserved_n += 1

    def enter_buried(self, j: Job) -> None:
        j.state = BURIED
        j.deadline = 0
        j.tube.buried[j.id] = None
        self.buried_n += 1

    def _enqueue(self, j: Job, delay: int, now: int) -> None:
        if delay:
            self.enter_delayed(j, now + delay * NS)
        else:
            self._enter_ready(j)

    def _reserved_by(self, jid: int, cid: int) -> Job:
        j = self._job(jid)
        if j.state != RESERVED or j.reserver != cid:
            raise StateError(f"job {jid} is not reserved by connection {cid}")
        return j

    def _new_job(self, jid: int, tube: str, rec, body, expires: int) -> None:
        if jid in self.jobs:
            raise StateError(f"job id {jid} reused")
        t = self.add_tube(tube)
        j = Job(jid, t, share(self.ints, rec.pri), rec.delay, share(self.ints, max(rec.ttr, 1)),
                body, rec.time)
        if expires:
            self.expires[jid] = expires
        self.jobs[jid] = j
        if jid >= self.next_job_id:
            # Below it: a put whose line took its id before an earlier put's
            # record (dispatch.put_heard, as beanstalkd makes the job there).
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
        t: Tube = j.tube
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
        t: Tube = self._depart(j)
        del self.jobs[j.id]
        if self.expires:
            self.expires.pop(j.id, None)
        if self.keys.of_job:
            self.keys.release(j.id, self.time)
        if self.holds:
            self.holds.pop(j.id, None)
        if isinstance(j.body, int) and self.on_body_dropped is not None:
            self.on_body_dropped(j.body)
        return t

    def spill(self, j: Job, ref: int) -> None:
        """The job's body now lives on disk at `ref` (a representation change only)."""
        if isinstance(j.body, int):
            return
        n = len(j.body)
        if ref & M32 != n:
            raise ValueError(f"reference length {ref & M32} is not the body's {n}")
        j.body = ref
        j.tube.spilled_n += n
        self.spilled_bytes += n

    def _stop_waiting(self, c: Conn) -> None:
        c.waiting = False
        c.wait_deadline = None
        self.waiting_n -= 1
        del self.waiters[c.id]
        self.waiters_holding.discard(c.id)
        for name in c.watch:
            waiting = self.tubes[name].waiting
            waiting.remove(c.id)
            if not waiting:
                self.waited.discard(name)
