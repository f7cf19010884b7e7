"""The reserve's and the delete's fast paths held to the general one.

In memory the loop applies a Reserve or a Delete with `State.apply_reserve`
and `State.apply_delete`, without the record (`loop.log_job`). Each must
leave exactly the state `State.apply(Reserve(...))` / `apply(Delete(...))`
leaves, and refuse exactly what it refuses with the same message (after the
same partial effects: a record's seq and time, a connection it mentions).
Hypothesis draws workloads of puts, reserves and deletes of any job by any
connection (reserved by another, buried, delayed, gone), among releases,
buries, kicks, waits, watches, pauses, limits and disconnects.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from smallstalk.core import records as r
from smallstalk.core.state import State, StateError
from smallstalk.storage.encoder import LiveEncoder

from .test_put_fastpath import fingerprint

T0 = 1_700_000_000 * 10**9
S = 10**9
TUBES = hs.sampled_from(["default", "a", "b"])


def fast(st: State, rec) -> None:
    if type(rec) is r.Reserve:
        st.apply_reserve(rec.seq, rec.time, rec.conn, rec.id)
    elif type(rec) is r.Delete:
        st.apply_delete(rec.seq, rec.time, rec.conn, rec.id)
    else:
        st.apply(rec)


@hs.composite
def workloads(draw) -> list:
    recs = []
    seq = 0
    for _ in range(draw(hs.integers(1, 40))):
        seq += draw(hs.sampled_from([1, 1, 1, 0, -1]))  # 0, -1: a seq not after the last
        time = T0 + draw(hs.integers(0, 100)) * S
        conn = draw(hs.integers(1, 4))
        jid = draw(hs.integers(1, 14))
        kind = draw(hs.sampled_from(["put", "put", "reserve", "reserve", "reserve", "delete",
                                     "delete", "delete", "release", "bury", "kick", "watch", "use", "pause", "limits", "disconnect"]))
        if kind == "put":
            rec = r.Put(seq, time, conn, jid, draw(TUBES), draw(hs.sampled_from([0, 1024, 5])),
                        draw(hs.sampled_from([0, 0, 3])), draw(hs.sampled_from([0, 1, 60])),
                        b"x" * draw(hs.integers(0, 5)))
        elif kind == "reserve":
            rec = r.Reserve(seq, time, conn, jid)
        elif kind == "delete":
            rec = r.Delete(seq, time, conn, jid)
        elif kind == "release":
            rec = r.Release(seq, time, conn, jid, 7, draw(hs.sampled_from([0, 2])))
        elif kind == "bury":
            rec = r.Bury(seq, time, conn, jid, 3)
        elif kind == "kick":
            rec = r.Kick(seq, time, conn, [jid])
        elif kind == "watch":
            rec = r.Watch(seq, time, conn, draw(TUBES))
        elif kind == "use":
            rec = r.Use(seq, time, conn, draw(TUBES))
        elif kind == "pause":
            rec = r.PauseTube(seq, time, conn, draw(TUBES), 5)
        elif kind == "limits":
            rec = r.Limits(seq, time, draw(TUBES), draw(hs.sampled_from([0, 2])),
                           draw(hs.sampled_from([0, 3])), 10 * S)
        else:
            rec = r.Disconnect(seq, time, conn)
        recs.append(rec)
    return recs


def _apply(st: State, rec, how) -> str | None:
    try:
        how(st, rec)
    except StateError as e:
        return str(e)
    return None


@given(workloads())
@settings(max_examples=200, deadline=None)
def test_apply_reserve_and_delete_are_apply_of_their_records(recs: list) -> None:
    slow, quick = State(), State()
    for rec in recs:
        expected = _apply(slow, rec, State.apply)
        assert _apply(quick, rec, fast) == expected, rec
        if type(rec) in (r.Reserve, r.Delete):
            assert fingerprint(quick) == fingerprint(slow), rec
    quick.check()
    assert fingerprint(quick) == fingerprint(slow)


@pytest.mark.parametrize("rec, message", [
    (r.Reserve(9, T0, 1, 99), "job 99 does not exist"),
    (r.Reserve(9, T0, 2, 2), "job 2 is already reserved"),
    (r.Delete(9, T0, 2, 2), "job 2 is reserved by another connection"),
    (r.Delete(9, T0, 3, 99), "job 99 does not exist"),
    (r.Delete(4, T0, 1, 1), "record seq 4 is not after 4"),
])
def test_the_fast_paths_refuse_as_apply_does(rec, message: str) -> None:
    setup = [r.Put(1, T0, 1, 1, "default", 1, 0, 1, b"a"),
             r.Put(2, T0, 1, 2, "a", 1, 0, 1, b"b"), r.Watch(3, T0, 1, "a"),
             r.Reserve(4, T0, 1, 2)]
    slow, quick = State(), State()
    for st in (slow, quick):
        for s in setup:
            st.apply(s)
    assert _apply(slow, rec, State.apply) == message
    assert _apply(quick, rec, fast) == message
    assert fingerprint(quick) == fingerprint(slow)


def test_a_reserve_then_delete_leaves_what_the_records_leave() -> None:
    """The everyday pair, from a job put to its delete, step by step."""
    slow, quick = State(), State()
    recs = [r.Put(1, T0, 1, 1, "default", 1024, 0, 60, b"body"),
            r.Reserve(2, T0 + S, 2, 1), r.Delete(3, T0 + 2 * S, 2, 1)]
    for rec in recs:
        slow.apply(rec)
        fast(quick, rec)
        assert fingerprint(quick) == fingerprint(slow)
    assert not quick.jobs and quick.tubes["default"].cmd_delete == 1


def test_a_reserve_ends_the_connections_wait() -> None:
    """A waiting connection granted a job (the loop's grant logs a Reserve)."""
    slow, quick = State(), State()
    recs = [r.Watch(1, T0, 2, "a"), r.WaitStart(0, T0, 2, T0 + 5 * S),
            r.Put(2, T0, 1, 1, "a", 5, 0, 60, b"x"), r.Reserve(3, T0, 2, 1),
            r.Limits(4, T0, "a", 0, 2, 10 * S), r.Put(5, T0, 1, 2, "a", 5, 0, 60, b"y"),
            r.Reserve(6, T0 + S, 2, 2), r.Delete(7, T0 + S, 2, 1), r.Delete(8, T0 + S, 1, 2)]
    for rec in recs:
        assert _apply(quick, rec, fast) == _apply(slow, rec, State.apply), rec
        assert fingerprint(quick) == fingerprint(slow), rec
    assert quick.limits["a"].tat == slow.limits["a"].tat > 0


ENCODER = LiveEncoder()


@given(kind=hs.sampled_from([r.Reserve, r.Delete]), seq=hs.integers(0, 2**64 - 1),
       time=hs.integers(0, 2**64 - 1), conn=hs.integers(0, 2**64 - 1),
       id=hs.integers(0, 2**64 - 1))
@settings(max_examples=200)
def test_encode_job_is_encode_of_its_record(kind: type, seq: int, time: int, conn: int,
                                            id: int) -> None:
    """With a journal the loop stages `LiveEncoder.job`'s bytes (commit.stage_job); one
    encoder across examples, as the commit keeps one."""
    assert ENCODER.job(kind, seq, time, conn, id) == r.encode(kind(seq, time, conn, id))


@pytest.mark.parametrize("last", [r.Reserve, r.Delete])
def test_the_fast_paths_compact_heaps_where_apply_does(last: type) -> None:
    """Every 65,536th seq compacts the heaps (past 1,024 stale entries they
    go): at a reserve's or a delete's seq too."""
    n = 1100
    seq = 0x10000 - 2 * n
    recs = []
    for jid in range(1, n + 2):
        recs.append(r.Put(seq, T0, 1, jid, "default", 1, 0, 60, b"a"))
        seq += 1
    for jid in range(1, n):  # each leaves its ready-heap entry stale
        recs.append(r.Reserve(seq, T0, 1, jid))
        seq += 1
    assert seq == 0x10000
    recs.append(last(seq, T0, 1, n + 1 if last is r.Reserve else 1))
    slow, quick = State(), State()
    for rec in recs:
        slow.apply(rec)
        fast(quick, rec)
    assert fingerprint(quick) == fingerprint(slow)
    assert len(slow.tubes["default"].ready) < n  # compacted
