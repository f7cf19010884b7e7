"""Every reader of the log gives one verdict on a damaged directory: start-up, `aof verify`
and the streaming history reader (dump, replay, job-history) read it with one reader of
the log's rules (logread.LogReader), so the file, offset and last good seq are the same;
`aof ls`, which reads each segment on its own, names the same damage inside a segment."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from smallstalk.core import records as r
from smallstalk.core.state import State
from smallstalk.ops import ls, verify
from smallstalk.storage import aof, datadir, history, logread, recovery, snapshot
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


def gap_deep_inside_a_file(d: Path) -> tuple[Path, int, int]:
    """Past the first batch of records (aof.SEGMENT_BATCH) a reader decodes at a time."""
    first = segment(d, 1, [*range(1, 1101), *range(1102, 1201)])
    segment(d, 1201, [1201])
    return first, offset_of(first, 1102), 1100


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


def wrong_header_seq(d: Path) -> tuple[Path, int, int]:
    """A header (valid, with its CRC) that names another seq than its first record's."""
    segment(d, 1, [1, 2])
    middle = segment(d, 3, [3, 4])
    segment(d, 5, [5])
    raw = middle.read_bytes()
    middle.write_bytes(aof.header(aof.SEGMENT_MAGIC, 2) + raw[aof.HEADER_SIZE:])
    return middle, aof.HEADER_SIZE, 2


def torn_tail_in_a_closed_segment(d: Path) -> tuple[Path, int, int]:
    """Only the last segment may end torn: the same half frame earlier is damage."""
    first = segment(d, 1, [1, 2])
    end = first.stat().st_size
    with open(first, "ab") as f:
        f.write(aof.frame(put(3))[:-3])
    segment(d, 3, [3, 4])
    return first, end, 2


def header_only_closed_segment(d: Path) -> tuple[Path, int, int]:
    """Only the last segment may be shorter than its header."""
    segment(d, 1, [1, 2])
    stub = segment(d, 3, [])
    stub.write_bytes(stub.read_bytes()[:10])
    segment(d, 4, [4])
    return stub, 0, 2


def record_that_does_not_decode(d: Path) -> tuple[Path, int, int]:
    first = segment(d, 1, [1, 2])
    end = first.stat().st_size
    with open(first, "ab") as f:
        f.write(aof.frame(b"\xff\x00not cbor"))
    segment(d, 4, [4])
    return first, end, 2


def damage_past_the_first_read(d: Path) -> tuple[Path, int, int]:
    """The streaming reader reads a segment a CHUNK at a time: damage past the first."""
    aof_dir = datadir.aof_dir(d)
    aof_dir.mkdir(parents=True)
    big = aof_dir / datadir.segment_name(1)
    big.write_bytes(aof.header(aof.SEGMENT_MAGIC, 1) + b"".join(
        aof.frame(put(s, bytes([s]) * (aof.CHUNK // 3))) for s in range(1, 7)))
    segment(d, 7, [7])
    off = offset_of(big, 5)
    assert off > aof.CHUNK
    flip(big, off + aof.FRAME.size + 40)
    return big, off, 4


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


Story = Callable[[Path], tuple[Path, int, int]]
# Damage inside one segment: a reader of a segment on its own (ls) sees it too.
IN_A_FILE: list[Story] = [
    gap_inside_a_file, gap_deep_inside_a_file, mid_file_damage,
    damage_before_good_records_of_the_last_file,
    wrong_header_seq, torn_tail_in_a_closed_segment, header_only_closed_segment,
    record_that_does_not_decode, damage_past_the_first_read, bad_header]
STORIES: list[Story] = [gap, overlap, *IN_A_FILE, snapshot_then_a_gap]
STREAMED = [s for s in STORIES if s is not snapshot_then_a_gap]  # that one: below


def files_of(data: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}


@pytest.mark.parametrize("story", STORIES, ids=[s.__name__ for s in STORIES])
def test_recover_and_verify_name_the_same_damage(tmp_path: Path, story: Story) -> None:
    data = tmp_path / "data"
    path, offset, last_good = story(data)
    before = files_of(data)
    with pytest.raises(CorruptionError) as info:
        recovery.recover(data)  # repair allowed: damage is refused all the same
    e = info.value
    assert (e.path, e.offset, e.seq) == (path, offset, last_good), str(e)
    assert files_of(data) == before
    rep = verify.verify(data)
    assert not rep.ok
    assert rep.problems[0] == str(e), (rep.problems, str(e))
    assert [row[2] for row in rep.rows if row[1] == str(path)] == ["DAMAGED"]


@pytest.mark.parametrize("story", STREAMED, ids=[s.__name__ for s in STREAMED])
def test_the_streaming_reader_names_the_same_damage_as_start_up(tmp_path: Path,
                                                                 story: Story) -> None:
    """history.iter_records (dump, job-history; replay from a seq) streams the files
    with start-up's rules: the same error, and nothing written."""
    data = tmp_path / "data"
    story(data)
    before = files_of(data)
    with pytest.raises(CorruptionError) as info:
        recovery.recover(data, repair=False)
    for from_seq in (None, 2):
        with pytest.raises(CorruptionError) as streamed:
            list(history.iter_records(data, from_seq=from_seq, warn=pytest.fail))
        assert str(streamed.value) == str(info.value)
    assert files_of(data) == before


@pytest.mark.parametrize("story", IN_A_FILE, ids=[s.__name__ for s in IN_A_FILE])
def test_a_segment_read_on_its_own_shows_the_same_damage(tmp_path: Path, story: Story) -> None:
    data = tmp_path / "data"
    path, offset, _last_good = story(data)
    with pytest.raises(CorruptionError) as info:
        recovery.recover(data, repair=False)
    segs = datadir.list_segments(datadir.aof_dir(data))
    for i, (first, seg) in enumerate(segs):
        s = ls.summarize_segment(seg, first, seg.stat().st_size, i == len(segs) - 1)
        if seg == path:
            assert (s.status, s.why) == ("damaged", f"{info.value.why} at offset {offset}")
        else:
            assert s.status == "ok", (seg, s.why)


def test_streamed_and_whole_files_give_the_same_records(tmp_path: Path) -> None:
    data = tmp_path / "data"
    segment(data, 1, list(range(1, 1301)))
    last = segment(data, 1301, list(range(1301, 1401)))
    whole = [(p, o, rec) for p, _d, offsets, recs in logread.LogReader(
        [last.with_name(datadir.segment_name(1)), last], 0).batches()
        for o, rec in zip(offsets, recs, strict=True)]
    assert [rec.seq for _p, _o, rec in whole] == list(range(1, 1401))
    assert list(history.iter_records(data, warn=pytest.fail)) == whole
    assert list(history.iter_records(data, from_seq=700)) == whole[699:]


def test_a_gap_after_the_snapshot_is_missing_history_to_the_streaming_reader(
        tmp_path: Path) -> None:
    """Start-up refuses it (above); the tools name the records no snapshot holds
    (Layout.folded) and show what the log holds."""
    data = tmp_path / "data"
    snapshot_then_a_gap(data)
    with pytest.raises(history.HistoryFolded) as info:
        list(history.iter_records(data, from_seq=1))
    assert info.value.snapshot is None and "segments were lost: damage" in str(info.value)
    assert [rec.seq for _p, _o, rec in history.iter_records(data)] == [7, 8]


def test_zeros_allocated_ahead_are_a_clean_end_to_every_reader(tmp_path: Path) -> None:
    data = tmp_path / "data"
    for first, seqs in ((1, [1, 2]), (3, [3, 4])):
        seg = segment(data, first, seqs)
        with open(seg, "ab") as f:
            f.write(bytes(1000))
    got = recovery.recover(data, repair=False)
    assert got.state.last_seq == 4 and not got.warnings
    rep = verify.verify(data)
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    assert [rec.seq for _p, _o, rec in history.iter_records(data, warn=pytest.fail)] == [
        1, 2, 3, 4]


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
    warned: list[str] = []
    assert [rec.seq for _p, _o, rec in history.iter_records(data, warn=warned.append)] == [
        1, 2, 3, 4]
    assert warned == rep.warnings
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
    warned: list[str] = []
    assert [rec.seq for _p, _o, rec in history.iter_records(data, warn=warned.append)] == [1, 2]
    assert warned == rep.warnings
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
