"""What the replay tools share: the history reader (storage/history.py) over folded and
retained segments and a live server that rotates and compacts, never writing into
the data directory, progress only on a terminal, and the CLI that runs them."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from smallstalk.ops import aof as aof_tool
from smallstalk.ops import job_history, replay
from smallstalk.ops import text as fmt
from smallstalk.storage import aof, history, logread

from ..support.procs import REPO, start_smallstalk
from ..support.toollogs import (
    FOLDED,
    T,
    client,
    files_of,
    iso,
    norm,
    run,
    run_n,
    wait_until,
)
from .test_aof_tools import DUMP

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
        # At least 3 s and 3 rounds, and until the compactor has folded
        # something under the readers (bounded: a slow machine gets a minute).
        least, most = time.monotonic() + 3, time.monotonic() + 60
        while (time.monotonic() < least or rounds < 3
               or not aof.list_snapshots(data / "snapshots")) and time.monotonic() < most:
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


@pytest.mark.parametrize("argv", [["aof", "ls"], ["aof", "dump"], ["aof", "verify"],
                                  ["replay", "--until-seq", "1"], ["job-history", "1"]],
                         ids=lambda a: " ".join(a[:2]))
def test_a_path_that_is_no_data_directory_is_one_line(tmp_path: Path, argv: list[str]) -> None:
    """A wrong path (the data directory's parent, a file) is not read as an
    empty history: `aof verify` of it said "OK (no damage)"."""
    main = {"aof": aof_tool.main, "replay": replay.main, "job-history": job_history.main}[argv[0]]
    (tmp_path / "data" / "aof").mkdir(parents=True)  # its parent is the mistake
    (tmp_path / "file").write_text("")
    for path, why in ((tmp_path, "not a data directory (no aof/ or snapshots/): give the "
                       "server's --data-dir"), (tmp_path / "file", "not a directory")):
        out, err = io.StringIO(), io.StringIO()
        args = [*argv[1:2], str(path), *argv[2:]] if argv[0] == "aof" else [str(path), *argv[1:]]
        assert main(args, out, err) == 1
        assert (out.getvalue(), err.getvalue()) == ("", f"smallstalk: {path}: {why}\n")
