"""The fsync thread: makes written AOF records durable while the loop goes on.

Under `--fsync always` the loop writes a turn's records to the segment and
asks this thread to fsync them; meanwhile it runs the next turns (whose
replies wait too). A request the thread has not started yet is replaced by
a newer one: one fsync covers every write before it, so requests coalesce
into as few fsyncs as the disk allows. This is group commit with two batches
in flight: the disk syncs one while the loop parses and applies the next.

Why a thread of our own and not `trio.to_thread`: handing work to trio's
thread pool and back costs ~65 us of CPU and latency per fsync here, a
dedicated thread woken through an eventfd ~22 us (bench notes in
docs/ARCHITECTURE.md). The thread touches no Python state of the loop: it
fsyncs a duplicate of the segment's descriptor (the loop may close its own
meanwhile), records the outcome under a lock and writes to an eventfd the
loop's trio task waits on.

Each request carries a generation: after a failure the loop starts a new
one, so a late answer about records it has since dropped is ignored, and
the thread skips the failed generation's queued requests.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


class SyncResult:
    __slots__ = ("gen", "seq", "position", "error")

    def __init__(self, gen: int, seq: int, position: tuple, error: OSError | None):
        self.gen, self.seq, self.position, self.error = gen, seq, position, error


_STOP = object()


class Syncer:
    def __init__(self, fsync: Callable[[int], None] = os.fsync) -> None:
        self._fsync = fsync  # tests pass one that waits, or fails like a disk
        self._lock = threading.Lock()
        self._wanted = None  # (gen, seq, fd, position) not started yet, or _STOP
        self._result: SyncResult | None = None
        self._failed_gen = -1
        self._wake = os.eventfd(0, os.EFD_CLOEXEC)  # the thread blocks on it
        self.done_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)  # the loop waits on it
        self._thread = threading.Thread(target=self._run, name="smallstalk-fsync", daemon=True)
        self._thread.start()

    def request(self, gen: int, seq: int, fd: int, position: tuple) -> None:
        """fsync `fd` (duplicated here) and report `seq` durable; `position`
        comes back with the result (where the file is durable up to)."""
        dup = os.dup(fd)
        with self._lock:
            old, self._wanted = self._wanted, (gen, seq, dup, position)
        if old is not None and old is not _STOP:
            os.close(old[2])  # superseded: the newer request's fsync covers it
        os.eventfd_write(self._wake, 1)

    def take_result(self) -> SyncResult | None:
        """The latest outcome (an error sticks until the loop starts a new generation)."""
        with self._lock:
            res, self._result = self._result, None
        return res

    def stop(self) -> None:
        with self._lock:
            old, self._wanted = self._wanted, _STOP
        if old is not None and old is not _STOP:
            os.close(old[2])
        os.eventfd_write(self._wake, 1)
        self._thread.join()
        os.close(self._wake)
        os.close(self.done_fd)

    def _run(self) -> None:
        while True:
            os.eventfd_read(self._wake)  # blocks without the GIL
            with self._lock:
                req, self._wanted = self._wanted, None
            if req is None:
                continue
            if req is _STOP:
                return
            gen, seq, fd, position = req
            if gen == self._failed_gen:
                os.close(fd)
                continue
            error = None
            try:
                self._fsync(fd)
            except OSError as e:
                error = e
            finally:
                os.close(fd)
            with self._lock:
                if error is not None:
                    self._failed_gen = gen
                    self._result = SyncResult(gen, seq, position, error)
                elif self._result is None or self._result.error is None:
                    self._result = SyncResult(gen, seq, position, None)
            os.eventfd_write(self.done_fd, 1)
