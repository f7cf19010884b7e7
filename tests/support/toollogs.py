"""The replay tools' test data: a fixed scenario run against real `smallstalk serve`
processes (two runs on one data directory), and how the tests run a tool and compare
its output.

Job 1 is reserved, times out (TTR 1s), is reserved and released, reserved and
buried, kicked, reserved and deleted; job 2 loses its reservations to a
disconnect and to a server restart. The text output is compared exactly, after
`norm()` replaces what the wall clock decides (timestamps, and durations, which
the tools right-align in fixed-width columns, so the replacement keeps every other
character in place). The fixtures that run it are tests/procs/conftest.py's.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import greenstalk

from smallstalk.storage import history

from .procs import REPO, Server, start_smallstalk

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


def files_of(data: Path) -> dict[str, tuple[int, int, str]]:
    return {str(p.relative_to(data)): (p.stat().st_size, p.stat().st_mtime_ns,
                                       hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(data.rglob("*")) if p.is_file()}


# The v2 golden fixture is a real server's data directory (tools/make_fixtures.py; ids and seqs
# are in snapshots/v2/expected.json): seq 41 put order-2 into orders with an expiry of an hour,
# as jobs 13 (orders), 14 (orders+audit) and 15 (orders+archive), dropping job 10 from the full
# orders; seq 43 dropped job 13; job 18 expired and was deleted (seq 46); job 20 was put into
# reports and moved to the dead-letter tube dead when it expired (seq 50).
V2 = REPO / "snapshots" / "v2" / "log-only"
