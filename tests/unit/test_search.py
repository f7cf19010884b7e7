"""core/search.py on a pure State: the scan by id and the listed scan find
the same jobs as a brute-force filter, slice by slice within the bounds; a
job put after the scan started is not seen; key lookups."""

from __future__ import annotations

import random

import pytest

from smallstalk.core import records as r
from smallstalk.core import search
from smallstalk.core.model import STATE_BY_NAME
from smallstalk.core.state import State


def _state(n: int, seed: int) -> State:
    rnd = random.Random(seed)
    st = State()
    st.apply(r.Connect(0, 0, 1))
    seq = 0
    for jid in range(1, n + 1):
        seq += 1
        tube = rnd.choice(("a", "b"))
        body = rnd.choice((b"red", b"green", b"blue")) + b" %d" % jid
        st.apply_put(seq, 0, 1, jid, tube, 0, rnd.choice((0, 0, 100)), 60, body)
    for jid in rnd.sample(range(1, n + 1), n // 4):  # holes in the ids
        seq += 1
        st.apply(r.Delete(seq, 0, 1, jid))
    return st


def _brute(st: State, tube: str, state: str, needle: bytes, after: int) -> list[int]:
    return sorted(j.id for j in st.jobs.values() if j.tube.name == tube and j.id > after
                  and j.state == STATE_BY_NAME[state] and needle in j.body)


@pytest.mark.parametrize("small", [0, 10**6])  # scanned by id / listed whole
@pytest.mark.parametrize("state", ["ready", "delayed"])
def test_slices_find_what_a_filter_finds(monkeypatch, small: int, state: str) -> None:
    monkeypatch.setattr(search, "SMALL", small)
    st = _state(3000, 7)
    for after in (0, 1234):
        scan = search.Scan(st, "a", state, "substr", b"red", after, st.next_job_id)
        found: list[int] = []
        while not scan.done:
            found += scan.step(st, None, 10**6, probes=100)
            assert scan.probed <= 100
        assert found == _brute(st, "a", state, b"red", after)


def test_regex_matches_and_costs_more_per_job() -> None:
    st = _state(500, 3)
    scan = search.Scan(st, "b", "ready", "regex", rb"^(red|blue) \d*7$", 0, st.next_job_id)
    found: list[int] = []
    while not scan.done:
        found += scan.step(st, None, 10**6, probes=64)
        assert scan.probed + search.REGEX_COST * scan.examined <= 64 + search.REGEX_COST + 1
    assert found == [jid for jid in _brute(st, "b", "ready", b"", 0)
                     if st.jobs[jid].body.split()[0] in (b"red", b"blue")
                     and st.jobs[jid].body.endswith(b"7")]


def test_a_job_put_after_the_start_is_not_seen_and_want_stops_early() -> None:
    st = _state(100, 1)
    scan = search.Scan(st, "a", "ready", "substr", b"", 0, st.next_job_id)
    st.apply_put(10**6, 0, 1, st.next_job_id, "a", 0, 0, 60, b"late")
    found = []
    while not scan.done:
        found += scan.step(st, None, 10**6)
    assert found == [jid for jid in _brute(st, "a", "ready", b"", 0) if jid <= 100]
    scan = search.Scan(st, "a", "ready", "substr", b"", 0, st.next_job_id)
    assert len(scan.step(st, None, 3)) == 3 and not scan.done


def test_bad_patterns() -> None:
    st = State()
    with pytest.raises(search.SearchError, match="longer than"):
        search.matcher("regex", b"a" * (search.REGEX_MAX + 1))
    with pytest.raises(search.SearchError, match="bad regular expression"):
        search.matcher("regex", rb"(a)\1")  # no backreferences in RE2
    with pytest.raises(search.SearchError, match="empty key"):
        search.Scan(st, "t", "ready", "key", b"", 0, 1)
    with pytest.raises(search.SearchError, match="unknown state"):
        search.Scan(st, "t", "waiting", "substr", b"", 0, 1)
    # Only the first MATCH_BYTES of a body are looked at.
    has = search.matcher("substr", b"needle")
    assert has(b"needle" + b"x" * 10**6)
    assert not has(b"x" * search.MATCH_BYTES + b"needle")
