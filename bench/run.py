#!/usr/bin/env python3
"""smallstalk vs beanstalkd and the floor on loopback: throughput, latency, CPU per op, RSS, restart.

    python bench/run.py            # full run (make bench), ~10-15 minutes
    python bench/run.py --quick    # reduced counts (make bench-quick), ~2-3 minutes
    python bench/run.py --tiny     # a few hundred ops, one point per mode (the smoke test)

Every measurement point starts a fresh server (fresh data directory) on
127.0.0.1 and a free port, drives it with bench/loadgen.py for at most
`--duration` seconds and stops it; smallstalk and beanstalkd are measured back
to back for each point so their ratio compares like with like on a shared
machine. Server CPU per operation comes from the kernel's CPU clock of the
process (utime+stime, all threads) over the measured interval; RSS from
/proc/PID/status. Beside them runs the floor (bench/floor.py, smallstalk's I/O
shape and no state): "ss/floor" is smallstalk's CPU per command over the
floor's per put, the broker's own cost; `--fsync never` rows are also divided
by the writing floor's (the floor appending each put's record to a log,
"ss/wfloor"). An open-loop section compares CPU per command at equal offered
load, below saturation.

The modules: servers.py (starting and reading servers), measure.py (the
measurements), targets.py (the goals and the judging), render.py (tables).

Results: a table on stdout, bench-results/<timestamp>.json and
bench-results/latest.json (everything measured), bench-results/latest.md
(markdown tables for the README). See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import OPEN_LOAD_SHARE, PRESETS, Bench  # noqa: E402
from render import render, render_across  # noqa: E402
from servers import (  # noqa: E402
    CLK_TCK,
    FLOOR,
    REPO,
    SERVERS,
    beanstalkd_path,
    beanstalkd_version,
    loadavg,
    python_facts,
    smallstalk_build,
)
from targets import evaluate_targets, judge_across  # noqa: E402


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
    ap.add_argument("--only", help="regex on MODE/WORKLOAD/CONNS to run a subset of the points "
                    "(open-loop points are open/WORKLOAD/CONNS)")
    ap.add_argument("--servers", default="smallstalk,beanstalkd,floor",
                    help="which of smallstalk, beanstalkd, floor to measure")
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
    ap.add_argument("--across", metavar="JSON", nargs="+",
                    help="judge the goals on the median of several earlier runs' JSONs "
                         "(each run's value, the median, how many runs met each) and exit")
    ap.add_argument("--markdown", action="store_true",
                    help="with --render or --across: markdown")
    args = ap.parse_args(argv)
    if args.across:
        runs = [_load_run(ap, p) for p in args.across]
        judged = judge_across([_judged_now(r) for r in runs])
        print(render_across(judged, [r["meta"] for r in runs], args.markdown), end="")
        return 0
    if args.render:
        results = _load_run(ap, args.render)
        results["targets"] = _judged_now(results)
        print(render(results, markdown=args.markdown), end="")
        return 0
    args.servers = args.servers.split(",")
    preset = PRESETS[args.preset]
    beanstalkd_path()

    bench = Bench(args, preset)
    build = smallstalk_build(bench.src)  # now: the cleanup below removes the snapshot
    started = time.monotonic()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    loads = [loadavg()]
    try:
        points = bench.run_points()
        open_loop = bench.run_open_loop()
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
            "rounds": bench.rounds, "open_load_share": OPEN_LOAD_SHARE,
            "procs": args.procs, "nproc": os.cpu_count(), "host": platform.node(),
            "python": platform.python_version(), "python_facts": python_facts(),
            "beanstalkd": beanstalkd_version(),
            "git": bench.git, "build": build,
            "source": "working tree (live)" if bench.src is None
            else "snapshot of smallstalk/ taken at the start",
            "elapsed_s": round(time.monotonic() - started, 1),
            "loadavg_range": [min(loads), max(loads)], "clk_tck": CLK_TCK,
            "servers": bench.servers + [FLOOR] * bench.with_floor,
            "partial": bool(args.only) or len(bench.servers) < len(SERVERS)
            or not bench.with_floor
            or args.rss_jobs == 0 or args.startup_jobs == 0
            or args.handoff_samples == 0 or args.spawn_samples == 0 or args.rate_seconds == 0,
        },
        "points": points,
        "floor": bench.floor_results(),
        "floor_log": bench.floor_log_results(),
        "open_loop": open_loop,
        "rss": rss,
        "startup": startup,
        "handoff": handoff,
        "spawn": spawn,
        "rate": rate,
    }
    results["targets"] = evaluate_targets(points, rss, startup, handoff, spawn, open_loop)
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


def _load_run(ap: argparse.ArgumentParser, path: str) -> dict:
    """A run's JSON (bench-results/*.json), or one line that says what is wrong."""
    try:
        results = json.loads(Path(path).read_text())
    except OSError as e:
        ap.error(f"cannot read {path}: {e.strerror}")
    except ValueError:
        results = None
    if not (isinstance(results, dict) and "points" in results
            and "timestamp" in (results.get("meta") or {})):
        ap.error(f"{path} is not a bench/run.py results file (bench-results/*.json)")
    return results


def _judged_now(results: dict) -> list[dict]:
    """An earlier run's results judged against today's goals, whatever the run's were."""
    return evaluate_targets(results["points"], results["rss"], results["startup"],
                            results.get("handoff"), results.get("spawn"),
                            results.get("open_loop"))


if __name__ == "__main__":
    sys.exit(main())

