"""Job lifecycles and per-tube, per-window metrics from AOF records, on Spark.

Input: the DataFrame of the `smallstalk` data source (one row per record, plus
the newest snapshot's jobs). Everything below is DataFrame code: it runs the
same on a laptop in local mode and on a cluster, and only small aggregates
(one row per tube, per server) ever reach the driver.

**Job events.** Records that name jobs (put, reserve, delete, release, bury,
touch; kick, promote and timeout exploded to one row per id) and snapshot job
rows, keyed by (server, id): job ids are unique only within one server. A
put-jobs (format 2), and a put-unique (format 5, a keyed put) alike, is a
"put" per job it made (a fanout copy is a job of its own) and a "discard"
per job it dropped from a full tube, and a schedule's firing is a "put" of
the job it made; an expire is an "expire" per job it deleted and a "move"
per job it moved to a dead-letter tube, where the job's life goes on. A
requeue (a tube's job policy ending reservations) is an event per job named
by its cause ("timeout", "release", "disconnect"), in the state the policy
chose: ready, delayed (a back-off), buried, or ready in a dead-letter tube
(at an attempt limit); a move-job is a "move-job" event that takes the job,
in the state it had, to another tube.

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
"restart", the job back to ready. In a tube with a job policy the log says
where a closed connection's jobs went (a requeue, cause disconnect): that
event is the job's "disconnect", and it counts as an implicit release too.

**States.** Each event's state after it follows from the op alone (put and
release: delayed if delay > 0 else ready; reserve, touch: reserved; bury:
buried; kick, promote, timeout, disconnect, restart, move: ready; delete:
deleted; expire: expired; discard: discarded), but for a requeue's, which
its outcome gives, and a move-job's, the state it had; so after one sort by (server,
id, seq) two window passes do the rest: one over the whole job (where its
story starts, what to drop), one ordered (the state before each event, when
the job entered it, what ended each reservation, the implicit events, the
tube each event happens in: the put's until a move), then one aggregation
per job. A bury counted is a job going from reserved to buried, by `bury` or
by a policy at an attempt limit.

**Attempts** (one per reserve): `wait_ns` = reserve time - time the job
entered the state it was reserved from (normally ready: put, release, promote,
kick, timeout, disconnect, restart, a move); `first_wait_ns` (first attempt only) =
reserve time - put time, delay included; `outcome` = what ended it (delete,
release, bury, timeout, disconnect, restart, or open); `run_ns` = end time -
reserve time. Run-time percentiles use attempts ending in delete.

**Windows** (minute, hour; UTC): per tube, throughput in (puts) and out
(deletes), reserves, re-reserves (attempts after the first: duplicate work),
releases, buries, kicks, timeouts, touches, implicit releases, expiries
(deleted or moved out), discards, moves in (from another tube); wait,
first-wait and run-time percentiles of the attempts that started in the
window; and the backlog at the end of the window: jobs alive in the tube (put
or moved in, and not yet deleted, expired, discarded or moved out) and how
many of them are ready, delayed, reserved, buried. Each event counts in the
tube it happens in, each attempt in the tube it was reserved from. Windows
are dense from a tube's first event to the end of the data (the last record
of any server), so backlog series have no holes.

Percentiles are `percentile_approx` with `accuracy` (default 10000): exact
nearest-rank (the smallest value with at least p of all values at or below
it) while a group has fewer values than `accuracy`, and within n/accuracy
ranks above that.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from smallstalk.core.model import NS, STATE_NAMES
from smallstalk.core.records import REQUEUE_DISCONNECT, REQUEUE_RELEASE, REQUEUE_TIMEOUT

DAY_NS = 86_400 * NS
WINDOWS = {"minute": 60 * NS, "hour": 3_600 * NS}
QUANTILES = (0.5, 0.95, 0.99)
JOB_OPS = ("put", "reserve", "delete", "release", "bury", "touch", "snapshot")
MULTI_OPS = ("kick", "promote", "timeout")
PUT_JOBS_OPS = ("put-jobs", "put-unique")  # records whose `jobs` it made and `dropped`
IMPLICIT_OPS = ("disconnect", "restart")
# A requeue's event op, by its cause.
REQUEUE_OPS = {REQUEUE_TIMEOUT: "timeout", REQUEUE_RELEASE: "release",
               REQUEUE_DISCONNECT: "disconnect"}
EXPIRY_OPS = ("expire", "move")  # an Expire record's job: deleted, or moved to `to_tube`
ENDS = ("deleted", "expired", "discarded")  # states a job's life ends in
COUNTED_OPS = (
    ("puts", "put"), ("reserves", "reserve"), ("deletes", "delete"), ("releases", "release"),
    ("buries", "bury"), ("kicks", "kick"), ("timeouts", "timeout"), ("touches", "touch"),
    ("promotes", "promote"), ("discards", "discard"), ("moves_in", "move-in"),
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


def div(c: Column, n: int) -> Column:
    """Integer division rounding down (`/` would go through a double)."""
    return F.call_function("div", floor_to(c, n), F.lit(n))


def ns_day(c: Column) -> Column:
    """The UTC date of a time in ns, independent of the session time zone."""
    return F.date_from_unix_date(div(c, DAY_NS).cast("int"))


def ns_timestamp(c: Column) -> Column:
    return F.timestamp_micros(div(c, 1000))


# --- lifecycles -----------------------------------------------------------------


def job_events(records: DataFrame) -> DataFrame:
    """One row per (job, record naming it); snapshot rows included.

    A put-jobs or a put-unique is a "put" row per job it made (each fanout copy
    is a job of its own) and a "discard" row per job it dropped; a schedule's
    firing that made a job is a "put" row (no connection); an expire is an
    "expire" row (the job is deleted) or a "move" row (it goes on, ready, in
    `to_tube`) per job; a flush-tube is a "delete" row per job it names. A
    requeue is a row per job, its op the cause ("timeout", "release",
    "disconnect") and `after` the state the tube's policy sent it to (with
    `to_tube` for a dead-letter move); a move-job is a "move-job" row, the job
    in `to_tube` in the state it had. Other rows leave `after` null: their op
    decides (`_after_state`).
    """
    cols = ["seq", "time", "op", "conn", "tube", "pri", "delay", "ttr", "body_size", "snap"]
    single = records.where(col("op").isin(*JOB_OPS)).select("server", "id", *cols)
    multi = (records.where(col("op").isin(*MULTI_OPS))
             .select("server", F.explode("ids").alias("id"), "seq", "time", "op", "conn"))
    put_jobs = records.where(col("op").isin(*PUT_JOBS_OPS))
    made = (put_jobs.select("server", F.explode("jobs").alias("j"), "seq", "time", "conn", "pri",
                            "delay", "ttr", "body_size")
            .select("server", col("j.id").alias("id"), "seq", "time", F.lit("put").alias("op"),
                    "conn", col("j.tube").alias("tube"), "pri", "delay", "ttr", "body_size"))
    dropped = put_jobs.select("server", F.explode("dropped").alias("id"), "seq", "time",
                              F.lit("discard").alias("op"), "conn")
    fired = (records.where((col("op") == "fire") & (col("id") != 0))  # id 0: a skipped firing
             .select("server", "id", "seq", "time", F.lit("put").alias("op"), "tube", "pri",
                     "delay", "ttr", "body_size"))
    expired = (records.where(col("op") == "expire")
               .select("server", F.explode("moves").alias("m"), "seq", "time")
               .select("server", col("m.id").alias("id"), "seq", "time",
                       F.when(col("m.to") == "", "expire").otherwise("move").alias("op"),
                       F.when(col("m.to") != "", col("m.to")).alias("to_tube")))
    flushed = (records.where(col("op") == "flush-tube")  # each job it names is deleted
               .select("server", F.explode("ids").alias("id"), "seq", "time",
                       F.lit("delete").alias("op"), "conn"))
    o = col("o")
    at_limit = o["reason"] != ""
    requeued = (records.where(col("op") == "requeue")
                .select("server", F.explode("outcomes").alias("o"), "seq", "time", "conn",
                        "cause")
                .select("server", o["id"].alias("id"), "seq", "time",
                        F.create_map(*[F.lit(x) for kv in REQUEUE_OPS.items() for x in kv])
                        [col("cause")].alias("op"),
                        F.when(col("cause") != REQUEUE_TIMEOUT, col("conn")).alias("conn"),
                        F.when(~at_limit, F.when(o["until"] > 0, "delayed").otherwise("ready"))
                        .when(o["to"] == "", "buried").otherwise("ready").alias("after"),
                        F.when(at_limit & (o["to"] != ""), o["to"]).alias("to_tube")))
    moved = (records.where(col("op") == "move")  # triage's move-job: the state stays
             .select("server", "id", "seq", "time", F.lit("move-job").alias("op"), "conn",
                     col("tube").alias("to_tube")))
    out = single
    for part in (multi, made, dropped, fired, expired, flushed, requeued, moved):
        out = out.unionByName(part, allowMissingColumns=True)
    return out


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
    """The state an event leaves its job in; null for a move-job (the state it had)."""
    delayed_or_ready = F.when(col("delay") > 0, "delayed").otherwise("ready")
    return (F.when(col("after").isNotNull(), col("after"))
            .when(col("op").isin("put", "release"), delayed_or_ready)
            .when(col("op").isin("reserve", "touch"), "reserved")
            .when(col("op") == "bury", "buried")
            .when(col("op").isin(*MULTI_OPS, *IMPLICIT_OPS), "ready")
            .when(col("op") == "delete", "deleted")
            .when(col("op") == "move", "ready")
            .when(col("op") == "expire", "expired")
            .when(col("op") == "discard", "discarded")
            .when(col("op") == "snapshot", col("snap.state")))


def _since() -> Column:
    """When the job entered the state this row leaves it in (null: unknown)."""
    snap_known = ((col("snap.state") == "ready") & (col("snap.reserves") == 0)
                  & (col("snap.kicks") == 0) & (col("delay") == 0))
    return F.when(col("op") == "snapshot",
                  F.when(snap_known, col("snap.created"))).otherwise(col("time"))


def is_bury(from_state: Column, to_state: Column) -> Column:
    """A bury: reserved to buried, by `bury` or by a tube's policy at an attempt limit."""
    return (from_state == "reserved") & (to_state == "buried")


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
         .withColumn("state", _after_state()))
    before = ordered.rowsBetween(Window.unboundedPreceding, -1)
    e = e.withColumns({"state": F.coalesce(col("state"),
                                           F.last("state", ignorenulls=True).over(before)),
                       "since": _since()})

    # Pass 2, one ordered window: the previous and the next non-touch row (a touch
    # changes no state), and whether a Disconnect/Restart ended the reservation a
    # row starts before the job's next event came: then the job has an implicit
    # event there (reserved -> ready), which also ends that attempt.
    prev = F.expr("lag(CASE WHEN op <> 'touch' THEN named_struct('seq', seq, 'state', state, "
                  "'since', since, 'ie_seq', ie_seq, 'ie_time', ie_time) END, 1, NULL, true)")
    nxt = F.expr("lead(CASE WHEN op <> 'touch' THEN named_struct('seq', seq, 'time', time, "
                 "'op', op) END, 1, NULL, true)")
    running = ordered.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    seed = F.coalesce(F.max(F.when(is_snap, col("snap.reserves"))).over(running), F.lit(0))
    attempt_no = F.sum(F.when(col("op") == "reserve", 1).otherwise(0)).over(running) + seed
    # The tube each event happens in: the put's (or the snapshot's), until a move
    # (an expiry's, a policy's dead-letter move, a move-job) takes the job on; the
    # move itself happens in the tube it leaves.
    moves = col("to_tube").isNotNull()
    tube_set = F.when(col("op").isin("put", "snapshot"), col("tube")).when(moves, col("to_tube"))
    at_tube = F.when(moves, F.last(tube_set, ignorenulls=True).over(before)
                     ).otherwise(F.last(tube_set, ignorenulls=True).over(running))
    e = e.withColumns({"prev": prev.over(ordered), "nxt": nxt.over(ordered),
                       "attempt_no": attempt_no, "at_tube": at_tube})

    def ends_early(state: Column, ie_seq: Column, next_seq: Column) -> Column:
        return ((state == "reserved") & ie_seq.isNotNull()
                & (next_seq.isNull() | (ie_seq < next_seq)))

    not_touch = col("op") != "touch"
    e = e.withColumn("implicit", not_touch & ends_early(col("state"), col("ie_seq"),
                                                       col("nxt.seq")))
    after_implicit = ends_early(col("prev.state"), col("prev.ie_seq"), col("seq"))
    e = e.withColumns({
        "from_state": F.when(~not_touch, "reserved").when(after_implicit, "ready")
        .otherwise(col("prev.state")),
        "prev_since": F.when(after_implicit, col("prev.ie_time")).otherwise(col("prev.since")),
    })
    end = F.when(col("implicit"), F.struct(col("ie_seq").alias("seq"), col("ie_time").alias("time"),
                                           col("ie_op").alias("op"))).otherwise(col("nxt"))
    event = F.struct("seq", "time", "op", "conn", "from_state", col("state").alias("to_state"),
                     col("at_tube").alias("tube"), "to_tube")
    implicit_event = F.when(col("implicit"), F.struct(
        col("ie_seq").alias("seq"), col("ie_time").alias("time"), col("ie_op").alias("op"),
        "conn", F.lit("reserved").alias("from_state"), F.lit("ready").alias("to_state"),
        col("at_tube").alias("tube"), F.lit(None).cast("string").alias("to_tube")))
    attempt = F.when(col("op") == "reserve", F.struct(
        col("attempt_no").alias("n"), "seq", "time", "conn", "from_state",
        (col("time") - col("prev_since")).alias("wait_ns"),
        end["seq"].alias("end_seq"), end["time"].alias("end_ns"),
        F.coalesce(end["op"], F.lit("open")).alias("outcome"),
        (end["time"] - col("time")).alias("run_ns"), col("at_tube").alias("tube")))

    def from_start(c: str) -> Column:
        return F.max(F.when(col("op").isin("put", "snapshot"), col(c)))

    def seeded(counter: str, happened: Column) -> Column:
        return (F.sum(F.when(happened, 1).otherwise(0))
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
        seeded("reserves", col("op") == "reserve").alias("reserves"),
        seeded("releases", col("op") == "release").alias("releases"),
        seeded("buries", is_bury(col("from_state"), col("state"))).alias("buries"),
        seeded("timeouts", col("op") == "timeout").alias("timeouts"),
        seeded("kicks", col("op") == "kick").alias("kicks"),
        F.sum(F.when(col("op") == "touch", 1).otherwise(0)).cast("long").alias("touches"),
        (F.sum(col("implicit").cast("int")) + F.sum(col("op").isin(*IMPLICIT_OPS).cast("int")))
        .cast("long").alias("implicit_releases"),
        F.sum(F.when(col("op").isin(*EXPIRY_OPS), 1).otherwise(0)).cast("long").alias("expiries"),
        F.max(F.when(col("op") == "delete", col("time"))).alias("deleted_ns"),
        F.max(F.when(col("op") == "expire", col("time"))).alias("expired_ns"),
        F.max(F.when(col("op") == "discard", col("time"))).alias("discarded_ns"),
        F.min("time").alias("first_ns"),
        F.greatest(F.max("time"), F.max(F.when(col("implicit"), col("ie_time")))).alias("last_ns"),
        F.array_sort(F.concat(F.collect_list(event), F.collect_list(implicit_event)))
        .alias("events"),
        F.array_sort(F.collect_list(attempt)).alias("attempts"),
    )
    return (jobs
            .withColumn("state", F.element_at("events", -1)["to_state"])
            .withColumn("last_tube", F.coalesce(F.element_at("events", -1)["to_tube"],
                                                F.element_at("events", -1)["tube"]))
            .withColumn("first_wait_ns", col("first_reserve_ns") - col("put_ns"))
            .withColumn("latency_ns", col("deleted_ns") - col("put_ns"))
            .withColumn("put_at", ns_timestamp(col("put_ns")))
            .withColumn("day", ns_day(F.coalesce(col("put_ns"), col("first_ns"))))
            .select(*JOB_COLUMNS))


JOB_COLUMNS = (
    "server", "id", "origin", "put_ns", "put_at", "pri", "delay", "ttr", "body_size",
    "first_reserve_ns", "first_wait_ns", "reserves", "releases", "buries", "timeouts", "kicks",
    "touches", "implicit_releases", "expiries", "state", "deleted_ns", "expired_ns",
    "discarded_ns", "latency_ns", "last_tube", "first_ns", "last_ns", "events", "attempts",
    "tube", "day",
)


def attempts_of(jobs: DataFrame) -> DataFrame:
    """One row per reservation attempt, in the tube it was reserved from."""
    a = jobs.select("server", "id", "origin", "put_ns",
                    F.explode("attempts").alias("a")).select(
        "server", "id", "origin", "a.*", "put_ns")
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


def windowed(jobs: DataFrame, attempts: DataFrame, width_ns: int, accuracy: int,
             end_ns: int) -> DataFrame:
    """Per (tube, window) metrics, dense up to `end_ns`, with the backlog at each window's end.

    Each event counts in the tube it happened in; a job an expiry, a policy's
    dead-letter move or a move-job moves leaves its tube there and enters the
    other tube ("move-in").
    """
    e = jobs.select(F.explode("events").alias("e"))
    window = floor_to(col("e.time"), width_ns).alias("window_ns")
    is_move = col("e.to_tube").isNotNull()
    ev = (e.where(col("e.tube").isNotNull())
          .select(col("e.tube").alias("tube"), window, col("e.op").alias("op"),
                  col("e.from_state").alias("frm"),
                  F.when(~is_move, col("e.to_state")).alias("to"))
          .unionByName(e.where(is_move)
                       .select(col("e.to_tube").alias("tube"), window,
                               F.lit("move-in").alias("op"),
                               F.lit(None).cast("string").alias("frm"),
                               col("e.to_state").alias("to"))))

    def moved(s: str) -> Column:
        # +1 for the state an event enters, -1 for the one it leaves (a touch: both)
        return (F.when(col("to") == s, 1).otherwise(0) - F.when(col("frm") == s, 1).otherwise(0))

    def happened(name: str, op: str) -> Column:
        return is_bury(col("frm"), col("to")) if name == "buries" else col("op") == op

    stats = ev.groupBy("tube", "window_ns").agg(
        *[F.sum(F.when(happened(name, op), 1).otherwise(0)).cast("long").alias(name)
          for name, op in COUNTED_OPS],
        F.sum(F.when(col("op").isin(*IMPLICIT_OPS), 1).otherwise(0)).cast("long")
        .alias("implicit_releases"),
        F.sum(F.when(col("op").isin(*EXPIRY_OPS), 1).otherwise(0)).cast("long").alias("expiries"),
        *[F.sum(moved(s)).cast("long").alias(f"d_{s}") for s in STATE_NAMES])
    att = (attempts.where(col("tube").isNotNull())
           .withColumn("window_ns", floor_to(col("reserve_ns"), width_ns))
           .groupBy("tube", "window_ns").agg(
               F.sum(F.when(col("n") > 1, 1).otherwise(0)).cast("long").alias("re_reserves"),
               *_latency_aggs(accuracy)))
    # Every reserve is an event, so each attempt window has a stats row.
    per = stats.join(att, ["tube", "window_ns"], "left").fillna(0, subset=["re_reserves"])
    # Dense: each row also stands for the empty windows up to the tube's next row (or the end).
    by_time = Window.partitionBy("tube").orderBy("window_ns")
    last = F.lit(end_ns - end_ns % width_ns)
    filled = (per.withColumn("upto", F.coalesce(F.lead("window_ns").over(by_time)
                                                - F.lit(width_ns), last))
              .withColumn("w", F.explode(F.sequence("window_ns", F.greatest("upto", "window_ns"),
                                                    F.lit(width_ns)))))
    own = col("w") == col("window_ns")
    metrics = [n for n, _ in COUNTED_OPS] + ["implicit_releases", "expiries", "re_reserves"]
    latency = [f"{n}_p{q}_ms" for n, _c, _o in LATENCIES for q in (50, 95, 99)]
    out = filled.select(
        "tube", col("w").alias("window_ns"),
        *[F.when(own, col(m)).otherwise(0).alias(m) for m in metrics],
        *[F.when(own, col(m)).alias(m) for m in latency],
        *[F.when(own, col(f"d_{s}")).otherwise(0).alias(f"d_{s}") for s in STATE_NAMES])
    running = Window.partitionBy("tube").orderBy("window_ns").rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    out = out.withColumns({s: F.sum(f"d_{s}").over(running).cast("long") for s in STATE_NAMES})
    out = out.withColumn("backlog", sum((col(s) for s in STATE_NAMES), F.lit(0)).cast("long"))
    rate = {f"{name}_rate": F.when(col("reserves") > 0, col(name) / col("reserves"))
            for name in ("releases", "buries", "timeouts")}
    return (out.withColumns(rate)
            .withColumn("window", ns_timestamp(col("window_ns")))
            .withColumn("day", ns_day(col("window_ns")))
            .select("window_ns", "window", *metrics, *rate, *latency,
                    "backlog", *STATE_NAMES, "tube", "day"))


def tube_summary(jobs: DataFrame, attempts: DataFrame, minutes: DataFrame,
                 accuracy: int) -> DataFrame:
    """One row per tube over the whole time range (tube null: the orphan jobs).

    Job figures (jobs, states, counters, latency) count the jobs put into the
    tube; attempt figures (attempts, wait and run percentiles) the reserves made
    from it; the backlog is the tube's own. They differ only for jobs a move
    (an expiry's, a policy's dead-letter move, a move-job) took to another tube,
    which has a row even if nothing was put into it.
    """
    j = jobs.groupBy("tube").agg(
        F.countDistinct("server").alias("servers"),
        F.count("*").alias("jobs"),
        F.sum(F.when(col("origin") == "put", 1).otherwise(0)).cast("long").alias("puts"),
        F.sum(F.when(col("origin") == "snapshot", 1).otherwise(0)).cast("long")
        .alias("from_snapshot"),
        *[F.sum(F.when(col("state") == s, 1).otherwise(0)).cast("long").alias(s) for s in ENDS],
        F.sum(F.when(~col("state").isin(*ENDS), 1).otherwise(0)).cast("long").alias("open"),
        *[F.sum(F.when(col("state") == s, 1).otherwise(0)).cast("long").alias(f"open_{s}")
          for s in STATE_NAMES],
        *[F.sum(c).cast("long").alias(c) for c in (
            "reserves", "releases", "buries", "timeouts", "kicks", "touches",
            "implicit_releases", "expiries")],
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
    counts = [f.name for f in j.schema.fields if f.name not in ("tube", "first_ns", "last_ns")
              and not f.name.startswith("latency_")]
    out = (j.join(a, "tube", "full").join(m, "tube", "full")
           .fillna(0, subset=[*counts, "attempts"]))
    rates = {f"{n}_rate": F.when(col("reserves") > 0, col(n) / col("reserves"))
             for n in ("releases", "buries", "timeouts")}
    return out.withColumns(rates)


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
        F.max(F.when(~logged, col("time"))).alias("snapshot_ns"),
        F.sum(F.when(col("op") == "restart", 1).otherwise(0)).cast("long").alias("restarts"),
    ).withColumn("missing", col("last_seq") - col("first_seq") + 1 - col("records")).orderBy("server")


# --- running it -------------------------------------------------------------------------


def _write(df: DataFrame, path: Path | str, partitioned: bool = True, big: bool = False) -> None:
    """Parquet, partitioned by tube and day (or one file).

    Small tables are shuffled into one file per (tube, day); big ones (jobs,
    attempts) are written from the partitions they have, which saves a shuffle
    of the largest data: a task writes one file per (tube, day) it holds.
    """
    if not partitioned:
        df = df.coalesce(1)
    elif not big:
        df = df.repartition("tube", "day")
    w = df.write.mode("overwrite")
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
        _write(jobs_df, f"{out}/jobs", big=True)
    finally:
        recs.unpersist()
    jobs = _read(spark, f"{out}/jobs", jobs_df)
    step("writing reservation attempts")
    attempts_df = attempts_of(jobs)
    _write(attempts_df, f"{out}/attempts", big=True)
    attempts = _read(spark, f"{out}/attempts", attempts_df)
    end_ns = max((t for srv in servers for t in (srv["last_ns"], srv["snapshot_ns"])
                  if t is not None), default=0)
    tables: dict[str, DataFrame] = {}
    for name, width in WINDOWS.items():
        step(f"per-tube metrics per {name}")
        df = windowed(jobs, attempts, width, accuracy, end_ns)
        _write(df, f"{out}/tube_{name}")
        tables[name] = _read(spark, f"{out}/tube_{name}", df)
    step("per-tube summary")
    summary_df = tube_summary(jobs, attempts, tables["minute"], accuracy)
    rows = summary_df.collect()
    orphans = sum(r["jobs"] for r in rows if r["tube"] is None)
    rows = sorted((r for r in rows if r["tube"] is not None), key=lambda r: r["tube"])
    _write(spark.createDataFrame(rows, summary_df.schema), f"{out}/tube_summary",
           partitioned=False)
    _write(spark.createDataFrame(server_rows, servers_df.schema), f"{out}/servers",
           partitioned=False)
    return {"servers": servers, "tubes": [r.asDict(recursive=True) for r in rows],
            "orphan_jobs": orphans, "end_ns": end_ns}


def series(spark: SparkSession, out: Path | str, width: str) -> dict[str, list[dict[str, Any]]]:
    """Per tube, the window rows the report charts (a small aggregate)."""
    keep = ["tube", "window_ns", "puts", "deletes", "reserves", "timeouts", "backlog", *STATE_NAMES,
            "wait_p50_ms", "wait_p95_ms", "wait_p99_ms", "run_p50_ms", "run_p95_ms", "run_p99_ms"]
    infer = "spark.sql.sources.partitionColumnTypeInference.enabled"
    before = spark.conf.get(infer, "true")
    spark.conf.set(infer, "false")  # tube names stay strings ("007" is not 7)
    try:
        df = spark.read.parquet(f"{str(out).rstrip('/')}/tube_{width}")
        rows = _rows(df.select(*keep).orderBy("tube", "window_ns"))
    finally:
        spark.conf.set(infer, before)
    by_tube: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_tube.setdefault(str(r.pop("tube")), []).append(r)
    return by_tube
