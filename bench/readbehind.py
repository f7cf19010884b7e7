"""Read-behind (issue #8): a backlog far bigger than --max-memory, then drained.

Starts `smallstalk serve --fsync never` on a fresh data directory, puts TOTAL
bytes of jobs with random bodies of 1-60 KiB (pipelined, one producer), then
reserves and deletes them all (one worker), checking every body's SHA-256.
Meanwhile the server's VmRSS is sampled from /proc every 20 ms; VmHWM (its
peak) is read at the end. Prints one JSON object.

    .venv/bin/python bench/readbehind.py --total 2GiB --max-memory 64MB
    .venv/bin/python bench/readbehind.py --total 512MiB --compare   # with and without a budget

tests/procs/test_readbehind.py loads this file and uses its `drive`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BATCH = 32  # commands per send


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([kmg]?)(i?b)?", text.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def job_sizes(total: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    out: list[int] = []
    left = total
    while left > 0:
        n = min(rnd.randint(1024, 60 * 1024), max(left, 1024))
        out.append(n)
        left -= n
    return out


def body(i: int, size: int, seed: int) -> bytes:
    return random.Random(seed * 1_000_003 + i).randbytes(size)


class Conn:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> None:
        data = self.sock.recv(1 << 20)
        if not data:
            raise ConnectionError("server closed the connection")
        self.buf += data

    def line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            self._more()
        out = bytes(self.buf[:i])
        del self.buf[:i + 2]
        return out

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def stats(self) -> dict[str, str]:
        self.send(b"stats\r\n")
        head = self.line()
        data = self.exact(int(head.split()[1]) + 2).decode()
        return dict(ln.split(": ", 1) for ln in data.splitlines()[1:] if ": " in ln)

    def close(self) -> None:
        self.sock.close()


class RssSampler(threading.Thread):
    """Max VmRSS of a process, sampled every `every` seconds."""

    def __init__(self, pid: int, every: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.max_rss = 0
        self.samples = 0
        self.stop = threading.Event()

    def read(self) -> dict[str, int]:
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for ln in f:
                if ln.startswith(("VmRSS:", "VmHWM:")):
                    out[ln.split(":")[0]] = int(ln.split()[1]) * 1024
        return out

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                rss = self.read()["VmRSS"]
            except (OSError, KeyError):
                return
            self.max_rss = max(self.max_rss, rss)
            self.samples += 1
            time.sleep(self.every)


def evict(data_dir: Path) -> None:
    """Drop the data directory's files from the page cache (written back first)."""
    os.sync()
    for path in data_dir.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def drive(port: int, pid: int, total: int, seed: int = 1, cold: Path | None = None) -> dict:
    """Put `total` bytes of jobs, then reserve and delete them all, checking bodies.

    `cold`: the data directory, evicted from the page cache before the drain.
    """
    sizes = job_sizes(total, seed)
    sampler = RssSampler(pid)
    base = sampler.read()
    sampler.start()
    digests: dict[int, bytes] = {}
    c = Conn(port)
    t0 = time.monotonic()
    for start in range(0, len(sizes), BATCH):
        chunk = [body(i, sizes[i], seed) for i in range(start, min(start + BATCH, len(sizes)))]
        c.send(b"".join(b"put 0 0 600 %d\r\n%s\r\n" % (len(b), b) for b in chunk))
        for b in chunk:
            reply = c.line()
            if not reply.startswith(b"INSERTED "):
                raise AssertionError(f"put answered {reply!r}")
            digests[int(reply.split()[1])] = hashlib.sha256(b).digest()
    t_put = time.monotonic() - t0
    after_puts = c.stats()
    rss_after_puts = sampler.read()["VmRSS"]
    if cold is not None:
        evict(cold)
    t1 = time.monotonic()
    got = 0
    bad = 0
    while got < len(digests):
        n = min(BATCH, len(digests) - got)
        c.send(b"reserve-with-timeout 0\r\n" * n)
        ids = []
        for _ in range(n):
            head = c.line()
            if not head.startswith(b"RESERVED "):
                raise AssertionError(f"reserve answered {head!r} after {got} jobs")
            _, jid, size = head.split()
            data = c.exact(int(size) + 2)[:-2]
            if hashlib.sha256(data).digest() != digests.get(int(jid)):
                bad += 1
            ids.append(int(jid))
        c.send(b"".join(b"delete %d\r\n" % j for j in ids))
        for _ in ids:
            reply = c.line()
            if reply != b"DELETED":
                raise AssertionError(f"delete answered {reply!r}")
        got += n
    t_drain = time.monotonic() - t1
    final = c.stats()
    c.close()
    sampler.stop.set()
    sampler.join()
    end = sampler.read()
    mib = total / (1 << 20)
    return {
        "total_bytes": total, "jobs": len(sizes), "bad_bodies": bad,
        "put_s": round(t_put, 2), "drain_s": round(t_drain, 2),
        "put_jobs_per_s": round(len(sizes) / t_put), "put_mib_per_s": round(mib / t_put, 1),
        "drain_jobs_per_s": round(len(sizes) / t_drain),
        "drain_mib_per_s": round(mib / t_drain, 1),
        "rss_start": base["VmRSS"], "rss_max_sampled": sampler.max_rss,
        "rss_after_puts": rss_after_puts, "vm_hwm": end["VmHWM"], "rss_end": end["VmRSS"],
        "rss_samples": sampler.samples,
        "bytes_in_memory_after_puts": int(after_puts.get("bytes-in-memory", 0)),
        "bytes_on_disk_after_puts": int(after_puts.get("bytes-on-disk", 0)),
        "body_reads": int(final.get("body-reads", 0)),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(data_dir: Path, log_path: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(log_path, "ab")  # noqa: SIM115
    start_at = log.tell()
    proc = subprocess.Popen(
        [sys.executable, "-m", "smallstalk", "serve", "-l", "127.0.0.1", "-p", str(port),
         "--data-dir", str(data_dir), "--fsync", "never", *flags],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(log_path, "rb") as f:
            f.seek(start_at)
            if b"listening on" in f.read():
                return proc, port
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{log_path.read_text()}")


def run(tmp: Path, total: int, max_memory: str | None, seed: int = 1,
        cold: bool = False) -> dict:
    data = tmp / "data"
    shutil.rmtree(data, ignore_errors=True)
    flags = ["--extended-stats", *(["--max-memory", max_memory] if max_memory else [])]
    proc, port = start(data, tmp / "server.log", *flags)
    try:
        out = drive(port, proc.pid, total, seed, data if cold else None)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out["max_memory"] = max_memory or "none"
    out["cold"] = cold
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", type=parse_size, default=parse_size("512MiB"))
    ap.add_argument("--max-memory", default="64MB")
    ap.add_argument("--compare", action="store_true", help="also run without a budget")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cold", action="store_true",
                    help="evict the data directory from the page cache before draining")
    ap.add_argument("--tmp", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="readbehind-", dir=args.tmp))
    try:
        results = [run(tmp, args.total, args.max_memory, args.seed, args.cold)]
        if args.compare:
            results.append(run(tmp, args.total, None, args.seed, args.cold))
        print(json.dumps(results if args.compare else results[0], indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
