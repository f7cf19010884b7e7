"""Frames and segment files, byte by byte: what start-up calls a torn tail, what damage.

Written to kill the mutants of storage/aof.py that `make mutation` found
surviving: these rules decide whether start-up may cut bytes off a segment.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest

from smallstalk.core import records as r
from smallstalk.storage import aof, logread
from smallstalk.storage.aof import CorruptionError, FrameScan, SegmentWriter


def put(seq: int, body: bytes = b"body") -> bytes:
    return r.encode(r.Put(seq, 0, 0, seq, "default", 0, 0, 60, body))


def segment(first: int, payloads: list[bytes]) -> bytes:
    return aof.header(aof.SEGMENT_MAGIC, first) + b"".join(aof.frame(p) for p in payloads)


def test_a_clean_file_reads_to_its_end() -> None:
    data = segment(1, [put(1), put(2)])
    got = list(aof.read_frames(data))
    assert [type(x) for x in got] == [tuple, tuple, FrameScan]
    assert got[0] == (aof.HEADER_SIZE, put(1))
    assert got[1][0] == aof.HEADER_SIZE + aof.FRAME.size + len(put(1))
    assert got[-1] == FrameScan(len(data), len(data)) and got[-1].clean


@pytest.mark.parametrize("tail, why", [
    (b"\x01\x02", "incomplete frame header"),
    (b"\x00" * 12 + b"\x01", "zero-length frame"),
    (struct.pack("<II", 100, 0) + b"abc", "frame runs past the end of the file"),
    (struct.pack("<II", 3, 12345) + b"abc", "checksum mismatch"),
])
def test_damage_is_named_where_it_starts(tail: bytes, why: str) -> None:
    good = segment(1, [put(1)])
    *frames, scan = aof.read_frames(good + tail)
    assert len(frames) == 1
    assert (scan.end, scan.size, scan.why) == (len(good), len(good) + len(tail), why)
    assert not scan.clean
    assert aof.frame_damage(good + tail, len(good)) == why


@pytest.mark.parametrize("zeros", [1, 7, 8, 9, 4096, aof.CHUNK + 5])
def test_zeros_after_the_last_frame_are_the_end_of_the_records(
        tmp_path: Path, zeros: int) -> None:
    """A preallocated tail (SegmentWriter): a clean end, in memory and streamed."""
    good = segment(1, [put(1), put(2)])
    data = good + bytes(zeros)
    *frames, scan = aof.read_frames(data)
    assert len(frames) == 2 and scan == FrameScan(len(good), len(data)) and scan.clean
    p = tmp_path / "s"
    p.write_bytes(data)
    with open(p, "rb") as f:
        batches = list(aof.file_frames(f))
    assert sum(len(offs) for offs, _, _ in batches) == 2
    assert batches[-1][2] == FrameScan(len(good), len(data))
    # ... but not when anything else follows the zeros, however far
    p.write_bytes(data + b"\x01")
    with open(p, "rb") as f:
        last = list(aof.file_frames(f))[-1][2]
    why = "incomplete frame header" if zeros + 1 < aof.FRAME.size else "zero-length frame"
    assert (last.end, last.why) == (len(good), why)
    assert list(aof.read_frames(data + b"\x01"))[-1] == FrameScan(len(good), len(data) + 1, why)


def test_a_live_reader_waits_for_a_frame_being_written_into_zeros(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a live segment a frame half written into the space allocated ahead
    fails its checksum, zeros after it: with `settle`, the reader waits and
    reads it again (here the "wait" finishes the write), instead of stopping."""
    good = segment(1, [put(1)])
    whole = aof.frame(put(2))
    p = tmp_path / "live"
    p.write_bytes(good + whole[:-5] + bytes(4096 + 5))
    waits = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        with open(p, "r+b") as f:
            f.seek(len(good))
            f.write(whole)

    monkeypatch.setattr(aof.time, "sleep", sleep)
    with open(p, "rb") as f:
        batches = list(aof.file_frames(f, settle=(0.02, 0.05)))
    assert waits == [0.02]
    offsets = [off for offs, _, _ in batches for off in offs]
    assert offsets == [aof.HEADER_SIZE, len(good)]
    assert batches[-1][2] == FrameScan(len(good) + len(whole), len(good) + len(whole) + 4096)
    # Without `settle` (a stopped server's file) the same bytes are a bad frame at once.
    p.write_bytes(good + whole[:-5] + bytes(4096 + 5))
    with open(p, "rb") as f:
        last = list(aof.file_frames(f))[-1][2]
    assert (last.end, last.why) == (len(good), "checksum mismatch") and len(waits) == 1


def test_a_frame_of_exactly_the_remaining_bytes_is_whole() -> None:
    data = aof.frame(b"x" * 10)
    assert list(aof.read_frames(data, 0))[0] == (0, b"x" * 10)


def test_a_torn_tail_has_no_later_good_frame() -> None:
    data = segment(1, [put(1), put(2)])
    end = len(data)
    torn = data + aof.frame(put(3))[:-3]
    assert aof.later_good_frame(torn, end, 2) is None


def test_damage_followed_by_records_that_continue_the_log_is_not_a_tail() -> None:
    good = segment(1, [put(1)])
    rest = aof.frame(put(2)) + aof.frame(put(3))
    for junk in (1, 7):
        damaged = good + b"\xff" * junk + rest
        assert aof.later_good_frame(damaged, len(good), 1) == len(good) + junk


def test_zeros_allocated_ahead_do_not_hide_or_fake_the_log() -> None:
    """A torn frame in space allocated ahead: zeros follow it, and it is still a
    torn tail; records continuing the log before the zeros are still found."""
    good = segment(1, [put(1), put(2)])
    torn = good + aof.frame(put(3))[:-3] + bytes(aof.PREALLOCATE)
    assert aof.later_good_frame(torn, len(good), 2) is None
    rest = aof.frame(put(3)) + aof.frame(put(4))
    damaged = good + b"\xff" * 5 + rest + bytes(4096)
    assert aof.later_good_frame(damaged, len(good), 2) == len(good) + 5


def test_frames_that_do_not_continue_the_sequence_are_not_the_log() -> None:
    good = segment(1, [put(1), put(2)])
    # a frame-shaped run inside garbage, but its seqs are at or below the last good one
    old = aof.frame(put(1)) + aof.frame(put(2))
    assert aof.later_good_frame(good + b"\xff" * 5 + old, len(good), 2) is None
    # ... or with a gap between its own records (from the last one on, a run does continue)
    gap = aof.frame(put(3)) + aof.frame(put(5))
    at = len(good) + 5
    assert aof.later_good_frame(good + b"\xff" * 5 + gap, len(good), 2) == \
        at + len(aof.frame(put(3)))
    # ... or followed by damage of its own
    tail = aof.frame(put(3)) + b"\x00\x01"
    assert aof.later_good_frame(good + b"\xff" * 5 + tail, len(good), 2) is None
    # ... or not records at all
    junk = aof.frame(b"\xff\xfe not cbor")
    assert aof.later_good_frame(good + b"\xff" * 5 + junk, len(good), 2) is None


def test_read_header_checks_magic_crc_and_version(tmp_path: Path) -> None:
    p = tmp_path / "f"
    head = aof.header(aof.SEGMENT_MAGIC, 42)
    assert aof.read_header(p, head, aof.SEGMENT_MAGIC) == 42
    with pytest.raises(CorruptionError, match="shorter than its header"):
        aof.read_header(p, head[:-1], aof.SEGMENT_MAGIC)
    with pytest.raises(CorruptionError, match="bad header"):
        aof.read_header(p, head, aof.SNAPSHOT_MAGIC)
    with pytest.raises(CorruptionError, match="bad header"):
        aof.read_header(p, head[:-1] + bytes([head[-1] ^ 1]), aof.SEGMENT_MAGIC)
    future = aof.HEADER.pack(aof.SEGMENT_MAGIC, r.FORMAT_VERSION + 1, 42)
    with pytest.raises(CorruptionError, match="unknown format version"):
        aof.read_header(p, future + struct.pack("<I", zlib.crc32(future)), aof.SEGMENT_MAGIC)


def test_a_segment_writer_never_opens_an_existing_segment(tmp_path: Path) -> None:
    old = tmp_path / aof.segment_name(7)
    old.write_bytes(b"acknowledged records")
    with pytest.raises(FileExistsError):
        SegmentWriter(tmp_path, 7)
    assert old.read_bytes() == b"acknowledged records"


def test_a_segment_writer_writes_its_header_and_appends(tmp_path: Path) -> None:
    seg = SegmentWriter(tmp_path, 5)
    assert (seg.size, seg.records, seg.last_seq) == (aof.HEADER_SIZE, 0, 4)
    seg.append(put(5), 5)
    seg.append(put(6), 6)
    seg.write()
    seg.sync()
    assert (seg.records, seg.last_seq, seg.pending, seg.pending_bytes) == (2, 6, [], 0)
    seg.close()
    data = seg.path.read_bytes()
    assert len(data) == seg.size and os.stat(seg.path).st_mode & 0o777 == 0o644
    assert [rec.seq for _, rec in list(logread.iter_segment(seg.path))[:-1]] == [5, 6]


@pytest.mark.parametrize("size", [0, 1, 3, 4, 100, 255, 256, 65_535, 65_536, 1 << 20])
def test_a_staged_frame_is_the_structs_length_and_crc(tmp_path: Path, size: int) -> None:
    # The compiled build writes the header in C (storage/framehead.pyx), the
    # pure one with struct and zlib: both must stage exactly `aof.frame`'s bytes.
    payload = bytes((i * 7 + size) % 256 for i in range(size))
    seg = SegmentWriter(tmp_path, 1)
    seg.append(payload, 1)
    assert b"".join(seg.pending) == aof.frame(payload)
    assert b"".join(seg.pending) == struct.pack("<II", size, zlib.crc32(payload)) + payload
    assert seg.pending_bytes == aof.FRAME_SIZE + size
    seg.discard_pending()
    seg.close()


def test_a_segment_is_allocated_ahead_and_closes_at_its_exact_size(tmp_path: Path) -> None:
    seg = SegmentWriter(tmp_path, 1, preallocate=64 << 10)
    seg.append(put(1), 1)
    seg.write()
    seg.sync()
    assert seg.path.stat().st_size == aof.HEADER_SIZE + (64 << 10) > seg.size
    *frames, scan = logread.iter_segment(seg.path)
    assert [rec.seq for _, rec in frames] == [1] and scan.clean and scan.end == seg.size
    big = b"x" * (100 << 10)  # past the allocation: allocated again, as far as needed
    seg.append(put(2, big), 2)
    seg.write()
    assert seg.path.stat().st_size >= seg.size
    seg.finish()
    assert seg.path.stat().st_size == seg.size
    seg.close()
    assert [rec.seq for _, rec in list(logread.iter_segment(seg.path))[:-1]] == [1, 2]
    other = SegmentWriter(tmp_path, 3, preallocate=4096)
    other.append(put(3), 3)
    other.write()
    other.close()  # close alone cuts the zeros off too
    assert other.path.stat().st_size == other.size


def test_cut_back_drops_what_followed(tmp_path: Path) -> None:
    seg = SegmentWriter(tmp_path, 1)
    seg.append(put(1), 1)
    seg.write()
    durable = (seg.size, seg.records, seg.last_seq)
    seg.append(put(2), 2)
    seg.write()
    seg.cut_back_to(*durable)
    assert (seg.size, seg.records, seg.last_seq) == durable
    assert seg.path.stat().st_size == durable[0]
    seg.append(put(2, b"again"), 2)  # the next write lands right after the durable part
    seg.write()
    seg.close()
    recs = [rec for _, rec in list(logread.iter_segment(seg.path))[:-1]]
    assert [(x.seq, x.body) for x in recs] == [(1, b"body"), (2, b"again")]


def test_discard_pending_forgets_staged_records(tmp_path: Path) -> None:
    seg = SegmentWriter(tmp_path, 1)
    seg.append(put(1), 1)
    seg.discard_pending()
    assert (seg.pending, seg.pending_bytes, seg.pending_records, seg.pending_last_seq) == (
        [], 0, 0, 0)
    seg.write()
    seg.close()
    assert seg.path.stat().st_size == aof.HEADER_SIZE


def test_corruption_error_names_file_offset_and_seq(tmp_path: Path) -> None:
    e = CorruptionError(tmp_path / "x.aof", 99, 7, "checksum mismatch")
    assert (e.offset, e.seq, e.why) == (99, 7, "checksum mismatch")
    assert str(e) == f"{tmp_path / 'x.aof'}: checksum mismatch at offset 99 (after seq 7)"
    assert "before any record" in str(CorruptionError(tmp_path, 0, None, "bad header"))


@pytest.mark.parametrize("tail", [b"", b"\x01\x02", b"\x00" * 12, struct.pack("<II", 100, 0) + b"abc",
                                  struct.pack("<II", 3, 12345) + b"abc"],
                         ids=["clean", "short", "zeros", "past-end", "crc"])
@pytest.mark.parametrize("n", [3, 1100], ids=["one-batch", "three-batches"])
def test_start_ups_batched_reader_stops_where_read_frames_does(tmp_path: Path, tail: bytes,
                                                               n: int) -> None:
    """segment_batches (start-up's fast path) applies read_frames' rules inline."""
    data = segment(1, [put(s) for s in range(1, n + 1)]) + tail
    path = tmp_path / aof.segment_name(1)
    *entries, scan = logread.iter_segment(path, data)
    *frames, want = aof.read_frames(data)
    assert [off for off, _ in entries] == [off for off, _ in frames]
    assert [rec.seq for _, rec in entries] == list(range(1, n + 1))
    assert (scan.end, scan.size, scan.why) == (want.end, want.size, want.why)
    batches = list(logread.segment_batches(path, data, put_lists=True))
    assert all(len(offs) <= aof.SEGMENT_BATCH for offs, _, _ in batches)
    assert [s for _, _, s in batches[:-1]] == [None] * (len(batches) - 1)
    assert all(type(x) is list for _, recs, _ in batches for x in recs)  # format-1 puts as lists


def test_start_ups_reader_names_a_record_that_does_not_decode(tmp_path: Path) -> None:
    path = tmp_path / aof.segment_name(1)
    data = segment(1, [put(1), b"\xff not cbor", put(3)])
    with pytest.raises(CorruptionError) as e:
        list(logread.iter_segment(path, data))
    assert e.value.offset == aof.HEADER_SIZE + len(aof.frame(put(1))) and e.value.seq == 1
    with pytest.raises(CorruptionError, match="header says first seq 1, first record has 2"):
        list(logread.iter_segment(path, segment(1, [put(2)])))


def test_header_errors_name_the_file_and_offset_0(tmp_path: Path) -> None:
    p = tmp_path / "f.aof"
    head = aof.header(aof.SEGMENT_MAGIC, 42)
    future = aof.HEADER.pack(aof.SEGMENT_MAGIC, r.FORMAT_VERSION + 1, 42)
    cases = [(head[:-1], "file shorter than its header"), (head[:-1] + b"\x00", "bad header"),
             (future + struct.pack("<I", zlib.crc32(future)),
              f"unknown format version {r.FORMAT_VERSION + 1}")]
    for data, why in cases:
        with pytest.raises(CorruptionError) as e:
            aof.read_header(p, data, aof.SEGMENT_MAGIC)
        assert (e.value.path, e.value.offset, e.value.seq, e.value.why) == (p, 0, None, why)
        assert str(e.value) == f"{p}: {why} at offset 0 (before any record)"


def test_only_numbered_segments_and_snapshots_are_listed(tmp_path: Path) -> None:
    for name in ("00000000000000000001.aof", "00000000000000000009.aof", "notes.aof",
                 "00000000000000000005.aof.broken", "00000000000000000003.tmp",
                 "00000000000000000007.snap", "00000000000000000007.bodies",
                 "00000000000000000008.snap.123.tmp", "x.snap"):
        (tmp_path / name).write_bytes(b"")
    assert [s for s, _ in aof.list_segments(tmp_path)] == [1, 9]
    assert [(s, p.name) for s, p in aof.list_snapshots(tmp_path)] == \
        [(7, "00000000000000000007.snap")]
    assert aof.list_segments(tmp_path / "missing") == []
