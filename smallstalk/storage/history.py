"""Streaming, read-only access to a data directory's history: snapshots, segments, records.

`iter_records(data_dir)` yields every record the AOF still holds as
`(segment path, byte offset, record)`, in sequence order, reading one chunk of
one file at a time: memory stays constant however long the log is. The
operator tools (`smallstalk aof`, `replay`, `job-history`) and the analytics
pipeline are built on it.

Safe on the data directory of a live server: nothing is ever written, the
segments are opened as soon as they are listed (the compactor may unlink them
meanwhile; an open file stays readable), and the last segment is read up to
its readable prefix. A frame there that does not (yet) check out ends the
read with a warning, not an error: it is either a write in progress or a torn
tail that start-up will cut off. Damage anywhere else raises
`aof.CorruptionError`, naming the file, the offset and the last good seq.

Records folded into a snapshot by the compactor are gone from the log: asking
for them (`from_seq` below the oldest record kept) raises `HistoryFolded`,
which names the snapshot that holds their result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import attrs

from smallstalk.core import records
from smallstalk.core.state import State, StateError
from smallstalk.storage import aof, datadir, snapshot, snapshot_codec
from smallstalk.storage.aof import HEADER_SIZE, CorruptionError

log = logging.getLogger("smallstalk.storage.history")

EAGER_OPEN = 512  # segments opened up front (a live compactor may unlink them)
TAIL_SETTLE = (0.02, 0.05)  # seconds to wait for a write in progress at the very end
RETENTION_HINT = ("to keep older records for these tools, run the server with "
                  "`smallstalk serve --keep-segments-hours N` or `--keep-segments-bytes N`")

Warn = Callable[[str], None]
Progress = Callable[[int, int], None]  # (bytes read, bytes in all)


class HistoryFolded(Exception):
    """Records that are needed are no longer in the log.

    Normally the compactor folded them into `snapshot` (which keeps the state
    they led to, not the records); `snapshot` is None when no snapshot holds
    them either, which is damage.
    """

    def __init__(self, first_needed: int, first_kept: int | None,
                 snapshot: Path | None, snapshot_seq: int | None, what: str = ""):
        self.first_needed, self.first_kept = first_needed, first_kept
        self.snapshot, self.snapshot_seq = snapshot, snapshot_seq
        last_missing = (first_kept - 1) if first_kept is not None else snapshot_seq
        if last_missing is None or last_missing <= first_needed:
            span = f"record {first_needed} is"
        else:
            span = f"records {first_needed}..{last_missing} are"
        if snapshot is not None:
            msg = (f"{span} no longer in the log: the compactor folded them away into snapshot "
                   f"{snapshot.parent.name}/{snapshot.name} (seq {snapshot_seq}), which keeps the "
                   f"state at seq {snapshot_seq}, not the records that led to it. "
                   f"{RETENTION_HINT[0].upper()}{RETENTION_HINT[1:]}.")
        else:
            msg = (f"{span} missing from the log, and no snapshot holds them either "
                   f"(segments were lost: damage)")
        if what:
            msg = f"{what}. {msg[0].upper()}{msg[1:]}"
        super().__init__(msg)


# --- what is in the directory ---------------------------------------------------


@attrs.frozen
class SegmentFile:
    first: int  # seq its name says it starts at
    path: Path
    size: int


@attrs.frozen
class SnapshotFile:
    seq: int
    path: Path
    size: int


@attrs.frozen
class Layout:
    """The files of a data directory at one moment, in reading order."""

    data_dir: Path
    segments: list[SegmentFile]
    snapshots: list[SnapshotFile]
    others: list[Path]  # `*.broken` tails and `*.tmp` snapshots: never read

    @property
    def newest_snapshot(self) -> SnapshotFile | None:
        return self.snapshots[-1] if self.snapshots else None

    @property
    def first_kept(self) -> int | None:
        """The seq of the oldest record the log can still hold (from segment names)."""
        return self.segments[0].first if self.segments else None

    def covering_snapshot(self, seq: int) -> SnapshotFile | None:
        """The oldest snapshot that contains record `seq` (its seq is at least `seq`)."""
        for snap in self.snapshots:
            if snap.seq >= seq:
                return snap
        return None

    def folded(self, from_seq: int = 1) -> HistoryFolded | None:
        """Why records from `from_seq` on are not all in the log, or None if they are."""
        first = self.first_kept
        if first is not None and from_seq >= first:
            return None
        last_missing = first - 1 if first is not None else None
        if last_missing is None:
            newest = self.newest_snapshot
            if newest is None or from_seq > newest.seq:
                return None  # nothing was ever written (or nothing from there on)
            last_missing = newest.seq
        if from_seq > last_missing:
            return None
        snap = self.covering_snapshot(last_missing)
        return HistoryFolded(from_seq, first, snap.path if snap else None,
                             snap.seq if snap else None)


def layout(data_dir: Path) -> Layout:
    aof_dir, snap_dir = datadir.paths(data_dir)
    segments, snapshots = [], []
    for first, path in datadir.list_segments(aof_dir):
        size = _size(path)
        if size is not None:
            segments.append(SegmentFile(first, path, size))
    for seq, path in datadir.list_snapshots(snap_dir):
        size = _size(path)
        if size is not None:
            snapshots.append(SnapshotFile(seq, path, size))
    return Layout(data_dir, segments, snapshots, datadir.strays(data_dir))


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None  # unlinked by the compactor between listing and looking


# --- segments ----------------------------------------------------------------------


class SegmentReader:
    """One segment, streamed: iterate for (offset, record); then read how it ended.

    Raises CorruptionError for a bad header or a payload that checks out but is
    not a record. A frame that does not check out ends the iteration and sets
    `why`; `tail_is_torn()` then tells a torn tail from damage in the middle.
    """

    def __init__(self, path: Path, file: BinaryIO | None = None, last: bool = False):
        self.path = path
        self.file = file
        self.last = last
        self.header_seq: int | None = None
        self.short_header = False  # the file is shorter than a header
        self.records = 0
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self.first_time: int | None = None
        self.last_time: int | None = None
        self.end = 0  # offset after the last good frame
        self.size = 0
        self.why: str | None = None
        self._data: bytes | None = None  # the whole file, read only when a frame is bad

    def __iter__(self) -> Iterator[tuple[int, records.Record]]:
        f = self.file if self.file is not None else open(self.path, "rb")  # noqa: SIM115
        try:
            yield from self._read(f)
        finally:
            f.close()
            self.file = None

    def _read(self, f: BinaryIO) -> Iterator[tuple[int, records.Record]]:
        f.seek(0)
        head = f.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE:
            self.short_header = True
            self.size = self.end = len(head)
            self.why = "file shorter than its header"
            return
        first = self.header_seq = aof.read_header(self.path, head, aof.SEGMENT_MAGIC)
        self.end = HEADER_SIZE
        decode = records.decode
        for offsets, payloads, scan in aof.file_frames(f, HEADER_SIZE,
                                                       TAIL_SETTLE if self.last else ()):
            for offset, payload in zip(offsets, payloads, strict=True):
                try:
                    rec = decode(payload)
                except records.DecodeError as e:
                    raise CorruptionError(self.path, offset, self.last_seq, str(e)) from None
                if self.first_seq is None:
                    if rec.seq != first:
                        raise CorruptionError(
                            self.path, offset, None,
                            f"header says first seq {first}, first record has {rec.seq}")
                    self.first_seq, self.first_time = rec.seq, rec.time
                self.records += 1
                self.last_seq, self.last_time = rec.seq, rec.time
                yield offset, rec
            if scan is not None:
                self.end, self.size, self.why = scan.end, scan.size, scan.why
                if self.why is not None:
                    f.seek(0)
                    self._data = f.read()  # for tail_is_torn, from the file we have open
                return

    @property
    def clean(self) -> bool:
        return self.why is None

    def tail_is_torn(self) -> bool:
        """After a bad frame: True if no good record follows it (a torn tail)."""
        if self.short_header:
            return True
        data = self._data if self._data is not None else self.path.read_bytes()
        # start-up's rule (recovery): no run of records continuing the log follows
        last = self.last_seq if self.last_seq is not None else (self.header_seq or 1) - 1
        return aof.later_good_frame(data, self.end, last) is None

    def damage(self) -> CorruptionError:
        return CorruptionError(self.path, self.end, self.last_seq, self.why or "damage")

    def torn_warning(self) -> str:
        return torn_warning(self.path, self.size, self.end, self.why or "", self.last_seq,
                            None if self.short_header else self.header_seq)


def torn_warning(path: Path, size: int, end: int, why: str, last_seq: int | None,
                 header_seq: int | None) -> str:
    """The tools' warning for a last segment that ends in a torn (or in-progress) write;
    `header_seq` None: the file is shorter than its header."""
    if header_seq is None:
        return f"{path}: last segment has no complete header yet ({size} bytes)"
    after = f"seq {last_seq}" if last_seq is not None else "its header"
    return (f"{path}: the last segment ends in {size - end} bytes that are not "
            f"a complete record ({why}) at offset {end}, after {after}: a write in "
            f"progress if a server is running, else a torn write that start-up cuts off")


@attrs.define
class OpenDir:
    """A data directory's files, opened together right after listing them.

    A live server's compactor may unlink segments and snapshots at any moment;
    a file opened before that stays readable, so what was listed can be read.
    `iter_records` consumes the segment files; the snapshot files stay open
    until `close()` (they can be read more than once).
    """

    layout: Layout
    segments: list[BinaryIO | None]  # None beyond EAGER_OPEN: opened when reached
    snapshots: list[BinaryIO]

    def snapshot_file(self, snap: SnapshotFile) -> BinaryIO:
        return self.snapshots[self.layout.snapshots.index(snap)]

    def close(self) -> None:
        for f in [*self.segments, *self.snapshots]:
            if f is not None:
                f.close()

    def __enter__(self) -> OpenDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_dir(data_dir: Path, tries: int = 50) -> OpenDir:
    """List the directory and open its files at once (segments: the first EAGER_OPEN).

    A file unlinked between listing and opening means a compaction just
    finished: list again (after a short pause, growing: a server compacting
    constantly can take several tries).
    """
    for attempt in range(tries):
        if attempt:
            time.sleep(min(0.002 * attempt, 0.05))
        lay = layout(data_dir)
        opened = OpenDir(lay, [], [])
        try:
            for snap in lay.snapshots:
                opened.snapshots.append(open(snap.path, "rb"))  # noqa: SIM115
            for i, seg in enumerate(lay.segments):
                opened.segments.append(open(seg.path, "rb") if i < EAGER_OPEN else None)  # noqa: SIM115
        except FileNotFoundError:
            opened.close()
            continue
        return opened
    raise RuntimeError(f"{data_dir}: files keep disappearing while being opened")


def iter_records(
    data_dir: Path | str,
    from_seq: int | None = None,
    include_open: bool = True,
    *,
    warn: Warn | None = None,
    progress: Progress | None = None,
    opened: OpenDir | None = None,
) -> Iterator[tuple[Path, int, records.Record]]:
    """Every record the log holds, as (segment path, offset, record), in seq order.

    - `from_seq`: start there; segments wholly before it are not read. If the
      log no longer holds `from_seq` (folded into a snapshot), HistoryFolded.
    - `include_open=False`: leave out the last segment (the one a running
      server appends to), so only closed, immutable segments are read.
    - Sequence numbers are checked to follow on without gaps; damage raises
      CorruptionError. A torn or still-being-written tail of the last segment
      ends the stream and is reported through `warn` (default: logging).
    - `progress(bytes read, bytes in all)` is called now and then.
    - `opened`: the files of `open_dir(data_dir)` to read (to list once and
      make several decisions on the same files); its segments are consumed.
    """
    data_dir = Path(data_dir)
    warn = warn or log.warning
    own = opened is None
    if opened is None:
        opened = open_dir(data_dir)
    lay, files = opened.layout, opened.segments
    try:
        n_all = len(lay.segments)
        chosen = list(zip(lay.segments, files, strict=True))
        if not include_open and chosen:
            chosen = chosen[:-1]
        if from_seq is not None:
            gone = lay.folded(from_seq)
            if gone is not None:
                raise gone
            while len(chosen) > 1 and chosen[1][0].first <= from_seq:
                seg, f = chosen.pop(0)
                if f is not None:
                    f.close()
        total = sum(seg.size for seg, _ in chosen)
        done = 0
        expected: int | None = None
        for seg, f in chosen:
            is_last = seg is lay.segments[-1] and n_all > 0
            if f is None:
                try:
                    f = open(seg.path, "rb")  # noqa: SIM115
                except FileNotFoundError:
                    after = expected - 1 if expected is not None else None
                    raise CorruptionError(seg.path, 0, after,
                                          "segment disappeared while reading (a compaction "
                                          "folded it meanwhile); run the command again") from None
            reader = SegmentReader(seg.path, f, last=is_last)
            count = 0
            for offset, rec in reader:
                if expected is not None and rec.seq != expected:
                    raise CorruptionError(seg.path, offset, expected - 1,
                                          f"sequence gap: expected {expected}, found {rec.seq}")
                expected = rec.seq + 1
                count += 1
                if progress is not None and count & 0xFFF == 0:
                    progress(done + offset, total)
                if from_seq is not None and rec.seq < from_seq:
                    continue
                yield seg.path, offset, rec
            if not reader.clean:
                if is_last and reader.tail_is_torn():
                    warn(reader.torn_warning())
                else:
                    raise reader.damage()
            done += seg.size
            if progress is not None:
                progress(done, total)
    finally:
        for f in files:
            if f is not None:
                f.close()
        if own:
            opened.close()


# --- snapshots --------------------------------------------------------------------


def iter_snapshot(path: Path, file: BinaryIO | None = None) -> Iterator[list]:
    """A snapshot's items one by one (meta first): `snapshot.iter_items`, the
    one snapshot reader (a format-3 `jobs` item comes as `job` items, too).

    Raises CorruptionError on damage, including a missing `end` frame; the
    error comes when the reader gets there, so a caller that needs a whole
    valid snapshot must read to the end before trusting what it got. A
    `file` given is read from its start and left open.
    """
    yield from snapshot.iter_items(path, file=file)


def load_snapshot(path: Path, file: BinaryIO | None = None) -> State:
    """The state in a snapshot (`snapshot.load` for a file a live server may unlink)."""
    try:
        return snapshot_codec.load(iter_snapshot(path, file))
    except (StateError, TypeError, ValueError, KeyError, IndexError) as e:
        raise CorruptionError(path, 0, None, f"snapshot items do not load: {e!r}") from None


def snapshot_meta(path: Path, file: BinaryIO | None = None) -> dict:
    """The meta item of a snapshot by name (reads only the first frame)."""
    items = iter_snapshot(path, file)
    try:
        item = next(items)
    finally:
        items.close()
    names = ("last_seq", "time", "next_job_id", "next_conn_id", "total_jobs", "job_timeouts")
    return dict(zip(names, item[1:], strict=False))
