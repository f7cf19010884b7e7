"""Damaged data directories (torn tails, bit flips) made from real server runs: repaired or refused, never misread."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from smallstalk.core import records
from smallstalk.core.model import STATE_NAMES
from smallstalk.core.state import State
from smallstalk.storage import aof, logread, recovery, snapshot, snapshot_codec
from smallstalk.storage.aof import CorruptionError

from ..support.bsclient import Client, connect, peek_ids, put_cmd, stats_jobs
from ..support.procs import REPO, Server, free_port, smallstalk_cmd, start_smallstalk

SERVER_RUNS = 3  # runs after the compacting one: each leaves one more segment


# --- building a real data directory ---------------------------------------------


def workload(c: Client, tag: str, n: int) -> None:
    """A fixed mix of changes: puts (some delayed), release with a new priority, bury, kick, delete."""
    tube = f"tube-{tag}"
    assert c.call(b"use %s\r\n" % tube.encode()).status == b"USING"
    assert c.call(b"watch %s\r\n" % tube.encode()).status == b"WATCHING"
    cmds = [put_cmd(b"%s-%03d" % (tag.encode(), i), pri=i * 7, delay=3600 if i % 5 == 0 else 0,
                    ttr=120) for i in range(n)]
    assert all(r.status == b"INSERTED" for r in c.pipeline(cmds))

    def reserve() -> int:
        r = c.call(b"reserve-with-timeout 0\r\n")
        assert r.status == b"RESERVED", r
        return r.id

    assert c.call(b"release %d 4242 0\r\n" % reserve()).status == b"RELEASED"
    assert c.call(b"bury %d 17\r\n" % reserve()).status == b"BURIED"
    assert c.call(b"delete %d\r\n" % reserve()).status == b"DELETED"
    assert c.call(b"kick 1\r\n").status == b"KICKED"
    assert c.call(b"bury %d 99\r\n" % reserve()).status == b"BURIED"
    reserve()  # stays reserved until the crash
    ready = c.call(b"peek-ready\r\n")
    assert c.call(b"delete %d\r\n" % ready.id).status == b"DELETED"


def wait_until(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def build_data_dir(tmp: Path) -> Path:
    """A snapshot plus several segments, all written by real server processes."""
    data = tmp / "data"
    srv = start_smallstalk(tmp, "--segment-records", "20", "--compact-interval", "0.2", data_dir=data)
    try:
        with connect(srv.port) as c:
            workload(c, "c0", 40)
            wait_until(lambda: aof.list_snapshots(data / "snapshots")
                       and len(aof.list_segments(data / "aof")) == 1, 20.0, "compaction")
            if newest(data).stat().st_size == aof.HEADER_SIZE:
                assert c.put(b"filler").status == b"INSERTED"
            srv.kill()
    finally:
        srv.kill()
    for run in range(1, SERVER_RUNS + 1):
        srv = start_smallstalk(tmp, "--compact-interval", "3600", data_dir=data)
        try:
            with connect(srv.port) as c:
                workload(c, f"r{run}", 30)
                srv.kill()
        finally:
            srv.kill()
    segs = aof.list_segments(data / "aof")
    assert len(segs) == SERVER_RUNS + 1 and aof.list_snapshots(data / "snapshots"), segs
    return data


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_data_dir(tmp_path_factory.mktemp("golden"))


@pytest.fixture
def data(golden: Path, tmp_path: Path) -> Path:
    """A private copy of the real data directory, to damage."""
    return Path(shutil.copytree(golden, tmp_path / "data"))


# --- looking at files -------------------------------------------------------------


@attrs.frozen
class Frame:
    offset: int
    length: int  # payload bytes
    payload: bytes

    @property
    def end(self) -> int:
        return self.offset + aof.FRAME.size + self.length


def frames(path: Path) -> list[Frame]:
    out = []
    for item in aof.read_frames(path.read_bytes()):
        if isinstance(item, aof.FrameScan):
            assert item.clean, item
            break
        off, payload = item
        out.append(Frame(off, len(payload), payload))
    return out


def newest(data: Path) -> Path:
    return aof.list_segments(data / "aof")[-1][1]


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(bytes(raw))


def start_expecting_failure(tmp: Path, data: Path, timeout: float = 30.0) -> tuple[int, str]:
    """Start a server that must refuse the data: return its exit code and output."""
    port = free_port()
    log_path = tmp / f"refused-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            smallstalk_cmd() + ["serve", "-l", "127.0.0.1", "-p", str(port), "--data-dir", str(data)],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError("the server neither served nor exited")
            # The port opens before recovery (launch.py); serving is the log line.
            if f"listening on 127.0.0.1:{port}" in log_path.read_text(errors="replace"):
                raise AssertionError(f"the server started on damaged data:\n{log_path.read_text()}")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    return proc.returncode, log_path.read_text()


def all_job_ids(data: Path) -> list[int]:
    """Every job id any file of the directory mentions."""
    ids: set[int] = set(recovery.recover(data, repair=False).state.jobs)
    for _, path in aof.list_segments(data / "aof"):
        for f in frames(path):
            rec = records.decode(f.payload)
            if isinstance(rec, records.Put):
                ids.add(rec.id)
    for _, path in aof.list_snapshots(data / "snapshots"):
        _, items = snapshot.read_items(path)
        ids.update(item[1] for item in items if item[0] == "job")
    return sorted(ids)


def assert_server_matches(port: int, expected: State, ids: list[int]) -> None:
    """The live server holds exactly the expected jobs (a restart makes reserved ones ready)."""
    with connect(port) as c:
        bodies = peek_ids(c, ids)
        stats = stats_jobs(c, ids)
    want = {jid: j.body for jid, j in expected.jobs.items()}
    assert bodies == want
    for jid, j in expected.jobs.items():
        name = STATE_NAMES[j.state]
        st = stats[jid]
        assert (st["state"], int(st["pri"]), st["tube"]) == (
            "ready" if name == "reserved" else name, j.pri, j.tube.name), jid


def dump(state: State) -> list:
    return list(snapshot_codec.dump(state))


# --- the space a segment is allocated ahead ----------------------------------------


def test_a_killed_servers_allocated_tail_is_the_end_and_startup_cuts_it(
        data: Path, tmp_path: Path, servers: list[Server]) -> None:
    """Each run of the fixture was SIGKILLed: its segment ends in the zeros it was
    allocated ahead (aof.SegmentWriter). That is a clean end, not a torn tail: the
    next start-up cut the earlier runs' off, and cuts the last one's the same way."""
    segs = [path for _, path in aof.list_segments(data / "aof")]
    ends = {path: list(logread.iter_segment(path))[-1] for path in segs}
    assert all(scan.clean for scan in ends.values())
    last = segs[-1]
    assert last.stat().st_size > ends[last].end, "the last run's segment was not allocated ahead"
    assert last.read_bytes()[ends[last].end:] == bytes(last.stat().st_size - ends[last].end)
    for path in segs[:-1]:  # cut by the start-up after each run
        assert path.stat().st_size == ends[path].end, path
    ids = all_job_ids(data)
    expected = recovery.recover(data, repair=False).state

    srv = start_smallstalk(tmp_path, "--compact-interval", "3600", data_dir=data)
    servers.append(srv)
    log = srv.log()
    assert "torn" not in log and "warning" not in log.lower(), log
    assert last.stat().st_size == ends[last].end
    assert not last.with_name(last.name + ".broken").exists()
    assert_server_matches(srv.port, expected, ids)


# --- torn tail ------------------------------------------------------------------------

TEARS = {
    "in-frame-header": lambda f: f.offset + 3,
    "mid-payload": lambda f: f.offset + aof.FRAME.size + f.length // 2,
    "last-byte-missing": lambda f: f.end - 1,
}


@pytest.mark.parametrize("where", sorted(TEARS))
def test_torn_tail_is_cut_kept_aside_and_startup_goes_on(
    data: Path, tmp_path: Path, where: str, servers: list[Server]
) -> None:
    seg = newest(data)
    fs = frames(seg)
    k = len(fs) // 2
    torn = fs[k]
    cut = TEARS[where](torn)
    before_seq = records.decode(fs[k - 1].payload).seq
    ids = all_job_ids(data)
    expected = recovery.recover(data, repair=False, until_seq=before_seq).state
    original = seg.read_bytes()
    with open(seg, "r+b") as f:
        f.truncate(cut)

    srv = start_smallstalk(tmp_path, "--compact-interval", "3600", data_dir=data)
    servers.append(srv)
    log = srv.log()
    assert "torn write" in log and str(seg) in log and f"offset {torn.offset}" in log, log
    broken = seg.with_name(seg.name + ".broken")
    assert broken.read_bytes() == original[torn.offset:cut]
    assert seg.read_bytes() == original[:torn.offset]
    assert_server_matches(srv.port, expected, ids)
    with connect(srv.port) as c:
        r = c.put(b"after the tear")
        assert r.status == b"INSERTED" and r.id >= expected.next_job_id, r


def test_torn_tail_in_process(data: Path) -> None:
    """recover(): repair=False reports and leaves the files alone; repair=True cuts and keeps the tail."""
    seg = newest(data)
    fs = frames(seg)
    torn = fs[-2]
    cut = torn.offset + aof.FRAME.size + 1
    expected = recovery.recover(data, repair=False,
                                until_seq=records.decode(fs[-3].payload).seq).state
    original = seg.read_bytes()
    with open(seg, "r+b") as f:
        f.truncate(cut)

    dry = recovery.recover(data, repair=False)
    assert len(dry.warnings) == 1 and "torn write" in dry.warnings[0] and str(seg) in dry.warnings[0]
    assert seg.read_bytes() == original[:cut]
    assert not seg.with_name(seg.name + ".broken").exists()
    assert dump(dry.state) == dump(expected)

    fixed = recovery.recover(data)
    assert dump(fixed.state) == dump(expected)
    assert seg.with_name(seg.name + ".broken").read_bytes() == original[torn.offset:cut]
    assert seg.read_bytes() == original[:torn.offset]
    again = recovery.recover(data)
    assert again.warnings == [] and dump(again.state) == dump(expected)


def test_torn_tail_whose_job_body_looks_like_a_frame(tmp_path: Path, servers: list[Server]) -> None:
    """A torn put is still a torn tail when its body happens to hold a valid frame."""
    data = tmp_path / "data"
    srv = start_smallstalk(tmp_path, "--compact-interval", "3600", data_dir=data)
    servers.append(srv)
    inner = aof.frame(records.encode(records.Restart(1, 0)))
    with connect(srv.port) as c:
        kept = c.put(b"kept")
        assert kept.status == b"INSERTED"
        assert c.put(b"<" + inner + b">" + b"." * 64).status == b"INSERTED"
        # Killed while connected: closing first would log a Disconnect after the put.
        srv.kill()
    seg = newest(data)
    last = frames(seg)[-1]
    assert inner in last.payload
    with open(seg, "r+b") as f:
        f.truncate(last.end - 10)  # the embedded frame is whole, the put is not

    srv = start_smallstalk(tmp_path, "--compact-interval", "3600", data_dir=data)
    servers.append(srv)
    assert "torn write" in srv.log()
    with connect(srv.port) as c:
        assert peek_ids(c, [kept.id, kept.id + 1]) == {kept.id: b"kept"}


# --- bit flips: start-up must stop and say where -----------------------------------


def frame_flip(f: Frame, part: str) -> int:
    """Byte offset to damage in one frame."""
    if part == "length":
        return f.offset
    if part == "crc":
        return f.offset + 4
    return f.offset + aof.FRAME.size + f.length // 2


@pytest.mark.parametrize("part", ["payload", "length", "crc", "header"])
def test_bit_flip_in_closed_segment_stops_startup(data: Path, tmp_path: Path, part: str) -> None:
    segs = aof.list_segments(data / "aof")
    seg = segs[1][1]  # closed: later segments follow it
    assert seg != newest(data)
    fs = frames(seg)
    victim = fs[len(fs) // 2]
    if part == "header":
        flip_bit(seg, 12, 3)  # inside the first-seq field: the header CRC no longer matches
        offset, after = 0, f"after seq {int(seg.stem) - 1}"  # the last good seq
    else:
        flip_bit(seg, frame_flip(victim, part), 0)
        offset = victim.offset
        after = f"after seq {records.decode(victim.payload).seq - 1}"
    before = {p: p.read_bytes() for _, p in segs}

    code, log = start_expecting_failure(tmp_path, data)
    assert code != 0
    assert str(seg) in log and f"offset {offset}" in log and after in log, log
    assert {p: p.read_bytes() for _, p in segs} == before, "a refused start changed the files"
    assert not list((data / "aof").glob("*.broken"))

    with pytest.raises(CorruptionError) as err:
        recovery.recover(data, repair=False)
    assert (err.value.path, err.value.offset) == (seg, offset)


def test_bit_flip_in_snapshot_stops_startup(data: Path, tmp_path: Path) -> None:
    (last_seq, snap), = aof.list_snapshots(data / "snapshots")
    fs = frames(snap)
    victim = fs[len(fs) // 2]
    flip_bit(snap, frame_flip(victim, "payload"), 5)

    code, log = start_expecting_failure(tmp_path, data)
    assert code != 0
    assert str(snap) in log and f"offset {victim.offset}" in log and f"seq {last_seq}" in log, log

    with pytest.raises(CorruptionError) as err:
        recovery.recover(data, repair=False)
    assert (err.value.path, err.value.offset, err.value.seq) == (snap, victim.offset, last_seq)


@pytest.mark.parametrize("part", ["payload", "length", "crc"])
def test_bit_flip_mid_last_segment_is_not_a_torn_tail(data: Path, tmp_path: Path, part: str) -> None:
    seg = newest(data)
    fs = frames(seg)
    victim = fs[len(fs) // 3]
    assert len(fs) - fs.index(victim) > 5, "valid frames must follow the damage"
    flip_bit(seg, frame_flip(victim, part), 1)
    damaged = seg.read_bytes()
    seq = records.decode(victim.payload).seq

    code, log = start_expecting_failure(tmp_path, data)
    assert code != 0
    assert str(seg) in log and f"offset {victim.offset}" in log and f"after seq {seq - 1}" in log, log
    assert seg.read_bytes() == damaged, "the damaged segment was truncated: acknowledged records lost"
    assert not seg.with_name(seg.name + ".broken").exists()

    with pytest.raises(CorruptionError) as err:
        recovery.recover(data)
    assert (err.value.path, err.value.offset, err.value.seq) == (seg, victim.offset, seq - 1)
    assert seg.read_bytes() == damaged


def test_undamaged_copy_starts_and_matches_in_process_recovery(
    data: Path, tmp_path: Path, servers: list[Server]
) -> None:
    """The control: the same directory, undamaged, starts and serves what recover() reads."""
    ids = all_job_ids(data)
    expected = recovery.recover(data, repair=False)
    assert expected.warnings == [] and expected.state.jobs
    expected.state.check()
    srv = start_smallstalk(tmp_path, "--compact-interval", "3600", data_dir=data)
    servers.append(srv)
    assert_server_matches(srv.port, expected.state, ids)
