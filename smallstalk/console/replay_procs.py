"""The replay tools for the console, run as child processes (bounded, off the loop).

`smallstalk job-history`, `replay` and `aof dump` read the data directory's
files; run in a child process (like the compactor) they never hold the
mutation loop, and each run is bounded in time (`TIMEOUT`), in output
(`MAX_LINES`) and in how many run at once. Their JSON lines are what the
pages show; their one-line errors (history compacted away, a seq out of
range) are shown as they are.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

import trio

from smallstalk.core import records
from smallstalk.core.protocol import valid_tube_name

TIMEOUT = 20.0
MAX_LINES = 2000
AROUND = 10  # records shown before and after the chosen point
OPS = sorted(records.OP_NAMES.values())
CONCURRENT = 2  # tool processes at once (the console's CapacityLimiter)


async def run_tool(limiter: trio.CapacityLimiter,
                   args: list[str]) -> tuple[list[dict[str, Any]], str]:
    """(JSON lines, error text) of `smallstalk ARGS --format jsonl`."""
    cmd = [sys.executable, "-m", "smallstalk", *args, "--format", "jsonl", "--utc"]
    async with limiter:
        with trio.move_on_after(TIMEOUT) as scope:
            proc = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True,
                                          check=False)
    if scope.cancelled_caught:
        return [], f"gave up after {TIMEOUT:.0f}s"
    lines = proc.stdout.decode("utf-8", "replace").splitlines()
    out = []
    for line in lines[:MAX_LINES]:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    err = proc.stderr.decode("utf-8", "replace").strip()
    if len(lines) > MAX_LINES:
        err = (err + "\n" if err else "") + f"(only the first {MAX_LINES} lines are shown)"
    if proc.returncode != 0 and not err:
        err = f"exit status {proc.returncode}"
    return out, err


async def job_history(limiter: trio.CapacityLimiter, data_dir, jid: int) -> dict[str, Any]:
    steps, err = await run_tool(limiter, ["job-history", str(data_dir), str(jid)])
    for s in steps:
        s["time_text"] = fmt_time(s.get("time"))
    return {"steps": [s for s in steps if s.get("kind") == "step"],
            "summary": [s for s in steps if s.get("kind") != "step"], "error": err}


async def travel(limiter: trio.CapacityLimiter, data_dir, seq: str, at: str, filters: dict[str, str]) -> dict[str, Any]:
    """The state at a seq or time, and the records around it (aof dump's filters)."""
    where = ["--until-seq", seq] if seq else ["--until", at]
    state, err = await run_tool(limiter, ["replay", str(data_dir), *where])
    head = next((x for x in state if x.get("kind") == "state"), None)
    tubes = [x for x in state if x.get("kind") == "tube"]
    dump: list[dict[str, Any]] = []
    dump_err = ""
    if head is not None:
        point = int(head["seq"])
        args = ["aof", "dump", str(data_dir), "--from-seq", str(max(point - AROUND, 1)),
                "--to-seq", str(point + AROUND)]
        for key, flag in (("op", "--op"), ("tube", "--tube"), ("job", "--job"),
                          ("conn", "--conn")):
            if filters.get(key):
                args += [flag, filters[key]]
        dump, dump_err = await run_tool(limiter, args)
        for rec in dump:
            rec.pop("body", None)  # base64 of the whole body: the job page shows bodies
    return {"state": head, "tubes": tubes, "error": err, "records": dump,
            "records_error": dump_err}


def check_travel(seq: str, filters: dict[str, str]) -> str | None:
    """What is wrong with a time-travel query, in one line, or None."""
    for name, value in (("seq", seq), ("job", filters.get("job", "")),
                        ("conn", filters.get("conn", ""))):
        if value and not value.isdigit():
            return f"{name} must be a whole number, not {value!r}"
    if filters.get("op") and filters["op"] not in OPS:
        return f"unknown op {filters['op']!r}"
    tube = filters.get("tube", "")
    if tube and not valid_tube_name(tube.encode("utf-8", "replace")):
        return f"{tube!r} is not a tube name"
    return None


def fmt_time(ns: int | None) -> str:
    if not ns:
        return "-"
    t = datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def hexdump(data: bytes, width: int = 16) -> str:
    rows = []
    for i in range(0, len(data), width):
        chunk = data[i:i + width]
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        rows.append(f"{i:08x}  {chunk.hex(' '):<{width * 3}} {text}")
    return "\n".join(rows)


def decode_task(body: bytes) -> dict[str, Any] | None:
    """A smallstalk.worker task call (name, args, kwargs), or None."""
    from smallstalk.worker import BadPayload, decode_call

    try:
        name, args, kwargs = decode_call(body)
    except BadPayload:
        return None
    return {"task": name, "args": repr(args), "kwargs": repr(kwargs)}
