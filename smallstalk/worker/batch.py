"""Batches (`Worker(batch=N)`, `--batch N`): when a job taken late in a batch
must be touched before it starts, and the deletes of finished jobs pipelined.

Theory of operation.

- A slot takes up to N jobs with one `reserve-batch` and runs them in
  order, one at a time (its connection holds them all). Every job's TTR
  runs from the reply, so a job waits for those before it. `needs_touch`:
  a job whose wait ate half its time limit (`time_limit(ttr)`, the TTR less
  a second) is touched before it starts, which gives it a whole TTR again
  (one round trip, only for late jobs); a touch answered NOT_FOUND means
  its TTR ran out already (another worker may have it): it is logged
  `job.lost` and skipped. An async task's time limit counts from the reply
  (or the touch), so the worker still gives up before the server does.
- `DeleteQueue`: a finished job's delete is queued, not awaited; one
  flusher task sends every queued delete in one write (`delete_many`), and
  the deletes queued while that write is in flight go in the next. So the
  next job starts at once, and N quick jobs cost about one round trip of
  deletes instead of N. A delete waits for at most the flush before it, and
  `job.done` is logged once the server answered DELETED.
- Stopping: the jobs of a batch not yet started when the worker stops are
  handed back by closing the slot's connection once the running job ended
  and the queued deletes were answered (a close is an immediate release
  that does not count as a failure), as jobs cancelled at the end of the
  grace are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import trio

from smallstalk.client import AsyncClient, BeanstalkError, Job

from .context import time_limit
from .logs import log_event


def needs_touch(received: float, now: float, ttr: int) -> bool:
    """Whether a job reserved at `received` (trio time) and starting at `now`
    has used half its time limit already, waiting behind its batch."""
    return now - received > time_limit(ttr) / 2


@attrs.define
class Finished:
    """A job whose task succeeded, waiting for its delete."""

    job: Job
    tube: str | None
    task: str | None
    ms: float


class DeleteQueue:
    """The deletes of one slot's finished jobs, sent by one flusher task in as
    few writes as the round trips allow (see the module docstring)."""

    def __init__(self, client: AsyncClient, nursery: trio.Nursery, counts: dict[str, int],
                 done: Callable[[Finished], None], lost: Callable[[Finished], None]) -> None:
        self.client = client
        self.nursery = nursery
        self.counts = counts  # the worker's: "delete_writes" counts the writes sent
        self.done = done
        self.lost = lost
        self.queued: list[Finished] = []
        self.flushing = False

    def add(self, item: Finished) -> None:
        self.queued.append(item)
        if not self.flushing:
            self.flushing = True
            self.nursery.start_soon(self._flush)

    async def _flush(self) -> None:
        try:
            while self.queued:
                items, self.queued = self.queued, []
                self.counts["delete_writes"] += 1
                try:
                    missing = await self.client.delete_many([f.job for f in items])
                except BeanstalkError as e:
                    # The connection failed: the server gives those jobs back.
                    for f in items:
                        log_event(logging.WARNING, "job.connection_error", job=f.job.id,
                                  server=f.job.server, error=str(e))
                    continue
                gone = {id(j) for j in missing}
                for f in items:
                    (self.lost if id(f.job) in gone else self.done)(f)
        finally:
            self.flushing = False
