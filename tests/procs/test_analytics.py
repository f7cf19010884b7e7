"""The Spark analytics pipeline (`smallstalk analyze`) on AOFs from real server runs.

A scripted workload with known answers (tests/support/analytics_script.py:
five data directories made by real `smallstalk serve` processes, with
timeouts, releases, burials, kicks, lost connections, a restart, compaction
into a snapshot, fanout, expiry and a dead-letter tube, keyed puts, job
policies' requeues, move-job and a schedule) is analyzed once per
session, in-process through `main` (the cluster test compares its own run
with the same one). The outputs are checked three ways:
exact counts from the script; every lifecycle, attempt, window and summary
figure against a plain-Python pass that replays the same files through the
project's own `State` and watches each job's state change; and the gross
timing the script guarantees (delays, TTRs and a held job take at least a
second by the server's clock), which does not depend on scheduling.
"""

from __future__ import annotations

import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

import pyarrow as pa  # noqa: E402
import pyarrow.dataset as ds  # noqa: E402

from smallstalk.core import records as r  # noqa: E402
from smallstalk.core.model import NS  # noqa: E402
from smallstalk.storage import aof, logread  # noqa: E402

from ..support.analytics_script import (  # noqa: E402
    LATENCY_KEYS,
    STATES,
    latencies,
    percentiles,
    reference_windows,
)

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="Spark needs Java")
# The first test also waits for the scripted workload and the JVM (3 min on a busy machine).
pytestmark = pytest.mark.timeout(900)


# The scripted workload, its reference and its one run: tests/support/analytics_script.py,
# made once per session (the cluster test compares with the same run).


@pytest.fixture
def workload(analytics_workload) -> dict[str, Any]:
    return analytics_workload


@pytest.fixture
def spark(analytics_spark) -> Any:
    return analytics_spark


@pytest.fixture
def analyzed(analytics_run) -> dict[str, Any]:
    return analytics_run


def table(out: Path, name: str) -> list[dict[str, Any]]:
    """A written table, read with pyarrow (tube/day partitions as strings)."""
    part = ds.partitioning(pa.schema([("tube", pa.string()), ("day", pa.string())]),
                           flavor="hive")
    return ds.dataset(out / name, format="parquet", partitioning=part).to_table().to_pylist()


def spark_jobs(analyzed) -> dict[tuple[str, int], dict[str, Any]]:
    return {(j["server"], j["id"]): j for j in table(analyzed["out"], "jobs")}


# --- tests: known answers -------------------------------------------------------------------


@needs_java
def test_known_answers_from_the_script(analyzed, workload) -> None:
    jobs = spark_jobs(analyzed)
    g = workload["groups"]

    def job(i: int, server: str = "alpha") -> dict[str, Any]:
        return jobs[(server, i)]

    alpha = [j for (s, _i), j in jobs.items() if s == "alpha"]
    assert len(alpha) == 1000
    by_tube = {t: [j for j in alpha if j["tube"] == t] for t in ("emails", "images")}
    assert {t: len(v) for t, v in by_tube.items()} == {"emails": 600, "images": 400}

    def total(tube: str, key: str) -> int:
        return sum(j[key] for j in by_tube[tube])

    expected = {
        "emails": dict(reserves=693, releases=60, buries=30, timeouts=20, kicks=20, touches=0,
                       implicit_releases=8),
        "images": dict(reserves=410, releases=0, buries=0, timeouts=20, kicks=10, touches=10,
                       implicit_releases=0),
    }
    for tube, want in expected.items():
        assert {k: total(tube, k) for k in want} == want, tube
    assert sum(j["reserves"] > 1 for j in by_tube["emails"]) == 108
    assert sum(j["reserves"] > 1 for j in by_tube["images"]) == 20
    finals = {t: sorted({(j["state"], sum(x["state"] == j["state"] for x in v)) for j in v})
              for t, v in by_tube.items()}
    assert finals == {"emails": [("buried", 10), ("deleted", 575), ("ready", 15)],
                      "images": [("delayed", 10), ("deleted", 390)]}
    assert all(j["origin"] == "put" for j in alpha)
    epoch = datetime(1970, 1, 1, tzinfo=UTC)  # Parquet timestamps are UTC instants

    def micros(t: datetime) -> int:
        return (t.replace(tzinfo=t.tzinfo or UTC) - epoch) // timedelta(microseconds=1)

    assert all(micros(j["put_at"]) == j["put_ns"] // 1000 for j in alpha)
    # Implicit releases: the Disconnect and the Restart, with the connection that held the job.
    for i in g["e_disconnect"]:
        ops = [e["op"] for e in job(i)["events"]]
        assert ops == ["put", "reserve", "disconnect", "reserve", "delete"]
        assert [a["outcome"] for a in job(i)["attempts"]] == ["disconnect", "delete"]
    for i in g["e_restart"]:
        assert [e["op"] for e in job(i)["events"]] == ["put", "reserve", "restart", "reserve",
                                                       "delete"]
        ev = job(i)["events"]
        assert ev[2]["conn"] == ev[1]["conn"] and ev[2]["to_state"] == "ready"
    for i in g["e_timeout"] + g["i_timeout"]:
        assert [a["outcome"] for a in job(i)["attempts"]] == ["timeout", "delete"]
    for i in g["e_bury_kick"]:
        assert [e["op"] for e in job(i)["events"]] == ["put", "reserve", "bury", "kick",
                                                       "reserve", "delete"]
    for i in g["i_delay"]:
        assert [e["op"] for e in job(i)["events"]] == ["put", "promote", "reserve", "delete"]
    assert [e["op"] for e in job(g["i_touch"][0])["events"]] == ["put", "reserve", "touch",
                                                                 "delete"]

    # beta: b_gone was deleted before the snapshot, so it is not in the data at all.
    beta = {i: j for (s, i), j in jobs.items() if s == "beta"}
    assert not set(g["b_gone"]) & set(beta)
    assert len(beta) == 60
    assert {i for i, j in beta.items() if j["origin"] == "snapshot"} == set(
        g["b_kick"] + g["b_buried"] + g["b_held"] + g["b_released"] + g["b_ready_done"]
        + g["b_ready"] + g["r_done"] + g["r_delayed"])
    assert {i for i, j in beta.items() if j["origin"] == "put"} == set(g["b_new"])
    for i in g["b_held"]:  # reserved in the snapshot, freed by the Restart
        assert [e["op"] for e in beta[i]["events"]] == ["snapshot", "restart", "reserve",
                                                        "delete"]
        assert beta[i]["reserves"] == 2 and beta[i]["implicit_releases"] == 1
        assert beta[i]["first_reserve_ns"] is None  # the first one is before the snapshot
    for i in g["b_ready_done"]:  # ready since its put: the wait is known
        (a,) = beta[i]["attempts"]
        assert a["wait_ns"] == a["time"] - beta[i]["put_ns"]
    for i in g["b_released"]:  # released before the snapshot: when is unknown
        assert [a["wait_ns"] for a in beta[i]["attempts"]] == [None]
    assert {beta[i]["state"] for i in g["b_buried"]} == {"buried"}
    assert {beta[i]["state"] for i in g["r_delayed"]} == {"delayed"}
    assert {beta[i]["kicks"] for i in g["b_kick"]} == {1}
    assert not [j for j in jobs.values() if j["origin"] == "orphan"]


@needs_java
def test_known_answers_of_big_tubes(analyzed, workload) -> None:
    """epsilon: fanout copies, a discard, an expiry that deletes and two that move a job,
    and keyed puts (put-unique: its jobs are puts like any other, a repeat is nothing)."""
    jobs = {i: j for (s, i), j in spark_jobs(analyzed).items() if s == "epsilon"}
    g = workload["groups"]
    ticks = [j for j in jobs.values() if j["tube"] == "ticks"]  # a firing a second, while none waits
    assert len(jobs) - len(ticks) == 4 + 3 + 1 + 2 + 2 + 2 + 6  # orders, copies, sessions,
    # invoices, junk, keyed; the job policies' and triage's (test_known_answers_of_policies)
    assert {jobs[i]["tube"] for i in g["o_copies"]} == {"orders+audit"}
    assert {jobs[i]["origin"] for i in g["o_copies"]} == {"put"}
    (gone,) = g["o_discarded"]
    assert [e["op"] for e in jobs[gone]["events"]] == ["put", "discard"]
    assert jobs[gone]["state"] == "discarded" and jobs[gone]["discarded_ns"] is not None
    (s,) = g["s_expired"]
    assert [(e["op"], e["to_state"]) for e in jobs[s]["events"]] == [
        ("put", "ready"), ("expire", "expired")]
    assert jobs[s]["expiries"] == 1 and jobs[s]["expired_ns"] - jobs[s]["put_ns"] >= NS
    done_id, waiting = g["i_moved"]
    ev = jobs[done_id]["events"]
    assert [(e["op"], e["tube"], e["to_tube"]) for e in ev] == [
        ("put", "invoices", None), ("move", "invoices", "dead"), ("reserve", "dead", None),
        ("delete", "dead", None)]
    assert (jobs[done_id]["tube"], jobs[done_id]["last_tube"], jobs[done_id]["state"]) == (
        "invoices", "dead", "deleted")
    (a,) = jobs[done_id]["attempts"]
    assert a["tube"] == "dead" and a["wait_ns"] == a["time"] - ev[1]["time"]  # since the move
    assert (jobs[waiting]["state"], jobs[waiting]["last_tube"]) == ("ready", "dead")
    for flushed in g["f_flushed"]:  # flush-tube: a delete of each job it names
        assert [e["op"] for e in jobs[flushed]["events"]] == ["put", "delete"]
        assert jobs[flushed]["state"] == "deleted"
    (kd,), (kr,) = g["k_done"], g["k_ready"]
    assert [(e["op"], e["tube"]) for e in jobs[kd]["events"]] == [
        ("put", "keyed"), ("reserve", "keyed"), ("delete", "keyed")]
    assert (jobs[kd]["origin"], jobs[kd]["tube"], jobs[kd]["state"]) == ("put", "keyed", "deleted")
    assert (jobs[kr]["origin"], jobs[kr]["state"], len(jobs[kr]["events"])) == ("put", "ready", 1)
    summary = {t["tube"]: t for t in analyzed["summary"]["tubes"]}
    assert (summary["keyed"]["jobs"], summary["keyed"]["deleted"]) == (2, 1)
    assert (summary["junk"]["jobs"], summary["junk"]["deleted"]) == (2, 2)
    assert (summary["orders"]["jobs"], summary["orders"]["discarded"]) == (4, 1)
    assert (summary["sessions"]["expired"], summary["invoices"]["expiries"]) == (1, 2)
    assert (summary["dead"]["jobs"], summary["dead"]["attempts"]) == (0, 1)
    minutes = table(analyzed["out"], "tube_minute")
    assert sum(w["expiries"] for w in minutes if w["tube"] == "invoices") == 2
    assert sum(w["moves_in"] for w in minutes if w["tube"] == "dead") == 2
    dead = sorted((w for w in minutes if w["tube"] == "dead"), key=lambda w: w["window_ns"])
    assert (dead[-1]["backlog"], dead[-1]["ready"]) == (1, 1)


@needs_java
def test_known_answers_of_policies(analyzed, workload) -> None:
    """epsilon: a tube policy's requeues (each cause; back-off, bury and dead-letter outcomes),
    triage's move-job, and a schedule's job: each a step in its job's story."""
    jobs = {i: j for (s, i), j in spark_jobs(analyzed).items() if s == "epsilon"}
    g = workload["groups"]

    def story(key: str) -> list[tuple[str, str, str, str | None]]:
        (i,) = g[key]
        return [(e["op"], e["to_state"], e["tube"], e["to_tube"]) for e in jobs[i]["events"]]

    def figures(key: str) -> tuple:
        (i,) = g[key]
        j = jobs[i]
        return (j["reserves"], j["releases"], j["buries"], j["timeouts"], j["implicit_releases"],
                j["state"], j["last_tube"])

    assert story("q_buried") == [  # the release-backoff's delay, then max-reserves 2
        ("put", "ready", "retry", None), ("reserve", "reserved", "retry", None),
        ("release", "delayed", "retry", None), ("promote", "ready", "retry", None),
        ("reserve", "reserved", "retry", None), ("release", "buried", "retry", None)]
    assert figures("q_buried") == (2, 2, 1, 0, 0, "buried", "retry")
    (qb,) = g["q_buried"]
    backoff = jobs[qb]["events"][3]["time"] - jobs[qb]["events"][2]["time"]
    assert backoff >= NS  # 1 s for the first release
    assert [a["outcome"] for a in jobs[qb]["attempts"]] == ["release", "release"]
    assert story("q_timeout") == [
        ("put", "ready", "retry", None), ("reserve", "reserved", "retry", None),
        ("timeout", "ready", "retry", None), ("reserve", "reserved", "retry", None),
        ("delete", "deleted", "retry", None)]
    assert figures("q_timeout") == (2, 0, 0, 1, 0, "deleted", "retry")
    (qt,) = g["q_timeout"]
    assert jobs[qt]["events"][2]["conn"] is None  # the server's timer, not a connection
    assert story("d_released") == [
        ("put", "ready", "payments", None), ("reserve", "reserved", "payments", None),
        ("release", "ready", "payments", "payments-dead")]
    assert figures("d_released") == (1, 1, 0, 0, 0, "ready", "payments-dead")
    assert story("d_dropped") == [
        ("put", "ready", "payments", None), ("reserve", "reserved", "payments", None),
        ("disconnect", "ready", "payments", "payments-dead"),
        ("reserve", "reserved", "payments-dead", None),
        ("delete", "deleted", "payments-dead", None)]
    assert figures("d_dropped") == (2, 0, 0, 0, 1, "deleted", "payments-dead")
    assert story("m_ready") == [("put", "ready", "triage", None),
                                ("move-job", "ready", "triage", "moved")]
    assert story("m_buried") == [
        ("put", "ready", "triage", None), ("reserve", "reserved", "triage", None),
        ("bury", "buried", "triage", None), ("move-job", "buried", "triage", "moved")]
    assert figures("m_buried") == (1, 0, 1, 0, 0, "buried", "moved")
    (td,) = g["t_done"]
    assert story("t_done") == [("put", "ready", "ticks", None),
                               ("reserve", "reserved", "ticks", None),
                               ("delete", "deleted", "ticks", None)]
    assert (jobs[td]["origin"], jobs[td]["events"][0]["conn"]) == ("put", None)
    assert analyzed["summary"]["orphan_jobs"] == 0
    summary = {t["tube"]: t for t in analyzed["summary"]["tubes"]}
    assert (summary["retry"]["buries"], summary["retry"]["timeouts"]) == (1, 1)
    assert (summary["payments"]["jobs"], summary["payments-dead"]["jobs"]) == (2, 0)
    assert (summary["payments-dead"]["attempts"], summary["moved"]["attempts"]) == (1, 0)
    minutes = table(analyzed["out"], "tube_minute")

    def total(tube: str, key: str) -> int:
        return sum(w[key] for w in minutes if w["tube"] == tube)

    assert (total("payments-dead", "moves_in"), total("moved", "moves_in")) == (2, 2)
    assert (total("retry", "buries"), total("retry", "releases")) == (1, 2)
    assert total("payments", "implicit_releases") == 1
    moved = max((w for w in minutes if w["tube"] == "moved"), key=lambda w: w["window_ns"])
    assert (moved["backlog"], moved["ready"], moved["buried"]) == (2, 1, 1)


@needs_java
def test_gross_timing_the_script_guarantees(analyzed, workload) -> None:
    """Delays, TTRs and the held jobs take at least a second by the server's clock."""
    jobs = spark_jobs(analyzed)
    g = workload["groups"]
    for i in g["i_delay"]:  # put with delay 1: promoted no sooner than a second later
        assert jobs[("alpha", i)]["first_wait_ns"] >= NS
    for i in g["e_timeout"] + g["i_timeout"]:  # TTR 1: timed out no sooner
        assert jobs[("alpha", i)]["attempts"][0]["run_ns"] >= NS
    for i in g["e_held"]:  # deleted after a 1.1s sleep
        assert jobs[("alpha", i)]["attempts"][0]["run_ns"] >= NS
    for i in g["e_release_delay"]:  # released with delay 1
        first, second = jobs[("alpha", i)]["attempts"]
        assert second["time"] - first["end_ns"] >= NS
        assert second["wait_ns"] < second["time"] - first["end_ns"]  # waits from the promote
    summary = {t["tube"]: t for t in analyzed["summary"]["tubes"]}
    # images: 280 of 410 first reserves came after a 1s delay -> p50 of first_wait >= 1s
    assert summary["images"]["first_wait_p50_ms"] >= 1000
    # emails: 20 of 575 deletes ran > 1s (3.5% > 1%) -> run p99 >= 1s; most ran quickly
    assert summary["emails"]["run_p99_ms"] >= 1000


# --- tests: against the plain-Python pass -------------------------------------------------------


@needs_java
def test_every_lifecycle_matches_the_reference(analyzed, workload) -> None:
    jobs = spark_jobs(analyzed)
    ref = workload["ref"]
    assert set(jobs) == set(ref)
    for key, want in ref.items():
        got = jobs[key]
        assert got["origin"] == want["origin"], key
        assert (got["tube"], got["put_ns"], got["state"], got["deleted_ns"],
                got["first_reserve_ns"]) == (want["tube"], want["put_ns"], want["state"],
                                             want["deleted_ns"], want["first_reserve_ns"]), key
        assert (got["expired_ns"], got["discarded_ns"], got["expiries"], got["last_tube"]) == (
            want["expired_ns"], want["discarded_ns"], want["expiries"], want["last_tube"]), key
        c = want["counts"]
        assert (got["reserves"], got["releases"], got["buries"], got["timeouts"], got["kicks"],
                got["touches"], got["implicit_releases"]) == (
            c["reserve"], c["release"], c["bury"], c["timeout"], c["kick"], want["touches"],
            want["implicit"]), key
        events = [(e["seq"], e["time"], e["op"], e["conn"], e["from_state"], e["to_state"])
                  for e in got["events"]]
        assert events == want["events"], key
        assert [(e["tube"], e["to_tube"]) for e in got["events"]] == want["tubes"], key
        keys = ("n", "seq", "time", "conn", "from_state", "wait_ns", "end_seq", "end_ns",
                "outcome", "run_ns", "tube")
        assert [{k: a[k] for k in keys} for a in got["attempts"]] == want["attempts"], key
    # gamma (snapshot + the segments it covers) reads like delta (segments only)
    for (server, i), j in jobs.items():
        if server == "gamma":
            twin = jobs[("delta", i)]
            assert {k: v for k, v in j.items() if k != "server"} == {
                k: v for k, v in twin.items() if k != "server"}


@needs_java
def test_attempts_table_is_the_exploded_lifecycles(analyzed) -> None:
    jobs = spark_jobs(analyzed)
    attempts = table(analyzed["out"], "attempts")
    assert len(attempts) == sum(len(j["attempts"]) for j in jobs.values())
    for a in attempts:
        j = jobs[(a["server"], a["id"])]
        (same,) = [x for x in j["attempts"] if x["n"] == a["n"]]
        assert (a["reserve_ns"], a["outcome"], a["run_ns"], a["wait_ns"]) == (
            same["time"], same["outcome"], same["run_ns"], same["wait_ns"])
        assert a["first_wait_ns"] == (a["reserve_ns"] - j["put_ns"] if a["n"] == 1 else None)
        assert a["tube"] == same["tube"]  # the tube it was reserved from


@needs_java
@pytest.mark.parametrize("width, name", [(60 * NS, "minute"), (3600 * NS, "hour")])
def test_windows_match_the_reference(analyzed, workload, width, name) -> None:
    want = reference_windows(workload["ref"], width, workload["end"])
    got = {(w["tube"], w["window_ns"]): w for w in table(analyzed["out"], f"tube_{name}")}
    assert set(got) == set(want)
    for key, row in want.items():
        assert {k: got[key][k] for k in row} == pytest.approx(row), key
        day = time.strftime("%Y-%m-%d", time.gmtime(key[1] // NS))
        assert got[key]["day"] == day


@needs_java
def test_tube_summary_matches_the_reference(analyzed, workload) -> None:
    ref = workload["ref"]
    minutes = reference_windows(ref, 60 * NS, workload["end"])
    got = {t["tube"]: t for t in analyzed["summary"]["tubes"]}
    assert set(got) == {"emails", "images", "reports", "orders", "orders+audit", "sessions",
                        "invoices", "dead", "junk", "keyed", "retry", "payments",
                        "payments-dead", "triage", "moved", "ticks"}
    for tube, s in got.items():
        jobs = [j for j in ref.values() if j["tube"] == tube]  # by the tube put into
        # attempt figures by the tube reserved from
        reserved = [dict(j, attempts=[a]) for j in ref.values() for a in j["attempts"]
                    if a["tube"] == tube]
        lat = latencies(reserved)
        want = dict(
            jobs=len(jobs), puts=sum(j["origin"] == "put" for j in jobs),
            from_snapshot=sum(j["origin"] == "snapshot" for j in jobs),
            deleted=sum(j["state"] == "deleted" for j in jobs),
            expired=sum(j["state"] == "expired" for j in jobs),
            discarded=sum(j["state"] == "discarded" for j in jobs),
            open=sum(j["state"] not in ("deleted", "expired", "discarded") for j in jobs),
            expiries=sum(j["expiries"] for j in jobs),
            reserves=sum(j["counts"]["reserve"] for j in jobs),
            timeouts=sum(j["counts"]["timeout"] for j in jobs),
            releases=sum(j["counts"]["release"] for j in jobs),
            buries=sum(j["counts"]["bury"] for j in jobs),
            reserved_more_than_once=sum(j["counts"]["reserve"] > 1 for j in jobs),
            attempts=len(reserved),
            max_backlog=max(w["backlog"] for (t, _w), w in minutes.items() if t == tube),
            max_ready=max(w["ready"] for (t, _w), w in minutes.items() if t == tube),
            **{f"open_{st}": sum(j["state"] == st for j in jobs) for st in STATES},
            **{k: v for name in LATENCY_KEYS for k, v in percentiles(name, lat[name]).items()},
            **percentiles("latency", [j["deleted_ns"] - j["put_ns"] for j in jobs
                                      if j["deleted_ns"] is not None]),
        )
        assert {k: s[k] for k in want} == pytest.approx(want), tube
        if want["reserves"]:
            assert s["timeouts_rate"] == pytest.approx(want["timeouts"] / want["reserves"])
    servers = {s["server"]: s for s in analyzed["summary"]["servers"]}
    assert set(servers) == {"alpha", "beta", "gamma", "delta", "epsilon"}
    assert servers["alpha"]["missing"] == 0 and servers["alpha"]["restarts"] == 2
    assert servers["beta"]["snapshot_jobs"] == 50 and servers["delta"]["snapshot_jobs"] == 0


@needs_java
def test_data_source_reads_every_record(spark, workload) -> None:
    """spark.read.format("smallstalk") = a plain walk of the segments, bodies on request."""
    from smallstalk.analytics.command import register

    register(spark)
    alpha = workload["dirs"]["alpha"]
    df = (spark.read.format("smallstalk").option("bodies", "true")
          .option("partitionBytes", "4096").load(str(alpha)))
    rows = {x["seq"]: x for x in df.select("seq", "op", "id", "body", "server").collect()}
    plain = {}
    for _first, path in aof.list_segments(alpha / "aof"):
        for entry in logread.iter_segment(path):
            if not isinstance(entry, aof.FrameScan):
                plain[entry[1].seq] = entry[1]
    assert set(rows) == set(plain)
    for seq, rec in plain.items():
        assert rows[seq]["op"] == r.OP_NAMES[type(rec)]
        assert rows[seq]["server"] == "alpha"
        if isinstance(rec, r.Put):
            assert (rows[seq]["id"], rows[seq]["body"]) == (rec.id, rec.body)
    assert "body" not in spark.read.format("smallstalk").load(str(alpha)).columns


# --- tests: what a person sees --------------------------------------------------------------


@needs_java
def test_printed_summary_and_html_report(analyzed) -> None:
    text = analyzed["stdout"]
    emails = next(line for line in text.splitlines() if line.startswith("emails "))
    s = {t["tube"]: t for t in analyzed["summary"]["tubes"]}["emails"]
    assert emails.split()[1:5] == [f"{s['jobs']:,}", f"{s['deleted']:,}", f"{s['open']:,}",
                                   f"{s['reserves']:,}"]
    assert "alpha" in text and "wait p50" in text
    assert "reading and decoding" in analyzed["stderr"]  # progress
    page = analyzed["html"]
    # Four charts per tube (backlog, wait, run, throughput); a tube nobody reserved from
    # (sessions and invoices: their jobs expired first; junk: flushed; moved: only
    # moved into) has no wait or run chart, one where no reservation ended in a delete
    # (payments, triage) no run chart, and the throughput chart leaves out the window the
    # data ends inside: a tube whose events all fall in that window has none.
    tubes = analyzed["summary"]["tubes"]
    assert len(tubes) == 16 and sum(t["attempts"] == 0 for t in tubes) == 4
    assert {t["tube"] for t in tubes if t["attempts"] and t["run_p50_ms"] is None} == {
        "payments", "triage"}
    throughput = page.count("<figcaption>Throughput per")
    assert throughput + page.count("no complete minute yet") == len(tubes)
    charts = sum(1 + (t["attempts"] > 0) + (t["run_p50_ms"] is not None) for t in tubes)
    assert page.count("<svg") == charts + throughput
    for forbidden in ("<script", "http://", "https://", "<link", "src="):
        assert forbidden not in page
    assert "Tube emails" in page and "Backlog" in page and "Queue wait" in page
