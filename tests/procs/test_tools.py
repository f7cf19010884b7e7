"""The replay tools (`smallstalk aof ls|dump|verify`, `replay`, `job-history`) on AOFs from real server runs.

A fixed scenario runs against real `smallstalk serve` processes (two runs on
one data directory): job 1 is reserved, times out (TTR 1s), is reserved and
released, reserved and buried, kicked, reserved and deleted; job 2 loses its
reservations to a disconnect and to a server restart. The text output is
compared exactly, after `norm()` replaces what the wall clock decides
(timestamps, and durations, which the tools right-align in fixed-width
columns, so the replacement keeps every other character in place).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import greenstalk
import pytest

from smallstalk.core import records
from smallstalk.ops import aof as aof_tool
from smallstalk.ops import format as fmt
from smallstalk.ops import job_history, replay
from smallstalk.storage import aof, history, logread, snapshot_codec

from ..support.procs import REPO, Server, start_smallstalk

TS = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z")
DUR = r"[+-]?(?:0s|<1ms|\d+ms|\d+\.\d\ds|\d+\.\ds|\d+m\d\ds|\d+h\d\dm|\d+d\d\dh)"
HISTORY_ID = re.compile(r"history [0-9a-f]{16}")
DUR_COLUMN = re.compile(r"(?<=  ) *" + DUR + r"(?=  |$)", re.M)


def norm(text: str, data: Path | None = None) -> str:
    """Hide the wall clock: timestamps, and durations standing in their own column."""
    if data is not None:
        text = text.replace(str(data), "DATA")
    text = TS.sub("YYYY-MM-DD hh:mm:ss.mmmZ", text)
    text = HISTORY_ID.sub("history HHHHHHHHHHHHHHHH", text)  # random per data directory
    return DUR_COLUMN.sub(lambda m: "~".rjust(len(m.group())), text)


def wait_until(cond: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def client(srv: Server, **kw) -> greenstalk.Client:
    return greenstalk.Client(("127.0.0.1", srv.port), **kw)


def run_scenario(tmp: Path, data: Path) -> None:
    """Two server runs; comments give the records each step logs (seq: record).

    Connection ids start at 1 (start_smallstalk waits without connecting), and
    a restarted server gives ids above every id in the log.
    """
    srv = start_smallstalk(tmp, "--segment-records", "8", "--no-compact", data_dir=data)
    try:  # 1: new-epoch (a fresh log gets its history id), 2: restart
        p = client(srv, use="emails")  # conn 1.  3: use
        j1 = p.put("email-1", priority=100, ttr=1)  # 4
        j2 = p.put("email-2", priority=200, ttr=60)  # 5
        p.put("email-3", priority=300, delay=3600, ttr=60)  # 6: job 3, delayed
        w = client(srv, watch="emails")  # conn 2.  7: watch, 8: ignore default
        assert w.reserve(timeout=5).id == j1  # 9
        wait_until(lambda: p.stats_job(j1)["state"] == "ready", "the TTR to run out")  # 10: timeout
        w.release(w.reserve(timeout=5), priority=50)  # 11: reserve, 12: release
        w.bury(w.reserve(timeout=5), priority=60)  # 13: reserve, 14: bury
        assert p.kick(1) == 1  # 15
        job = w.reserve(timeout=5)  # 16
        assert job.id == j1
        w.delete(job)  # 17
        assert w.reserve(timeout=5).id == j2  # 18
        w.close()  # 19: disconnect (job 2 back to ready)
        wait_until(lambda: p.stats_job(j2)["state"] == "ready", "the disconnect")
        w2 = client(srv, watch="emails")  # conn 3.  20: watch, 21: ignore default
        assert w2.reserve(timeout=5).id == j2  # 22
        p.use("other")  # 23
        p.put("other-1", priority=7)  # 24: job 4
        srv.stop()  # SIGTERM with the connections open: nothing more is logged
        p.close()
        w2.close()
    finally:
        srv.kill()
    srv = start_smallstalk(tmp, "--segment-records", "8", "--no-compact", data_dir=data)
    try:  # 25: restart (conn 3's reservation of job 2 ends)
        p = client(srv, use="emails")  # conn 4.  26: use
        p.put("email-4", priority=500, ttr=60)  # 27: job 5
        w = client(srv, watch="emails")  # conn 5.  28: watch, 29: ignore default
        assert w.reserve(timeout=5).id == j2  # 30
        srv.stop()
        p.close()
        w.close()
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tools")
    data = tmp / "data"
    run_scenario(tmp, data)
    return data


@pytest.fixture(scope="module")
def folded_dir(log_dir: Path, tmp_path_factory) -> Path:
    """The same history after a server compacted it: seqs 1..30 only in a snapshot."""
    tmp = tmp_path_factory.mktemp("folded")
    data = tmp / "data"
    shutil.copytree(log_dir, data)
    srv = start_smallstalk(tmp, "--compact-interval", "0.1", data_dir=data)  # 31: restart
    try:
        wait_until(lambda: aof.list_snapshots(data / "snapshots")
                   and len(aof.list_segments(data / "aof")) == 1, "the compaction", 20)
        srv.stop()
    finally:
        srv.kill()
    return data


def run(main: Callable[..., int], *argv: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def run_n(main: Callable[..., int], data: Path, *argv: object) -> tuple[int, str, str]:
    """run(), with the data directory and the wall clock normalised away."""
    code, out, err = run(main, *argv)
    return code, norm(out, data), norm(err, data)


def times_of(data: Path) -> dict[int, int]:
    return {rec.seq: rec.time for _, _, rec in history.iter_records(data)}


def iso(ns: int) -> str:
    """An ISO time with its zone, `ns` floored to the microsecond (what --since/--until take)."""
    secs, rest = divmod(ns, 10**9)
    return datetime.fromtimestamp(secs, UTC).replace(microsecond=rest // 1000).isoformat()


def base64_of(data: bytes) -> str:
    return base64.b64encode(data).decode()


FOLDED = (
    "no longer in the log: the compactor folded them away into snapshot "
    "snapshots/00000000000000000030.snap (seq 30), which keeps the state at seq 30, not the "
    "records that led to it. To keep older records for these tools, run the server with "
    "`smallstalk serve --keep-segments-hours N` or `--keep-segments-bytes N`.")
T = "YYYY-MM-DD hh:mm:ss.mmmZ"


# --- aof ls -----------------------------------------------------------------------------


def test_aof_ls(log_dir: Path) -> None:
    assert run_n(aof_tool.main, log_dir, "ls", log_dir, "--utc") == (0, f"""\
data directory DATA (times in UTC)

snapshots: none

segments
  file                      seqs    records  first record              last record                size  note
  00000000000000000001.aof  1..8          8  {T}  {T}  295 B
  00000000000000000009.aof  9..16         8  {T}  {T}  206 B
  00000000000000000017.aof  17..24        8  {T}  {T}  236 B
  00000000000000000025.aof  25..30        6  {T}  {T}  200 B  last (open while a server runs)

4 segments: 30 records, seqs 1..30, 937 B
""", "")


def test_space_allocated_ahead_is_the_end_of_the_records(log_dir: Path, tmp_path: Path) -> None:
    """What a killed server leaves in its last segment (aof.SegmentWriter): zeros
    after the records. The tools read to the records' end and say so; no warning."""
    data = damaged_copy(log_dir, tmp_path)
    seg = data / "aof" / "00000000000000000025.aof"
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(bytes(aof.PREALLOCATE - size))
    code, out, err = run_n(aof_tool.main, data, "ls", data, "--utc")
    assert (code, err) == (0, "")
    assert out.splitlines()[-3].endswith(
        f"1.0 MiB  records end at {size}, then {fmt.fmt_size(aof.PREALLOCATE - size)} "
        f"allocated ahead; last (open while a server runs)"), out
    code, out, err = run_n(aof_tool.main, data, "verify", data)
    assert (code, err) == (0, "") and out.endswith("verdict: OK (no damage)\n"), out
    assert run_n(aof_tool.main, data, "dump", data, "--utc") == (0, DUMP, "")


def test_aof_ls_folded(folded_dir: Path) -> None:
    assert run_n(aof_tool.main, folded_dir, "ls", folded_dir, "--utc") == (0, f"""\
data directory DATA (times in UTC)

snapshots
  file                       seq  time                      jobs  tubes  conns   size  status
  00000000000000000030.snap   30  {T}     4      3      2  441 B  ok (newest: start-up loads it)

segments
  file                      seqs    records  first record              last record               size  note
  00000000000000000031.aof  31..31        1  {T}  {T}  45 B  last (open while a server runs)

1 segment: 1 record, seqs 31..31, 45 B
1 snapshot: newest at seq 30, 441 B
seqs 1..30 are no longer in the log: folded away by the compactor into snapshots/00000000000000000030.snap (only the state is kept)
""", "")


def test_aof_ls_jsonl(log_dir: Path) -> None:
    code, out, err = run(aof_tool.main, "ls", log_dir, "--format", "jsonl")
    rows = [json.loads(line) for line in out.splitlines()]
    assert (code, err) == (0, "")
    assert [(r["file"], r["first_seq"], r["last_seq"], r["records"], r["status"], r["last"])
            for r in rows] == [
        ("aof/00000000000000000001.aof", 1, 8, 8, "ok", False),
        ("aof/00000000000000000009.aof", 9, 16, 8, "ok", False),
        ("aof/00000000000000000017.aof", 17, 24, 8, "ok", False),
        ("aof/00000000000000000025.aof", 25, 30, 6, "ok", True),
    ]
    times = times_of(log_dir)
    assert [(r["first_time"], r["last_time"]) for r in rows] == [
        (times[1], times[8]), (times[9], times[16]), (times[17], times[24]),
        (times[25], times[30])]
    assert all(r["size"] == (log_dir / r["file"]).stat().st_size for r in rows)


# --- aof dump -------------------------------------------------------------------------------

DUMP = f"""\
  seq  time                      op             conn    job  details
    1  {T}  new-epoch                   epoch 1  history HHHHHHHHHHHHHHHH
    2  {T}  restart                     server started: earlier connections are gone
    3  {T}  use               1         tube emails
    4  {T}  put               1      1  tube emails  pri 100  delay 0s  ttr 1s  body 7 B "email-1"
    5  {T}  put               1      2  tube emails  pri 200  delay 0s  ttr 60s  body 7 B "email-2"
    6  {T}  put               1      3  tube emails  pri 300  delay 3600s  ttr 60s  body 7 B "email-3"
    7  {T}  watch             2         tube emails
    8  {T}  ignore            2         tube default
    9  {T}  reserve           2      1
   10  {T}  timeout                  1
   11  {T}  reserve           2      1
   12  {T}  release           2      1  pri 50  delay 0s
   13  {T}  reserve           2      1
   14  {T}  bury              2      1  pri 60
   15  {T}  kick              1      1
   16  {T}  reserve           2      1
   17  {T}  delete            2      1
   18  {T}  reserve           2      2
   19  {T}  disconnect        2
   20  {T}  watch             3         tube emails
   21  {T}  ignore            3         tube default
   22  {T}  reserve           3      2
   23  {T}  use               1         tube other
   24  {T}  put               1      4  tube other  pri 7  delay 0s  ttr 60s  body 7 B "other-1"
   25  {T}  restart                     server started: earlier connections are gone
   26  {T}  use               4         tube emails
   27  {T}  put               4      5  tube emails  pri 500  delay 0s  ttr 60s  body 7 B "email-4"
   28  {T}  watch             5         tube emails
   29  {T}  ignore            5         tube default
   30  {T}  reserve           5      2
"""


def test_aof_dump_text(log_dir: Path) -> None:
    assert run_n(aof_tool.main, log_dir, "dump", log_dir, "--utc") == (0, DUMP, "")


def dumped_seqs(data: Path, *filters: object) -> list[int]:
    code, out, err = run(aof_tool.main, "dump", data, "--format", "jsonl", *filters)
    assert (code, err) == (0, ""), err
    return [json.loads(line)["seq"] for line in out.splitlines()]


def test_aof_dump_filters(log_dir: Path) -> None:
    # --job matches the id lists of timeout and kick records too
    assert dumped_seqs(log_dir, "--job", 1) == [4, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    assert dumped_seqs(log_dir, "--job", 2, "--job", 4) == [5, 18, 22, 24, 30]
    assert dumped_seqs(log_dir, "--op", "timeout,kick", "--op", "disconnect") == [10, 15, 19]
    assert dumped_seqs(log_dir, "--tube", "other") == [23, 24]
    # a tube's records include those naming only its jobs (reserve, timeout, kick, ...)
    assert dumped_seqs(log_dir, "--tube", "emails", "--from-seq", 9, "--to-seq", 19) == list(
        range(9, 19))
    assert dumped_seqs(log_dir, "--conn", 3) == [20, 21, 22]
    assert dumped_seqs(log_dir, "--from-seq", 28) == [28, 29, 30]
    assert dumped_seqs(log_dir, "--job", 1, "--op", "reserve", "--to-seq", 13) == [9, 11, 13]
    times = times_of(log_dir)
    since = iso((times[10] + times[11]) // 2)
    until = iso((times[13] + times[14]) // 2).removesuffix("+00:00")  # no zone: UTC by --utc
    assert dumped_seqs(log_dir, "--utc", "--since", since, "--until", until) == [11, 12, 13]


def test_aof_dump_jsonl_has_every_field(log_dir: Path) -> None:
    code, out, err = run(aof_tool.main, "dump", log_dir, "--format", "jsonl")
    assert (code, err) == (0, "")
    expected = []
    for _first, path in aof.list_segments(log_dir / "aof"):
        for entry in logread.iter_segment(path):
            if isinstance(entry, aof.FrameScan):
                assert entry.clean
                break
            offset, rec = entry
            d = records.as_dict(rec)
            if "body" in d:
                d["body"] = base64_of(d["body"])
            if "ids" in d:
                d["ids"] = list(d["ids"])
            expected.append({**d, "file": f"aof/{path.name}", "offset": offset})
    assert [json.loads(line) for line in out.splitlines()] == expected
    assert len(expected) == 30


def test_aof_dump_folded_says_so(folded_dir: Path) -> None:
    code, out, err = run_n(aof_tool.main, folded_dir, "dump", folded_dir, "--utc",
                           "--from-seq", 5)
    assert code == 0
    assert out == f"""\
  seq  time                      op             conn    job  details
   31  {T}  restart                     server started: earlier connections are gone
"""
    assert err == f"note: records 5..30 are {FOLDED} Showing the records the log holds.\n"


def test_aof_dump_bad_op_is_a_usage_error(log_dir: Path) -> None:
    code, out, err = run(aof_tool.main, "dump", log_dir, "--op", "frobnicate")
    assert (code, out) == (2, "")
    assert "unknown --op frobnicate" in err and "pause-tube" in err


# --- aof verify ------------------------------------------------------------------------------


def test_aof_verify(log_dir: Path, folded_dir: Path) -> None:
    assert run_n(aof_tool.main, log_dir, "verify", log_dir) == (0, """\
verifying DATA
  check    file                          status  detail
  segment  aof/00000000000000000001.aof  ok      seqs 1..8, 8 records
  segment  aof/00000000000000000009.aof  ok      seqs 9..16, 8 records
  segment  aof/00000000000000000017.aof  ok      seqs 17..24, 8 records
  segment  aof/00000000000000000025.aof  ok      seqs 25..30, 6 records
  log                                    ok      seqs 1..30, no gaps
  replay                                 ok      the empty state + 30 records -> state at seq 30: 4 jobs, 3 tubes, 2 connections
verdict: OK (no damage)
""", "")
    assert run_n(aof_tool.main, folded_dir, "verify", folded_dir) == (0, """\
verifying DATA
  check     file                                 status  detail
  snapshot  snapshots/00000000000000000030.snap  ok      seq 30: 4 jobs, 3 tubes, 2 connections
  segment   aof/00000000000000000031.aof         ok      seqs 31..31, 1 record
  log                                            ok      seqs 31..31, no gaps
  replay                                         ok      snapshot 00000000000000000030.snap + 1 record -> state at seq 31: 4 jobs, 3 tubes, 0 connections
verdict: OK (no damage)
""", "")


def test_aof_verify_checks_snapshot_against_log(log_dir: Path, folded_dir: Path,
                                                tmp_path: Path) -> None:
    """Snapshot and every segment present (a crash before the folded segments went)."""
    data = tmp_path / "both"
    shutil.copytree(log_dir, data)
    shutil.copytree(folded_dir / "snapshots", data / "snapshots")
    code, out, err = run_n(aof_tool.main, data, "verify", data)
    assert (code, err) == (0, "")
    assert ("replay                                         ok      the empty state + 30 records "
            "-> state at seq 30: 4 jobs, 3 tubes, 2 connections; agrees with snapshot "
            "00000000000000000030.snap") in out
    # The log holds the seqs the snapshot covers: the tools use them, nothing is folded.
    code, out, err = run(job_history.main, data, 1)
    assert (code, err) == (0, "") and "deleted at seq 17 by conn 2" in out
    # A snapshot that disagrees with the log is damage, named.
    snap = data / "snapshots" / aof.snapshot_name(30)
    items = list(history.iter_snapshot(snap))
    snap.unlink()
    items = [[*i[:3], 999, *i[4:]] if i[0] == "job" and i[1] == 3 else i for i in items]
    from smallstalk.storage import snapshot

    snapshot.write(data / "snapshots", 30, items)
    code, out, err = run_n(aof_tool.main, data, "verify", data)
    assert code == 1
    assert ("  snapshot  snapshots/00000000000000000030.snap  DAMAGED  seq 30: 4 jobs, 3 tubes, "
            "2 connections; disagrees with the log at seq 30\n") in out
    assert ("\nverdict: DAMAGED (1 problem)\n  snapshots/00000000000000000030.snap: disagrees "
            "with the log at seq 30: item 8: the snapshot has ['job', 3, 'emails', 999, 3600, 60, "
            "b'email-3', 1, ") in out


def damaged_copy(src: Path, tmp: Path) -> Path:
    data = tmp / "damaged"
    shutil.copytree(src, data)
    return data


def offset_of(segment: Path, seq: int) -> int:
    for entry in logread.iter_segment(segment):
        if not isinstance(entry, aof.FrameScan) and entry[1].seq == seq:
            return entry[0]
    raise AssertionError(seq)


def test_aof_verify_names_a_bad_checksum(log_dir: Path, tmp_path: Path) -> None:
    data = damaged_copy(log_dir, tmp_path)
    seg = data / "aof" / "00000000000000000009.aof"
    off = offset_of(seg, 12)
    raw = bytearray(seg.read_bytes())
    raw[off + aof.FRAME.size + 2] ^= 0x40  # one bit in the payload of seq 12
    seg.write_bytes(bytes(raw))
    code, out, err = run_n(aof_tool.main, data, "verify", data)
    assert (code, err) == (1, "")
    assert out == f"""\
verifying DATA
  check    file                          status   detail
  segment  aof/00000000000000000001.aof  ok       seqs 1..8, 8 records
  segment  aof/00000000000000000009.aof  DAMAGED  seqs 9..11, 3 records; checksum mismatch at offset {off}
  segment  aof/00000000000000000017.aof  ok       seqs 17..24, 8 records
  segment  aof/00000000000000000025.aof  ok       seqs 25..30, 6 records
  log                                    ok       seqs 1..30, no gaps
  replay                                 STOPPED  at seq 11, at the damage in 00000000000000000009.aof
verdict: DAMAGED (1 problem)
  aof/00000000000000000009.aof: checksum mismatch at offset {off} (after seq 11)
"""
    # The readers stop there too, naming the same place.
    code, out, err = run_n(aof_tool.main, data, "dump", data)
    assert code == 1 and out.count("\n") == 12  # header + seqs 1..11
    assert err == (f"smallstalk: damage: aof/00000000000000000009.aof: checksum mismatch at "
                   f"offset {off} (after seq 11)\n")
    assert run(replay.main, data, "--until-seq", 20)[0] == 1
    assert run(replay.main, data, "--until-seq", 10)[0] == 0


def test_aof_verify_names_a_sequence_gap(log_dir: Path, tmp_path: Path) -> None:
    data = damaged_copy(log_dir, tmp_path)
    (data / "aof" / "00000000000000000017.aof").unlink()
    code, out, err = run_n(aof_tool.main, data, "verify", data)
    assert (code, err) == (1, "")
    assert out.endswith("""\
  segment  aof/00000000000000000025.aof  DAMAGED  seqs 25..30, 6 records
  log                                    DAMAGED  seqs 1..30, 1 gap
  replay                                 STOPPED  at seq 16, at the sequence gap after seq 16
verdict: DAMAGED (1 problem)
  aof/00000000000000000025.aof: sequence gap: expected 17, found 25 at offset 24 (after seq 16)
""")


def test_torn_tail_is_a_warning_not_damage(log_dir: Path, tmp_path: Path) -> None:
    """What a reader of a live server's open segment may see: a frame not fully there."""
    data = damaged_copy(log_dir, tmp_path)
    seg = data / "aof" / "00000000000000000025.aof"
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(aof.FRAME.pack(40, 0) + b"half a reco")
    code, out, err = run_n(aof_tool.main, data, "verify", data)
    warning = (f"warning: aof/00000000000000000025.aof: the last segment ends in 19 bytes that "
               f"are not a complete record (frame runs past the end of the file) at offset "
               f"{size}, after seq 30: a write in progress if a server is running, else a torn "
               f"write that start-up cuts off")
    assert (code, err) == (0, "")  # verify reports warnings in its report
    assert out.endswith(f"""\
  segment  aof/00000000000000000025.aof  ok      seqs 25..30, 6 records; torn tail: 19 B after offset {size}
  log                                    ok      seqs 1..30, no gaps
  replay                                 ok      the empty state + 30 records -> state at seq 30: 4 jobs, 3 tubes, 2 connections
{warning}
verdict: OK (no damage, 1 warning)
""")
    assert run_n(aof_tool.main, data, "dump", data, "--utc") == (0, DUMP, warning + "\n")
    code, out, err = run_n(aof_tool.main, data, "ls", data, "--utc")
    assert code == 0
    assert out.splitlines()[-3].endswith(
        f"{size + 19} B  torn tail: 19 B after offset {size}; last (open while a server runs)")
    # A bad frame with a good one after it is damage, even in the last segment.
    with open(seg, "ab") as f:
        f.write(aof.frame(records.encode(records.Restart(31, 1))))
    code, out, err = run_n(aof_tool.main, data, "verify", data)
    assert code == 1 and (f"  aof/00000000000000000025.aof: frame runs past the end of the "
                          f"file at offset {size} (after seq 30)") in out


# --- replay --------------------------------------------------------------------------------

REPLAY_30 = """\
4 jobs: 2 ready, 1 delayed, 1 reserved, 0 buried; 2 connections; 5 put in all, 1 TTR timeout

tube     ready  delayed  reserved  buried  total  expired  discarded   paused
default      0        0         0       0      0        0          0        -
emails       1        1         1       0      3        0          0        -
other        1        0         0       0      1        0          0        -

id  tube    state     pri      age  delay  ttr  time-left  expires  reserver  reserves  timeouts  releases  buries  kicks  body
 2  emails  reserved  200        ~      0   60          ~        -         5         3         0         0       0      0  7 B "email-2"
 3  emails  delayed   300        ~   3600   60          ~        -         -         0         0         0       0      0  7 B "email-3"
 4  other   ready       7        ~      0   60          -        -         -         0         0         0       0      0  7 B "other-1"
 5  emails  ready     500        ~      0   60          -        -         -         0         0         0       0      0  7 B "email-4"
"""


def test_replay(log_dir: Path, folded_dir: Path) -> None:
    assert run_n(replay.main, log_dir, log_dir, "--until-seq", 18, "--jobs",
                 "--utc") == (0, f"""\
state at seq 18 ({T}): the empty state + 18 records
2 jobs: 0 ready, 1 delayed, 1 reserved, 0 buried; 2 connections; 3 put in all, 1 TTR timeout

tube     ready  delayed  reserved  buried  total  expired  discarded   paused
default      0        0         0       0      0        0          0        -
emails       0        1         1       0      2        0          0        -

id  tube    state     pri      age  delay  ttr  time-left  expires  reserver  reserves  timeouts  releases  buries  kicks  body
 2  emails  reserved  200        ~      0   60          ~        -         2         1         0         0       0      0  7 B "email-2"
 3  emails  delayed   300        ~   3600   60          ~        -         -         0         0         0       0      0  7 B "email-3"
""", "")
    assert run_n(replay.main, log_dir, log_dir, "--until-seq", 30, "--jobs",
                 "--utc") == (0, f"state at seq 30 ({T}): the empty state + 30 records\n"
                              + REPLAY_30, "")
    # The snapshot the compactor wrote gives the same state as the records did.
    assert run_n(replay.main, folded_dir, folded_dir, "--until-seq", 30, "--jobs",
                 "--utc") == (0, f"state at seq 30 ({T}): snapshot 00000000000000000030.snap "
                              f"+ 0 records\n" + REPLAY_30, "")


def test_replay_until_a_time(log_dir: Path) -> None:
    times = times_of(log_dir)
    at = iso((times[18] + times[19]) // 2)
    code, out, err = run_n(replay.main, log_dir, log_dir, "--until", at, "--utc",
                           "--tube", "emails")
    assert (code, err) == (0, "")
    assert out == f"""\
state at {T} (after seq 18): the empty state + 18 records
2 jobs: 0 ready, 1 delayed, 1 reserved, 0 buried; 2 connections; 3 put in all, 1 TTR timeout

tube    ready  delayed  reserved  buried  total  expired  discarded   paused
emails      0        1         1       0      2        0          0        -
"""
    code, out, err = run(replay.main, log_dir, "--until", at, "--jobs",
                         "--format", "jsonl", "--state", "reserved")
    lines = [json.loads(line) for line in out.splitlines()]
    assert (code, err) == (0, "")
    assert (lines[0]["seq"], lines[0]["records_applied"], lines[0]["time"]) == (
        18, 18, fmt.Clock(utc=True).parse(at))
    assert [(x["kind"], x.get("name") or x.get("id")) for x in lines[1:]] == [
        ("tube", "default"), ("tube", "emails"), ("job", 2)]
    assert lines[-1]["reserver"] == 2 and lines[-1]["body"] == base64_of(b"email-2")
    assert lines[-1]["deadline"] == times[18] + 60 * 10**9


def test_replay_of_folded_history_says_so(folded_dir: Path, log_dir: Path) -> None:
    assert run(replay.main, folded_dir, "--until-seq", 17) == (
        3, "", "smallstalk: the state at seq 17 cannot be rebuilt (the oldest state that can is "
               f"at seq 30). Records 1..30 are {FOLDED}\n")
    assert run(replay.main, log_dir, "--until-seq", 31) == (
        1, "", "smallstalk: seq 31 is beyond the end of the log (the last record is seq 30)\n")
    assert run(replay.main, log_dir)[0] == 2  # --until-seq or --until is required


def files_of(data: Path) -> dict[str, tuple[int, int, str]]:
    return {str(p.relative_to(data)): (p.stat().st_size, p.stat().st_mtime_ns,
                                       hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(data.rglob("*")) if p.is_file()}


def test_replay_write_snapshot_starts_a_server(log_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "at-18.snap"
    code, out, err = run(replay.main, log_dir, "--until-seq", 18, "--write-snapshot",
                         target)
    name = aof.snapshot_name(18)
    assert code == 0 and out.startswith("state at seq 18 ")
    assert err == (f"wrote {target}: the state at seq 18 (2 jobs)\n"
                   f"to serve it: mkdir -p COPY/snapshots && cp {target} COPY/snapshots/{name} "
                   f"&& smallstalk serve --data-dir COPY\n"
                   f"(the server's start-up ends the connections of that moment: jobs they had "
                   f"reserved become ready)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["at-18.snap"]  # no temp files left
    # The same items the compactor writes for that state.
    assert list(history.iter_snapshot(target)) == list(
        snapshot_codec.dump(replay.rebuild(log_dir, until_seq=18).state))
    # A directory as the target: the name a server looks for.
    (tmp_path / "dir").mkdir()
    assert run(replay.main, log_dir, "--until-seq", 18, "--write-snapshot",
               tmp_path / "dir")[0] == 0
    assert (tmp_path / "dir" / name).read_bytes() == target.read_bytes()
    # Never into the data directory.
    before = files_of(log_dir)
    code, _, err = run(replay.main, log_dir, "--until-seq", 18, "--write-snapshot",
                       log_dir / "snapshots")
    assert code == 2 and "inside the data directory" in err
    assert files_of(log_dir) == before

    copy = tmp_path / "copy"
    (copy / "snapshots").mkdir(parents=True)
    shutil.copy(target, copy / "snapshots" / name)
    srv = start_smallstalk(tmp_path, data_dir=copy)
    try:
        with client(srv, use="emails", watch="emails") as c:
            j2 = c.stats_job(2)
            # conn 2 held job 2 at seq 18; the new server's start-up Restart ended that
            assert (j2["state"], j2["pri"], j2["reserves"], j2["timeouts"], j2["tube"]) == (
                "ready", 200, 1, 0, "emails")
            j3 = c.stats_job(3)
            assert (j3["state"], j3["pri"], j3["delay"]) == ("delayed", 300, 3600)
            for gone in (1, 4):
                with pytest.raises(greenstalk.NotFoundError):
                    c.stats_job(gone)
            assert c.put("new") == 4  # job ids go on from where the log was at seq 18
            assert c.stats_tube("emails")["current-jobs-ready"] == 2
            assert c.stats()["job-timeouts"] == 1
            assert c.reserve(timeout=5).id == 2
        srv.stop()
    finally:
        srv.kill()
    first = next(iter(history.iter_records(copy)))[2]
    assert (type(first), first.seq) == (records.Restart, 19)


# --- job-history -----------------------------------------------------------------------------


def test_job_history_of_a_job_that_did_everything(log_dir: Path) -> None:
    assert run_n(job_history.main, log_dir, log_dir, 1, "--utc") == (0, f"""\
job 1 (tube emails): put at seq 4 by conn 1; deleted at seq 17 by conn 2

seq  time                          step     held  state     event
  4  {T}                     ready     put by conn 1 into emails: pri 100, delay 0s, ttr 1s, body 7 B "email-1"
  9  {T}         ~           reserved  reserved by conn 2
 10  {T}         ~        ~  ready     TTR (1s) ran out: conn 2 lost it
 11  {T}         ~           reserved  reserved by conn 2
 12  {T}         ~        ~  ready     released by conn 2: pri 50, delay 0s
 13  {T}         ~           reserved  reserved by conn 2
 14  {T}         ~        ~  buried    buried by conn 2: pri 60
 15  {T}         ~           ready     kicked out of buried by conn 1
 16  {T}         ~           reserved  reserved by conn 2
 17  {T}         ~        ~  deleted   deleted by conn 2

lifetime            ~  put to delete
  ready             ~
  reserved          ~  4 reservations: 1 timed out, 1 released, 1 buried, 1 deleted
  buried            ~
""", "")


def test_job_history_disconnect_and_restart(log_dir: Path) -> None:
    assert run_n(job_history.main, log_dir, log_dir, 2, "--utc") == (0, f"""\
job 2 (tube emails): put at seq 5 by conn 1; reserved at the end of the log

seq  time                          step     held  state     event
  5  {T}                     ready     put by conn 1 into emails: pri 200, delay 0s, ttr 60s, body 7 B "email-2"
 18  {T}         ~           reserved  reserved by conn 2
 19  {T}         ~        ~  ready     conn 2 disconnected while holding it
 22  {T}         ~           reserved  reserved by conn 3
 25  {T}         ~        ~  ready     server restarted: conn 3's reservation ended
 30  {T}         ~           reserved  reserved by conn 5
     {T}         ~        ~  reserved  end of the log (seq 30): still reserved by conn 5

lifetime            ~  put to end of the log, still alive
  ready             ~
  reserved          ~  3 reservations: 1 ended by disconnect, 1 ended by a server restart, 1 still held
""", "")


def test_job_history_jsonl_durations(log_dir: Path) -> None:
    code, out, err = run(job_history.main, log_dir, 1, "--format", "jsonl")
    lines = [json.loads(line) for line in out.splitlines()]
    assert (code, err) == (0, "")
    steps, summary = lines[:-1], lines[-1]
    assert [(s["seq"], s["event"], s["conn"]) for s in steps] == [
        (4, "put", 1), (9, "reserve", 2), (10, "timeout", 2), (11, "reserve", 2),
        (12, "release", 2), (13, "reserve", 2), (14, "bury", 2), (15, "kick", 1),
        (16, "reserve", 2), (17, "delete", 2)]
    times = times_of(log_dir)
    timeout = steps[2]
    assert timeout["held_ns"] == times[10] - times[9]
    assert 1_000_000_000 <= timeout["held_ns"] < 5_000_000_000  # the TTR was 1s
    assert [s["held_ns"] for s in steps[4:]] == [
        times[12] - times[11], None, times[14] - times[13], None, None, times[17] - times[16]]
    assert all(s["since_prev_ns"] == times[s["seq"]] - times[p["seq"]]
               for p, s in zip(steps, steps[1:], strict=False))
    assert summary["reservations"] == ["timed out", "released", "buried", "deleted"]
    assert sum(summary["time_in_ns"].values()) == times[17] - times[4]
    assert summary["time_in_ns"]["buried"] == times[15] - times[14]


def test_job_history_of_folded_history(folded_dir: Path) -> None:
    code, out, err = run_n(job_history.main, folded_dir, folded_dir, 2, "--utc")
    assert code == 0
    assert out == f"""\
job 2 (tube emails): put before the log begins; ready at the end of the log

seq  time                          step     held  state     event
 30  {T}                     reserved  in snapshot 00000000000000000030.snap: reserved by conn 5; put at {T} into emails, pri 200, delay 0s, ttr 60s, body 7 B "email-2"; so far 3 reservations, 0 timeouts, 0 releases, 0 buries, 0 kicks
 31  {T}         ~        ?  ready     server restarted: conn 5's reservation ended
     {T}         ~           ready     end of the log (seq 31): still ready

since seq 30        ~  the snapshot to end of the log, still alive
  ready             ~
  reserved          ~  1 reservation: 1 ended by a server restart
"""
    assert err == f"note: job 2's history before seq 31 is gone. Records 1..30 are {FOLDED}\n"
    assert run(job_history.main, folded_dir, 1) == (
        3, "", "smallstalk: job 1 was put and deleted by seq 30: its whole history is gone. "
               f"Records 1..30 are {FOLDED}\n")
    assert run(job_history.main, folded_dir, 77) == (
        1, "", "smallstalk: no job 77 in the log (the log ends at seq 31)\n")


# --- with retention: the compactor keeps some folded segments ---------------------------------


@pytest.fixture(scope="module")
def kept_dir(log_dir: Path, tmp_path_factory) -> Path:
    """Compacted with `--keep-segments-bytes 500`: segments 17 and 25 (436 B) stay, 1 and 9 go."""
    tmp = tmp_path_factory.mktemp("kept")
    data = tmp / "data"
    shutil.copytree(log_dir, data)
    srv = start_smallstalk(tmp, "--compact-interval", "0.1", "--keep-segments-bytes", "500",
                           data_dir=data)  # 31: restart
    try:
        wait_until(lambda: aof.list_snapshots(data / "snapshots")
                   and [f for f, _ in aof.list_segments(data / "aof")] == [17, 25, 31],
                   "the compaction", 20)
        srv.stop()
    finally:
        srv.kill()
    return data


def test_tools_with_retained_segments(kept_dir: Path) -> None:
    data = kept_dir
    folded = FOLDED
    code, out, err = run_n(aof_tool.main, data, "ls", data, "--utc")
    assert code == 0 and out.endswith(
        "seqs 1..16 are no longer in the log: folded away by the compactor into "
        "snapshots/00000000000000000030.snap (only the state is kept)\n")
    assert "  00000000000000000017.aof  17..24        8" in out and "covered by the snapshot" in out
    assert dumped_seqs_and_note(data) == (list(range(17, 32)), f"note: records 1..16 are {folded} "
                                          "Showing the records the log holds.\n")
    code, out, err = run_n(aof_tool.main, data, "verify", data)
    assert (code, err) == (0, "") and ("snapshot 00000000000000000030.snap + 1 record -> state "
                                       "at seq 31") in out
    # Job 2's reservations after seq 16 are in the log; its put is not.
    code, out, err = run_n(job_history.main, data, data, 2, "--utc")
    assert code == 0
    assert err == f"note: job 2's history before seq 17 is gone. Records 1..16 are {folded}\n"
    assert out == f"""\
job 2 (tube emails): put before the log begins; ready at the end of the log

seq  time                          step     held  state     event
 18  {T}                     reserved  reserved by conn 2
 19  {T}         ~        ~  ready     conn 2 disconnected while holding it
 22  {T}         ~           reserved  reserved by conn 3
 25  {T}         ~        ~  ready     server restarted: conn 3's reservation ended
 30  {T}         ~           reserved  reserved by conn 5
 31  {T}         ~        ~  ready     server restarted: conn 5's reservation ended
     {T}         ~           ready     end of the log (seq 31): still ready

since seq 18        ~  its first step shown to end of the log, still alive
  ready             ~
  reserved          ~  3 reservations: 1 ended by disconnect, 2 ended by a server restart
"""
    # States between the kept records and the snapshot cannot be rebuilt: no snapshot there.
    assert run(replay.main, data, "--until-seq", 20)[0] == 3
    assert run(replay.main, data, "--until-seq", 31)[0] == 0


def dumped_seqs_and_note(data: Path) -> tuple[list[int], str]:
    code, out, err = run(aof_tool.main, "dump", data, "--format", "jsonl")
    assert code == 0
    return [json.loads(line)["seq"] for line in out.splitlines()], norm(err, data)


# --- the reader, live servers, read-only, progress, the CLI ---------------------------------------


def test_iter_records(log_dir: Path, folded_dir: Path) -> None:
    expected = []
    for _first, path in aof.list_segments(log_dir / "aof"):
        expected += [(path, e[0], e[1]) for e in logread.iter_segment(path)
                     if not isinstance(e, aof.FrameScan)]
    assert list(history.iter_records(log_dir)) == expected
    assert list(history.iter_records(str(log_dir), from_seq=10)) == expected[9:]
    assert [r.seq for _, _, r in history.iter_records(log_dir, include_open=False)] == list(
        range(1, 25))
    with pytest.raises(history.HistoryFolded) as info:
        next(history.iter_records(folded_dir, from_seq=3))
    assert (info.value.first_kept, info.value.snapshot_seq) == (31, 30)
    assert [r.seq for _, _, r in history.iter_records(folded_dir)] == [31]
    assert [r.seq for _, _, r in history.iter_records(folded_dir, from_seq=31)] == [31]


def test_the_tools_never_write_into_the_data_directory(log_dir: Path, folded_dir: Path,
                                                       tmp_path: Path) -> None:
    for data in (log_dir, folded_dir):
        before = files_of(data)
        dirs = sorted(p for p in data.rglob("*") if p.is_dir())
        for main, argv in [
            (aof_tool.main, ["ls", data]), (aof_tool.main, ["dump", data]),
            (aof_tool.main, ["dump", data, "--tube", "emails", "--format", "jsonl"]),
            (aof_tool.main, ["verify", data]),
            (replay.main, [data, "--until-seq", 30, "--jobs"]),
            (replay.main, [data, "--until-seq", 30, "--write-snapshot", tmp_path]),
            (job_history.main, [data, 2]),
        ]:
            assert run(main, *argv)[0] == 0, argv
        assert files_of(data) == before
        assert sorted(p for p in data.rglob("*") if p.is_dir()) == dirs


def test_the_tools_on_a_live_server(tmp_path: Path) -> None:
    """Rotation and compaction happen while the tools read: no false damage, no gaps."""
    data = tmp_path / "live"
    srv = start_smallstalk(tmp_path, "--segment-records", "5", "--compact-interval", "0.05",
                           "--compact-segments", "1", data_dir=data)
    stop = threading.Event()
    errors: list[BaseException] = []

    def traffic() -> None:
        try:
            with client(srv, use="live", watch="live") as c:
                while not stop.is_set():
                    c.put("x", ttr=60)
                    job = c.reserve(timeout=5)
                    if job.id % 3:
                        c.release(job)
                    else:
                        c.delete(job)
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=traffic)
    thread.start()
    rounds = 0
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline or rounds < 3:
            code, out, err = run(aof_tool.main, "verify", data)
            assert code == 0 and "verdict: OK" in out, out + err
            code, out, err = run(aof_tool.main, "dump", data, "--format", "jsonl")
            assert code == 0, err
            seqs = [json.loads(line)["seq"] for line in out.splitlines()]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            code, out, err = run(replay.main, data, "--until", iso(time.time_ns() + 10**9),
                                 "--format", "jsonl")
            assert code == 0, err
            assert json.loads(out.splitlines()[0])["seq"] >= seqs[-1]
            rounds += 1
    finally:
        stop.set()
        thread.join(10)
        srv.stop()
    assert not errors, errors
    assert aof.list_snapshots(data / "snapshots"), "no compaction happened meanwhile"


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal(log_dir: Path) -> None:
    out, err = io.StringIO(), FakeTTY()
    assert aof_tool.main(["dump", str(log_dir)], stdout=out, stderr=err) == 0
    shown = err.getvalue()
    assert shown.startswith("\rdumping: ") and "%" in shown and shown.endswith("\r\x1b[K")
    assert "\r" not in out.getvalue()
    quiet = io.StringIO()  # not a terminal: nothing
    line = fmt.ProgressLine("x", quiet)
    line(1, 2)
    line.clear()
    assert quiet.getvalue() == ""


def test_the_cli_runs_the_tools(log_dir: Path) -> None:
    def cli(*argv: object) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "smallstalk", *map(str, argv)],
                              capture_output=True, text=True, cwd=REPO, timeout=60)

    done = cli("aof", "dump", log_dir, "--utc")
    assert (done.returncode, norm(done.stdout, log_dir), done.stderr) == (0, DUMP, "")
    done = cli("job-history", log_dir)
    assert done.returncode == 2 and "the following arguments are required: ID" in done.stderr
    done = cli("aof")
    assert done.returncode == 2 and "ls       snapshots and segments" in done.stdout
    missing = log_dir / "nope"
    done = cli("replay", missing, "--until-seq", 1)
    assert (done.returncode, done.stderr) == (1, f"smallstalk: {missing}: no such directory\n")


# --- big tubes (format 2): fanout, discards, expiry -------------------------------------------
#
# The v2 golden fixture is a real server's data directory (tools/make_fixtures.py; ids and seqs
# are in snapshots/v2/expected.json): seq 41 put order-2 into orders with an expiry of an hour,
# as jobs 13 (orders), 14 (orders+audit) and 15 (orders+archive), dropping job 10 from the full
# orders; seq 43 dropped job 13; job 18 expired and was deleted (seq 46); job 20 was put into
# reports and moved to the dead-letter tube dead when it expired (seq 50).

V2 = REPO / "snapshots" / "v2" / "log-only"


def test_job_history_of_big_tube_jobs() -> None:
    def history_of(jid: int) -> str:
        code, out, err = run_n(job_history.main, V2, V2, jid, "--utc")
        assert (code, err) == (0, "")
        return out

    assert history_of(14) == f"""\
job 14 (tube orders+audit): put at seq 41 by conn 2; ready at the end of the log

seq  time                          step     held  state  event
 41  {T}                     ready  put by conn 2 into orders+audit, a fanout copy of job 13 (orders): pri 20, delay 0s, ttr 3600s, expires +1h00m, body 7 B "order-2"; discarded 1 job (10) to make room
     {T}         ~           ready  end of the log (seq 63): still ready

lifetime            ~  put to end of the log, still alive
  ready             ~
"""
    assert history_of(13) == f"""\
job 13 (tube orders): put at seq 41 by conn 2; discarded at seq 43 by conn 2's put

seq  time                          step     held  state      event
 41  {T}                     ready      put by conn 2 into orders (fanout copies: 14 (orders+audit), 15 (orders+archive)): pri 20, delay 0s, ttr 3600s, expires +1h00m, body 7 B "order-2"; discarded 1 job (10) to make room
 43  {T}         ~           discarded  discarded to make room in full orders by conn 2's put (jobs 16 (orders), 17 (orders+audit))

lifetime            ~  put to discard
  ready             ~
"""
    assert history_of(18) == f"""\
job 18 (tube sessions): put at seq 45 by conn 2; expired at seq 46 (deleted)

seq  time                          step     held  state    event
 45  {T}                     ready    put by conn 2 into sessions: pri 30, delay 0s, ttr 3600s, expires +1.00s, body 9 B "session-1"
 46  {T}         ~           expired  expired in sessions: deleted

lifetime            ~  put to expiry
  ready             ~
"""
    assert history_of(20) == f"""\
job 20 (tube reports, then dead): put at seq 49 by conn 2; ready at the end of the log

seq  time                          step     held  state  event
 49  {T}                     ready  put by conn 2 into reports: pri 40, delay 0s, ttr 3600s, expires +1.00s, body 8 B "report-1"
 50  {T}         ~           ready  expired in reports: moved to dead, expires never
     {T}         ~           ready  end of the log (seq 63): still ready

lifetime            ~  put to end of the log, still alive
  ready             ~
"""
    code, out, _err = run(job_history.main, V2, 20, "--format", "jsonl")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(s["seq"], s["event"], s["state"]) for s in lines[:-1]] == [
        (49, "put", "ready"), (50, "move", "ready"), (None, "end", "ready")]
    assert (lines[-1]["tube"], lines[-1]["moved_to"], lines[-1]["alive"]) == (
        "reports", ["dead"], True)
    # A job known only from a format-2 snapshot shows its expiry time.
    compacted = V2.parent / "compacted"
    code, out, _err = run_n(job_history.main, compacted, compacted, 15, "--utc")
    assert code == 0 and "into orders+archive, pri 20, delay 0s, ttr 3600s, expires +59m" in out


def test_aof_dump_big_tube_records() -> None:
    code, out, err = run_n(aof_tool.main, V2, "dump", V2, "--utc", "--from-seq", 40,
                           "--to-seq", 50, "--op", "put-jobs,expire,delete-tube")
    assert (code, err) == (0, "")
    assert out == f"""\
  seq  time                      op             conn    job  details
   40  {T}  put-jobs          2         jobs 10 orders, 11 orders+audit, 12 orders+archive  pri 20  delay 0s  ttr 3600s  expires never  body 7 B "order-1"
   41  {T}  put-jobs          2         jobs 13 orders, 14 orders+audit, 15 orders+archive  pri 20  delay 0s  ttr 3600s  expires +1h00m  dropped 10  body 7 B "order-2"
   42  {T}  delete-tube       2         tube orders+archive  (no more fanout copies)
   43  {T}  put-jobs          2         jobs 16 orders, 17 orders+audit  pri 20  delay 0s  ttr 3600s  expires never  dropped 13  body 7 B "order-3"
   45  {T}  put-jobs          2     18  jobs 18 sessions  pri 30  delay 0s  ttr 3600s  expires +1.00s  body 9 B "session-1"
   46  {T}  expire                  18  18 deleted
   49  {T}  put-jobs          2     20  jobs 20 reports  pri 40  delay 0s  ttr 3600s  expires +1.00s  body 8 B "report-1"
   50  {T}  expire                  20  20 moved to dead, expires never
"""
    # --job: the put-jobs that made a job or dropped it, the expire that moved it
    assert dumped_seqs(V2, "--job", 13) == [41, 43]
    assert dumped_seqs(V2, "--job", 20) == [49, 50]
    # --tube: a moved job's records follow it; a dropped job's drop counts for its tube
    assert dumped_seqs(V2, "--tube", "dead") == [50]
    assert dumped_seqs(V2, "--tube", "orders+archive") == [38, 40, 41, 42]
    assert dumped_seqs(V2, "--tube", "orders", "--op", "put-jobs") == [40, 41, 43]
    code, out, _err = run(aof_tool.main, "dump", V2, "--format", "jsonl", "--from-seq", 41,
                          "--to-seq", 41)
    (rec,) = [json.loads(line) for line in out.splitlines()]
    assert (rec["op"], rec["jobs"], rec["dropped"], rec["body"]) == (
        "put-jobs", [[13, "orders"], [14, "orders+audit"], [15, "orders+archive"]], [10],
        base64_of(b"order-2"))
    assert rec["expires"] == rec["time"] + 3600 * 10**9


def test_replay_shows_expired_discarded_and_fanout() -> None:
    code, out, err = run_n(replay.main, V2, V2, "--until-seq", 50, "--utc",
                           "--tube", "orders", "--tube", "sessions", "--tube", "reports",
                           "--tube", "dead")
    assert (code, err) == (0, "")
    assert out.split("\n", 3)[3] == """\
tube      ready  delayed  reserved  buried  total  expired  discarded   paused
orders        1        0         0       0      1        0          2        -
sessions      1        0         0       0      1        1          0        -
reports       0        0         0       0      0        1          0        -
dead          1        0         0       0      1        0          0        -

fanout: puts into orders are copied into orders+audit
"""
    code, out, _err = run(replay.main, V2, "--until-seq", 50, "--format", "jsonl",
                          "--jobs", "--tube", "orders+audit")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(x["kind"], x.get("id")) for x in lines[1:]] == [
        ("tube", None), ("job", 11), ("job", 14), ("job", 17)]
    times = times_of(V2)
    assert [x["expires"] for x in lines[2:]] == [None, times[41] + 3600 * 10**9, None]
    code, out, _err = run(replay.main, V2, "--until-seq", 50, "--format", "jsonl")
    assert [json.loads(x) for x in out.splitlines() if '"fanout"' in x] == [
        {"kind": "fanout", "parent": "orders", "tubes": ["orders+audit"]}]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_aof_verify_reads_snapshots_of_every_format(version: str) -> None:
    """A format-1 snapshot is compared with the replayed state in today's layout."""
    data = REPO / "snapshots" / version / "snapshot-and-segments"
    code, out, _err = run(aof_tool.main, "verify", data)
    assert code == 0, out
    assert "agrees with snapshot" in out and out.endswith("verdict: OK (no damage)\n")
