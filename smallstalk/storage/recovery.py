"""Start-up recovery: newest snapshot + the segments after it = the state to serve.

Rules (snapshots/README.md, "Recovery"):
- the newest snapshot must read cleanly; damage there stops start-up;
- records at or below the snapshot's sequence number are skipped (a crash
  between writing a snapshot and deleting the segments it covers is harmless);
- sequence numbers follow on by one across all segments (`LogSeq`): a gap or
  an overlap (two processes that wrote one directory) is damage, never skipped;
  `LogReader` is the one reader of these rules, for start-up and `aof verify`;
- a frame that does not check out at the end of the *last* segment, with no
  valid frame after it, is a torn write: the tail is copied aside to
  `<segment>.broken`, cut off, and start-up goes on with a warning;
- any other damage raises CorruptionError naming file, offset and the last
  good sequence number, and nothing is written. `smallstalk aof verify`
  reports the same (`refusal` words start-up's one line).

With a body store (`bodies`, read-behind), bodies past the memory budgets
are not loaded: the snapshot's are referenced where they are in the snapshot
file, and replayed puts' where they are in their segment (bodies.py).
"""

from __future__ import annotations

import gc
import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import attrs

from smallstalk.core import records
from smallstalk.core.state import State, StateError
from smallstalk.storage import aof, datadir, snapshot
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.bodies import PUTS, BodyStore, spill_record

log = logging.getLogger("smallstalk.storage.recovery")


@attrs.define
class Recovered:
    state: State
    segments: list[Path]  # segments holding records after the snapshot
    snapshot: Path | None
    records_replayed: int = 0
    warnings: list[str] = attrs.Factory(list)


def recover(data_dir: Path, repair: bool = True, until_seq: int | None = None,
            bodies: BodyStore | None = None) -> Recovered:
    """Rebuild the state from `data_dir`. With repair=False nothing is written.

    `bodies`: keep bodies past its budgets on disk; the state tells it which go
    (`state.on_body_dropped`).
    """
    # Loading allocates millions of objects and no garbage cycles: the cyclic
    # collector would run over and over for nothing (docs/PERFORMANCE.md, Restart).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _recover(data_dir, repair, until_seq, bodies)
    finally:
        if enabled:
            gc.enable()


def _recover(data_dir: Path, repair: bool, until_seq: int | None,
             bodies: BodyStore | None) -> Recovered:
    aof_dir, snap_dir = datadir.paths(data_dir)
    snaps = datadir.list_snapshots(snap_dir)
    if snaps:
        snap_path = snaps[-1][1]
        state = snapshot.load(snap_path, bodies)
    else:
        snap_path = None
        state = State()
    state.on_body_dropped = bodies.drop if bodies is not None else None
    spill = bodies if bodies is not None and bodies.active else None
    keys: dict = {}
    result = Recovered(state, [], snap_path)
    floor = state.last_seq
    log_reader = LogReader([path for _first, path in datadir.list_segments(aof_dir)], floor,
                           put_lists=True, until_seq=until_seq)
    apply_put = state.apply_put
    replayed = 0
    for path, data, offsets, recs in log_reader.batches():
        before = replayed
        for offset, rec in zip(offsets, recs, strict=True):
            # LogReader has checked the seqs; here: skip the snapshot's, apply the rest.
            if type(rec) is list:
                # A format-1 Put, the bulk of a log (see records.is_put_list):
                # apply_next's rules, applied from the fields.
                _, seq, time, conn, jid, tube, pri, delay, ttr, body = rec
                if until_seq is not None and seq > until_seq:
                    result.records_replayed = replayed
                    return result
                if seq <= floor:
                    continue  # already in the snapshot
                try:
                    apply_put(seq, time, conn, jid, tube, pri, delay, ttr, body)
                except StateError as e:
                    raise CorruptionError(path, offset, state.last_seq,
                                          f"record does not apply: {e}") from None
                if spill is not None:
                    rec = records.from_list(rec)
                    spill_record(spill, state, rec, path, body_offset(data, offset, rec), keys)
                replayed += 1
                continue
            seq = rec.seq
            if until_seq is not None and seq > until_seq:
                result.records_replayed = replayed
                return result
            if seq <= floor:
                continue  # already in the snapshot
            apply_next(state, path, offset, rec)
            if spill is not None and type(rec) in PUTS:
                spill_record(spill, state, rec, path, body_offset(data, offset, rec), keys)
            replayed += 1
        if replayed > before and (not result.segments or result.segments[-1] != path):
            result.segments.append(path)
    result.records_replayed = replayed
    if not log_reader.stopped:
        for seg in log_reader.read:
            if seg.torn is not None:
                _cut_torn_tail(seg, repair, result)
            elif repair and seg.end < seg.size:
                # The zeros it was allocated ahead of its records (aof.SegmentWriter):
                # start-up's next segment follows the last record.
                _truncate(seg)
    return result


class LogSeq:
    """The log's sequence rule, one for start-up, `aof verify`, the compactor and replay.

    Sequence numbers run on by one across every segment, those the snapshot
    covers included; the first record read may be anywhere up to one past the
    snapshot (`floor`). A record below the next expected one is an overlap
    (two writers of one directory, or a segment restored twice), above it a
    gap: both are damage, never skipped, since skipping drops acknowledged
    records.
    """

    def __init__(self, floor: int, expected: int | None = None):
        self.floor = floor  # the snapshot's seq: records at or below it are in it
        self.expected = expected  # None: nothing read yet

    def problem(self, seq: int) -> str | None:
        """Why `seq` cannot come next (and then nothing changes), or None (it is taken)."""
        expected = self.expected
        if expected is None:
            if seq > self.floor + 1:
                return f"sequence gap: expected {self.floor + 1}, found {seq}"
        elif seq != expected:
            kind = "gap" if seq > expected else "overlap"
            return f"sequence {kind}: expected {expected}, found {seq}"
        self.expected = seq + 1
        return None

    def check(self, path: Path, offset: int, seq: int, last_good: int) -> None:
        why = self.problem(seq)
        if why is not None:
            raise CorruptionError(path, offset, last_good, why)


@attrs.define
class SegmentRead:
    """How `LogReader` found one segment (start-up's repair, verify's report)."""

    path: Path
    size: int
    header_seq: int | None = None  # the seq its header says (unchecked if damaged)
    first_seq: int | None = None
    last_seq: int | None = None
    records: int = 0
    end: int = 0  # offset after the last good frame (preallocated zeros may follow)
    torn: str | None = None  # the last segment ends in a torn write: why its tail is bad
    tail: bytes = b""  # the torn tail's bytes
    problems: list[CorruptionError] = attrs.Factory(list)


class LogReader:
    """The one reader of the log's structure, for start-up and `aof verify`.

    `batches()` walks the segments in order and yields their records a batch
    at a time, (path, file bytes, offsets, records), enforcing the log's
    rules: every frame checks out and decodes, and seqs run on by one within
    a file (`aof.segment_batches`) and across files (`LogSeq`, from `floor`,
    the snapshot's seq). Damage raises CorruptionError naming the file, the
    offset and the last good seq (the higher of `floor` and the last seq
    read: a replay is good up to there). The one exception is a torn tail: a
    frame that does not check out at the end of the last segment with no run
    of records continuing the log after it, or a last segment shorter than
    its header. It ends the read and is described in `read` (`torn`) for the
    caller to cut off or report.

    `keep_going` (verify): collect damage in `problems` instead of raising and
    read on: after a sequence break at a file's start, with that file; after
    other damage, with the next file, taking its seqs as they come.
    `until_seq`: stop before a file that starts past it (a replay up to there
    needs nothing after it, damaged or not); `stopped` then says so.
    `files`: open files to read instead of the paths (a live server's
    compactor may unlink what was listed).
    """

    def __init__(self, segments: list[Path], floor: int, *, put_lists: bool = False,
                 keep_going: bool = False, until_seq: int | None = None,
                 files: list[BinaryIO | None] | None = None):
        self.segments = segments
        self.files = files
        self.floor = floor
        self.put_lists = put_lists
        self.keep_going = keep_going
        self.until_seq = until_seq
        self.read: list[SegmentRead] = []
        self.problems: list[CorruptionError] = []
        self.stopped = False
        self.last_read: int | None = None  # the seq of the last record read

    def last_good(self, seq: int | None = None) -> int:
        seq = self.last_read if seq is None else seq
        return self.floor if seq is None else max(self.floor, seq)

    def batches(self) -> Iterator[tuple[Path, bytes, list[int], list]]:
        log_seq = LogSeq(self.floor)
        resync = False  # after damage (keep_going): take the next file's seqs as they come
        n = len(self.segments)
        for i, path in enumerate(self.segments):
            f = self.files[i] if self.files is not None else None
            if f is None:
                data = path.read_bytes()
            else:
                f.seek(0)
                data = f.read()
            seg = SegmentRead(path, len(data))
            self.read.append(seg)
            if len(data) >= aof.HEADER_SIZE:
                seg.header_seq = aof.HEADER.unpack_from(data)[2]
            elif i == n - 1:
                # Created, but its header never fully reached the disk: no records.
                seg.torn = "file shorter than its header"
                return
            try:
                for offsets, recs, scan in aof.segment_batches(path, data, self.put_lists):
                    if recs:
                        head, tail = recs[0], recs[-1]
                        if not seg.records:
                            first = head[1] if type(head) is list else head.seq
                            if self.until_seq is not None and first > self.until_seq:
                                self.stopped = True
                                return
                            if resync:
                                log_seq.expected, resync = first, False
                            why = log_seq.problem(first)
                            if why is not None:
                                self._damage(seg, CorruptionError(path, offsets[0], None, why))
                            seg.first_seq = first
                        last = tail[1] if type(tail) is list else tail.seq
                        log_seq.expected = last + 1
                        seg.last_seq = self.last_read = last
                        seg.records += len(recs)
                        yield path, data, offsets, recs
                    if scan is not None:
                        seg.end = scan.end
                        if not scan.clean:
                            self._bad_frame(seg, data, scan, i == n - 1)
            except CorruptionError as e:
                self._damage(seg, e)
                resync = True

    def _damage(self, seg: SegmentRead, e: CorruptionError) -> None:
        e = CorruptionError(e.path, e.offset, self.last_good(e.seq), e.why)
        if not self.keep_going:
            raise e
        seg.problems.append(e)
        self.problems.append(e)

    def _bad_frame(self, seg: SegmentRead, data: bytes, scan: aof.FrameScan,
                   last_segment: bool) -> None:
        after = self.last_read if self.last_read is not None else (seg.header_seq or 1) - 1
        if last_segment and aof.later_good_frame(data, scan.end, after) is None:
            seg.torn, seg.tail = scan.why, data[scan.end:]
            return
        raise CorruptionError(seg.path, scan.end, self.last_read, scan.why)


def refusal(e: CorruptionError, data_dir: Path) -> str:
    """Start-up's one line for damage: what and where, and how to recover what is intact."""
    if e.path.suffix == datadir.SNAPSHOT_SUFFIX:
        return (f"{e}; start-up changed nothing. The newest snapshot is damaged: "
                f"`smallstalk aof verify {data_dir}` shows what is intact")
    seq = e.seq if e.seq is not None else 0
    return (f"{e}; start-up changed nothing. To recover the records up to seq {seq}: copy the "
            f"directory to COPY, run `smallstalk replay COPY --until-seq {seq} --write-snapshot "
            f"SNAP`, and serve a new directory holding only that snapshot in snapshots/ "
            f"(`smallstalk aof verify {data_dir}` shows all the damage)")


def body_offset(data: bytes, offset: int, rec) -> int:
    """Where the body of the Put/PutJobs record in the frame at `offset` starts:
    the body is the record's last field, so its bytes end where the frame does."""
    (length,) = struct.unpack_from("<I", data, offset)
    return offset + aof.FRAME.size + length - len(rec.body)


def apply_next(state: State, path: Path, offset: int, rec) -> bool:
    """Apply `rec` if it is the state's next record; False if the state has it already.

    A gap, or a record that does not apply, is damage: CorruptionError names
    the file, offset and the last good sequence number.
    """
    if rec.seq <= state.last_seq:
        return False
    if rec.seq != state.last_seq + 1:
        raise CorruptionError(path, offset, state.last_seq,
                              f"sequence gap: expected {state.last_seq + 1}, found {rec.seq}")
    try:
        state.apply(rec)
    except StateError as e:
        raise CorruptionError(path, offset, state.last_seq,
                              f"record does not apply: {e}") from None
    return True


def _truncate(seg: SegmentRead) -> None:
    """Cut a segment durably at the end of its good records."""
    with open(seg.path, "r+b") as f:
        f.truncate(seg.end)
        os.fsync(f.fileno())


def _cut_torn_tail(seg: SegmentRead, repair: bool, result: Recovered) -> None:
    if seg.header_seq is None:
        result.warnings.append(f"{seg.path}: last segment has no complete header; removed")
        if repair:
            seg.path.unlink()
            aof.fsync_dir(seg.path.parent)  # gone for good before a new segment takes its place
        return
    msg = (f"{seg.path}: torn write at offset {seg.end} after seq {result.state.last_seq} "
           f"({seg.size - seg.end} bytes, {seg.torn}); truncated")
    result.warnings.append(msg)
    log.warning("%s", msg)
    if repair:
        datadir.broken_path(seg.path).write_bytes(seg.tail)
        _truncate(seg)
