"""The segmented append-only file: frames, segment files, and reading them back.

The format is specified in snapshots/README.md; in short:

- a segment is `DATA_DIR/aof/<first seq, 20 digits>.aof`: a 24-byte header
  (magic `SSTKAOF\\0`, u32 version, u64 first seq, u32 CRC32 of the preceding
  20 bytes) followed by frames;
- a frame is u32 payload length, u32 CRC32 of the payload, then the payload
  (one record's CBOR array), all little-endian;
- a segment may end in zero bytes (space allocated ahead of the records):
  a frame header of zeros with only zeros after it is the end of the records.

`SegmentWriter` appends records to a buffer; `write()` puts the buffer in the
file and `sync()` makes it durable (group commit: journal.py decides when).

`decode_frames` is the one frame decoder: every reader of segments,
snapshots and the replication feed cuts frames with it (`frame_batches` over
a file in memory, `file_frames` streaming an open file), and stops at the
first frame that does not check out, reporting where. What the frames of a
segment mean as records, and the log's rules, are logread.py's. File names
are datadir.py's.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Iterator
from os import pwrite  # a turn's write: a global, not an attribute of `os`, in the compiled build
from pathlib import Path
from typing import BinaryIO
from zlib import crc32

import attrs

from smallstalk.core import records

# The names are datadir's; re-exported here for the many readers that list segments.
from smallstalk.storage.datadir import (  # noqa: F401
    list_segments,
    list_snapshots,
    segment_name,
    snapshot_name,
)

try:  # the compiled build's frame header (framehead.pyx)
    from smallstalk.storage import framehead
    FAST_HEAD = True
except ImportError:  # the pure build: struct and zlib
    FAST_HEAD = False

SEGMENT_MAGIC = b"SSTKAOF\x00"
SNAPSHOT_MAGIC = b"SSTKSNP\x00"
HEADER = struct.Struct("<8sIQ")  # magic, version, first seq (segment) / last seq (snapshot)
HEADER_SIZE = HEADER.size + 4
FRAME = struct.Struct("<II")  # payload length, CRC32 of payload
_FRAME_PACK = FRAME.pack
FRAME_SIZE = FRAME.size
MAX_FRAME = 1 << 31  # a length beyond this is damage, not data
PREALLOCATE = 1 << 20  # bytes a segment file is allocated ahead of its records
ZERO_FRAME = "zero-length frame"

# fsync policies (journal.py carries them out)
FSYNC_ALWAYS, FSYNC_INTERVAL, FSYNC_NEVER = "always", "interval", "never"


class CorruptionError(Exception):
    """Damage that start-up must not skip: names the file, offset and sequence number."""

    def __init__(self, path: Path, offset: int, seq: int | None, why: str):
        self.path, self.offset, self.seq, self.why = path, offset, seq, why
        after = f"after seq {seq}" if seq is not None else "before any record"
        super().__init__(f"{path}: {why} at offset {offset} ({after})")


def header(magic: bytes, seq: int) -> bytes:
    head = HEADER.pack(magic, records.FORMAT_VERSION, seq)
    return head + struct.pack("<I", zlib.crc32(head))


def frame(payload: bytes) -> bytes:
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def read_header(path: Path, data: bytes, magic: bytes) -> int:
    """Check a file header; return the sequence number it carries."""
    if len(data) < HEADER_SIZE:
        raise CorruptionError(path, 0, None, "file shorter than its header")
    got_magic, version, seq = HEADER.unpack_from(data)
    (crc,) = struct.unpack_from("<I", data, HEADER.size)
    if got_magic != magic or crc != zlib.crc32(data[: HEADER.size]):
        raise CorruptionError(path, 0, None, "bad header")
    if not 1 <= version <= records.FORMAT_VERSION:
        # Older versions stay readable (their decoders are kept); newer ones are not ours.
        raise CorruptionError(path, 0, None, f"unknown format version {version}")
    return seq


@attrs.define
class FrameScan:
    """Where reading a file stopped: `end` is the offset after the last good
    frame. A clean read may end before `size`: the rest is preallocated zeros."""

    end: int
    size: int
    why: str | None = None  # None: the whole file read cleanly

    @property
    def clean(self) -> bool:
        return self.why is None


def decode_frames(buf: bytes | bytearray, pos: int, offsets: list[int], payloads: list,
                  limit: int = -1, base: int = 0) -> tuple[int, str | None]:
    """The frame decoder: cut whole, good frames out of `buf` from `pos`.

    Appends each frame's offset (`base` + its position in `buf`) and payload
    to `offsets` and `payloads`, up to `limit` frames (-1: no limit). Returns
    the position after the last good frame and why it stopped there: None
    when `buf` ends (perhaps inside a frame: read more, or `frame_damage` at
    the end of the file) or the limit is reached, else the damage found.
    """
    n = len(buf)
    head = FRAME.size
    unpack = FRAME.unpack_from
    crc32 = zlib.crc32
    while limit and n - pos >= head:
        length, crc = unpack(buf, pos)
        if length == 0:
            # Every record encodes to at least one byte: zeros are space
            # allocated ahead of the records (the end, if only zeros follow:
            # `is_zeros`), or a tail the file system allocated but a write
            # never filled.
            return pos, ZERO_FRAME
        if length > MAX_FRAME:
            return pos, "frame runs past the end of the file"
        end = pos + head + length
        if end > n:
            break
        payload = buf[pos + head:end]
        if crc32(payload) != crc:
            return pos, "checksum mismatch"
        offsets.append(base + pos)
        payloads.append(payload)
        pos = end
        limit -= 1
    return pos, None


SEGMENT_BATCH = 512  # frames decoded at a time from a file in memory
CHUNK = 1 << 20  # bytes read at a time from a file streamed


def frame_batches(data: bytes, start: int = HEADER_SIZE,
                  ) -> Iterator[tuple[list[int], list[bytes], FrameScan | None]]:
    """The frames of a whole file in memory, SEGMENT_BATCH at a time:
    (offsets, payloads, None), and last (offsets, payloads, how it ended)."""
    pos = start
    n = len(data)
    while True:
        offsets: list[int] = []
        payloads: list[bytes] = []
        pos, why = decode_frames(data, pos, offsets, payloads, SEGMENT_BATCH)
        if why is None and len(offsets) == SEGMENT_BATCH and pos < n:
            yield offsets, payloads, None
            continue
        if pos < n and (why is None or why == ZERO_FRAME):
            why = None if is_zeros(data, pos) else frame_damage(data, pos)
        yield offsets, payloads, FrameScan(pos, n, why)
        return


def is_zeros(buf: bytes | bytearray, pos: int = 0) -> bool:
    """Are the bytes from `pos` on all zero? (A segment's preallocated tail:
    the end of its records, see SegmentWriter.)"""
    return buf.count(0, pos) == len(buf) - pos


def _zeros_to_end(f: BinaryIO, buf: bytes) -> int | None:
    """len(buf) plus what is left of `f`, if all of it is zeros; else None."""
    if not is_zeros(buf):
        return None
    n = len(buf)
    while chunk := f.read(CHUNK):
        if not is_zeros(chunk):
            return None
        n += len(chunk)
    return n


def file_frames(f: BinaryIO, start: int = HEADER_SIZE, settle: tuple[float, ...] = (),
                ) -> Iterator[tuple[list[int], list[bytes], FrameScan | None]]:
    """The frames of an open file, streamed a CHUNK at a time (memory stays
    bounded): `frame_batches`' items and rules. `settle`: delays to wait, when
    the records end in a frame that does not check out, for a write in
    progress to complete it (a live server's last segment).
    """
    f.seek(start)
    buf = b""
    base = start  # file offset of buf[0]; f is at base + len(buf)
    waits = list(settle)
    head = FRAME.size
    while True:
        offsets: list[int] = []
        payloads: list[bytes] = []
        pos, why = decode_frames(buf, 0, offsets, payloads, base=base)
        if pos:
            buf = buf[pos:]
            base += pos
        if why is None:
            need = head if len(buf) < head else head + FRAME.unpack_from(buf)[0]
            more = f.read(max(CHUNK, need - len(buf)))
            if more:
                buf += more
                if offsets:
                    yield offsets, payloads, None
                continue
            if not buf or is_zeros(buf):
                yield offsets, payloads, FrameScan(base, base + len(buf))
                return
            why = frame_damage(buf, 0)
        elif why == ZERO_FRAME:
            size = _zeros_to_end(f, buf)
            if size is not None:
                yield offsets, payloads, FrameScan(base, base + size)
                return
        if waits:
            time.sleep(waits.pop(0))  # a write in progress may complete the frame
            f.seek(base)
            buf = b""
            if offsets:
                yield offsets, payloads, None
            continue
        yield offsets, payloads, FrameScan(base, os.fstat(f.fileno()).st_size, why)
        return


def read_frames(data: bytes, start: int = HEADER_SIZE) -> Iterator[tuple[int, bytes] | FrameScan]:
    """Yield (offset, payload) per good frame, then one FrameScan saying how it ended."""
    for offsets, payloads, scan in frame_batches(data, start):
        yield from zip(offsets, payloads, strict=True)
        if scan is not None:
            yield scan


def frame_damage(data: bytes, pos: int) -> str:
    """Why the frame at `pos` does not check out (the caller found it does not)."""
    n = len(data)
    if n - pos < FRAME.size:
        return "incomplete frame header"
    length, crc = FRAME.unpack_from(data, pos)
    if length == 0:
        return ZERO_FRAME
    if length > MAX_FRAME or pos + FRAME.size + length > n:
        return "frame runs past the end of the file"
    return "checksum mismatch"


def later_good_frame(data: bytes, after: int, last_seq: int = -1) -> int | None:
    """Offset of a run of valid records after `after` that continues the log, if any.

    Tells a torn tail (nothing valid follows) from damage in the middle of a
    file (valid records follow, so truncating would drop acknowledged data).
    A candidate counts only if, from it, frames check out all the way to the
    end of the file with consecutive seqs above `last_seq`: bytes inside a job
    body that happen to look like a frame do not.
    """
    n = len(data)
    unpack = FRAME.unpack_from
    # A frame's length is not zero: none starts past the last non-zero byte
    # (a torn write into space allocated ahead has up to PREALLOCATE zeros after it).
    last = len(data.rstrip(b"\0"))
    for pos in range(after + 1, min(n - FRAME.size, last)):
        length, _crc = unpack(data, pos)
        if (0 < length <= n - pos - FRAME.size  # (cheap: most offsets fail here)
                and decode_frames(data, pos, [], [], 1)[0] > pos
                and _continues(data, pos, last_seq)):
            return pos
    return None


def _continues(data: bytes, start: int, last_seq: int) -> bool:
    prev = None
    for entry in read_frames(data, start):
        if isinstance(entry, FrameScan):
            return entry.clean and prev is not None
        try:
            rec = records.decode(entry[1])
        except records.DecodeError:
            return False
        if rec.seq <= last_seq or (prev is not None and rec.seq != prev + 1):
            return False
        prev = rec.seq
    return False


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """`mkdir -p` that a power cut cannot undo: a directory entry is durable only
    once its parent is fsynced, so each directory created is fsynced into its parent."""
    missing = []
    p = path
    while not p.is_dir():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            pass  # made meanwhile by another process, which may not have fsynced it yet
        fsync_dir(d.parent)


class SegmentWriter:
    """The open segment. Not thread-safe: the loop hands it to one thread at a time.

    The file is allocated ahead of the records, `preallocate` bytes at a time:
    an fsync that must also record a bigger file costs the disk a metadata
    write each time, one into space already allocated does not (the
    fsync-per-acknowledgement rows of the benchmark, docs/PERFORMANCE.md). So
    a live segment ends in zeros, which readers take as its end (see
    `decode_frames`); `finish` and `close` cut them off.
    """

    def __init__(self, directory: Path, first_seq: int, preallocate: int = PREALLOCATE):
        self.directory = directory
        self.first_seq = first_seq
        self.path = directory / segment_name(first_seq)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(self.fd, header(SEGMENT_MAGIC, first_seq))
            os.fsync(self.fd)
            fsync_dir(directory)
        except OSError:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
            raise
        self.size = HEADER_SIZE  # bytes durable or written: where the next frame goes
        self.allocated = HEADER_SIZE  # the file's size: `size` and zeros after it
        self.preallocate = preallocate
        self.records = 0
        self.last_seq = first_seq - 1
        # (size, records, last_seq) known to be on disk: a failed fsync cuts back to it.
        self.durable = (self.size, 0, self.last_seq)
        # The staged frames, headers and payloads in turn, joined by `write`: a
        # list's appends, where a buffer's `+=` reallocates as it grows, each turn.
        self.pending = []
        self.pending_bytes = 0
        self.pending_records = 0
        self.pending_last_seq = self.last_seq
        self.needs_cut = False  # a failed write may have left bytes past self.size

    def append(self, payload: bytes, seq) -> None:
        pending = self.pending  # `frame`, inlined: a call and a copy of the payload a record
        n = len(payload)
        head = framehead.head(payload) if FAST_HEAD else None
        pending.append(_FRAME_PACK(n, crc32(payload)) if head is None else head)
        pending.append(payload)
        self.pending_bytes += FRAME_SIZE + n
        self.pending_records += 1
        self.pending_last_seq = seq

    def write(self) -> None:
        """Put the pending frames in the file; on failure cut the file back."""
        if not self.pending:
            return
        data = b"".join(self.pending)
        if self.needs_cut:
            # Never leave a stale partial frame behind frames shorter than it.
            os.ftruncate(self.fd, self.size)
            self.allocated = self.size
            self.needs_cut = False
        end = self.size + len(data)
        if end > self.allocated and self.preallocate:
            self._allocate(end)
        try:
            written = pwrite(self.fd, data, self.size)  # no copy for the usual whole write
            while written < len(data):
                written += pwrite(self.fd, data[written:], self.size + written)
        except OSError:
            self._cut_back()
            raise
        self.size = end
        self.allocated = max(self.allocated, end)
        self.records += self.pending_records
        self.last_seq = self.pending_last_seq
        self.pending.clear()
        self.pending_bytes = 0
        self.pending_records = 0

    def _allocate(self, end: int) -> None:
        want = max(end, self.allocated + self.preallocate)
        try:
            os.posix_fallocate(self.fd, self.allocated, want - self.allocated)
        except OSError:
            # A full disk, a file size limit, a file system without it: the
            # write itself decides, without preallocation from now on (a
            # failed call may have grown the file: zeros, which read as the end).
            self.preallocate = 0
            self.allocated = os.fstat(self.fd).st_size
            return
        self.allocated = want

    def discard_pending(self) -> None:
        self.pending.clear()
        self.pending_bytes = 0
        self.pending_records = 0
        self.pending_last_seq = self.last_seq

    def sync(self) -> None:
        os.fsync(self.fd)

    def finish(self) -> None:
        """Make the segment durable at its exact size: it closes for good."""
        self._trim()
        os.fsync(self.fd)

    def _trim(self) -> None:
        if self.allocated > self.size:
            os.ftruncate(self.fd, self.size)
            self.allocated = self.size

    def _cut_back(self) -> None:
        # A partial write must not stay behind the records we acknowledge next.
        self.needs_cut = True
        os.ftruncate(self.fd, self.size)
        self.allocated = self.size
        self.needs_cut = False

    def cut_back_to(self, size: int, records_: int, last_seq: int) -> None:
        self.size, self.records, self.last_seq = size, records_, last_seq
        self.needs_cut = True
        os.ftruncate(self.fd, size)
        self.allocated = size
        self.needs_cut = False

    def close(self) -> None:
        """Close the file, its preallocated zeros cut off (durably only if
        `finish` came first; left behind, they read as the end anyway)."""
        try:
            self._trim()
        except OSError:
            pass
        finally:
            os.close(self.fd)
