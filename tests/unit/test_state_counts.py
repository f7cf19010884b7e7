"""State details `make mutation` found untested: stats-job counters that add up, and a
waiting connection that goes away."""

from __future__ import annotations

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
