"""The tube policies that hold jobs back: attempt limits, back-off, concurrency, rate.

Attempt limits (`max-reserves`, `max-timeouts`) and back-off
(`timeout-backoff`, `release-backoff`) are decided here when a reservation
ends (its TTR ran out, a release, the worker's connection closed) and
written into one `Requeue` record that says, per job, ready / delayed
until T / buried with a reason / moved to a dead-letter tube: replay and a
replica apply the decision and never need the policy. Concurrency
(`max-reserved`) and rate (`max-rate`) are configuration carried into the
state by `Limits` records (`sync_limits`), so the state itself keeps them
and their token buckets, from record times: the queries that choose a job
(`best_ready`, `next_grant`) skip a tube at its limit, and the next token's
time is one of the state's deadlines. `reason_text` says why a job is held
back, in one place (`stats-job` with --extended-stats, the console).
"""

from __future__ import annotations

from typing import Protocol

from smallstalk.core import records as r
from smallstalk.core.explain import iso as _iso
from smallstalk.core.model import Job
from smallstalk.core.state import NS, State
from smallstalk.server.policy import Policies, TubePolicy


class Loop(Protocol):
    """What the policies read and call of the mutation loop (loop.MutationLoop)."""

    state: State
    policies: Policies
    read_only: str | None
    now: int

    def log(self, cls: type, *fields) -> r.Record: ...

    def count_tube(self, tube: str, name: str) -> None: ...


def backoff_seconds(base_cap: tuple[int, int], n: int) -> int:
    """base·2^(n−1), at most the cap; n is the count of failures so far (>= 1)."""
    base, cap = base_cap
    if n > 40:  # 2^40 seconds is past any cap
        return cap
    return min(base << max(n - 1, 0), cap)


def _exhausted(pol: TubePolicy, j: Job, cause: int) -> str:
    """The reason an attempt limit stops the job, or "" when none does."""
    if pol.max_reserves and j.reserves >= pol.max_reserves:
        return f"exhausted: reserved {j.reserves} times (max-reserves {pol.max_reserves})"
    if cause == r.REQUEUE_TIMEOUT and pol.max_timeouts and j.timeouts + 1 >= pol.max_timeouts:
        return (f"exhausted: TTR ran out {j.timeouts + 1} times "
                f"(max-timeouts {pol.max_timeouts})")
    return ""


def move_for(pol: TubePolicy, j: Job, cause: int, now: int,
             delay: int = 0) -> tuple[int, int, str, str] | None:
    """The Requeue move for a job leaving its reservation, None when the
    policy changes nothing (ready at once, or the release's own delay)."""
    to = pol.exhausted_to()
    if to is not None:
        reason = _exhausted(pol, j, cause)
        if reason:
            return (j.id, 0, to, reason + (f"; moved from {j.tube.name}" if to else ""))
    if cause == r.REQUEUE_TIMEOUT and pol.timeout_backoff[0]:
        secs = backoff_seconds(pol.timeout_backoff, j.timeouts + 1)
        return (j.id, now + secs * NS, "", "")
    if cause == r.REQUEUE_RELEASE and not delay and pol.release_backoff[0]:
        secs = backoff_seconds(pol.release_backoff, j.releases + 1)
        return (j.id, now + secs * NS, "", "")
    return None


def _count(lp: Loop, j: Job, move: tuple[int, int, str, str]) -> None:
    _, until, to, reason = move
    if reason:
        lp.count_tube(j.tube.name, "jobs-dead-lettered" if to else "jobs-exhausted")
    elif until:
        lp.count_tube(j.tube.name, "jobs-backed-off")


def log_timeouts(lp: Loop, due: list[int]) -> None:
    """The reservations whose TTR ran out: one Timeout record when no policy
    touches them (the common case), else one Requeue record for all."""
    st, policies, now = lp.state, lp.policies, lp.now
    moves = []
    touched = False
    for jid in due:
        j = st.jobs[jid]
        pol = policies.of(j.tube.name)
        move = None
        if pol.holds_back:
            move = move_for(pol, j, r.REQUEUE_TIMEOUT, now)
        if move is None:
            moves.append((jid, 0, "", ""))
        else:
            touched = True
            _count(lp, j, move)
            moves.append(move)
    if touched:
        lp.log(r.Requeue, 0, r.REQUEUE_TIMEOUT, 0, moves)
    else:
        lp.log(r.Timeout, due)


def release(lp: Loop, conn: int, j: Job, pri: int, delay: int) -> bool:
    """A release the tube's policy decides (back-off, an attempt limit):
    logged as a Requeue, True. False: a plain Release is the caller's."""
    pol = lp.policies.of(j.tube.name)
    if not pol.holds_back:
        return False
    move = move_for(pol, j, r.REQUEUE_RELEASE, lp.now, delay)
    if move is None:
        return False
    _count(lp, j, move)
    lp.log(r.Requeue, conn, r.REQUEUE_RELEASE, pri, [move])
    return True


def before_disconnect(lp: Loop, conn: int) -> None:
    """A closing connection's reservations that an attempt limit stops (a
    worker that dies on a job each time it takes it): a Requeue before the
    Disconnect record, which makes the rest ready."""
    st = lp.state
    c = st.conn(conn)
    if c is None or not c.reserved:
        return
    moves = []
    for jid in sorted(c.reserved):
        j = st.jobs[jid]
        pol = lp.policies.of(j.tube.name)
        if pol.holds_back and pol.exhausted_to() is not None:
            reason = _exhausted(pol, j, r.REQUEUE_DISCONNECT)
            if reason:
                to = pol.exhausted_to()
                move = (jid, 0, to, reason + (f"; moved from {j.tube.name}" if to else ""))
                _count(lp, j, move)
                moves.append(move)
    if moves:
        lp.log(r.Requeue, conn, r.REQUEUE_DISCONNECT, 0, moves)


def wanted_limits(policies: Policies) -> dict[str, tuple[int, int, int]]:
    """tube -> (max_reserved, rate, period ns) as the configuration sets them."""
    out = {}
    for name, pol in policies.tubes.items():
        rate, per = pol.max_rate
        if pol.max_reserved or rate:
            out[name] = (pol.max_reserved, rate, per * NS)
    return out


def limits_changes(st: State, policies: Policies) -> list[tuple[str, int, int, int]]:
    """The Limits records that make the state's limits the configuration's."""
    want = wanted_limits(policies)
    out = []
    for name in sorted(set(want) | set(st.limits)):
        w = want.get(name, (0, 0, 0))
        lim = st.limits.get(name)
        have = (lim.max_reserved, lim.rate, lim.period) if lim is not None else (0, 0, 0)
        if w != have:
            out.append((name, *w))
    return out


def sync_limits(lp: Loop) -> None:
    """Log a Limits record for every tube whose limits the configuration
    changed (at start, after a reload, on promotion); a replica logs none."""
    if lp.read_only:
        return
    for fields in limits_changes(lp.state, lp.policies):
        lp.log(r.Limits, *fields)


def reason_text(st: State, jid: int, now: int) -> str:
    """Why job `jid` is held back, in words ("" when nothing holds it)."""
    held = st.held_back(jid, now)
    if held is None:
        return ""
    kind, value = held
    if kind == "exhausted":
        return str(value)
    if kind == "backoff":
        return f"backing off until {_iso(int(value))}"
    if kind == "concurrency":
        return f"tube at its concurrency limit (max-reserved {value})"
    if kind == "rate":
        return f"tube out of rate tokens until {_iso(int(value))}"
    return f"tube paused until {_iso(int(value))}"
