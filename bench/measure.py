"""The measurements of a run: points, RSS, restart, hand-off, spawn to first reply.

`Bench` starts a fresh server for every measurement (servers.py), drives it
with loadgen.py and reads the server's CPU time around the measured interval.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import loadgen
from render import disk_note, fmt_num, fmt_pct
from servers import (
    CLK_TCK,
    FLOOR,
    FLOOR_LOG,
    MODES,
    REPO,
    SERVERS,
    Server,
    compile_package,
    current_jobs,
    fsync_probe,
    git_info,
    loadavg,
    proc_cpu_ns,
    proc_run_wait_s,
    proc_status_kb,
    proc_user_sys_ticks,
    read_line,
    recv_until,
    stats,
    stats_on,
)
from targets import ratio_of, ratios, vs_floor

# A put-unique point's second slot: smallstalk's plain put, in the same alternating
# rounds, which the keyed put is judged against (bench/targets.py).
PLAIN_PUT = "smallstalk-plain-put"
OPEN_RR = (("put", 10), ("rd", 10), ("cycle", 10), ("put", 100), ("rd", 100), ("cycle", 100))
PRESETS = {
    # conns: request/response points per workload; the fsync-always put/cycle
    # points at 10/50/200 and the never put at 50 are the targets.
    # open: (workload, conns) measured in open loop, in memory, at equal offered load.
    "full": dict(duration=5.0, conns=(1, 10, 100), pipe=(("put-pipe", 1), ("put-pipe", 10),
                 ("rd-pipe", 10), ("rd-batch", 10)), rss_jobs=1_000_000, startup_jobs=1_000_000,
                 rd_jobs=300_000, max_ops=0, extras=True, rounds=2,
                 handoff_samples=2000, spawn_samples=7, open=OPEN_RR, rate_seconds=6.0),
    "quick": dict(duration=1.0, conns=(1, 10, 100), pipe=(("put-pipe", 10), ("rd-batch", 10)),
                  rss_jobs=100_000, startup_jobs=100_000, rd_jobs=40_000, max_ops=0,
                  extras=True, rounds=1, handoff_samples=300, spawn_samples=3,
                  open=(("put", 10), ("cycle", 10)), rate_seconds=4.0),
    "tiny": dict(duration=0.5, conns=(), pipe=(), rss_jobs=2_000, startup_jobs=2_000,
                 rd_jobs=600, max_ops=300, extras=False, rounds=1,
                 handoff_samples=20, spawn_samples=1, open=(("put", 2),), rate_seconds=0.0),
}
# Open loop: the load offered, as a share of the slowest server's saturated
# command rate at the same point of this run (below saturation for all three).
OPEN_LOAD_SHARE = 0.5
OPEN_FALLBACK_CMDS = 2000  # per second, when the run measured no saturated point to go by


def floor_key(workload: str, conns: int) -> tuple[str, int]:
    """The floor's point for a row: puts, one at a time or 100 per send, at its conns."""
    return ("put-pipe" if workload in loadgen.PIPELINED else "put", conns)

# The tiny preset covers every workload once across the three modes.
TINY_POINTS = (("memory", "put", 2), ("memory", "rd-pipe", 2), ("never", "cycle", 2),
               ("never", "put-pipe", 1), ("always", "rd", 2), ("memory", "rd-batch", 2),
               ("never", "put-unique", 2))
# A smallstalk-only workload measured beside beanstalkd's nearest one: the
# point's beanstalkd column runs this workload instead (the row keeps it as
# "baseline"). reserve-batch: beanstalkd cannot batch, so its reserve+delete
# with the same 100 commands per send and the same connections.
BEANSTALKD_BASELINE = {"rd-batch": "rd-pipe"}
CONSUMING = ("rd", "rd-pipe", "rd-batch")  # workloads that consume preloaded jobs


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
        self.with_floor = FLOOR in args.servers
        self.floors: dict[tuple[str, int], dict] = {}  # floor_key -> the floor's result
        self.floor_logs: dict[tuple[str, int], dict] = {}  # the same, the writing floor's
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
                if mode != "memory":  # a keyed put against the plain put's points
                    pts += [(mode, "put-unique", c) for c in sorted(self.preset["conns"])]
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
                      duration: float, rate: float = 0.0) -> dict:
        """One server, one point (`rate`: open loop, commands a second per
        connection); a point that fails is tried once more (the first failure
        is kept in the result as `retried`)."""
        try:
            res = self._measure_point(kind, mode, workload, conns, duration, rate)
            if res["ops"] == 0 and res["errors"]:
                raise RuntimeError(f"no op succeeded, {res['errors']} errors; server log: "
                                   f"{res.get('server_log', '')}")
            return res
        except Exception as e:  # noqa: BLE001
            first = f"{type(e).__name__}: {e}"
            self.say(f"    {kind} {mode}/{workload}/{conns} failed ({first[:300]}); once more")
        res = self._measure_point(kind, mode, workload, conns, duration, rate)
        res["retried"] = first
        if res["ops"] == 0 and res["errors"]:
            raise RuntimeError(f"no op succeeded twice, {res['errors']} errors; server log: "
                               f"{res.get('server_log', '')}")
        return res

    def _measure_point(self, kind: str, mode: str, workload: str, conns: int,
                       duration: float, rate: float = 0.0) -> dict:
        srv = Server("smallstalk" if kind == PLAIN_PUT else kind, mode, self.workdir,
                     src=self.src).start()
        try:
            info = {}
            if srv.data_dir is not None:
                info["disk_fsync_per_sec"] = fsync_probe(srv.data_dir)
            if workload in CONSUMING:
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
                             max_ops=self.preset["max_ops"], rate=rate)
            res.update(info)
            if workload in CONSUMING:
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
        put = {"rd": "put", "rd-pipe": "put-pipe", "rd-batch": "put-pipe"}[workload]
        known = {c: rate for (k, m, w, c), rate in self.rates.items()
                 if (k, m, w) == (kind, mode, put)}
        if not known:
            return cap
        return int(min(cap, max(2000, 2.0 * duration * max(known.values()))))

    def alternate(self, mode: str, conns: int, plan: dict[str, tuple[str, float]],
                  label: str) -> dict[str, dict]:
        """`plan`: server kind -> (workload, rate). `rounds` alternating rounds of
        duration/rounds per server (A B C, C B A, ...), merged: alternation evens
        out drift on a shared machine."""
        kinds = list(plan)
        runs: dict[str, list] = {k: [] for k in kinds}
        for rnd in range(max(1, self.rounds)):
            for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
                if runs[kind] and "error" in runs[kind][-1]:
                    continue
                wl, rate = plan[kind]
                try:
                    r = self.measure_point(kind, mode, wl, conns,
                                           self.duration / max(1, self.rounds), rate)
                except Exception as e:  # noqa: BLE001 - one broken point must not end the run
                    r = {"error": f"{type(e).__name__}: {e}"}
                runs[kind].append(r)
        out = {}
        for kind in kinds:
            r = out[kind] = merge_runs(runs[kind])
            self.say(f"{label} {kind:10} " + _summary(r))
        return out

    def run_points(self) -> list[dict]:
        """Every point, the floor's first (floor_key) beside the first row that needs it."""
        out = []
        pts = self.points()
        for i, (mode, wl, conns) in enumerate(pts, 1):
            row = {"mode": mode, "workload": wl, "conns": conns,
                   "depth": 100 if wl in loadgen.PIPELINED else 1, "servers": {}}
            # beanstalkd has no put-unique: the keyed put is judged against our plain put
            plan = {k: (wl, 0.0) for k in self.servers
                    if wl not in loadgen.SMALLSTALK_ONLY or k == "smallstalk"}
            if wl == "put-unique" and "smallstalk" in plan:
                # Judged against the plain put of the same rounds, seconds apart, not
                # against the put row's of minutes before, whatever ran in between.
                plan[PLAIN_PUT] = ("put", 0.0)
            baseline = BEANSTALKD_BASELINE.get(wl)
            if baseline is not None and "beanstalkd" in self.servers:
                plan["beanstalkd"] = (baseline, 0.0)
                row["baseline"] = baseline
            fkey = floor_key(wl, conns)
            if self.with_floor and fkey not in self.floors:
                plan[FLOOR] = (fkey[0], 0.0)
            # `--fsync never` writes a log the floor does not: the writing floor too
            writes = self.with_floor and mode == "never"
            if writes and fkey not in self.floor_logs:
                plan[FLOOR_LOG] = (fkey[0], 0.0)
            res = self.alternate(mode, conns, plan,
                                 f"[{i}/{len(pts)}] {mode:6} {wl:8} {conns:3} conns ")
            if FLOOR in res:
                self.floors[fkey] = res.pop(FLOOR)
            if FLOOR_LOG in res:
                self.floor_logs[fkey] = res.pop(FLOOR_LOG)
            if PLAIN_PUT in res:
                row["plain_put"] = res.pop(PLAIN_PUT)
                plan.pop(PLAIN_PUT)
            row["servers"] = res
            for kind, r in res.items():
                if "ops_per_sec" in r:
                    self.rates[(kind, mode, wl, conns)] = r["ops_per_sec"]
            row["ratio"] = ratios(row["servers"])
            if self.with_floor:
                row["floor"] = "/".join(map(str, fkey))
                cpo = {k: loadgen.COMMANDS_PER_OP[w] for k, (w, _) in plan.items()}
                row["vs_floor"] = vs_floor(res, cpo, self.floors.get(fkey))
                if writes:
                    row["vs_floor_log"] = vs_floor(res, cpo, self.floor_logs.get(fkey))
            out.append(row)
        return out

    def floor_results(self) -> dict[str, dict]:
        """The floor's saturated points, by "workload/conns"."""
        return {f"{wl}/{c}": r for (wl, c), r in self.floors.items()}

    def floor_log_results(self) -> dict[str, dict]:
        """The writing floor's saturated points, by "workload/conns"."""
        return {f"{wl}/{c}": r for (wl, c), r in self.floor_logs.items()}

    def run_open_loop(self) -> list[dict]:
        """CPU per command at equal offered load, below saturation: each server
        (and the floor, with puts) gets the same commands a second, paced."""
        out = []
        for wl, conns in self.preset.get("open", ()):
            if self.only and not self.only.search(f"open/{wl}/{conns}"):
                continue
            offered = self.offered_load(wl, conns)
            rate = offered / conns
            plan = {k: (wl, rate) for k in self.servers}
            if self.with_floor:
                plan[FLOOR] = ("put", rate)
            res = self.alternate("memory", conns, plan,
                                 f"OPEN     {wl:8} {conns:3} conns {offered:,.0f} cmd/s")
            floor = res.pop(FLOOR, None)
            row = {"mode": "memory", "workload": wl, "conns": conns, "depth": 1,
                   "rate_per_conn": round(rate, 1), "offered_cmds_per_sec": round(offered),
                   "servers": res, "ratio": ratios(res)}
            if self.with_floor:
                row["floor_result"] = floor
                row["vs_floor"] = vs_floor(res, loadgen.COMMANDS_PER_OP[wl], floor)
            out.append(row)
        return out

    def offered_load(self, workload: str, conns: int) -> float:
        """Commands a second to offer at an open-loop point: OPEN_LOAD_SHARE of the
        slowest saturated rate this run measured there (in commands)."""
        cpo = loadgen.COMMANDS_PER_OP[workload]
        known = [rate * cpo for (kind, mode, wl, c), rate in self.rates.items()
                 if (mode, wl, c) == ("memory", workload, conns)]
        floor = self.floors.get(("put", conns), {}).get("ops_per_sec")
        if floor:
            known.append(floor)
        return OPEN_LOAD_SHARE * min(known) if known else float(OPEN_FALLBACK_CMDS)

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

    def run_startup(self) -> dict:
        n = self.preset["startup_jobs"] if self.args.startup_jobs is None \
            else self.args.startup_jobs
        out = {"jobs": n, "mode": "never", "servers": {}}
        if n <= 0:
            return out
        compile_package(self.src)
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
                cpu_s = srv.cpu_ticks() / CLK_TCK
                wait_s = proc_run_wait_s(srv.pid)
                r = {"jobs_loaded": loaded, "load_per_sec": round(res["ops_per_sec"]),
                     "disk_bytes": disk, "disk_bytes_per_job": round(disk / max(1, loaded), 1),
                     "port_s": round(t_port, 3), "ready_s": round(t_ready, 3),
                     "jobs_after_restart": seen, "rss_after_restart_kb": srv.rss_kb(),
                     "cpu_s": round(cpu_s, 2)}
                if wait_s is not None:  # where the wall time went: see proc_run_wait_s
                    r["run_queue_s"] = round(wait_s, 2)
                    r["blocked_s"] = round(max(0.0, t_ready - cpu_s - wait_s), 2)
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
        time from sending the put until the worker holds the job (its RESERVED and body),
        and the server's side of it: until the RESERVED reached the worker's socket (the
        kernel's receive stamp), without the worker's own wake-up. Then, in memory, each
        server and the floor answer a put sent after the same idle pause: the cost of one
        wake-up, server side, that no broker on the floor's I/O shape goes below."""
        n = self.preset["handoff_samples"] if self.args.handoff_samples is None \
            else self.args.handoff_samples
        out = {"samples": n, "body_bytes": 100, "modes": {}}
        if n <= 0:
            return out
        idle = {}
        for kind in [*self.servers, *([FLOOR] if self.with_floor else [])]:
            srv = Server(kind, "memory", self.workdir, src=self.src).start()
            try:
                idle[kind] = idle_round_trips(srv.port, n)
            except Exception as e:  # noqa: BLE001
                idle[kind] = {"error": f"{type(e).__name__}: {e}"}
            finally:
                srv.stop()
            self.say(f"IDLE-RT  memory {kind:10} {json.dumps(idle[kind])}")
        out["idle_put"] = {"servers": idle, "ratio": {
            k: ratio_of(idle, k) for k in ("p50_us", "p99_us")}}
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
                k: ratio_of(row, k) for k in ("p50_us", "p99_us", "max_us", "server_p50_us",
                                              "server_p99_us")}}
        return out

    def run_spawn(self) -> dict:
        """Spawn the server, connect with retries, time until the first reply to `stats`
        (median and max of a few spawns); without a data dir and with an empty one."""
        n = self.preset["spawn_samples"] if self.args.spawn_samples is None \
            else self.args.spawn_samples
        out = {"samples": n, "cases": {}}
        if n <= 0:
            return out
        compile_package(self.src)
        out["import_trio"] = import_trio_ms(n)
        self.say(f"SPAWN    import trio alone {json.dumps(out['import_trio'])}")
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

    def cleanup(self) -> None:
        if not self.args.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)



def import_trio_ms(n: int) -> dict:
    """Spawn to exit of `python -c "import trio"`, the interpreter smallstalk runs
    on: the start-up that is trio's, not the broker's (median and min of n). It
    exits with os._exit, as soon as trio is imported: a normal exit tears the
    modules down first (~45 ms here), which a server's first reply never waits for."""
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import os, trio; os._exit(0)"], check=True,
                       cwd="/")
        times.append(time.monotonic() - t0)
    times.sort()
    return {"median_ms": round(1e3 * times[len(times) // 2], 2),
            "min_ms": round(1e3 * times[0], 2)}


def _summary(r: dict) -> str:
    """One line of a measured point for the progress log."""
    if "error" in r:
        return "ERROR " + r["error"][:300]
    rounds = r["rounds_ops_per_sec"]
    paced = (f", {r['cmds_per_sec']:,.0f} of {r['offered_cmds_per_sec']:,.0f} cmd/s offered"
             if r.get("offered_cmds_per_sec") else "")
    return (f"{r['ops_per_sec']:9.0f} ops/s  {fmt_num(r['server_cpu_us_per_op'], 1):>6} µs/op  "
            f"p50 {fmt_num(r['lat_p50_us'], 0)} µs  p99 {fmt_num(r['lat_p99_us'], 0)} µs  "
            f"(server {r['server_cpu_pct']:.0f}% cpu {fmt_pct(r['server_sys_share'])} sys, "
            f"client {r['client_cpu_pct']:.0f}%, load {r['loadavg']:.1f}"
            f"{', errors ' + str(r['errors']) if r['errors'] else ''}{disk_note(r)}{paced}"
            f"{', rounds ' + '/'.join(f'{x:.0f}' for x in rounds) if len(rounds) > 1 else ''})")


SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's number
STAMP = struct.Struct("qq")  # the control message: struct timespec
PUT = loadgen.put_command()  # the bench's put: 100 bytes, pri 1024, ttr 60


def stamped(s: socket.socket) -> socket.socket:
    """Nagle off, and the kernel's receive time (CLOCK_REALTIME) on every read."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return s


def recv_stamped(s: socket.socket) -> tuple[bytes, int | None]:
    """One read and when its first bytes reached the socket (ns, the epoch's clock):
    the server's side of a round trip ends there, before the client's own wake-up.
    None when the kernel gave the read no stamp (seen now and then on a loaded
    machine): that sample has no server side, and the callers leave it out."""
    data, anc, _flags, _addr = s.recvmsg(65536, 64)
    if not data:
        raise RuntimeError("connection closed")
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            sec, nsec = STAMP.unpack(raw[:STAMP.size])
            return data, sec * 1_000_000_000 + nsec
    return data, None


def _quantiles(xs_ns: list[int], prefix: str = "") -> dict:
    ns = sorted(xs_ns)
    return {f"{prefix}p{round(q * 100)}_us": round(loadgen.percentile(ns, q) / 1000, 1)
            for q in (0.5, 0.99)}


def _put_then_read(prod: socket.socket, reader: socket.socket,
                   want: bytes) -> tuple[int, int | None, bytes, bytes]:
    """Put a job on `prod` and read `reader`'s next line, which must start with `want`:
    (the send's ns, when that line reached `reader`'s socket in ns, the line, the rest)."""
    t0_ns = time.time_ns()
    prod.sendall(PUT)
    first, t_rx = recv_stamped(reader)
    line, rest = read_line(reader, first)
    if not line.startswith(want):
        raise RuntimeError(f"expected {want!r}, got {line!r}")
    return t0_ns, t_rx, line, rest


def idle_round_trips(port: int, n: int, settle: float = 0.0005) -> dict:
    """n puts on one connection, each after `settle` s idle (as a hand-off's put):
    from the send until the reply reached the client's socket, in µs."""
    lat = []
    with stamped(socket.create_connection(("127.0.0.1", port))) as prod:
        for _ in range(n):
            time.sleep(settle)
            t0_ns, t_rx, _line, _rest = _put_then_read(prod, prod, b"INSERTED ")
            if t_rx is not None:
                lat.append(t_rx - t0_ns)
    if not lat:
        raise RuntimeError("no receive timestamp (SO_TIMESTAMPNS) on any reply")
    return _quantiles(lat)


def handoffs(port: int, n: int,
             settle: float = 0.0005) -> Iterator[tuple[float, int, int | None]]:
    """n hand-offs: a worker sends `reserve`, after `settle` s a producer puts a job, the
    worker reads it and deletes it. Each: (seconds from the send until the worker holds
    the job, the send's ns, when the RESERVED reached the worker's socket in ns)."""
    with stamped(socket.create_connection(("127.0.0.1", port))) as w, \
            stamped(socket.create_connection(("127.0.0.1", port))) as prod:
        for _ in range(n):
            w.sendall(b"reserve\r\n")
            time.sleep(settle)  # the reserve is parked in the server before the put
            t0 = time.perf_counter()
            t0_ns, t_rx, line, rest = _put_then_read(prod, w, b"RESERVED ")
            recv_until(w, rest, int(line.split()[2]) + 2)
            held = time.perf_counter() - t0
            ins, _ = read_line(prod, b"")
            if not ins.startswith(b"INSERTED "):
                raise RuntimeError(f"put answered {ins!r}")
            w.sendall(b"delete %s\r\n" % line.split()[1])
            d, _ = read_line(w, b"")
            if d != b"DELETED":
                raise RuntimeError(f"delete answered {d!r}")
            yield held, t0_ns, t_rx


def handoff_samples(port: int, n: int, settle: float = 0.0005) -> dict:
    """n hand-offs (see Bench.run_handoff): p50/p99/max in µs, and the server's side."""
    lat, server = [], []
    for held, t0_ns, t_rx in handoffs(port, n, settle):
        lat.append(round(held * 1e9))
        if t_rx is not None:
            server.append(t_rx - t0_ns)
    if not server:
        raise RuntimeError("no receive timestamp (SO_TIMESTAMPNS) on any hand-off")
    return {**_quantiles(lat), "max_us": round(max(lat) / 1000, 1),
            "mean_us": round(sum(lat) / len(lat) / 1000, 1), **_quantiles(server, "server_"),
            "unstamped": len(lat) - len(server)}


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
            read_line(s, b"")
            wall = time.monotonic() - srv.t_spawn
            cpu = proc_cpu_ns(srv.pid)
            return wall, None if cpu is None else cpu / 1e9
    finally:
        srv.stop()
        if srv.data_dir is not None:
            shutil.rmtree(srv.data_dir, ignore_errors=True)



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
        out["cmds_per_sec"] = out["ops_per_sec"] * loadgen.COMMANDS_PER_OP[out["workload"]]
        if out.get("offered_cmds_per_sec"):
            out["achieved_share"] = round(out["cmds_per_sec"] / out["offered_cmds_per_sec"], 3)
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

