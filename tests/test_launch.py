"""The early listener: launch.py's quick flag scan agrees with the full parser, and it is fast."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from smallstalk.config import ServeConfig, parse_serve
from smallstalk.launch import listen_address

from .procs import free_port

CASES = [
    [], ["-p", "11400"], ["-p11400"], ["-l", "0.0.0.0", "-p", "1"], ["-l0.0.0.0"],
    ["-VVp", "5"], ["-Fp", "5"], ["-b", "/tmp/x", "-p", "7"], ["--listen", "::1", "--port=9"],
    ["--data-dir", "d", "--fsync", "never", "-p", "3"], ["-l", "unix:/tmp/s.sock"],
    ["-z", "10", "-s", "4096", "-f", "0", "-u", "nobody", "-p", "8"], ["--no-compact", "-p", "2"],
]


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(c) or "none" for c in CASES])
def test_quick_scan_agrees_with_the_parser(argv: list[str]) -> None:
    cfg = parse_serve(argv)
    assert isinstance(cfg, ServeConfig)
    assert listen_address(argv) == (cfg.addr, cfg.port)


@pytest.mark.parametrize("argv", [["-h"], ["-v"], ["--help"], ["-p"], ["-p", "x"], ["bogus"]])
def test_quick_scan_leaves_the_rest_to_the_parser(argv: list[str]) -> None:
    assert listen_address(argv) is None


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
