"""The read side of the state: what a reserve would get, what is due, what
`kick` moves, when something next changes; and `check`, the invariants of
core/state.py as assertions. Heaps are cleaned lazily here, from the top.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from heapq import heapify, heappop, heappush

from smallstalk.core import readyheap
from smallstalk.core.model import (
    BURIED,
    DEFAULT_TUBE,
    DELAYED,
    M32,
    READY,
    RESERVED,
    SAFETY_MARGIN,
    Conn,
    Job,
    Limit,
    Tube,
    body_len,
    fanout_parent,
)


def _heap_walk(heap: Sequence, cursor, count: int, live) -> list:
    """Up to `count` live entries of a heap greater than `cursor`, ascending,
    visiting only the entries before them (best-first over the heap's tree)."""
    out: list = []
    frontier = [(heap[0], 0)] if heap else []
    n = len(heap)
    while frontier and len(out) < count:
        entry, i = heappop(frontier)
        if entry > cursor and live(entry):
            out.append(entry)
        for child in (2 * i + 1, 2 * i + 2):
            if child < n:
                heappush(frontier, (heap[child], child))
    return out


def _job_key(j: Job | None, state: int, jid: int) -> tuple:
    if not jid:
        return (-1,)
    return (j.deadline if j is not None and j.state == state else 0, jid)


def _after_key(keys: list[tuple], cursor: tuple, count: int) -> list[int]:
    return [k[1] for k in keys if k > cursor][:count]


class Queries:
    """The root of the State chain (Queries, Moves, State): reads the fields
    `Moves.__init__` sets."""

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
        j: Job
        while heap:
            j = jobs.get(heap.top_id())
            if j is not None and j.state == READY and heap.top_has_gen(j.gen):
                return j
            heap.drop_top()
        return None

    def _heap_top(self, heap: list, *states: int) -> Job | None:
        """The job at the top of a (key, id, gen) heap, dropping stale entries."""
        jobs = self.jobs
        j: Job
        while heap:
            _, jid, gen = heap[0]
            j = jobs.get(jid)
            if j is not None and j.gen == gen and j.state in states:
                return j
            heappop(heap)
        return None

    def live_entries(self, heap: list, state: int) -> list:
        """A (time, id, gen) heap's entries whose jobs are still in `state`, as
        a new heap (`drop_ended_reservations`, `State.compact_heaps`)."""
        jobs = self.jobs
        j: Job
        kept = [e for e in heap
                if (j := jobs.get(e[1])) is not None and j.gen == e[2] and j.state == state]
        heapify(kept)
        return kept

    def drop_ended_reservations(self) -> None:
        """Rebuild the TTR heap from the live reservations' entries once ended
        ones (a reserve pushes one; its delete, release or bury leaves it
        behind) outnumber them twice over, and 64. The loop asks each turn
        (timers.run): one pass and a heapify, about 150 instructions an entry
        where popping each one cost some 2,500 (tuple compares at every
        level), and the heap stays small for the pops `next_deadline` makes."""
        if len(self.ttr_heap) > 2 * self.reserved_n + 64:
            self.ttr_heap = self.live_entries(self.ttr_heap, RESERVED)

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
        return self.jobs[next(iter(t.buried))]

    def best_ready(self, cid, now) -> Job | None:  # ints unannotated: queries.pxd
        """The job a reserve by `cid` gets now: lowest (pri, id) in unpaused watched tubes."""
        best: Job = None
        j: Job
        t: Tube
        limits = self.limits
        c: Conn = self.conns.get(cid)  # watch_of, inlined
        tubes = self.tubes
        for name in c.watch if c else (DEFAULT_TUBE,):
            t = tubes[name]
            if not t.ready_n or t.unpause_at > now:  # t.paused(now), inlined
                continue
            if limits and name in limits and self._limited(limits[name], t, now):
                continue
            j = self._top_ready(t)
            if j is not None and (best is None or (j.pri, j.id) < (best.pri, best.id)):
                best = j
        return best

    @staticmethod
    def _limited(lim: Limit, t: Tube, now: int) -> bool:
        """Does the tube's concurrency or rate limit hold its ready jobs back now?"""
        return lim.full(t.reserved_n) or (lim.rate and now < lim.token_at())

    def held_back(self, jid: int, now: int) -> tuple[str, int | str] | None:
        """Why a job is not handed out although it exists, in one place:
        ("exhausted", reason) buried or dead-lettered by an attempt limit,
        ("backoff", until ns), ("concurrency", the tube's max-reserved),
        ("rate", when the next token is due, ns), ("paused", until ns); None
        when nothing holds it back (or it is reserved)."""
        j = self.jobs.get(jid)
        if j is None:
            return None
        reason = self.holds.get(jid)
        if j.state == DELAYED:
            return ("backoff", j.deadline) if reason == "backoff" else None
        if j.state == BURIED:
            return ("exhausted", reason) if reason else None
        if j.state != READY:
            return None
        t = j.tube
        if t.paused(now):
            return ("paused", t.unpause_at)
        lim = self.limits.get(t.name)
        if lim is not None:
            if lim.full(t.reserved_n):
                return ("concurrency", lim.max_reserved)
            if lim.rate and now < lim.token_at():
                return ("rate", lim.token_at())
        return ("exhausted", reason) if reason else None

    def has_ready(self, cid: int) -> bool:
        """beanstalkd's conn_ready: a watched tube has ready jobs, paused or not."""
        c = self.conns.get(cid)
        tubes = self.tubes
        for name in c.watch if c else (DEFAULT_TUBE,):  # a loop: any() and a generator cost more
            if tubes[name].ready_n:
                return True
        return False

    def deadline_soon(self, cid: int, now: int) -> bool:
        c = self.conns.get(cid)
        if c is None or not c.reserved:
            return False
        soonest = min(self.jobs[jid].deadline for jid in c.reserved)
        return now >= soonest - SAFETY_MARGIN

    def next_grant(self, now) -> tuple[int, Job] | None:  # unannotated: queries.pxd
        """(waiting conn, job) for the best job any waiter can take now, or None."""
        if not self.waiting_n:
            return None
        best: Job = None
        best_tube: Tube = None
        j: Job
        t: Tube
        limits = self.limits
        for name in self.waited:  # (pri, id) is unique: the order of the walk does not matter
            t = self.tubes[name]
            if not t.ready_n or t.paused(now):
                continue
            if limits and name in limits and self._limited(limits[name], t, now):
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
            _, jid, gen = heappop(heap)
            j = jobs.get(jid)
            if j is not None and j.gen == gen and j.state in states:
                out.append(jid)
        return out

    def might_be_due(self, now) -> bool:  # unannotated: queries.pxd
        """Could `due_promotions`, `due_timeouts` or `due_expiries` return
        anything at `now`? False is certain; True may find only stale entries.

        Ensures: False implies all three are empty at `now`."""
        h = self.delay_heap
        if h and h[0][0] <= now:
            return True
        h = self.ttr_heap
        if h and h[0][0] < now:
            return True
        h = self.expiry_heap
        return bool(h) and h[0][0] <= now

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
            cursor = readyheap.entry_of(a.pri if a is not None and a.state == READY else 0,
                                        after, M32) if after else -1

            def live(key: int) -> bool:
                j = jobs.get(readyheap.entry_id(key))
                return (j is not None and j.state == READY
                        and readyheap.entry_has_gen(key, j.gen))

            return [readyheap.entry_id(k) for k in _heap_walk(t.ready, cursor, count, live)]
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
            d = self._wait_top()
            if d is not None:
                times.append(d)
            for cid in self.waiters_holding:
                c = self.waiters[cid]
                if c.reserved:
                    times.append(min(self.jobs[j].deadline for j in c.reserved) - SAFETY_MARGIN)
            for name in list(self.paused):  # paused tubes that a waiter watches
                t = self.tubes.get(name)
                if t is None or not t.unpause_at:  # gone (or made anew, never paused)
                    self.paused.discard(name)
                elif t.waiting and t.unpause_at > now:
                    times.append(t.unpause_at)
            for name, lim in self.limits.items():  # a token due for a waiter
                t = self.tubes.get(name)
                if (lim.rate and t is not None and t.waiting and t.ready_n
                        and not lim.full(t.reserved_n) and lim.token_at() > now):
                    times.append(lim.token_at())
        return min(times) if times else None

    def _wait_top(self) -> int | None:
        """The earliest wait deadline of a waiting connection (stale entries popped)."""
        h = self.wait_heap
        waiters = self.waiters
        while h:
            d, cid = h[0]
            c = waiters.get(cid)
            if c is not None and c.wait_deadline == d:
                return d
            heappop(h)
        return None

    def waiters_maybe_due(self, now) -> bool:  # unannotated: queries.pxd
        """Could `waiters_due(now)` answer anyone? Without walking the waiters:
        the earliest wait deadline, and the few waiters that hold jobs.

        Ensures: False implies `waiters_due(now)` is empty."""
        if not self.waiting_n:
            return False
        d = self._wait_top()
        if d is not None and d <= now:
            return True
        for cid in self.waiters_holding:  # (a loop: a cpdef method holds no closure)
            if self.deadline_soon(cid, now):
                return True
        return False

    def waiters_due(self, now: int) -> list[tuple[int, bool]]:
        """Waiting conns to answer now, oldest first: (cid, True) when a job it
        has reserved is near its deadline (DEADLINE_SOON, which wins), (cid,
        False) when its own wait timed out."""
        out: list[tuple[int, bool]] = []
        if not self.waiters_maybe_due(now):
            return out
        for c in list(self.waiters.values()):
            if self.deadline_soon(c.id, now):
                out.append((c.id, True))
            elif c.wait_deadline is not None and c.wait_deadline <= now:
                out.append((c.id, False))
        return out

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
        assert all(jid in self.jobs for jid in self.holds)
        assert all(self.jobs[jid].state == DELAYED for jid, why in self.holds.items()
                   if why == "backoff")
        self.keys.check(self.jobs)
        for parent, children in self.fanout.items():
            assert children and all(fanout_parent(c) == parent for c in children)
        for c in self.conns.values():
            for jid in c.reserved:
                assert self.jobs[jid].reserver == c.id
        assert sorted(self.tube_order) == sorted(self.tubes)
        assert self.waited == {name for name, t in self.tubes.items() if t.waiting}
        for name, t in self.tubes.items():
            assert t.using_n == sum(1 for c in self.conns.values() if c.use == name)
            assert t.watching_n == sum(1 for c in self.conns.values() if name in c.watch)
            assert (t.jobs_n or t.using_n or t.watching_n or name == DEFAULT_TUBE)
