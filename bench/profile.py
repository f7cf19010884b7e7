#!/usr/bin/env python3
"""Profile smallstalk under load and print where the time goes.

    .venv/bin/pip install py-spy        # not a project dependency
    .venv/bin/python bench/profile.py --workload put --conns 10 --mode never --seconds 20
    .venv/bin/python bench/profile.py --tool cprofile ...   # CPU-time, call counts per op
    .venv/bin/python bench/profile.py --tool callgrind      # instructions per command, in-process
    .venv/bin/python bench/profile.py --tool opcodes        # bytecodes per command, by function

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
import json
import os
import pstats
import re
import shutil
import signal
import statistics
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
    ap.add_argument("--tool", choices=("py-spy", "cprofile", "count", "opcodes", "time",
                                                "callgrind"),
                    default="py-spy",
                    help="count/opcodes/time/callgrind: in-process, deterministic calls, "
                         "bytecodes, CPU or instructions per command")
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
    g = ap.add_argument_group("count and time (in-process, no sockets)")
    g.add_argument("--workloads", default="put,rd,cycle")
    g.add_argument("--per-turn", default="1,10,100",
                   help="commands per turn (clients, one command each per pass)")
    g.add_argument("--ops", type=int, default=2000, help="measured ops per workload")
    g.add_argument("--reps", type=int, default=5, help="--tool time: repetitions")
    g.add_argument("--source", action="append", metavar="DIR",
                   help="a directory holding a smallstalk/ package to count (twice: A/B, "
                        "alternating in fresh processes)")
    g.add_argument("--rounds", type=int, default=4, help="A/B rounds")
    g.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--cg-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tool in ("count", "opcodes", "time", "callgrind"):
        if args.mode == "always":
            raise SystemExit("count/time run memory or never (no fsync thread in-process)")
        return count_main(args)

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


# --- deterministic counts: what a turn does, in-process --------------------------------

COUNT_WORKLOADS = ("put", "rd", "cycle", "put-unique", "handoff", "rd-batch", "mc")
# The commands one op sends, in order, one per turn (request/response).
# `handoff`: a worker waits in `reserve`, a producer's put is handed to it in
# the put's turn, the worker deletes it; `--per-turn` workers and as many
# producers (a turn: the workers' commands, or the producers' puts).
# `rd-batch`: `reserve-batch BATCH 0`, then its BATCH deletes in one read; an
# op is those BATCH jobs, a "command" one of the two reads.
# `mc`: the memcache port's (kestrel's) `set q`, then `get q`, which takes the job.
STEPS = {"put": ("put",), "rd": ("reserve", "delete"), "cycle": ("put", "reserve", "delete"),
         "put-unique": ("put-unique",), "handoff": ("wait", "put", "delete"),
         "rd-batch": ("batch", "deletes"), "mc": ("mc-set", "mc-get")}
BATCH = 10
PUT = b"put 1024 0 60 100\r\n" + b"x" * 100 + b"\r\n"
MC_SET = b"set q 0 0 100\r\n" + b"x" * 100 + b"\r\n"


class _Conn:
    """One client as the server's connection code meets it (connection.py's
    `_received`: feed the parser, hand the commands of a read to the loop in
    one hop); replies are kept, as a socket write would take them."""

    def __init__(self, lp, parser_cls, dialect=None) -> None:
        self.lp = lp
        self.parser = parser_cls(lp.max_job_size) if dialect is None \
            else dialect.parser(lp.max_job_size)
        self.read_bytes = self.submitted = 0
        self.replies: list[bytes] = []
        self.session = lp.open_session(self.deliver, dialect=dialect)
        self.job = b""
        self.jobs: list[bytes] = []  # rd-batch: the ids of the last batch
        self.keys = 0  # put-unique: keys used so far

    def deliver(self, blob: bytes, done: bool, close: bool) -> None:
        self.replies.append(blob)

    def received(self, data: bytes) -> None:
        parser = self.parser
        if hasattr(parser, "take"):  # this tree's connection.py (an older one's below)
            events, held = parser.take(data)
        else:
            parser.feed(data)
            events = parser.events()
            held = parser.buffered()
        self.read_bytes += len(data)
        if events:
            used = self.read_bytes - held
            self.lp.submit(self.session, events, used - self.submitted + len(events) * 64)
            self.submitted = used

    def next_command(self, step: str) -> bytes:
        """What to send for `step`, from the replies so far (outside the counted pass)."""
        replies, self.replies = b"".join(self.replies), []
        if replies.startswith(b"RESERVED "):
            self.job = replies.split(b" ", 2)[1]
        elif replies.startswith(b"RESERVED_BATCH "):
            self.jobs = re.findall(rb"RESERVED (\d+) ", replies)
        if step == "put":
            return PUT
        if step == "put-unique":  # a new key each, as bench/loadgen.py's workload
            self.keys += 1
            return loadgen.put_unique_command(b"k%d-%d" % (id(self), self.keys))
        if step == "reserve":
            return b"reserve-with-timeout 0\r\n"
        if step == "wait":
            return b"reserve\r\n"
        if step == "batch":
            return b"reserve-batch %d 0\r\n" % BATCH
        if step == "mc-set":
            return MC_SET
        if step == "mc-get":
            return b"get q\r\n"
        if step == "deletes":
            return b"".join(b"delete %s\r\n" % j for j in self.jobs)
        return b"delete %s\r\n" % self.job


async def _count_run(workload: str, per_turn: int, ops: int, mode: str, profile,
                     on_off=None, trace=None) -> dict:
    """`ops` ops of `workload` by `per_turn` clients, one command each per poller
    pass, as in request/response at `per_turn` connections; `profile` (a
    sys.setprofile hook, or None) and `trace` (a sys.settrace one) are on only
    during the passes of the measured ops, and so are `on_off`'s two callables
    (callgrind's collection), if given."""
    import trio

    from smallstalk.core.protocol import Parser
    from smallstalk.core.state import State
    from smallstalk.server.loop import MutationLoop
    from smallstalk.storage.journal import FSYNC_NEVER, Journal

    tmp = None
    journal = None
    if mode != "memory":
        tmp = Path(tempfile.mkdtemp(prefix="smallstalk-count-"))
        journal = Journal(tmp, 1, fsync=FSYNC_NEVER)
    lp = MutationLoop(State(), journal, tmp)
    steps = STEPS[workload]
    rounds = max(1, ops // per_turn)
    cpu = 0.0
    passes = 0
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(lp.run)
            service = None
            if workload == "mc":  # the memcache port's sessions (server/memcache.py)
                from smallstalk.server.memcache_dispatch import McService

                service = McService()
            conns = [_Conn(lp, Parser, service.session() if service else None)
                     for _ in range(per_turn)]
            producers = [_Conn(lp, Parser) for _ in range(per_turn)] \
                if workload == "handoff" else conns

            async def one_pass(sends: list, measured: bool) -> None:
                nonlocal cpu, passes
                if measured:
                    t0 = time.thread_time()
                    if profile is not None:
                        sys.setprofile(profile)
                    if trace is not None:
                        sys.settrace(trace)
                    if on_off is not None:
                        on_off[0]()
                lp.begin_batch()
                for c, data in sends:
                    c.received(data)
                await lp.end_batch()
                if measured:
                    if on_off is not None:
                        on_off[1]()
                    sys.setprofile(None)
                    sys.settrace(None)
                    cpu += time.thread_time() - t0
                    passes += 1

            await one_pass([], False)  # the sessions open
            if workload in ("rd", "rd-batch"):  # jobs to consume: pipelined puts per client
                per_op = BATCH if workload == "rd-batch" else 1
                await one_pass([(c, PUT * ((rounds + 8) * per_op)) for c in conns], False)
                for c in conns:
                    c.replies = []
            for i in range(8 + rounds):  # 8 ops' warm-up, then the measured ones
                for step in steps:
                    senders = producers if step == "put" else conns
                    await one_pass([(c, c.next_command(step)) for c in senders], i >= 8)
            nursery.cancel_scope.cancel()
    finally:
        if journal is not None:
            journal.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    commands = passes * per_turn
    return {"passes": passes, "commands": commands, "ops": rounds * per_turn,
            "cpu_us_per_command": 1e6 * cpu / commands if commands else None}


def count_calls(workload: str, per_turn: int, ops: int, mode: str) -> dict:
    """Python calls (and C calls) per command and per turn: deterministic."""
    import trio

    calls: collections.Counter = collections.Counter()

    def hook(frame, event, arg):
        if event == "call":
            code = frame.f_code
            calls[("py", f"{code.co_name} ({_short(code.co_filename)}:{code.co_firstlineno})")] \
                += 1
        elif event == "c_call":
            calls[("c", getattr(arg, "__qualname__", repr(arg)))] += 1

    res = trio.run(_count_run, workload, per_turn, ops, mode, hook)
    res["py_calls"] = sum(n for (k, _), n in calls.items() if k == "py")
    res["c_calls"] = sum(n for (k, _), n in calls.items() if k == "c")
    res["top"] = calls.most_common()
    return res


def count_opcodes(workload: str, per_turn: int, ops: int, mode: str) -> dict:
    """Bytecodes executed per command, by function: deterministic, and what a
    change to the hot path's Python is best judged by before any timing
    (callgrind then says what the bytecodes cost)."""
    import trio

    ops_by: collections.Counter = collections.Counter()

    def local(frame, event, arg):
        if event == "opcode":
            code = frame.f_code
            ops_by[(code.co_name, code.co_filename, code.co_firstlineno)] += 1
        return local

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return local

    res = trio.run(_count_run, workload, per_turn, ops, mode, None, None, trace)
    res["opcodes"] = sum(ops_by.values())
    res["top"] = [(f"{name} ({_short(file)}:{line})", n)
                  for (name, file, line), n in ops_by.most_common()]
    return res


def time_turns(workload: str, per_turn: int, ops: int, mode: str, reps: int) -> list[float]:
    """Thread CPU µs per command over the measured passes, `reps` times (no profiler)."""
    import trio

    return [trio.run(_count_run, workload, per_turn, ops, mode, None)["cpu_us_per_command"]
            for _ in range(reps)]


def count_main(args) -> int:
    """--tool count / time / callgrind: in this process, or alternating over --source DIRs."""
    if args.tool == "callgrind":
        return callgrind_main(args)
    if args.source and not args.inner:
        return _ab(args)
    rows = []
    for wl in args.workloads.split(","):
        for k in (int(x) for x in args.per_turn.split(",")):
            row = {"workload": wl, "per_turn": k, "mode": args.mode}
            if args.tool == "count":
                res = count_calls(wl, k, args.ops, args.mode)
                n, turns = res["commands"], res["passes"]
                row.update(py_per_cmd=res["py_calls"] / n, c_per_cmd=res["c_calls"] / n,
                           py_per_turn=res["py_calls"] / turns,
                           py_per_op=res["py_calls"] / res["ops"],
                           top=[(f"{kind} {name}", round(c / n, 3))
                                for (kind, name), c in res["top"]])
            elif args.tool == "opcodes":
                res = count_opcodes(wl, k, args.ops, args.mode)
                n = res["commands"]
                row.update(opcodes_per_cmd=res["opcodes"] / n,
                           opcodes_per_op=res["opcodes"] / res["ops"],
                           opcodes_per_turn=res["opcodes"] / res["passes"],
                           top=[(name, round(c / n, 3)) for name, c in res["top"]])
            else:
                us = time_turns(wl, k, args.ops, args.mode, args.reps)
                row.update(cpu_us_per_cmd=statistics.median(us), samples=us)
            rows.append(row)
    if args.inner:
        print(json.dumps(rows))
        return 0
    print(render_counts(rows, args))
    return 0


def _ab(args) -> int:
    """Each --source DIR's smallstalk/ in its own process, alternating A B, B A, ..."""
    results: dict[str, list] = {d: [] for d in args.source}
    for rnd in range(args.rounds):
        for d in args.source if rnd % 2 == 0 else args.source[::-1]:
            env = dict(os.environ, PYTHONPATH=str(Path(d).resolve()))
            out = subprocess.run(
                [sys.executable, str(HERE / "profile.py"), "--tool", args.tool, "--inner",
                 "--workloads", args.workloads, "--per-turn", args.per_turn, "--ops",
                 str(args.ops), "--mode", args.mode, "--reps", str(args.reps)],
                env=env, cwd="/", capture_output=True, text=True, check=True).stdout
            results[d].append(json.loads(out))
    lines = [f"### {args.tool}: " + " vs ".join(args.source) + f" ({args.rounds} alternating "
             f"rounds, mode {args.mode})", ""]
    key, what = {"count": ("py_per_cmd", "Python calls per command"),
                 "opcodes": ("opcodes_per_cmd", "bytecodes per command")}.get(
        args.tool, ("cpu_us_per_cmd", "CPU µs per command, median"))
    lines += ["| workload | per turn | " + " | ".join(args.source) + " |",
              "|---|---:|" + "---:|" * len(args.source)]
    first = results[args.source[0]][0]
    for i, row in enumerate(first):
        vals = [statistics.median(r[i][key] for r in results[d]) for d in args.source]
        lines.append(f"| {row['workload']} | {row['per_turn']} | "
                     + " | ".join(f"{v:.2f}" for v in vals) + " |")
    print("\n".join(lines) + f"\n\n({what})")
    return 0


# --- instructions per command under callgrind -------------------------------------------

# Callgrind's client requests, for ctypes: collection is switched on for each
# measured pass only, and the counts are dumped once per workload.
CALLGRIND_C = r"""
#include <valgrind/callgrind.h>
void ss_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void ss_dump(const char *what) { CALLGRIND_DUMP_STATS_AT(what); }
void ss_zero(void) { CALLGRIND_ZERO_STATS; }
"""


def _callgrind_lib(tmp: Path):
    import ctypes

    src, lib = tmp / "ss_callgrind.c", tmp / "ss_callgrind.so"
    src.write_text(CALLGRIND_C)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("--tool callgrind needs a C compiler and valgrind's headers "
                         "(apt-get install -y gcc valgrind)")
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))


def callgrind_inner(args) -> list[dict]:
    """Under valgrind: every (workload, per turn) in turn, collection on during
    its measured passes only, one dump each; and a calibration of what the
    switching itself costs (a pass of nothing)."""
    import gc

    import trio

    # The cyclic collector runs at allocation counts, wherever they fall: off,
    # so that a change elsewhere cannot move a collection into or out of the passes.
    gc.disable()
    tmp = Path(args.cg_dir)
    lib = _callgrind_lib(tmp)
    on_off = (lib.ss_toggle, lib.ss_toggle)
    rows = []
    # Calibration: the toggles around an empty pass body, as the passes make them.
    lib.ss_zero()
    n_cal = 2000
    for _ in range(n_cal):
        on_off[0]()
        on_off[1]()
    lib.ss_dump(b"calibration")
    for wl in args.workloads.split(","):
        for k in (int(x) for x in args.per_turn.split(",")):
            ops = max(args.ops, k * 4)
            gc.collect()
            lib.ss_zero()
            res = trio.run(_count_run, wl, k, ops, args.mode, None, on_off)
            lib.ss_dump(f"{wl}/{k}".encode())
            rows.append({"workload": wl, "per_turn": k, "mode": args.mode,
                         "passes": res["passes"], "commands": res["commands"], "ops": res["ops"]})
    return [{"calibration_passes": n_cal}, *rows]


def _callgrind_totals(out_dir: Path) -> dict[str, int]:
    """Instructions collected in each dump, by its label."""
    totals = {}
    for f in out_dir.glob("callgrind.out.*"):
        label = ir = None
        with open(f) as fh:
            for line in fh:
                if line.startswith("desc: Trigger:"):
                    m = re.search(r"Client Request: (.*)$", line.strip())
                    label = m.group(1) if m else line.split(":", 2)[2].strip()
                elif line.startswith(("summary:", "totals:")):
                    ir = int(line.split()[1])
        if label is not None and ir is not None:
            totals[label] = ir
    return totals


def callgrind_main(args) -> int:
    """Run the passes under valgrind --tool=callgrind; instructions per command."""
    if args.inner:
        print(json.dumps(callgrind_inner(args)))
        return 0
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--tool callgrind needs valgrind (apt-get install -y valgrind)")
    sources = args.source or [None]
    lines = []
    for src in sources:
        tmp = Path(tempfile.mkdtemp(prefix="smallstalk-callgrind-"))
        try:
            env = dict(os.environ, PYTHONHASHSEED="0")
            if src is not None:
                env["PYTHONPATH"] = str(Path(src).resolve())
            out = subprocess.run(
                [valgrind, "--tool=callgrind", "--collect-atstart=no",
                 f"--callgrind-out-file={tmp}/callgrind.out.%p", sys.executable,
                 str(HERE / "profile.py"), "--tool", "callgrind", "--inner", "--cg-dir",
                 str(tmp), "--workloads", args.workloads, "--per-turn", args.per_turn,
                 "--ops", str(args.ops), "--mode", args.mode],
                env=env, cwd="/" if src is not None else None, capture_output=True,
                text=True)
            if out.returncode != 0:
                raise SystemExit(f"valgrind failed:\n{out.stderr[-3000:]}")
            meta = json.loads(out.stdout.strip().splitlines()[-1])
            totals = _callgrind_totals(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        per_toggle_pair = totals["calibration"] / meta[0]["calibration_passes"]
        what = src or "this checkout"
        lines += [f"### Instructions per command in-process under callgrind, mode {args.mode}: "
                  f"{what} (switching collection on and off: {per_toggle_pair:,.0f} per pass, "
                  "subtracted)", "",
                  "| workload | commands per turn | instructions/command | per op | per turn |",
                  "|---|---:|---:|---:|---:|"]
        for row in meta[1:]:
            ir = totals[f"{row['workload']}/{row['per_turn']}"] \
                - per_toggle_pair * row["passes"]
            lines.append(f"| {row['workload']} | {row['per_turn']} | "
                         f"{ir / row['commands']:,.0f} | {ir / row['ops']:,.0f} | "
                         f"{ir / row['passes']:,.0f} |")
        lines.append("")
    print("\n".join(lines))
    return 0


def render_counts(rows: list[dict], args) -> str:
    if args.tool == "time":
        lines = [f"### Thread CPU per command in-process, mode {args.mode} ({args.ops} ops, "
                 f"{args.reps} repetitions: median, min-max)", "",
                 "| workload | commands per turn | µs/command | min | max |",
                 "|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['workload']} | {r['per_turn']} | {r['cpu_us_per_cmd']:.2f} | "
                         f"{min(r['samples']):.2f} | {max(r['samples']):.2f} |")
        return "\n".join(lines) + "\n"
    if args.tool == "opcodes":
        lines = [f"### Bytecodes per command in-process, mode {args.mode} ({args.ops} ops after "
                 f"8 of warm-up; git {servers.git_info()['commit'][:10]}; the harness's own "
                 f"`received` and `deliver` (bench/profile.py) are counted too)", "",
                 "| workload | commands per turn | bytecodes/command | per op | per turn |",
                 "|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['workload']} | {r['per_turn']} | {r['opcodes_per_cmd']:.1f} | "
                         f"{r['opcodes_per_op']:.1f} | {r['opcodes_per_turn']:.1f} |")
        for r in rows:
            lines += ["", f"Top {args.top} functions, bytecodes per command, {r['workload']} "
                      f"with {r['per_turn']} per turn:", "", "| bytecodes/command | function |",
                      "|---:|---|"]
            lines += [f"| {n:.1f} | `{name}` |" for name, n in r["top"][: args.top]]
        return "\n".join(lines) + "\n"
    lines = [f"### Calls per command in-process, mode {args.mode} ({args.ops} ops after 8 of "
             f"warm-up; a turn = one poller pass with one command from each client; git "
             f"{servers.git_info()['commit'][:10]})", "",
             "| workload | commands per turn | Python calls/command | per op | per turn | "
             "C calls/command |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['per_turn']} | {r['py_per_cmd']:.1f} | "
                     f"{r['py_per_op']:.1f} | {r['py_per_turn']:.1f} | {r['c_per_cmd']:.1f} |")
    for r in rows:
        lines += ["", f"Top {args.top} calls per command, {r['workload']} with "
                  f"{r['per_turn']} per turn:", "", "| calls/command | function |", "|---:|---|"]
        lines += [f"| {n:.3f} | `{name}` |" for name, n in r["top"][: args.top]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
