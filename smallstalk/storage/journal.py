"""The AOF as the mutation loop uses it: sequence numbers, group commit, rotation.

`Journal.append(record)` stages a record (encoded into the open segment's
buffer). A commit has two steps, each with one body here: `write_staged()`
puts everything staged in the file (`written_seq`), `sync()` makes it durable
(`committed_seq`, what replicas may be sent). Which caller takes which path:

- `await commit()` (start-up; the loop under `always` before its fsync
  thread runs; the loop's turn whose write fills the segment):
  `write_staged()`, then under `always` `sync()`, in this thread for a
  small batch and in a worker thread for a big one; under `everysec` a
  background task fsyncs at most every `interval` seconds; under `never`
  the kernel flushes. `commit_now()` is the same without an await, for the
  loop's other turns under `everysec` and `never` (no rotation follows).
- The loop under `always` (server/commit.py) calls the two steps itself:
  `write_staged()` at the end of each turn, then `sync()` inline for a small
  turn or `sync_in_background()` (the fsync thread, syncer.py) for a big one,
  whose answer `sync_result()` takes. So the next turns are parsed and
  applied while the disk works, and each reply waits only for what it needs.
  Why the split stays, and why a small batch is synced inline: the
  measurements in docs/PERFORMANCE.md ("Group commit, inline fsync threshold").

Once the open segment holds `segment_records` records or `segment_bytes`
bytes it is closed and the next one started (`rotate`, or `rotate_now` in
the loop's thread when the old segment is durable already). Closed segments
are what the compactor folds.

A failed write or fsync raises `JournalError`: the segment is cut back to the
last committed size so no half-written batch stays in front of later records,
and the caller must treat the staged records as never having happened.
"""

from __future__ import annotations

import logging
import os
import select
import time
from pathlib import Path

import trio

from smallstalk.core import records
from smallstalk.storage import datadir
from smallstalk.storage.aof import (
    FSYNC_ALWAYS,
    FSYNC_NEVER,
    HEADER_SIZE,
    PREALLOCATE,
    SegmentWriter,
    fsync_dir,
)
from smallstalk.storage.datadir import list_segments, segment_name
from smallstalk.storage.observe import StorageMetrics
from smallstalk.storage.syncer import Syncer

log = logging.getLogger("smallstalk.storage.journal")

# Under --fsync always, at most this many unsynced records are fsynced in the
# loop's own thread (by `commit`, and by the loop's two-step commit): a thread
# hand-off costs more than a small batch could overlap. Bigger batches go to
# a thread, so the next batch is parsed and applied while the disk works.
# Why 64 and not 4 or 16: docs/PERFORMANCE.md (group commit).
INLINE_SYNC_RECORDS = 64



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
        self.aof_dir = datadir.aof_dir(data_dir)
        self.aof_dir.mkdir(parents=True, exist_ok=True)
        fsync_dir(data_dir)
        self.fsync = fsync
        self.interval = interval
        self.segment_records = segment_records
        self.segment_bytes = segment_bytes
        self.next_seq = next_seq
        self.committed_seq = next_seq - 1  # durable as the policy promises
        self.written_seq = next_seq - 1  # in the file (page cache at least)
        self.records_written = 0
        # The fsync thread (always, started by the loop) and what was asked of it.
        self.syncer: Syncer | None = None
        self._sync_gen = 0
        self.sync_asked = next_seq - 1  # the highest seq the fsync thread was asked for
        self.segment: SegmentWriter | None = None
        self._dirty = False  # written but not fsynced (interval mode)
        self.rotated = trio.Event()  # set when a segment closes (wakes the compactor)
        self.metrics = StorageMetrics()  # fsync latency, commit sizes (the console reports them)
        self._open_segment()

    def _open_segment(self) -> None:
        leftover = self.aof_dir / segment_name(self.next_seq)
        if leftover.exists() and leftover.stat().st_size <= HEADER_SIZE:
            # Opened just before a stop and never written to: no records in it.
            leftover.unlink()
        # Allocated ahead no further than a segment may grow (see SegmentWriter).
        self.segment = SegmentWriter(self.aof_dir, self.next_seq,
                                     min(PREALLOCATE, self.segment_bytes))

    # --- staging ---------------------------------------------------------------

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def append(self, rec: records.Record) -> bytes:
        payload = records.encode(rec)
        self.append_payload(payload, rec.seq)
        return payload

    def append_payload(self, payload: bytes, seq) -> None:
        """Stage an encoded record (`append` does the encoding)."""
        self.segment.append(payload, seq)

    def appended_at(self) -> tuple[Path, int]:
        """(file, offset) where the last staged record's payload will end once
        written (the file grows by whole frames from its size): read-behind
        finds a put's body there, as the body is the record's last field."""
        seg = self.segment
        return seg.path, seg.size + seg.pending_bytes

    def expect_seq(self, seq: int) -> None:
        """A replica logs the primary's seqs: take exactly this one next."""
        if seq != self.next_seq:
            raise JournalError(f"replicated seq {seq}, journal expects {self.next_seq}")
        self.next_seq += 1

    def reset(self, next_seq: int) -> None:
        """Drop every segment and start over at next_seq (a replica's full resync)."""
        self.wait_for_syncs()
        self._sync_gen += 1
        self.segment.discard_pending()
        self.segment.close()
        for _first, path in list_segments(self.aof_dir):
            path.unlink()
        self.next_seq = next_seq
        self.committed_seq = self.written_seq = self.sync_asked = next_seq - 1
        self._open_segment()

    def has_pending(self) -> bool:
        return bool(self.segment.pending)

    def discard(self) -> None:
        """Forget staged records after a failed commit; their seqs are reused."""
        self.segment.discard_pending()
        self.next_seq = self.written_seq + 1

    # --- committing --------------------------------------------------------------

    def _timed(self, sync) -> None:
        t0 = time.perf_counter()
        sync()
        self.metrics.fsync_seconds.observe(time.perf_counter() - t0)

    def _timed_fsync(self, fd: int) -> None:
        """os.fsync for the fsync thread, measured (that thread is the only observer then)."""
        self._timed(lambda: os.fsync(fd))

    async def commit(self) -> None:
        """Make everything staged as durable as the policy promises (see the
        module's docstring). JournalError if the write or the fsync fails:
        the segment is cut back and the staged records are gone."""
        seg = self.segment
        if not seg.pending:
            return
        count = seg.pending_records
        self.write_staged()
        if self.fsync == FSYNC_ALWAYS:
            if count <= INLINE_SYNC_RECORDS:
                self.sync()
            else:
                await trio.to_thread.run_sync(self.sync)
        else:
            self._written_is_committed(count)
        if self.segment_full():
            await self.rotate()

    def commit_now(self) -> bool:
        """`commit` where it would not wait: under `everysec` and `never`, when
        the segment is not full after the write (no rotation follows). True,
        committed (JournalError as `commit`'s); False, having done nothing: the
        caller awaits `commit`. (The loop asks this first: an await costs two
        coroutines a turn.)"""
        seg = self.segment
        if not seg.pending:
            return True
        if self.fsync == FSYNC_ALWAYS or self.segment_full(seg.pending_records, seg.pending_bytes):
            return False
        count = seg.pending_records
        self.write_staged()
        self._written_is_committed(count)
        return True

    def _written_is_committed(self, count) -> None:
        """Under `everysec` and `never` a written batch is committed: the kernel
        (or the background fsync, `_dirty`) takes it from there."""
        self.committed_seq = self.sync_asked = self.written_seq
        seg = self.segment
        seg.durable = (seg.size, seg.records, seg.last_seq)
        self.metrics.commit_records.observe(count)
        self._dirty = True

    def segment_full(self, records=0, nbytes=0) -> bool:
        """The open segment is full, or would be with `records` more records of
        `nbytes` (`commit_now` asks before its write)."""
        seg = self.segment
        return (seg.records + records >= self.segment_records
                or seg.size + nbytes >= self.segment_bytes)

    # --- the two steps ---------------------------------------------------------------

    def write_staged(self) -> None:
        """Write what is staged, without an fsync. JournalError if the write
        fails (the segment is cut back; the staged records are gone)."""
        seg = self.segment
        if not seg.pending:
            return
        count, last = seg.pending_records, seg.pending_last_seq
        try:
            seg.write()
        except OSError as e:
            seg.discard_pending()
            self.next_seq = self.written_seq + 1
            raise JournalError(f"writing {seg.path}: {e}") from e
        self.written_seq = last
        self.records_written += count

    def sync(self) -> None:
        """fsync in this thread: everything written is durable on return."""
        seg = self.segment
        batch = self.written_seq - self.committed_seq
        try:
            self._timed(seg.sync)
        except OSError as e:
            self.fail_unsynced()
            raise JournalError(f"fsync {seg.path}: {e}") from e
        self.metrics.commit_records.observe(batch)
        self.committed_seq = self.sync_asked = self.written_seq
        seg.durable = (seg.size, seg.records, seg.last_seq)

    @property
    def syncing(self) -> bool:
        """A background fsync was asked for and has not answered yet."""
        return self.sync_asked > self.committed_seq

    def sync_in_background(self) -> None:
        """Ask the fsync thread to make everything written so far durable."""
        seg = self.segment
        self.syncer.request(self._sync_gen, self.written_seq, seg.fd,
                            (seg.size, seg.records, seg.last_seq))
        self.metrics.commit_records.observe(self.written_seq - self.sync_asked)
        self.sync_asked = self.written_seq

    def sync_result(self) -> int:
        """Take the fsync thread's latest answer; the seq durable now.
        JournalError if it failed (everything not durable is cut off)."""
        res = self.syncer.take_result()
        if res is None or res.gen != self._sync_gen:
            return self.committed_seq  # nothing new, or about records dropped since
        if res.error is not None:
            self.fail_unsynced()
            raise JournalError(f"fsync {self.segment.path}: {res.error}")
        if res.seq > self.committed_seq:
            # Rotation waits for every fsync, so the answer is about this segment.
            self.committed_seq = res.seq
            self.segment.durable = res.position
        return self.committed_seq

    def wait_for_syncs(self) -> None:
        """Block until the fsync thread has answered everything asked of it
        (before a rotation or a reset). JournalError as `sync_result`."""
        if self.syncer is None:
            return
        while self.syncing:
            select.select([self.syncer.done_fd], [], [])
            try:
                os.eventfd_read(self.syncer.done_fd)
            except BlockingIOError:
                pass
            self.sync_result()

    def fail_unsynced(self) -> None:
        """An fsync failed: what was written after the last durable point may
        be lost, so it is cut off and its seqs are taken again."""
        seg = self.segment
        seg.discard_pending()
        self._sync_gen += 1
        self.next_seq = self.committed_seq + 1
        self.written_seq = self.sync_asked = self.committed_seq
        try:
            seg.cut_back_to(*seg.durable)
        except OSError:
            log.exception("could not cut %s back after a failed fsync", seg.path)

    def rotate_now(self) -> None:
        """Close the open segment durably at its exact size and start the
        next one, in this thread (the loop under always, after
        `wait_for_syncs`: the old segment is durable, its last fsync quick).
        On failure the open segment stays and takes records; logged."""
        self._rotated(self._next_segment())

    async def rotate(self) -> None:
        """`rotate_now` with the old segment's last fsync in a worker thread."""
        self._rotated(await trio.to_thread.run_sync(self._next_segment))

    def _next_segment(self) -> SegmentWriter | None:
        """The one body of a rotation (no trio: it may run in a thread). The
        old segment, or None if there was nothing to close or it failed."""
        old = self.segment
        if old.records == 0:
            return None
        try:
            old.finish()  # durable at its exact size before the next one exists
            self._open_segment()  # on failure self.segment is still `old`, open
        except OSError:
            log.exception("rotation failed; staying on %s", old.path)
            return None
        return old

    def _rotated(self, old: SegmentWriter | None) -> None:
        if old is None:
            return
        old.close()
        self._dirty = False
        self.rotated.set()  # wakes the compactor
        self.rotated = trio.Event()

    def start_syncer(self) -> Syncer:
        if self.syncer is None:
            self.syncer = Syncer(self._timed_fsync)
        return self.syncer

    def stop_syncer(self) -> None:
        if self.syncer is not None:
            self.syncer.stop()
            self.syncer = None
            # Unanswered requests are gone with the thread: close() syncs.
            self._sync_gen += 1
            self.sync_asked = self.committed_seq

    async def sync_now(self) -> None:
        if self._dirty:
            self._dirty = False
            await trio.to_thread.run_sync(self._timed, self.segment.sync)

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
