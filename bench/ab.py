#!/usr/bin/env python3
"""A/B of two smallstalk checkouts at one point, alternating: server CPU µs/op medians.

    .venv/bin/python bench/ab.py memory/put/10 /tmp/base /tmp/new --rounds 6

    .venv/bin/python bench/ab.py spawn /tmp/base /tmp/new --rounds 30

Each DIR holds a `smallstalk/` package (a copy of main, a copy of a branch).
The point `spawn` (or `spawn-dir`, with an empty data directory) times spawn
to the first reply to `stats` instead, with the server's CPU time by then.
Every round starts a fresh server from each DIR in turn (A B, then B A) and
drives it with bench/loadgen.py for `--duration` seconds; `rd` points are
pre-loaded first. On a shared machine the server's CPU per op is the figure
to compare; ops/s is printed next to it. See bench/README.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402
import measure  # noqa: E402
import servers  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("point", help="MODE/WORKLOAD/CONNS, e.g. memory/put/10")
    ap.add_argument("sources", nargs="+", metavar="DIR")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=1.5)
    ap.add_argument("--procs", type=int, default=2)
    a = ap.parse_args(argv)
    if a.point in ("spawn", "spawn-dir"):
        return spawn_ab(a.point == "spawn-dir", a.sources, a.rounds)
    mode, workload, conns = a.point.split("/")
    workdir = Path(tempfile.mkdtemp(prefix="smallstalk-ab-"))
    bench = types.SimpleNamespace(args=types.SimpleNamespace(procs=a.procs),
                                  preset={"max_ops": 0})
    res: dict[str, list] = {s: [] for s in a.sources}
    try:
        for i in range(a.rounds):
            for src in a.sources if i % 2 == 0 else a.sources[::-1]:
                srv = servers.Server("smallstalk", mode, workdir, src=Path(src)).start()
                try:
                    if workload in ("rd", "rd-pipe"):
                        loadgen.run(srv.port, "load", 10, procs=a.procs, total=60_000,
                                    duration=5.0)
                    r = measure.Bench.drive(bench, srv, workload, int(conns), duration=a.duration,
                                        max_ops=0)
                    res[src].append((r["server_cpu_us_per_op"], r["ops_per_sec"]))
                finally:
                    srv.stop()
                    if srv.data_dir is not None:
                        shutil.rmtree(srv.data_dir, ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for src, rows in res.items():
        us = [x[0] for x in rows if x[0] is not None]
        ops = [x[1] for x in rows]
        print(f"{a.point} {src}: server CPU µs/op median {statistics.median(us):.1f} "
              f"(min {min(us):.1f}, max {max(us):.1f}), ops/s median {statistics.median(ops):,.0f}")
    return 0


def spawn_ab(with_dir: bool, sources: list[str], rounds: int) -> int:
    """Spawn to first reply from each DIR in turn: medians of wall and server CPU ms,
    beside `python -c "import trio"` spawned in the same rounds."""
    workdir = Path(tempfile.mkdtemp(prefix="smallstalk-ab-"))
    res: dict[str, list] = {s: [] for s in ["import trio", *sources]}
    for src in sources:
        servers.compile_package(Path(src))
    try:
        for i in range(rounds):
            res["import trio"].append((measure.import_trio_ms(1)["median_ms"], None))
            for src in sources if i % 2 == 0 else sources[::-1]:
                bench = types.SimpleNamespace(workdir=workdir, src=Path(src))
                wall, cpu = measure.spawn_to_first_reply(bench, "smallstalk", with_dir)
                res[src].append((1e3 * wall, None if cpu is None else 1e3 * cpu))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for src, rows in res.items():
        walls = [x[0] for x in rows]
        cpus = [x[1] for x in rows if x[1] is not None]
        cpu = f", server CPU ms median {statistics.median(cpus):.1f}" if cpus else ""
        print(f"spawn{'-dir' if with_dir else ''} {src}: wall ms median "
              f"{statistics.median(walls):.1f} (min {min(walls):.1f}, max {max(walls):.1f}){cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
