"""The worker: runs an App's tasks from weighted tubes, retries, buries with a
record of the error, and shuts down gracefully (theory in the package docstring)."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
import socket
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from smallstalk.client import (
    AsyncClient,
    BadFormat,
    BeanstalkError,
    Job,
    JobStats,
    NotFound,
    TimedOut,
    UnknownCommand,
)
from smallstalk.client.addresses import Servers, resolve_servers
from smallstalk.client.security import Security
from smallstalk.core.commands import RESERVE_BATCH_MAX

from .batch import DeleteQueue, Finished, needs_touch
from .codec import BadPayload, TimeLimitExceeded, UnknownTask, decode_job
from .context import JobContext, running_job, time_limit
from .logs import log_event
from .lottery import TubeSelector, parse_tubes
from .tasks import App, Task

TRACEBACK_MAX = 4000  # characters of traceback kept in an error record


def backoff_delay(backoff: float, failures: int, max_backoff: float) -> int:
    """Seconds before retry number `failures` (1, 2, ...): backoff * 2**(failures-1)."""
    if backoff <= 0 or failures < 1:
        return 0
    return int(math.ceil(min(max_backoff, backoff * 2.0 ** min(failures - 1, 60))))


class Worker:
    """Runs an App's tasks from weighted tubes with `concurrency` jobs at a time."""

    def __init__(self, app: App, tubes: Mapping[str, float] | str | Sequence[str] | None = None,
                 *, servers: Servers = None, concurrency: int = 1,
                 grace: float = 30.0, recheck: float = 1.0, poll_interval: float = 1.0,
                 rng: random.Random | None = None, security: Security | None = None,
                 batch: int = 1) -> None:
        """`servers` and `security` (TLS, token) default to the app's; `batch` > 1
        takes up to that many jobs per reserve (`reserve-batch`, smallstalk only)."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if not 1 <= batch <= RESERVE_BATCH_MAX:
            raise ValueError(f"batch must be from 1 to {RESERVE_BATCH_MAX}")
        self.app = app
        if tubes is None:
            tubes = app.tubes() or ["default"]
        self.weights = dict(tubes) if isinstance(tubes, Mapping) else parse_tubes(tubes)
        self.tubes = list(self.weights)
        self.servers = resolve_servers(servers) if servers is not None else app.servers
        self.security = app.security if security is None else security
        self.concurrency = concurrency
        self.batch = batch
        self.grace = grace
        self.poll_interval = poll_interval
        self.selector = TubeSelector(self.weights, rng, recheck)
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        self.counts = {"done": 0, "retried": 0, "buried": 0, "lost": 0, "handed_back": 0,
                       "delete_writes": 0}
        self._stopping = False
        self._nursery: trio.Nursery | None = None
        self._reserve_scopes: set[trio.CancelScope] = set()
        self._job_scopes: set[trio.CancelScope] = set()

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        log_event(logging.INFO, "worker.start", servers=self.servers, tubes=self.weights,
               concurrency=self.concurrency, batch=self.batch, tasks=sorted(self.app.tasks), worker=self.identity)
        async with trio.open_nursery() as outer:
            self._nursery = outer
            async with trio.open_nursery() as slots:
                for n in range(self.concurrency):
                    slots.start_soon(self._slot, n)
                task_status.started()
            outer.cancel_scope.cancel()  # the grace timer, if any
        log_event(logging.INFO, "worker.stopped", **self.counts)

    def stop(self, grace: float | None = None) -> None:
        """Stop reserving; cancel running jobs after `grace` seconds (default: the worker's)."""
        grace = self.grace if grace is None else grace
        if not self._stopping:
            self._stopping = True
            log_event(logging.INFO, "worker.stopping", grace=grace, running=len(self._job_scopes))
            for scope in list(self._reserve_scopes):
                scope.cancel()
        if grace <= 0 or self._nursery is None:
            self._hand_back()
        else:
            self._nursery.start_soon(self._grace_timer, grace)

    async def _grace_timer(self, grace: float) -> None:
        await trio.sleep(grace)
        self._hand_back()

    def _hand_back(self) -> None:
        for scope in list(self._job_scopes):
            scope.cancel()

    async def _slot(self, n: int) -> None:
        client = AsyncClient(self.servers, connect_timeout=self.app.connect_timeout,
                             read_timeout=self.app.read_timeout,
                             poll_interval=self.poll_interval,
                             ssl_context=self.security.ssl_context, token=self.security.token)
        errors = 0
        try:
            while not self._stopping:
                got: list[tuple[Job, str | None]] = []
                with trio.CancelScope() as scope:
                    self._reserve_scopes.add(scope)
                    if self._stopping:
                        scope.cancel()
                    batching = self.batch > 1  # what this slot's reserve will send
                    try:
                        got = await self._reserve(client)
                        errors = 0
                    except (BadFormat, UnknownCommand) as e:
                        if not batching:
                            raise
                        # beanstalkd reads `reserve-batch` as a malformed reserve.
                        # Every slot's reserve in flight meets it: the first says so.
                        if self.batch > 1:
                            log_event(logging.ERROR, "worker.batch_off", slot=n, error=str(e),
                                      why="the server does not know reserve-batch "
                                      "(beanstalkd?): reserving one job at a time; drop "
                                      "--batch for it")
                            self.batch = 1
                    except BeanstalkError as e:
                        errors += 1
                        wait = min(30.0, 0.25 * 2 ** min(errors, 8))
                        log_event(logging.WARNING, "reserve.error", slot=n, error=str(e),
                               retry_in=wait)
                        await trio.sleep(wait)
                    finally:
                        self._reserve_scopes.discard(scope)
                if got:
                    await self._run_batch(client, got, trio.current_time())
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def _run_batch(self, client: AsyncClient, got: list[tuple[Job, str | None]],
                         received: float) -> None:
        """Run the jobs of one reserve in order; a batch's deletes are pipelined
        (batch.py). Jobs left when the worker stops or one is cancelled are
        handed back by closing the connection."""
        left = 0
        async with trio.open_nursery() as flusher:
            deletes = None if len(got) == 1 else DeleteQueue(
                client, flusher, self.counts, self._done, lambda f: self._lost(
                    f.job, f.task, "the job was no longer reserved by this worker when it "
                    "finished (its TTR ran out)"))
            for k, (job, tube) in enumerate(got):
                if self._stopping and k:
                    left = len(got) - k
                    break
                with trio.CancelScope() as job_scope:
                    self._job_scopes.add(job_scope)
                    try:
                        await self._run_job(client, job, tube, received, deletes)
                    except BeanstalkError as e:
                        # The connection failed around the job: the server gives it back.
                        log_event(logging.WARNING, "job.connection_error", job=job.id,
                               server=job.server, error=str(e))
                    finally:
                        self._job_scopes.discard(job_scope)
                if job_scope.cancelled_caught:
                    left = len(got) - k
                    break
        if left:
            # Closing the connection releases its jobs at once, without
            # counting a release against their retries (the deletes are in).
            with trio.CancelScope(shield=True):
                await client.aclose()
            for job, _ in got[len(got) - left:]:
                self.counts["handed_back"] += 1
                log_event(logging.WARNING, "job.handed_back", job=job.id, server=job.server,
                       reason="shutdown")

    async def _reserve(self, client: AsyncClient) -> list[tuple[Job, str | None]]:
        tube = self.selector.choose()
        if tube is None:
            try:
                if self.batch > 1:
                    jobs = await client.reserve_many(self.batch, None, tubes=self.tubes)
                else:
                    jobs = [await client.reserve(None, tubes=self.tubes)]
            except TimedOut:
                return []
            self.selector.woke()
            # Which tube woke us, for the logs (the busy path knows it already).
            out: list[tuple[Job, str | None]] = []
            for job in jobs:
                try:
                    out.append((job, (await client.stats_job(job)).tube))
                except NotFound:
                    out.append((job, None))
            return out
        try:
            if self.batch > 1:
                jobs = await client.reserve_many(self.batch, 0, tubes=[tube])
            else:
                jobs = [await client.reserve(0, tubes=[tube])]
        except TimedOut:
            self.selector.saw_empty(tube)
            return []
        self.selector.saw_work(tube)
        return [(job, tube) for job in jobs]

    async def _run_job(self, client: AsyncClient, job: Job, tube: str | None,
                       received: float, deletes: DeleteQueue | None = None) -> None:
        """Run `job`, reserved at `received` (its TTR runs from then), and
        delete it (queued on `deletes` in a batch) or retry or bury it."""
        started = trio.current_time()
        task: Task | None = None
        name = None
        try:
            name, args, kwargs, job_ttr = decode_job(job.body)
            task = self.app.tasks.get(name)
            if task is None:
                raise UnknownTask(f"no task named {name!r} in this worker's app")
            ttr = task.ttr if job_ttr is None else job_ttr  # its publish's options, else the task's
        except (BadPayload, UnknownTask) as e:
            await self._failed(client, job, None, name, e, started)
            return
        if needs_touch(received, started, ttr):
            try:
                await client.touch(job)
            except NotFound:
                self._lost(job, name, "its TTR ran out while the jobs before it in its batch "
                           "ran")
                return
            received = trio.current_time()
        ctx = JobContext(job, task, tube, client, ttr)
        token = running_job.set(ctx)
        try:
            log_event(logging.DEBUG, "job.start", job=job.id, server=job.server, tube=tube,
                   task=name)
            if task.is_async:
                with trio.move_on_at(received + time_limit(ttr)) as scope:
                    ctx.scope = scope
                    await task.fn(*args, **kwargs)
                if scope.cancelled_caught:
                    raise TimeLimitExceeded(f"no touch within {time_limit(ttr):g}s "
                                            f"(ttr {ttr}s)")
            else:
                await trio.to_thread.run_sync(functools.partial(task.fn, *args, **kwargs),
                                              abandon_on_cancel=True)
        except Exception as e:
            await self._failed(client, job, task, name, e, started)
            return
        finally:
            running_job.reset(token)
        finished = Finished(job, tube, name, round((trio.current_time() - started) * 1000, 1))
        if deletes is not None:
            deletes.add(finished)
            return
        self.counts["delete_writes"] += 1
        try:
            await client.delete(job)
        except NotFound:
            self._lost(job, name, "the job was no longer reserved by this worker when it "
                       "finished (its TTR ran out)")
            return
        self._done(finished)

    def _done(self, f: Finished) -> None:
        self.counts["done"] += 1
        log_event(logging.INFO, "job.done", job=f.job.id, server=f.job.server, tube=f.tube,
                  task=f.task, ms=f.ms)

    def _lost(self, job: Job, name: str | None, why: str) -> None:
        self.counts["lost"] += 1
        log_event(logging.WARNING, "job.lost", job=job.id, server=job.server, task=name, why=why)

    async def _failed(self, client: AsyncClient, job: Job, task: Task | None, name: str | None,
                      exc: BaseException, started: float) -> None:
        try:
            st = await client.stats_job(job)
        except NotFound:
            self._lost(job, name, "the job was gone when its failure was to be recorded")
            return
        failures = st.releases + st.timeouts + 1
        error = f"{type(exc).__name__}: {exc}"
        fields = {"job": job.id, "server": job.server, "tube": st.tube, "task": name,
                  "attempt": failures, "error": error,
                  "ms": round((trio.current_time() - started) * 1000, 1)}
        if task is not None and failures <= task.retries:
            delay = backoff_delay(task.backoff, failures, task.max_backoff)
            try:
                await client.release(job, priority=st.pri, delay=delay)
            except NotFound:
                self._lost(job, name, "the TTR ran out before the job could be released")
                return
            self.counts["retried"] += 1
            log_event(logging.WARNING, "job.retry", **fields, retries=task.retries, delay=delay)
            return
        await self._bury(client, job, st, name, exc, failures, fields)

    async def _bury(self, client: AsyncClient, job: Job, st: JobStats, name: str | None,
                    exc: BaseException, failures: int, fields: dict[str, Any]) -> None:
        try:
            await client.bury(job, priority=st.pri)
        except NotFound:
            self._lost(job, name, "the TTR ran out before the job could be buried")
            return
        self.counts["buried"] += 1
        tb = "".join(traceback.format_exception(exc))[-TRACEBACK_MAX:]
        record = {"job": job.id, "server": job.server, "tube": st.tube, "task": name,
                  "attempts": failures, "error": fields["error"], "traceback": tb,
                  "worker": self.identity, "at": time.time()}
        error_tube = self.app.error_tube_for(st.tube)
        recorded = None
        if error_tube is not None:
            try:
                await client.put(json.dumps(record).encode(), tube=error_tube,
                                 server=job.server)
                recorded = error_tube
            except (BeanstalkError, ValueError) as e:
                log_event(logging.ERROR, "error_record.failed", job=job.id, server=job.server,
                       tube=error_tube, error=str(e))
        log_event(logging.ERROR, "job.buried", **fields, error_tube=recorded, traceback=tb)

