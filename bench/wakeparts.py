"""Where a hand-off's microseconds go, server side, stamped (no tracer).

Syscall tracers add more to each call on this kind of machine than the parts
sought (docs/PERFORMANCE-ROUNDS.md), so this stamps instead. smallstalk runs in this
process, memory mode, with four clock reads (CLOCK_REALTIME, `time.time_ns`):
when trio's epoll wait returns with events, when the poller task resumes from
its `wait_readable`, when the producer's connection reads its put
(`on_readable`), and around the write of the RESERVED to the waiting worker.
A second process is the client: a worker sends `reserve`, the producer, after
an idle pause, puts a job; the worker's socket gives the kernel's receive time
of the RESERVED (SO_TIMESTAMPNS, the same clock), the end of the server's part.

    .venv/bin/python bench/wakeparts.py --samples 2000

It reaches into trio's private `_core._io_epoll` for the first stamp, and
replaces two methods of server/connection.py's connection class: a
measurement tool, not a test; a trio release may move what it patches.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from loadgen import percentile  # noqa: E402
from measure import handoffs  # noqa: E402

PARTS = (
    ("the put's send -> trio's epoll wait returns", 0, 1),
    ("-> the poller task resumes (trio's run loop)", 1, 2),
    ("-> the producer's connection reads (poller pass)", 2, 3),
    ("-> RESERVED write starts (parse, turn, grant)", 3, 4),
    ("-> RESERVED reaches the worker's socket", 4, 6),
    ("(the write call itself)", 4, 5),
    ("server side in all: send -> worker's socket", 0, 6),
)


def client(port: int, n: int, settle: float) -> list[tuple[int, int]]:
    """n hand-offs after 50 of warm-up: (send ns, kernel receive ns) each."""
    stamps = [(t0_ns, t_rx) for _held, t0_ns, t_rx in handoffs(port, n + 50, settle)]
    return stamps[50:]


def serve_stamped(port: int, n: int, settle: float) -> dict:
    import trio
    import trio._core._io_epoll as io_epoll

    from smallstalk.cli import main
    from smallstalk.server import connection

    woke, resumed, read = [0], [0], [0]
    stamps: list[tuple[int, int, int, int, int]] = []
    get_events = io_epoll.EpollIOManager.get_events
    wait_readable = trio.lowlevel.wait_readable
    on_readable = connection._Connection.on_readable
    deliver = connection._Connection.deliver

    def stamped_get_events(self, timeout):
        events = get_events(self, timeout)
        if events:
            woke[0] = time.time_ns()
        return events

    async def stamped_wait_readable(fd):
        await wait_readable(fd)
        resumed[0] = time.time_ns()

    def stamped_on_readable(self):
        read[0] = time.time_ns()
        return on_readable(self)

    def stamped_deliver(self, blob, done, close):
        if not (isinstance(blob, bytes) and blob.startswith(b"RESERVED ")):
            return deliver(self, blob, done, close)
        t = time.time_ns()
        deliver(self, blob, done, close)
        stamps.append((woke[0], resumed[0], read[0], t, time.time_ns()))
        return None

    io_epoll.EpollIOManager.get_events = stamped_get_events
    trio.lowlevel.wait_readable = stamped_wait_readable
    connection._Connection.on_readable = stamped_on_readable
    connection._Connection.deliver = stamped_deliver
    result: dict = {}

    def drive() -> None:
        deadline = time.monotonic() + 30
        while True:  # until the server answers
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    os._exit(2)
                time.sleep(0.05)
        proc = subprocess.run([sys.executable, __file__, "--client", str(port), "--samples",
                               str(n), "--settle", str(settle)],
                              capture_output=True, text=True, check=True)
        samples = json.loads(proc.stdout)
        # A reply the kernel did not stamp (measure.recv_stamped) has no end: left out.
        result["rows"] = [(t0, *srv, t_rx) for (t0, t_rx), srv
                          in zip(samples, stamps[-len(samples):], strict=True)
                          if t_rx is not None]
        report(result["rows"])
        os._exit(0)  # the server runs in the main thread until then

    threading.Thread(target=drive, daemon=True).start()
    main(["serve", "-l", "127.0.0.1", "-p", str(port)])
    return result


def report(rows: list[tuple[int, ...]]) -> None:
    print(f"{len(rows):,} hand-offs, server side, µs (smallstalk in memory, stamped)\n")
    print(f"{'part':52} {'p50':>7} {'p90':>7} {'p99':>7}")
    for name, a, b in PARTS:
        xs = sorted((r[b] - r[a]) / 1000 for r in rows)
        q = [percentile(xs, p) for p in (0.5, 0.9, 0.99)]
        print(f"{name:52} {q[0]:7.1f} {q[1]:7.1f} {q[2]:7.1f}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--settle", type=float, default=0.0005,
                    help="idle seconds before each put (as bench/run.py's hand-off)")
    ap.add_argument("--port", type=int, default=11471)
    ap.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client is not None:
        print(json.dumps(client(args.client, args.samples, args.settle)))
        return 0
    serve_stamped(args.port, args.samples, args.settle)
    return 1  # the server ended before the client did


if __name__ == "__main__":
    sys.exit(main())
