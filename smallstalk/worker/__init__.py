"""Tasks for producers and the task worker (`smallstalk worker module:app`).

A producer and a worker share one module of tasks::

    app = App()                                   # $SMALLSTALK_SERVERS or 127.0.0.1:11300

    @app.task(tube="default", retries=3, ttr=60)
    def resize(path: str, width: int) -> None: ...

    resize.publish("a.png", width=200)            # producer: returns a JobRef
    $ smallstalk worker tasks:app --tubes high,default,low

Theory of operation.

- A published call is one job whose body is CBOR: {"v": 1, "task": name,
  "args": [...], "kwargs": {...}}; priority, delay and TTR come from the task
  (`task.options(...)` overrides them for one call). A task's `ttr` is its
  time limit: the worker cancels an async task one second before the TTR
  runs out (a sync task, in a thread, cannot be stopped; when it overruns,
  the server hands the job to someone else and the late delete is logged).
  Long tasks call `touch()` (or `await atouch()`) to get another TTR.
- Tube choice, the "reduced lottery" (`pick_tube`, `TubeSelector`): each
  reserve draws a tube at random, weighted (the first of `--tubes` weighs
  most), among the tubes not seen empty within the last `recheck` seconds,
  and reserves from it without waiting. A tube that answers TIMED_OUT drops
  out of the draw for a while; when all have, the worker blocks on a reserve
  across every tube and, woken by a job, draws from all of them again. Busy
  high tubes win most draws, low ones still win some, empty ones cost at
  most one poll per `recheck` seconds.
- Failures: an exception (or the time limit) counts as a failure. Failures
  so far are read from the server (`releases + timeouts` of stats-job, plus
  this one), so they survive worker restarts. Below the task's `retries`,
  the job is released with a delay of backoff * 2**(failure-1) seconds (at
  most max_backoff); after that it is buried, keeping its priority.
- The error of a buried job: beanstalkd keeps no text with a job, so the
  worker (1) logs a `job.buried` record with the error and traceback and
  (2) puts a JSON record {job, server, tube, task, attempts, error,
  traceback, worker, at} into the tube `<tube>.errors` on the job's own
  server (App(error_tube=None) turns that off). The bury comes first: a
  worker that dies in between leaves a buried job without a record, never
  a record about a job that is not buried.
- Shutdown: SIGTERM or SIGINT stops reserving and lets running jobs finish
  for `--grace` seconds; jobs still running then (or at a second signal) are
  cancelled and handed back by closing their connection, which the server
  turns into an immediate release that does not count as a failure. A
  killed worker's jobs come back the same way (connection closed) or, if the
  connection stays open, when their TTR runs out (counted as a failure).
- Each of the `--concurrency` slots has its own connection(s): a waiting
  reserve blocks its connection, and a job belongs to the connection that
  reserved it. Logs are JSON lines on stderr (`--log-format text` for
  people): an `event` and its fields.
"""

from __future__ import annotations

import argparse
import contextvars
import copy
import functools
import importlib
import inspect
import json
import logging
import math
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import cbor2
import trio

from smallstalk.client import (
    DEFAULT_PRIORITY,
    DEFAULT_TTR,
    AsyncClient,
    BeanstalkError,
    Client,
    Job,
    JobRef,
    JobStats,
    NotFound,
    TimedOut,
    resolve_servers,
)
from smallstalk.core.usage import Parser

PAYLOAD_VERSION = 1
DEFAULT_ERROR_TUBE = "{tube}.errors"
TRACEBACK_MAX = 4000  # characters of traceback kept in an error record

log = logging.getLogger("smallstalk.worker")

__all__ = [
    "App", "BadPayload", "JobContext", "Task", "TimeLimitExceeded", "TubeSelector",
    "UnknownTask", "Worker", "atouch", "backoff_delay", "current_job", "decode_call",
    "encode_call", "main", "parse_tubes", "pick_tube", "touch",
]


# --- payload -----------------------------------------------------------------


class BadPayload(ValueError):
    """A job body that is not a task call."""


class UnknownTask(LookupError):
    """A job names a task this worker's app does not have."""


class TimeLimitExceeded(Exception):
    """An async task ran into its time limit (its TTR less a second)."""


def encode_call(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    return cbor2.dumps({"v": PAYLOAD_VERSION, "task": name, "args": list(args),
                        "kwargs": dict(kwargs)})


def decode_call(body: bytes) -> tuple[str, list[Any], dict[str, Any]]:
    try:
        data = cbor2.loads(body)
    except Exception as e:
        raise BadPayload(f"job body is not CBOR: {e}") from None
    if (not isinstance(data, dict) or data.get("v") != PAYLOAD_VERSION
            or not isinstance(data.get("task"), str) or not isinstance(data.get("args"), list)
            or not isinstance(data.get("kwargs"), dict)):
        raise BadPayload("job body is not a smallstalk task call")
    return data["task"], data["args"], data["kwargs"]


# --- tasks and the app -----------------------------------------------------


def _default_name(fn: Callable[..., Any]) -> str:
    module = fn.__module__
    if module == "__main__":
        # `python tasks.py` and `smallstalk worker tasks:app` should agree.
        main_mod = sys.modules.get("__main__")
        spec = getattr(main_mod, "__spec__", None)
        if spec is not None and spec.name:
            module = spec.name
        elif getattr(main_mod, "__file__", None):
            module = Path(main_mod.__file__).stem  # type: ignore[union-attr, arg-type]
    return f"{module}.{fn.__qualname__}"


class Task:
    """A function that can also be published as a job (`publish`) and run by a worker.

    Calling the task calls the function.
    """

    def __init__(self, app: App, fn: Callable[..., Any], *, name: str, tube: str,
                 priority: int, delay: int, ttr: int, retries: int, backoff: float,
                 max_backoff: float) -> None:
        if ttr < 1 or retries < 0 or backoff < 0 or delay < 0 or max_backoff < 0:
            raise ValueError("ttr must be at least 1; retries, delay and backoff not negative")
        self.app = app
        self.fn = fn
        self.name = name
        self.tube = tube
        self.priority = priority
        self.delay = delay
        self.ttr = ttr
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.is_async = inspect.iscoroutinefunction(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Task {self.name} tube={self.tube}>"

    def options(self, *, priority: int | None = None, delay: int | None = None,
                ttr: int | None = None, tube: str | None = None) -> Task:
        """This task with other defaults, for one publish: `t.options(delay=60).publish(x)`."""
        other = copy.copy(self)
        for key, value in (("priority", priority), ("delay", delay), ("ttr", ttr),
                           ("tube", tube)):
            if value is not None:
                setattr(other, key, value)
        return other

    def encode(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
        return encode_call(self.name, args, kwargs)

    def publish(self, *args: Any, **kwargs: Any) -> JobRef:
        """Put a job that runs this task with these arguments (CBOR-serializable)."""
        return self.app.client().put(self.encode(args, kwargs), self.priority, self.delay,
                                     self.ttr, tube=self.tube)

    async def apublish(self, *args: Any, **kwargs: Any) -> JobRef:
        """`publish` for trio code."""
        client = self.app.async_client()
        return await client.put(self.encode(args, kwargs), self.priority, self.delay,
                                self.ttr, tube=self.tube)


class App:
    """The tasks of an application and the servers they go through.

    `servers`: as for `Client` (None: $SMALLSTALK_SERVERS or 127.0.0.1:11300).
    `error_tube`: where a worker records why it buried a job ("{tube}" is the
    job's tube); None records in the log only.
    """

    def __init__(self, servers: str | Sequence[str] | None = None, *,
                 error_tube: str | None = DEFAULT_ERROR_TUBE, connect_timeout: float = 5.0,
                 read_timeout: float = 10.0) -> None:
        self.servers = resolve_servers(servers)
        self.error_tube = error_tube
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.tasks: dict[str, Task] = {}
        self._client: Client | None = None
        self._client_lock = threading.Lock()
        self._async_client: trio.lowlevel.RunVar[AsyncClient | None] = trio.lowlevel.RunVar(
            f"smallstalk.App.{id(self)}", default=None)

    def task(self, fn: Callable[..., Any] | None = None, *, name: str | None = None,
             tube: str = "default", priority: int = DEFAULT_PRIORITY, delay: int = 0,
             ttr: int = DEFAULT_TTR, retries: int = 3, backoff: float = 1.0,
             max_backoff: float = 3600.0) -> Any:
        """Register a function as a task: `@app.task` or `@app.task(tube=..., ...)`.

        `ttr` is the time limit in seconds (and the job's TTR); `retries` how
        many times a failure is retried (so retries + 1 runs at most);
        `backoff` the delay before the first retry, doubled each time.
        """

        def register(f: Callable[..., Any]) -> Task:
            t = Task(self, f, name=name or _default_name(f), tube=tube, priority=priority,
                     delay=delay, ttr=ttr, retries=retries, backoff=backoff,
                     max_backoff=max_backoff)
            if t.name in self.tasks:
                raise ValueError(f"a task named {t.name!r} is already registered")
            self.tasks[t.name] = t
            return t

        return register(fn) if fn is not None else register

    def tubes(self) -> list[str]:
        """The tubes of the registered tasks, in registration order."""
        return list(dict.fromkeys(t.tube for t in self.tasks.values()))

    def client(self) -> Client:
        """The app's shared synchronous client (made on first use)."""
        with self._client_lock:
            if self._client is None:
                self._client = Client(self.servers, connect_timeout=self.connect_timeout,
                                      read_timeout=self.read_timeout)
            return self._client

    def async_client(self) -> AsyncClient:
        """The app's trio client for the current trio run (made on first use)."""
        client = self._async_client.get()
        if client is None:
            client = AsyncClient(self.servers, connect_timeout=self.connect_timeout,
                                 read_timeout=self.read_timeout)
            self._async_client.set(client)
        return client

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def error_tube_for(self, tube: str) -> str | None:
        return None if self.error_tube is None else self.error_tube.format(tube=tube)


# --- tube selection: the reduced lottery -------------------------------------


def parse_tubes(spec: str | Sequence[str]) -> dict[str, float]:
    """"high,default,low" or "high:6,default:3,low:1" to weights.

    Without explicit weights the first of n tubes weighs n, the last 1.
    """
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    items = [s for s in items if s]
    if not items:
        raise ValueError("no tubes given")
    out: dict[str, float] = {}
    for k, item in enumerate(items):
        name, sep, weight = item.partition(":")
        if name in out:
            raise ValueError(f"tube {name!r} is listed twice")
        try:
            value = float(weight) if sep else float(len(items) - k)
        except ValueError:
            raise ValueError(f"bad weight in {item!r}") from None
        if not value > 0 or math.isinf(value):
            raise ValueError(f"the weight of {name!r} must be a positive number")
        out[name] = value
    return out


def pick_tube(weights: Mapping[str, float], exclude: Iterable[str],
              rng: random.Random) -> str | None:
    """A weighted random tube among those not in `exclude`; None if none is left."""
    skip = set(exclude)
    names = [t for t, w in weights.items() if w > 0 and t not in skip]
    if not names:
        return None
    return rng.choices(names, weights=[weights[t] for t in names])[0]


class TubeSelector:
    """The reduced lottery's memory: which tubes were seen empty, and when."""

    def __init__(self, weights: Mapping[str, float], rng: random.Random | None = None,
                 recheck: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.weights = dict(weights)
        self.rng = rng or random.Random()
        self.recheck = recheck
        self.clock = clock
        self._empty_until: dict[str, float] = {}

    def empty(self) -> set[str]:
        now = self.clock()
        return {t for t, until in self._empty_until.items() if until > now}

    def choose(self) -> str | None:
        """The tube to poll next; None means every tube was just seen empty: block."""
        return pick_tube(self.weights, self.empty(), self.rng)

    def saw_empty(self, tube: str) -> None:
        self._empty_until[tube] = self.clock() + self.recheck

    def saw_work(self, tube: str) -> None:
        self._empty_until.pop(tube, None)

    def woke(self) -> None:
        """A blocking reserve returned a job: draw from every tube again."""
        self._empty_until.clear()


def backoff_delay(backoff: float, failures: int, max_backoff: float) -> int:
    """Seconds before retry number `failures` (1, 2, ...): backoff * 2**(failures-1)."""
    if backoff <= 0 or failures < 1:
        return 0
    return int(math.ceil(min(max_backoff, backoff * 2.0 ** min(failures - 1, 60))))


def time_limit(ttr: int) -> float:
    """How long an async task may run between touches: its TTR less a second
    (half the TTR when that is shorter), so the worker gives up before the server does."""
    return ttr - min(1.0, ttr / 2)


# --- the job being run ---------------------------------------------------------


_current: contextvars.ContextVar[JobContext] = contextvars.ContextVar("smallstalk_job")


@attrs.define(eq=False)
class JobContext:
    """The job a task is running for (`current_job()` inside a task)."""

    job: Job
    task: Task
    tube: str | None
    client: AsyncClient = attrs.field(repr=False)
    scope: trio.CancelScope | None = attrs.field(default=None, repr=False)
    touches: int = 0

    async def atouch(self) -> None:
        await self.client.touch(self.job)
        self.touches += 1
        if self.scope is not None:
            self.scope.deadline = trio.current_time() + time_limit(self.task.ttr)


def current_job() -> JobContext:
    try:
        return _current.get()
    except LookupError:
        raise RuntimeError("not in a task run by a smallstalk worker") from None


def touch() -> None:
    """From a sync task: ask for another TTR. Outside a worker this does nothing."""
    ctx = _current.get(None)
    if ctx is None:
        return
    if trio.lowlevel.in_trio_task():
        raise RuntimeError("in an async task, use `await atouch()`")
    trio.from_thread.run(ctx.atouch)


async def atouch() -> None:
    """From an async task: ask for another TTR. Outside a worker this does nothing."""
    ctx = _current.get(None)
    if ctx is not None:
        await ctx.atouch()


# --- structured logs -----------------------------------------------------------


def _event(level: int, event: str, **fields: Any) -> None:
    log.log(level, event, extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                               "logger": record.name, "event": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        parts = [time.strftime("%H:%M:%S", time.localtime(record.created)),
                 record.levelname.lower(), record.getMessage()]
        parts += [f"{k}={v!r}" if isinstance(v, str) and " " in v else f"{k}={v}"
                  for k, v in fields.items() if k != "traceback"]
        text = " ".join(parts)
        if fields.get("traceback"):
            text += "\n" + str(fields["traceback"]).rstrip()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(fmt: str = "json", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("smallstalk")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


# --- the worker ----------------------------------------------------------------


class Worker:
    """Runs an App's tasks from weighted tubes with `concurrency` jobs at a time."""

    def __init__(self, app: App, tubes: Mapping[str, float] | str | Sequence[str] | None = None,
                 *, servers: str | Sequence[str] | None = None, concurrency: int = 1,
                 grace: float = 30.0, recheck: float = 1.0, poll_interval: float = 1.0,
                 rng: random.Random | None = None) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.app = app
        if tubes is None:
            tubes = app.tubes() or ["default"]
        self.weights = dict(tubes) if isinstance(tubes, Mapping) else parse_tubes(tubes)
        self.tubes = list(self.weights)
        self.servers = resolve_servers(servers) if servers is not None else app.servers
        self.concurrency = concurrency
        self.grace = grace
        self.poll_interval = poll_interval
        self.selector = TubeSelector(self.weights, rng, recheck)
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        self.counts = {"done": 0, "retried": 0, "buried": 0, "lost": 0, "handed_back": 0}
        self._stopping = False
        self._nursery: trio.Nursery | None = None
        self._reserve_scopes: set[trio.CancelScope] = set()
        self._job_scopes: set[trio.CancelScope] = set()

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        _event(logging.INFO, "worker.start", servers=self.servers, tubes=self.weights,
               concurrency=self.concurrency, tasks=sorted(self.app.tasks), worker=self.identity)
        async with trio.open_nursery() as outer:
            self._nursery = outer
            async with trio.open_nursery() as slots:
                for n in range(self.concurrency):
                    slots.start_soon(self._slot, n)
                task_status.started()
            outer.cancel_scope.cancel()  # the grace timer, if any
        _event(logging.INFO, "worker.stopped", **self.counts)

    def stop(self, grace: float | None = None) -> None:
        """Stop reserving; cancel running jobs after `grace` seconds (default: the worker's)."""
        grace = self.grace if grace is None else grace
        if not self._stopping:
            self._stopping = True
            _event(logging.INFO, "worker.stopping", grace=grace, running=len(self._job_scopes))
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
                             poll_interval=self.poll_interval)
        errors = 0
        try:
            while not self._stopping:
                got: tuple[Job, str | None] | None = None
                with trio.CancelScope() as scope:
                    self._reserve_scopes.add(scope)
                    if self._stopping:
                        scope.cancel()
                    try:
                        got = await self._reserve(client)
                        errors = 0
                    except BeanstalkError as e:
                        errors += 1
                        wait = min(30.0, 0.25 * 2 ** min(errors, 8))
                        _event(logging.WARNING, "reserve.error", slot=n, error=str(e),
                               retry_in=wait)
                        await trio.sleep(wait)
                    finally:
                        self._reserve_scopes.discard(scope)
                if got is None:
                    continue
                job, tube = got
                with trio.CancelScope() as job_scope:
                    self._job_scopes.add(job_scope)
                    try:
                        await self._run_job(client, job, tube)
                    except BeanstalkError as e:
                        # The connection failed around the job: the server gives it back.
                        _event(logging.WARNING, "job.connection_error", job=job.id,
                               server=job.server, error=str(e))
                    finally:
                        self._job_scopes.discard(job_scope)
                if job_scope.cancelled_caught:
                    # Closing the connection releases the job at once, without
                    # counting a release against its retries.
                    with trio.CancelScope(shield=True):
                        await client.aclose()
                    self.counts["handed_back"] += 1
                    _event(logging.WARNING, "job.handed_back", job=job.id, server=job.server,
                           reason="shutdown")
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def _reserve(self, client: AsyncClient) -> tuple[Job, str | None] | None:
        tube = self.selector.choose()
        if tube is None:
            try:
                job = await client.reserve(None, tubes=self.tubes)
            except TimedOut:
                return None
            self.selector.woke()
            # Which tube woke us, for the logs (the busy path knows it already).
            try:
                return job, (await client.stats_job(job)).tube
            except NotFound:
                return job, None
        try:
            job = await client.reserve(0, tubes=[tube])
        except TimedOut:
            self.selector.saw_empty(tube)
            return None
        self.selector.saw_work(tube)
        return job, tube

    async def _run_job(self, client: AsyncClient, job: Job, tube: str | None) -> None:
        started = trio.current_time()
        task: Task | None = None
        name = None
        try:
            name, args, kwargs = decode_call(job.body)
            task = self.app.tasks.get(name)
            if task is None:
                raise UnknownTask(f"no task named {name!r} in this worker's app")
        except (BadPayload, UnknownTask) as e:
            await self._failed(client, job, None, name, e, started)
            return
        ctx = JobContext(job, task, tube, client)
        token = _current.set(ctx)
        try:
            _event(logging.DEBUG, "job.start", job=job.id, server=job.server, tube=tube,
                   task=name)
            if task.is_async:
                with trio.move_on_after(time_limit(task.ttr)) as scope:
                    ctx.scope = scope
                    await task.fn(*args, **kwargs)
                if scope.cancelled_caught:
                    raise TimeLimitExceeded(f"no touch within {time_limit(task.ttr):g}s "
                                            f"(ttr {task.ttr}s)")
            else:
                await trio.to_thread.run_sync(functools.partial(task.fn, *args, **kwargs),
                                              abandon_on_cancel=True)
        except Exception as e:
            await self._failed(client, job, task, name, e, started)
            return
        finally:
            _current.reset(token)
        try:
            await client.delete(job)
        except NotFound:
            self._lost(job, name, "the job was no longer reserved by this worker when it "
                       "finished (its TTR ran out)")
            return
        self.counts["done"] += 1
        _event(logging.INFO, "job.done", job=job.id, server=job.server, tube=tube, task=name,
               ms=round((trio.current_time() - started) * 1000, 1))

    def _lost(self, job: Job, name: str | None, why: str) -> None:
        self.counts["lost"] += 1
        _event(logging.WARNING, "job.lost", job=job.id, server=job.server, task=name, why=why)

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
            _event(logging.WARNING, "job.retry", **fields, retries=task.retries, delay=delay)
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
                _event(logging.ERROR, "error_record.failed", job=job.id, server=job.server,
                       tube=error_tube, error=str(e))
        _event(logging.ERROR, "job.buried", **fields, error_tube=recorded, traceback=tb)


# --- command line --------------------------------------------------------------


def load_app(spec: str) -> App:
    """"module:attribute" (attribute defaults to `app`), importable from the current directory."""
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise ValueError(f"expected module:app, got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    module = importlib.import_module(module_name)
    app = getattr(module, attr or "app", None)
    if not isinstance(app, App):
        raise ValueError(f"{spec} is not a smallstalk.worker.App")
    return app


def _parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="smallstalk worker",
        description="Run the tasks of an App from beanstalkd/smallstalk tubes.")
    ap.add_argument("app", help="module:attribute of the App (attribute defaults to app)")
    ap.add_argument("--tubes", help="tubes by priority, first highest: high,default,low or "
                    "high:6,default:3,low:1 (default: the tubes of the app's tasks)")
    ap.add_argument("--servers", help="host:port,... (default: the app's servers)")
    ap.add_argument("-c", "--concurrency", type=int, default=1, help="jobs at a time (default 1)")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds running jobs get to finish after SIGTERM (default 30)")
    ap.add_argument("--recheck", type=float, default=1.0,
                    help="seconds an empty tube stays out of the lottery (default 1)")
    ap.add_argument("--log-format", choices=("json", "text"), default="json")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    return ap


async def _run_until_signalled(worker: Worker) -> None:
    async def signals(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            task_status.started()
            count = 0
            async for sig in received:
                count += 1
                _event(logging.INFO, "worker.signal", signal=signal.Signals(sig).name)
                worker.stop(grace=None if count == 1 else 0)

    async with trio.open_nursery() as nursery:
        await nursery.start(signals)
        await worker.run()
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    """`smallstalk worker`: 0 after a graceful stop, 2 on bad arguments or app."""
    ap = _parser()
    try:
        args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        app = load_app(args.app)
        worker = Worker(app, args.tubes, servers=args.servers, concurrency=args.concurrency,
                        grace=args.grace, recheck=args.recheck)
    except (ImportError, ValueError) as e:
        print(f"smallstalk worker: {e}", file=sys.stderr)
        return 2
    setup_logging(args.log_format, logging.DEBUG if args.verbose else logging.INFO)
    trio.run(_run_until_signalled, worker)
    return 0
