"""The log's rules, kept once: segment files in, checked records out.

Every reader of the AOF's records goes through here: start-up recovery and
`aof verify` (recovery.py, ops/verify.py), the compactor, and the streaming,
read-only history reader (history.py: dump, replay, job-history, ls) and the
analytics source. The frames come from aof.py's one frame decoder
(`frame_batches` over a file in memory, `file_frames` streaming an open one);
the rules are these (snapshots/README.md, "Recovery"):

- a segment's header checks out (`aof.read_header`) and its first record has
  the seq the header names;
- seqs run on by one within a segment (`record_batches`) and across segments
  (`LogSeq`): the first record read may be anywhere up to one past the
  snapshot's seq (`floor`); a gap or an overlap is damage, never skipped;
- a segment's records may end in zeros (space allocated ahead): a clean end;
- only the last segment may end torn: a frame that does not check out there,
  with no run of records continuing the log after it (`aof.later_good_frame`),
  or a last segment shorter than its header, ends the read and is described
  in `SegmentRead.torn` for the caller to cut off (start-up) or report;
- records at or below `after` (start-up: the snapshot's seq) are checked but
  not handed out.

What differs between the readers is a parameter of `LogReader`, never a
second copy of a rule: start-up reads each file whole (it needs the bytes for
body references and a torn tail's `.broken` copy) and repairs afterwards from
`read`; the history reader streams (`stream=True`: memory stays bounded),
writes nothing, and may wait for a live segment's last frame (`settle`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import attrs

from smallstalk.core import records
from smallstalk.storage import aof
from smallstalk.storage.aof import HEADER_SIZE, SEGMENT_MAGIC, CorruptionError, FrameScan

SHORT_HEADER = "file shorter than its header"
GONE = ("segment disappeared while reading (a compaction folded it meanwhile); "
        "run the command again")

Batches = Iterable[tuple[list[int], list[bytes], FrameScan | None]]


# --- one segment ---------------------------------------------------------------------


def record_batches(path: Path, first: int, frames: Batches, put_lists: bool = False,
                   ) -> Iterator[tuple[list[int], list, FrameScan | None]]:
    """The records in one segment's frame batches, with the rules inside a file.

    `first` is the seq its header names; `frames` are `aof.frame_batches` or
    `aof.file_frames` items. Yields (offsets, records, FrameScan or None); the
    FrameScan comes with the last batch. Damage (a record that does not
    decode, a first record other than the header's, seqs that do not run on
    by one) raises CorruptionError after the good records before it.

    `put_lists`: a format-1 Put comes as its list (`records.is_put_list`)
    instead of a Put record, for a bulk replay that applies it from there.
    A replay steps through a list instead of a generator per record, and
    cbor2 decodes a batch in one `map`: ~0.1 us a record.
    """
    last = first - 1
    decode_list = records.decode_list
    loads = records.loads_unchecked
    from_list = records.from_list
    put_code, put_len = records.Put.CODE, records.PUT_LIST_LEN
    for offsets, payloads, scan in frames:
        try:
            decoded = list(map(loads, payloads))
        except Exception:  # cbor2 raises several types for garbage
            decoded = [None] * len(payloads)  # decode_list below says which and why
        recs: list = []
        err = None
        for offset, payload, items in zip(offsets, payloads, decoded, strict=True):
            try:
                if type(items) is not list or not items:
                    items = decode_list(payload)  # raises DecodeError, or it is a list
                code = items[0]
                # records.is_put_list, inlined
                if (put_lists and type(code) is int and code == put_code
                        and len(items) == put_len):
                    rec = items
                    seq = items[1]
                else:
                    rec = from_list(items)
                    seq = rec.seq
            except records.DecodeError as e:
                err = CorruptionError(path, offset, last, str(e))
                break
            if seq != last + 1:
                if last == first - 1:
                    err = CorruptionError(path, offset, None,
                                          f"header says first seq {first}, first record has {seq}")
                else:
                    kind = "gap" if seq > last else "overlap"
                    err = CorruptionError(path, offset, last,
                                          f"sequence {kind}: expected {last + 1}, found {seq}")
                break
            last = seq
            recs.append(rec)
        if err is not None:
            if recs:
                yield offsets[:len(recs)], recs, None
            raise err
        yield offsets, recs, scan
        if scan is not None:
            return


def _pieces(frames: Batches) -> Batches:
    """A streamed file's batches (a read's worth of frames) cut to aof.SEGMENT_BATCH
    frames, as a file in memory comes: a batch's records live until the caller is
    done with them, and the cyclic collector pays for every one that lives long."""
    step = aof.SEGMENT_BATCH
    for offsets, payloads, scan in frames:
        last = max(len(offsets) - 1, 0) // step * step
        for i in range(0, last, step):
            yield offsets[i:i + step], payloads[i:i + step], None
        yield offsets[last:], payloads[last:], scan


def segment_batches(path: Path, data: bytes | None = None, put_lists: bool = False,
                    ) -> Iterator[tuple[list[int], list, FrameScan | None]]:
    """`record_batches` of a whole segment file in memory (read from `path` if
    `data` is None); a bad header raises."""
    if data is None:
        data = path.read_bytes()
    first = aof.read_header(path, data, SEGMENT_MAGIC)
    yield from record_batches(path, first, aof.frame_batches(data), put_lists)


def iter_segment(path: Path, data: bytes | None = None, put_lists: bool = False,
                 ) -> Iterator[tuple[int, records.Record | list] | FrameScan]:
    """Decoded records of one segment with their offsets, then the FrameScan
    (`segment_batches` a record at a time)."""
    for offsets, recs, scan in segment_batches(path, data, put_lists):
        yield from zip(offsets, recs, strict=True)
        if scan is not None:
            yield scan


# --- across segments ---------------------------------------------------------------------


class LogSeq:
    """The log's sequence rule across segments.

    Sequence numbers run on by one across every segment, those the snapshot
    covers included; the first record read may be anywhere up to one past the
    snapshot (`floor`; None: anywhere). A record below the next expected one
    is an overlap (two writers of one directory, or a segment restored
    twice), above it a gap: both are damage, never skipped, since skipping
    drops acknowledged records.
    """

    def __init__(self, floor: int | None, expected: int | None = None):
        self.floor = floor  # the snapshot's seq: records at or below it are in it
        self.expected = expected  # None: nothing read yet

    def problem(self, seq: int) -> str | None:
        """Why `seq` cannot come next (and then nothing changes), or None (it is taken)."""
        expected = self.expected
        if expected is None:
            if self.floor is not None and seq > self.floor + 1:
                return f"sequence gap: expected {self.floor + 1}, found {seq}"
        elif seq != expected:
            kind = "gap" if seq > expected else "overlap"
            return f"sequence {kind}: expected {expected}, found {seq}"
        self.expected = seq + 1
        return None


@attrs.define
class SegmentRead:
    """How `LogReader` found one segment (start-up's repair, verify's and ls's report)."""

    path: Path
    size: int = 0
    header_seq: int | None = None  # the seq its header names (None: no valid header)
    first_seq: int | None = None
    last_seq: int | None = None
    first_time: int | None = None
    last_time: int | None = None
    records: int = 0
    end: int = 0  # offset after the last good frame (preallocated zeros may follow)
    torn: str | None = None  # the last segment ends in a torn write: why its tail is bad
    tail: bytes = b""  # the torn tail's bytes
    problems: list[CorruptionError] = attrs.Factory(list)

    def torn_warning(self) -> str:
        """The tools' words for a torn (or still being written) last segment."""
        if self.torn == SHORT_HEADER:
            return f"{self.path}: last segment has no complete header yet ({self.size} bytes)"
        after = f"seq {self.last_seq}" if self.last_seq is not None else "its header"
        return (f"{self.path}: the last segment ends in {self.size - self.end} bytes that are "
                f"not a complete record ({self.torn}) at offset {self.end}, after {after}: a "
                f"write in progress if a server is running, else a torn write that start-up "
                f"cuts off")


def _seq_time(rec: records.Record | list) -> tuple[int, int]:
    return (rec[1], rec[2]) if type(rec) is list else (rec.seq, rec.time)


class LogReader:
    """The one reader of the log: segments in order, their records checked by the rules.

    `batches()` yields the records a batch at a time, (path, file bytes or
    None when streaming, offsets, records). Damage raises CorruptionError
    naming the file, the offset and the last good seq (the higher of `floor`
    and the last seq read: a replay is good up to there). A torn tail of the
    last segment ends the read and is described in `read` (`torn`).

    - `floor`: the snapshot's seq (None: take the first record as it comes).
    - `after`: records at or below it are checked but not yielded.
    - `until_seq`: stop after it (`stopped` then says so; what follows is not
      read, damaged or not).
    - `keep_going` (verify, ls): collect damage in `problems` (and the
      segment's) instead of raising, and read on: after a sequence break at
      a file's start, with that file; after other damage, with the next
      file, taking its seqs as they come.
    - `torn_tail`: the last of `segments` is the log's last, which may end
      torn (False: every segment is closed, so any bad frame is damage).
    - `files`: open files to read instead of the paths (a live server's
      compactor may unlink what was listed); None entries are opened when
      reached. They are read from their start and left open.
    - `stream`: read each file a chunk at a time (`aof.file_frames`) instead
      of whole; `settle`: delays to wait for a write in progress to complete
      the last segment's last frame (a live server's).
    - `put_lists`: see `record_batches`.
    """

    def __init__(self, segments: list[Path], floor: int | None, *, put_lists: bool = False,
                 keep_going: bool = False, after: int | None = None,
                 until_seq: int | None = None, files: list[BinaryIO | None] | None = None,
                 torn_tail: bool = True, stream: bool = False,
                 settle: tuple[float, ...] = ()):
        self.segments = segments
        self.files = files
        self.floor = floor
        self.put_lists = put_lists
        self.keep_going = keep_going
        self.after = after
        self.until_seq = until_seq
        self.torn_tail = torn_tail
        self.stream = stream
        self.settle = settle
        self.read: list[SegmentRead] = []
        self.problems: list[CorruptionError] = []
        self.stopped = False
        self.last_read: int | None = None  # the seq of the last record read

    def last_good(self, seq: int | None = None) -> int | None:
        seq = self.last_read if seq is None else seq
        if self.floor is None or seq is None:
            return self.floor if seq is None else seq
        return max(self.floor, seq)

    def batches(self) -> Iterator[tuple[Path, bytes | None, list[int], list]]:
        log_seq = LogSeq(self.floor)
        resync = False  # after damage (keep_going): take the next file's seqs as they come
        after, until = self.after, self.until_seq
        n = len(self.segments)
        for i, path in enumerate(self.segments):
            last_segment = self.torn_tail and i == n - 1
            seg = SegmentRead(path)
            self.read.append(seg)
            f = self.files[i] if self.files is not None else None
            own = None
            try:
                if f is None and self.stream:
                    f = own = self._open(path)
                data = None if self.stream else self._read_all(path, f)
                frames = self._frames(seg, f, data, last_segment)
                if frames is None:
                    return  # a last segment without a whole header: no records
                for offsets, recs, scan in frames:
                    if recs:
                        first_seq, first_time = _seq_time(recs[0])
                        last_seq, last_time = _seq_time(recs[-1])
                        if not seg.records:
                            if until is not None and first_seq > until:
                                self.stopped = True
                                return
                            if resync:
                                log_seq.expected, resync = first_seq, False
                            why = log_seq.problem(first_seq)
                            if why is not None:
                                self._damage(seg, CorruptionError(path, offsets[0], None, why))
                            seg.first_seq, seg.first_time = first_seq, first_time
                        log_seq.expected = last_seq + 1
                        seg.last_seq, seg.last_time = last_seq, last_time
                        self.last_read = last_seq
                        seg.records += len(recs)
                        # Seqs in a batch run on by one: the wanted ones are a slice.
                        lo = 0 if after is None or first_seq > after else after + 1 - first_seq
                        hi = len(recs) if until is None or last_seq <= until else \
                            until + 1 - first_seq
                        if lo < hi:
                            if lo or hi < len(recs):
                                offsets, recs = offsets[lo:hi], recs[lo:hi]
                            yield path, data, offsets, recs
                        if hi < len(recs):
                            self.stopped = True
                            return
                    if scan is not None:
                        seg.end, seg.size = scan.end, scan.size
                        if not scan.clean:
                            self._bad_frame(seg, f, data, scan, last_segment)
            except CorruptionError as e:
                self._damage(seg, e)
                resync = True
            finally:
                if own is not None:
                    own.close()

    def _open(self, path: Path) -> BinaryIO:
        try:
            return open(path, "rb")  # noqa: SIM115 (closed by batches)
        except FileNotFoundError:
            raise CorruptionError(path, 0, self.last_good(), GONE) from None

    def _read_all(self, path: Path, f: BinaryIO | None) -> bytes:
        if f is None:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                raise CorruptionError(path, 0, self.last_good(), GONE) from None
        f.seek(0)
        return f.read()

    def _frames(self, seg: SegmentRead, f: BinaryIO | None, data: bytes | None,
                last_segment: bool) -> Batches | None:
        """The segment's checked record batches after its header; None for a last
        segment shorter than its header (torn). A bad header raises."""
        if data is None:
            f.seek(0)
            head = f.read(HEADER_SIZE)
        else:
            head = data
        seg.size = len(head)
        if len(head) < HEADER_SIZE:
            seg.end = len(head)
            if last_segment:
                # Created, but its header never fully reached the disk: no records.
                seg.torn = SHORT_HEADER
                return None
        seg.header_seq = first = aof.read_header(seg.path, head, SEGMENT_MAGIC)
        seg.end = HEADER_SIZE
        if data is None:
            frames = _pieces(aof.file_frames(f, HEADER_SIZE, self.settle if last_segment else ()))
        else:
            frames = aof.frame_batches(data)
        return record_batches(seg.path, first, frames, self.put_lists)

    def _damage(self, seg: SegmentRead, e: CorruptionError) -> None:
        e = CorruptionError(e.path, e.offset, self.last_good(e.seq), e.why)
        if not self.keep_going:
            raise e
        seg.problems.append(e)
        self.problems.append(e)

    def _bad_frame(self, seg: SegmentRead, f: BinaryIO | None, data: bytes | None,
                   scan: FrameScan, last_segment: bool) -> None:
        """A frame that does not check out: the torn tail, or damage (raised)."""
        if last_segment:
            if data is None:
                # The file as it was when the frame was found bad: frames a live
                # server appends later must not pass for records after damage.
                f.seek(0)
                data = f.read(scan.size)
            last = self.last_read if self.last_read is not None else (seg.header_seq or 1) - 1
            if aof.later_good_frame(data, scan.end, last) is None:
                seg.torn, seg.tail = scan.why, data[scan.end:]
                return
        raise CorruptionError(seg.path, scan.end, self.last_read, scan.why)
