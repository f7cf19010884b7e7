"""What `smallstalk serve` imports until it has answered its first command: only what
serving needs (start-up time, docs/PERFORMANCE-ROUNDS.md "Start-up"). The operator tools,
the console, the clients, replication's follower and HA, the memcache port, TLS
files, schedules' datetime and argparse are imported on use, and stay so.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ..support.procs import REPO, free_port, wait_listening

# Never imported by a plain server (module names, or packages ending in ".").
NEVER = ("smallstalk.ops.", "smallstalk.console.", "smallstalk.client.", "smallstalk.worker.",
         "smallstalk.analytics.", "smallstalk.replication.follower",
         "smallstalk.replication.ha", "smallstalk.replication.etcd",
         "smallstalk.replication.cluster", "smallstalk.replication.hactl",
         "smallstalk.server.memcache", "smallstalk.server.memcache_dispatch",
         "smallstalk.core.memcache", "smallstalk.storage.history", "argparse", "tomllib", "datetime", "zoneinfo",
         "cronsim", "encodings.idna", "hypercorn.", "httpx.")
# ... and without a data directory, nothing that reads one back.
NEVER_IN_MEMORY = ("smallstalk.storage.recovery", "smallstalk.storage.compactor",
                   "smallstalk.storage.snapshot",
                   "smallstalk.storage.snapshot_codec", "smallstalk.storage.logread")


def imported_until_first_reply(tmp_path: Path, *args: str) -> set[str]:
    """Every module the server imported (`-X importtime`) from its start until its
    reply to `stats` (and its exit on SIGTERM right after)."""
    port = free_port()
    err = tmp_path / "importtime.txt"
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "smallstalk",
                                 "serve", "-l", "127.0.0.1", "-p", str(port), *args],
                                stderr=f, stdout=subprocess.DEVNULL, cwd=REPO)
    try:
        wait_listening(port, proc, timeout=60)
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"stats\r\n")
            assert s.recv(4096).startswith(b"OK ")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    names = importtime_names(err.read_text())
    assert "smallstalk.server.loop" in names, "no -X importtime output"
    return names


def importtime_names(stderr: str) -> set[str]:
    return {line.rpartition("|")[2].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and "self [us]" not in line}


def forbidden(names: set[str], never: tuple[str, ...]) -> list[str]:
    """The names in `never` the server imported, less what its libraries (trio,
    attrs, cbor2) import by themselves: another version of one may need them,
    and that is not the server's doing."""
    libs = importtime_names(subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import trio, attrs, cbor2"],
        capture_output=True, text=True, check=True, timeout=60).stderr)
    return sorted(n for n in names - libs
                  if any(n.startswith(x) if x.endswith(".") else n == x for x in never))


@pytest.mark.timeout(120)
def test_a_server_in_memory_imports_only_what_serving_needs(tmp_path: Path) -> None:
    names = imported_until_first_reply(tmp_path)
    assert forbidden(names, NEVER + NEVER_IN_MEMORY) == []


@pytest.mark.timeout(120)
def test_a_server_with_a_data_dir_imports_only_what_serving_needs(tmp_path: Path) -> None:
    names = imported_until_first_reply(tmp_path, "--data-dir", str(tmp_path / "data"))
    assert "smallstalk.storage.recovery" in names
    assert forbidden(names, NEVER) == []
