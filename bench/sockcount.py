#!/usr/bin/env python3
"""Instructions per command over real sockets: smallstalk against the floor's per put, under callgrind.

    .venv/bin/python bench/sockcount.py --conns 1,10 --ops 1000
    .venv/bin/python bench/sockcount.py --workloads put,rd,cycle --source /tmp/base --source /tmp/new

Each server (bench/floor.py, and smallstalk in memory mode, or `--mode never` or `always`, from this checkout
or from each `--source DIR`'s `smallstalk/`) runs whole under
`valgrind --tool=callgrind` on loopback, and bench/loadgen.py (one process,
outside valgrind) sends it `--ops` puts, request/response, at each
connection count; a second run sends three times as many. The difference of
the two runs' instructions over the difference of their puts is the
server's user-space instructions per put: start-up, imports and shutdown
cancel out. The kernel's work is not counted (valgrind sees only user
space), for either server.

`--workloads` adds bench/loadgen.py's `rd` (reserve-with-timeout 0 and
delete: two commands an op) and `cycle` (put, reserve, delete: three) for
smallstalk; the floor answers puts only, so each row's ratio is smallstalk's
instructions per command over the floor's per put at the same connections,
the issue's measure. With `--mode never` the writing floor (`floor.py --log`,
a record per put appended with one write a wake-up) runs too, and each row
also gives smallstalk's per command over its per put. Before an `rd` run the server is loaded with 3 x `--ops`
+ 100 per connection jobs (pipelined puts), the same number in both runs, so
the loading cancels out too; the shorter run ends with 2 x `--ops` more jobs
left, whose freeing at exit is not cancelled (a few hundred instructions a
job: well under 1% of an op).

Each wake-up's own cost (trio's scheduling, the poller's pass, a turn) is
shared by the commands it finds, and how many it finds depends on how fast
the load generator answers, so on what else the machine runs: the last
column, commands per epoll poll (`calls` of `select_epoll_poll`: trio's
wait and the poller's pass each make one), says how alike two rows'
batching was. A ratio between rows whose batching differs says as much
about the machine as about the servers (at 100 connections the floor's
put read 14,100 instructions with another callgrind run beside it and
18,300 alone). Minutes per point: run it on a quiet moment or with few
points.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import loadgen  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before answering")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"stats\r\n")
                if s.recv(100).startswith(b"OK"):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not answer `stats` in time")


def _connections(s: socket.socket) -> int:
    """smallstalk's current-connections (`stats`), this one included."""
    s.sendall(b"stats\r\n")
    data = b""
    while b"\r\n" not in data:
        data += s.recv(65536)
    head, _, data = data.partition(b"\r\n")
    size = int(head.split()[1]) + 2
    while len(data) < size:
        data += s.recv(65536)
    for line in data.split(b"\n"):
        if line.startswith(b"current-connections:"):
            return int(line.split()[1])
    raise SystemExit("no current-connections in stats")


def _wait_connections(port: int, done, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        while time.monotonic() < deadline:
            if done(_connections(s)):
                return
            time.sleep(0.2)
    raise SystemExit(f"server did not {what} in time")


def _wait_accepted(port: int, conns: int) -> None:
    """Until smallstalk has accepted `conns` connections besides the one
    asking. Under valgrind it accepts slowly: a run that ends before it has
    accepted every connection counts fewer connections' set-up than the
    longer run, and the difference of the two is then set-up, not commands
    (at 100 connections and 1,000 puts, 49 connections were accepted against
    83 in the run of 3,000)."""
    _wait_connections(port, lambda n: n > conns, f"accept {conns} connections")


def _wait_closed(port: int) -> None:
    """Until smallstalk has closed the load's connections, before it is
    stopped: a run stopped while it still closes them counts some of the
    closes and the other run not (±750 instructions a put at 100
    connections, in either direction)."""
    _wait_connections(port, lambda n: n <= 1, "close the load's connections")


def _first_call_only(f):
    """loadgen calls its probe before the start and after the end: only the first."""
    calls = []

    def once() -> None:
        if not calls:
            calls.append(1)
            f()
    return once


def calls(out: Path, name: str) -> int:
    """How many times the run of callgrind file `out` called C function `name`
    (callgrind's `calls=` lines under each `cfn=` naming it)."""
    ids: set[str] = set()
    total = 0
    counting = False
    with open(out) as f:
        for line in f:
            if line.startswith(("fn=", "cfn=")):
                head, _, rest = line.rstrip("\n").partition(" ")
                fid = head.split("=", 1)[1]
                if rest == name:
                    ids.add(fid)
                counting = line.startswith("cfn=") and fid in ids
            elif counting and line.startswith("calls="):
                total += int(line[6:].split()[0])
                counting = False
    return total


def counts(kind: str, source: str | None, conns: int, ops: int, tmp: Path,
           workload: str = "put", preload: int = 0, mode: str = "memory") -> tuple[int, int]:
    """The server's total instructions for one run of `ops` ops of `workload`
    at `conns` (after `preload` pipelined puts, for `rd`), and the run's epoll
    polls (trio's wait for events and the poller's pass each make one): how
    many wake-ups it took."""
    port = _free_port()
    out = tmp / f"callgrind.{kind}.{workload}.{conns}.{ops}.out"
    env = dict(os.environ, PYTHONHASHSEED="0")
    cwd = None
    if kind.startswith("floor"):
        cmd = [sys.executable, str(HERE / "floor.py"), "-l", "127.0.0.1", "-p", str(port)]
        if kind == "floor-log":
            cmd += ["--log", str(Path(tempfile.mkdtemp(prefix="data-", dir=tmp)) / "records.log")]
    else:
        cmd = [sys.executable, "-m", "smallstalk", "serve", "-l", "127.0.0.1", "-p", str(port)]
        if mode != "memory":  # a fresh data directory each run
            cmd += ["--data-dir", tempfile.mkdtemp(prefix="data-", dir=tmp), "--fsync", mode]
        if source is not None:
            cwd = str(Path(source).resolve())  # first on sys.path for -m
    proc = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                             *cmd], env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_up(port, proc)
        if preload:
            loadgen.run(port, "load", min(conns, 10), total=preload, duration=3600, procs=1)
        ready = None if kind.startswith("floor") else _first_call_only(
            lambda: _wait_accepted(port, conns))
        res = loadgen.run(port, workload, conns, duration=3600, procs=1, max_ops=ops,
                          probe=ready)
        if res["ops"] < ops or res.get("errors"):
            raise SystemExit(f"{kind}: {res['ops']} of {ops} {workload} ops answered, "
                             f"{res.get('errors')} errors")
        if not kind.startswith("floor"):
            _wait_closed(port)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(timeout=60)
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1]), calls(out, "select_epoll_poll")
    raise SystemExit(f"no totals in {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conns", default="1,10")
    ap.add_argument("--ops", type=int, default=1000, help="ops of the shorter run (x3 the other)")
    ap.add_argument("--mode", choices=("memory", "never", "always"), default="memory",
                    help="smallstalk's durability mode (bench/run.py's; the floor has none)")
    ap.add_argument("--workloads", default="put",
                    help="smallstalk's workloads, of put, rd, cycle, put-unique (the floor "
                         "runs put)")
    ap.add_argument("--source", action="append", metavar="DIR",
                    help="a directory holding a smallstalk/ package (default: this checkout)")
    a = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install -y valgrind)")
    floors = ["floor", "floor-log"] if a.mode == "never" else ["floor"]
    servers = [(f, None) for f in floors] + [("smallstalk", s) for s in (a.source or [None])]
    tmp = Path(tempfile.mkdtemp(prefix="smallstalk-sockcount-"))
    rows = []
    try:
        for conns in (int(c) for c in a.conns.split(",")):
            floor = floor_log = None
            for kind, src in servers:
                for wl in ["put"] if kind.startswith("floor") else a.workloads.split(","):
                    preload = 3 * a.ops + 100 * conns if wl == "rd" else 0
                    lo, lo_polls = counts(kind, src, conns, a.ops, tmp, wl, preload, a.mode)
                    hi, hi_polls = counts(kind, src, conns, 3 * a.ops, tmp, wl, preload, a.mode)
                    per_op = (hi - lo) / (2 * a.ops)
                    per_cmd = per_op / loadgen.COMMANDS_PER_OP[wl]
                    floor = per_cmd if kind == "floor" else floor
                    floor_log = per_cmd if kind == "floor-log" else floor_log
                    name = kind if src is None else f"{kind} {src}"
                    cmds = 2 * a.ops * loadgen.COMMANDS_PER_OP[wl]
                    per_poll = cmds / (hi_polls - lo_polls) if hi_polls > lo_polls else float("inf")
                    wfloor = "" if a.mode != "never" else \
                        f" {per_cmd / floor_log:.2f}× |" if floor_log else " – |"
                    rows.append(f"| {conns} | {name} | {wl} | {per_op:,.0f} | {per_cmd:,.0f} | "
                                f"{per_cmd / floor:.2f}× |{wfloor} {per_poll:,.1f} |")
                    print(rows[-1], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wcol = (" / writing floor's |", "---:|") if a.mode == "never" else ("", "")
    print(f"### User-space instructions per command over loopback, mode {a.mode}, under "
          f"callgrind ({a.ops} and {3 * a.ops} ops)\n\n| connections | server | workload | "
          f"instructions/op | per command | / floor's per put |{wcol[0]} commands per poll |\n"
          f"|---:|---|---|---:|---:|---:|{wcol[1]}---:|\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
