"""Server-side job policies seen by unchanged clients, against a real server
process: greenstalk and fivebeans (Node, from npm) see a job buried after N
timeouts and a tube limited to N reserved jobs; a schedule fires once per
period across a kill -9 and a restart, and across an automatic failover of
a three-member HA cluster, where a tube's limit holds on the new primary too
(read back with `aof dump`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import greenstalk
import pytest

from ..support.bsclient import Client, peek_ids
from ..support.procs import REPO, smallstalk_cmd, start_smallstalk, wait_for
from .conftest import HA_TTL

CONFIG = """
[tubes.flaky]
max-timeouts = 2
[tubes."flaky-node"]
max-timeouts = 2
[tubes.narrow]
max-reserved = 2
[tubes."narrow-node"]
max-reserved = 2
"""

CACHE = REPO / "build" / "client-suites"
SCRIPT = REPO / "tests" / "support" / "clients" / "policies.js"


def _config(tmp_path: Path, text: str = CONFIG) -> Path:
    path = tmp_path / "smallstalk.toml"
    path.write_text(text)
    return path


def test_greenstalk_sees_attempt_limits_and_concurrency(tmp_path: Path) -> None:
    # In memory (the Node test below runs with a data directory): the limits
    # reach the state without a journal too.
    server = start_smallstalk(tmp_path, "--config", str(_config(tmp_path)), "--extended-stats")
    addr = ("127.0.0.1", server.port)
    try:
        with greenstalk.Client(addr, use="flaky", watch="flaky") as a, \
                greenstalk.Client(addr, watch="flaky") as b, \
                greenstalk.Client(addr, watch="flaky") as c:
            jid = a.put("payload", ttr=1)
            assert a.reserve(timeout=5).id == jid
            assert b.reserve(timeout=10).id == jid  # its TTR ran out: ready again
            with pytest.raises(greenstalk.TimedOutError):
                c.reserve(timeout=4)  # the second time: buried, not ready
            stats = a.stats_job(jid)
            assert stats["state"] == "buried" and stats["timeouts"] == 2
            assert stats["held-back"] == "exhausted: TTR ran out 2 times (max-timeouts 2)"
        workers = [greenstalk.Client(addr, watch="narrow") for _ in range(3)]
        with greenstalk.Client(addr, use="narrow") as p:
            for i in range(4):
                p.put(f"n{i}")
            held = [w.reserve(timeout=1) for w in workers[:2]]
            with pytest.raises(greenstalk.TimedOutError):
                workers[2].reserve(timeout=1)  # two reserved: the tube looks empty
            workers[0].delete(held[0])
            t0 = time.monotonic()
            assert workers[2].reserve(timeout=10).body == "n2"
            assert time.monotonic() - t0 < 5
        for w in workers:
            w.close()
    finally:
        server.stop()


def _fivebeans() -> Path:
    """fivebeans 1.5.0 from npm, in the client suites' cache (run_suite.py fetches it)."""
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.fail("node and npm are needed (make system-packages installs them)")
    spec = importlib.util.spec_from_file_location(
        "run_suite", REPO / "tests" / "support" / "clients" / "run_suite.py")
    run_suite = importlib.util.module_from_spec(spec)
    sys.modules["run_suite"] = run_suite  # its dataclasses look their module up
    spec.loader.exec_module(run_suite)
    CACHE.mkdir(parents=True, exist_ok=True)
    home = run_suite.cached(CACHE, "fivebeans-1.5.0", lambda tmp: run_suite.npm_install(
        tmp, ["fivebeans@1.5.0", "mocha@3.0.2", "must@0.13.4"]))
    return home / "node_modules" / "fivebeans"


def test_a_node_client_sees_attempt_limits_and_concurrency(tmp_path: Path) -> None:
    pkg = _fivebeans()
    server = start_smallstalk(tmp_path, "--config", str(_config(tmp_path)), "--extended-stats",
                              data_dir=tmp_path / "data")
    try:
        done = subprocess.run(["node", str(SCRIPT), str(pkg), str(server.port)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr + done.stdout
        seen = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        server.stop()
    assert seen["first"][1] == seen["second"][1] == "node job"
    assert seen["third"] == {"err": "TIMED_OUT"}
    assert seen["stats"]["state"] == "buried" and seen["stats"]["timeouts"] == 2
    assert seen["stats"]["held-back"] == "exhausted: TTR ran out 2 times (max-timeouts 2)"
    assert [len(x) for x in seen["held"]] == [2, 2]
    assert seen["refused"] == {"err": "TIMED_OUT"}
    assert seen["woken"][1] == "n2" and seen["waited_ms"] < 5000


# Every 3 s (six fields: seconds first), so a test sees several periods quickly.
SCHEDULE = """
[[schedules]]
name = "tick"
tube = "ticks"
cron = "*/3 * * * * *"
body = "tick"
"""


def _fires(data_dir: Path) -> list[dict]:
    return _records(data_dir, "fire")


def test_a_schedule_fires_once_per_period_across_kill_9(tmp_path: Path) -> None:
    data = tmp_path / "data"
    config = _config(tmp_path, SCHEDULE)
    server = start_smallstalk(tmp_path, "--config", str(config), data_dir=data)
    addr = ("127.0.0.1", server.port)
    try:
        with greenstalk.Client(addr, watch="ticks") as c:
            wait_for(lambda: c.stats_tube("ticks")["total-jobs"] >= 2
                     if "ticks" in c.tubes() else False, 20, "two firings")
        server.kill()  # SIGKILL, just after a firing
        time.sleep(4)  # down for at least one period
        server = start_smallstalk(tmp_path, "--config", str(config), data_dir=data,
                                  port=server.port)
        with greenstalk.Client(addr, watch="ticks") as c:
            before = c.stats_tube("ticks")["total-jobs"]
            wait_for(lambda: c.stats_tube("ticks")["total-jobs"] >= before + 2, 20,
                     "two firings after the restart")
    finally:
        server.stop()
    fires = _fires(data)
    ats = [f["at"] for f in fires]
    assert ats == sorted(set(ats)), "a firing came twice"
    assert all(at % (3 * 10**9) == 0 for at in ats)
    made = [f for f in fires if f["id"]]
    skipped = [f for f in fires if not f["id"]]
    # The periods missed while down count once, as a skip (catch-up = "none").
    assert len(skipped) <= 1 and len(made) >= 4
    assert [f["id"] for f in made] == sorted(f["id"] for f in made)
    # Each period once: consecutive firings 3 s apart, except across the downtime.
    gaps = [b - a for a, b in zip(ats, ats[1:], strict=False)]
    assert sum(1 for g in gaps if g != 3 * 10**9) <= 1
    assert os.path.exists(data)


def test_a_schedule_and_limits_carry_over_a_promotion(tmp_path: Path) -> None:
    """A replica follows the primary's firings and limits through its records;
    promoted after a kill -9 of the primary, it goes on from the last firing
    the log holds, never firing a period twice."""
    config = _config(tmp_path, SCHEDULE + '[tubes.narrow]\nmax-reserved = 2\n')
    primary = start_smallstalk(tmp_path, "--config", str(config), data_dir=tmp_path / "p")
    replica = start_smallstalk(tmp_path, "--config", str(config), "--replica-of",
                               f"127.0.0.1:{primary.port}", data_dir=tmp_path / "r")
    try:
        with greenstalk.Client(("127.0.0.1", replica.port)) as c:
            wait_for(lambda: "ticks" in c.tubes() and c.stats_tube("ticks")["total-jobs"] >= 2,
                     30, "two firings on the replica")
        primary.kill()
        done = subprocess.run([*smallstalk_cmd(), "promote", f"127.0.0.1:{replica.port}"],
                              capture_output=True, text=True, timeout=60, cwd=REPO)
        assert done.returncode == 0 and done.stdout.startswith("PROMOTED"), done
        with greenstalk.Client(("127.0.0.1", replica.port), watch="ticks") as c:
            before = c.stats_tube("ticks")["total-jobs"]
            wait_for(lambda: c.stats_tube("ticks")["total-jobs"] >= before + 2, 30,
                     "two firings after the promotion")
    finally:
        primary.kill()
        replica.stop()
    fires = _fires(tmp_path / "r")
    ats = [f["at"] for f in fires]
    assert ats == sorted(set(ats)), "a firing came twice"
    assert len([f for f in fires if f["id"]]) >= 4
    limits = _records(tmp_path / "r", "limits")  # the primary's, replicated
    assert [(x["tube"], x["max_reserved"]) for x in limits] == [("narrow", 2)]


def _records(data_dir: Path, *ops: str) -> list[dict]:
    """The records of these kinds in `data_dir`'s log, in order (`aof dump`)."""
    done = subprocess.run([*smallstalk_cmd(), "aof", "dump", str(data_dir),
                           *[x for op in ops for x in ("--op", op)], "--format", "jsonl"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


PERIOD = 3 * 10**9  # SCHEDULE's
# One schedule per catch-up mode, firing together, and a limited tube.
FAILOVER_CONFIG = SCHEDULE + """
[[schedules]]
name = "tock"
tube = "tocks"
cron = "*/3 * * * * *"
body = "tock"
catch-up = "last"

[tubes.narrow]
max-reserved = 2
"""


def test_schedules_fire_once_per_period_and_limits_hold_across_an_automatic_failover(
        cluster_factory, tmp_path: Path) -> None:
    """Three HA members (etcd lock, --ha-ttl 2); the primary is killed -9
    just before a period, so its lease outlives that period and no member
    fires it on time. From the whole history (the new primary's log, the
    surviving replica's and the dead primary's): every period once, none
    twice; the missed one recorded by the new primary as catch-up says
    (`none`: a skip, `last`: one job); and the old primary's Limits record
    reached the new one, whose tube still holds at most two reserved."""
    c = cluster_factory("--config", str(_config(tmp_path, FAILOVER_CONFIG)))
    old = c.wait_leader(30)
    c.wait_members({c.node(i): ("primary" if c.node(i) == old else "replica")
                    for i in range(3)})
    o = c.index(old)
    with greenstalk.Client(c.address(o), use="narrow") as g:
        for i in range(3):
            g.put(f"n{i}")
        wait_for(lambda: "tocks" in g.tubes() and g.stats_tube("tocks")["total-jobs"] >= 2,
                 30, "two firings on the primary")
    # Kill 0.8 s before a period: the lease, renewed every third of its 2 s,
    # has at least 1.3 s left, so the next primary comes after that period.
    for _ in range(5):
        boundary = (time.time_ns() // PERIOD + 1) * PERIOD
        if boundary - time.time_ns() > 1.2 * 10**9:
            time.sleep((boundary - time.time_ns()) / 1e9 - 0.8)
            if boundary - time.time_ns() > 0.4 * 10**9:
                break
        time.sleep(1.5)
    else:
        raise AssertionError("no moment to kill the primary before a period")
    c.kill(o)
    new = c.wait_leader(HA_TTL + 20, not_=old)
    n = c.index(new)
    rest = next(i for i in range(3) if i not in (o, n))
    with greenstalk.Client(c.address(n), watch="ticks") as g:
        before = g.stats_tube("ticks")["total-jobs"]
        wait_for(lambda: g.stats_tube("ticks")["total-jobs"] >= before + 2, 30,
                 "two firings after the failover")
    # The limit on the new primary: two of three ready jobs reserved, then none.
    workers = [greenstalk.Client(c.address(n), watch="narrow") for _ in range(3)]
    try:
        held = [w.reserve(timeout=5) for w in workers[:2]]
        assert sorted(j.body for j in held) == ["n0", "n1"]
        with pytest.raises(greenstalk.TimedOutError):
            workers[2].reserve(timeout=1)
    finally:
        for w in workers:
            w.close()
    c.wait_members({new: "primary", c.node(rest): "replica"}, 30)
    c.stop()  # the histories are read from stopped members
    logs = {i: _records(c.tmp / c.node(i), "fire", "new-epoch", "limits") for i in range(3)}
    promoted = [x for x in logs[n] if x["op"] == "new-epoch"][-1]
    limits = [(x["tube"], x["max_reserved"]) for x in logs[n]
              if x["op"] == "limits" and x["seq"] < promoted["seq"]]
    assert limits == [("narrow", 2)], logs[n]  # the old primary's, replicated
    fires = {i: [(x["schedule"], x["at"], x["id"], x["seq"]) for x in logs[i]
                 if x["op"] == "fire"] for i in range(3)}
    history = fires[n]
    # The surviving replica holds the new primary's history (one firing behind
    # at most), the dead primary a prefix of it: no firing of its undone or repeated.
    assert history[:len(fires[rest])] == fires[rest] and len(history) - len(fires[rest]) <= 2
    assert history[:len(fires[o])] == fires[o], (fires[o][-3:], history[:len(fires[o]) + 1])
    missed = []  # periods no member fired on time, per schedule
    for name, catch_up in (("tick", "none"), ("tock", "last")):
        mine = [(at, jid, seq) for s, at, jid, seq in history if s == name]
        ats = [at for at, _j, _s in mine]
        assert ats == sorted(set(ats)), f"{name}: a period fired twice: {ats}"
        assert all(at % PERIOD == 0 for at in ats)
        before = [x for x in mine if x[2] < promoted["seq"]]
        after = [x for x in mine if x[2] > promoted["seq"]]
        assert len(before) >= 2 and len(after) >= 2, (name, mine)
        # Periods no member fired: between the dead primary's last firing and
        # the promotion (the kill's timing makes one at least); the new
        # primary records the last of them once, as catch-up says.
        late = [x for x in after if x[0] < promoted["time"]]
        gap = range(before[-1][0] + PERIOD, after[0][0], PERIOD)  # not recorded at all
        assert all(p < promoted["time"] for p in gap), (name, list(gap), promoted)
        assert len(late) == 1, f"{name}: missed {list(gap)}, recorded late {late}"
        # From the first job made on: a skip only where the failover missed one.
        # (Before it, a period may pass between loading the schedule and the
        # first election on a loaded machine: recorded as missed, as it should.)
        first = next(i for i, x in enumerate(mine) if x[1])
        assert all(x[1] == 0 and catch_up == "none" for x in mine[:first]), (name, mine)
        for x in mine[first:]:
            assert (x[1] == 0) == (x in late and catch_up == "none"), (name, x, promoted)
        assert all(b - a == PERIOD for a, b in zip(ats, ats[1:], strict=False)
                   if b <= before[-1][0] or a >= after[0][0]), (name, ats)
        missed.append(len(gap) + 1)
    assert missed[0] == missed[1], missed
    # The jobs themselves: one per firing that made one, on the new primary
    # (each schedule's body is its name; the members are stopped: restart
    # the new primary alone, as a plain server).
    made = {jid: s for s, _at, jid, _seq in history if jid}
    server = start_smallstalk(tmp_path, data_dir=c.tmp / new)
    try:
        with Client(server.port) as conn:
            bodies = peek_ids(conn, sorted(made))
    finally:
        server.stop()
    assert bodies == {jid: s.encode() for jid, s in made.items()}
