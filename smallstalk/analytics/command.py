"""`smallstalk analyze`: the job analytics pipeline as a command, locally or under spark-submit.

    smallstalk analyze DATA_DIR... --out DIR [--master local[*]] [--report report.html]

Without `--master` it starts Spark in local mode using every core, unless it
runs under spark-submit (or inside a PySpark session), where the session it
finds is used as is. Steps and task progress go to stderr; the summary table
goes to stdout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from smallstalk.usage import Parser

DESCRIPTION = """\
Job analytics over smallstalk AOF data on Spark: one row per job lifecycle, and
per tube and minute/hour: throughput, queue-wait and run-time percentiles,
timeouts, releases, buries, duplicate work and backlog. Written as Parquet
under --out (partitioned by tube and day); a summary table is printed.

DATA_DIR is a server's data directory (aof/ and snapshots/), a copy or an
archive of one, a glob (/archive/*), or a URI pyarrow can read
(s3://bucket/aof/web-1, hdfs://nn/aof/web-1). Job ids are per server: each
directory is one server, named after the directory unless --server-name
names it."""

EPILOG = """\
Outputs under --out: jobs/, attempts/, tube_minute/, tube_hour/ (Parquet,
partitioned by tube=/day=), tube_summary/, servers/ and summary.json.

On a cluster (see docs/ANALYTICS.md):
  spark-submit --master yarn --py-files smallstalk.zip \\
      smallstalk/analytics/submit.py hdfs:///aof-archive/* --out hdfs:///analytics/run1
"""


SMALL_INPUT = 64 << 20  # bytes of AOF below which whole-stage codegen is turned off


class Progress:
    """Step lines, and the running Spark stages' task counts, on stderr."""

    def __init__(self, stream: IO[str] | None = None, enabled: bool = True,
                 interval: float = 1.0):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.interval = interval
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.status = ""
        self.last_printed = 0.0

    def _stamp(self) -> str:
        s = int(time.monotonic() - self.started)
        return f"[{s // 60:02d}:{s % 60:02d}]"

    def _clear(self) -> None:
        if self.tty and self.status:
            self.stream.write("\r" + " " * len(self.status) + "\r")
            self.status = ""

    def step(self, text: str) -> None:
        if not self.enabled:
            return
        with self.lock:
            self._clear()
            self.stream.write(f"{self._stamp()} {text}\n")
            self.stream.flush()

    def watch(self, spark: Any) -> None:
        if not self.enabled:
            return
        tracker = spark.sparkContext.statusTracker()
        self.thread = threading.Thread(target=self._poll, args=(tracker,), daemon=True)
        self.thread.start()

    def _poll(self, tracker: Any) -> None:
        previous = ""
        while not self.stop_event.wait(self.interval):
            try:
                parts = []
                for sid in sorted(tracker.getActiveStageIds()):
                    info = tracker.getStageInfo(sid)
                    if info is not None:
                        parts.append(f"stage {sid}: {info.numCompletedTasks}/{info.numTasks} "
                                     f"tasks ({info.numActiveTasks} running)")
            except Exception:  # the session is stopping
                return
            line = f"{self._stamp()}   " + ("; ".join(parts) if parts else "…")
            with self.lock:
                if self.tty:
                    self._clear()
                    self.status = line[:160]
                    self.stream.write(self.status)
                    self.stream.flush()
                elif parts and "; ".join(parts) != previous and \
                        time.monotonic() - self.last_printed > 15:
                    self.stream.write(line + "\n")
                    self.stream.flush()
                    self.last_printed = time.monotonic()
            previous = "; ".join(parts)

    def close(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        with self.lock:
            self._clear()


def brief(e: BaseException) -> str:
    """The line of a (Python worker or JVM) error that says what went wrong."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return (named or lines or [type(e).__name__])[-1][:500]


MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")


def explain(e: BaseException, python: str | None = None) -> str:
    """One line for a failed cluster run: what executors that miss a module need, else `brief`."""
    found = MISSING_MODULE.search(str(e))
    if found is None:
        return brief(e)
    module = found.group(1).split(".")[0]
    where = f"the Spark executors' Python ({python})" if python else "the Spark executors"
    if module == "smallstalk":
        advice = ("pass the package with --py-files smallstalk.zip "
                  "(zip -r smallstalk.zip smallstalk, in a checkout)")
    else:
        advice = ("install cbor2, attrs and pyarrow in the executors' Python on every node "
                  "(or ship an environment with --archives; docs/ANALYTICS.md)")
    return f"{where} cannot import {module}: {advice}"


def master_addresses(master: str) -> list[tuple[str, int]]:
    """The (host, port) pairs of a standalone master URL (spark://h1:p1,h2:p2); [] for others."""
    if not master.startswith("spark://"):
        return []
    out = []
    for item in master[len("spark://"):].split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{master}: a standalone master URL is spark://HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    return out


def unreachable_master(master: str, timeout: float = 5.0) -> str | None:
    """Why no master of a spark:// URL accepts a connection; None if one does (or not spark://).

    Spark itself would start, wait a minute for the master and then fail with
    a stack trace; a TCP connect says it at once.
    """
    why = []
    for host, port in master_addresses(master):
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return None
        except OSError as e:
            why.append(f"{host}:{port}: {e.strerror or e}")
    if not why:
        return None
    return (f"cannot reach the Spark master {master} ({'; '.join(why)}): start it, or give "
            "the spark://HOST:PORT it logs (\"Starting Spark master at ...\")")


def submitted_master() -> str | None:
    """The master spark-submit was given (read from its JVM, before a context starts)."""
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM; starts no context
    return SparkConf().get("spark.master", None)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = Parser(prog="smallstalk analyze", description=DESCRIPTION,
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data_dirs", nargs="+", metavar="DATA_DIR")
    ap.add_argument("--out", required=True, help="output folder (local path or URI Spark can write)")
    ap.add_argument("--master", help="Spark master (default: local[*], or spark-submit's)")
    ap.add_argument("--server-name", action="append", default=[], metavar="NAME",
                    help="name of the server of each DATA_DIR, in order (repeat; "
                         "default: the directory's name)")
    ap.add_argument("--report", type=Path, metavar="FILE.html",
                    help="also write a self-contained HTML report with charts")
    ap.add_argument("--report-window", choices=("auto", "minute", "hour"), default="auto",
                    help="the report's time resolution (auto: minutes for up to 6 hours of data)")
    ap.add_argument("--accuracy", type=int, default=10_000,
                    help="percentile_approx accuracy: exact below this many values per group "
                         "(default 10000)")
    ap.add_argument("--skip-damaged", action="store_true",
                    help="keep the records before a bad frame instead of failing")
    ap.add_argument("--no-snapshots", action="store_true",
                    help="ignore snapshots (jobs older than the oldest segment are then orphans)")
    ap.add_argument("--partition-mb", type=int, default=32,
                    help="AOF bytes per read task (default 32)")
    ap.add_argument("--driver-memory", default="3g",
                    help="driver memory when Spark starts here in local mode (default 3g)")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Spark configuration (repeat)")
    ap.add_argument("--py-files", metavar="FILES",
                    help="comma-separated .zip/.py files for the executors' Python path, "
                         "as spark-submit takes them (on a cluster: smallstalk.zip)")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    ap.add_argument("--verbose", action="store_true",
                    help="keep Spark's own warnings and errors; raise failures with their trace")
    return ap.parse_args(argv)


def session(master: str | None = None, conf: dict[str, str] | None = None,
            driver_memory: str = "3g", app: str = "smallstalk analyze") -> tuple[Any, bool]:
    """The SparkSession to use and whether it was started here.

    Local mode: the workers must run this interpreter (it has smallstalk,
    cbor2 and pyarrow), so PYSPARK_PYTHON is set to sys.executable before
    the JVM starts. An existing session (tests, pyspark shell, spark-submit)
    is reused as it is.
    """
    from pyspark.sql import SparkSession

    existing = SparkSession.getActiveSession()
    if existing is not None:
        return existing, False
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM
    if master is None and not submitted:
        master = "local[*]"
    builder = SparkSession.builder.appName(app)
    if master is not None:
        builder = builder.master(master)
    if master is not None and master.startswith("local"):
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode needs no network
        cores = os.cpu_count() or 2
        builder = (builder.config("spark.driver.memory", driver_memory)
                   .config("spark.sql.shuffle.partitions", str(max(8, 4 * cores))))
    builder = (builder.config("spark.sql.session.timeZone", "UTC")
               .config("spark.ui.showConsoleProgress", "false"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate(), True


def register(spark: Any) -> None:
    from .source import SmallstalkDataSource

    spark.dataSource.register(SmallstalkDataSource)


def read_records(spark: Any, servers: list[tuple[str, str]], *, snapshots: bool = True,
                 damaged: str = "fail", partition_bytes: int = 32 << 20) -> Any:
    """The records DataFrame of these (name, data directory) servers."""
    register(spark)
    return (spark.read.format("smallstalk")
            .option("serverNames", ",".join(name for name, _ in servers))
            .option("snapshots", str(snapshots).lower())
            .option("damaged", damaged)
            .option("partitionBytes", str(partition_bytes))
            .load([path for _, path in servers]))


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from .source import list_files, resolve_servers

    local_bytes = 0
    try:
        servers = resolve_servers(args.data_dirs, args.server_name)
        for _name, path in servers:
            if "://" not in path:  # a local typo fails here, not inside Spark
                segments, snap = list_files(path)
                local_bytes += sum(size for *_x, size in segments) + (snap[2] if snap else 0)
    except (ValueError, OSError) as e:
        print(f"smallstalk analyze: {e}", file=sys.stderr)
        return 2
    py_files = [p for p in (args.py_files or "").split(",") if p]
    for path in py_files:
        if "://" not in path and not os.path.isfile(path):
            print(f"smallstalk analyze: --py-files: {path}: no such file", file=sys.stderr)
            return 2
    conf = {}
    for item in args.conf:
        key, eq, value = item.partition("=")
        if not eq:
            print(f"smallstalk analyze: --conf wants KEY=VALUE, not {item!r}", file=sys.stderr)
            return 2
        conf[key] = value
    progress = Progress(enabled=not args.quiet)
    progress.step(f"{len(servers)} data directories: "
                  + ", ".join(f"{n} ({p})" if n != p.rstrip('/').rsplit('/', 1)[-1] else p
                              for n, p in servers))
    progress.step("starting Spark" + (f" ({args.master})" if args.master else ""))
    try:
        from . import pipeline, report
    except ImportError as e:
        print(f"smallstalk analyze: {e}; install the extra: pip install 'smallstalk[analytics]'",
              file=sys.stderr)
        return 2
    small = local_bytes < SMALL_INPUT and all("://" not in p for _n, p in servers)
    if small and "spark.sql.codegen.wholeStage" not in conf:
        # Compiling whole-stage code takes longer than running small inputs without it.
        conf["spark.sql.codegen.wholeStage"] = "false"
    master = args.master
    try:
        if master is None and "PYSPARK_GATEWAY_PORT" in os.environ:
            master = submitted_master()
        why = unreachable_master(master) if master else None
    except ValueError as e:
        why = str(e)
    if why:
        print(f"smallstalk analyze: {why}", file=sys.stderr)
        return 2
    if not args.verbose:
        conf.setdefault("spark.log.level", "FATAL")  # from the start, not only from setLogLevel
    spark, started_here = session(args.master, conf, args.driver_memory)
    for path in py_files:
        spark.sparkContext.addPyFile(path)
    if not args.verbose:
        # Failures are reported below in one line; Spark's own stack traces only with -v.
        spark.sparkContext.setLogLevel("FATAL")
    progress.watch(spark)
    try:
        records = read_records(spark, servers, snapshots=not args.no_snapshots,
                               damaged="skip" if args.skip_damaged else "fail",
                               partition_bytes=args.partition_mb << 20)
        result = pipeline.run(spark, records, args.out, args.accuracy, progress.step)
        span = [s for srv in result["servers"] for s in (srv["first_ns"], srv["last_ns"])
                if s is not None]
        width = args.report_window
        if width == "auto":
            short = not span or max(span) - min(span) <= 6 * 3600 * 10**9
            width = "minute" if short else "hour"
        if args.report:
            progress.step(f"report: {args.report} (per {width})")
            series = pipeline.series(spark, args.out, width)
            meta = (f"{', '.join(n for n, _ in servers)} · generated "
                    f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC · output {args.out}")
            args.report.write_text(report.html_report(result, series, width, meta=meta))
        summary_path = f"{str(args.out).rstrip('/')}/summary.json"
        if "://" not in summary_path:
            Path(summary_path).write_text(json.dumps(result, default=str, indent=1))
        progress.step("done")
    except Exception as e:  # a Spark failure: say it briefly, not a JVM stack
        progress.close()
        why = brief(e)
        if master and not master.startswith("local"):  # executors with a Python of their own
            sc = spark.sparkContext
            why = explain(e, sc.getConf().get("spark.pyspark.python", None) or sc.pythonExec)
        print(f"smallstalk analyze: failed: {why}", file=sys.stderr)
        if args.verbose:
            raise
        return 1
    finally:
        progress.close()
        if started_here:
            spark.stop()
    print(report.text_summary(result))
    return 0
