"""A tube with `max-rate`: how accurate the rate is, and what a limit costs a reserve.

Starts `smallstalk serve` (in memory) with a configuration file that gives the
tube `limited` a rate limit, fills it, and lets CONNS workers take jobs from it
(reserve-with-timeout 1, delete) for SECONDS:

- accuracy: a token bucket of R tokens refilled at R/s hands out R at once and
  then R per second: the grants of the run's second half should come at
  R/s, and by any time t there may be at most R + R·t grants (how far they
  ever went past that bound is reported; it should be at most 1);
- cost: server CPU per job consumed (from /proc/PID/stat) on an unlimited
  tube, and on a tube whose limits never bind (`max-rate` of a billion per
  second, `max-reserved` of a million): the difference is what checking the
  limits adds to a reserve.

    .venv/bin/python bench/ratelimit.py --rate 500 --seconds 4

Prints one JSON object; bench/run.py runs `measure` as its `rate` section.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class _Conn:
    def __init__(self, port: int):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buf = b""

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.s.recv(65536)
            if not chunk:
                raise ConnectionError("server closed")
            self.buf += chunk
        out, self.buf = self.buf.split(b"\r\n", 1)
        return out

    def ask(self, cmd: bytes) -> bytes:
        self.s.sendall(cmd)
        return self.line()

    def skip(self, n: int) -> None:
        while len(self.buf) < n + 2:
            self.buf += self.s.recv(65536)
        self.buf = self.buf[n + 2:]


def _server(config: str, work: Path, python: str, cwd: Path) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    cfg = work / f"rate-{port}.toml"
    cfg.write_text(config)
    log = open(work / f"rate-{port}.log", "ab")
    proc = subprocess.Popen([python, "-m", "smallstalk", "serve", "-l", "127.0.0.1", "-p",
                             str(port), "--config", str(cfg)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=cwd, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            _Conn(port).ask(b"stats\r\n")
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("smallstalk did not start") from None
            time.sleep(0.02)


def _fill(port: int, tube: bytes, n: int) -> None:
    c = _Conn(port)
    c.ask(b"use %b\r\n" % tube)
    put = b"put 1024 0 60 100\r\n" + b"x" * 100 + b"\r\n"
    left = n
    while left:
        k = min(left, 500)
        c.s.sendall(put * k)
        for _ in range(k):
            c.line()
        left -= k


def _consume(port: int, tube: bytes, conns: int, seconds: float) -> tuple[list[float], float]:
    """Workers take jobs for `seconds`: (grant times since the start, server-side elapsed)."""
    times: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(conns + 1)
    t0 = [0.0]

    def work() -> None:
        c = _Conn(port)
        c.ask(b"watch %b\r\n" % tube)
        c.ask(b"ignore default\r\n")
        start.wait()
        while time.monotonic() < t0[0] + seconds:
            head = c.ask(b"reserve-with-timeout 1\r\n")
            if not head.startswith(b"RESERVED"):
                continue
            _, jid, size = head.split()
            c.skip(int(size))
            now = time.monotonic() - t0[0]
            c.ask(b"delete %b\r\n" % jid)
            with lock:
                times.append(now)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(conns)]
    for t in threads:
        t.start()
    t0[0] = time.monotonic()
    start.wait()
    t0[0] = time.monotonic()
    for t in threads:
        t.join(seconds + 30)
    return sorted(times), time.monotonic() - t0[0]


def _run(config: str, tube: bytes, jobs: int, conns: int, seconds: float, work: Path,
         python: str, cwd: Path) -> dict:
    proc, port = _server(config, work, python, cwd)
    try:
        _fill(port, tube, jobs)
        cpu0 = _cpu_s(proc.pid)
        times, elapsed = _consume(port, tube, conns, seconds)
        cpu = _cpu_s(proc.pid) - cpu0
        return {"times": times, "elapsed": elapsed, "consumed": len(times),
                "server_cpu_us_per_job": round(1e6 * cpu / max(1, len(times)), 1)}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure(rate: int = 500, seconds: float = 4.0, conns: int = 4,
            python: str = sys.executable, work: Path | None = None,
            cwd: Path = REPO) -> dict:
    """The JSON object; `cwd` is where `python -m smallstalk` finds the package."""
    work = work or Path(tempfile.mkdtemp(prefix="smallstalk-rate-"))
    limited = _run(f'[tubes.limited]\nmax-rate = "{rate}/s"\n', b"limited",
                   int(rate * (seconds + 2)), conns, seconds, work, python, cwd)
    times = limited.pop("times")
    # The steady rate: grants in the second half of the run, once the bucket's
    # first `rate` tokens (handed out at once, or as fast as the workers take
    # them) are long gone.
    half = seconds / 2
    late = [t for t in times if half <= t < seconds]
    steady = len(late) / (seconds - half) if late else None
    # The bucket's bound: by time t at most rate + rate·t grants; how far the
    # grants ever went past it (at most 1: the grant that is due at t itself).
    over = max(((i + 1) - (rate + rate * t) for i, t in enumerate(times)), default=0.0)
    free_jobs = 20_000
    free = _run("", b"free", free_jobs, conns, seconds, work, python, cwd)
    loose = _run('[tubes.free]\nmax-rate = "1000000000/s"\nmax-reserved = 1000000\n', b"free",
                 free_jobs, conns, seconds, work, python, cwd)
    for r in (free, loose):
        r.pop("times")
    return {
        "rate": rate, "seconds": seconds, "conns": conns,
        "consumed": limited["consumed"],
        "steady_per_sec": round(steady, 1) if steady else None,
        "accuracy": round(steady / rate, 4) if steady else None,
        "max_over_bound_jobs": round(over, 2),
        "limited_cpu_us_per_job": limited["server_cpu_us_per_job"],
        "unlimited_cpu_us_per_job": free["server_cpu_us_per_job"],
        "unlimited_per_sec": round(free["consumed"] / free["elapsed"]),
        "loose_limit_cpu_us_per_job": loose["server_cpu_us_per_job"],
        "loose_limit_per_sec": round(loose["consumed"] / loose["elapsed"]),
        "loadavg": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=500, help="reserves per second (max-rate)")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--conns", type=int, default=4)
    args = ap.parse_args()
    print(json.dumps(measure(args.rate, args.seconds, args.conns), indent=1))


if __name__ == "__main__":
    main()
