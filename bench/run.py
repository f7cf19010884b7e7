#!/usr/bin/env python3
"""smallstalk vs beanstalkd on loopback: throughput, latency, CPU per op, RSS, restart.

    python bench/run.py            # full run (make bench), ~10-15 minutes
    python bench/run.py --quick    # reduced counts (make bench-quick), ~2-3 minutes
    python bench/run.py --tiny     # a few hundred ops, one point per mode (the smoke test)

Every measurement point starts a fresh server (fresh data directory) on
127.0.0.1 and a free port, drives it with bench/loadgen.py for at most
`--duration` seconds and stops it; smallstalk and beanstalkd are measured back
to back for each point so their ratio compares like with like on a shared
machine. Server CPU per operation comes from /proc/PID/stat (utime+stime,
all threads) over the measured interval; RSS from /proc/PID/status.

Results: a table on stdout, bench-results/<timestamp>.json and
bench-results/latest.json (everything measured), bench-results/latest.md
(markdown tables for the README). See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import loadgen  # noqa: E402

SERVERS = ("smallstalk", "beanstalkd")
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Durability modes, side by side: (smallstalk flags, beanstalkd flags, needs a data dir)
MODES = {
    "memory": ([], [], False),
    "never": (["--fsync", "never"], ["-F"], True),
    "always": (["--fsync", "always"], ["-f", "0"], True),
}
MODE_LABELS = {
    "memory": "no persistence (no --data-dir / no -b)",
    "never": "smallstalk --data-dir --fsync never  vs  beanstalkd -b DIR -F",
    "always": "smallstalk --data-dir --fsync always  vs  beanstalkd -b DIR -f 0",
}
WORKLOAD_LABELS = {
    "put": "put",
    "rd": "reserve+delete",
    "cycle": "put+reserve+delete",
    "put-pipe": "put, 100/send",
    "rd-pipe": "reserve+delete, 100/send",
}

PRESETS = {
    # conns: request/response points per workload; the fsync-always put/cycle
    # points at 10/50/200 and the never put at 50 are the targets.
    "full": dict(duration=5.0, conns=(1, 10, 100), pipe=(("put-pipe", 1), ("put-pipe", 10),
                 ("rd-pipe", 10)), rss_jobs=1_000_000, startup_jobs=1_000_000,
                 rd_jobs=300_000, max_ops=0, extras=True, rounds=2,
                 handoff_samples=2000, spawn_samples=7, rate_seconds=6.0),
    "quick": dict(duration=1.0, conns=(1, 10, 100), pipe=(("put-pipe", 10),),
                  rss_jobs=100_000, startup_jobs=100_000, rd_jobs=40_000, max_ops=0,
                  extras=True, rounds=1, handoff_samples=300, spawn_samples=3,
                  rate_seconds=4.0),
    "tiny": dict(duration=0.5, conns=(), pipe=(), rss_jobs=2_000, startup_jobs=2_000,
                 rd_jobs=600, max_ops=300, extras=False, rounds=1,
                 handoff_samples=20, spawn_samples=1, rate_seconds=0.0),
}
# The tiny preset covers every workload once across the three modes.
TINY_POINTS = (("memory", "put", 2), ("memory", "rd-pipe", 2), ("never", "cycle", 2),
               ("never", "put-pipe", 1), ("always", "rd", 2))

def _targets() -> tuple:
    """The performance issue's goals, as ratios smallstalk / beanstalkd in one run.
    (description, mode, workload, conns, metric, goal, comparison)."""
    t = []
    ops = "ops_per_sec"
    for mode in ("memory", "never"):  # request/response at 10+ connections
        for wl in ("put", "rd", "cycle"):
            for conns in (10, 100):
                t.append((f"req/resp at {conns} conns", mode, wl, conns, ops, 0.67, ">="))
    for mode in ("memory", "never", "always"):  # one connection
        for wl in ("put", "rd", "cycle"):
            t.append(("one connection", mode, wl, 1, ops, 0.8, ">="))
    for mode in ("memory", "never", "always"):  # pipelined, 100 per send
        for wl, conns in (("put-pipe", 1), ("put-pipe", 10), ("rd-pipe", 10)):
            t.append(("pipelined, 100 per send", mode, wl, conns, ops, 1.2, ">="))
    for wl, conns in (("put", 10), ("put", 50), ("put", 100), ("put", 200), ("rd", 10),
                      ("rd", 100), ("cycle", 10), ("cycle", 50), ("cycle", 100),
                      ("cycle", 200)):  # durable rows keep their lead
        t.append(("fsync every ack, 10+ conns", "always", wl, conns, ops, 2.0, ">="))
    return tuple(t)


TARGETS = _targets()
RSS_GOAL = 1.3  # RSS per job, at most this ratio
RESTART_GOAL = 1.0  # restart with a million jobs: no slower
HANDOFF_GOAL = 1.25  # hand-off p50 and p99, at most this ratio
SPAWN_GOAL_MS = 100.0  # spawn to first reply, absolute


# --- servers ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_ticks(pid: int) -> int:
    return sum(proc_user_sys_ticks(pid))


def proc_user_sys_ticks(pid: int) -> tuple[int, int]:
    """(utime, stime) of the whole thread group, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def proc_cpu_ns(pid: int) -> int | None:
    """utime+stime of the whole thread group in ns: the kernel's CPU clock of another process
    (clock_getcpuclockid), the same sum /proc/PID/stat reports in 10 ms ticks."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    except OSError:
        return None


def proc_status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def fsync_probe(directory: Path, count: int = 10, limit: float = 0.5) -> float | None:
    """4 KiB appends + fsync per second on the disk under `directory`, right now.

    Other tenants' I/O moves this a lot; it puts the fsync-bound rows in context."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        block = b"\0" * 4096
        t0 = time.monotonic()
        done = 0
        while done < count and time.monotonic() - t0 < limit:
            os.write(fd, block)
            os.fsync(fd)
            done += 1
        return round(done / (time.monotonic() - t0), 1)
    except OSError:
        return None
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


class Server:
    """One server process we started; stop() signals only its PID."""

    def __init__(self, kind: str, mode: str, workdir: Path, data_dir: Path | None = None,
                 smallstalk_python: str = sys.executable, src: Path | None = None):
        self.kind = kind
        self.mode = mode
        self.port = free_port()
        self.data_dir = data_dir
        if MODES[mode][2] and data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix=f"{kind}-{mode}-", dir=workdir))
        ss_flags, bs_flags, persistent = MODES[mode]
        if kind == "smallstalk":
            cmd = [smallstalk_python, "-m", "smallstalk", "serve", "-l", "127.0.0.1",
                   "-p", str(self.port)]
            if persistent:
                cmd += ["--data-dir", str(self.data_dir), *ss_flags]
        else:
            cmd = [beanstalkd_path(), "-l", "127.0.0.1", "-p", str(self.port)]
            if persistent:
                cmd += ["-b", str(self.data_dir), *bs_flags]
        self.cmd = cmd
        # src: a directory holding a copy of the smallstalk package to run instead of the
        # working tree (PYTHONPATH beats the editable install; cwd must not be the repo).
        self.cwd = REPO if src is None or kind != "smallstalk" else src
        self.env = None
        if src is not None and kind == "smallstalk":
            self.env = dict(os.environ)
            self.env["PYTHONPATH"] = os.pathsep.join(
                [str(src)] + ([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH") else []))
        self.log_path = workdir / f"{kind}-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.t_spawn = 0.0

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.t_spawn = time.monotonic()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.cwd, env=self.env,
                                         stdin=subprocess.DEVNULL)

    def wait_port(self, timeout: float = 60.0) -> float:
        """Seconds from spawn until a TCP connect succeeds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return time.monotonic() - self.t_spawn
            except OSError:
                time.sleep(0.005)
        raise RuntimeError(f"{self.kind} did not listen within {timeout}s")

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Seconds from spawn until a `stats` is answered: a server may accept
        connections (listen backlog) well before it serves them."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                stats(self.port, timeout=max(0.1, deadline - time.monotonic()))
                return time.monotonic() - self.t_spawn
            except (OSError, RuntimeError):
                if not self.alive():
                    raise RuntimeError(f"{self.kind} exited: {self.log_tail()}") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def start(self) -> Server:
        self.spawn()
        self.wait_port()
        self.wait_ready()
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_ticks(self) -> int:
        return proc_cpu_ticks(self.pid)

    def rss_kb(self) -> int:
        return proc_status_kb(self.pid, "VmRSS")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def log_tail(self, n: int = 800) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def beanstalkd_path() -> str:
    path = shutil.which("beanstalkd") or ("/usr/bin/beanstalkd"
                                          if os.path.exists("/usr/bin/beanstalkd") else None)
    if path is None:
        raise SystemExit("beanstalkd is not installed (apt-get install beanstalkd)")
    return path


def stats(port: int, timeout: float = 10.0) -> dict[str, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        return stats_on(s)


def stats_on(s: socket.socket) -> dict[str, str]:
    s.sendall(b"stats\r\n")
    head, rest = _read_line(s, b"")
    if not head.startswith(b"OK "):
        raise RuntimeError(f"stats answered {head!r}")
    need = int(head.split()[1]) + 2
    rest = _recv_until(s, rest, need)
    out = {}
    for line in rest[: need - 2].decode().splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


def current_jobs(st: dict[str, str]) -> int:
    return sum(int(st.get(f"current-jobs-{k}", 0))
               for k in ("ready", "reserved", "delayed", "buried"))


# --- measurements ----------------------------------------------------------------------


class Bench:
    def __init__(self, args, preset: dict):
        self.args = args
        self.preset = preset
        self.duration = args.duration or preset["duration"]
        self.workdir = Path(tempfile.mkdtemp(prefix="smallstalk-bench-", dir=args.tmp))
        # Other people edit the server while a run takes minutes: measure one version.
        self.src = None
        if not args.live_source:
            self.src = self.workdir / "src"
            shutil.copytree(Path(args.source or REPO) / "smallstalk", self.src / "smallstalk",
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        self.git = git_info(self.src)  # commit and dirty flag as of the start
        self.servers = [s for s in SERVERS if s in args.servers]
        self.only = re.compile(args.only) if args.only else None
        self.log = sys.stderr
        self.rates: dict[tuple, float] = {}
        self.rounds = args.rounds if args.rounds is not None else preset["rounds"]

    def say(self, text: str) -> None:
        print(text, file=self.log, flush=True)

    def points(self) -> list[tuple[str, str, int]]:
        if self.args.preset == "tiny":
            pts = list(TINY_POINTS)
        else:
            pts = []
            for mode in MODES:
                for wl in ("put", "rd", "cycle"):
                    cs = set(self.preset["conns"])
                    if self.preset["extras"]:
                        if mode == "always" and wl in ("put", "cycle"):
                            cs |= {10, 50, 200}
                        if mode == "never" and wl == "put":
                            cs |= {50}
                    pts += [(mode, wl, c) for c in sorted(cs)]
                for wl, c in self.preset["pipe"]:
                    pts.append((mode, wl, c))
                    if mode == "never" and wl == "put-pipe" and self.preset["extras"]:
                        for extra in (1, 10):  # the pipelining target's points
                            if (wl, extra) not in self.preset["pipe"]:
                                pts.append((mode, wl, extra))
        if self.only:
            pts = [p for p in pts if self.only.search(f"{p[0]}/{p[1]}/{p[2]}")]
        return pts

    def drive(self, srv: Server, workload: str, conns: int, **kw) -> dict:
        def probe():
            user, system = proc_user_sys_ticks(srv.pid)
            return {"ticks": user + system, "user": user, "sys": system,
                    "ns": proc_cpu_ns(srv.pid), "t": time.monotonic(), "load": loadavg()}

        res = loadgen.run(srv.port, workload, conns, procs=self.args.procs, probe=probe,
                          keep_latencies=True, **kw)
        before, after = res.pop("probe")
        stat_secs = (after["ticks"] - before["ticks"]) / CLK_TCK
        secs = stat_secs
        if before["ns"] is not None and after["ns"] is not None:
            secs = (after["ns"] - before["ns"]) / 1e9
        ops = res["ops"]
        res["server_cpu_s"] = round(secs, 6)
        res["server_cpu_pct"] = 100.0 * secs / max(1e-9, after["t"] - before["t"])
        res["server_cpu_us_per_op"] = round(1e6 * secs / ops, 2) if ops else None
        res["server_cpu_stat_us_per_op"] = round(1e6 * stat_secs / ops, 2) if ops else None
        # user (interpreter, parsing, state) vs system (syscalls, loopback TCP, fsync) share
        us, sy = after["user"] - before["user"], after["sys"] - before["sys"]
        res["server_sys_share"] = round(sy / (us + sy), 3) if us + sy else None
        res["_ticks"] = (us, sy)
        res["_interval"] = after["t"] - before["t"]
        res["loadavg"] = after["load"]
        return res

    def measure_point(self, kind: str, mode: str, workload: str, conns: int,
                      duration: float) -> dict:
        """One server, one point; a point that fails is tried once more (the first
        failure is kept in the result as `retried`)."""
        try:
            res = self._measure_point(kind, mode, workload, conns, duration)
            if res["ops"] == 0 and res["errors"]:
                raise RuntimeError(f"no op succeeded, {res['errors']} errors; server log: "
                                   f"{res.get('server_log', '')}")
            return res
        except Exception as e:  # noqa: BLE001
            first = f"{type(e).__name__}: {e}"
            self.say(f"    {kind} {mode}/{workload}/{conns} failed ({first[:300]}); once more")
        res = self._measure_point(kind, mode, workload, conns, duration)
        res["retried"] = first
        if res["ops"] == 0 and res["errors"]:
            raise RuntimeError(f"no op succeeded twice, {res['errors']} errors; server log: "
                               f"{res.get('server_log', '')}")
        return res

    def _measure_point(self, kind: str, mode: str, workload: str, conns: int,
                       duration: float) -> dict:
        srv = Server(kind, mode, self.workdir, src=self.src).start()
        try:
            info = {}
            if srv.data_dir is not None:
                info["disk_fsync_per_sec"] = fsync_probe(srv.data_dir)
            if workload in ("rd", "rd-pipe"):
                # Jobs to consume: loaded pipelined, bounded in count and time;
                # the point then ends at its duration or when the queue runs dry
                # (the rate is then over the time until it ran dry).
                pre = loadgen.run(srv.port, "load", min(10, max(2, conns)),
                                  procs=self.args.procs,
                                  total=self.jobs_to_consume(kind, mode, workload, duration),
                                  duration=max(2.0, duration * 1.5))
                info["preloaded"] = pre["ops"]
                info["preload_per_sec"] = round(pre["ops_per_sec"])
            res = self.drive(srv, workload, conns, duration=duration,
                             max_ops=self.preset["max_ops"])
            res.update(info)
            if workload in ("rd", "rd-pipe"):
                res["ran_dry"] = res["elapsed"] < duration * 0.98
            if not srv.alive():
                raise RuntimeError(f"{kind} died: {srv.log_tail()}")
            if res["errors"]:
                res["server_log"] = srv.log_tail(2000)
            return res
        finally:
            srv.stop()
            if srv.data_dir is not None:
                shutil.rmtree(srv.data_dir, ignore_errors=True)

    def jobs_to_consume(self, kind: str, mode: str, workload: str, duration: float) -> int:
        """Enough jobs for the point's duration: twice what the fastest matching put point
        managed (a reserve+delete pair is at least as much work as a put), capped."""
        cap = self.preset["rd_jobs"]
        put = {"rd": "put", "rd-pipe": "put-pipe"}[workload]
        known = {c: rate for (k, m, w, c), rate in self.rates.items()
                 if (k, m, w) == (kind, mode, put)}
        if not known:
            return cap
        return int(min(cap, max(2000, 2.0 * duration * max(known.values()))))

    def run_points(self) -> list[dict]:
        """Each point: `rounds` alternating rounds of duration/rounds per server
        (A B B A ...), merged; alternation evens out drift on a shared machine."""
        out = []
        pts = self.points()
        rounds = max(1, self.rounds)
        for i, (mode, wl, conns) in enumerate(pts, 1):
            row = {"mode": mode, "workload": wl, "conns": conns,
                   "depth": 100 if wl in loadgen.PIPELINED else 1, "servers": {}}
            runs: dict[str, list] = {k: [] for k in self.servers}
            for rnd in range(rounds):
                order = self.servers if rnd % 2 == 0 else self.servers[::-1]
                for kind in order:
                    if runs[kind] and "error" in runs[kind][-1]:
                        continue
                    try:
                        r = self.measure_point(kind, mode, wl, conns, self.duration / rounds)
                    except Exception as e:  # noqa: BLE001 - one broken point must not end the run
                        r = {"error": f"{type(e).__name__}: {e}"}
                    runs[kind].append(r)
            for kind in self.servers:
                r = merge_runs(runs[kind])
                row["servers"][kind] = r
                if "ops_per_sec" in r:
                    self.rates[(kind, mode, wl, conns)] = r["ops_per_sec"]
                self.say(f"[{i}/{len(pts)}] {mode:6} {wl:8} {conns:3} conns  {kind:10} "
                         + (f"{r['ops_per_sec']:9.0f} ops/s  "
                            f"{_f(r['server_cpu_us_per_op'], 1):>6} µs/op  "
                            f"p50 {_f(r['lat_p50_us'], 0)} µs  p99 {_f(r['lat_p99_us'], 0)} µs  "
                            f"(server {r['server_cpu_pct']:.0f}% cpu "
                            f"{_pct(r['server_sys_share'])} sys, client "
                            f"{r['client_cpu_pct']:.0f}%, load {r['loadavg']:.1f}"
                            f"{', errors ' + str(r['errors']) if r['errors'] else ''}"
                            f"{_disk_note(r)}"
                            f"{', rounds ' + '/'.join(f'{x:.0f}' for x in r['rounds_ops_per_sec']) if len(r['rounds_ops_per_sec']) > 1 else ''})"
                            if "error" not in r else "ERROR " + r["error"][:300]))
            row["ratio"] = ratios(row["servers"])
            out.append(row)
        return out

    def run_rss(self) -> dict:
        n = self.preset["rss_jobs"] if self.args.rss_jobs is None else self.args.rss_jobs
        out = {"jobs": n, "body_bytes": 100, "servers": {}}
        if n <= 0:
            return out
        for kind in self.servers:
            srv = Server(kind, "memory", self.workdir, src=self.src).start()
            try:
                time.sleep(0.3)
                stats(srv.port)  # a connection has come and gone
                before = srv.rss_kb()
                res = loadgen.run(srv.port, "load", 4, procs=self.args.procs, total=n,
                                  duration=600.0)
                time.sleep(0.5)
                st = stats(srv.port)
                after = srv.rss_kb()
                held = current_jobs(st)
                r = {"rss_before_kb": before, "rss_after_kb": after,
                     "hwm_kb": proc_status_kb(srv.pid, "VmHWM"), "jobs_held": held,
                     "load_per_sec": round(res["ops_per_sec"]),
                     "bytes_per_job": round((after - before) * 1024 / max(1, held), 1),
                     "mib_per_million_jobs": round((after - before) / 1024 * 1e6 / max(1, held),
                                                   1)}
                if held != n:
                    r["error"] = f"loaded {held} of {n} jobs"
            except Exception as e:  # noqa: BLE001
                r = {"error": f"{type(e).__name__}: {e}"}
            finally:
                srv.stop()
            out["servers"][kind] = r
            self.say(f"RSS      {kind:10} {json.dumps(r)}")
        out["ratio"] = ratio_of(out["servers"], "bytes_per_job")
        return out

    def run_rate(self) -> dict:
        """A tube with max-rate: accuracy, and the CPU a limit adds to a reserve
        (bench/ratelimit.py); smallstalk only, beanstalkd has no such limit."""
        secs = self.preset["rate_seconds"] if self.args.rate_seconds is None \
            else self.args.rate_seconds
        if secs <= 0 or "smallstalk" not in self.servers:
            return {}
        import ratelimit

        try:  # the same copy of smallstalk/ as the other points (cwd comes first)
            r = ratelimit.measure(self.args.rate, secs, work=self.workdir,
                                  cwd=self.src if self.src is not None else REPO)
        except Exception as e:  # noqa: BLE001 - one broken section must not end the run
            r = {"error": f"{type(e).__name__}: {e}"}
        self.say(f"RATE     smallstalk {json.dumps(r)}")
        return r

    def run_startup(self) -> dict:
        n = self.preset["startup_jobs"] if self.args.startup_jobs is None \
            else self.args.startup_jobs
        out = {"jobs": n, "mode": "never", "servers": {}}
        if n <= 0:
            return out
        for kind in self.servers:
            data_dir = Path(tempfile.mkdtemp(prefix=f"{kind}-restart-", dir=self.workdir))
            try:
                srv = Server(kind, "never", self.workdir, data_dir=data_dir,
                             src=self.src).start()
                try:
                    res = loadgen.run(srv.port, "load", 4, procs=self.args.procs, total=n,
                                      duration=900.0)
                    loaded = current_jobs(stats(srv.port))
                finally:
                    srv.stop()
                disk = sum(p.stat().st_size for p in data_dir.rglob("*") if p.is_file())
                srv = Server(kind, "never", self.workdir, data_dir=data_dir, src=self.src)
                srv.spawn()
                t_port = srv.wait_port(timeout=600)
                t_ready, seen = self._wait_jobs(srv, loaded, timeout=600)
                r = {"jobs_loaded": loaded, "load_per_sec": round(res["ops_per_sec"]),
                     "disk_bytes": disk, "disk_bytes_per_job": round(disk / max(1, loaded), 1),
                     "port_s": round(t_port, 3), "ready_s": round(t_ready, 3),
                     "jobs_after_restart": seen, "rss_after_restart_kb": srv.rss_kb(),
                     "cpu_s": round(srv.cpu_ticks() / CLK_TCK, 2)}
                if loaded != n or seen != loaded:
                    r["error"] = f"loaded {loaded} of {n}, {seen} after restart"
                srv.stop()
            except Exception as e:  # noqa: BLE001
                r = {"error": f"{type(e).__name__}: {e}"}
            finally:
                shutil.rmtree(data_dir, ignore_errors=True)
            out["servers"][kind] = r
            self.say(f"RESTART  {kind:10} {json.dumps(r)}")
        out["ratio"] = ratio_of(out["servers"], "ready_s")
        return out

    def _wait_jobs(self, srv: Server, want: int, timeout: float) -> tuple[float, int]:
        """Seconds from spawn until `stats` shows `want` jobs."""
        deadline = time.monotonic() + timeout
        seen = -1
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
                    while time.monotonic() < deadline:
                        seen = current_jobs(stats_on(s))
                        if seen >= want:
                            return time.monotonic() - srv.t_spawn, seen
                        time.sleep(0.01)
            except OSError:
                if not srv.alive():
                    raise RuntimeError(f"{srv.kind} exited: {srv.log_tail()}") from None
                time.sleep(0.01)
        raise RuntimeError(f"{srv.kind}: {seen} of {want} jobs after {timeout}s")

    # --- hand-off latency and spawn-to-first-reply (issue: the figures a user feels) ----

    def run_handoff(self) -> dict:
        """A worker waits in `reserve`; another connection puts one job; one sample is the
        time from sending the put until the worker holds the job (its RESERVED and body)."""
        n = self.preset["handoff_samples"] if self.args.handoff_samples is None \
            else self.args.handoff_samples
        out = {"samples": n, "body_bytes": 100, "modes": {}}
        if n <= 0:
            return out
        for mode in ("memory", "always"):
            row = {}
            for kind in self.servers:
                srv = Server(kind, mode, self.workdir, src=self.src).start()
                try:
                    if srv.data_dir is not None:
                        probe = fsync_probe(srv.data_dir)
                    row[kind] = handoff_samples(srv.port, n)
                    if srv.data_dir is not None:
                        row[kind]["disk_fsync_per_sec"] = probe
                except Exception as e:  # noqa: BLE001
                    row[kind] = {"error": f"{type(e).__name__}: {e}"}
                finally:
                    srv.stop()
                    if srv.data_dir is not None:
                        shutil.rmtree(srv.data_dir, ignore_errors=True)
                self.say(f"HANDOFF  {mode:6} {kind:10} {json.dumps(row[kind])}")
            out["modes"][mode] = {"servers": row, "ratio": {
                k: ratio_of(row, k) for k in ("p50_us", "p99_us", "max_us")}}
        return out

    def run_spawn(self) -> dict:
        """Spawn the server, connect with retries, time until the first reply to `stats`
        (median and max of a few spawns); without a data dir and with an empty one."""
        n = self.preset["spawn_samples"] if self.args.spawn_samples is None \
            else self.args.spawn_samples
        out = {"samples": n, "cases": {}}
        if n <= 0:
            return out
        for case in ("no data dir", "empty data dir"):
            row = {}
            for kind in self.servers:
                times, cpus = [], []
                try:
                    for _ in range(n):
                        t, c = spawn_to_first_reply(self, kind, case != "no data dir")
                        times.append(t)
                        cpus.append(c or 0.0)
                    times.sort()
                    cpus.sort()
                    row[kind] = {"median_ms": round(1e3 * times[len(times) // 2], 2),
                                 "min_ms": round(1e3 * times[0], 2),
                                 "max_ms": round(1e3 * times[-1], 2),
                                 "cpu_median_ms": round(1e3 * cpus[len(cpus) // 2], 2)}
                except Exception as e:  # noqa: BLE001
                    row[kind] = {"error": f"{type(e).__name__}: {e}"}
                self.say(f"SPAWN    {case:14} {kind:10} {json.dumps(row[kind])}")
            out["cases"][case] = {"servers": row, "ratio": ratio_of(row, "median_ms")}
        return out

    def cleanup(self) -> None:
        if not self.args.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _recv_until(s: socket.socket, buf: bytes, need: int) -> bytes:
    while len(buf) < need:
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError("connection closed")
        buf += chunk
    return buf


def _read_line(s: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
    while b"\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError("connection closed")
        buf += chunk
    line, _, rest = buf.partition(b"\r\n")
    return line, rest


def handoff_samples(port: int, n: int, settle: float = 0.0005) -> dict:
    """n hand-offs (see Bench.run_handoff): p50/p99/max in µs."""
    body = b"x" * 100
    put = b"put 1024 0 60 %d\r\n%s\r\n" % (len(body), body)
    lat = []
    with socket.create_connection(("127.0.0.1", port)) as w, \
            socket.create_connection(("127.0.0.1", port)) as prod:
        for s in (w, prod):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            w.sendall(b"reserve\r\n")
            time.sleep(settle)  # the reserve is parked in the server before the put
            t0 = time.perf_counter()
            prod.sendall(put)
            line, rest = _read_line(w, b"")
            if not line.startswith(b"RESERVED "):
                raise RuntimeError(f"reserve answered {line!r}")
            _recv_until(w, rest, int(line.split()[2]) + 2)
            lat.append(time.perf_counter() - t0)
            ins, _ = _read_line(prod, b"")
            if not ins.startswith(b"INSERTED "):
                raise RuntimeError(f"put answered {ins!r}")
            w.sendall(b"delete %s\r\n" % line.split()[1])
            d, _ = _read_line(w, b"")
            if d != b"DELETED":
                raise RuntimeError(f"delete answered {d!r}")
    lat.sort()
    us = [1e6 * x for x in lat]
    return {"p50_us": round(us[len(us) // 2], 1), "p99_us": round(us[int(len(us) * 0.99)], 1),
            "max_us": round(us[-1], 1), "mean_us": round(sum(us) / len(us), 1)}


def spawn_to_first_reply(bench: Bench, kind: str, with_dir: bool,
                         timeout: float = 30.0) -> tuple[float, float | None]:
    """Seconds from spawn until the first reply to `stats` on a connection made with
    retries (the way client test suites start a server), and the server's CPU seconds
    by then (steadier than wall time on a shared machine)."""
    srv = Server(kind, "memory", bench.workdir, src=bench.src)
    if with_dir:
        srv.data_dir = Path(tempfile.mkdtemp(prefix=f"{kind}-spawn-", dir=bench.workdir))
        srv.cmd += (["--data-dir", str(srv.data_dir)] if kind == "smallstalk"
                    else ["-b", str(srv.data_dir)])
    srv.spawn()
    try:
        deadline = srv.t_spawn + timeout
        while True:
            try:
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
                break
            except OSError:
                if time.monotonic() > deadline or not srv.alive():
                    raise RuntimeError(f"{kind} did not accept: {srv.log_tail()}") from None
                time.sleep(0.001)
        with s:
            s.sendall(b"stats\r\n")
            _read_line(s, b"")
            wall = time.monotonic() - srv.t_spawn
            cpu = proc_cpu_ns(srv.pid)
            return wall, None if cpu is None else cpu / 1e9
    finally:
        srv.stop()
        if srv.data_dir is not None:
            shutil.rmtree(srv.data_dir, ignore_errors=True)


# --- arithmetic and output ------------------------------------------------------------------


def merge_runs(runs: list[dict]) -> dict:
    """Several rounds of one server at one point -> one result (sums, then rates)."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[-1] if runs else {"error": "not measured"}
    if len(good) == 1:
        out = dict(good[0])
    else:
        out = dict(good[-1])
        for key in ("ops", "errors", "timeouts", "elapsed", "wall", "client_cpu",
                    "server_cpu_s", "_interval", "preloaded"):
            if key in good[0]:
                out[key] = sum(r.get(key) or 0 for r in good)
        ops = out["ops"]
        out["ops_per_sec"] = ops / max(1e-9, out["elapsed"])
        out["client_cpu_pct"] = 100.0 * out["client_cpu"] / max(1e-9, out["wall"])
        out["server_cpu_pct"] = 100.0 * out["server_cpu_s"] / max(1e-9, out["_interval"])
        out["server_cpu_us_per_op"] = round(1e6 * out["server_cpu_s"] / ops, 2) if ops else None
        stat = sum(r["server_cpu_stat_us_per_op"] * r["ops"] for r in good
                   if r.get("server_cpu_stat_us_per_op") is not None)
        out["server_cpu_stat_us_per_op"] = round(stat / ops, 2) if ops else None
        us = sum(r["_ticks"][0] for r in good)
        sy = sum(r["_ticks"][1] for r in good)
        out["server_sys_share"] = round(sy / (us + sy), 3) if us + sy else None
        out["loadavg"] = max(r["loadavg"] for r in good)
        if any("ran_dry" in r for r in good):
            out["ran_dry"] = any(r.get("ran_dry") for r in good)
        probes = [r["disk_fsync_per_sec"] for r in good if r.get("disk_fsync_per_sec")]
        if probes:
            out["disk_fsync_per_sec"] = min(probes)
            out["disk_fsync_per_sec_probes"] = probes
        lat: list[int] = []
        for r in good:
            lat.extend(r["latencies_ns"])
        lat.sort()
        out.update(loadgen.latency_summary(lat))
    out["rounds_ops_per_sec"] = [round(r["ops_per_sec"], 1) for r in good]
    if len(good) < len(runs):
        out["failed_rounds"] = [r["error"] for r in runs if "error" in r]
    for key in ("latencies_ns", "_ticks", "_interval"):
        out.pop(key, None)
    return out


def _rounds_note(rounds: int) -> str:
    return f" in {rounds} alternating rounds" if rounds > 1 else ""


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _disk_note(r: dict) -> str:
    v = r.get("disk_fsync_per_sec")
    return f", disk {v:.0f} fsync/s" if v else ""


def ratio_of(servers: dict, key: str):
    a = servers.get("smallstalk", {}).get(key)
    b = servers.get("beanstalkd", {}).get(key)
    if a is None or b is None or not b:
        return None
    return round(a / b, 3)


def ratios(servers: dict) -> dict:
    return {k: ratio_of(servers, k) for k in
            ("ops_per_sec", "server_cpu_us_per_op", "lat_p50_us", "lat_p99_us")}


def _f(x, nd=0, suffix=""):
    if x is None:
        return "-"
    return f"{x:,.{nd}f}{suffix}"


def fmt_rate(x):
    if x is None:
        return "-"
    return f"{x / 1000:.1f}k" if x >= 10_000 else f"{x:,.0f}"


def fmt_us(x):
    if x is None:
        return "-"
    if x >= 10_000:
        return f"{x / 1000:.0f}ms"
    if x >= 1000:
        return f"{x / 1000:.1f}ms"
    return f"{x:.0f}µs"


def fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def _met(ratio, goal: float, cmp: str) -> bool | None:
    if ratio is None:
        return None
    return bool(ratio >= goal if cmp == ">=" else ratio <= goal)


def evaluate_targets(rows: list[dict], rss: dict, startup: dict, handoff: dict | None = None,
                     spawn: dict | None = None) -> list[dict]:
    """Each goal of TARGETS (and RSS, restart, hand-off, spawn) against this run;
    points the run did not measure are left out."""
    found = {(r["mode"], r["workload"], r["conns"]): r for r in rows}
    out = []
    for desc, mode, wl, conns, metric, goal, cmp in TARGETS:
        row = found.get((mode, wl, conns))
        if row is None:
            continue
        ratio = row["ratio"].get(metric)
        out.append({"target": desc, "point": f"{mode}/{wl}/{conns}", "metric": metric,
                    "smallstalk": _get(row, "smallstalk", metric),
                    "beanstalkd": _get(row, "beanstalkd", metric),
                    "ratio": ratio, "goal": f"{cmp} {goal}", "met": _met(ratio, goal, cmp)})
    if rss["servers"]:
        r = rss.get("ratio")
        out.append({"target": "RSS per 100-byte job", "point": f"memory/{rss['jobs']} jobs",
                    "metric": "bytes_per_job",
                    "smallstalk": rss["servers"].get("smallstalk", {}).get("bytes_per_job"),
                    "beanstalkd": rss["servers"].get("beanstalkd", {}).get("bytes_per_job"),
                    "ratio": r, "goal": f"<= {RSS_GOAL}", "met": _met(r, RSS_GOAL, "<=")})
    if startup["servers"]:
        r = startup.get("ratio")
        out.append({"target": f"restart with {startup['jobs']:,} jobs", "point": "never/-F",
                    "metric": "ready_s",
                    "smallstalk": startup["servers"].get("smallstalk", {}).get("ready_s"),
                    "beanstalkd": startup["servers"].get("beanstalkd", {}).get("ready_s"),
                    "ratio": r, "goal": f"<= {RESTART_GOAL}",
                    "met": _met(r, RESTART_GOAL, "<=")})
    for mode, m in ((handoff or {}).get("modes") or {}).items():
        for metric in ("p50_us", "p99_us"):
            r = m["ratio"].get(metric)
            out.append({"target": f"hand-off {metric[:3]}", "point": mode, "metric": metric,
                        "smallstalk": m["servers"].get("smallstalk", {}).get(metric),
                        "beanstalkd": m["servers"].get("beanstalkd", {}).get(metric),
                        "ratio": r, "goal": f"<= {HANDOFF_GOAL}",
                        "met": _met(r, HANDOFF_GOAL, "<=")})
    for case, c in ((spawn or {}).get("cases") or {}).items():
        ms = c["servers"].get("smallstalk", {}).get("median_ms")
        out.append({"target": "spawn to first reply (ms)", "point": case, "metric": "median_ms",
                    "smallstalk": ms,
                    "beanstalkd": c["servers"].get("beanstalkd", {}).get("median_ms"),
                    "ratio": c.get("ratio"), "goal": f"<= {SPAWN_GOAL_MS:.0f} ms",
                    "met": None if ms is None else bool(ms <= SPAWN_GOAL_MS)})
    return out


def _get(row, kind, metric):
    if not row:
        return None
    return row["servers"].get(kind, {}).get(metric)


def table(headers: list[str], rows: list[list[str]], markdown: bool, right=None) -> str:
    right = right or set()
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---:" if i in right else "---" for i in range(len(headers)))
                 + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths)]
                     + [fmt(r) for r in rows])


def render(results: dict, markdown: bool) -> str:
    meta = results["meta"]
    ss, bs = "smallstalk", "beanstalkd"
    parts = []
    h = "### " if markdown else "== "
    parts.append(f"{h}smallstalk vs beanstalkd ({meta['preset']} run, {meta['timestamp']})")
    parts.append(
        f"{meta['nproc']} cores, {meta['duration']} s per point and server"
        f"{_rounds_note(meta.get('rounds', 1))}"
        ", load generator "
        f"{meta['procs']} processes, 100-byte bodies; git {meta['git']['commit'][:10]}"
        f"{' (dirty)' if meta['git']['dirty'] else ''}, smallstalk/ sha256 "
        f"{meta['git']['smallstalk_src_sha256'][:8]}; load average "
        f"{meta['loadavg_range'][0]:.1f}-{meta['loadavg_range'][1]:.1f} during the run. "
        "ratio = smallstalk / beanstalkd (ops/s: higher is better for smallstalk; "
        "µs/op and latency: lower is). Latency is per command in request/response rows, "
        "per 100-command batch in pipelined rows. An op is a put, a job reserved and "
        "deleted, or a job put, reserved and deleted.")
    headers = ["mode", "workload", "conns", "ops/s ss", "ops/s bs", "ratio", "µs/op ss",
               "µs/op bs", "ratio", "p50 ss", "p50 bs", "p99 ss", "p99 bs"]
    right = set(range(2, len(headers)))
    by_mode: dict[str, list] = {}
    for row in results["points"]:
        by_mode.setdefault(row["mode"], []).append(row)
    for mode, rows in by_mode.items():
        cells = []
        for row in rows:
            a, b = row["servers"].get(ss, {}), row["servers"].get(bs, {})
            cells.append([
                mode, WORKLOAD_LABELS.get(row["workload"], row["workload"]), str(row["conns"]),
                _cell_rate(a), _cell_rate(b), fmt_ratio(row["ratio"]["ops_per_sec"]),
                _cell(a, "server_cpu_us_per_op", 1), _cell(b, "server_cpu_us_per_op", 1),
                fmt_ratio(row["ratio"]["server_cpu_us_per_op"]),
                _cell_us(a, "lat_p50_us"), _cell_us(b, "lat_p50_us"),
                _cell_us(a, "lat_p99_us"), _cell_us(b, "lat_p99_us"),
            ])
        parts.append(f"{h}{MODE_LABELS[mode]}" if markdown else f"-- {MODE_LABELS[mode]}")
        probes = sorted(r["disk_fsync_per_sec"] for row in rows
                        for r in row["servers"].values() if r.get("disk_fsync_per_sec"))
        if probes:
            parts.append(f"Disk: {probes[0]:,.0f} / {probes[len(probes) // 2]:,.0f} / "
                         f"{probes[-1]:,.0f} (min / median / max) 4 KiB append+fsync per "
                         "second, probed before each point.")
        parts.append(table(headers, cells, markdown, right))

    rss = results["rss"]
    if rss["servers"]:
        cells = []
        for kind in (ss, bs):
            r = rss["servers"].get(kind)
            if r is None:
                continue
            if "bytes_per_job" not in r:
                cells.append([kind, "ERROR", r.get("error", "")[:60], "", "", ""])
                continue
            cells.append([kind, f"{r['rss_before_kb'] / 1024:.1f}",
                          f"{r['rss_after_kb'] / 1024:.1f}", f"{r['bytes_per_job']:.0f}",
                          f"{r['mib_per_million_jobs']:.0f}", fmt_rate(r["load_per_sec"])])
        cells.append(["ratio", "", "", fmt_ratio(rss.get("ratio")), "", ""])
        parts.append(f"{h}Memory: RSS for {rss['jobs']:,} jobs of 100 bytes (in memory)"
                     if markdown else
                     f"-- Memory: RSS for {rss['jobs']:,} jobs of 100 bytes (in memory)")
        parts.append(table(["server", "RSS before MiB", "RSS after MiB", "bytes/job",
                            "MiB per 1M jobs", "load puts/s"], cells, markdown,
                           {1, 2, 3, 4, 5}))

    st = results["startup"]
    if st["servers"]:
        cells = []
        for kind in (ss, bs):
            r = st["servers"].get(kind)
            if r is None:
                continue
            if "ready_s" not in r:
                cells.append([kind, "ERROR", r.get("error", "")[:60], "", "", ""])
                continue
            cells.append([kind, f"{r['port_s']:.2f}", f"{r['ready_s']:.2f}", f"{r['cpu_s']:.2f}",
                          f"{r['disk_bytes'] / 2**20:.0f}",
                          f"{r['rss_after_restart_kb'] / 1024:.0f}"])
        cells.append(["ratio", "", fmt_ratio(st.get("ratio")), "", "", ""])
        title = (f"Restart with {st['jobs']:,} jobs on disk (--fsync never / -F; "
                 "from spawn until the port answers / `stats` shows every job)")
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(["server", "port s", "all jobs s", "cpu s", "disk MiB",
                            "RSS MiB"], cells, markdown, {1, 2, 3, 4, 5}))

    ho = results.get("handoff") or {}
    if ho.get("modes"):
        cells = []
        for mode, m in ho["modes"].items():
            a, b = m["servers"].get(ss, {}), m["servers"].get(bs, {})
            cells.append([mode] + [_cell(r, k, 0) for k in ("p50_us", "p99_us", "max_us")
                                   for r in (a, b)]
                         + [fmt_ratio(m["ratio"].get(k)) for k in ("p50_us", "p99_us")])
        title = (f"Hand-off latency, µs ({ho['samples']:,} samples: a worker waits in "
                 "`reserve`, another connection puts a job; until the worker holds it; "
                 "always = --fsync always / -f 0)")
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(["mode", "p50 ss", "p50 bs", "p99 ss", "p99 bs", "max ss",
                            "max bs", "p50 ratio", "p99 ratio"], cells, markdown,
                           set(range(1, 9))))
    sp = results.get("spawn") or {}
    if sp.get("cases"):
        cells = []
        for case, c in sp["cases"].items():
            a, b = c["servers"].get(ss, {}), c["servers"].get(bs, {})
            cells.append([case] + [_cell(r, k, 1) for r in (a, b)
                                   for k in ("median_ms", "max_ms", "cpu_median_ms")]
                         + [fmt_ratio(c.get("ratio"))])
        title = (f"Spawn to first reply, ms (median / max of {sp['samples']} spawns: "
                 "connect with retries, first `stats` answered; cpu = the server's CPU "
                 "time by then, median)")
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(["case", "ss median", "ss max", "ss cpu", "bs median", "bs max",
                            "bs cpu", "ratio"], cells, markdown, set(range(1, 8))))

    rt = results.get("rate") or {}
    if "accuracy" in rt:
        title = (f"Rate-limited reserves (smallstalk; max-rate {rt['rate']}/s, {rt['conns']} "
                 f"workers, {rt['seconds']:g} s; load {rt['loadavg']:.1f})")
        parts.append(f"{h}{title}" if markdown else f"-- {title}")
        parts.append(table(
            ["steady /s", "accuracy", "past the bound", "µs/job limited", "µs/job unlimited",
             "µs/job loose limit"],
            [[_f(rt["steady_per_sec"], 1), f"{rt['accuracy']:.4f}",
              f"{rt['max_over_bound_jobs']:.2f}", _f(rt["limited_cpu_us_per_job"], 1),
              _f(rt["unlimited_cpu_us_per_job"], 1), _f(rt["loose_limit_cpu_us_per_job"], 1)]],
            markdown, set(range(6))))

    cells = []
    for t in results["targets"]:
        def val(v, metric=t["metric"]):
            if v is None:
                return "-"
            return fmt_rate(v) if metric == "ops_per_sec" else f"{v:,.2f}"

        cells.append([t["target"], t["point"], val(t["smallstalk"]), val(t["beanstalkd"]),
                      fmt_ratio(t["ratio"]), t["goal"],
                      "-" if t["met"] is None else ("yes" if t["met"] else "NO")])
    parts.append(f"{h}Targets (ratio smallstalk/beanstalkd)" if markdown
                 else "-- Targets (ratio smallstalk/beanstalkd)")
    parts.append(table(["target", "point", "smallstalk", "beanstalkd", "ratio", "goal", "met"],
                       cells, markdown, {2, 3, 4}))
    return "\n\n".join(parts) + "\n"


def _cell(r, key, nd):
    if "error" in r:
        return "ERR"
    return _f(r.get(key), nd)


def _cell_rate(r):
    return "ERR" if "error" in r else fmt_rate(r.get("ops_per_sec"))


def _cell_us(r, key):
    return "ERR" if "error" in r else fmt_us(r.get(key))


def git_info(src: Path | None = None) -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    digest = hashlib.sha256()
    for p in sorted(((src or REPO) / "smallstalk").rglob("*.py")):
        digest.update(p.name.encode() + b"\0" + p.read_bytes())
    return {"commit": git("rev-parse", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "smallstalk")),
            "smallstalk_src_sha256": digest.hexdigest()[:16]}


def beanstalkd_version() -> str:
    try:
        return subprocess.run([beanstalkd_path(), "-v"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="preset", action="store_const", const="quick")
    g.add_argument("--tiny", dest="preset", action="store_const", const="tiny")
    ap.set_defaults(preset="full")
    ap.add_argument("--duration", type=float, help="seconds per point (default: preset's)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="alternating rounds per point and server, duration split between "
                         "them (default: 2 full, 1 quick)")
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 2,
                    help="load-generator processes (default: number of cores)")
    ap.add_argument("--rss-jobs", type=int, help="jobs for the RSS measurement (0 skips)")
    ap.add_argument("--startup-jobs", type=int, help="jobs for the restart measurement (0 skips)")
    ap.add_argument("--handoff-samples", type=int,
                    help="hand-off latency samples per mode and server (0 skips)")
    ap.add_argument("--spawn-samples", type=int,
                    help="spawns per case for spawn-to-first-reply (0 skips)")
    ap.add_argument("--rate-seconds", type=float,
                    help="seconds of the rate-limited reserve point (smallstalk only; 0 skips)")
    ap.add_argument("--rate", type=int, default=500, help="its max-rate, reserves per second")
    ap.add_argument("--only", help="regex on MODE/WORKLOAD/CONNS to run a subset of the points")
    ap.add_argument("--servers", default="smallstalk,beanstalkd")
    ap.add_argument("--out", default=str(REPO / "bench-results"), help="results directory")
    ap.add_argument("--tmp", default=None, help="where data directories go (a real disk!)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory and logs")
    ap.add_argument("--source", metavar="DIR",
                    help="measure the smallstalk/ package in DIR (a copy of an older "
                         "version, for A/B runs) instead of this checkout's")
    ap.add_argument("--live-source", action="store_true",
                    help="run smallstalk from the working tree (default: from a copy of "
                         "smallstalk/ taken at the start, so edits during a run do not mix in)")
    ap.add_argument("--render", metavar="JSON",
                    help="print the tables of an earlier run's JSON and exit (no servers)")
    ap.add_argument("--markdown", action="store_true", help="with --render: markdown")
    args = ap.parse_args(argv)
    if args.render:
        results = json.loads(Path(args.render).read_text())
        # Judged against today's goals, whatever the run's were.
        results["targets"] = evaluate_targets(results["points"], results["rss"],
                                              results["startup"], results.get("handoff"),
                                              results.get("spawn"))
        print(render(results, markdown=args.markdown), end="")
        return 0
    args.servers = args.servers.split(",")
    preset = PRESETS[args.preset]
    beanstalkd_path()

    bench = Bench(args, preset)
    started = time.monotonic()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    loads = [loadavg()]
    try:
        points = bench.run_points()
        rss = bench.run_rss()
        startup = bench.run_startup()
        handoff = bench.run_handoff()
        spawn = bench.run_spawn()
        rate = bench.run_rate()
    finally:
        bench.cleanup()
    for row in points:
        loads += [r["loadavg"] for r in row["servers"].values() if "loadavg" in r]
    loads.append(loadavg())
    results = {
        "meta": {
            "timestamp": stamp, "preset": args.preset, "duration": bench.duration,
            "rounds": bench.rounds,
            "procs": args.procs, "nproc": os.cpu_count(), "host": platform.node(),
            "python": platform.python_version(), "beanstalkd": beanstalkd_version(),
            "git": bench.git,
            "source": "working tree (live)" if bench.src is None
            else "snapshot of smallstalk/ taken at the start",
            "elapsed_s": round(time.monotonic() - started, 1),
            "loadavg_range": [min(loads), max(loads)], "clk_tck": CLK_TCK,
            "servers": bench.servers,
            "partial": bool(args.only) or len(bench.servers) < len(SERVERS)
            or args.rss_jobs == 0 or args.startup_jobs == 0
            or args.handoff_samples == 0 or args.spawn_samples == 0 or args.rate_seconds == 0,
        },
        "points": points,
        "rss": rss,
        "startup": startup,
        "handoff": handoff,
        "spawn": spawn,
        "rate": rate,
    }
    results["targets"] = evaluate_targets(points, rss, startup, handoff, spawn)
    text = render(results, markdown=False)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    blob = json.dumps(results, indent=1, sort_keys=False)
    # latest.* tracks the last complete full run; quick, tiny and subset runs
    # (--only etc.) get their own latest-<kind>.* so they never replace it.
    latest = ("latest-partial" if results["meta"]["partial"] else
              "latest" if args.preset == "full" else f"latest-{args.preset}")
    (out / f"{stamp}.json").write_text(blob)
    (out / f"{latest}.json").write_text(blob)
    (out / f"{latest}.md").write_text(render(results, markdown=True))
    print(f"wrote {out / (stamp + '.json')}, {out / (latest + '.json')}, "
          f"{out / (latest + '.md')} in {results['meta']['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
