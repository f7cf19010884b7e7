"""One data directory, one server: the lock on DATA_DIR/lock, with real processes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from smallstalk.storage import aof, datadir, logread

from ..support.bsclient import connect, put_cmd
from ..support.procs import REPO, Server, free_port, smallstalk_cmd, start_smallstalk


def second_server(data: Path, *args: str) -> subprocess.CompletedProcess:
    """A server started on a directory another one holds: it must exit on its own."""
    return subprocess.run(
        smallstalk_cmd() + ["serve", "-l", "127.0.0.1", "-p", str(free_port()),
                            "--data-dir", str(data), *args],
        capture_output=True, text=True, cwd=REPO, timeout=60)


def assert_refused(done: subprocess.CompletedProcess, data: Path, holder: Server) -> None:
    out = (done.stdout + done.stderr).strip()
    assert done.returncode == datadir.EXIT_LOCKED, out
    assert "Traceback" not in out, out
    assert len(out.splitlines()) == 1, out
    assert str(data) in out and f"process {holder.pid}" in out, out


def put_ids(port: int, bodies: list[bytes]) -> list[int]:
    c = connect(port)
    try:
        replies = c.pipeline([put_cmd(b) for b in bodies])
        assert all(r.status == b"INSERTED" for r in replies), replies
        return [r.id for r in replies]
    finally:
        c.close()


def test_a_second_server_is_refused_and_the_first_keeps_serving(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = start_smallstalk(tmp_path, data_dir=data)
    try:
        before = put_ids(first.port, [b"a", b"b", b"c"])
        segments = datadir.list_segments(data / "aof")

        assert_refused(second_server(data), data, first)

        # Nothing of the second server's reached the directory, and the first serves on.
        assert datadir.list_segments(data / "aof") == segments
        after = put_ids(first.port, [b"d", b"e"])
        assert after == [before[-1] + 1, before[-1] + 2]
        c = connect(first.port)
        try:
            assert c.call(b"peek %d\r\n" % after[-1]).body == b"e"
        finally:
            c.close()
    finally:
        first.stop()
    # Every acknowledged job is there after a restart: nothing was lost to a second writer.
    again = start_smallstalk(tmp_path, data_dir=data)
    try:
        c = connect(again.port)
        try:
            for jid, body in zip([*before, *after], [b"a", b"b", b"c", b"d", b"e"], strict=True):
                assert c.call(b"peek %d\r\n" % jid).body == body
        finally:
            c.close()
    finally:
        again.stop()


def test_the_lock_goes_with_a_killed_server(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = start_smallstalk(tmp_path, data_dir=data)
    put_ids(first.port, [b"x"])
    first.kill()  # SIGKILL: the kernel lets go of the flock; the stale pid stays in the file
    assert datadir.holder(data) == first.pid
    second = start_smallstalk(tmp_path, data_dir=data)
    try:
        assert datadir.holder(data) == second.pid
        c = connect(second.port)
        try:
            assert c.call(b"peek 1\r\n").body == b"x"
        finally:
            c.close()
    finally:
        second.stop()


def test_a_replica_holds_its_directory(tmp_path: Path) -> None:
    primary = start_smallstalk(tmp_path, data_dir=tmp_path / "p")
    replica = None
    try:
        replica = start_smallstalk(tmp_path, "--replica-of", f"127.0.0.1:{primary.port}",
                                   data_dir=tmp_path / "r")
        assert_refused(second_server(tmp_path / "r"), tmp_path / "r", replica)
        assert_refused(second_server(tmp_path / "p"), tmp_path / "p", primary)
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()


def tool(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(smallstalk_cmd() + [str(a) for a in args], capture_output=True,
                          text=True, cwd=REPO, timeout=120)


def test_read_only_tools_work_beside_a_server_and_writers_wait(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = start_smallstalk(tmp_path, data_dir=data)
    other = start_smallstalk(tmp_path, data_dir=tmp_path / "other")
    try:
        put_ids(server.port, [b"one", b"two"])
        last = max(seq for path in [p for _f, p in aof.list_segments(data / "aof")]
                   for seq in [e[1].seq for e in logread.iter_segment(path)
                               if not isinstance(e, aof.FrameScan)])
        for args in (["aof", "ls", data], ["aof", "dump", data], ["aof", "verify", data],
                     ["job-history", data, "1"], ["replay", data, "--until-seq", last]):
            done = tool(*args)
            assert done.returncode == 0, (args, done.stdout, done.stderr)
            assert "Traceback" not in done.stderr
        # Writing a snapshot into a directory a server holds is refused; elsewhere it works.
        snaps = tmp_path / "other" / "snapshots"
        snaps.mkdir(parents=True, exist_ok=True)
        done = tool("replay", data, "--until-seq", last, "--write-snapshot", snaps)
        assert done.returncode == 1, done.stderr
        assert f"process {other.pid}" in done.stderr and "Traceback" not in done.stderr
        assert not list(snaps.glob("*.snap"))
        free = tmp_path / "copy" / "snapshots"
        free.mkdir(parents=True)
        done = tool("replay", data, "--until-seq", last, "--write-snapshot", free)
        assert done.returncode == 0, done.stderr
        assert [p.name for p in free.glob("*.snap")] == [aof.snapshot_name(last)]
    finally:
        other.stop()
        server.stop()
