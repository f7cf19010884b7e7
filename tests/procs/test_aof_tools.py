"""`smallstalk aof ls|dump|verify` on AOFs from real server runs (the scenario in
tests/support/toollogs.py) and on the golden fixtures of every snapshot format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from smallstalk.core import records
from smallstalk.ops import aof as aof_tool
from smallstalk.ops import job_history, replay
from smallstalk.ops import text as fmt
from smallstalk.storage import aof, history, logread

from ..support.procs import REPO
from ..support.toollogs import (
    FOLDED,
    V2,
    T,
    base64_of,
    iso,
    run,
    run_n,
    times_of,
)

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



@pytest.mark.parametrize("version", ["v1", "v2"])
def test_aof_verify_reads_snapshots_of_every_format(version: str) -> None:
    """A format-1 snapshot is compared with the replayed state in today's layout."""
    data = REPO / "snapshots" / version / "snapshot-and-segments"
    code, out, _err = run(aof_tool.main, "verify", data)
    assert code == 0, out
    assert "agrees with snapshot" in out and out.endswith("verdict: OK (no damage)\n")
