"""The everyday put's fast path held to the general one.

The live put (`loop.log_put`) encodes with `LiveEncoder.put` and applies
with `State.apply_put`; recovery applies format-1 Puts from their decoded
lists with `State.apply_put` too, and `snapshot_codec.load` makes jobs without
`Job.__init__`. Each must give exactly what the general path gives
(`records.encode(Put(...))`, `State.apply(Put(...))`, `Job(...)`), down to the
heaps' layout, and damage must be reported exactly as before. Hypothesis
draws the puts (and records between them) for the two property tests.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from smallstalk.core import records as r
from smallstalk.core.model import Job
from smallstalk.core.state import BURIED, READY, RESERVED, State, StateError
from smallstalk.storage import aof, datadir, logread, recovery, snapshot, snapshot_codec
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.encoder import LiveEncoder

from ..support.segments import write_segment

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
        "dump": list(snapshot_codec.dump(st)), "tubes": tubes, "order": list(st.tube_order),
        "jobs": jobs,
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
    items = list(snapshot_codec.dump(base))
    slow, quick = snapshot_codec.load(iter(items)), snapshot_codec.load(iter(items))
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
    put(5, 1),  # the id of a live job, below next_job_id
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



def generic_recover(data_dir: Path) -> State:
    """Recovery as it was before the fast path: every record built and applied."""
    aof_dir, snap_dir = datadir.paths(data_dir)
    snaps = aof.list_snapshots(snap_dir)
    st = snapshot.load(snaps[-1][1]) if snaps else State()
    for _first, path in aof.list_segments(aof_dir):
        for entry in logread.iter_segment(path):
            if isinstance(entry, aof.FrameScan):
                break
            recovery.apply_next(st, path, *entry)
    return st


def test_recover_puts_after_a_snapshot_like_the_generic_path(tmp_path: Path) -> None:
    recs = workload()
    base = State()
    for rec in recs[:20]:
        base.apply(rec)
    snapshot.write(tmp_path / "snapshots", base.last_seq, snapshot_codec.dump(base))
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
    """apply_put and snapshot_codec.load inline Job.__init__: every slot set, as __init__ sets it."""
    slow, quick = State(), State()
    rec = put(1, 1, ttr=0)
    slow.apply(rec)
    fast(quick, rec)
    made = quick.jobs[1]
    assert slots(made) == slots(slow.jobs[1])
    assert slots(made) == slots(Job(1, made.tube, 100, 0, 1, b"hello", T0 + S))
    loaded = snapshot_codec.load(iter(list(snapshot_codec.dump(slow))))
    assert slots(loaded.jobs[1]) == slots(made)


def test_is_put_list_picks_exactly_the_format_1_puts() -> None:
    for rec in workload():
        assert r.is_put_list(r.to_list(rec)) == (type(rec) is r.Put)
    # Values that equal 1 but are not the int 1 go the generic way (from_list
    # still makes a Put of them); a wrong length is not a Put.
    assert not r.is_put_list([1.0, *r.to_list(put(1, 1))[1:]])
    assert not r.is_put_list(r.to_list(put(1, 1))[:-1])


U32, U64 = 2**32 - 1, 2**64 - 1
TUBE_NAMES = hs.sampled_from(["default", "a", "b", "a+x", "urgent-work"])
BODIES = hs.one_of(
    hs.binary(max_size=64), hs.binary(max_size=64), hs.binary(max_size=64),
    # a spilled body: a reference whose low 32 bits are the body's length
    hs.tuples(hs.integers(1, 2**20), hs.integers(0, 2**20)).map(lambda kn: (kn[0] << 32) | kn[1]),
)


# One encoder across examples, as the loop keeps one: its buffer is reused.
ENCODER = LiveEncoder()


@given(seq=hs.integers(1, U64), time=hs.integers(0, U64), conn=hs.integers(0, U64),
       id=hs.integers(1, U64), tube=hs.text(min_size=1, max_size=200), pri=hs.integers(0, U32),
       delay=hs.integers(0, U32), ttr=hs.integers(0, U32), body=hs.binary(max_size=300))
@settings(max_examples=300)
def test_encode_put_is_encode_of_a_put(seq: int, time: int, conn: int, id: int, tube: str,
                                       pri: int, delay: int, ttr: int, body: bytes) -> None:
    fields = (seq, time, conn, id, tube, pri, delay, ttr, body)
    assert ENCODER.put(*fields) == r.encode(r.Put(*fields))


def test_a_failed_encode_leaves_nothing_in_the_next_record() -> None:
    """A put whose body cannot be encoded raises, and the encoder's next
    record is exactly that record's bytes, nothing of the failed one's."""
    enc = LiveEncoder()
    with pytest.raises(cbor2.CBOREncodeError):
        enc.put(1, 2, 3, 4, "t", 5, 6, 7, object())  # type: ignore[arg-type]
    fields = (2, 2, 3, 5, "t", 5, 6, 7, b"x")
    assert enc.put(*fields) == r.encode(r.Put(*fields))


# Each field's values at CBOR's head-size edges and past them, and of types
# a hand-written writer could take for its own: cbor2 writes True, not 1, a
# float as a float, a body's int and a bytearray as themselves; texts ASCII
# or not, as long as a tube name may be and longer.
EDGE_INTS = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64,
             -1, -2**70, True, 1.0]
EDGE_TEXTS = ["t", "a" * 200, "a" * 255, "a" * 256, "é", "\udc80", 3]
EDGE_BODIES = [b"", b"x" * 23, b"y" * 24, b"z" * 255, b"w" * 256, b"v" * 65536, 5,
               bytearray(b"q")]
EVERYDAY = {  # the encoder's method: the record's code, then a valid value per field
    "put": (r.Put.CODE, (9, T0, 3, 7, "default", 1024, 0, 60, b"body")),
    "put_unique": (r.PUT_UNIQUE_ONE, (9, T0, 3, "default", "key", 60, 100, 7, 1024, 0, 60,
                                      b"body")),
    "job": (r.Delete.CODE, (9, T0, 3, 7)),
}


def _outcome(f, *args):
    try:
        return f(*args)
    except Exception as e:  # cbor2's error, whichever it is
        return type(e)


@pytest.mark.parametrize("method", sorted(EVERYDAY))
def test_each_field_at_cbors_edges_encodes_as_cbor2_does(method: str) -> None:
    """The compiled build writes the everyday records itself (`fixedcbor.pyx`)
    and leaves cbor2 what it does not write: each field alone at each edge
    gives cbor2's bytes of the record's list, or cbor2's error."""
    code, valid = EVERYDAY[method]
    enc = LiveEncoder()
    encode = getattr(enc, method)
    if method == "job":
        encode = lambda *fields: enc.job(r.Delete, *fields)  # noqa: E731
    checked = 0
    for i, v in enumerate(valid):
        edges = EDGE_TEXTS if type(v) is str else EDGE_BODIES if type(v) is bytes else EDGE_INTS
        for edge in edges:
            fields = list(valid)
            fields[i] = edge
            assert _outcome(encode, *fields) == _outcome(cbor2.dumps, [code, *fields]), fields
            checked += 1
    assert checked >= 4 * len(EDGE_INTS)


@hs.composite
def put_workloads(draw) -> list:
    """Puts of every kind (ready, delayed, urgent, ttr 0, spilled bodies, new
    tubes and connections, fanout tubes) with reserves, deletes, buries, kicks,
    use and disconnects between them, each valid for the state so far."""
    recs: list = []
    model = State()
    seq, time, next_id = 0, T0, 1
    for _ in range(draw(hs.integers(1, 40))):
        seq += draw(hs.integers(1, 3))
        time += draw(hs.integers(0, 3 * S))
        conn = draw(hs.integers(1, 4))
        kind = draw(hs.sampled_from(["put"] * 5 + ["reserve", "delete", "bury", "kick", "use",
                                                   "disconnect"]))
        ready = [j.id for j in model.jobs.values() if j.state == READY]
        rec = None
        if kind == "reserve" and ready:
            rec = r.Reserve(seq, time, conn, draw(hs.sampled_from(sorted(ready))))
        elif kind == "delete" and model.jobs:
            jid = draw(hs.sampled_from(sorted(model.jobs)))
            j = model.jobs[jid]
            rec = r.Delete(seq, time, j.reserver if j.state == RESERVED else conn, jid)
        elif kind == "bury":
            held = sorted(j.id for j in model.jobs.values() if j.state == RESERVED)
            if held:
                jid = draw(hs.sampled_from(held))
                rec = r.Bury(seq, time, model.jobs[jid].reserver, jid, draw(hs.integers(0, U32)))
        elif kind == "kick":
            buried = sorted(j.id for j in model.jobs.values() if j.state == BURIED)
            if buried:
                rec = r.Kick(seq, time, conn, [draw(hs.sampled_from(buried))])
        elif kind == "use":
            rec = r.Use(seq, time, conn, draw(TUBE_NAMES))
        elif kind == "disconnect":
            rec = r.Disconnect(seq, time, conn)
        if rec is None:
            rec = r.Put(seq, time, conn, next_id, draw(TUBE_NAMES),
                        draw(hs.sampled_from([0, 1023, 1024, 100, U32])),
                        draw(hs.sampled_from([0, 0, 1, 30])), draw(hs.sampled_from([0, 1, 60])),
                        draw(BODIES))
            next_id += draw(hs.integers(1, 3))
        model.apply(rec)
        recs.append(rec)
    return recs


def peeks(s: State) -> dict:
    """The id each tube's peek-ready, -delayed and -buried would show."""
    return {t: [None if j is None else j.id for j in (s.peek_ready(t), s.peek_delayed(t),
                                                       s.peek_buried(t))] for t in s.tubes}


@given(recs=put_workloads(), keep_arrivals=hs.booleans())
@settings(max_examples=150, deadline=None)
def test_apply_put_is_apply_of_a_put(recs: list, keep_arrivals: bool) -> None:
    slow, quick = State(), State()
    if keep_arrivals:
        for s in (slow, quick):
            s.oldest_ready("default", 1)  # "default" keeps its arrival order from now on
    for rec in recs:
        slow.apply(rec)
        fast(quick, rec)
    quick.check()
    assert fingerprint(quick) == fingerprint(slow)
    # The snapshot codec's inlined job creation, on the same state: from `job`
    # items (formats 1 and 2) and from a snapshot file's `jobs` items (format 3).
    items = list(snapshot_codec.dump(slow))
    loads = [snapshot_codec.load(iter(items))]
    if not any(isinstance(j.body, int) for j in slow.jobs.values()):
        # (a writer needs the body store to read spilled bodies, even empty ones)
        with tempfile.TemporaryDirectory() as tmp:
            loads.append(snapshot.load(snapshot.write(Path(tmp), slow.last_seq, items)))
    for loaded in loads:
        loaded.check()
        assert {jid: slots(j) for jid, j in loaded.jobs.items()} == {
            jid: {**slots(j), "gen": 0} for jid, j in slow.jobs.items()}
        assert list(snapshot_codec.dump(loaded)) == items
        assert peeks(loaded) == peeks(slow)


@given(seq=hs.integers(1, U64), time=hs.integers(0, U64), conn=hs.integers(0, U64),
       tube=hs.text(min_size=1, max_size=200), key=hs.text(min_size=1, max_size=200),
       unique_for=hs.integers(0, U32), keys_max=hs.integers(0, U32), id=hs.integers(1, U64),
       pri=hs.integers(0, U32), delay=hs.integers(0, U32), ttr=hs.integers(0, U32),
       body=hs.binary(max_size=300))
@settings(max_examples=200)
def test_encode_put_unique_is_encode_of_its_record(seq: int, time: int, conn: int, tube: str,
                                                   key: str, unique_for: int, keys_max: int,
                                                   id: int, pri: int, delay: int, ttr: int,
                                                   body: bytes) -> None:
    rec = r.PutUnique(seq, time, conn, tube, key, unique_for, keys_max, ((id, tube),), pri,
                      delay, ttr, 0, (), body)
    assert ENCODER.put_unique(seq, time, conn, tube, key, unique_for, keys_max, id, pri,
                              delay, ttr, body) == r.encode(rec)


def test_apply_put_unique_equals_apply_of_its_record() -> None:
    """The live keyed put's state change is the record's: the same jobs and
    keys, and a duplicate refused the same way."""
    fast, slow = State(), State()
    puts = [(1, T0, 1, "a", "k1", 60, 10, 1, 5, 0, 30, b"x"),
            (2, T0 + S, 1, "a", "k2", 60, 10, 2, 5, 3, 30, b"y"),
            (3, T0 + 2 * S, 2, "b", "k1", 0, 1, 3, 5, 0, 30, b"z")]
    for seq, time, conn, tube, key, window, kmax, jid, pri, delay, ttr, body in puts:
        fast.apply_put_unique(seq, time, conn, tube, key, window, kmax, jid, pri, delay, ttr,
                              body)
        slow.apply(r.PutUnique(seq, time, conn, tube, key, window, kmax, ((jid, tube),), pri,
                               delay, ttr, 0, (), body))
    assert fingerprint(fast) == fingerprint(slow)
    for st in (fast, slow):
        st.check()
        assert st.keys.find("a", "k1", T0 + 3 * S) == 1 and st.keys.find("b", "k1", T0) == 3
        with pytest.raises(StateError, match="is taken"):
            st.apply_put_unique(4, T0 + 3 * S, 1, "a", "k2", 60, 10, 4, 5, 0, 30, b"again")
