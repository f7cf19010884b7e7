"""The mutation loop's timers: what happens because time passed, and when to look again.

Called by the loop (loop.py) once per turn, after the turn's commands: schedules
whose time came (`Fire`), delayed jobs whose time came (`Promote`),
reservations whose TTR ran out (`Timeout`, or `Requeue` where an attempt
limit or back-off decides: holdback.py), jobs past their max-age (`Expire`),
and waiting reserves to grant, to time out, or to warn with DEADLINE_SOON. See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Protocol

import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.state import NS, State
from smallstalk.server import holdback, schedules
from smallstalk.server.commit import GroupCommit, Unavailable
from smallstalk.server.policy import Policies
from smallstalk.server.session import Session


class Loop(Protocol):
    """What the timers read and call of the mutation loop (loop.MutationLoop)."""

    state: State
    commit: GroupCommit
    policies: Policies
    sessions: dict[int, Session]
    deferred: list  # heap of (trio time due, session id, session, reply)
    read_only: str | None
    now: int
    serving_since: int
    clock: Callable[[], int]
    schedules_loaded: dict[str, int]  # schedule -> when this server first loaded it (ns)
    max_job_size: int

    def take_job_id(self) -> int: ...

    def count_tube(self, tube: str, name: str) -> None: ...

    def log(self, cls: type, *fields) -> r.Record: ...

    def grant_waiters(self) -> None: ...

    def answer_wait(self, s: Session, reply: bytes) -> None: ...

    def answer_deferred(self, s: Session, reply: bytes) -> None: ...


def run(lp: Loop) -> None:
    """Everything that happens because time passed, as records."""
    c = lp.commit
    if c.awaiting_acks:  # replies held for replicas (most turns: none)
        c.expire_unacked()
    if lp.deferred:
        _answer_deferred_due(lp)
    if lp.read_only or (c.failed_until and trio.current_time() < c.failed_until):
        return
    st = lp.state
    now = lp.now
    st.drop_ended_reservations()
    scheduled = lp.policies.schedules
    if scheduled and schedules.next_due(st, scheduled, lp.schedules_loaded) <= now:
        try:
            schedules.fire_due(lp, now)
        except Unavailable:
            return
    if not st.might_be_due(now) and not st.waiters_maybe_due(now):
        return  # the common turn: no heap's first entry is due, no wait ends
    try:
        due = st.due_promotions(now)
        if due:
            lp.log(r.Promote, due)
        due = st.due_timeouts(now)
        if due:
            holdback.log_timeouts(lp, due)
        due = st.due_expiries(now)
        if due:
            lp.log(r.Expire, expiry_moves(st, lp.policies, due, now))
        lp.grant_waiters()
    except Unavailable:
        return
    for cid, soon in st.waiters_due(now):
        s = lp.sessions.get(cid)
        if s is not None:
            lp.answer_wait(s, p.DEADLINE_SOON if soon else p.TIMED_OUT)
    lp.grant_waiters()


def _answer_deferred_due(lp: Loop) -> None:
    """Send the deferred replies whose time came (a failed `auth`)."""
    now = trio.current_time()
    deferred = lp.deferred
    while deferred and deferred[0][0] <= now:
        _, _, s, reply = heapq.heappop(deferred)
        lp.answer_deferred(s, reply)


def expiry_moves(st: State, policies: Policies, due: list[int],
                 now: int) -> list[tuple[int, str, int]]:
    """Where each expiring job goes (its tube's expire-to, "" = deleted)."""
    moves = []
    for jid in due:
        name = st.jobs[jid].tube.name
        to = policies.of(name).expire_to
        if to == name:
            to = ""
        age = policies.of(to).max_age if to else 0
        moves.append((jid, to, now + age * NS if age else 0))
    return moves


def heap_tops(st: State) -> tuple:
    """The first entries of the state's timer heaps (an empty heap itself), for
    `maybe_earlier`."""
    h1, h2, h3 = st.delay_heap, st.ttr_heap, st.expiry_heap
    return h1 and h1[0], h2 and h2[0], h3 and h3[0]


def maybe_earlier(lp: Loop, tops: tuple) -> bool:
    """Could the turns since `tops` (`heap_tops` before them) have made a
    timer due earlier than the loop task's alarm? False is certain, and saves
    a poller's pass `seconds_to_next_deadline` (a dozen calls with a TTR
    running, as on every reserve).

    Why a heap whose first entry is the same cannot have: the alarm was set
    from the heaps' first live entries (`next_deadline` drops stale ones
    first), and a pop only brings a later entry to the top, so the alarm is no
    later than a heap's first entry; an entry pushed since without becoming
    the first is no earlier than it. Every other timer source (waiters, held
    replies, a lazy fsync, a failing disk, schedules, deferred replies) is
    not judged here: while one exists, the answer is True."""
    st, c = lp.state, lp.commit
    return bool(st.waiting_n or lp.deferred or lp.policies.schedules or c.awaiting_acks
                or c.unsynced or c.failed_until or tops != heap_tops(st))


def seconds_to_next_deadline(lp: Loop) -> float | None:
    """How long the loop may wait for input before a timer is due (None: no timer).

    Cheap when nothing can be due (a poller's pass asks after every turn, and
    puts and deletes make no timer): every timer source is listed in the
    first test, so a new one is added there and below, side by side."""
    st, c = lp.state, lp.commit
    scheduled = lp.policies.schedules
    if not (st.delay_heap or st.ttr_heap or st.expiry_heap or st.waiting_n or lp.deferred
            or c.has_timers() or scheduled):
        return None
    wait = _seconds_to_state_deadline(lp)
    if scheduled and not lp.read_only:
        left = max((schedules.next_due(st, scheduled, lp.schedules_loaded) - lp.clock()) / NS,
                   0.0)
        wait = left if wait is None else min(wait, left)
    left = c.seconds_to_deadline()  # replies held for replicas, a lazy fsync
    if left is not None:
        wait = left if wait is None else min(wait, left)
    if lp.deferred:
        left = max(lp.deferred[0][0] - trio.current_time(), 0.0)
        wait = left if wait is None else min(wait, left)
    return wait


def _seconds_to_state_deadline(lp: Loop) -> float | None:
    now = lp.clock()
    deadline = lp.state.next_deadline(now)
    failed_until = lp.commit.failed_until
    if failed_until:
        # Timers may not log while the AOF is failing: look again later.
        retry = max(failed_until - trio.current_time(), 0.0)
        if deadline is None:
            return retry if retry > 0 else None
        return max((deadline - now) / NS, retry)
    if deadline is None:
        return None
    return max((deadline - now) / NS, 0.0)
