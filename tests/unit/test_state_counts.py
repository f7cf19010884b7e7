"""State details `make mutation` found untested: stats-job counters that add up, and a
waiting connection that goes away; the timer queries against walks over every waiter."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as hs

from smallstalk.core import records as r
from smallstalk.core.state import State


def apply(st: State, *recs) -> None:
    for rec in recs:
        st.apply(rec)


def test_releases_and_buries_count_every_time() -> None:
    st = State()
    apply(st, r.Connect(0, 1, 1), r.Put(1, 1, 1, 1, "default", 0, 0, 60, b"job"),
          r.Reserve(2, 1, 1, 1), r.Release(3, 1, 1, 1, 0, 0),
          r.Reserve(4, 1, 1, 1), r.Release(5, 1, 1, 1, 0, 0),
          r.Reserve(6, 1, 1, 1), r.Bury(7, 1, 1, 1, 0), r.Kick(8, 1, 1, (1,)),
          r.Reserve(9, 1, 1, 1), r.Bury(10, 1, 1, 1, 0))
    j = st.jobs[1]
    assert (j.releases, j.buries, j.reserves, j.kicks) == (2, 2, 4, 1)
    st.check()


def test_a_waiting_connection_that_disconnects_waits_no_more() -> None:
    st = State()
    apply(st, r.Connect(0, 1, 1), r.Connect(0, 1, 2), r.WaitStart(0, 1, 1, None),
          r.WaitStart(0, 1, 2, None))
    assert st.waiting_n == 2
    apply(st, r.Disconnect(1, 1, 1))
    assert st.waiting_n == 1 and 1 not in st.waiters and list(st.tubes["default"].waiting) == [2]
    st.check()


def test_might_be_due_is_false_only_when_nothing_is_due() -> None:
    """timers.run skips the due_* queries on False: it must never hide a due job."""
    s = 10**9

    def state() -> State:  # a job delayed 5 s, one reserved with TTR 10 s, at t=1 s
        st = State()
        apply(st, r.Connect(0, s, 1), r.Put(1, s, 1, 1, "default", 0, 5, 60, b"d"),
              r.Put(2, s, 1, 2, "default", 0, 0, 10, b"r"), r.Reserve(3, s, 1, 2))
        return st

    assert not State().might_be_due(10**18)
    seen = []
    for now in (s, 6 * s - 1, 6 * s, 11 * s, 11 * s + 1, 20 * s):
        st = state()
        maybe = st.might_be_due(now)
        due = st.due_promotions(now) + st.due_timeouts(now) + st.due_expiries(now)
        assert maybe == bool(due), now
        seen.append(due)
    assert seen == [[], [], [1], [1], [1, 2], [1, 2]]


def _ref_next_deadline(st: State, now: int) -> int | None:
    """Queries.next_deadline as it was: every waiter walked."""
    from smallstalk.core.model import DELAYED, READY, RESERVED, SAFETY_MARGIN

    times = []
    if st.expiry_heap and st._heap_top(st.expiry_heap, READY, DELAYED) is not None:
        times.append(st.expiry_heap[0][0])
    j = st._heap_top(st.delay_heap, DELAYED)
    if j is not None:
        times.append(j.deadline)
    j = st._heap_top(st.ttr_heap, RESERVED)
    if j is not None:
        times.append(j.deadline + 1)
    for c in st.waiters.values():
        if c.wait_deadline is not None:
            times.append(c.wait_deadline)
        if c.reserved:
            times.append(min(st.jobs[j].deadline for j in c.reserved) - SAFETY_MARGIN)
        for name in c.watch:
            if st.tubes[name].unpause_at > now:
                times.append(st.tubes[name].unpause_at)
            token = _ref_token_at(st, name)
            t = st.tubes[name]
            if token is not None and t.ready_n and token > now and not _ref_full(st, name):
                times.append(token)
    return min(times) if times else None


def _ref_token_at(st: State, name: str) -> int | None:
    """GCRA from its definition: a token once `tat - (period - period/rate)` has come."""
    lim = st.limits.get(name)
    if lim is None or not lim.rate:
        return None
    return lim.tat - (lim.period - lim.period // lim.rate)


def _ref_full(st: State, name: str) -> bool:
    lim = st.limits.get(name)
    return lim is not None and lim.max_reserved > 0 and (
        st.tubes[name].reserved_n >= lim.max_reserved)


def _ref_held(st: State, name: str, now: int) -> bool:
    token = _ref_token_at(st, name)
    return _ref_full(st, name) or (token is not None and now < token)


def _ref_next_grant(st: State, now: int) -> tuple | None:
    """The walk next_grant replaced: every tube, in creation order."""
    best = None
    for name in st.tube_order:
        t = st.tubes[name]
        if t.waiting and t.ready_n and not t.paused(now) and not _ref_held(st, name, now):
            j = st.peek_ready(name)
            if j is not None and (best is None or (j.pri, j.id) < (best[1].pri, best[1].id)):
                best = (t.waiting[0], j)
    return best


def _ref_waiters_due(st: State, now: int) -> list:
    out = []
    for c in st.waiters.values():
        if st.deadline_soon(c.id, now):
            out.append((c.id, True))
        elif c.wait_deadline is not None and c.wait_deadline <= now:
            out.append((c.id, False))
    return out


@given(hs.lists(hs.tuples(hs.integers(0, 7), hs.integers(1, 3), hs.integers(0, 4),
                          hs.integers(0, 3 * 10**9)), max_size=40))
@settings(max_examples=300, deadline=None)
def test_waiter_timers_match_a_walk_over_every_waiter(ops) -> None:
    """next_deadline, waiters_due and waiters_maybe_due keep the waiters' deadlines in
    a heap and a set instead of walking every waiting connection, and next_grant
    walks only the tubes someone waits on: same answers. Tube "b" may get
    concurrency and rate limits (Limits records): held back from grants and
    reserves, its next token one of the deadlines."""
    s = 10**9
    st = State()
    now, seq, jid = s, 0, 0

    def log(rec_cls, *fields) -> None:
        nonlocal seq
        seq += 1
        st.apply(rec_cls(seq, now, *fields))

    for cid in (1, 2, 3):
        st.apply(r.Connect(0, now, cid))
    for op, cid, k, step in ops:
        now += step
        c = st.conns[cid]
        if op == 0:
            jid += 1
            log(r.Put, cid, jid, "default" if k % 2 else "b", 0, 0, 1 + k, b"j")
        elif op == 1 and not c.waiting:
            j = st.best_ready(cid, now)
            ref = [st.peek_ready(n) for n in c.watch if st.tubes[n].ready_n
                   and not st.tubes[n].paused(now) and not _ref_held(st, n, now)]
            assert j == min((x for x in ref if x is not None),
                            key=lambda x: (x.pri, x.id), default=None)
            if j is not None:
                log(r.Reserve, cid, j.id)
        elif op == 2 and not c.waiting:
            st.apply(r.WaitStart(0, now, cid, None if k == 0 else now + k * s))
        elif op == 3 and c.waiting:
            st.apply(r.WaitStop(0, now, cid))
        elif op == 4 and "b" in st.tubes:
            log(r.PauseTube, cid, "b", k)
        elif op == 5 and c.reserved and not c.waiting:
            log(r.Delete, cid, min(c.reserved))
        elif op == 6 and not c.waiting and "b" not in c.watch:
            log(r.Watch, cid, "b")
        elif op == 7:
            log(r.Limits, "b", k % 3, k, 10 * s)
        due = st.due_timeouts(now)
        if due:
            log(r.Timeout, due)
        for at in (now, now + s // 2, now + 2 * s):
            assert st.next_deadline(at) == _ref_next_deadline(st, at)
            ref = _ref_waiters_due(st, at)
            assert st.waiters_due(at) == ref
            assert st.waiters_maybe_due(at) == bool(ref)
            assert st.next_grant(at) == _ref_next_grant(st, at)
        st.check()


def test_limits_hold_a_tube_back_from_reserves_and_grants() -> None:
    """Concurrency and rate limits as the state applies them: a full tube or
    an empty bucket is skipped like an empty tube, the next token is a
    deadline while someone waits, and a Limits record of zeros forgets them."""
    s = 10**9
    st = State()
    seq = 0

    def log(now: int, rec_cls, *fields) -> None:
        nonlocal seq
        seq += 1
        st.apply(rec_cls(seq, now, *fields))

    log(s, r.Limits, "default", 2, 3, 6 * s)  # 2 at once, 3 per 6 s: a token every 2 s
    for jid in range(1, 6):
        log(s, r.Put, 1, jid, "default", 0, 0, 60, b"x")
    log(s, r.Reserve, 1, 1)
    log(s, r.Reserve, 1, 2)
    assert st.best_ready(1, s) is None  # full
    assert st.held_back(3, s) == ("concurrency", 2)
    log(s, r.Delete, 1, 1)
    log(s, r.Reserve, 1, 3)  # the bucket's third token
    log(s, r.Delete, 1, 2)
    log(s, r.Delete, 1, 3)
    assert st.best_ready(1, s) is None  # no token until 2 s later
    assert st.held_back(4, s) == ("rate", 3 * s)
    st.apply(r.WaitStart(0, s, 2, None))
    assert st.next_grant(s) is None and st.next_deadline(s) == 3 * s
    assert st.next_grant(3 * s) == (2, st.jobs[4])
    log(3 * s, r.Reserve, 2, 4)
    assert st.best_ready(1, 4 * s) is None and st.best_ready(1, 5 * s).id == 5
    log(5 * s, r.Limits, "default", 0, 0, 0)
    assert not st.limits and st.held_back(5, 5 * s) is None
    st.check()
