"""The analytics tests' scripted workload with known answers, its plain-Python
reference, and its one in-process `smallstalk analyze` run, made once per
session (tests/procs/conftest.py): tests/procs/test_analytics.py checks the
run against the script and the reference, and test_analytics_cluster.py
checks a cluster run of the same input against it, row for row.

The script (real `smallstalk serve` processes):

- `alpha` (no compaction, every record kept): 1,000 jobs in two tubes. In
  `emails` (600): 20 with TTR 1s time out and are reserved again; 50 are
  released and 10 released with a 1s delay, then reserved again; 30 are
  buried, 20 of those kicked and done, 10 stay buried; 5 are lost by a
  connection that closes (Disconnect) and 3 by a server restart (Restart),
  then reserved again; 20 are held for more than a second; 15 are never
  reserved. In `images` (400): 20 time out; 10 are touched; 280 are put with
  a 1s delay; 10 are put with a long delay and kicked; 10 stay delayed.
- `beta`: a first run, then compaction folds every segment into a snapshot
  and deletes them, then a second run: its older jobs are known only from
  the snapshot (reserved ones lose their reservation to the Restart).
- `gamma` / `delta`: beta's first run as it was before compaction, with the
  snapshot and the covered segments both present (gamma) and with segments
  only (delta): the covered records must be used, so both give the same
  lifecycles.
- `epsilon` (big tubes, tube policies from a --config file): puts into
  `orders` are copied into the fanout tube `orders+audit` until a
  delete-tube, and the full `orders` (2 jobs) discards its oldest; a job put
  with a max-age of 1s into `sessions` expires and is deleted; two put into
  `invoices` (max-age 1s) expire into the dead-letter tube `dead`, where one
  is reserved and deleted.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from smallstalk.core import records as r
from smallstalk.core.model import STATE_NAMES
from smallstalk.core.state import RESERVED, State
from smallstalk.storage import aof, compactor, logread, snapshot

from .bsclient import Client, Reply, connect, put_cmd
from .procs import start_smallstalk

SERVERS = ("alpha", "beta", "gamma", "delta", "epsilon")


# --- the scripted workload --------------------------------------------------------------


def wait_until(cond: Callable[[], object], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def run(c: Client, cmds: list[bytes], status: bytes | tuple[bytes, ...]) -> list[Reply]:
    """Pipeline `cmds`; every reply must have `status` (or one of several, in turn)."""
    replies = c.pipeline(cmds)
    want = status if isinstance(status, tuple) else (status,)
    for i, reply in enumerate(replies):
        assert reply.status == want[i % len(want)], (cmds[i], reply)
    return replies


def puts(c: Client, n: int, *, delay: int = 0, ttr: int = 60, pri: int = 100) -> list[int]:
    return [x.id for x in run(c, [put_cmd(b"job-%d" % i, pri, delay, ttr) for i in range(n)],
                              b"INSERTED")]


def reserve(c: Client, ids: list[int]) -> None:
    run(c, [b"reserve-job %d\r\n" % i for i in ids], b"RESERVED")


def then(c: Client, ids: list[int], cmd: bytes, status: bytes) -> None:
    """reserve-job each id, then `cmd % id` (pipelined pairs)."""
    cmds = [x for i in ids for x in (b"reserve-job %d\r\n" % i, cmd % i)]
    run(c, cmds, (b"RESERVED", status))


def done(c: Client, ids: list[int]) -> None:
    then(c, ids, b"delete %d\r\n", b"DELETED")


def states(c: Client, ids: list[int]) -> set[str]:
    replies = c.pipeline([b"stats-job %d\r\n" % i for i in ids])
    return {x.yaml()["state"] for x in replies}


def script_alpha(tmp: Path, data: Path) -> dict[str, list[int]]:
    """1,000 jobs; returns the ids of each group, by what the script did to them."""
    srv = start_smallstalk(tmp, "--no-compact", "--segment-records", "200", data_dir=data)
    g: dict[str, list[int]] = {}
    try:
        with connect(srv.port) as p, connect(srv.port) as w, connect(srv.port) as w2:
            run(p, [b"use emails\r\n"], b"USING")
            e = puts(p, 20, ttr=1) + puts(p, 580)
            run(p, [b"use images\r\n"], b"USING")
            i = puts(p, 20, ttr=1) + puts(p, 80) + puts(p, 280, delay=1) + puts(p, 20, delay=3600)
            g.update(e_timeout=e[0:20], e_release=e[20:70], e_bury_kick=e[70:90],
                     e_buried=e[90:100], e_disconnect=e[100:105], e_restart=e[105:108],
                     e_ready=e[108:123], e_held=e[123:143], e_release_delay=e[143:153],
                     e_plain=e[153:600], i_timeout=i[0:20], i_touch=i[20:30], i_plain=i[30:100],
                     i_delay=i[100:380], i_kick=i[380:390], i_delayed=i[390:400],
                     emails=e, images=i)
            reserve(w, g["e_timeout"] + g["i_timeout"])  # TTR 1s: these time out
            then(w, g["e_release"], b"release %d 100 0\r\n", b"RELEASED")
            then(w, g["e_release_delay"], b"release %d 100 1\r\n", b"RELEASED")
            then(w, g["e_bury_kick"] + g["e_buried"], b"bury %d 100\r\n", b"BURIED")
            reserve(w2, g["e_disconnect"])
            w2.close()  # Disconnect: the five go back to ready
            run(w, [b"kick-job %d\r\n" % x for x in g["i_kick"]], b"KICKED")
            reserve(w, g["e_held"])
            held_since = time.monotonic()
            then(w, g["i_touch"], b"touch %d\r\n", b"TOUCHED")
            run(w, [b"delete %d\r\n" % x for x in g["i_touch"]], b"DELETED")
            done(w, g["i_plain"] + g["i_kick"])
            run(w, [b"kick-job %d\r\n" % x for x in g["e_bury_kick"]], b"KICKED")
            done(w, g["e_bury_kick"] + g["e_plain"] + g["e_release"])
            wait_until(lambda: states(w, g["e_disconnect"]) == {"ready"}, "the disconnect")
            done(w, g["e_disconnect"])
            time.sleep(max(0.0, held_since + 1.1 - time.monotonic()))
            run(w, [b"delete %d\r\n" % x for x in g["e_held"]], b"DELETED")
            back = g["e_timeout"] + g["i_timeout"] + g["i_delay"] + g["e_release_delay"]
            wait_until(lambda: states(w, back) == {"ready"}, "timeouts and promotions")
            done(w, back)
            with connect(srv.port) as w3:
                reserve(w3, g["e_restart"])
                srv.stop()  # SIGTERM logs nothing; the next start logs Restart
        srv = start_smallstalk(tmp, "--no-compact", "--segment-records", "200", data_dir=data)
        with connect(srv.port) as w:
            done(w, g["e_restart"])
    finally:
        srv.stop()
    return g


EPSILON_CONFIG = """\
[tubes.orders]
max-jobs = 2
discard-old-when-full = true

[tubes.invoices]
max-age = 1
expire-to = "dead"

[tubes.retry]
max-reserves = 2
release-backoff = "1s..1m"

[tubes.payments]
max-reserves = 1
dead-letter = "payments-dead"

[[schedules]]
name = "tick"
tube = "ticks"
cron = "* * * * * *"
skip-if-pending = true
"""


def script_epsilon(tmp: Path, data: Path) -> dict[str, list[int]]:
    config = tmp / "epsilon.toml"
    config.write_text(EPSILON_CONFIG)
    srv = start_smallstalk(tmp, "--no-compact", "--config", str(config), data_dir=data)
    g: dict[str, list[int]] = {}
    try:
        with connect(srv.port) as p, connect(srv.port) as w:
            run(p, [b"use orders+audit\r\n", b"use orders\r\n"], b"USING")
            o = puts(p, 3)  # each: the orders job, and its copy in orders+audit (id + 1)
            g.update(o_discarded=o[:1], o_done=o[1:2], o_ready=o[2:3],
                     o_copies=[i + 1 for i in o])
            done(w, [o[1], o[1] + 1])  # an orders job and a copy, in their own tubes
            run(p, [b"delete-tube orders+audit\r\n"], b"DELETED")
            g["o_uncopied"] = puts(p, 1)  # no copy now; orders has room (one job)
            run(p, [b"use sessions\r\n"], b"USING")
            body = b"session"
            g["s_expired"] = [x.id for x in run(
                p, [put_cmd(body, pri=100, max_age=1)], b"INSERTED")]
            run(p, [b"use invoices\r\n"], b"USING")
            g["i_moved"] = puts(p, 2)
            policies(srv.port, p, w, g)  # its waits overlap the expiries'

            def expired() -> bool:
                return (w.stats_job(g["s_expired"][0]) is None
                        and {w.stats_job(i)["tube"] for i in g["i_moved"]} == {"dead"})

            wait_until(expired, "the expiries")
            done(w, g["i_moved"][:1])  # its life goes on in the dead-letter tube
            run(p, [b"use junk\r\n"], b"USING")
            g["f_flushed"] = puts(p, 2)
            run(p, [b"flush-tube junk\r\n"], b"FLUSHED")  # one record deletes both
            run(p, [b"use keyed\r\n"], b"USING")
            k = run(p, [b"put-unique order-1 100 0 60 3\r\nk-1\r\n",
                        b"put-unique order-1 100 0 60 3\r\nk-1\r\n",  # a repeat: no record
                        b"put-unique order-2 100 0 60 3\r\nk-2\r\n"],
                    (b"INSERTED", b"DUPLICATE", b"INSERTED"))
            g["k_done"], g["k_ready"] = [k[0].id], [k[2].id]
            done(w, g["k_done"])
            run(p, [b"use ticks\r\n"], b"USING")  # the schedule's job, made by the server
            wait_until(lambda: p.call(b"peek-ready\r\n").status == b"FOUND", "a firing")
            g["t_done"] = [p.call(b"peek-ready\r\n").id]
            done(w, g["t_done"])
    finally:
        srv.stop()
    return g


def policies(port: int, p: Client, w: Client, g: dict[str, list[int]]) -> None:
    """Job policies' requeues (each cause and outcome) and triage's move-job."""
    run(p, [b"use retry\r\n"], b"USING")
    g["q_buried"] = puts(p, 1)  # released: backed off a second; released again: buried
    g["q_timeout"] = puts(p, 1, ttr=1)  # its TTR runs out: ready again
    then(w, g["q_buried"], b"release %d 100 0\r\n", b"RELEASED")
    reserve(w, g["q_timeout"])
    run(p, [b"use payments\r\n"], b"USING")
    g["d_released"] = puts(p, 1)  # released at its one reserve: to payments-dead
    g["d_dropped"] = puts(p, 1)  # its worker's connection closes: to payments-dead too
    then(w, g["d_released"], b"release %d 100 0\r\n", b"RELEASED")
    with connect(port) as w2:
        reserve(w2, g["d_dropped"])
    run(p, [b"use triage\r\n"], b"USING")
    g["m_ready"], g["m_buried"] = puts(p, 1), puts(p, 1)
    then(w, g["m_buried"], b"bury %d 100\r\n", b"BURIED")
    run(w, [b"move-job %d moved\r\n" % i for i in g["m_ready"] + g["m_buried"]], b"MOVED")
    wait_until(lambda: states(w, g["q_buried"] + g["q_timeout"]) == {"ready"}, "the requeues")
    then(w, g["q_buried"], b"release %d 100 0\r\n", b"RELEASED")
    done(w, g["q_timeout"])
    wait_until(lambda: w.stats_job(g["d_dropped"][0])["tube"] == "payments-dead",
               "the dead-letter move")
    done(w, g["d_dropped"])


def script_beta(tmp: Path, data: Path, before_compaction: Path) -> dict[str, list[int]]:
    srv = start_smallstalk(tmp, "--no-compact", "--segment-records", "20", data_dir=data)
    g: dict[str, list[int]] = {}
    try:
        with connect(srv.port) as p, connect(srv.port) as w:
            run(p, [b"use emails\r\n"], b"USING")
            b = puts(p, 40)
            run(p, [b"use reports\r\n"], b"USING")
            rep = puts(p, 15) + puts(p, 5, delay=3600)
            g.update(b_gone=b[0:10], b_kick=b[10:13], b_buried=b[13:15], b_held=b[15:18],
                     b_released=b[18:20], b_ready_done=b[20:30], b_ready=b[30:40],
                     r_done=rep[0:15], r_delayed=rep[15:20])
            done(w, g["b_gone"])
            then(w, g["b_kick"] + g["b_buried"], b"bury %d 100\r\n", b"BURIED")
            then(w, g["b_released"], b"release %d 100 0\r\n", b"RELEASED")
            reserve(w, g["b_held"])
            srv.stop()
        shutil.copytree(data, before_compaction)
        # Fold every segment into a snapshot, as the compactor does, then delete them all.
        segments = [path for _first, path in aof.list_segments(data / "aof")]
        compactor.fold(data, segments)
        for path in segments:
            path.unlink()
        srv = start_smallstalk(tmp, "--no-compact", "--segment-records", "20", data_dir=data)
        with connect(srv.port) as p, connect(srv.port) as w:
            done(w, g["b_held"] + g["b_released"] + g["b_ready_done"] + g["r_done"])
            run(w, [b"kick-job %d\r\n" % x for x in g["b_kick"]], b"KICKED")
            done(w, g["b_kick"])
            run(p, [b"use emails\r\n"], b"USING")
            g["b_new"] = puts(p, 10)
            done(w, g["b_new"][:5])
    finally:
        srv.stop()
    return g


# --- the plain-Python reference -----------------------------------------------------------


def reference_jobs(data_dir: Path, server: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Every job's events, replayed through `State` (newest snapshot, then the records after it).

    Before and after each record, the state of each job it concerns is read from
    the State; Disconnect and Restart concern the jobs the connection(s) held.
    """
    snaps = aof.list_snapshots(data_dir / "snapshots")
    state = snapshot.load(snaps[-1][1]) if snaps else State()
    last = state.last_seq
    jobs: dict[int, dict[str, Any]] = {}
    for j in state.jobs.values():
        st = STATE_NAMES[j.state]
        known = st == "ready" and j.reserves == 0 and j.kicks == 0 and j.delay == 0
        jobs[j.id] = dict(
            origin="snapshot", tube=j.tube.name, put_ns=j.created, seed=j.reserves,
            counts=dict(reserve=j.reserves, release=j.releases, bury=j.buries,
                        timeout=j.timeouts, kick=j.kicks),
            events=[(last, state.time, "snapshot", j.reserver if st == "reserved" else None,
                     None, st)],
            tubes=[(j.tube.name, None)], since=j.created if known else None)
    for _first, path in aof.list_segments(data_dir / "aof"):
        for entry in logread.iter_segment(path):
            if isinstance(entry, aof.FrameScan):
                break
            rec = entry[1]
            if rec.seq <= last:
                continue
            t = type(rec)
            if t is r.Disconnect:
                c = state.conns.get(rec.conn)
                ids, op = (sorted(c.reserved) if c else []), "disconnect"
            elif t is r.Restart:
                ids = sorted(j.id for j in state.jobs.values() if j.state == RESERVED)
                op = "restart"
            elif t in (r.Kick, r.Promote, r.Timeout):
                ids, op = list(rec.ids), r.OP_NAMES[t]
            elif t in (r.Put, r.Reserve, r.Delete, r.Release, r.Bury, r.Touch):
                ids, op = [rec.id], r.OP_NAMES[t]
            elif t in (r.PutJobs, r.PutUnique):  # a put per job made (copies too), the drops
                ids, op = [i for i, _tube in rec.jobs] + list(rec.dropped), "put"
            elif t is r.Expire:
                ids, op = [i for i, _to, _e in rec.moves], "expire"
            elif t is r.FlushTube:
                ids, op = list(rec.ids), "delete"
            elif t is r.Requeue:  # the cause is the event; where it went, the State says
                ids = [i for i, _until, _to, _why in rec.outcomes]
                op = {r.REQUEUE_TIMEOUT: "timeout", r.REQUEUE_RELEASE: "release",
                      r.REQUEUE_DISCONNECT: "disconnect"}[rec.cause]
            elif t is r.Fire:
                ids, op = ([rec.id] if rec.id else []), "put"
            elif t is r.Move:
                ids, op = [rec.id], "move-job"
            else:
                ids, op = [], ""
            before = {i: STATE_NAMES[state.jobs[i].state] for i in ids if i in state.jobs}
            holder = {i: state.jobs[i].reserver for i in ids if i in state.jobs}
            tube_before = {i: state.jobs[i].tube.name for i in ids if i in state.jobs}
            buries = {i: state.jobs[i].buries for i in ids if i in state.jobs}
            state.apply(rec)
            made = {}  # job id -> tube, for the jobs this record makes
            if t is r.Put:
                made = {rec.id: rec.tube}
            elif t in (r.PutJobs, r.PutUnique):
                made = dict(rec.jobs)
            elif t is r.Fire and rec.id:
                made = {rec.id: rec.tube}
            moved_to = {i: to for i, to, _e in rec.moves} if t is r.Expire else {}
            if t is r.Requeue or t is r.Move:  # the tube a job is in now, if it changed
                moved_to = {i: state.jobs[i].tube.name for i in ids
                            if state.jobs[i].tube.name != tube_before[i]}
            for i in ids:
                ev_op = op
                if t in (r.PutJobs, r.PutUnique) and i in rec.dropped:
                    ev_op = "discard"
                elif t is r.Expire and moved_to[i]:
                    ev_op = "move"
                gone = {"discard": "discarded", "expire": "expired"}.get(ev_op, "deleted")
                after = STATE_NAMES[state.jobs[i].state] if i in state.jobs else gone
                if i in made:
                    jobs[i] = dict(origin="put", tube=made[i], put_ns=rec.time, seed=0,
                                   counts=dict(reserve=0, release=0, bury=0, timeout=0, kick=0),
                                   events=[], tubes=[], since=None)
                conn = holder.get(i) if op in ("disconnect", "restart") else getattr(rec, "conn", None)
                if t is r.Requeue:
                    conn = None if rec.cause == r.REQUEUE_TIMEOUT else rec.conn
                    # a policy's bury at an attempt limit counts as a bury (the State's count)
                    jobs[i]["counts"]["bury"] += state.jobs[i].buries - buries[i]
                jobs[i]["events"].append((rec.seq, rec.time, ev_op, conn, before.get(i), after))
                # (the tube the event happens in, the tube a move takes the job to)
                jobs[i]["tubes"].append((tube_before.get(i, jobs[i]["tube"]),
                                         moved_to.get(i) or None))
    for job in jobs.values():
        since, current, n = job["since"], None, job["seed"]
        job["attempts"], job["touches"], job["implicit"] = [], 0, 0
        for seq, t, op, conn, frm, _to in job["events"]:
            if op == "snapshot":
                continue
            if op == "touch":
                job["touches"] += 1
                continue
            if op in job["counts"]:
                job["counts"][op] += 1
            job["implicit"] += op in ("disconnect", "restart")
            if current is not None:  # any state change ends the reservation
                current.update(end_seq=seq, end_ns=t, outcome=op, run_ns=t - current["time"])
                current = None
            if op == "reserve":
                n += 1
                current = dict(n=n, seq=seq, time=t, conn=conn, from_state=frm,
                               wait_ns=None if since is None else t - since,
                               end_seq=None, end_ns=None, outcome="open", run_ns=None)
                job["attempts"].append(current)
            since = t
        job["state"] = job["events"][-1][5]
        for op, key in (("delete", "deleted_ns"), ("expire", "expired_ns"),
                        ("discard", "discarded_ns")):
            ends = [e[1] for e in job["events"] if e[2] == op]
            job[key] = ends[-1] if ends else None
        job["expiries"] = sum(e[2] in ("expire", "move") for e in job["events"])
        job["last_tube"] = job["tubes"][-1][1] or job["tubes"][-1][0]
        tube_at = {e[0]: at for e, (at, _to) in zip(job["events"], job["tubes"], strict=True)}
        for a in job["attempts"]:  # the tube a reserve took the job from
            a["tube"] = tube_at[a["seq"]]
        first = [a["time"] for a in job["attempts"]]
        job["first_reserve_ns"] = min(first) if first and job["seed"] == 0 else None
    return {(server, i): j for i, j in jobs.items()}


def nearest_rank(values: list[int], q: float) -> float | None:
    """The smallest value with at least q of all values at or below it, in ms."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)] / 1e6


COUNTED = dict(puts="put", reserves="reserve", deletes="delete", releases="release",
               buries="bury", kicks="kick", timeouts="timeout", touches="touch",
               promotes="promote", discards="discard", moves_in="move-in")
STATES = ("ready", "delayed", "reserved", "buried")
LATENCY_KEYS = ("wait", "first_wait", "run")


def percentiles(prefix: str, values: list[int]) -> dict[str, float | None]:
    return {f"{prefix}_p{round(q * 100)}_ms": nearest_rank(values, q) for q in (0.5, 0.95, 0.99)}


def latencies(jobs: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {k: [] for k in LATENCY_KEYS}
    for j in jobs:
        for a in j["attempts"]:
            if a["wait_ns"] is not None:
                out["wait"].append(a["wait_ns"])
            if a["n"] == 1:
                out["first_wait"].append(a["time"] - j["put_ns"])
            if a["outcome"] == "delete":
                out["run"].append(a["run_ns"])
    return out


def data_end(dirs: list[Path]) -> int:
    """The time of the last record (or snapshot) in the data: where the window series end."""
    end = 0
    for d in dirs:
        for _first, path in aof.list_segments(d / "aof"):
            for entry in logread.iter_segment(path):
                if not isinstance(entry, aof.FrameScan):
                    end = max(end, entry[1].time)
        for _seq, path in aof.list_snapshots(d / "snapshots"):
            end = max(end, snapshot.read_items(path)[1][0][2])  # meta time
    return end


def reference_windows(jobs: dict, width: int, end: int) -> dict[tuple[str, int], dict[str, Any]]:
    """(tube, window start) -> the window row, dense from a tube's first event to `end`."""
    zero = {k: 0 for k in [*COUNTED, "implicit_releases", "expiries"]}
    counts: dict = {}
    deltas: dict = {}
    attempts: dict = {}
    first: dict[str, int] = {}
    last = end - end % width
    for j in jobs.values():
        for (_seq, t, op, _conn, frm, to), (at, to_tube) in zip(j["events"], j["tubes"],
                                                                 strict=True):
            w = t - t % width
            # An event counts in the tube it happens in; a move (an expiry's, a
            # policy's dead-letter move, a move-job) leaves that tube and enters the
            # other (a "move-in" there).
            rows = [(at, op, frm, None if to_tube else to)]
            if to_tube:
                rows.append((to_tube, "move-in", None, to))
            for tube, o, f, tt in rows:
                first[tube] = min(first.get(tube, w), w)
                c = counts.setdefault((tube, w), dict(zero))
                for k, name in COUNTED.items():
                    c[k] += o == name if k != "buries" else (f, tt) == ("reserved", "buried")
                c["implicit_releases"] += o in ("disconnect", "restart")
                c["expiries"] += o in ("expire", "move")
                if o != "touch":
                    d = deltas.setdefault((tube, w), dict.fromkeys(STATES, 0))
                    if f in d:
                        d[f] -= 1
                    if tt in d:
                        d[tt] += 1
        for a in j["attempts"]:
            w = a["time"] - a["time"] % width
            attempts.setdefault((a["tube"], w), []).append((j, a))
    out = {}
    for tube, lo in first.items():
        level = dict.fromkeys(STATES, 0)
        for w in range(lo, last + 1, width):
            row = dict(counts.get((tube, w), zero))
            for s, v in deltas.get((tube, w), {}).items():
                level[s] += v
            row.update(level, backlog=sum(level.values()))
            group = attempts.get((tube, w), [])
            row["re_reserves"] = sum(a["n"] > 1 for _j, a in group)
            lat = latencies([dict(j, attempts=[a]) for j, a in group])
            for k in LATENCY_KEYS:
                row.update(percentiles(k, lat[k]))
            out[(tube, w)] = row
    return out


# --- the session fixtures (tests/procs/conftest.py) -----------------------------------------


@pytest.fixture(scope="session")
def analytics_workload(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("analytics")
    dirs = {name: tmp / name for name in ("alpha", "beta", "gamma", "delta", "epsilon")}
    groups = script_alpha(tmp, dirs["alpha"])
    groups.update(script_beta(tmp, dirs["beta"], dirs["gamma"]))
    groups.update(script_epsilon(tmp, dirs["epsilon"]))
    # gamma: snapshot + every segment it covers; delta: the same segments alone.
    shutil.copytree(dirs["gamma"], dirs["delta"])
    compactor.fold(dirs["gamma"], [p for _f, p in aof.list_segments(dirs["gamma"] / "aof")])
    ref: dict = {}
    for name in ("alpha", "beta", "delta", "epsilon"):
        ref.update(reference_jobs(dirs[name], name))
    ref.update({("gamma", i): j for (s, i), j in list(ref.items()) if s == "delta"})
    end = data_end(list(dirs.values()))
    return dict(dirs=dirs, groups=groups, ref=ref, tmp=tmp, end=end)


@pytest.fixture(scope="session")
def analytics_spark() -> Iterator[Any]:
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java")
    from smallstalk.analytics.command import session

    # Tiny data: compiling whole-stage code costs more than it saves (about 8s here).
    s, _started = session("local[2]", {"spark.ui.enabled": "false",
                                       "spark.sql.codegen.wholeStage": "false",
                                       "spark.sql.shuffle.partitions": "4"}, "2g")
    s.sparkContext.setLogLevel("ERROR")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def analytics_run(analytics_spark, analytics_workload) -> dict[str, Any]:
    from smallstalk.analytics import main

    workload = analytics_workload
    out = workload["tmp"] / "out"
    html_path = workload["tmp"] / "report.html"
    dirs = workload["dirs"]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main([str(dirs[n]) for n in SERVERS]
                      + ["--out", str(out), "--report", str(html_path)])
    assert status == 0, stderr.getvalue()
    return dict(out=out, html=html_path.read_text(), stdout=stdout.getvalue(),
                stderr=stderr.getvalue(),
                summary=json.loads((out / "summary.json").read_text()))
