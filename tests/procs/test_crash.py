"""Crash recovery: SIGKILL a loaded server at random moments (also mid-compaction) and hold the restart to every acknowledged reply."""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from smallstalk.core import records
from smallstalk.storage import aof, logread, recovery
from smallstalk.storage.aof import CorruptionError

from ..support.bsclient import Client, Reply, connect, peek_ids, put_cmd, stats_jobs
from ..support.procs import Server, children, start_smallstalk, wait_for

ROUNDS = int(os.environ.get("SMALLSTALK_CRASH_ROUNDS", "30"))
CHURN_OPS = int(os.environ.get("SMALLSTALK_CHURN_OPS", "100000"))
SEED = os.environ.get("SMALLSTALK_CRASH_SEED")  # set it to replay a failing run
CLIENTS = 4
SEGMENT_RECORDS = 200
CRASH_ARGS = ("--segment-records", str(SEGMENT_RECORDS), "--compact-interval", "0.2")
FSYNC_MODES = ("always", "everysec", "never")  # SIGKILL keeps the page cache: all must hold
MAX_LIVE = 150  # jobs per client before it stops putting
MAX_OPS_PER_ROUND = 200_000  # per client; rounds end by the kill long before this
IO_TIMEOUT = 10.0
JOIN_TIMEOUT = 20.0
STATES_AFTER_RESTART = {
    "ready": {"ready"},
    "delayed": {"delayed", "ready"},  # its delay may have run out meanwhile
    "reserved": {"ready"},  # start-up's Restart record ends every reservation
    "buried": {"buried"},
}


# --- processes ------------------------------------------------------------------




def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def crash(srv: Server, with_children: bool) -> list[int]:
    """Freeze the server where it is, then SIGKILL it (and its compactor, for a power cut).

    Returns the children left running (an orphaned compactor, as after an OOM kill).
    """
    with contextlib.suppress(ProcessLookupError):
        os.kill(srv.pid, signal.SIGSTOP)
    kids = children(srv.pid)
    if with_children:
        for kid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
    srv.kill()
    return [] if with_children else kids


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            left = [p for p in pids if alive(p)]
            for p in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            raise AssertionError(f"orphaned compactor(s) {left} still running after {timeout}s")
        time.sleep(0.05)


# --- what each client was told ------------------------------------------------------


@attrs.define
class JobModel:
    body: bytes
    pri: int
    state: str  # as of the last acknowledged reply: ready, delayed, reserved, buried
    ttr: int
    alt_pri: set[int] = attrs.Factory(set)  # an unacknowledged change may have set one of these
    alt_state: set[str] = attrs.Factory(set)  # ... or left the job in one of these
    maybe_gone: bool = False  # an unacknowledged delete

    def states_after_restart(self) -> set[str]:
        return STATES_AFTER_RESTART[self.state] | self.alt_state


class Mismatch(AssertionError):
    pass


def expect(ok: object, msg: str) -> None:
    if not ok:
        raise Mismatch(msg)


@attrs.define(eq=False)
class World:
    """What every client together has been told, shared by the client threads."""

    lock: threading.Lock = attrs.Factory(threading.Lock)
    acked: set[int] = attrs.Factory(set)  # every id an INSERTED reply carried
    floor: int = 0  # every id handed out from now on must be above this
    gone: set[int] = attrs.Factory(set)  # acknowledged deletes (and observed-gone jobs)

    def inserted(self, jid: int) -> None:
        with self.lock:
            expect(jid not in self.acked, f"job id {jid} handed out twice")
            expect(jid > self.floor, f"job id {jid} reused: ids up to {self.floor} were seen before")
            self.acked.add(jid)

    def deleted(self, jid: int) -> None:
        with self.lock:
            self.gone.add(jid)


@attrs.define(eq=False)
class Worker:
    """One client connection per round, its own tube, and the model of its jobs."""

    k: int
    rng: random.Random
    world: World
    jobs: dict[int, JobModel] = attrs.Factory(dict)
    buried: list[int] = attrs.Factory(list)  # the tube's buried FIFO
    inflight: tuple | None = None  # the command sent and not yet answered
    inflight_put: bytes | None = None  # body of a put cut off by the crash
    counter: int = 0
    ops: collections.Counter = attrs.Factory(collections.Counter)
    errors: list[str] = attrs.Factory(list)

    @property
    def tube(self) -> str:
        return f"t{self.k}"

    # --- one round --------------------------------------------------------------

    def run(self, port: int, stop: threading.Event) -> None:
        try:
            c = Client(port, timeout=IO_TIMEOUT)
        except OSError:
            return  # the server is already gone
        try:
            t = self.tube.encode()
            for cmd, want in ((b"use %s\r\n" % t, b"USING"), (b"watch %s\r\n" % t, b"WATCHING"),
                              (b"ignore default\r\n", b"WATCHING")):
                r = c.call(cmd)
                expect(r.status == want, f"{cmd!r} -> {r.line!r}")
            for _ in range(MAX_OPS_PER_ROUND):
                if stop.is_set():
                    break
                self.step(c)
        except TimeoutError:
            self.errors.append(f"client {self.k}: no reply within {IO_TIMEOUT}s to {self.inflight}")
        except (ConnectionError, OSError):
            pass  # the crash: self.inflight is what it cut off
        except Exception:
            self.errors.append(f"client {self.k}, op {self.inflight}:\n{traceback.format_exc()}")
        finally:
            c.close()

    def call(self, c: Client, op: tuple, data: bytes) -> Reply:
        self.inflight = op
        return c.call(data)

    def done(self, kind: str) -> None:
        self.inflight = None
        self.ops[kind] += 1

    def step(self, c: Client) -> None:
        reserved = [j for j, m in self.jobs.items() if m.state == "reserved"]
        menu: list[tuple[Callable[[Client], None], int]] = [(self.reserve, 20)]
        if len(self.jobs) < MAX_LIVE:
            menu.append((self.put, 30))
        if reserved:
            menu += [(self.release, 12), (self.bury, 6), (self.touch, 4), (self.delete_reserved, 12)]
        if self.jobs:
            menu.append((self.delete_any, 25 if len(self.jobs) >= MAX_LIVE else 4))
        if self.buried:
            menu += [(self.kick, 3), (self.kick_job, 3), (self.rescue, 5)]
        fn = self.rng.choices([f for f, _ in menu], [w for _, w in menu])[0]
        fn(c)

    def new_pri(self) -> int:
        return self.rng.choice([0, self.rng.randrange(1, 1024), self.rng.randrange(1024, 2**32)])

    def put(self, c: Client) -> None:
        self.counter += 1
        body = b"c%d-%d-" % (self.k, self.counter) + os.urandom(self.rng.randrange(0, 120)).hex().encode()
        pri = self.new_pri()
        delay = self.rng.choice((0, 0, 0, 0, 0, 0, 1, 2))
        ttr = self.rng.choice((1, 2, 30, 30, 30))
        self.inflight = ("put", body)
        r = c.call(put_cmd(body, pri, delay, ttr))
        expect(r.status == b"INSERTED", f"put -> {r.line!r}")
        self.world.inserted(r.id)
        self.jobs[r.id] = JobModel(body, pri, "delayed" if delay else "ready", ttr)
        self.done("put")

    def reserve(self, c: Client) -> None:
        r = self.call(c, ("reserve",), b"reserve-with-timeout 0\r\n")
        if r.status == b"RESERVED":
            m = self.jobs.get(r.id)
            expect(m is not None, f"reserved job {r.id}, which client {self.k} does not have")
            expect(m.state != "buried", f"reserved job {r.id}, which is buried")
            expect(r.body == m.body, f"job {r.id}: body changed")
            m.state = "reserved"
            self.done("reserve")
        else:
            expect(r.status in (b"TIMED_OUT", b"DEADLINE_SOON"), f"reserve -> {r.line!r}")
            self.done("reserve-empty")

    def _lost_reservation(self, jid: int, r: Reply, what: str) -> None:
        """NOT_FOUND on a job we reserved: only its TTR running out explains it."""
        m = self.jobs[jid]
        expect(r.status == b"NOT_FOUND", f"{what} {jid} -> {r.line!r}")
        expect(m.ttr < 10, f"{what} {jid} -> NOT_FOUND although its TTR ({m.ttr}s) cannot have run out")
        m.state = "ready"
        self.done(f"{what}-timed-out")

    def release(self, c: Client) -> None:
        jid = self.rng.choice([j for j, m in self.jobs.items() if m.state == "reserved"])
        pri = self.new_pri()
        delay = self.rng.choice((0, 0, 0, 0, 0, 1))
        r = self.call(c, ("release", jid, pri, delay), b"release %d %d %d\r\n" % (jid, pri, delay))
        if r.status == b"RELEASED":
            m = self.jobs[jid]
            m.pri, m.state = pri, "delayed" if delay else "ready"
            self.done("release")
        else:
            self._lost_reservation(jid, r, "release")

    def bury(self, c: Client) -> None:
        jid = self.rng.choice([j for j, m in self.jobs.items() if m.state == "reserved"])
        pri = self.new_pri()
        r = self.call(c, ("bury", jid, pri), b"bury %d %d\r\n" % (jid, pri))
        if r.status == b"BURIED":
            m = self.jobs[jid]
            m.pri, m.state = pri, "buried"
            self.buried.append(jid)
            self.done("bury")
        else:
            self._lost_reservation(jid, r, "bury")

    def touch(self, c: Client) -> None:
        jid = self.rng.choice([j for j, m in self.jobs.items() if m.state == "reserved"])
        r = self.call(c, ("touch", jid), b"touch %d\r\n" % jid)
        if r.status == b"TOUCHED":
            self.done("touch")
        else:
            self._lost_reservation(jid, r, "touch")

    def _delete(self, c: Client, jid: int, kind: str) -> None:
        r = self.call(c, ("delete", jid), b"delete %d\r\n" % jid)
        expect(r.status == b"DELETED", f"delete {jid} ({self.jobs[jid].state}) -> {r.line!r}")
        del self.jobs[jid]
        if jid in self.buried:
            self.buried.remove(jid)
        self.world.deleted(jid)
        self.done(kind)

    def delete_reserved(self, c: Client) -> None:
        self._delete(c, self.rng.choice([j for j, m in self.jobs.items() if m.state == "reserved"]),
                     "delete-reserved")

    def delete_any(self, c: Client) -> None:
        self._delete(c, self.rng.choice(list(self.jobs)), "delete")

    def kick(self, c: Client) -> None:
        n = self.rng.randint(1, len(self.buried))
        r = self.call(c, ("kick", n), b"kick %d\r\n" % n)
        expect(r.line == b"KICKED %d" % n, f"kick {n} with {len(self.buried)} buried -> {r.line!r}")
        for jid in self.buried[:n]:
            self.jobs[jid].state = "ready"
        del self.buried[:n]
        self.done("kick")

    def kick_job(self, c: Client) -> None:
        jid = self.rng.choice(self.buried)
        r = self.call(c, ("kick-job", jid), b"kick-job %d\r\n" % jid)
        expect(r.status == b"KICKED", f"kick-job {jid} (buried) -> {r.line!r}")
        self.jobs[jid].state = "ready"
        self.buried.remove(jid)
        self.done("kick-job")

    def rescue(self, c: Client) -> None:
        """reserve-job a buried job, then release it with a new priority."""
        jid = self.rng.choice(self.buried)
        m = self.jobs[jid]
        r = self.call(c, ("reserve-job", jid), b"reserve-job %d\r\n" % jid)
        expect(r.status == b"RESERVED" and r.id == jid and r.body == m.body,
               f"reserve-job {jid} (buried) -> {r.line!r}")
        m.state = "reserved"
        self.buried.remove(jid)
        self.done("reserve-job")
        pri = self.new_pri()
        r = self.call(c, ("release", jid, pri, 0), b"release %d %d 0\r\n" % (jid, pri))
        if r.status == b"RELEASED":
            m.pri, m.state = pri, "ready"
            self.done("rescue")
        else:
            self._lost_reservation(jid, r, "release")

    # --- after the crash -----------------------------------------------------------

    def crashed(self) -> None:
        """Turn the command the crash cut off into what the restart may show."""
        op, self.inflight = self.inflight, None
        if op is None:
            return
        kind = op[0]
        if kind == "put":
            self.inflight_put = op[1]
        elif kind == "delete":
            self.jobs[op[1]].maybe_gone = True
        elif kind == "release":
            m = self.jobs[op[1]]
            m.alt_pri.add(op[2])
            m.alt_state |= {"delayed", "ready"} if op[3] else {"ready"}
        elif kind == "bury":
            m = self.jobs[op[1]]
            m.alt_pri.add(op[2])
            m.alt_state.add("buried")
        elif kind == "kick":
            for jid in self.buried[:op[1]]:
                self.jobs[jid].alt_state.add("ready")
        elif kind in ("kick-job", "reserve-job"):
            self.jobs[op[1]].alt_state.add("ready")

    def check(self, stats: dict[int, dict[str, str]], bodies: dict[int, bytes]) -> list[str]:
        """Hold the restarted server to this client's model; then adopt what it shows."""
        problems = []
        for jid, m in list(self.jobs.items()):
            st = stats.get(jid)
            if st is None:
                if m.maybe_gone:
                    del self.jobs[jid]
                    self.world.gone.add(jid)
                else:
                    problems.append(f"client {self.k}: job {jid} lost (acknowledged, last {m.state}, "
                                    f"pri {m.pri})")
                continue
            pri, state = int(st["pri"]), st["state"]
            if bodies.get(jid) != m.body:
                problems.append(f"client {self.k}: job {jid} body changed")
            if st["tube"] != self.tube:
                problems.append(f"client {self.k}: job {jid} moved to tube {st['tube']}")
            if pri != m.pri and pri not in m.alt_pri:
                problems.append(f"client {self.k}: job {jid} has pri {pri}, acknowledged {m.pri} "
                                f"(unacknowledged: {sorted(m.alt_pri)})")
            if state not in m.states_after_restart():
                problems.append(f"client {self.k}: job {jid} is {state}, expected one of "
                                f"{sorted(m.states_after_restart())} (last acknowledged: {m.state})")
            m.pri, m.state, m.maybe_gone = pri, state, False
            m.alt_pri.clear()
            m.alt_state.clear()
        kept = [j for j in self.buried if j in self.jobs and self.jobs[j].state == "buried"]
        kept += [j for j, m in self.jobs.items() if m.state == "buried" and j not in kept]
        self.buried = kept
        return problems


# --- rounds --------------------------------------------------------------------------


@attrs.define(eq=False)
class Harness:
    tmp: Path
    rng: random.Random
    seed: int
    world: World = attrs.Factory(World)
    workers: list[Worker] = attrs.Factory(list)
    logs: list[str] = attrs.Factory(list)
    caught_compacting: int = 0

    @property
    def data(self) -> Path:
        return self.tmp / "data"

    def start(self) -> Server:
        fsync = self.rng.choice(FSYNC_MODES)
        return start_smallstalk(self.tmp, *CRASH_ARGS, "--fsync", fsync, data_dir=self.data)

    def verify(self, srv: Server, ctx: str) -> None:
        """Everything acknowledged is there, nothing deleted came back, no id is reused."""
        w = self.world
        with connect(srv.port, timeout=IO_TIMEOUT) as c:
            assert c.call(b"use probe\r\n").status == b"USING"
            probe = c.put(b"probe")
            assert probe.status == b"INSERTED", (ctx, probe)
            seen = max(w.acked | {w.floor})
            assert probe.id > seen, f"{ctx}: new put got id {probe.id}; ids up to {seen} were seen"
            window = set(range(w.floor + 1, probe.id))  # ids handed out since the last check
            known = {jid for wk in self.workers for jid in wk.jobs}
            ask = sorted(known | w.gone | window)
            stats = stats_jobs(c, ask)
            bodies = peek_ids(c, sorted(stats))
            back = sorted(w.gone & stats.keys())
            assert not back, f"{ctx}: deleted jobs came back: {back}"
            problems = []
            for wk in self.workers:
                problems += wk.check(stats, bodies)
            by_tube = {wk.tube: wk for wk in self.workers}
            for jid in sorted(window - known):
                if jid not in stats:
                    continue
                st = stats[jid]
                wk = by_tube.get(st["tube"])
                if wk is None or wk.inflight_put is None or bodies[jid] != wk.inflight_put:
                    problems.append(f"job {jid} in {st['tube']} exists, but no client was told of it "
                                    "and none had a put cut off")
                    continue
                wk.jobs[jid] = JobModel(bodies[jid], int(st["pri"]), st["state"], int(st["ttr"]))
                if st["state"] == "buried":
                    wk.buried.append(jid)
                wk.inflight_put = None
                w.acked.add(jid)
            for wk in self.workers:
                wk.inflight_put = None
                problems += self.check_tube(c, wk)
            assert not problems, f"{ctx}:\n" + "\n".join(problems[:40])
            assert c.call(b"delete %d\r\n" % probe.id).status == b"DELETED"
            w.gone.add(probe.id)
            w.acked.add(probe.id)
            w.floor = probe.id

    @staticmethod
    def check_tube(c: Client, wk: Worker) -> list[str]:
        r = c.call(b"stats-tube %s\r\n" % wk.tube.encode())
        counts = collections.Counter()
        if r.status == b"OK":
            y = r.yaml()
            for name in ("ready", "reserved", "delayed", "buried"):
                counts[name] = int(y[f"current-jobs-{name}"])
        else:
            assert r.status == b"NOT_FOUND", r
        problems = []
        if sum(counts.values()) != len(wk.jobs):
            problems.append(f"tube {wk.tube}: {sum(counts.values())} jobs, client knows {len(wk.jobs)}")
        if counts["reserved"]:
            problems.append(f"tube {wk.tube}: {counts['reserved']} jobs still reserved after a restart")
        if wk.buried:
            assert c.call(b"use %s\r\n" % wk.tube.encode()).status == b"USING"
            top = c.call(b"peek-buried\r\n")
            if top.status != b"FOUND" or top.id != wk.buried[0]:
                problems.append(f"tube {wk.tube}: peek-buried {top.line!r}, expected {wk.buried[0]}")
        return problems

    def round(self, srv: Server, rnd: int) -> tuple[Server, str]:
        stop = threading.Event()
        threads = [threading.Thread(target=wk.run, args=(srv.port, stop), daemon=True)
                   for wk in self.workers]
        for t in threads:
            t.start()
        when = self.rng.choice(("anytime", "compacting"))
        if when == "anytime":
            time.sleep(self.rng.uniform(0.1, 1.5))  # the random moment of the crash
        else:
            deadline = time.monotonic() + 5.0
            while not children(srv.pid) and time.monotonic() < deadline:
                time.sleep(0.005)
            when = "after a compactor started" if children(srv.pid) else "(no compaction in 5s)"
            time.sleep(self.rng.uniform(0.0, 0.6))  # a compaction takes ~0.3-0.6 s here
        power_cut = self.rng.random() < 0.5
        running = children(srv.pid)
        orphans = crash(srv, with_children=power_cut)
        if running:
            self.caught_compacting += 1
            when += ", mid-compaction"
        self.logs.append(srv.log())
        stop.set()
        for t in threads:
            t.join(JOIN_TIMEOUT)
            assert not t.is_alive(), "a client thread did not finish after the crash"
        for wk in self.workers:
            assert not wk.errors, f"round {rnd} (seed {self.seed}):\n" + "\n".join(wk.errors)
            wk.crashed()
        ctx = (f"round {rnd} (seed {self.seed}; killed {when}, "
               f"{'with' if power_cut else 'without'} its compactor)")
        try:
            new = self.start()
        except RuntimeError as e:
            raise AssertionError(f"{ctx}: restart failed: {e}") from None
        try:
            self.verify(new, ctx)
        except BaseException:
            new.kill()
            raise
        wait_gone(orphans, 20.0)
        return new, ctx


def test_crash_recovery_under_load(tmp_path: Path, servers: list[Server]) -> None:
    seed = int(SEED) if SEED else random.randrange(2**32)
    rng = random.Random(seed)
    h = Harness(tmp_path, rng, seed)
    h.workers = [Worker(k, random.Random(rng.random()), h.world) for k in range(CLIENTS)]
    srv = h.start()
    servers.append(srv)
    for rnd in range(ROUNDS):
        srv, _ = h.round(srv, rnd)
        servers.append(srv)
    h.logs.append(srv.log())
    srv.kill()
    # In-process: the directory the last server left is consistent and holds exactly the model.
    rec = recovery.recover(h.data, repair=False)
    rec.state.check()
    model = {jid for wk in h.workers for jid in wk.jobs}
    assert set(rec.state.jobs) == model
    ops = sum((wk.ops for wk in h.workers), collections.Counter())
    print(f"seed {seed}, {ROUNDS} rounds, {sum(ops.values())} acknowledged ops: {dict(ops)}; "
          f"{h.caught_compacting} kills during compaction")
    for kind in ("put", "reserve", "release", "bury", "touch", "delete", "delete-reserved", "kick",
                 "kick-job", "reserve-job", "rescue"):
        assert ops[kind] > 0, f"the workload never did {kind}: {dict(ops)}"
    assert any("compacted" in log for log in h.logs), "no compaction happened"
    if ROUNDS >= 6:
        assert h.caught_compacting > 0, "no kill landed while a compactor was running"


# --- targeted crashes ---------------------------------------------------------------------


def segment_records(data: Path) -> list:
    """The records in the segments right now (read while the server runs: best effort)."""
    out = []
    for _, path in aof.list_segments(data / "aof"):
        try:
            out += [e[1] for e in logread.iter_segment(path) if not isinstance(e, aof.FrameScan)]
        except (FileNotFoundError, CorruptionError):
            continue  # deleted by the compactor, or its header not written yet
    return out


def not_just_rotated(c: Client, data: Path) -> None:
    """Log one more record if the newest segment is empty, so that a targeted test is not
    stopped by the empty-segment restart failure (test_restart_after_stop_right_after_rotation)."""
    if aof.list_segments(data / "aof")[-1][1].stat().st_size == aof.HEADER_SIZE:
        assert c.call(b"use not-just-rotated\r\n").status == b"USING"


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_restart_after_stop_right_after_rotation(tmp_path: Path, how: str,
                                                 servers: list[Server]) -> None:
    """The newest segment holds only its header (a rotation just happened): start-up must cope."""
    data = tmp_path / "data"
    srv = start_smallstalk(tmp_path, "--segment-records", "5", "--compact-interval", "3600",
                           data_dir=data)
    servers.append(srv)
    with connect(srv.port) as c:
        ids: list[int] = []
        for i in range(12):  # put until a put's commit rotates (start-up logs a record or two)
            ids.append(c.put(b"job %d" % i).id)
            if aof.list_segments(data / "aof")[-1][1].stat().st_size == aof.HEADER_SIZE:
                break
        else:
            raise AssertionError("no rotation after 12 puts with --segment-records 5")
        if how == "SIGKILL":
            srv.kill()
        else:
            srv.stop()
    try:
        srv = start_smallstalk(tmp_path, "--segment-records", "5", data_dir=data)
    except RuntimeError as e:
        raise AssertionError(f"restart after {how} failed:\n{e}") from None
    servers.append(srv)
    with connect(srv.port) as c:
        assert peek_ids(c, ids + [ids[-1] + 1]) == {i: b"job %d" % n for n, i in enumerate(ids)}
        r = c.put(b"next")
        assert r.status == b"INSERTED" and r.id > ids[-1]


@pytest.mark.parametrize("compacted", [False, True], ids=["in-aof", "in-snapshot"])
@pytest.mark.parametrize("crash_after", ["reserve-job", "release"])
def test_reserve_job_from_buried_then_release_is_ready_after_crash(
    tmp_path: Path, compacted: bool, crash_after: str, servers: list[Server]
) -> None:
    data = tmp_path / "data"
    args = ("--segment-records", "10", "--compact-interval", "0.2")
    srv = start_smallstalk(tmp_path, *args, data_dir=data)
    servers.append(srv)
    with connect(srv.port) as c:
        jid = c.put(b"the job", pri=10).id
        assert c.call(b"reserve\r\n").id == jid
        assert c.call(b"bury %d 20\r\n" % jid).status == b"BURIED"
        if compacted:  # fold the bury into a snapshot
            for i in range(23):
                assert c.put(b"filler %d" % i, pri=100).status == b"INSERTED"
            snaps = data / "snapshots"
            wait_for(lambda: any(seq >= 3 for seq, _ in aof.list_snapshots(snaps)), 10.0,
                     "a snapshot holding the bury")
        r = c.call(b"reserve-job %d\r\n" % jid)
        assert (r.status, r.id, r.body) == (b"RESERVED", jid, b"the job")
        if crash_after == "release":
            assert c.call(b"release %d 30 0\r\n" % jid).status == b"RELEASED"
        not_just_rotated(c, data)
        crash(srv, with_children=True)
    srv = start_smallstalk(tmp_path, *args, data_dir=data)
    servers.append(srv)
    with connect(srv.port) as c:
        st = c.stats_job(jid)
        assert st is not None
        assert (st["state"], int(st["pri"])) == ("ready", 30 if crash_after == "release" else 20)
        assert c.call(b"peek-buried\r\n").status == b"NOT_FOUND"


def test_ids_not_reused_when_everything_was_compacted(tmp_path: Path, servers: list[Server]) -> None:
    """The newest jobs were deleted and every put folded into the snapshot: ids still go on."""
    data = tmp_path / "data"
    srv = start_smallstalk(tmp_path, "--segment-records", "10", "--compact-interval", "0.2",
                           data_dir=data)
    servers.append(srv)
    with connect(srv.port) as c:
        ids = [c.put(b"j%d" % i).id for i in range(12)]
        for jid in ids[6:]:
            assert c.call(b"delete %d\r\n" % jid).status == b"DELETED"
        # Rotate with records that are not puts until a snapshot holds every put and delete.
        for i in range(30):
            assert c.call(b"use tube-%d\r\n" % (i % 2)).status == b"USING"
        wait_for(lambda: aof.list_snapshots(data / "snapshots") and not any(
            isinstance(rec, records.Put | records.Delete) for rec in segment_records(data)),
            10.0, "the puts and deletes to be compacted")
        not_just_rotated(c, data)
        crash(srv, with_children=True)
    srv = start_smallstalk(tmp_path, "--segment-records", "10", data_dir=data)
    servers.append(srv)
    with connect(srv.port) as c:
        assert peek_ids(c, ids) == {j: b"j%d" % n for n, j in enumerate(ids) if n < 6}
        r = c.put(b"new")
        assert r.status == b"INSERTED" and r.id > ids[-1], f"job id reused: {r.line!r}"


def test_released_priorities_survive_crash(tmp_path: Path, servers: list[Server]) -> None:
    data = tmp_path / "data"
    srv = start_smallstalk(tmp_path, *CRASH_ARGS, data_dir=data)
    servers.append(srv)
    want: dict[int, int] = {}
    with connect(srv.port) as c:
        ids = [r.id for r in c.pipeline([b"put 5 0 60 3\r\nabc\r\n"] * 300)]
        for rnd in range(4):  # every job released with a new priority, several times
            got = c.pipeline([b"reserve-with-timeout 0\r\n"] * len(ids))
            assert sorted(r.id for r in got) == ids
            pris = {jid: 1000 * rnd + jid for jid in ids}
            rel = c.pipeline([b"release %d %d 0\r\n" % (j, p) for j, p in pris.items()])
            assert {r.status for r in rel} == {b"RELEASED"}
            want = pris
        not_just_rotated(c, data)
        crash(srv, with_children=True)
    srv = start_smallstalk(tmp_path, *CRASH_ARGS, data_dir=data)
    servers.append(srv)
    with connect(srv.port) as c:
        got = {j: int(s["pri"]) for j, s in stats_jobs(c, ids).items()}
        assert got == want


# --- disk use under churn -------------------------------------------------------------------

CHURN_LIVE = 1000
CHURN_BODY = 100
CHURN_BATCH = 250
CHURN_SEGMENT_RECORDS = 2000
CHURN_LAG_SEGMENTS = 24  # closed segments allowed to pile up while a (CPU-starved) compaction runs


def disk_use(data: Path) -> tuple[int, set[str]]:
    """Bytes on disk (as du counts them) under the data directory, and the segment names there."""
    total = 0
    segs = set()
    for sub in ("aof", "snapshots"):
        try:
            entries = list(os.scandir(data / sub))
        except FileNotFoundError:
            continue
        for e in entries:
            try:
                total += e.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                continue
            if sub == "aof" and e.name.endswith(".aof"):
                segs.add(e.name)
    return total, segs


def test_disk_use_stays_bounded_under_churn(tmp_path: Path, servers: list[Server]) -> None:
    """1,000 live jobs reserved and released SMALLSTALK_CHURN_OPS times: compaction keeps du small."""
    data = tmp_path / "data"
    args = ("--segment-records", str(CHURN_SEGMENT_RECORDS), "--compact-interval", "0.2")
    srv = start_smallstalk(tmp_path, *args, data_dir=data)
    servers.append(srv)
    rng = random.Random(1)
    samples: list[int] = []
    seen: set[str] = set()
    most_segments = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal most_segments
        while not stop.wait(0.05):
            used, segs = disk_use(data)
            samples.append(used)
            seen.update(segs)
            most_segments = max(most_segments, len(segs))

    sampler = threading.Thread(target=sample, daemon=True)
    pri: dict[int, int] = {}
    started = time.monotonic()
    with connect(srv.port, timeout=30.0) as c:
        bodies = [b"%06d" % i + b"x" * (CHURN_BODY - 6) for i in range(CHURN_LIVE)]
        ids = [r.id for r in c.pipeline([put_cmd(b, ttr=600) for b in bodies])]
        pri = dict.fromkeys(ids, 0)
        sampler.start()
        done = 0
        while done < CHURN_OPS:
            n = min(CHURN_BATCH, CHURN_OPS - done)
            got = c.pipeline([b"reserve-with-timeout 0\r\n"] * n)
            assert all(r.status == b"RESERVED" for r in got), {r.line for r in got}
            new = {r.id: rng.randrange(2**32) for r in got}
            rel = c.pipeline([b"release %d %d 0\r\n" % item for item in new.items()])
            assert all(r.status == b"RELEASED" for r in rel), {r.line for r in rel}
            pri.update(new)
            done += n
        churn_time = time.monotonic() - started
        # Let the compactor catch up: the last closed segments get folded too.
        wait_for(lambda: len(disk_use(data)[1]) <= 2, 30.0, "compaction to catch up")
        stop.set()
        sampler.join(10)
        final, _ = disk_use(data)
        srv.kill()

    snaps = aof.list_snapshots(data / "snapshots")
    assert snaps, "no snapshot was written"
    live = snaps[-1][1].stat().st_size  # the live data, as the compactor wrote it
    seg_max = 24 + CHURN_SEGMENT_RECORDS * 40  # a segment of reserve/release records, generously
    ahead = aof.PREALLOCATE  # the open segment's space allocated ahead of its records
    bound = 3 * live + CHURN_LAG_SEGMENTS * seg_max + ahead + (256 << 10)
    records = 2 * CHURN_OPS
    print(f"churn: {CHURN_OPS} releases in {churn_time:.1f}s; du peak {max(samples)} B, final {final} B, "
          f"bound {bound} B; live {live} B; {len(seen)} segments seen, at most {most_segments} at once")
    assert samples, "the sampler took no samples"
    assert max(samples) <= bound, f"disk use peaked at {max(samples)} B (bound {bound} B)"
    assert final <= 2 * live + 2 * seg_max + ahead + (64 << 10)
    if records >= 10 * CHURN_SEGMENT_RECORDS:
        assert len(seen) >= records // CHURN_SEGMENT_RECORDS // 2, f"only {len(seen)} segments seen"
        assert most_segments <= CHURN_LAG_SEGMENTS

    srv = start_smallstalk(tmp_path, *args, data_dir=data)
    servers.append(srv)
    m = re.search(r"recovered (\d+) jobs \(snapshot \S+ \+ (\d+) records\)", srv.log())
    assert m and int(m.group(1)) == CHURN_LIVE, srv.log()
    assert int(m.group(2)) <= 2 * CHURN_SEGMENT_RECORDS, "start-up replayed records compaction should have folded"
    with connect(srv.port, timeout=30.0) as c:
        st = stats_jobs(c, ids)
        assert {j: int(s["pri"]) for j, s in st.items()} == pri
        assert {s["state"] for s in st.values()} == {"ready"}
        assert peek_ids(c, ids) == dict(zip(ids, bodies, strict=True))
        r = c.put(b"after the churn")
        assert r.status == b"INSERTED" and r.id > max(ids), f"job id reused: {r.line!r}"
