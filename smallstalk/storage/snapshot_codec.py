"""The state's snapshot codec: a `State` as snapshot items (`dump`) and back (`load`).

The items' layout is the snapshot format's (snapshots/README.md); snapshot.py
frames and stores them. Kept apart from core/state.py so that the state knows
nothing of its durable form (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from smallstalk.core.model import (
    BURIED,
    DELAYED,
    READY,
    RESERVED,
    URGENT_THRESHOLD,
    ZERO_COUNTS,
    Conn,
    Job,
    Limit,
    StateError,
    Tube,
    body_len,
    fanout_parent,
    new_bare_job,
    share,
)
from smallstalk.core.state import State


def dump(state: State) -> Iterator[list]:
    """The durable state as CBOR-ready items, in a canonical order.

    Volatile parts (waiting reservers, connections no logged record
    mentioned) are left out: a restart forgets them.
    """
    yield ["meta", state.last_seq, state.time, state.next_job_id, state.next_conn_id,
           state.total_jobs, state.job_timeouts]
    for epoch, history, first_seq in state.epochs:
        yield ["epoch", epoch, history, first_seq]
    for name in state.tube_order:
        t = state.tubes[name]
        yield ["tube", name, t.total_jobs, t.cmd_delete, t.cmd_pause, t.pause, t.unpause_at,
               t.expired_n, t.discarded_n]
    for children in state.fanout.values():
        for child in children:
            yield ["fanout", child]
    for name in sorted(state.limits):
        lim = state.limits[name]
        yield ["limit", name, lim.max_reserved, lim.rate, lim.period, lim.tat]
    for name in sorted(state.schedules):
        at, jid = state.schedules[name]
        yield ["schedule", name, at, jid]
    for cid in sorted(state.conns):
        c = state.conns[cid]
        if c.logged:
            yield ["conn", cid, c.use, list(c.watch)]
    for jid in sorted(state.jobs):
        j = state.jobs[jid]
        if j.state != BURIED:  # buried jobs follow, in their FIFO order
            yield _job_item(state, j)
    for name in state.tube_order:
        for jid in state.tubes[name].buried:
            yield _job_item(state, state.jobs[jid])
    yield from _keys_items(state)
    for jid in sorted(state.holds):
        yield ["hold", jid, state.holds[jid]]


KEYS_PER_ITEM = 1024  # live plus retained keys in one `keys` item (a frame stays small)


def _keys_items(state: State) -> Iterator[list]:
    """Format 5: each tube's idempotency keys, after the jobs they name."""
    for tube, k in state.keys.tubes.items():
        live = [[key, jid] for key, jid in k.live.items()]
        gone = [[key, jid, until] for key, (jid, until) in k.gone.items()]
        rows = [*live, *gone]
        for i in range(0, max(len(rows), 1), KEYS_PER_ITEM):
            part = rows[i:i + KEYS_PER_ITEM]
            part_live = [x for x in part if len(x) == 2]
            part_gone = [x for x in part if len(x) == 3]
            yield ["keys", tube, k.window, k.keys_max, k.dropped_n, part_live, part_gone]


def _job_item(state: State, j: Job) -> list:
    return ["job", j.id, j.tube.name, j.pri, j.delay, j.ttr, j.body, j.state, j.created,
            j.deadline, j.reserver, j.reserves, j.timeouts, j.releases, j.buries, j.kicks,
            state.expires.get(j.id, 0)]

def load(items: Iterable[list]) -> State:
    """Rebuild a state from snapshot items: `dump` items (a `job` item
    per job, formats 1 and 2) and format 3's `jobs` items (many jobs each).

    A job's body may already be an int reference (a reader that keeps
    bodies on disk puts it there); it is counted as spilled.
    """
    s: State = State()
    s.tubes.clear()
    s.tube_order.clear()
    s.fanout.clear()
    jobs = s.jobs
    tubes = s.tubes
    expires = s.expires
    expiry_heap = s.expiry_heap
    new_job = new_bare_job
    ints = s.ints
    last_created = None
    # Jobs come in runs of one tube: the tube is looked up when the name
    # changes. Any other item may change the tubes.
    t: Tube = None
    j: Job
    last_tube = None
    # The bulk of a big snapshot is job items: this loop is the restart time
    # (see the README's start-up row), so it stays flat, its only call a
    # ready job's `add_unordered` (a C call in the compiled build).
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
            j = new_job(Job)  # Job.__init__, inlined as in apply_put
            j.id = jid
            j.tube = t
            if pri > 256:
                pri = ints.get(pri) or share(ints, pri)
            j.pri = pri
            if ttr > 256:
                ttr = ints.get(ttr) or share(ints, ttr)
            j.ttr = ttr
            j.body = body
            # Jobs of one turn were made at one time: share that int too.
            if created == last_created:
                created = last_created
            else:
                last_created = created
            j.created = created
            j.state = READY
            j.deadline = j.gen = 0
            if reserves or timeouts or releases or buries or kicks or delay:
                j.counts = (reserves, timeouts, releases, buries, kicks, delay, 0)
            else:
                j.counts = ZERO_COUNTS
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
                # Unordered, one heapify below (ready_n from their count).
                t.ready.add_unordered(pri, jid, 0)
                if pri < URGENT_THRESHOLD:
                    t.urgent_n += 1
                if exp:
                    expiry_heap.append((exp, jid, 0))
            elif st == DELAYED:
                s.enter_delayed(j, deadline)
            elif st == RESERVED:
                s.enter_reserved(j, s.conns[reserver], deadline)
            else:
                s.enter_buried(j)
            continue
        if kind == "jobs":
            # Format 3. The per-job code is the `job` branch's again: both a
            # shared function and turning each `job` item into a one-row `jobs`
            # item measured slower for format-2 loads.
            for (jid, tube, pri, delay, ttr, st, created, deadline, reserver, reserves,
                 timeouts, releases, buries, kicks, exp), body in zip(
                    item[1], item[2], strict=True):
                if tube != last_tube or last_tube is None:
                    t = tubes[tube]
                    last_tube = tube
                j = new_job(Job)  # Job.__init__, inlined as in apply_put
                j.id = jid
                j.tube = t
                j.pri = pri
                j.ttr = ttr
                j.body = body
                j.created = created
                j.state = READY
                j.deadline = j.gen = 0
                if reserves or timeouts or releases or buries or kicks or delay:
                    j.counts = (reserves, timeouts, releases, buries, kicks, delay, 0)
                else:
                    j.counts = ZERO_COUNTS
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
                    # Unordered, one heapify below (ready_n from their count).
                    t.ready.add_unordered(pri, jid, 0)
                    if pri < URGENT_THRESHOLD:
                        t.urgent_n += 1
                    if exp:
                        expiry_heap.append((exp, jid, 0))
                elif st == DELAYED:
                    s.enter_delayed(j, deadline)
                elif st == RESERVED:
                    s.enter_reserved(j, s.conns[reserver], deadline)
                else:
                    s.enter_buried(j)
            continue
        last_tube = None
        if kind == "tube":
            _, name, total, cmd_delete, cmd_pause, pause, unpause_at, *rest = item
            t = s.add_tube(name, register=False)  # "fanout" items say which are
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
        elif kind == "limit":
            _, name, max_reserved, rate, period, tat = item
            s.limits[name] = Limit(max_reserved, rate, period, tat)
        elif kind == "schedule":
            s.schedules[item[1]] = (item[2], item[3])
        elif kind == "hold":
            if item[1] not in jobs:
                raise StateError(f"hold item for job {item[1]}, which is not in the snapshot")
            s.holds[item[1]] = item[2]
        elif kind == "epoch":
            if s.epochs and item[1] <= s.epochs[-1][0]:
                raise StateError(f"epoch {item[1]} does not follow {s.epochs[-1][0]}")
            s.epochs.append((item[1], item[2], item[3]))
        elif kind == "keys":
            _, tube, window, keys_max, dropped_n, live, gone = item
            s.keys.restore(tube, window, keys_max, dropped_n, live, gone)
        elif kind == "meta":
            (_, s.last_seq, s.time, s.next_job_id, s.next_conn_id, s.total_jobs,
             s.job_timeouts) = item
        else:
            raise StateError(f"unknown snapshot item {kind!r}")
    for t in tubes.values():  # every ready entry is a fresh job's, added above
        t.ready.reorder()
        t.ready_n = len(t.ready)
        s.ready_n += t.ready_n
    s.urgent_n = sum(t.urgent_n for t in s.tubes.values())
    heapq.heapify(s.expiry_heap)
    s.body_bytes = sum(t.bytes_n for t in s.tubes.values())
    s.spilled_bytes = sum(t.spilled_n for t in s.tubes.values())
    return s
