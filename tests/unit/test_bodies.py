"""The body store of read-behind on its own: references, reads, replaced files, snapshots that
refer to body files, and the documented body index (the loop under a budget is in
tests/inproc/test_readbehind.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from smallstalk.core import records as r
from smallstalk.core.state import State, body_len
from smallstalk.storage import snapshot, snapshot_codec
from smallstalk.storage.bodies import BodyError, BodyStore, pack, resolve_items, unpack

from ..support.readbehind import in_memory, open_fds, rand_bodies


def test_reference_packing() -> None:
    ref = pack(7, (1 << 40) - 1, 65535)
    assert unpack(ref) == (7, (1 << 40) - 1, 65535)
    assert body_len(ref) == 65535
    with pytest.raises(ValueError):
        pack(1, 1 << 40, 1)


def test_store_reads_counts_references_and_closes_files(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = os.urandom(10_000)
    path.write_bytes(data)
    store = BodyStore()
    a = store.ref(path, 100, 50)
    b = store.ref(path, 5000, 4000)
    assert a >> 72 == b >> 72, "one file, one key"
    store.share(a)  # a fanout copy holds the same reference
    assert store.read(a) == data[100:150]
    assert store.read(b) == data[5000:9000]
    assert store.reads == 2
    fd_path = str(path)
    assert fd_path in open_fds()
    path.unlink()  # deleted (a compaction): still readable through the open fd
    assert store.read(b) == data[5000:9000]
    store.drop(a)
    store.drop(b)
    assert store.read(a) == data[100:150]
    assert store.files
    store.drop(a)  # the last holder
    assert not store.files
    assert not any(x.startswith(fd_path) for x in open_fds())
    with pytest.raises(BodyError):
        store.read(a)


def test_store_read_error_names_file_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 1000)
    store = BodyStore()
    ref = store.ref(path, 900, 100)
    os.truncate(path, 950)
    with pytest.raises(BodyError, match=r"f: 100 bytes at offset 900"):
        store.read(ref)
    assert store.read_errors == 1


def test_a_replaced_file_gets_a_new_key(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    path.write_bytes(b"old-bytes")
    store = BodyStore()
    old = store.ref(path, 0, 3)
    path.unlink()
    path.write_bytes(b"new-bytes")
    new = store.ref(path, 0, 3)
    assert old >> 72 != new >> 72
    assert store.read(old) == b"old"
    assert store.read(new) == b"new"


def test_snapshot_under_a_budget_refers_to_bodies_and_the_index_finds_them(tmp_path: Path) -> None:
    st = State()
    bodies = rand_bodies(60, 1, 5000)
    for i, b in enumerate(bodies, 1):
        st.apply(r.Put(i, 10**18, 1, i, "t" if i % 2 else "default", i, 0, 60, b))
    st.apply(r.Reserve(61, 10**18, 1, 3))
    st.apply(r.Bury(62, 10**18, 1, 3, 7))
    snap = snapshot.write_state(tmp_path, st, index=True)
    items = list(snapshot_codec.dump(st))
    # Unbudgeted: exactly what was written.
    assert list(snapshot.iter_items(snap)) == items
    store = BodyStore(20_000)
    loaded = snapshot.load(snap, store)
    loaded.check()
    assert 0 < in_memory(loaded) <= 20_000
    assert loaded.spilled_bytes > 0
    assert list(resolve_items(snapshot_codec.dump(loaded), store)) == items
    # The index: every job's body, where it is in the snapshot file.
    entries = snapshot.index_entries(snapshot.index_path(snap))
    data = snap.read_bytes()
    seen = set()
    for jid, offset, length in snapshot.BODY_INDEX_ENTRY.iter_unpack(entries):
        assert data[offset:offset + length] == bodies[jid - 1]
        seen.add(jid)
    assert seen == set(range(1, 61))
    # A tube budget alone.
    store = BodyStore(0, lambda t: 3000 if t == "t" else 0)
    loaded = snapshot.load(snap, store)
    assert loaded.tubes["t"].bytes_n - loaded.tubes["t"].spilled_n <= 3000
    assert loaded.tubes["default"].spilled_n == 0


def test_body_index_is_documented() -> None:
    """snapshots/README.md's body index section against the code."""
    text = (Path(__file__).resolve().parents[2] / "snapshots" / "README.md").read_text()
    section = text.split("## Body index (read-behind)", 1)[1].split("\n## ", 1)[0]
    assert "`SSTKBDX\\0` (53 53 54 4B 42 44 58 00)" in section
    assert snapshot.BODY_INDEX_MAGIC == bytes.fromhex("53 53 54 4B 42 44 58 00")
    rows = [ln.split("|")[1:5] for ln in section.splitlines()
            if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    layout = [(int(o), int(n), t.strip()) for o, n, t, _ in rows]
    assert layout == [(0, 8, "u64"), (8, 8, "u64"), (16, 4, "u32")]
    assert snapshot.BODY_INDEX_ENTRY.format == "<QQI" and snapshot.BODY_INDEX_ENTRY.size == 20
    assert f"{snapshot.BODY_INDEX_ENTRY.size}-byte entry" in section
