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
