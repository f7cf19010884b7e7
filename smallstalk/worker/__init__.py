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
- `--batch N` (`Worker(batch=N)`): each reserve takes up to N jobs with
  smallstalk's `reserve-batch`; the slot runs them in order, touches one
  whose wait ate half its time limit before starting it, and pipelines the
  deletes (batch.py). Jobs not started when the worker stops are handed
  back by closing the connection. beanstalkd answers BAD_FORMAT: the
  worker logs `worker.batch_off` and reserves one job at a time.
- Each of the `--concurrency` slots has its own connection(s): a waiting
  reserve blocks its connection, and a job belongs to the connection that
  reserved it. Logs are JSON lines on stderr (`--log-format text` for
  people): an `event` and its fields.
"""

from smallstalk.worker.cli import load_app, main
from smallstalk.worker.codec import (
    PAYLOAD_VERSION,
    BadPayload,
    TimeLimitExceeded,
    UnknownTask,
    decode_call,
    encode_call,
)
from smallstalk.worker.context import JobContext, atouch, current_job, time_limit, touch
from smallstalk.worker.logs import JsonFormatter, TextFormatter, setup_logging
from smallstalk.worker.lottery import TubeSelector, parse_tubes, pick_tube
from smallstalk.worker.runner import TRACEBACK_MAX, Worker, backoff_delay
from smallstalk.worker.tasks import DEFAULT_ERROR_TUBE, App, Task

__all__ = [
    "DEFAULT_ERROR_TUBE", "PAYLOAD_VERSION", "TRACEBACK_MAX", "App", "BadPayload", "JobContext",
    "JsonFormatter", "Task", "TextFormatter", "TimeLimitExceeded", "TubeSelector", "UnknownTask",
    "Worker", "atouch", "backoff_delay", "current_job", "decode_call", "encode_call", "load_app",
    "main", "parse_tubes", "pick_tube", "setup_logging", "time_limit", "touch",
]
