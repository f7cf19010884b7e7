#!/usr/bin/env python3
"""Replication lag under load, and failover time, for the README.

    .venv/bin/python bench/replication.py [--conns 10] [--seconds 10] [--fsync always]

Starts a primary and a replica (fresh data directories, 127.0.0.1), drives
the primary with bench/loadgen.py puts, samples the replica's
`replication-lag-records` and `replication-lag-seconds` every 50 ms, then
SIGKILLs the primary, promotes the replica and times promote + first put on
it. Not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.procs import free_port, start_smallstalk  # noqa: E402


def stats(port: int) -> dict[str, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"stats\r\n")
        data = b""
        while not data.endswith(b"\n\r\n"):
            data += s.recv(65536)
    body = data.split(b"\r\n", 1)[1]
    return dict(line.split(": ", 1) for line in body.decode().splitlines()[1:] if ": " in line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--fsync", default="always")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="smallstalk-repl-"))
    primary = start_smallstalk(tmp, "--fsync", args.fsync, "--extended-stats",
                               data_dir=tmp / "primary")
    replica = start_smallstalk(tmp, "--fsync", args.fsync, "--extended-stats", "--replica-of",
                               f"127.0.0.1:{primary.port}", data_dir=tmp / "replica")
    try:
        load = subprocess.Popen([sys.executable, str(ROOT / "bench" / "loadgen.py"), "-p",
                                 str(primary.port), "-w", "put", "-c", str(args.conns), "-d",
                                 str(args.seconds)], stdout=subprocess.DEVNULL)
        lag_records, lag_seconds = [], []
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and load.poll() is None:
            st = stats(replica.port)
            lag_records.append(int(st["replication-lag-records"]))
            lag_seconds.append(float(st["replication-lag-seconds"]))
            time.sleep(0.05)
        load.wait(timeout=args.seconds + 30)
        puts = int(stats(primary.port)["cmd-put"])
        os.kill(primary.pid, signal.SIGKILL)
        primary.proc.wait()
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "smallstalk", "promote",
                              f"127.0.0.1:{replica.port}"], capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
        with socket.create_connection(("127.0.0.1", replica.port), timeout=10) as s:
            s.sendall(b"put 0 0 10 1\r\nx\r\n")
            reply = s.recv(100)
        failover = time.monotonic() - started
        print(f"load: {args.conns} producers, {puts / args.seconds:,.0f} puts/s, "
              f"--fsync {args.fsync}, {len(lag_records)} samples")
        print(f"lag records: median {statistics.median(lag_records):.0f}, "
              f"p99 {sorted(lag_records)[int(0.99 * (len(lag_records) - 1))]}, "
              f"max {max(lag_records)}")
        print(f"lag seconds: median {statistics.median(lag_seconds):.3f}, "
              f"max {max(lag_seconds):.3f}")
        print(f"failover: {out.stdout.strip()}, first put {reply!r} "
              f"{failover * 1000:.0f} ms after the promote command started")
    finally:
        primary.kill()
        replica.stop()


if __name__ == "__main__":
    free_port()
    main()
