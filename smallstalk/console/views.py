"""What the console reads from the live server, taken inside a loop turn.

Each function here runs through `MutationLoop.call`, so it sees the state
between turns and never races the loop; each returns plain data (no State
objects escape) and is bounded: listings are paged and capped, and the
per-tube walk is cut into chunks of `TUBE_CHUNK` tubes, one turn each, so a
server with many tubes is not held up for long (docs/CONSOLE.md).
"""

from __future__ import annotations

import os
import time
from typing import Any

from smallstalk.core.explain import explain
from smallstalk.core.model import STATE_BY_NAME, STATE_NAMES
from smallstalk.core.state import DELAYED, NS, RESERVED, body_len
from smallstalk.core.stats import job_key_stats, job_stats, tube_stats
from smallstalk.server import stats as server_stats
from smallstalk.server.loop import MutationLoop

TUBE_CHUNK = 500  # tubes read per loop turn
PAGE_MAX = 200  # jobs or tubes per page
PREVIEW_BYTES = 60


def server(lp: MutationLoop) -> dict[str, Any]:
    """`stats` as a dict (bytes values decoded) plus what only the loop knows."""
    out: dict[str, Any] = {}
    for key, value in server_stats.server_stats(lp):
        out[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    out["read-only"] = lp.read_only or ""
    out["feeds"] = [{"session": sid, "acked": f.acked, "cut_off": f.cut_off}
                    for sid, f in sorted(lp.feeds.items())]
    return out


def tube_names(lp: MutationLoop) -> list[str]:
    return list(lp.state.tube_order)


def tube_rows(lp: MutationLoop, names: list[str]) -> list[dict[str, Any]]:
    """`stats-tube` of each named tube that still exists, plus the next ready job's age."""
    st, now = lp.state, lp.now
    rows = []
    for name in names:
        t = st.tubes.get(name)
        if t is None:
            continue
        row: dict[str, Any] = {}
        for key, value in tube_stats(t, now) + server_stats.tube_stats_extended(lp, name):
            row[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        top = st.peek_ready(name) if t.ready_n else None
        row["next-ready-age"] = (now - top.created) // NS if top is not None else None
        rows.append(row)
    return rows


def _job_row(lp: MutationLoop, j, now: int) -> dict[str, Any]:
    body = j.body
    if isinstance(body, int):  # read-behind: on disk; the page does not read it back
        shown = f"({body_len(body)} bytes on disk)"
    else:
        shown = _preview(body)
    return {"id": j.id, "pri": j.pri, "age": (now - j.created) // NS, "ttr": j.ttr,
            "reserves": j.reserves, "timeouts": j.timeouts, "releases": j.releases,
            "buries": j.buries, "kicks": j.kicks, "size": body_len(body), "preview": shown,
            "state": STATE_NAMES[j.state],
            "time_left": max(j.deadline - now, 0) // NS if j.state in (RESERVED, DELAYED) else 0}


def tube_jobs(lp: MutationLoop, tube: str, state: str, after: int,
              count: int) -> list[dict[str, Any]]:
    """One page of a tube's jobs in a state, in hand-out order (as `list-jobs`)."""
    st, now = lp.state, lp.now
    ids = st.list_jobs(tube, STATE_BY_NAME[state], after, min(count, PAGE_MAX))
    return [_job_row(lp, st.jobs[i], now) for i in ids]


def job_rows(lp: MutationLoop, ids: list[int]) -> list[dict[str, Any]]:
    """The rows of the jobs `ids` that still exist (a search's page)."""
    st, now = lp.state, lp.now
    return [_job_row(lp, st.jobs[i], now) for i in ids[:PAGE_MAX] if i in st.jobs]


def job(lp: MutationLoop, jid: int, body_limit: int) -> dict[str, Any] | None:
    """`stats-job`, and the body (up to `body_limit` bytes; read back if on disk)."""
    st = lp.state
    j = st.jobs.get(jid)
    if j is None:
        return None
    stats = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in job_stats(j, lp.now)}
    stats.update((k, v) for k, v in job_key_stats(st.keys, j) if v)  # put-unique's key
    stats.update(server_stats.job_stats_extended(lp, jid))  # why a policy holds it back
    try:
        body = lp.body_of(j)[:body_limit]
        error = ""
    except Exception as e:  # a read-behind read that failed: say so, the page still shows
        body, error = b"", str(e)
    why = explain(st, jid, lp.now, lp.peer_of) or []
    reasons = next((v for k, v in why if k == "reasons"), [])
    return {"stats": stats, "body": body, "size": body_len(j.body), "body_error": error,
            "reasons": reasons}


def counters(lp: MutationLoop) -> dict[str, Any]:
    """What the rate sampler keeps: command counters, and each tube's total puts."""
    c = lp.counters
    st = lp.state
    return {
        "t": time.time(),
        "put": c.get("cmd-put", 0),
        "reserve": c.get("cmd-reserve", 0) + c.get("cmd-reserve-with-timeout", 0)
        + c.get("cmd-reserve-job", 0),
        "delete": c.get("cmd-delete", 0),
        "tubes": ({name: st.tubes[name].total_jobs for name in st.tube_order}
                  if len(st.tube_order) <= 10_000 else {}),
    }


def _preview(body: bytes) -> str:
    text = body[:PREVIEW_BYTES].decode("utf-8", "replace")
    text = "".join(ch if ch.isprintable() else "·" for ch in text)
    return text + ("…" if len(body) > PREVIEW_BYTES else "")


def disk_use(data_dir) -> dict[str, int]:
    """Bytes and counts of the data directory's segments and snapshots (a few stat calls)."""
    out = {"aof_bytes": 0, "segments": 0, "snapshot_bytes": 0, "snapshots": 0}
    if data_dir is None:
        return out
    for sub, ext, nbytes, count in (("aof", ".aof", "aof_bytes", "segments"),
                                    ("snapshots", ".snap", "snapshot_bytes", "snapshots")):
        try:
            entries = list(os.scandir(os.path.join(data_dir, sub)))
        except OSError:
            continue
        for e in entries:
            if e.name.endswith(ext):
                try:
                    out[nbytes] += e.stat().st_size
                except OSError:
                    continue
                out[count] += 1
    return out


def rss_bytes() -> int:
    """The process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
