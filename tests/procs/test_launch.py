"""The early listener as a process: a client that connects while the server is still
recovering is accepted at once, and answered once recovery is done.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from smallstalk.storage import aof
from smallstalk.storage.encoder import LiveEncoder

from ..support.procs import free_port, wait_listening

JOBS = 400_000  # recovery takes ~3 s here: long enough to connect in the middle of it
PER_SEGMENT = 50_000
BODY = b"0123456789"


def big_data_dir(data: Path) -> None:
    """JOBS ready jobs, written as the server writes them (no server needed)."""
    (data / "aof").mkdir(parents=True)
    enc = LiveEncoder()
    for first in range(1, JOBS + 1, PER_SEGMENT):
        w = aof.SegmentWriter(data / "aof", first)
        for seq in range(first, min(first + PER_SEGMENT, JOBS + 1)):
            w.append(enc.put(seq, 1_700_000_000 * 10**9, 1, seq, "default", 100, 0, 60, BODY),
                     seq)
        w.write()
        w.sync()
        w.close()


@pytest.mark.timeout(180)
def test_a_client_connecting_during_recovery_is_accepted(tmp_path: Path) -> None:
    """Like client test set-ups that connect right after starting the binary:
    the socket listens before recovery ends, one connect succeeds, and the
    reply to its first command comes after recovery, with the recovered jobs."""
    data = tmp_path / "data"
    big_data_dir(data)
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "smallstalk", "-l", "127.0.0.1",
                                 "-p", str(port), "--data-dir", str(data)], stderr=log)
    try:
        wait_listening(port, proc, timeout=60)
        assert b"recovered" not in log_path.read_bytes(), "listening only after recovery"
        with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
            s.sendall(b"peek %d\r\n" % JOBS)
            want = b"FOUND %d %d\r\n%s\r\n" % (JOBS, len(BODY), BODY)
            reply = b""
            while len(reply) < len(want) and (chunk := s.recv(4096)):
                reply += chunk
        assert reply == want
        assert b"recovered %d jobs" % JOBS in log_path.read_bytes()
        # A stop with all those jobs held: launch.py ends the process without
        # the interpreter's teardown, after the server has closed its files and
        # flushed its log; the exit status and the last line are still there.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        lines = log_path.read_text().splitlines()
        assert lines[-1].endswith("shutting down"), lines[-3:]
        assert "Traceback" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # ...and the next start finds every job, the data directory unlocked.
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "smallstalk", "-l", "127.0.0.1",
                                 "-p", str(port), "--data-dir", str(data)], stderr=log)
    try:
        wait_listening(port, proc, timeout=60)
        with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
            s.sendall(b"peek %d\r\n" % JOBS)
            reply = b""
            while len(reply) < len(want) and (chunk := s.recv(4096)):
                reply += chunk
        assert reply == want
    finally:
        proc.kill()
        proc.wait()
