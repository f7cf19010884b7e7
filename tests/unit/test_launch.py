"""The early listener: launch.py's quick flag scan agrees with the full parser."""

from __future__ import annotations

import pytest

from smallstalk.config import ServeConfig, parse_serve
from smallstalk.launch import listen_address

CASES = [
    [], ["-p", "11400"], ["-p11400"], ["-l", "0.0.0.0", "-p", "1"], ["-l0.0.0.0"],
    ["-VVp", "5"], ["-Fp", "5"], ["-b", "/tmp/x", "-p", "7"], ["--listen", "::1", "--port=9"],
    ["--data-dir", "d", "--fsync", "never", "-p", "3"], ["-l", "unix:/tmp/s.sock"],
    ["-z", "10", "-s", "4096", "-f", "0", "-u", "nobody", "-p", "8"], ["--no-compact", "-p", "2"],
    ["--tls-port", "5", "--tls-cert", "c.pem", "--tls-key", "k.pem", "-p", "6"],
    ["--extended-stats", "-p", "4"],
]


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(c) or "none" for c in CASES])
def test_quick_scan_agrees_with_the_parser(argv: list[str]) -> None:
    cfg = parse_serve(argv)
    assert isinstance(cfg, ServeConfig)
    assert listen_address(argv) == (cfg.addr, cfg.port)


@pytest.mark.parametrize("argv", [["-h"], ["-v"], ["--help"], ["-p"], ["-p", "x"], ["bogus"],
                                  ["--no-plaintext", "-p", "7"]])
def test_quick_scan_leaves_the_rest_to_the_parser(argv: list[str]) -> None:
    assert listen_address(argv) is None
