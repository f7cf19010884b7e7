"""Generate the golden on-disk fixtures of the current format: snapshots/v<FORMAT_VERSION>/.

Runs a scripted session against real `smallstalk serve` processes (two runs on
the same data directory: the log starts with the NewEpoch record a fresh data
directory gets, and holds two Restart records; both with the tube policies of
`CONFIG` as their --config file, for the big-tube records of format 2: fanout
copies, a full tube dropping its oldest job, expiry into a dead-letter tube),
stops each with SIGTERM, folds the closed segments with
`python -m smallstalk.storage.compactor`, and writes three data directories plus
expected.json:

- log-only/               the data directory exactly as the server left it;
- snapshot-and-segments/  plus the compactor's snapshot, with every segment
                          still there (a crash before the covered segments
                          were deleted: recovery must skip seq <= snapshot seq);
- compacted/              the covered segments deleted, as the server does.

expected.json is written from what this script did (a small model of the
session below), never by reading the files back through smallstalk; before
writing anything the script checks the model against the live server
(stats-job, stats-tube, list-tubes) and against the records in the segments.
The one thing the model cannot predict is the random history id the server
picks for its NewEpoch record: the model knows only its form (16 lowercase hex
characters); the value expected.json carries is read from the segments after
the session (with this script's own reader) and must equal what the live
server reported in `stats` (see `Chosen` in tools/fixture_model.py).

An existing snapshots/v<N>/ is never overwritten: fixtures of a released
format are frozen. Usage: `make fixtures` or
`.venv/bin/python tools/make_fixtures.py [--root DIR]`.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import greenstalk
from fixture_model import HISTORY_PATTERN, Chosen, Model, resolve

from smallstalk.core import records

REPO = Path(__file__).resolve().parent.parent
SEGMENT_RECORDS = 10
LONG = 3600  # seconds: delays, TTRs and pauses that must not run out during the session

# Tube policies the servers run with (`--config`; tools/fixture_model.py keeps the
# model's copy of them).
# Only what the session needs: a full tube that discards its oldest job, and a
# tube whose jobs expire after a second into a dead-letter tube.
CONFIG = """\
[tubes.orders]
max-jobs = 1
discard-old-when-full = true

[tubes.reports]
max-age = 1
expire-to = "dead"

[tubes.keyed]
unique-for = "1h"
unique-keys-max = 5

[tubes.flaky]
max-timeouts = 1

[tubes.throttled]
max-reserved = 1
max-rate = "100/h"
"""
# Format 6: the Limits record the configuration gives (tube, max_reserved, rate, period s).
LIMITS = [("throttled", 1, 100, 3600)]
FLAKY_REASON = "exhausted: TTR ran out 1 times (max-timeouts 1)"


def schedule_config(at: int) -> str:
    """A schedule that fires once, at `at` (whole seconds since the epoch, UTC)."""
    t = time.gmtime(at)
    return (f'\n[[schedules]]\nname = "tick"\ntube = "ticks"\n'
            f'cron = "{t.tm_sec} {t.tm_min} {t.tm_hour} * * *"\nbody = "tick"\n'
            f"pri = 12\nttr = 30\n")


# ----------------------------------------------------------------------------
# Driving real servers.
# ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, pred: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"make_fixtures: timed out waiting for {what}")
        time.sleep(0.05)


class Server:
    def __init__(self, data_dir: Path, log_path: Path, extra: str = ""):
        self.port = free_port()
        self.log_path = log_path
        config = log_path.with_name("policies.toml")
        config.write_text(CONFIG + extra)
        cmd = [sys.executable, "-m", "smallstalk", "serve", "-l", "127.0.0.1", "-p",
               str(self.port), "--data-dir", str(data_dir), "--config", str(config),
               "--segment-records", str(SEGMENT_RECORDS), "--compact-interval", "3600",
               "--extended-stats"]  # the checks below read smallstalk's keys too
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        # Whatever ends this script (a failed check raises mid-session), the
        # server it started does not outlive it.
        atexit.register(self._reap)
        wait_until("the server to listen", self._listening, 30.0)

    def _reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            raise SystemExit(f"make_fixtures: server exited early:\n{self.log_path.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise SystemExit("make_fixtures: server ignored SIGTERM") from None
        if rc != 0:
            raise SystemExit(f"make_fixtures: server exited {rc}:\n{self.log_path.read_text()}")


class Client:
    """A greenstalk client whose logged commands are mirrored into the model."""

    def __init__(self, model: Model, server: Server, label: str):
        self.m = model
        self.label = label
        model.order[label] = len(model.order)
        self.gs = greenstalk.Client(("127.0.0.1", server.port))

    def put(self, body: str, pri: int, delay: int = 0, ttr: int = LONG, max_age: int = 0) -> int:
        """A put; with `max_age`, smallstalk's `put-expiring` (the job's own max age)."""
        if max_age:
            buf = body.encode()
            jid = self.gs._int_cmd(b"put-expiring %d %d %d %d %d\r\n%b" % (
                pri, delay, ttr, max_age, len(buf), buf), b"INSERTED")
        else:
            jid = self.gs.put(body, priority=pri, delay=delay, ttr=ttr)
        tube = self.m.view(self.label).use
        if self.m.needs_put_jobs(tube, max_age):
            expect = self.m.put_jobs(self.label, tube, pri, delay, ttr, body, max_age)
        else:
            expect = self.m.put(self.label, tube, pri, delay, ttr, body)
        assert jid == expect, (jid, expect)
        return jid

    def put_unique(self, key: str, body: str, pri: int, ttr: int = LONG) -> int:
        """smallstalk's `put-unique`: INSERTED for a new job, DUPLICATE (nothing logged)."""
        buf = body.encode()
        self.gs._sock.sendall(b"put-unique %b %d 0 %d %d\r\n%b\r\n" % (
            key.encode(), pri, ttr, len(buf), buf))
        word, jid_text = self.gs._reader.readline().split()
        jid = int(jid_text)
        tube = self.m.view(self.label).use
        held = self.m.find_key(tube, key)
        if held is not None:
            assert (word, jid) == (b"DUPLICATE", held), (word, jid, held)
        else:
            assert word == b"INSERTED", word
            assert jid == self.m.put_unique(self.label, tube, key, pri, ttr, body)
        return jid

    def delete_tube(self, tube: str) -> None:
        self.gs._send_cmd(b"delete-tube %b" % tube.encode("ascii"), b"DELETED")
        self.m.delete_tube(self.label, tube)

    def move_job(self, jid: int, tube: str) -> None:
        self.gs._send_cmd(b"move-job %d %b" % (jid, tube.encode("ascii")), b"MOVED")
        self.m.move(self.label, jid, tube)

    def flush_tube(self, tube: str) -> None:
        n = self.gs._int_cmd(b"flush-tube %b" % tube.encode("ascii"), b"FLUSHED")
        assert n == self.m.flush_tube(self.label, tube), n

    def reserve(self, expect: int, timeout: int | None = None) -> None:
        job = self.gs.reserve(timeout)
        assert job.id == expect, (job.id, expect)
        self.m.reserve(self.label, expect)

    def reserve_job(self, jid: int) -> None:
        assert self.gs.reserve_job(jid).id == jid
        self.m.reserve(self.label, jid)

    def reserve_times_out(self, timeout: int) -> None:
        """A reserve that waits and times out: volatile records only, nothing logged."""
        try:
            self.gs.reserve(timeout)
        except greenstalk.TimedOutError:
            return
        raise AssertionError("reserve-with-timeout should have timed out")

    def release(self, jid: int, pri: int, delay: int = 0) -> None:
        self.gs.release(greenstalk.Job(jid, ""), priority=pri, delay=delay)
        self.m.release(self.label, jid, pri, delay)

    def bury(self, jid: int, pri: int) -> None:
        self.gs.bury(greenstalk.Job(jid, ""), priority=pri)
        self.m.bury(self.label, jid, pri)

    def touch(self, jid: int) -> None:
        self.gs.touch(greenstalk.Job(jid, ""))
        self.m.touch(self.label, jid)

    def delete(self, jid: int) -> None:
        self.gs.delete(jid)
        self.m.delete(self.label, jid)

    def kick(self, bound: int, expect: list[int]) -> None:
        assert self.gs.kick(bound) == len(expect)
        self.m.kick(self.label, expect)

    def kick_job(self, jid: int) -> None:
        self.gs.kick_job(jid)
        self.m.kick(self.label, [jid])

    def use(self, tube: str) -> None:
        self.gs.use(tube)
        if self.m.view(self.label).use != tube:
            self.m.use(self.label, tube)

    def watch(self, tube: str) -> None:
        self.gs.watch(tube)
        if tube not in self.m.view(self.label).watch:
            self.m.watch(self.label, tube)

    def ignore(self, tube: str) -> None:
        self.gs.ignore(tube)
        watched = self.m.view(self.label).watch
        if tube in watched and len(watched) > 1:
            self.m.ignore(self.label, tube)

    def pause_tube(self, tube: str, delay: int) -> None:
        self.gs.pause_tube(tube, delay)
        self.m.pause_tube(self.label, tube, delay)

    def close(self) -> None:
        self.gs.close()


def job_state(server: Server, jid: int) -> str:
    with greenstalk.Client(("127.0.0.1", server.port)) as c:
        return str(c.stats_job(jid)["state"])


def job_tube(server: Server, jid: int) -> str | None:
    """The job's tube, or None once it is gone."""
    with greenstalk.Client(("127.0.0.1", server.port)) as c:
        try:
            return str(c.stats_job(jid)["tube"])
        except greenstalk.NotFoundError:
            return None


def session(data_dir: Path, work: Path) -> Model:
    """The scripted session. Every logged command is mirrored in the model."""
    m = Model()
    log = work / "server.log"

    # --- run 1 ---------------------------------------------------------------------
    srv = Server(data_dir, log)
    m.new_epoch(1)  # a fresh data directory: its own history id, before the first Restart
    m.restart()
    for limits in LIMITS:  # format 6: the configuration's limits, once, after Restart
        m.set_limits(*limits)
    p1 = Client(m, srv, "P1")
    p1.use("emails")
    p1.put("email-1", pri=100)  # 1
    p1.put("email-2", pri=10, delay=LONG)  # 2: delayed, kicked by kick-job later
    p1.put("email-3", pri=5000)  # 3
    p1.put("email-4", pri=200)  # 4
    p1.use("default")
    p1.put("default-1 \x00\r\n\u00e9", pri=0, ttr=1)  # 5: urgent, binary-ish body, TTR 1 s
    p1.put("default-2", pri=1, delay=1)  # 6: promoted after 1 s
    wait_until("job 6 to be promoted", lambda: job_state(srv, 6) == "ready")
    m.promote([6])

    w1 = Client(m, srv, "W1")
    w1.watch("emails")
    w1.ignore("default")
    w1.reserve(expect=1)  # emails: 1 (pri 100) before 4 (200) and 3 (5000)
    w1.release(1, pri=2000)  # back to ready with a new priority
    w1.reserve(expect=4)
    w1.bury(4, pri=300)
    w1.reserve(expect=1)
    w1.bury(1, pri=400)  # buried FIFO of emails: [4, 1]
    w1.reserve(expect=3)
    w1.touch(3)
    w1.delete(3)

    x1 = Client(m, srv, "X1")
    x1.reserve(expect=5)  # default: 5 (pri 0) before 6 (pri 1); TTR 1 s
    wait_until("job 5's TTR to run out", lambda: job_state(srv, 5) == "ready")
    m.timeout([5])
    x1.reserve(expect=5)
    x1.use("scratch")
    x1.put("scratch-1", pri=50)  # 7
    p1.use("other")
    p1.put("other-1", pri=7, delay=LONG)  # 8: stays delayed
    p1.put("other-2", pri=8, delay=LONG // 2)  # 9: kicked by `kick 1` (soonest delayed)
    x1.delete(7)
    x1.close()  # Disconnect: job 5 back to ready; "scratch" dropped (swap-removal)
    wait_until("X1's disconnect", lambda: job_state(srv, 5) == "ready")
    m.disconnect("X1")

    p1.kick(1, expect=[9])  # only delayed jobs in "other": the soonest one
    p1.kick_job(2)  # a delayed job in another tube
    p1.use("emails")
    p1.pause_tube("emails", LONG)  # still paused at the end

    # Big tubes (format 2): fanout, a full tube dropping its oldest job, expiry.
    p1.use("orders+audit")  # creating `orders+audit` registers it as a fanout tube of orders
    p1.use("orders+archive")  # registered too; orders+audit is dropped, and stays registered
    p1.use("orders")
    order1 = p1.put("order-1", pri=20)  # PutJobs: orders, a copy in each fanout tube
    p1.put("order-2", pri=20, max_age=LONG)  # + an expiry time; orders (max 1) drops order 1
    p1.delete_tube("orders+archive")  # no more copies there; its jobs stay
    p1.put("order-3", pri=20)  # orders and orders+audit only; drops order 2's orders job
    assert order1 not in m.jobs
    p1.use("sessions")
    s1 = p1.put("session-1", pri=30, max_age=1)  # gone (expired) a second later
    wait_until(f"job {s1} to expire", lambda: job_tube(srv, s1) is None)
    m.expire([(s1, "")])
    p1.put("session-2", pri=30)  # a plain Put into the same tube
    p1.use("reports")
    r1 = p1.put("report-1", pri=40)  # reports: max-age 1, then moved to the dead-letter tube
    wait_until(f"job {r1} to move", lambda: job_tube(srv, r1) == "dead")
    m.expire([(r1, "dead")])
    w1.watch("default")
    w1.reserve(expect=5)  # held at shutdown: the next Restart record releases it
    srv.stop()
    for c in (p1, w1):
        c.close()

    # --- run 2 ---------------------------------------------------------------------
    # Format 6: a schedule that fires once, a few seconds into this run (the
    # server starts well before); nothing else is logged until it has fired.
    fire_at = int(time.time()) + 8
    srv = Server(data_dir, log, schedule_config(fire_at))
    m.restart()  # the log already has a history: no second NewEpoch (nor Limits: unchanged)
    tick = m.next_job_id
    wait_until("the schedule to fire", lambda: job_tube(srv, tick) == "ticks", 30.0)
    m.fire("tick", fire_at * 10**9, "ticks", pri=12, ttr=30, body="tick")
    p2 = Client(m, srv, "P2")
    p2.use("emails")
    p2.put("email-5", pri=1024)  # not urgent (urgent is pri < 1024)
    email6 = p2.put("email-6", pri=3)
    w2 = Client(m, srv, "W2")
    w2.watch("emails")
    w2.ignore("default")
    w2.reserve_job(email6)  # reserve-job ignores the pause; held at shutdown
    v2 = Client(m, srv, "V2")
    v2.watch("idle")  # a tube kept alive only by a watcher
    v2.ignore("default")
    v2.reserve_times_out(1)
    p2.delete(2)
    p2.put("email-7", pri=100)
    p2.use("junk")  # format 4: flush-tube deletes a tube's unreserved jobs in one record
    p2.put("junk-1", pri=5)
    p2.put("junk-2", pri=6, delay=LONG)
    p2.flush_tube("junk")
    p2.use("keyed")  # format 5: keyed puts, a duplicate, a key outliving its job
    k1 = p2.put_unique("order-41", "keyed-1", pri=9)
    assert p2.put_unique("order-41", "keyed-1 again", pri=9) == k1  # DUPLICATE: no record
    p2.put_unique("order-42", "keyed-2", pri=9)
    p2.delete(k1)
    assert p2.put_unique("order-41", "keyed-1 retried", pri=9) == k1  # retained key
    p2.put_unique("order-43", "keyed-3", pri=9)
    p2.use("moving")  # format 7: move-job, a ready and a delayed job, one record each
    p2.move_job(p2.put("moving-1", pri=13), "moved")
    p2.move_job(p2.put("moving-2", pri=14, delay=LONG), "moved")
    p2.use("flaky")  # format 6: an attempt limit buries a job whose TTR ran out (Requeue)
    flaky = p2.put("flaky-1", pri=11, ttr=1)
    y2 = Client(m, srv, "Y2")
    y2.watch("flaky")
    y2.ignore("default")
    y2.reserve(expect=flaky)
    wait_until(f"job {flaky} to be buried", lambda: job_state(srv, flaky) == "buried")
    m.requeue_timeout([(flaky, FLAKY_REASON)])
    p2.use("throttled")  # a reserve from a rate-limited tube moves its bucket
    slow = p2.put("throttled-1", pri=13)
    y2.watch("throttled")
    y2.reserve(expect=slow)
    y2.delete(slow)
    p2.use("emails")
    check_live(srv, m)
    for c in (p2, w2, v2, y2):  # list-tube-used / list-tubes-watched are not logged
        view = m.view(c.label)
        assert (c.gs.using(), c.gs.watching()) == (view.use, view.watch), c.label
    srv.stop()
    for c in (p2, w2, v2, y2):
        c.close()
    return m


def check_live(srv: Server, m: Model) -> None:
    """The model agrees with the running server before it is stopped."""
    with greenstalk.Client(("127.0.0.1", srv.port)) as c:
        assert c.tubes() == m.tube_order, (c.tubes(), m.tube_order)
        for j in m.jobs.values():
            st = c.stats_job(j.id)
            got = {k: st[k] for k in ("tube", "state", "pri", "delay", "ttr", "reserves",
                                      "timeouts", "releases", "buries", "kicks")}
            want = {"tube": j.tube, "state": j.state, "pri": j.pri, "delay": j.delay,
                    "ttr": j.ttr, "reserves": j.reserves, "timeouts": j.timeouts,
                    "releases": j.releases, "buries": j.buries, "kicks": j.kicks}
            assert got == want, (j.id, got, want)
        for name in m.tube_order:
            st = c.stats_tube(name)
            t = m.tubes[name]
            assert (st["total-jobs"], st["cmd-delete"], st["cmd-pause-tube"]) == (
                t.total_jobs, t.cmd_delete, t.cmd_pause), (name, st)
            assert st["current-jobs-buried"] == len(t.buried), (name, st)
            assert (st["jobs-expired"], st["jobs-discarded"]) == (t.expired_n, t.discarded_n), (
                name, st)
            assert st["fanout-tubes"] == len(m.fanout.get(name, [])), (name, st)
        stats = c.stats()
        assert stats["job-timeouts"] == m.job_timeouts
        epoch, history, _first = m.epochs[-1]
        assert stats["epoch"] == epoch, stats["epoch"]
        # greenstalk turns an all-digit value into an int (dropping leading zeros).
        seen = stats["history"]
        m.live[history.name] = seen if isinstance(seen, str) else f"{seen:016d}"


# ----------------------------------------------------------------------------
# Files.
# ----------------------------------------------------------------------------

HEADER = struct.Struct("<8sIQI")
FRAME = struct.Struct("<II")


def read_segment(path: Path) -> tuple[int, list[list[Any]]]:
    """(first seq from the header, decoded CBOR arrays): a reader apart from aof.py."""
    data = path.read_bytes()
    magic, version, first, crc = HEADER.unpack_from(data)
    assert magic == b"SSTKAOF\x00" and crc == zlib.crc32(data[:20]), path
    assert version == records.FORMAT_VERSION, path
    out = []
    pos = HEADER.size
    while pos < len(data):
        length, crc = FRAME.unpack_from(data, pos)
        payload = data[pos + FRAME.size:pos + FRAME.size + length]
        assert len(payload) == length and zlib.crc32(payload) == crc, (path, pos)
        out.append(cbor2.loads(payload))
        pos += FRAME.size + length
    return first, out


def check_log(aof_dir: Path, m: Model) -> tuple[list[tuple[Path, int, int]], dict[str, str]]:
    """The segments hold exactly the model's records.

    Returns (path, first seq, last seq) of each segment, and the value found for
    each Chosen field of the model's records.
    """
    segs = sorted(aof_dir.glob("*.aof"))
    seen: list[list[Any]] = []
    spans = []
    for path in segs:
        first, items = read_segment(path)
        assert path.name == f"{first:020d}.aof", path
        if items:
            assert items[0][1] == first, (path, items[0][1], first)
        seen += items
        spans.append((path, first, items[-1][1] if items else first - 1))
    assert len(seen) == len(m.records), (len(seen), len(m.records))
    times = {raw[1]: raw[2] for raw in seen}

    def absolute(obj: Any) -> Any:  # {seq, plus_seconds} -> ns, as tests/unit/test_fixtures.py does
        if isinstance(obj, dict):
            if set(obj) == {"seq", "plus_seconds"}:
                return times[obj["seq"]] + obj["plus_seconds"] * 10**9
            return {k: absolute(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [absolute(v) for v in obj]
        return obj

    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v

    conn_of: dict[str, int] = {}
    chosen: dict[str, str] = {}
    last_time = 0
    for raw, want in zip(seen, m.records, strict=True):
        rec = records.as_dict(records.from_list(raw))
        assert rec.pop("seq") == want["seq"]
        t = rec.pop("time")
        assert t >= last_time, "wall clock went backwards during the session; run again"
        last_time = t
        if "client" in want:
            conn = rec.pop("conn")
            assert conn_of.setdefault(want["client"], conn) == conn, want
        got = {k: plain(v) for k, v in rec.items()}
        exp = absolute({k: v for k, v in want.items() if k not in ("seq", "client")})
        for k, v in exp.items():
            if isinstance(v, Chosen):
                value = got.get(k)
                assert isinstance(value, str) and re.fullmatch(v.pattern, value), (want, value)
                assert chosen.setdefault(v.name, value) == value, (want, value)
                exp[k] = value
        if "body" in exp:
            exp["body"] = exp["body"].encode()
        assert got == exp, (got, exp)
    return spans, chosen


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(data_dir: Path) -> dict[str, Any]:
    snaps = sorted(p.name for p in (data_dir / "snapshots").glob("*"))
    return {
        "snapshot": snaps[-1] if snaps else None,
        "segments": sorted(p.name for p in (data_dir / "aof").glob("*")),
    }


def build(out: Path, work: Path) -> None:
    data = work / "data"
    data.mkdir()
    # The server folds closed segments as soon as one closes and deletes them. A
    # plain file where snapshots/ would be makes its compactor child fail (and,
    # with --compact-interval 3600, not retry), so every segment stays.
    blocker = data / "snapshots"
    blocker.write_text("fixture generation: keeps the server's compactor from running\n")
    m = session(data, work)
    blocker.unlink()

    out.mkdir(parents=True)
    log_only = out / "log-only"
    shutil.copytree(data, log_only)
    spans, chosen = check_log(log_only / "aof", m)
    assert chosen == m.live, (chosen, m.live)  # the files and the live server agree
    assert len(spans) >= 3, "expected several segments"
    assert spans[-1][2] >= spans[-1][1], "the last segment should hold records"

    both = out / "snapshot-and-segments"
    shutil.copytree(log_only, both)
    closed = [path.name for path, _first, _last in spans[:-1]]
    res = subprocess.run(
        [sys.executable, "-m", "smallstalk.storage.compactor", str(both),
         *(str(both / "aof" / name) for name in closed)],
        cwd=REPO, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"make_fixtures: compactor failed:\n{res.stderr}")
    snap = Path(res.stdout.strip())
    snap_seq = spans[-2][2]
    assert snap == both / "snapshots" / f"{snap_seq:020d}.snap", (snap, snap_seq)

    compacted = out / "compacted"
    shutil.copytree(both, compacted)
    firsts = [first for _path, first, _last in spans]
    for (path, _first, _last), nxt in zip(spans, firsts[1:], strict=False):
        if nxt <= snap_seq + 1:  # wholly covered by the snapshot
            (compacted / "aof" / path.name).unlink()

    dirs = {d.name: listing(d) for d in (log_only, both, compacted)}
    files = {str(p.relative_to(out)): sha256(p) for p in sorted(out.rglob("*")) if p.is_file()}
    expected = {
        "format_version": records.FORMAT_VERSION,
        "generated_by": "tools/make_fixtures.py",
        "segment_records": SEGMENT_RECORDS,
        "notes": "`state`: what every data directory recovers to; `snapshot_state`: what "
                 "the snapshot holds. Times are relative: {seq, plus_seconds} means the `time` "
                 "of the record with that seq plus that many seconds, in ns. Bodies are the "
                 "UTF-8 encoding of `body`. `client` labels a connection; its conn id is "
                 "whatever the server gave it. `history` (NewEpoch records, `epochs` of a "
                 "state) is the random id the server picked: the model knows only its form "
                 "(`chosen`: a regular expression per field); the value here was read from "
                 "the segments after the session and matched what the live server reported "
                 "in stats. `files`: SHA-256 of every fixture file. Format 2: the servers ran "
                 "with tube policies (`policies`, the --config file); a record's `expires` and a "
                 "job's `expires` are relative times too (0 in a record, null in a job: never); "
                 "`fanout` is the fanout registry, parent by parent.",
        "chosen": {"new-epoch.history": HISTORY_PATTERN},
        "policies": CONFIG,
        "data_dirs": dirs,
        "files": files,
        "state": m.expected_state(),
        "snapshot_state": m.history[snap_seq],
        "records": m.records,
    }
    expected = resolve(expected, chosen)
    (out / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=REPO / "snapshots",
                    help="where version directories live (default: snapshots/)")
    args = ap.parse_args(argv)
    dest = args.root / f"v{records.FORMAT_VERSION}"
    if dest.exists():
        print(f"make_fixtures: {dest} exists; fixtures of a format version are never "
              "regenerated (bump FORMAT_VERSION for a new format)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="smallstalk-fixtures-") as tmp:
        work = Path(tmp)
        build(work / "out", work)
        args.root.mkdir(parents=True, exist_ok=True)
        shutil.move(str(work / "out"), dest)
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
