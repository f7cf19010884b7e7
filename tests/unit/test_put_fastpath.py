"""Recovery applies format-1 Puts from their decoded lists (`State.apply_put`),
everything else as records: the result must be the state the generic path
(`State.apply` of each decoded record) builds, down to the heaps' layout, and
damage must be reported exactly as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from smallstalk.core import records as r
from smallstalk.core.state import Job, State, StateError
from smallstalk.storage import aof, recovery, snapshot
from smallstalk.storage.aof import CorruptionError

T0 = 1_700_000_000 * 10**9
S = 10**9


def fingerprint(st: State) -> dict:
    """Everything a replay decides, including what `dump()` leaves out."""
    tubes = {}
    for name, t in st.tubes.items():
        tubes[name] = (
            list(t.ready), list(t.delayed), list(t.buried), t.ready_n, t.urgent_n,
            t.reserved_n, t.delayed_n, t.jobs_n, t.total_jobs, t.bytes_n, t.spilled_n,
            None if t.arrivals is None else list(t.arrivals), t.using_n, t.watching_n,
            t.expired_n, t.discarded_n, t.pause, t.unpause_at, t.cmd_delete, t.cmd_pause)
    jobs = {jid: (j.tube.name, j.pri, j.delay, j.ttr, j.body, j.state, j.created, j.deadline,
                  j.reserver, j.gen, j.counts) for jid, j in st.jobs.items()}
    conns = {cid: (c.use, list(c.watch), sorted(c.reserved), c.logged)
             for cid, c in st.conns.items()}
    return {
        "dump": list(st.dump()), "tubes": tubes, "order": list(st.tube_order), "jobs": jobs,
        "job_order": list(st.jobs), "conns": conns,
        "counters": (st.next_job_id, st.next_conn_id, st.last_seq, st.time, st.total_jobs,
                     st.job_timeouts, st.ready_n, st.urgent_n, st.reserved_n, st.delayed_n,
                     st.buried_n, st.body_bytes, st.spilled_bytes),
        "heaps": (list(st.delay_heap), list(st.ttr_heap), list(st.expiry_heap)),
        "expires": dict(st.expires), "fanout": {k: list(v) for k, v in st.fanout.items()},
    }


def put(seq: int, jid: int, tube: str = "default", pri: int = 100, delay: int = 0,
        ttr: int = 60, conn: int = 1, body: bytes = b"hello") -> r.Put:
    return r.Put(seq, T0 + seq * S, conn, jid, tube, pri, delay, ttr, body)


def fast(st: State, rec) -> None:
    if type(rec) is r.Put:
        st.apply_put(rec.seq, rec.time, rec.conn, rec.id, rec.tube, rec.pri, rec.delay,
                     rec.ttr, rec.body)
    else:
        st.apply(rec)


def workload() -> list:
    """Puts of every kind among other records: ready and delayed, urgent, ttr 0,
    new tubes and connections, a fanout tube, into tubes with a ready heap."""
    recs = [
        put(1, 1), put(2, 2, pri=5), put(3, 3, delay=10), put(4, 4, ttr=0, pri=2000),
        r.Use(5, T0 + 5 * S, 2, "a"), put(6, 5, tube="a", conn=2),
        r.Reserve(7, T0 + 7 * S, 1, 2),
        put(8, 6, tube="a", conn=2, delay=3),
        r.PutJobs(9, T0 + 9 * S, 2, [(7, "a")], 10, 0, 30, T0 + 99 * S, [5], b"pj"),
        put(10, 8, tube="a", conn=2), put(11, 9, tube="a+x", conn=3),
        r.Bury(12, T0 + 12 * S, 1, 2, 7), put(13, 10, conn=4, body=b""),
        r.Promote(14, T0 + 14 * S, [6]), put(15, 11, tube="a", pri=1),
        r.Kick(16, T0 + 16 * S, 1, [2]),
        r.Disconnect(17, T0 + 17 * S, 2), put(18, 12, tube="b", conn=5, delay=1),
    ]
    recs += [put(19 + i, 13 + i, tube=("a", "b", "default")[i % 3], pri=i % 7) for i in range(40)]
    return recs


def test_apply_put_equals_apply_put_record() -> None:
    slow, quick = State(), State()
    for st in (slow, quick):
        st.oldest_ready("default", 1)  # from now on "default" keeps its arrival order
    for rec in workload():
        slow.apply(rec)
        fast(quick, rec)
        quick.check()
        assert fingerprint(quick) == fingerprint(slow)


def test_apply_put_on_a_loaded_state() -> None:
    base = State()
    for rec in workload():
        base.apply(rec)
    items = list(base.dump())
    slow, quick = State.load(iter(items)), State.load(iter(items))
    seq, jid = base.last_seq + 1, base.next_job_id
    more = [put(seq, jid, tube="a"), put(seq + 1, jid + 1, delay=2, conn=9),
            put(seq + 2, jid + 2, tube="new", pri=0), put(seq + 3, jid + 3)]
    for rec in more:
        slow.apply(rec)
        fast(quick, rec)
        quick.check()
    assert fingerprint(quick) == fingerprint(slow)


def test_apply_put_compacts_heaps_where_apply_does() -> None:
    slow, quick = State(), State()
    for seq in range(1, 0x10000 + 3):
        rec = put(seq, seq, delay=seq % 2)
        slow.apply(rec)
        fast(quick, rec)
    assert fingerprint(quick) == fingerprint(slow)


@pytest.mark.parametrize("bad", [
    put(5, 2),  # id reused
    put(5, 1),  # id below next_job_id
    put(3, 9),  # seq not after the last
])
def test_apply_put_refuses_like_apply(bad: r.Put) -> None:
    slow, quick = State(), State()
    for rec in (put(1, 1), put(2, 2), put(4, 3)):
        slow.apply(rec)
        fast(quick, rec)
    with pytest.raises(StateError) as slow_err:
        slow.apply(bad)
    with pytest.raises(StateError) as quick_err:
        fast(quick, bad)
    assert str(quick_err.value) == str(slow_err.value)
    assert fingerprint(quick) == fingerprint(slow)


def write_segment(aof_dir: Path, recs: list) -> Path:
    aof_dir.mkdir(parents=True, exist_ok=True)
    w = aof.SegmentWriter(aof_dir, recs[0].seq)
    for rec in recs:
        w.append(r.encode(rec), rec.seq)
    w.write()
    w.close()
    return w.path


def generic_recover(data_dir: Path) -> State:
    """Recovery as it was before the fast path: every record built and applied."""
    aof_dir, snap_dir = recovery.paths(data_dir)
    snaps = aof.list_snapshots(snap_dir)
    st = snapshot.load(snaps[-1][1]) if snaps else State()
    for _first, path in aof.list_segments(aof_dir):
        for entry in aof.iter_segment(path):
            if isinstance(entry, aof.FrameScan):
                break
            recovery.apply_next(st, path, *entry)
    return st


def test_recover_puts_after_a_snapshot_like_the_generic_path(tmp_path: Path) -> None:
    recs = workload()
    base = State()
    for rec in recs[:20]:
        base.apply(rec)
    snapshot.write(tmp_path / "snapshots", base.last_seq, base.dump())
    # The segment repeats records the snapshot holds (skipped), then goes on.
    write_segment(tmp_path / "aof", recs[15:40])
    write_segment(tmp_path / "aof", recs[40:])
    got = recovery.recover(tmp_path, repair=False)
    got.state.check()
    assert got.records_replayed == len(recs) - 20
    assert fingerprint(got.state) == fingerprint(generic_recover(tmp_path))
    # until_seq stops on a Put as on any record
    part = recovery.recover(tmp_path, repair=False, until_seq=30)
    assert part.state.last_seq == 30


@pytest.mark.parametrize("bad, why", [
    (put(4, 3), "sequence gap: expected 3, found 4"),
    (put(3, 1), "record does not apply: job id 1 reused"),
])
def test_a_put_that_does_not_follow_is_reported_as_before(tmp_path: Path, bad: r.Put,
                                                           why: str) -> None:
    path = write_segment(tmp_path / "aof", [put(1, 1), put(2, 2), bad, put(bad.seq + 1, 9)])
    with pytest.raises(CorruptionError) as info:
        recovery.recover(tmp_path, repair=False)
    with pytest.raises(CorruptionError) as generic:
        generic_recover(tmp_path)
    assert str(info.value) == str(generic.value)
    assert info.value.path == path and info.value.why == why
    assert info.value.offset == generic.value.offset > aof.HEADER_SIZE


def test_a_segment_whose_first_put_is_not_its_first_seq(tmp_path: Path) -> None:
    aof_dir = tmp_path / "aof"
    aof_dir.mkdir()
    w = aof.SegmentWriter(aof_dir, 5)
    w.append(r.encode(put(1, 1)), 1)
    w.write()
    w.close()
    with pytest.raises(CorruptionError, match="header says first seq 5, first record has 1"):
        recovery.recover(tmp_path, repair=False)


def slots(j: Job) -> dict:
    out = {name: getattr(j, name) for name in Job.__slots__}
    out["tube"] = j.tube.name
    return out


def test_jobs_made_without_init_have_every_slot() -> None:
    """apply_put and State.load inline Job.__init__: every slot set, as __init__ sets it."""
    slow, quick = State(), State()
    rec = put(1, 1, ttr=0)
    slow.apply(rec)
    fast(quick, rec)
    made = quick.jobs[1]
    assert slots(made) == slots(slow.jobs[1])
    assert slots(made) == slots(Job(1, made.tube, 100, 0, 1, b"hello", T0 + S))
    loaded = State.load(iter(list(slow.dump())))
    assert slots(loaded.jobs[1]) == slots(made)


def test_is_put_list_picks_exactly_the_format_1_puts() -> None:
    for rec in workload():
        assert r.is_put_list(r.to_list(rec)) == (type(rec) is r.Put)
    # Values that equal 1 but are not the int 1 go the generic way (from_list
    # still makes a Put of them); a wrong length is not a Put.
    assert not r.is_put_list([1.0, *r.to_list(put(1, 1))[1:]])
    assert not r.is_put_list(r.to_list(put(1, 1))[:-1])
