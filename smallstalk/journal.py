"""The AOF as the mutation loop uses it: sequence numbers, group commit, rotation.

`Journal.append(record)` stages a record (encoded into the open segment's
buffer). `await Journal.commit()` makes everything staged as durable as the
fsync policy promises, in one write and at most one fsync, run in a worker
thread so connection tasks keep reading and parsing meanwhile:

- `always`: write + fsync before the loop answers anyone (group commit);
- `everysec` (any interval): write now, fsync at most every `interval`
  seconds from a background task;
- `never`: write now, leave flushing to the kernel.

After a commit the open segment is closed and a new one started once it holds
`segment_records` records or `segment_bytes` bytes. Closed segments are what
the compactor folds.

A failed write or fsync raises `JournalError`: the segment is cut back to the
last committed size so no half-written batch stays in front of later records,
and the caller must treat the staged records as never having happened.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import trio

from . import records
from .aof import (
    FSYNC_ALWAYS,
    FSYNC_NEVER,
    HEADER_SIZE,
    SegmentWriter,
    fsync_dir,
    list_segments,
    segment_name,
)

log = logging.getLogger("smallstalk.journal")

# Under --fsync always, a commit of at most this many records writes and
# fsyncs in the loop's own thread: handing one fsync to a worker thread costs
# ~220 us of CPU and ~240 us of latency here (trio.to_thread's wake-ups),
# more than what a small batch could parse meanwhile. Bigger batches go to
# the thread, so the connections keep parsing the next batch while the disk
# works.
INLINE_SYNC_RECORDS = 16



class JournalError(Exception):
    pass


class Journal:
    def __init__(
        self,
        data_dir: Path,
        next_seq: int,
        fsync: str = FSYNC_ALWAYS,
        interval: float = 1.0,
        segment_records: int = 100_000,
        segment_bytes: int = 16 << 20,
    ):
        self.aof_dir = data_dir / "aof"
        self.aof_dir.mkdir(parents=True, exist_ok=True)
        fsync_dir(data_dir)
        self.fsync = fsync
        self.interval = interval
        self.segment_records = segment_records
        self.segment_bytes = segment_bytes
        self.next_seq = next_seq
        self.committed_seq = next_seq - 1
        self.records_written = 0
        self.segment: SegmentWriter | None = None
        self.appended_at: tuple[Path, int] | None = None  # (file, payload end) of the last append
        self._dirty = False  # written but not fsynced (interval mode)
        self.rotated = trio.Event()  # set when a segment closes (wakes the compactor)
        self._open_segment()

    def _open_segment(self) -> None:
        leftover = self.aof_dir / segment_name(self.next_seq)
        if leftover.exists() and leftover.stat().st_size <= HEADER_SIZE:
            # Opened just before a stop and never written to: no records in it.
            leftover.unlink()
        self.segment = SegmentWriter(self.aof_dir, self.next_seq)

    # --- staging ---------------------------------------------------------------

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def append(self, rec: records.Record) -> bytes:
        payload = records.encode(rec)
        seg = self.segment
        seg.append(payload, rec.seq)
        # Where this record's payload will end in the file once written (the
        # file grows by whole frames from seg.size): read-behind finds a put's
        # body there, as the body is the record's last field.
        self.appended_at = (seg.path, seg.size + len(seg.pending))
        return payload

    def expect_seq(self, seq: int) -> None:
        """A replica logs the primary's seqs: take exactly this one next."""
        if seq != self.next_seq:
            raise JournalError(f"replicated seq {seq}, journal expects {self.next_seq}")
        self.next_seq += 1

    def reset(self, next_seq: int) -> None:
        """Drop every segment and start over at next_seq (a replica's full resync)."""
        self.segment.discard_pending()
        self.segment.close()
        for _first, path in list_segments(self.aof_dir):
            path.unlink()
        self.next_seq = next_seq
        self.committed_seq = next_seq - 1
        self._open_segment()

    def has_pending(self) -> bool:
        return bool(self.segment.pending)

    def discard(self) -> None:
        """Forget staged records after a failed commit; their seqs are reused."""
        self.segment.discard_pending()
        self.next_seq = self.committed_seq + 1

    # --- committing --------------------------------------------------------------

    def _write_and_sync(self) -> None:
        self.segment.write()
        if self.fsync == FSYNC_ALWAYS:
            self.segment.sync()

    async def commit(self) -> None:
        seg = self.segment
        if not seg.pending:
            return
        count = seg.pending_records
        last = seg.pending_last_seq
        before = seg.size, seg.records, seg.last_seq
        try:
            if self.fsync == FSYNC_ALWAYS:
                if count <= INLINE_SYNC_RECORDS:
                    self._write_and_sync()
                else:
                    await trio.to_thread.run_sync(self._write_and_sync)
            else:
                seg.write()
                self._dirty = True
        except OSError as e:
            try:
                seg.cut_back_to(*before)
            except OSError:
                log.exception("could not cut the segment back after a failed write")
            raise JournalError(f"writing {seg.path}: {e}") from e
        self.committed_seq = last
        self.records_written += count
        if seg.records >= self.segment_records or seg.size >= self.segment_bytes:
            try:
                await self.rotate()
            except JournalError:
                # The batch is durable already: keep appending to this segment, retry later.
                log.exception("rotation failed; staying on %s", seg.path)

    async def rotate(self) -> None:
        """Close the open segment (durably) and start the next one."""
        old = self.segment
        if old.records == 0:
            return
        try:
            await trio.to_thread.run_sync(old.sync)
            self._open_segment()  # on failure self.segment is still `old`, open
        except OSError as e:
            raise JournalError(f"rotating {old.path}: {e}") from e
        old.close()
        self._dirty = False
        self.rotated.set()
        self.rotated = trio.Event()

    async def sync_now(self) -> None:
        if self._dirty:
            self._dirty = False
            await trio.to_thread.run_sync(self.segment.sync)

    async def run_interval_sync(self) -> None:
        """Background fsync for the interval policy."""
        while True:
            await trio.sleep(self.interval)
            try:
                await self.sync_now()
            except OSError:
                log.exception("background fsync failed")

    def closed_segments(self) -> list[Path]:
        """Segments before the open one, oldest first: immutable, safe to fold."""
        return [p for first, p in list_segments(self.aof_dir) if first < self.segment.first_seq]

    def close(self) -> None:
        if self.segment is not None:
            try:
                self.segment.write()
                if self.fsync != FSYNC_NEVER:
                    os.fsync(self.segment.fd)
            except OSError:
                log.exception("final flush failed")
            self.segment.close()
            self.segment = None
