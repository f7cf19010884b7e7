"""The early listener as a process: a client that connects at once is accepted, not refused.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from ..support.procs import free_port


def test_a_client_connecting_at_once_is_not_refused() -> None:
    """Like client test set-ups: start the binary, connect after 50 ms."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "smallstalk", "-p", str(port)],
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.05)
        deadline = time.monotonic() + 5  # generous: CI machines are shared
        while True:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "not listening 5 s after start"
                time.sleep(0.005)
        with s:
            s.sendall(b"list-tube-used\r\n")
            assert s.recv(100) == b"USING default\r\n"
    finally:
        proc.kill()
        proc.wait()
