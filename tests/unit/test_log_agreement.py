"""Start-up and `aof verify` give one verdict on a damaged directory: they read it with
one reader (logread.LogReader), so the file, offset and last good seq are the same."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from smallstalk.core import records as r
from smallstalk.core.state import State
from smallstalk.ops import verify
from smallstalk.storage import aof, datadir, logread, recovery, snapshot
from smallstalk.storage.aof import CorruptionError


def put(seq: int, body: bytes = b"body") -> bytes:
    return r.encode(r.Put(seq, seq, 1, seq, "default", 100, 0, 60, body))


def segment(data: Path, first: int, seqs: list[int]) -> Path:
    """A segment named and headed `first`, holding puts with `seqs` (as given, gaps and all)."""
    aof_dir = datadir.aof_dir(data)
    aof_dir.mkdir(parents=True, exist_ok=True)
    path = aof_dir / datadir.segment_name(first)
    path.write_bytes(aof.header(aof.SEGMENT_MAGIC, first)
                     + b"".join(aof.frame(put(s)) for s in seqs))
    return path


def offset_of(path: Path, seq: int) -> int:
    for entry in aof.read_frames(path.read_bytes()):  # frames only: no rule checked
        if not isinstance(entry, aof.FrameScan) and r.decode(entry[1]).seq == seq:
            return entry[0]
    raise AssertionError(seq)


def flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


def gap(d: Path) -> tuple[Path, int, int]:
    segment(d, 1, [1, 2, 3])
    return segment(d, 6, [6, 7]), aof.HEADER_SIZE, 3


def overlap(d: Path) -> tuple[Path, int, int]:  # two servers on one directory
    segment(d, 1, [1, 2, 3, 4, 5])
    return segment(d, 3, [3, 4, 5, 6]), aof.HEADER_SIZE, 5


def gap_inside_a_file(d: Path) -> tuple[Path, int, int]:
    first = segment(d, 1, [1, 2, 3, 5, 6])
    segment(d, 7, [7, 8])
    return first, offset_of(first, 5), 3


def mid_file_damage(d: Path) -> tuple[Path, int, int]:
    first = segment(d, 1, [1, 2, 3, 4])
    segment(d, 5, [5, 6])
    off = offset_of(first, 3)
    flip(first, off + aof.FRAME.size + 2)
    return first, off, 2


def damage_before_good_records_of_the_last_file(d: Path) -> tuple[Path, int, int]:
    segment(d, 1, [1, 2])
    last = segment(d, 3, [3, 4, 5])
    off = offset_of(last, 4)
    flip(last, off + aof.FRAME.size + 2)
    return last, off, 3


def bad_header(d: Path) -> tuple[Path, int, int]:
    segment(d, 1, [1, 2])
    middle = segment(d, 3, [3, 4])
    segment(d, 5, [5])
    flip(middle, 9)  # the version field: the header's CRC no longer checks out
    return middle, 0, 2


def snapshot_then_a_gap(d: Path) -> tuple[Path, int, int]:
    state = State()
    for s in range(1, 5):
        state.apply(r.decode(put(s)))
    snap_dir = datadir.paths(d)[1]
    aof.make_dirs(snap_dir)
    snapshot.write_state(snap_dir, state)
    return segment(d, 7, [7, 8]), aof.HEADER_SIZE, 4


STORIES: list[Callable[[Path], tuple[Path, int, int]]] = [
    gap, overlap, gap_inside_a_file, mid_file_damage,
    damage_before_good_records_of_the_last_file, bad_header, snapshot_then_a_gap]


@pytest.mark.parametrize("story", STORIES, ids=[s.__name__ for s in STORIES])
def test_recover_and_verify_name_the_same_damage(tmp_path: Path, story) -> None:
    data = tmp_path / "data"
    path, offset, last_good = story(data)
    before = {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}
    with pytest.raises(CorruptionError) as info:
        recovery.recover(data)  # repair allowed: damage is refused all the same
    e = info.value
    assert (e.path, e.offset, e.seq) == (path, offset, last_good), str(e)
    assert {p: p.read_bytes() for p in data.rglob("*") if p.is_file()} == before
    rep = verify.verify(data)
    assert not rep.ok
    assert rep.problems[0] == str(e), (rep.problems, str(e))
    assert [row[2] for row in rep.rows if row[1] == str(path)] == ["DAMAGED"]


def test_a_torn_tail_is_a_warning_to_both_at_the_same_offset(tmp_path: Path) -> None:
    data = tmp_path / "data"
    segment(data, 1, [1, 2])
    last = segment(data, 3, [3, 4])
    end = last.stat().st_size
    tail = aof.FRAME.pack(40, 0) + b"half a record"
    with open(last, "ab") as f:
        f.write(tail)
    rep = verify.verify(data)
    assert rep.ok and len(rep.warnings) == 1, rep.problems
    assert f"at offset {end}, after seq 4" in rep.warnings[0]
    got = recovery.recover(data, repair=False)
    assert got.state.last_seq == 4 and len(got.state.jobs) == 4
    assert got.warnings == [f"{last}: torn write at offset {end} after seq 4 "
                            f"({len(tail)} bytes, frame runs past the end of the file); truncated"]
    assert last.stat().st_size == end + len(tail)  # repair=False wrote nothing
    recovery.recover(data)
    assert last.stat().st_size == end and datadir.broken_path(last).read_bytes() == tail


def test_a_last_segment_without_a_whole_header_is_dropped_by_both(tmp_path: Path) -> None:
    data = tmp_path / "data"
    segment(data, 1, [1, 2])
    stub = datadir.aof_dir(data) / datadir.segment_name(3)
    stub.write_bytes(aof.header(aof.SEGMENT_MAGIC, 3)[:10])
    rep = verify.verify(data)
    assert rep.ok and rep.warnings == [f"{stub}: last segment has no complete header yet "
                                       f"(10 bytes)"]
    got = recovery.recover(data)
    assert got.state.last_seq == 2 and not stub.exists()


def test_the_reader_raises_the_first_break_and_collects_every_one(tmp_path: Path) -> None:
    data = tmp_path / "data"
    segment(data, 1, [1, 2])
    segment(data, 3, [3, 4])
    segment(data, 9, [9])
    segment(data, 12, [12, 13])
    paths = [p for _first, p in datadir.list_segments(datadir.aof_dir(data))]
    with pytest.raises(CorruptionError) as info:
        list(logread.LogReader(paths, 0).batches())
    collecting = logread.LogReader(paths, 0, keep_going=True)
    seqs = [rec.seq for _p, _d, _o, recs in collecting.batches() for rec in recs]
    assert seqs == [1, 2, 3, 4, 9, 12, 13]  # read on past each break
    assert [(p.path, p.offset, p.seq, p.why) for p in collecting.problems] == [
        (paths[2], aof.HEADER_SIZE, 4, "sequence gap: expected 5, found 9"),
        (paths[3], aof.HEADER_SIZE, 9, "sequence gap: expected 10, found 12")]
    assert str(collecting.problems[0]) == str(info.value)
    rep = verify.verify(data)
    assert rep.problems == [str(p) for p in collecting.problems]
