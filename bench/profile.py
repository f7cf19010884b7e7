#!/usr/bin/env python3
"""Profile smallstalk under load and print where the time goes.

    .venv/bin/pip install py-spy        # not a project dependency
    .venv/bin/python bench/profile.py --workload put --conns 10 --mode never --seconds 20
    .venv/bin/python bench/profile.py --tool cprofile ...   # CPU-time, call counts per op

Starts smallstalk (same flags as bench/run.py's modes), drives it with
bench/loadgen.py for the duration and prints the top functions.

- `--tool py-spy` (default) attaches `py-spy record --format raw --function`
  (blocking sampling: each sample pauses the server briefly, but coroutine
  stacks come out whole; `--nonblocking` perturbs less and truncates some).
  py-spy samples wall-clock time of threads that are not idle, and a thread
  that is runnable but preempted counts as busy: on a loaded 2-core machine
  the server is often preempted right after a send() wakes the client, so
  socket calls look bigger than their CPU cost. The header gives the
  server's user/system CPU split and involuntary context switches per op to
  read it with.
- `--tool cprofile` runs the server under cProfile with a thread-CPU-time
  timer, switched on for the measured interval only (SIGUSR2): deterministic
  call counts per op and CPU time that excludes preemption, at the price of a
  heavy slowdown (the timer overhead inflates functions called very often).

Raw output is kept in bench-results/profile-<stamp>.{txt,pstats}; the summary
in bench-results/profile-latest.md (or profile-latest-cprofile.md).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import loadgen  # noqa: E402
import servers  # noqa: E402

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")

# Runs smallstalk's CLI under cProfile; SIGUSR2 switches profiling on, then off.
CPROFILE_WRAPPER = r"""
import cProfile, signal, sys, time
out = sys.argv[1]
prof = cProfile.Profile(time.thread_time)
state = {"on": False}
def toggle(signum, frame):
    if state["on"]:
        prof.disable()
        prof.dump_stats(out)
    else:
        prof.enable()
    state["on"] = not state["on"]
signal.signal(signal.SIGUSR2, toggle)
from smallstalk import cli
sys.exit(cli.main(sys.argv[2:]))
"""


def parse_raw(path: Path):
    """Collapsed stacks -> (self, inclusive, self per file, total samples)."""
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    files: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [f for f in stack.split(";") if f and FRAME.match(f)]
        if not frames:
            continue
        total += n
        leaf = _name(frames[-1])
        own[leaf] += n
        files[leaf.rsplit("(", 1)[1].split(":")[0].rstrip(")")] += n
        for f in set(_name(f) for f in frames):
            incl[f] += n
    return own, incl, files, total


def _short(file: str) -> str:
    for marker in ("site-packages/", "lib/python3.11/", "lib/python3"):
        if marker in file:
            return file.split(marker, 1)[1]
    repo = str(servers.REPO) + "/"
    return file[len(repo):] if file.startswith(repo) else file


def _name(frame: str) -> str:
    m = FRAME.match(frame)
    if not m:
        return frame
    line = m.group("line")
    return f"{m.group('func')} ({_short(m.group('file'))}{':' + line if line else ''})"


def status_counts(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if "ctxt_switches" in line:
                k, v = line.split(":")
                out[k] = int(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tool", choices=("py-spy", "cprofile"), default="py-spy")
    ap.add_argument("--workload", default="put", choices=loadgen.WORKLOADS)
    ap.add_argument("--conns", type=int, default=10)
    ap.add_argument("--mode", default="never", choices=list(servers.MODES))
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--nonblocking", action="store_true", help="py-spy --nonblocking")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=str(servers.REPO / "bench-results"))
    ap.add_argument("--py-spy", default=None, help="py-spy binary (default: next to python)")
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    workdir = Path(tempfile.mkdtemp(prefix="smallstalk-profile-"))
    spy = None
    if args.tool == "py-spy":
        spy = args.py_spy or shutil.which("py-spy", path=str(Path(sys.executable).parent)) \
            or shutil.which("py-spy")
        if not spy:
            raise SystemExit("py-spy not found: .venv/bin/pip install py-spy")
        raw = out / f"profile-{stamp}.txt"
    else:
        raw = out / f"profile-{stamp}.pstats"

    srv = servers.Server("smallstalk", args.mode, workdir)
    if args.tool == "cprofile":
        srv.cmd = [srv.cmd[0], "-c", CPROFILE_WRAPPER, str(raw), *srv.cmd[3:]]
    srv.start()
    spy_proc = None
    try:
        if args.workload in ("rd", "rd-pipe"):
            loadgen.run(srv.port, "load", 10, total=200_000, duration=60, procs=args.procs)
        if spy:
            spy_proc = subprocess.Popen(
                [spy, "record", "--pid", str(srv.pid), "--format", "raw", "--function",
                 *(["--nonblocking"] if args.nonblocking else []), "--rate", str(args.rate),
                 "--duration", str(int(args.seconds + 1)), "--output", str(raw)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(0.5)
        else:
            os.kill(srv.pid, signal.SIGUSR2)
        c0, t0, s0 = servers.proc_cpu_ns(srv.pid), servers.proc_user_sys_ticks(srv.pid), \
            status_counts(srv.pid)
        res = loadgen.run(srv.port, args.workload, args.conns, duration=args.seconds,
                          procs=args.procs)
        c1, t1, s1 = servers.proc_cpu_ns(srv.pid), servers.proc_user_sys_ticks(srv.pid), \
            status_counts(srv.pid)
        if spy_proc is not None:
            _, err = spy_proc.communicate(timeout=60)
            if spy_proc.returncode != 0 or not raw.exists():
                raise SystemExit(f"py-spy failed: {err.decode(errors='replace')[-2000:]}")
        else:
            os.kill(srv.pid, signal.SIGUSR2)
            deadline = time.monotonic() + 60
            while not raw.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)  # let dump_stats finish writing
    finally:
        if spy_proc is not None and spy_proc.poll() is None:
            spy_proc.kill()
        srv.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    ops = res["ops"] or 1
    user, system = t1[0] - t0[0], t1[1] - t0[1]
    nvcs = s1.get("nonvoluntary_ctxt_switches", 0) - s0.get("nonvoluntary_ctxt_switches", 0)
    cpu_us = (c1 - c0) / 1e3 / ops if c0 is not None else None
    head = (f"{res['ops_per_sec']:,.0f} ops/s under {args.tool}, server {cpu_us:,.1f} µs "
            f"CPU/op ({100 * user / max(1, user + system):.0f}% user, "
            f"{100 * system / max(1, user + system):.0f}% system), "
            f"{nvcs / ops:.2f} involuntary context switches per op; "
            f"git {servers.git_info()['commit'][:10]}. Raw: {raw.name}.")
    title = (f"### smallstalk profile ({args.tool}): {args.workload} at {args.conns} "
             f"connections, mode {args.mode}")
    if args.tool == "py-spy":
        text = render_pyspy(raw, args, title, head)
        (out / "profile-latest.md").write_text(text)
    else:
        text = render_cprofile(raw, args, title, head, ops)
        (out / "profile-latest-cprofile.md").write_text(text)
    print(text)
    return 0


def render_pyspy(raw: Path, args, title: str, head: str) -> str:
    own, incl, files, total = parse_raw(raw)
    lines = [title, "", head + f" {total:,} samples at {args.rate} Hz"
             f"{' (non-blocking)' if args.nonblocking else ''}, idle excluded.", "",
             f"Top {args.top} by own time (the function itself, not its callees):", "",
             "| # | own % | incl % | function |", "|---:|---:|---:|---|"]
    for i, (f, n) in enumerate(own.most_common(args.top), 1):
        lines.append(f"| {i} | {100 * n / total:.1f} | {100 * incl[f] / total:.1f} | `{f}` |")
    lines += ["", f"Top {args.top} by inclusive time (the function and everything it calls):",
              "", "| # | incl % | own % | function |", "|---:|---:|---:|---|"]
    for i, (f, n) in enumerate(incl.most_common(args.top), 1):
        lines.append(f"| {i} | {100 * n / total:.1f} | {100 * own[f] / total:.1f} | `{f}` |")
    lines += ["", "Own time by source file:", "", "| own % | file |", "|---:|---|"]
    for f, n in files.most_common(args.top):
        lines.append(f"| {100 * n / total:.1f} | `{f}` |")
    return "\n".join(lines) + "\n"


def render_cprofile(raw: Path, args, title: str, head: str, ops: int) -> str:
    st = pstats.Stats(str(raw))
    rows = []
    total_tt = 0.0
    total_calls = 0
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
        total_tt += tt
        total_calls += nc
        where = "" if file == "~" else f"{_short(file)}:{line}"
        rows.append((tt, ct, nc, f"{func} ({where})" if where else func))
    lines = [title, "", head + f" Profiled: {total_calls / ops:,.0f} Python-visible calls "
             f"and {1e6 * total_tt / ops:,.0f} µs of thread CPU per op (inflated by the "
             "profiler's own timer).", "",
             f"Top {args.top} by own CPU time:", "",
             "| # | own % | incl % | calls/op | function |", "|---:|---:|---:|---:|---|"]
    for i, (tt, ct, nc, name) in enumerate(sorted(rows, reverse=True)[: args.top], 1):
        lines.append(f"| {i} | {100 * tt / total_tt:.1f} | {100 * ct / total_tt:.1f} | "
                     f"{nc / ops:.2f} | `{name}` |")
    by_file: collections.Counter = collections.Counter()
    for (file, _line, _func), (_cc, _nc, tt, _ct, _callers) in st.stats.items():
        by_file["(C functions and methods)" if file == "~" else _short(file)] += tt
    lines += ["", "Own CPU time by source file:", "", "| own % | file |", "|---:|---|"]
    for f, tt in by_file.most_common(args.top):
        lines.append(f"| {100 * tt / total_tt:.1f} | `{f}` |")
    lines += ["", f"Top {args.top} by calls per op:", "",
              "| # | calls/op | own % | function |", "|---:|---:|---:|---|"]
    for i, (tt, _ct, nc, name) in enumerate(sorted(rows, key=lambda r: -r[2])[: args.top], 1):
        lines.append(f"| {i} | {nc / ops:.2f} | {100 * tt / total_tt:.1f} | `{name}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
