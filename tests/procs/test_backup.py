"""`smallstalk backup` of a live data directory, under load and compaction.

A real server takes puts from a client thread the whole time, closes a
segment every 100 records and compacts as often as it can, so the backup
races the journal and the compactor. The copy must pass `aof verify`, and a
server started on it must hold every job acknowledged before the backup began.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tests.support.bsclient import connect, peek_ids
from tests.support.procs import smallstalk_cmd, start_smallstalk, wait_for

CHURN = ["--segment-records", "100", "--compact-interval", "0.05", "--compact-segments", "1"]


class Load:
    """Puts from one connection until stopped (bounded): the acknowledged ids, in order."""

    def __init__(self, port: int, limit: int = 200_000, seconds: float = 120):
        self.port, self.limit, self.seconds = port, limit, seconds
        self.acked: list[int] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds
        try:
            with connect(self.port, timeout=30) as c:
                while not self.stop.is_set() and len(self.acked) < self.limit \
                        and time.monotonic() < deadline:
                    reply = c.put(b"job %d" % len(self.acked))
                    assert reply.status == b"INSERTED", reply
                    self.acked.append(reply.id)
        except BaseException as e:  # noqa: BLE001 -- reported by finish()
            self.error = e

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        assert self.error is None, self.error


def run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(smallstalk_cmd() + list(args), capture_output=True, text=True,
                          timeout=300)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return proc


def check_restores(tmp: Path, dest: Path, servers, acked: list[int]) -> None:
    proc = run("aof", "verify", str(dest))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    server = start_smallstalk(tmp, data_dir=dest)
    servers.append(server)
    with connect(server.port, timeout=30) as c:
        found = peek_ids(c, acked)
    missing = sorted(set(acked) - set(found))
    assert not missing, f"{len(missing)} acknowledged jobs missing, first {missing[:5]}"
    assert all(found[j].startswith(b"job ") for j in acked)
    server.stop()


def linked_count(output: str) -> int:
    return int(re.search(r"(\d+) hard-linked", output)[1])


def test_backup_under_load(tmp_path: Path, servers) -> None:
    data = tmp_path / "data"
    server = start_smallstalk(tmp_path, *CHURN, data_dir=data)
    servers.append(server)
    load = Load(server.port)
    other_fs = Path(tempfile.mkdtemp(dir="/dev/shm")) if os.path.isdir("/dev/shm") else None
    try:
        wait_for(lambda: len(load.acked) >= 3000 or load.error is not None, 120, "3000 puts")
        wait_for(lambda: any((data / "snapshots").glob("*.snap")), 60, "a compaction")
        before = list(load.acked)  # every one of these was answered INSERTED
        same = run("backup", str(data), str(tmp_path / "copy"))
        assert same.returncode == 0, same.stderr
        assert linked_count(same.stdout) >= 1  # the snapshot at least: same file system
        wait_for(lambda: len(load.acked) >= len(before) + 2000 or load.error is not None, 120,
                 "2000 more puts")
        before_second = list(load.acked)
        if other_fs is not None:
            copied = run("backup", str(data), str(other_fs / "copy"))
            assert copied.returncode == 0, copied.stderr
            assert linked_count(copied.stdout) == 0  # another file system: copies
        forced = run("backup", "--copy", str(data), str(tmp_path / "copied"))
        assert forced.returncode == 0, forced.stderr
        assert linked_count(forced.stdout) == 0
        load.finish()
        assert len(load.acked) > len(before_second)  # the server served during the backups
        server.stop()
        check_restores(tmp_path, tmp_path / "copy", servers, before)
        check_restores(tmp_path, tmp_path / "copied", servers, before_second)
        if other_fs is not None:
            check_restores(tmp_path, other_fs / "copy", servers, before_second)
    finally:
        load.stop.set()
        if other_fs is not None:
            shutil.rmtree(other_fs)


def test_backup_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "something").write_text("x")
    (tmp_path / "data" / "aof").mkdir(parents=True)
    proc = run("backup", str(tmp_path / "data"), str(tmp_path / "dest"))
    assert proc.returncode == 1
    assert proc.stderr == f"smallstalk backup: {tmp_path / 'dest'}: exists and is not an " \
                          "empty directory\n"
    proc = run("backup", str(tmp_path / "nothing"), str(tmp_path / "new"))
    assert proc.returncode == 1
    assert "not a data directory" in proc.stderr
    assert not (tmp_path / "new").exists()
