"""Snapshot format 3: jobs stored many to a frame in `jobs` items (issue #4, restart time).

A round trip through the writer and the loader keeps every part of the state;
bodies read back under a budget are byte-exact; damage in a batch frame stops
start-up naming file, offset and seq; and a file of `job` items (formats 1 and
2, or a replica's copy of an older primary's snapshot under its own header)
still loads.
"""

from __future__ import annotations

from pathlib import Path

import cbor2
import pytest

from smallstalk.core import records
from smallstalk.core import records as r
from smallstalk.core.state import BURIED, DELAYED, READY, RESERVED, State
from smallstalk.storage import aof, history, snapshot, snapshot_codec
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.bodies import BodyStore, resolve_items
from smallstalk.storage.recovery import recover

T0 = 1_700_000_000 * 10**9
NS = 10**9


def rich_state() -> State:
    """Jobs in every state, with expiry, fanout, paused tubes, conns and epochs;
    enough jobs and bytes for several `jobs` items, split both ways."""
    st = State()
    seq = 0

    def apply(cls, *fields) -> None:
        nonlocal seq
        seq += 1
        st.apply(cls(seq, T0 + seq, *fields))

    apply(r.NewEpoch, 1, "0123456789abcdef")
    apply(r.Use, 1, "orders+audit")  # registers a fanout tube of "orders"
    apply(r.Use, 2, "emails")
    jid = 0
    for i in range(300):
        jid += 1
        # bodies of every CBOR head length: 0, <24, <256, <65536 bytes
        body = bytes([i % 251]) * (0, 5, 23, 24, 255, 256, 3000)[i % 7]
        apply(r.Put, 2, jid, "emails" if i % 3 else "default", i, 0, 60, body)
    for size in (700_000, 500_000, 1 << 20, 10):  # past the per-item byte bound
        jid += 1
        apply(r.Put, 2, jid, "big", 5, 0, 60, b"B" * size)
    jid += 1
    apply(r.PutJobs, 2, ((jid, "orders"), (jid + 1, "orders+audit")), 7, 0, 60,
          T0 + 3600 * NS, (), b"fanned out")
    jid += 1
    apply(r.Put, 2, jid + 1, "emails", 9, 120, 60, b"delayed")
    apply(r.Reserve, 2, 4)
    apply(r.Reserve, 1, 5)
    apply(r.Bury, 1, 5, 11)
    apply(r.Reserve, 2, 7)
    apply(r.Bury, 2, 7, 12)
    apply(r.Reserve, 2, 2)
    apply(r.Release, 2, 2, 3, 30)
    apply(r.PauseTube, 2, "emails", 10)
    apply(r.Watch, 2, "big")
    apply(r.Reserve, 2, jid - 3)  # a big body, reserved
    st.check()
    return st


def frames(path: Path) -> list[tuple[int, list]]:
    out = []
    for offset, _seq, payload in snapshot.iter_frames(path):
        item = cbor2.loads(payload)
        out.append((offset, item))
        if item[0] == "end":
            return out
    raise AssertionError("no end")


def test_round_trip_keeps_the_state(tmp_path: Path) -> None:
    st = rich_state()
    items = list(snapshot_codec.dump(st))
    states = {j.state for j in st.jobs.values()}
    assert states == {READY, DELAYED, RESERVED, BURIED} and st.expires and st.fanout
    snap = snapshot.write_state(tmp_path, st)
    head = snap.read_bytes()[:aof.HEADER_SIZE]
    assert aof.HEADER.unpack_from(head)[1] == records.FORMAT_VERSION >= 3  # "jobs" items since format 3
    got = frames(snap)
    kinds = [item[0] for _o, item in got]
    assert "job" not in kinds
    batches = [item for _o, item in got if item[0] == "jobs"]
    assert sum(len(b[1]) for b in batches) == len(st.jobs)
    assert max(len(b[1]) for b in batches) == snapshot.JOBS_PER_ITEM
    # the byte bound closed items early: one of the 1 MiB bodies is alone
    assert any(len(b[1]) == 1 and len(b[2][0]) == 1 << 20 for b in batches)
    assert got[-1][1] == ["end", len(got) - 1]
    loaded = snapshot.load(snap)
    loaded.check()
    assert list(snapshot_codec.dump(loaded)) == items
    assert loaded.expires == st.expires and loaded.fanout == st.fanout
    assert {j.id: j.state for j in loaded.jobs.values()} == {
        j.id: j.state for j in st.jobs.values()}
    # Readers other than State.load see one `job` item per job, as before.
    assert snapshot.read_items(snap) == (st.last_seq, items)
    assert list(history.iter_snapshot(snap)) == items


def test_bodies_under_a_budget_are_byte_exact(tmp_path: Path) -> None:
    st = rich_state()
    want = {j.id: j.body for j in st.jobs.values()}
    snap = snapshot.write_state(tmp_path, st, index=True)
    data = snap.read_bytes()
    for budget in (1, 50_000, 2_000_000):
        store = BodyStore(budget)
        loaded = snapshot.load(snap, store)
        loaded.check()
        spilled = [j for j in loaded.jobs.values() if type(j.body) is int]
        assert spilled and loaded.body_bytes - loaded.spilled_bytes <= budget
        for j in spilled:
            assert store.read(j.body) == want[j.id], j.id
        want_items = list(snapshot_codec.dump(st))
        assert list(resolve_items(snapshot_codec.dump(loaded), store)) == want_items
        store.close()
    entries = snapshot.index_entries(snapshot.index_path(snap))
    seen = []
    for jid, offset, length in snapshot.BODY_INDEX_ENTRY.iter_unpack(entries):
        assert length == len(want[jid]) and data[offset:offset + length] == want[jid]
        seen.append(jid)
    assert seen == [item[1] for item in snapshot_codec.dump(st) if item[0] == "job"]


def test_damage_in_a_jobs_frame_names_file_offset_and_seq(tmp_path: Path) -> None:
    st = rich_state()
    snap_dir = tmp_path / "snapshots"
    snap = snapshot.write_state(snap_dir, st)
    good = snap.read_bytes()
    offset, item = [(o, i) for o, i in frames(snap) if i[0] == "jobs"][1]
    raw = bytearray(good)
    raw[offset + aof.FRAME.size + 40] ^= 0x01  # inside the second jobs item's rows
    snap.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError) as info:
        recover(tmp_path, repair=False)
    e = info.value
    assert (e.path, e.offset, e.seq) == (snap, offset, st.last_seq)
    assert "checksum mismatch" in str(e) and f"offset {offset}" in str(e)
    assert f"seq {st.last_seq}" in str(e)
    # Cut inside a jobs frame: an incomplete snapshot, never a shorter state.
    snap.write_bytes(good[:offset + 100])
    with pytest.raises(CorruptionError) as info:
        recover(tmp_path, repair=False)
    assert (info.value.path, info.value.offset) == (snap, offset)


def test_a_malformed_jobs_item_is_damage(tmp_path: Path) -> None:
    st = rich_state()
    items = []
    for item in snapshot_codec.dump(st):
        items.append(item)
    meta, rest = items[0], items[1:]
    jobs = [i for i in rest if i[0] == "job"]
    others = [i for i in rest if i[0] != "job"]
    rows = [j[1:6] + j[7:] for j in jobs]
    bodies = [j[6] for j in jobs]
    bad = [
        ["jobs", rows, bodies[:-1]],  # a body short
        ["jobs", [row[:-1] for row in rows], bodies],  # rows without expires
        ["jobs", rows],
    ]
    for n, item in enumerate(bad):
        path = tmp_path / f"{n}" / aof.snapshot_name(st.last_seq)
        path.parent.mkdir()
        payloads = [cbor2.dumps(i) for i in [meta, *others, item]]
        offset = aof.HEADER_SIZE + sum(aof.FRAME.size + len(p) for p in payloads[:-1])
        path.write_bytes(aof.header(aof.SNAPSHOT_MAGIC, st.last_seq)
                         + b"".join(map(aof.frame, payloads))
                         + aof.frame(cbor2.dumps(["end", len(payloads)])))
        with pytest.raises(CorruptionError) as info:
            snapshot.load(path)
        assert info.value.path == path and info.value.seq == st.last_seq
        with pytest.raises(CorruptionError) as info:
            snapshot.read_items(path)
        assert (info.value.path, info.value.offset) == (path, offset), n
        assert "malformed jobs item" in str(info.value)
        with pytest.raises(CorruptionError) as info:
            list(history.iter_snapshot(path))
        assert (info.value.path, info.value.offset) == (path, offset), n


def test_job_items_under_a_format_3_header_load(tmp_path: Path) -> None:
    """A replica writes its primary's frames under its own header: a format-2
    primary's `job` items come under a format-3 header, and load the same."""
    st = rich_state()
    items = list(snapshot_codec.dump(st))
    path = tmp_path / aof.snapshot_name(st.last_seq)
    path.write_bytes(aof.header(aof.SNAPSHOT_MAGIC, st.last_seq)
                     + b"".join(aof.frame(cbor2.dumps(i)) for i in items)
                     + aof.frame(cbor2.dumps(["end", len(items)])))
    loaded = snapshot.load(path)
    loaded.check()
    assert list(snapshot_codec.dump(loaded)) == items
    store = BodyStore(10_000)
    loaded = snapshot.load(path, store)
    assert loaded.spilled_bytes and list(resolve_items(snapshot_codec.dump(loaded), store)) == items
    store.close()
