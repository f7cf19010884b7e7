"""Job lifecycles and per-tube, per-window metrics from AOF records, on Spark.

Input: the DataFrame of the `smallstalk` data source (one row per record, plus
the newest snapshot's jobs). Everything below is DataFrame code: it runs the
same on a laptop in local mode and on a cluster, and only small aggregates
(one row per tube, per server) ever reach the driver.

**Job events.** Records that name jobs (put, reserve, delete, release, bury,
touch; kick, promote and timeout exploded to one row per id) and snapshot job
rows, keyed by (server, id): job ids are unique only within one server.

**Origin.** A job whose put is in the log is followed from its put, and the
snapshot row is not needed ("put"). A job without its put but in the
snapshot started before the oldest segment: it starts from the snapshot row
(state and counters as of the snapshot) and only records after the snapshot
apply ("snapshot"). A job with neither is an "orphan" (its put and the
snapshot that held it are both gone): its events are kept in `jobs`, but with
no tube it is left out of the per-tube metrics.

**Implicit releases.** A Disconnect makes the connection's reserved jobs
ready, and a Restart does so for every connection; neither names the jobs.
For each reservation (a reserve, or a snapshot job reserved by `conn`) the
earliest Disconnect of that connection or Restart of that server after it is
looked up (a join on (server, conn), and a broadcast per-server list of
restarts). If it comes before the job's next own event (a touch does not end
a reservation), the job got an implicit event there: op "disconnect" or
"restart", the job back to ready.

**States.** Each event's state after it follows from the op alone (put and
release: delayed if delay > 0 else ready; reserve, touch: reserved; bury:
buried; kick, promote, timeout, disconnect, restart: ready; delete: deleted),
so one ordered window over each job gives the state before it, when the job
entered that state, and what ended each reservation.

**Attempts** (one per reserve): `wait_ns` = reserve time - time the job
entered the state it was reserved from (normally ready: put, release, promote,
kick, timeout, disconnect, restart); `first_wait_ns` (first attempt only) =
reserve time - put time, delay included; `outcome` = what ended it (delete,
release, bury, timeout, disconnect, restart, or open); `run_ns` = end time -
reserve time. Run-time percentiles use attempts ending in delete.

**Windows** (minute, hour; UTC): per tube, throughput in (puts) and out
(deletes), reserves, re-reserves (attempts after the first: duplicate work),
releases, buries, kicks, timeouts, touches, implicit releases; wait,
first-wait and run-time percentiles of the attempts that started in the
window; and the backlog at the end of the window: jobs alive (put, not yet
deleted) and how many of them are ready, delayed, reserved, buried. Windows
are dense from a tube's first event to the last event of all data, so
backlog series have no holes.

Percentiles are `percentile_approx` with `accuracy` (default 10000): exact
nearest-rank (the smallest value with at least p of all values at or below
it) while a group has fewer values than `accuracy`, and within n/accuracy
ranks above that.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

NS = 1_000_000_000
DAY_NS = 86_400 * NS
WINDOWS = {"minute": 60 * NS, "hour": 3_600 * NS}
QUANTILES = (0.5, 0.95, 0.99)
STATES = ("ready", "delayed", "reserved", "buried")
JOB_OPS = ("put", "reserve", "delete", "release", "bury", "touch", "snapshot")
MULTI_OPS = ("kick", "promote", "timeout")
IMPLICIT_OPS = ("disconnect", "restart")
COUNTED_OPS = (
    ("puts", "put"), ("reserves", "reserve"), ("deletes", "delete"), ("releases", "release"),
    ("buries", "bury"), ("kicks", "kick"), ("timeouts", "timeout"), ("touches", "touch"),
    ("promotes", "promote"),
)
# Metric name -> (attempt column, filter); percentiles in ms.
LATENCIES = (("wait", "wait_ns", None), ("first_wait", "first_wait_ns", None),
             ("run", "run_ns", "delete"))

Step = Callable[[str], None]


def _noop(_text: str) -> None:
    pass


def col(name: str) -> Column:
    return F.col(name)


def floor_to(c: Column, n: int) -> Column:
    """The start of c's n-wide bucket, in exact integer arithmetic."""
    return c - F.pmod(c, F.lit(n))


def ns_day(c: Column) -> Column:
    """The UTC date of a time in ns, independent of the session time zone."""
    return F.date_from_unix_date(((c - F.pmod(c, F.lit(DAY_NS))) / F.lit(DAY_NS)).cast("int"))


def ns_timestamp(c: Column) -> Column:
    return F.timestamp_micros(((c - F.pmod(c, F.lit(1000))) / F.lit(1000)).cast("long"))


# --- lifecycles -----------------------------------------------------------------


def job_events(records: DataFrame) -> DataFrame:
    """One row per (job, record naming it); snapshot rows included."""
    cols = ["seq", "time", "op", "conn", "tube", "pri", "delay", "ttr", "body_size", "snap"]
    single = records.where(col("op").isin(*JOB_OPS)).select("server", "id", *cols)
    multi = (records.where(col("op").isin(*MULTI_OPS))
             .select("server", F.explode("ids").alias("id"), "seq", "time", "op", "conn"))
    return single.unionByName(multi, allowMissingColumns=True)


def reservation_ends(records: DataFrame, events: DataFrame) -> DataFrame:
    """`events` with ie_seq/ie_time/ie_op: what would end a reservation implicitly.

    Set on reservation rows (reserve, or a snapshot job in state reserved) only:
    the first Disconnect of the reserving connection or Restart of the server
    after the row. Whether it actually ended the reservation depends on the
    job's next event, which the ordered window decides.
    """
    disconnects = (records.where(col("op") == "disconnect")
                   .groupBy("server", "conn")
                   .agg(F.min("seq").alias("d_seq"), F.min_by("time", "seq").alias("d_time")))
    restarts = (records.where(col("op") == "restart")
                .groupBy("server")
                .agg(F.array_sort(F.collect_list(F.struct("seq", "time"))).alias("restarts")))
    holds = (col("op") == "reserve") | ((col("op") == "snapshot") & (col("snap.state") == "reserved"))
    held = events.where(holds)
    rest = events.where(~holds | holds.isNull())
    after = F.get(F.filter("restarts", lambda x: x["seq"] > col("seq")), 0)
    d_seq = F.when(col("d_seq") > col("seq"), col("d_seq"))
    ie_seq = F.least(d_seq, after["seq"])
    joined = (held.join(disconnects, ["server", "conn"], "left")
              .join(F.broadcast(restarts), ["server"], "left")
              .withColumn("ie_seq", ie_seq)
              .withColumn("ie_time", F.when(col("ie_seq") == d_seq, col("d_time"))
                          .otherwise(after["time"]))
              .withColumn("ie_op", F.when(col("ie_seq").isNull(), None)
                          .when(col("ie_seq") == d_seq, "disconnect").otherwise("restart"))
              .drop("d_seq", "d_time", "restarts"))
    return joined.unionByName(rest, allowMissingColumns=True)


def _after_state() -> Column:
    delayed_or_ready = F.when(col("delay") > 0, "delayed").otherwise("ready")
    return (F.when(col("op").isin("put", "release"), delayed_or_ready)
            .when(col("op").isin("reserve", "touch"), "reserved")
            .when(col("op") == "bury", "buried")
            .when(col("op").isin(*MULTI_OPS, *IMPLICIT_OPS), "ready")
            .when(col("op") == "delete", "deleted")
            .when(col("op") == "snapshot", col("snap.state")))


def _since() -> Column:
    """When the job entered the state this row leaves it in (null: unknown)."""
    snap_known = ((col("snap.state") == "ready") & (col("snap.reserves") == 0)
                  & (col("snap.kicks") == 0) & (col("delay") == 0))
    return F.when(col("op") == "snapshot",
                  F.when(snap_known, col("snap.created"))).otherwise(col("time"))


def lifecycles(records: DataFrame) -> DataFrame:
    """One row per job lifecycle, with its events and reservation attempts."""
    events = reservation_ends(records, job_events(records))
    job = ["server", "id"]
    whole = Window.partitionBy(*job).orderBy("seq").rowsBetween(
        Window.unboundedPreceding, Window.unboundedFollowing)
    ordered = Window.partitionBy(*job).orderBy("seq")
    is_put = col("op") == "put"
    is_snap = col("op") == "snapshot"

    # Pass 1: where the job's story starts; drop what the snapshot already holds.
    has_put = F.max(is_put.cast("int")).over(whole) == 1
    snap_seq = F.max(F.when(is_snap, col("seq"))).over(whole)
    e = (events
         .withColumn("origin", F.when(has_put, "put")
                     .when(snap_seq.isNotNull(), "snapshot").otherwise("orphan"))
         .withColumn("snap_seq", snap_seq)
         .where(F.when(col("origin") == "put", ~is_snap)
                .when(col("origin") == "snapshot", is_snap | (col("seq") > col("snap_seq")))
                .otherwise(True))
         .withColumn("state", _after_state())
         .withColumn("since", _since()))

    # Pass 2: reservations that a Disconnect/Restart ended before the job's next event.
    next_seq = F.expr("lead(CASE WHEN op <> 'touch' THEN seq END, 1, NULL, true)").over(ordered)
    e = e.withColumn("next_seq", next_seq).withColumn(
        "implicit", (col("state") == "reserved") & (col("op") != "touch")
        & col("ie_seq").isNotNull() & (col("next_seq").isNull() | (col("ie_seq") < col("next_seq"))))
    fields = ["seq", "time", "op", "conn", "tube", "pri", "delay", "ttr", "body_size", "snap",
              "origin", "state", "since"]
    own = F.struct(*[col(f) for f in fields])
    implicit = F.when(col("implicit"), F.struct(
        col("ie_seq").alias("seq"), col("ie_time").alias("time"), col("ie_op").alias("op"),
        col("conn"), *[F.lit(None).cast(t).alias(f) for f, t in (
            ("tube", "string"), ("pri", "long"), ("delay", "long"), ("ttr", "long"),
            ("body_size", "long"))],
        F.lit(None).cast(e.schema["snap"].dataType).alias("snap"),
        col("origin"), F.lit("ready").alias("state"), col("ie_time").alias("since")))
    e = (e.select(*job, F.explode(F.array(own, implicit)).alias("e"))
         .where(col("e").isNotNull())
         .select(*job, *[col("e")[f].alias(f) for f in fields]))

    # Pass 3: previous state and when it began; what ends each reservation.
    prev = F.expr("lag(CASE WHEN op <> 'touch' THEN named_struct("
                  "'state', state, 'since', since) END, 1, NULL, true)").over(ordered)
    nxt = F.expr("lead(CASE WHEN op <> 'touch' THEN named_struct("
                 "'seq', seq, 'time', time, 'op', op) END, 1, NULL, true)").over(ordered)
    running = ordered.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    seed = F.coalesce(F.max(F.when(is_snap, col("snap.reserves"))).over(running), F.lit(0))
    attempt_no = F.sum(F.when(col("op") == "reserve", 1).otherwise(0)).over(running) + seed
    e = (e.withColumn("prev", prev).withColumn("nxt", nxt).withColumn("attempt_no", attempt_no)
         .withColumn("from_state", F.when(col("op") == "touch", "reserved")
                     .otherwise(col("prev.state"))))

    event = F.struct("seq", "time", "op", "conn", "from_state", col("state").alias("to_state"))
    attempt = F.when(col("op") == "reserve", F.struct(
        col("attempt_no").alias("n"), "seq", "time", "conn", "from_state",
        (col("time") - col("prev.since")).alias("wait_ns"),
        col("nxt.seq").alias("end_seq"), col("nxt.time").alias("end_ns"),
        F.coalesce(col("nxt.op"), F.lit("open")).alias("outcome"),
        (col("nxt.time") - col("time")).alias("run_ns")))

    def from_start(c: str) -> Column:
        return F.max(F.when(col("op").isin("put", "snapshot"), col(c)))

    def seeded(counter: str, op: str) -> Column:
        return (F.sum(F.when(col("op") == op, 1).otherwise(0))
                + F.coalesce(F.max(F.when(is_snap, col(f"snap.{counter}"))), F.lit(0))
                ).cast("long")

    seed_reserves = F.coalesce(F.max(F.when(is_snap, col("snap.reserves"))), F.lit(0))
    jobs = e.groupBy(*job).agg(
        F.max("origin").alias("origin"),
        from_start("tube").alias("tube"),
        F.coalesce(F.max(F.when(is_put, col("time"))),
                   F.max(F.when(is_snap, col("snap.created")))).alias("put_ns"),
        from_start("pri").alias("pri"),
        from_start("delay").alias("delay"),
        from_start("ttr").alias("ttr"),
        from_start("body_size").alias("body_size"),
        F.when(seed_reserves == 0, F.min(F.when(col("op") == "reserve", col("time"))))
        .alias("first_reserve_ns"),
        seeded("reserves", "reserve").alias("reserves"),
        seeded("releases", "release").alias("releases"),
        seeded("buries", "bury").alias("buries"),
        seeded("timeouts", "timeout").alias("timeouts"),
        seeded("kicks", "kick").alias("kicks"),
        F.sum(F.when(col("op") == "touch", 1).otherwise(0)).cast("long").alias("touches"),
        F.sum(F.when(col("op").isin(*IMPLICIT_OPS), 1).otherwise(0)).cast("long")
        .alias("implicit_releases"),
        F.max(F.when(col("op") == "delete", col("time"))).alias("deleted_ns"),
        F.max_by("state", "seq").alias("state"),
        F.min("time").alias("first_ns"),
        F.max("time").alias("last_ns"),
        F.array_sort(F.collect_list(event)).alias("events"),
        F.array_sort(F.collect_list(attempt)).alias("attempts"),
    )
    return (jobs
            .withColumn("first_wait_ns", col("first_reserve_ns") - col("put_ns"))
            .withColumn("latency_ns", col("deleted_ns") - col("put_ns"))
            .withColumn("put_at", ns_timestamp(col("put_ns")))
            .withColumn("day", ns_day(F.coalesce(col("put_ns"), col("first_ns"))))
            .select(*JOB_COLUMNS))


JOB_COLUMNS = (
    "server", "id", "origin", "put_ns", "put_at", "pri", "delay", "ttr", "body_size",
    "first_reserve_ns", "first_wait_ns", "reserves", "releases", "buries", "timeouts", "kicks",
    "touches", "implicit_releases", "state", "deleted_ns", "latency_ns", "first_ns", "last_ns",
    "events", "attempts", "tube", "day",
)


def attempts_of(jobs: DataFrame) -> DataFrame:
    """One row per reservation attempt."""
    a = jobs.select("server", "id", "tube", "origin", "put_ns",
                    F.explode("attempts").alias("a")).select(
        "server", "id", "tube", "origin", "a.*", "put_ns")
    first_ok = (col("n") == 1) & col("put_ns").isNotNull()
    return (a.withColumnRenamed("time", "reserve_ns")
            .withColumn("first_wait_ns", F.when(first_ok, col("reserve_ns") - col("put_ns")))
            .withColumn("reserve_at", ns_timestamp(col("reserve_ns")))
            .withColumn("day", ns_day(col("reserve_ns")))
            .select("server", "id", "n", "seq", "reserve_ns", "reserve_at", "conn", "from_state",
                    "wait_ns", "first_wait_ns", "end_seq", "end_ns", "outcome", "run_ns",
                    "tube", "day"))


# --- windows ----------------------------------------------------------------------


def _percentiles(prefix: str, values: Column, accuracy: int) -> list[Column]:
    p = F.percentile_approx(values, list(QUANTILES), accuracy)
    return [(p[i] / F.lit(1e6)).alias(f"{prefix}_p{round(q * 100)}_ms")
            for i, q in enumerate(QUANTILES)]


def _latency_aggs(accuracy: int) -> list[Column]:
    out = []
    for name, column, outcome in LATENCIES:
        values = col(column) if outcome is None else F.when(col("outcome") == outcome, col(column))
        out += _percentiles(name, values, accuracy)
    return out


def windowed(jobs: DataFrame, attempts: DataFrame, width_ns: int, accuracy: int) -> DataFrame:
    """Per (tube, window) metrics, dense over time, with the backlog at each window's end."""
    ev = (jobs.where(col("tube").isNotNull())
          .select("tube", F.explode("events").alias("e"))
          .select("tube", floor_to(col("e.time"), width_ns).alias("window_ns"), "e.*"))
    counts = ev.groupBy("tube", "window_ns").agg(
        *[F.sum(F.when(col("op") == op, 1).otherwise(0)).cast("long").alias(name)
          for name, op in COUNTED_OPS],
        F.sum(F.when(col("op").isin(*IMPLICIT_OPS), 1).otherwise(0)).cast("long")
        .alias("implicit_releases"))
    # Backlog: -1 for the state an event leaves, +1 for the one it enters.
    deltas = ev.where(col("op") != "touch").select(
        "tube", "window_ns", F.explode(F.array(
            F.struct(col("from_state").alias("s"), F.lit(-1).alias("d")),
            F.struct(col("to_state").alias("s"), F.lit(1).alias("d")))).alias("x"))
    moves = (deltas.where(col("x.s").isin(*STATES))
             .groupBy("tube", "window_ns")
             .agg(*[F.sum(F.when(col("x.s") == s, col("x.d")).otherwise(0)).cast("long")
                    .alias(f"d_{s}") for s in STATES]))
    att = (attempts.where(col("tube").isNotNull())
           .withColumn("window_ns", floor_to(col("reserve_ns"), width_ns))
           .groupBy("tube", "window_ns").agg(
               F.sum(F.when(col("n") > 1, 1).otherwise(0)).cast("long").alias("re_reserves"),
               *_latency_aggs(accuracy)))
    bounds = ev.groupBy("tube").agg(F.min("window_ns").alias("lo"))
    end = ev.agg(F.max("window_ns").alias("hi"))
    grid = (bounds.crossJoin(F.broadcast(end))
            .select("tube", F.explode(F.sequence("lo", "hi", F.lit(width_ns))).alias("window_ns")))
    out = (grid.join(counts, ["tube", "window_ns"], "left")
           .join(moves, ["tube", "window_ns"], "left")
           .join(att, ["tube", "window_ns"], "left")
           .fillna(0, subset=[n for n, _ in COUNTED_OPS]
                   + ["implicit_releases", "re_reserves"] + [f"d_{s}" for s in STATES]))
    running = Window.partitionBy("tube").orderBy("window_ns").rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    for s in STATES:
        out = out.withColumn(s, F.sum(f"d_{s}").over(running).cast("long")).drop(f"d_{s}")
    out = out.withColumn("backlog", sum((col(s) for s in STATES), F.lit(0)).cast("long"))
    rate = {f"{name}_rate": F.when(col("reserves") > 0, col(name) / col("reserves"))
            for name in ("releases", "buries", "timeouts")}
    return (out.withColumns(rate)
            .withColumn("window", ns_timestamp(col("window_ns")))
            .withColumn("day", ns_day(col("window_ns")))
            .select("window_ns", "window", *[n for n, _ in COUNTED_OPS], "implicit_releases",
                    "re_reserves", *rate, *[c for n, _c, _o in LATENCIES for c in
                                            (f"{n}_p50_ms", f"{n}_p95_ms", f"{n}_p99_ms")],
                    "backlog", *STATES, "tube", "day"))


def tube_summary(jobs: DataFrame, attempts: DataFrame, minutes: DataFrame,
                 accuracy: int) -> DataFrame:
    """One row per tube over the whole time range."""
    j = jobs.where(col("tube").isNotNull()).groupBy("tube").agg(
        F.countDistinct("server").alias("servers"),
        F.count("*").alias("jobs"),
        F.sum(F.when(col("origin") == "put", 1).otherwise(0)).cast("long").alias("puts"),
        F.sum(F.when(col("origin") == "snapshot", 1).otherwise(0)).cast("long")
        .alias("from_snapshot"),
        F.sum(F.when(col("state") == "deleted", 1).otherwise(0)).cast("long").alias("deleted"),
        F.sum(F.when(col("state") != "deleted", 1).otherwise(0)).cast("long").alias("open"),
        *[F.sum(F.when(col("state") == s, 1).otherwise(0)).cast("long").alias(f"open_{s}")
          for s in STATES],
        *[F.sum(c).cast("long").alias(c) for c in (
            "reserves", "releases", "buries", "timeouts", "kicks", "touches",
            "implicit_releases")],
        F.sum(F.when(col("reserves") > 1, 1).otherwise(0)).cast("long")
        .alias("reserved_more_than_once"),
        F.min("first_ns").alias("first_ns"), F.max("last_ns").alias("last_ns"),
        *_percentiles("latency", col("latency_ns"), accuracy))
    a = attempts.where(col("tube").isNotNull()).groupBy("tube").agg(
        F.count("*").alias("attempts"), *_latency_aggs(accuracy))
    m = minutes.groupBy("tube").agg(
        F.max("backlog").alias("max_backlog"), F.max("ready").alias("max_ready"),
        F.max_by("window", "ready").alias("max_ready_at"),
        F.max("puts").alias("peak_puts_per_minute"))
    out = j.join(a, "tube", "left").join(m, "tube", "left")
    rates = {f"{n}_rate": F.when(col("reserves") > 0, col(n) / col("reserves"))
             for n in ("releases", "buries", "timeouts")}
    return out.withColumns(rates).orderBy("tube")


def server_summary(records: DataFrame) -> DataFrame:
    logged = col("op") != "snapshot"
    return records.groupBy("server").agg(
        F.sum(logged.cast("int")).cast("long").alias("records"),
        F.min(F.when(logged, col("seq"))).alias("first_seq"),
        F.max(F.when(logged, col("seq"))).alias("last_seq"),
        F.min(F.when(logged, col("time"))).alias("first_ns"),
        F.max(F.when(logged, col("time"))).alias("last_ns"),
        F.countDistinct(F.when(logged, col("segment"))).alias("segments"),
        F.sum((~logged).cast("int")).cast("long").alias("snapshot_jobs"),
        F.max(F.when(~logged, col("seq"))).alias("snapshot_seq"),
        F.sum(F.when(col("op") == "restart", 1).otherwise(0)).cast("long").alias("restarts"),
    ).withColumn("missing", col("last_seq") - col("first_seq") + 1 - col("records")).orderBy("server")


# --- running it -------------------------------------------------------------------------


def _write(df: DataFrame, path: Path | str, partitioned: bool = True) -> None:
    w = (df.repartition("tube", "day") if partitioned else df.coalesce(1)).write.mode("overwrite")
    if partitioned:
        w = w.partitionBy("tube", "day")
    w.parquet(str(path))


def _read(spark: SparkSession, path: Path | str, like: DataFrame) -> DataFrame:
    # The schema is given so partition values are never re-typed (a tube called "2026").
    return spark.read.schema(like.schema).parquet(str(path))


def _rows(df: DataFrame) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in df.collect()]


def run(spark: SparkSession, records: DataFrame, out: Path | str, accuracy: int = 10_000,
        step: Step = _noop) -> dict[str, Any]:
    """The whole pipeline: write the tables under `out`, return the small summaries.

    Tables (Parquet): jobs, attempts, tube_minute, tube_hour (each partitioned by
    tube and day), tube_summary and servers (one file each).
    """
    out = str(out).rstrip("/")
    recs = records.drop("body") if "body" in records.columns else records
    recs = recs.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        step("reading and decoding the AOF")
        servers_df = server_summary(recs)
        server_rows = servers_df.collect()
        servers = [r.asDict() for r in server_rows]
        step(f"{sum(s['records'] for s in servers):,} records from {len(servers)} servers; "
             "deriving job lifecycles")
        jobs_df = lifecycles(recs)
        _write(jobs_df, f"{out}/jobs")
    finally:
        recs.unpersist()
    jobs = _read(spark, f"{out}/jobs", jobs_df)
    step("writing reservation attempts")
    attempts_df = attempts_of(jobs)
    _write(attempts_df, f"{out}/attempts")
    attempts = _read(spark, f"{out}/attempts", attempts_df)
    tables: dict[str, DataFrame] = {}
    for name, width in WINDOWS.items():
        step(f"per-tube metrics per {name}")
        df = windowed(jobs, attempts, width, accuracy)
        _write(df, f"{out}/tube_{name}")
        tables[name] = _read(spark, f"{out}/tube_{name}", df)
    step("per-tube summary")
    _write(tube_summary(jobs, attempts, tables["minute"], accuracy), f"{out}/tube_summary",
           partitioned=False)
    summary = _rows(spark.read.parquet(f"{out}/tube_summary").orderBy("tube"))
    _write(spark.createDataFrame(server_rows, servers_df.schema), f"{out}/servers",
           partitioned=False)
    orphans = jobs.where(col("origin") == "orphan").count()
    return {"servers": servers, "tubes": summary, "orphan_jobs": orphans}


def series(spark: SparkSession, out: Path | str, width: str) -> dict[str, list[dict[str, Any]]]:
    """Per tube, the window rows the report charts (a small aggregate)."""
    df = spark.read.parquet(f"{str(out).rstrip('/')}/tube_{width}")
    keep = ["tube", "window_ns", "puts", "deletes", "reserves", "timeouts", "backlog", *STATES,
            "wait_p50_ms", "wait_p95_ms", "wait_p99_ms", "run_p50_ms", "run_p95_ms", "run_p99_ms"]
    by_tube: dict[str, list[dict[str, Any]]] = {}
    for r in _rows(df.select(*keep).orderBy("tube", "window_ns")):
        by_tube.setdefault(str(r.pop("tube")), []).append(r)
    return by_tube


def to_json(obj: Any) -> str:
    return json.dumps(obj, default=str, indent=1, sort_keys=True)
