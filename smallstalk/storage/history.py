"""Streaming, read-only access to a data directory's history: snapshots, segments, records.

`iter_records(data_dir)` yields every record the AOF still holds as
`(segment path, byte offset, record)`, in sequence order, reading one chunk of
one file at a time: memory stays constant however long the log is. The
operator tools (`smallstalk aof`, `replay`, `job-history`) are built on it.
It reads with start-up's reader and rules (logread.LogReader, streaming), so
the two name the same damage.

Safe on the data directory of a live server: nothing is ever written, the
segments are opened as soon as they are listed (the compactor may unlink them
meanwhile; an open file stays readable), and the last segment is read up to
its readable prefix. A frame there that does not (yet) check out, with
nothing continuing the log after it, ends the read with a warning, not an
error: it is either a write in progress or a torn tail that start-up will cut
off. Damage anywhere else raises `aof.CorruptionError`, naming the file, the
offset and the last good seq.

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
from smallstalk.storage import datadir, snapshot, snapshot_codec
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.logread import LogReader

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


# --- segments ---------------------------------------------------------------------


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
    - The log's rules are checked as start-up checks them (logread.LogReader,
      streaming); damage raises CorruptionError. A torn or still-being-written
      tail of the last segment ends the stream and is reported through `warn`
      (default: logging).
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
        chosen = list(zip(lay.segments, files, strict=True))
        if not include_open and chosen:
            chosen = chosen[:-1]
        floor = _floor(lay)
        if from_seq is not None:
            gone = lay.folded(from_seq)
            if gone is not None:
                raise gone
            while len(chosen) > 1 and chosen[1][0].first <= from_seq:
                seg, f = chosen.pop(0)
                if f is not None:
                    f.close()
                if floor is not None:
                    floor = max(floor, chosen[0][0].first - 1)  # the skipped ones hold those
        starts: dict[Path, int] = {}  # bytes in the segments before each one
        total = 0
        for seg, _ in chosen:
            starts[seg.path], total = total, total + seg.size
        reader = LogReader([seg.path for seg, _ in chosen], floor,
                           after=from_seq - 1 if from_seq is not None else None,
                           files=[f for _, f in chosen], torn_tail=include_open, stream=True,
                           settle=TAIL_SETTLE)
        for path, _data, offsets, recs in reader.batches():
            if progress is not None:  # a batch is a read's worth of frames
                progress(starts[path] + offsets[-1], total)
            for offset, rec in zip(offsets, recs, strict=True):
                yield path, offset, rec
        for read in reader.read:
            if read.torn is not None:
                warn(read.torn_warning())
        if progress is not None:
            progress(total, total)
    finally:
        for f in files:
            if f is not None:
                f.close()
        if own:
            opened.close()


def _floor(lay: Layout) -> int | None:
    """The seq the log's first record may follow: the newest snapshot's (start-up's
    rule), or None where records are missing that no snapshot holds (damage that
    `Layout.folded` names; the tools say so and show what the log holds)."""
    newest = lay.newest_snapshot
    floor = newest.seq if newest is not None else 0
    first = lay.first_kept
    return None if first is not None and first > floor + 1 else floor


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
