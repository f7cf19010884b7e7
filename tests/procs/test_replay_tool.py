"""`smallstalk replay`: the state at a sequence number or a time, rebuilt from AOFs of
real server runs (tests/support/toollogs.py) and the v2 golden fixture; a snapshot
written by it starts a server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import greenstalk
import pytest

from smallstalk.core import records
from smallstalk.ops import replay
from smallstalk.ops import text as fmt
from smallstalk.storage import aof, history, snapshot_codec

from ..support.procs import start_smallstalk
from ..support.toollogs import (
    FOLDED,
    V2,
    T,
    base64_of,
    client,
    files_of,
    iso,
    run,
    run_n,
    times_of,
)

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
