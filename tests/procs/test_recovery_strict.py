"""Start-up is as strict as `aof verify`: an overlap or a gap stops it in one line, files untouched.

The two-servers story (two processes writing one directory, each its own
segment with the same seqs) is replayed on files made by hand, and a torn
tail of the last segment is still cut off as before.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from smallstalk.core import records as r
from smallstalk.ops import verify
from smallstalk.storage import aof, datadir, recovery
from smallstalk.storage.aof import CorruptionError

from ..support import segments
from ..support.bsclient import connect
from ..support.procs import REPO, free_port, smallstalk_cmd, start_smallstalk

T0 = 1_763_000_000_000_000_000


def put(seq: int, jid: int, body: bytes) -> r.Put:
    return r.Put(seq, T0 + seq * 1_000_000, 1, jid, "default", 100, 0, 60, body)


def write_segment(data: Path, recs: list) -> Path:
    return segments.write_segment(datadir.aof_dir(data), recs)


def two_servers(data: Path) -> Path:
    """Server A wrote seqs 1..5 (jobs 1..5); server B, started on the same
    directory after A's first two records, wrote seqs 3..8 in its own segment."""
    write_segment(data, [put(s, s, b"A%d" % s) for s in range(1, 6)])
    return write_segment(data, [put(s, s, b"B%d" % s) for s in range(3, 9)])


def snapshot_of_files(data: Path) -> dict[str, bytes]:
    return {str(p.relative_to(data)): p.read_bytes()
            for p in sorted(data.rglob("*")) if p.is_file() and p.name != datadir.LOCK}


def start_refused(tmp: Path, data: Path) -> tuple[int, str]:
    done = subprocess.run(
        smallstalk_cmd() + ["serve", "-l", "127.0.0.1", "-p", str(free_port()),
                            "--data-dir", str(data)],
        capture_output=True, text=True, cwd=REPO, timeout=60)
    return done.returncode, (done.stdout + done.stderr).strip()


def test_two_servers_files_stop_startup_in_one_line_and_nothing_changes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    second = two_servers(data)
    before = snapshot_of_files(data)

    code, out = start_refused(tmp_path, data)
    assert code != 0, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert str(second) in out, out
    assert f"offset {aof.HEADER_SIZE}" in out and "after seq 5" in out, out
    assert "sequence overlap: expected 6, found 3" in out, out
    assert "smallstalk replay COPY --until-seq 5 --write-snapshot SNAP" in out, out
    # Nothing compacted, cut or deleted: every file as it was, and no new ones.
    assert snapshot_of_files(data) == before

    rep = verify.verify(data)
    assert not rep.ok
    assert any("sequence overlap" in p and str(second) in p for p in rep.problems), rep.problems
    done = subprocess.run(smallstalk_cmd() + ["aof", "verify", str(data)], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert done.returncode == 1 and "verdict: DAMAGED" in done.stdout, done.stdout


def test_the_recovery_command_it_names_recovers_up_to_the_damage(tmp_path: Path) -> None:
    data = tmp_path / "data"
    two_servers(data)
    copy = tmp_path / "copy"
    snaps = copy / "snapshots"
    snaps.mkdir(parents=True)
    done = subprocess.run(smallstalk_cmd() + ["replay", str(data), "--until-seq", "5",
                                              "--write-snapshot", str(snaps)],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    server = start_smallstalk(tmp_path, data_dir=copy)
    try:
        c = connect(server.port)
        try:
            assert [c.call(b"peek %d\r\n" % j).body for j in range(1, 6)] == [
                b"A%d" % j for j in range(1, 6)]
        finally:
            c.close()
    finally:
        server.stop()


def test_a_gap_between_segments_stops_startup(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_segment(data, [put(s, s, b"x") for s in range(1, 6)])
    later = write_segment(data, [put(s, s, b"y") for s in range(8, 10)])
    before = snapshot_of_files(data)
    code, out = start_refused(tmp_path, data)
    assert code != 0 and "Traceback" not in out and len(out.splitlines()) == 1, out
    assert str(later) in out and "sequence gap: expected 6, found 8" in out, out
    assert "--until-seq 5" in out, out
    assert snapshot_of_files(data) == before
    assert any("sequence gap" in p for p in verify.verify(data).problems)


@pytest.mark.parametrize("story", ["overlap", "gap"])
def test_recover_and_verify_agree(tmp_path: Path, story: str) -> None:
    data = tmp_path / "data"
    write_segment(data, [put(s, s, b"x") for s in range(1, 6)])
    start = 3 if story == "overlap" else 7
    write_segment(data, [put(s, s, b"y") for s in range(start, start + 3)])
    with pytest.raises(CorruptionError) as info:
        recovery.recover(data, repair=False)
    assert info.value.seq == 5 and f"sequence {story}" in info.value.why
    problems = verify.verify(data).problems
    assert any(f"sequence {story}" in p for p in problems), problems


def test_a_torn_tail_of_the_last_segment_is_still_cut_off(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_segment(data, [put(s, s, b"x") for s in range(1, 4)])
    last = write_segment(data, [put(s, s, b"y%d" % s) for s in range(4, 7)])
    tail = aof.FRAME.pack(40, 0) + b"half a record"
    with open(last, "ab") as f:
        f.write(tail)
    server = start_smallstalk(tmp_path, data_dir=data)
    try:
        assert "torn write" in server.log()
        c = connect(server.port)
        try:
            assert c.call(b"peek 6\r\n").body == b"y6"
        finally:
            c.close()
    finally:
        server.stop()
    assert datadir.broken_path(last).read_bytes() == tail
