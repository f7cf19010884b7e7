"""Disk errors on a real server: a change the AOF cannot take is refused, and nothing acknowledged is lost."""

from __future__ import annotations

import contextlib
import resource
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from smallstalk.server.commit import RETRY_AFTER_FAILURE
from smallstalk.storage import aof, logread

from ..support.bsclient import Client, Reply, connect, peek_ids, stats_jobs
from ..support.powercut import PowerCutMount, mounted
from ..support.procs import Server, start_smallstalk, wait_for

FSIZE = resource.RLIMIT_FSIZE
INF = resource.RLIM_INFINITY
BODY = 200  # bytes per job body in the "fill the file" phases
RECOVER_WITHIN = 5.0  # seconds a healed server may take to accept writes again


# --- bookkeeping: what the client was told -------------------------------------


@attrs.define
class Ledger:
    """Every reply a client got, as the durability contract sees it."""

    live: dict[int, bytes] = attrs.Factory(dict)  # INSERTED and not DELETED
    pri: dict[int, int] = attrs.Factory(dict)  # acknowledged priority per live job
    deleted: set[int] = attrs.Factory(set)  # DELETED was received
    refused: dict[bytes, bytes] = attrs.Factory(dict)  # put body -> the non-INSERTED reply
    max_id: int = 0
    counter: int = 0

    def body(self, tag: str, size: int = BODY) -> bytes:
        self.counter += 1
        head = b"%s-%06d-" % (tag.encode(), self.counter)
        return head + b"x" * max(size - len(head), 0)

    def put(self, c: Client, tag: str = "job", pri: int = 100, size: int = BODY) -> Reply:
        body = self.body(tag, size)
        r = c.put(body, pri=pri)
        if r.status == b"INSERTED":
            assert r.id > self.max_id, f"id {r.id} not above every id seen ({self.max_id})"
            self.max_id = r.id
            self.live[r.id] = body
            self.pri[r.id] = pri
        else:
            self.refused[body] = r.line
        return r

    def delete(self, c: Client, jid: int) -> Reply:
        r = c.call(b"delete %d\r\n" % jid)
        if r.status == b"DELETED":
            self.live.pop(jid)
            self.pri.pop(jid)
            self.deleted.add(jid)
        return r

    def reserve_release(self, c: Client, pri: int) -> int:
        r = c.call(b"reserve-with-timeout 0\r\n")
        assert r.status == b"RESERVED", r
        rel = c.call(b"release %d %d 0\r\n" % (r.id, pri))
        assert rel.status == b"RELEASED", rel
        self.pri[r.id] = pri
        return r.id


def seed(c: Client, led: Ledger, n: int = 12) -> None:
    """Some acknowledged history before the disk goes bad: puts, a delete, a release."""
    for i in range(n):
        assert led.put(c, "seed", pri=1000 + i).status == b"INSERTED"
    assert led.delete(c, min(led.live)).status == b"DELETED"
    led.reserve_release(c, pri=7)


def check_reads(c: Client, led: Ledger) -> None:
    """Reads are served from memory while writes fail, and show the acknowledged state."""
    stats = c.stats()
    assert int(stats["current-jobs-ready"]) >= len(led.live)
    assert peek_ids(c, sorted(led.live)) == led.live
    assert c.call(b"list-tubes\r\n").status == b"OK"


def verify_restart(tmp_path: Path, data: Path, led: Ledger) -> Server:
    """Restart on the same directory (no limits) and hold it to the ledger."""
    srv = start_smallstalk(tmp_path, "--compact-interval", "3600", data_dir=data)
    with connect(srv.port) as c:
        horizon = led.max_id + len(led.refused) + 50
        found = peek_ids(c, list(range(1, horizon)))
        missing = {j: b for j, b in led.live.items() if found.get(j) != b}
        assert not missing, f"acknowledged jobs lost or changed: {sorted(missing)}"
        back = led.deleted & set(found)
        assert not back, f"acknowledged deletes came back: {sorted(back)}"
        ghosts = {j: found[j][:20] for j in set(found) - set(led.live)}
        assert not ghosts, (
            f"jobs the client was not told were inserted are present: {ghosts}; "
            f"replies were {sorted(set(led.refused.values()))}")
        pris = {j: int(s["pri"]) for j, s in stats_jobs(c, sorted(led.live)).items()}
        assert pris == led.pri
        probe = c.put(b"probe")
        assert probe.status == b"INSERTED" and probe.id > led.max_id, probe
    assert "torn write" not in srv.log(), "a failed write left a partial frame behind"
    return srv


def newest_segment(data: Path) -> Path:
    return aof.list_segments(data / "aof")[-1][1]


def records_end(path: Path) -> int:
    """Where a segment's records end (the file is allocated further ahead)."""
    return [e for e in logread.iter_segment(path) if isinstance(e, aof.FrameScan)][-1].end


def assert_segment_clean(path: Path) -> None:
    """No partial frame at the end: a failed write was cut back."""
    scans = [e for e in logread.iter_segment(path) if isinstance(e, aof.FrameScan)]
    assert scans and scans[-1].clean, f"{path}: {scans[-1].why} at {scans[-1].end}"


def poll_put(c: Client, led: Ledger, within: float = RECOVER_WITHIN) -> Reply:
    """Put until one is INSERTED or the deadline passes; every attempt is in the ledger."""
    deadline = time.monotonic() + within
    while True:
        r = led.put(c, "heal")
        if r.status == b"INSERTED" or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def refuses_for(c: Client, led: Ledger, seconds: float) -> list[bytes]:
    """Keep putting for `seconds` while the disk is still bad; every put must be refused."""
    replies = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        r = led.put(c, "still-bad")
        assert r.status != b"INSERTED", "a put was acknowledged although it cannot be on disk"
        replies.append(r.line)
        time.sleep(0.1)
    return replies


# --- ways to make a root process's writes fail ----------------------------------


def set_fsize(pid: int, soft: int) -> None:
    """RLIMIT_FSIZE on a running process: writes past `soft` bytes fail with EFBIG.

    Python ignores SIGXFSZ, so the server gets EFBIG rather than dying. Only the
    soft limit moves (raising the hard one needs CAP_SYS_RESOURCE).
    """
    resource.prlimit(pid, FSIZE, (soft, INF))


def chattr(flag: str, *paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True, timeout=30)


@contextlib.contextmanager
def immutable(*paths: Path) -> Iterator[None]:
    """chattr +i: even root gets EPERM creating, unlinking or writing (ext4 checks writes too)."""
    r = chattr("+i", *paths)
    assert r.returncode == 0, r.stderr
    try:
        yield
    finally:
        chattr("-i", *paths)


@pytest.fixture
def can_chattr(tmp_path: Path) -> None:
    probe = tmp_path / "chattr-probe"
    probe.write_bytes(b"")
    try:
        r = chattr("+i", probe)
    except FileNotFoundError:
        pytest.skip("chattr is not installed")
    if r.returncode != 0:
        pytest.skip(f"chattr +i does not work here: {r.stderr.decode().strip()}")
    chattr("-i", probe)
    try:
        with open(probe, "ab") as f:
            f.write(b"x")
    except OSError:
        pytest.skip("chattr -i did not take")


# --- the tests ------------------------------------------------------------------


@pytest.mark.parametrize("fsync", ["always", "everysec", "never"])
def test_file_size_limit_refuses_put_and_keeps_acknowledged(
    tmp_path: Path, fsync: str, servers: list[Server]
) -> None:
    """The segment hits RLIMIT_FSIZE (EFBIG, as a full disk would give ENOSPC)."""
    data = tmp_path / "data"
    srv = start_smallstalk(tmp_path, "--fsync", fsync, "--compact-interval", "3600", data_dir=data)
    servers.append(srv)
    if resource.prlimit(srv.pid, FSIZE)[1] != INF:
        pytest.skip("the server's hard RLIMIT_FSIZE is not unlimited")
    led = Ledger()
    with connect(srv.port) as c:
        seed(c, led)
        seg = newest_segment(data)
        # Past its records: the space allocated ahead is there, but not writable.
        limit = records_end(seg) + 4096
        set_fsize(srv.pid, limit)
        before = len(led.live)
        failed = None
        for _ in range(200):  # ~15 puts fit in 4 KiB; the bound only stops a broken limit
            r = led.put(c, "fill")
            if r.status != b"INSERTED":
                failed = r
                break
        assert failed is not None, "no put failed although the segment cannot grow"
        assert len(led.live) - before >= 5, "puts that fitted under the limit were refused"
        assert failed.line == b"INTERNAL_ERROR", failed
        assert records_end(seg) <= limit
        assert_segment_clean(seg)
        # Still full: past the retry window every put is still refused, reads still work.
        replies = refuses_for(c, led, RETRY_AFTER_FAILURE + 0.5)
        assert set(replies) == {b"INTERNAL_ERROR"}, replies
        check_reads(c, led)
        assert srv.proc.poll() is None, "the server died on EFBIG"
        assert_segment_clean(seg)
        # Space comes back: the same server takes writes again, without a restart.
        set_fsize(srv.pid, INF)
        r = poll_put(c, led)
        assert r.status == b"INSERTED", f"the server did not recover after the limit was lifted: {r}"
        for _ in range(3):
            assert led.put(c, "after").status == b"INSERTED"
        led.reserve_release(c, pri=3)
    srv.kill()
    servers.append(verify_restart(tmp_path, data, led))


@pytest.mark.parametrize("fsync", ["always", "never"])
def test_unwritable_segment_refuses_changes_and_keeps_acknowledged(
    tmp_path: Path, fsync: str, servers: list[Server], can_chattr: None
) -> None:
    """The open segment becomes immutable: every write to it fails with EPERM."""
    data = tmp_path / "data"
    srv = start_smallstalk(tmp_path, "--fsync", fsync, "--compact-interval", "3600", data_dir=data)
    servers.append(srv)
    led = Ledger()
    with connect(srv.port) as c:
        seed(c, led)
        seg = newest_segment(data)
        size = seg.stat().st_size
        victim = max(led.live)
        with immutable(seg):
            r = led.put(c, "refused")
            assert r.line == b"INTERNAL_ERROR", r
            d = c.call(b"delete %d\r\n" % victim)
            assert d.status != b"DELETED", "a delete was acknowledged although it cannot be on disk"
            refuses_for(c, led, RETRY_AFTER_FAILURE + 0.5)
            check_reads(c, led)
            assert srv.proc.poll() is None
            assert seg.stat().st_size == size, "a failed write changed the segment"
        r = poll_put(c, led)
        assert r.status == b"INSERTED", f"the server did not recover after the file was writable: {r}"
        assert led.delete(c, victim).status == b"DELETED"
        led.reserve_release(c, pri=5)
    srv.kill()
    servers.append(verify_restart(tmp_path, data, led))


def fill_to_rotation(c: Client, led: Ledger, data: Path, per_segment: int) -> int:
    """Put until the open segment is one record short of rotating; return its record count."""
    seg = newest_segment(data)
    for _ in range(per_segment):
        n = sum(1 for e in logread.iter_segment(seg) if not isinstance(e, aof.FrameScan))
        if n == per_segment - 1:
            return n
        assert led.put(c, "fill").status == b"INSERTED"
        assert newest_segment(data) == seg, "rotated too early"
    raise AssertionError("the segment never got one record short of rotating")


def test_failed_rotation_does_not_answer_error_for_a_durable_put(
    tmp_path: Path, servers: list[Server], can_chattr: None
) -> None:
    """The put that fills a segment cannot rotate (directory immutable): its reply must match the disk."""
    data = tmp_path / "data"
    per = 20
    srv = start_smallstalk(tmp_path, "--segment-records", str(per), "--compact-interval", "3600",
                           data_dir=data)
    servers.append(srv)
    led = Ledger()
    with connect(srv.port) as c:
        fill_to_rotation(c, led, data, per)
        with immutable(data / "aof"):
            r = led.put(c, "rotating")
            assert srv.proc.poll() is None
    srv.kill()
    # Whatever the reply was, the restarted server must agree with it.
    servers.append(verify_restart(tmp_path, data, led))
    assert r.status == b"INSERTED" or r.line == b"INTERNAL_ERROR", r


def test_server_writes_again_after_failed_rotation(
    tmp_path: Path, servers: list[Server], can_chattr: None
) -> None:
    """After a rotation failed (no new segment could be created) and the directory is writable again,
    puts succeed again, no client receives stray bytes, and everything acknowledged survives."""
    data = tmp_path / "data"
    per = 20
    srv = start_smallstalk(tmp_path, "--segment-records", str(per), "--compact-interval", "3600",
                           data_dir=data)
    servers.append(srv)
    led = Ledger()
    with connect(srv.port) as c:
        fill_to_rotation(c, led, data, per)
        with immutable(data / "aof"):
            # The open segment itself is still writable: either answer is fair, as long
            # as the restart agrees with it (the ledger checks that).
            deadline = time.monotonic() + RETRY_AFTER_FAILURE + 0.2
            while time.monotonic() < deadline:
                r = led.put(c, "rotating")
                assert r.status in (b"INSERTED", b"INTERNAL_ERROR"), r
                time.sleep(0.1)
            check_reads(c, led)
        # New connections take the lowest free descriptors: none may receive AOF bytes.
        others = [connect(srv.port, timeout=5.0) for _ in range(3)]
        try:
            deadline = time.monotonic() + RECOVER_WITHIN
            healed = None
            while healed is None and time.monotonic() < deadline:
                for o in others:
                    r = led.put(o, "fresh-conn")
                    assert r.status in (b"INSERTED", b"INTERNAL_ERROR"), (
                        f"garbage reply on a new connection: {r.line[:60]!r}")
                    if r.status == b"INSERTED":
                        healed = r
                time.sleep(0.1)
            assert healed is not None, "the server never wrote again after the failed rotation"
            assert led.put(c, "old-conn").status == b"INSERTED"
        finally:
            for o in others:
                o.close()
    srv.kill()
    servers.append(verify_restart(tmp_path, data, led))


def test_compactor_failures_do_not_stop_the_server(
    tmp_path: Path, servers: list[Server], can_chattr: None
) -> None:
    """The snapshot cannot be written, then the folded segments cannot be deleted: the server serves on."""
    data = tmp_path / "data"
    (data / "snapshots").mkdir(parents=True)
    srv = start_smallstalk(tmp_path, "--segment-records", "10", "--compact-interval", "0.2",
                           data_dir=data)
    servers.append(srv)
    led = Ledger()
    with connect(srv.port) as c:
        with immutable(data / "snapshots"):
            for _ in range(25):
                assert led.put(c, "pre").status == b"INSERTED"
            wait_for(lambda: "compaction failed" in srv.log(), 10.0, "a failed compaction")
            assert srv.proc.poll() is None
            assert len(aof.list_segments(data / "aof")) >= 3
        # The fold can now succeed, but deleting the folded segments cannot.
        with immutable(data / "aof"):
            wait_for(lambda: aof.list_snapshots(data / "snapshots")
                     or srv.proc.poll() is not None, 10.0, "a snapshot")
            # The server deletes the folded segments right after its compactor child
            # exits: it must still be serving a while later.
            stay_up(srv, c, 1.0)
            r = led.put(c, "during")
            assert r.status == b"INSERTED", r
            check_reads(c, led)
        for _ in range(15):  # rotations and compaction work again
            assert led.put(c, "post").status == b"INSERTED"
        wait_for(lambda: len(aof.list_segments(data / "aof")) <= 2, 10.0, "compaction to catch up")
    srv.kill()
    servers.append(verify_restart(tmp_path, data, led))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[PowerCutMount]:
    yield from mounted(tmp_path)


def test_compactor_survives_a_disk_that_answers_eio(
    tmp_path: Path, disk: PowerCutMount, servers: list[Server]
) -> None:
    """Every file request fails with EIO right after a compaction's snapshot is renamed: the
    compactor logs each failed attempt (file and errno) and retries; the server serves reads and
    refuses writes, and acknowledges nothing it could not write."""
    data = disk.path / "data"
    disk.arm("snapshots")  # the power goes right after the new snapshot is durable
    srv = start_smallstalk(tmp_path, "--segment-records", "10", "--compact-interval", "0.2",
                           data_dir=data)
    servers.append(srv)
    led = Ledger()
    with connect(srv.port) as c:
        deadline = time.monotonic() + 30
        while not disk.fired():
            assert time.monotonic() < deadline, "no compaction wrote a snapshot in 30s"
            r = led.put(c, "pre")
            if r.status != b"INSERTED":
                break
        wait_for(disk.fired, 10.0, "the armed cut")
        # Several compactor intervals (and the commit retry window) with the disk gone.
        stay_up(srv, c, 2.0)
        refused = refuses_for(c, led, RETRY_AFTER_FAILURE + 0.5)
        assert set(refused) == {b"INTERNAL_ERROR"}, refused
        check_reads(c, led)
        stay_up(srv, c, 1.0)
    failures = [line for line in srv.log().splitlines() if "compaction" in line and "Errno 5" in line]
    assert len(failures) >= 2, f"no retried, logged compaction failure:\n{srv.log()[-2000:]}"
    assert "compactor.py" not in srv.log(), "a compaction failure logged a traceback"


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 16 MiB tmpfs: it fills up and gives ENOSPC like a full disk."""
    where = tmp_path / "small"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)],
                       capture_output=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(path: Path) -> None:
    """Write `path` until the file system is full."""
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError as e:
            assert e.errno == 28, e
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 512)


def test_compactor_on_a_full_disk_retries_and_catches_up(
    tmp_path: Path, small_tmpfs: Path, servers: list[Server]
) -> None:
    """The file system fills up: puts are refused, compactions fail (logged, one line, with
    errno) and are retried; once space is back, both work again and nothing acknowledged is lost."""
    data = small_tmpfs / "data"
    srv = start_smallstalk(tmp_path, "--segment-records", "10", "--compact-interval", "2",
                           "--compact-segments", "1000", data_dir=data)
    servers.append(srv)
    led = Ledger()
    filler = small_tmpfs / "filler"

    def compactions() -> int:
        return srv.log().count("compacted")

    def failures() -> list[str]:
        return [line for line in srv.log().splitlines()
                if "compaction failed" in line and "Errno 28" in line]

    with connect(srv.port) as c:
        seed(c, led)
        wait_for(lambda: compactions() == 1, 10.0, "a first compaction")
        # Right after it (the next is 2 s away): closed segments for the next one, then no space.
        for _ in range(20):
            assert led.put(c, "pre").status == b"INSERTED"
        fill(filler)
        assert compactions() == 1, "the next compaction came too early for this test"
        wait_for(lambda: len(failures()) >= 2, 10.0, "two failed (retried) compactions")
        stay_up(srv, c, 1.0)
        # A failed compaction frees its temporary file, and the open segment's space
        # allocated ahead (1 MiB) takes records until it runs out: some puts fit, big
        # bodies use it up. The ledger holds the server to each reply.
        fill(filler)
        replies = set()
        deadline = time.monotonic() + RETRY_AFTER_FAILURE + 0.5
        while time.monotonic() < deadline:  # ~30 puts of 60 KB: past 1 MiB
            replies.add(led.put(c, "full", size=60_000).line.split()[0])
            time.sleep(0.05)
        assert replies <= {b"INSERTED", b"INTERNAL_ERROR"} and b"INTERNAL_ERROR" in replies, replies
        check_reads(c, led)
        assert "compactor.py" not in srv.log(), "a compaction failure logged a traceback"
        filler.unlink()
        r = poll_put(c, led)
        assert r.status == b"INSERTED", f"the server did not recover once space was back: {r}"
        for _ in range(15):
            assert led.put(c, "post").status == b"INSERTED"
        wait_for(lambda: len(aof.list_segments(data / "aof")) <= 2, 10.0, "compaction to catch up")
    srv.kill()
    servers.append(verify_restart(tmp_path, data, led))


def stay_up(srv: Server, c: Client, seconds: float) -> None:
    """Assert the server keeps answering (read-only commands) for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            c.stats()
        except (ConnectionError, TimeoutError):
            srv.proc.wait(timeout=10)
            raise AssertionError(
                f"the server exited with {srv.proc.returncode}:\n{srv.log()[-1500:]}") from None
        time.sleep(0.05)
