"""`smallstalk replay`: rebuild the state at a sequence number or a time, show it, or write
it as a snapshot a server can start from (into a directory outside the one read)."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from smallstalk.core.model import STATE_NAMES
from smallstalk.core.state import DELAYED, RESERVED, State
from smallstalk.ops.command import EXIT_OK, ToolError, UsageError, parser, run, seq_arg
from smallstalk.ops.text import DUR_WIDTH, Clock, Out, fmt_dur, jsonl, plural, preview, table
from smallstalk.storage import aof, datadir, history, snapshot, snapshot_codec
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.history import HistoryFolded, load_snapshot
from smallstalk.storage.recovery import apply_next


def _parse_replay(argv: list[str]) -> argparse.Namespace:
    p = parser("replay", "Rebuild the state as it was after record N (--until-seq) or at a "
               "time (--until: every record up to that time) and show it: per tube the "
               "ready, delayed, reserved and buried counts and the jobs expired and "
               "discarded, the fanout tubes; with --jobs every job. "
               "--write-snapshot writes it as a snapshot file a server can start from.")
    point = p.add_mutually_exclusive_group(required=True)
    point.add_argument("--until-seq", type=seq_arg, metavar="N", help="the state after record N")
    point.add_argument("--until", metavar="TIME", help="the state at this ISO time")
    p.add_argument("--jobs", action="store_true", help="list the jobs too")
    p.add_argument("--tube", action="append", metavar="NAME", help="only these tubes")
    p.add_argument("--state", action="append", choices=STATE_NAMES, help="only jobs in this state")
    p.add_argument("--write-snapshot", type=Path, metavar="PATH",
                   help="write the state as a snapshot file (a directory: <seq>.snap in it)")
    p.add_argument("--format", choices=("text", "jsonl"), default="text")
    return p.parse_args(argv)


@attrs.define
class Rebuilt:
    state: State
    base: str  # what the replay started from
    base_seq: int
    applied: int
    now: int  # the moment shown: the time asked for, or the last record's time


def rebuild(data_dir: Path, until_seq: int | None = None, until_time: int | None = None,
            warn: Callable[[str], None] | None = None,
            progress: Callable[[int, int], None] | None = None,
            clock: Clock | None = None) -> Rebuilt:
    """The state after record `until_seq`, or after every record up to `until_time` (ns).

    Starts from the newest snapshot at or before that point (or the empty
    state when the log reaches back to seq 1); raises HistoryFolded when
    neither can reach it.
    """
    with history.open_dir(data_dir) as od:
        return _rebuild_from(od, data_dir, until_seq, until_time, warn, progress,
                             clock or Clock())


def _rebuild_from(od: history.OpenDir, data_dir: Path, until_seq: int | None,
                  until_time: int | None, warn: Callable[[str], None] | None,
                  progress: Callable[[int, int], None] | None, clock: Clock) -> Rebuilt:
    lay = od.layout
    first = lay.first_kept
    chosen: history.SnapshotFile | None = None
    for snap in reversed(lay.snapshots):
        if until_seq is not None and snap.seq > until_seq:
            continue
        if until_time is not None:
            try:
                if history.snapshot_meta(snap.path, od.snapshot_file(snap))["time"] > until_time:
                    continue
            except CorruptionError:
                continue
        if first is not None and first > snap.seq + 1:
            continue  # records after it are missing
        chosen = snap
        break
    gone = lay.folded(1)
    if chosen is None and gone is not None:
        what = (f"the state at seq {until_seq}" if until_seq is not None
                else f"the state at {clock.fmt(until_time)}")
        oldest = lay.covering_snapshot(0)
        if oldest is not None:
            what += f" cannot be rebuilt (the oldest state that can is at seq {oldest.seq})"
        else:
            what += " cannot be rebuilt"
        raise HistoryFolded(1, first, gone.snapshot, gone.snapshot_seq, what=what)
    if chosen is None:
        state, base, base_seq = State(), "the empty state", 0
    else:
        state = load_snapshot(chosen.path, od.snapshot_file(chosen))
        base, base_seq = f"snapshot {chosen.path.name}", chosen.seq
    applied = 0
    if until_seq is None or until_seq > state.last_seq:
        for path, offset, rec in history.iter_records(data_dir, from_seq=state.last_seq + 1,
                                                      warn=warn, progress=progress,
                                                      opened=od):
            if until_time is not None and rec.time > until_time:
                break
            if not apply_next(state, path, offset, rec):
                raise CorruptionError(path, offset, state.last_seq,
                                      f"sequence gap: expected {state.last_seq + 1}, found {rec.seq}")
            applied += 1
            if until_seq is not None and rec.seq >= until_seq:
                break
    if until_seq is not None and state.last_seq < until_seq:
        raise ToolError(f"seq {until_seq} is beyond the end of the log (the last record is "
                        f"seq {state.last_seq})")
    now = until_time if until_time is not None else state.time
    return Rebuilt(state, base, base_seq, applied, now)


def cmd_replay(args: argparse.Namespace, out: Out) -> int:
    clock = Clock(args.utc)
    until_time = clock.parse(args.until) if args.until else None
    target = args.write_snapshot
    if target is not None:
        _refuse_inside(target, args.data_dir)
    prog = out.start_progress("replaying")
    rb = rebuild(args.data_dir, args.until_seq, until_time, out.warn, prog, clock)
    out.end_progress()
    st = rb.state
    tubes = set(args.tube or ())
    states = {STATE_NAMES.index(s) for s in args.state or ()}
    if target is not None:
        owner = datadir.owner_of(target)
        try:
            # Writing into a data directory: only while no server owns it.
            held = datadir.lock(owner) if owner is not None else None
        except datadir.Locked as e:
            raise ToolError(f"--write-snapshot {target}: {e}") from None
        try:
            path = write_snapshot(st, target)
        finally:
            if held is not None:
                datadir.unlock(held)
        out.stderr.write(
            f"wrote {path}: the state at seq {st.last_seq} ({plural(len(st.jobs), 'job')})\n"
            f"to serve it: mkdir -p COPY/snapshots && cp {path} COPY/snapshots/"
            f"{aof.snapshot_name(st.last_seq)} && smallstalk serve --data-dir COPY\n"
            f"(the server's start-up ends the connections of that moment: jobs they had "
            f"reserved become ready)\n")
    if args.format == "jsonl":
        out.line(jsonl({"kind": "state", "seq": st.last_seq, "time": rb.now,
                        "last_record_time": st.time, "base": rb.base, "base_seq": rb.base_seq,
                        "records_applied": rb.applied, "jobs": len(st.jobs),
                        "total_jobs": st.total_jobs, "job_timeouts": st.job_timeouts}))
        for name in st.tube_order:
            if tubes and name not in tubes:
                continue
            out.line(jsonl({"kind": "tube", **_tube_counts(st, name)}))
        for parent, children in st.fanout.items():
            if not tubes or parent in tubes:
                out.line(jsonl({"kind": "fanout", "parent": parent, "tubes": children}))
        if args.jobs:
            for j in _jobs(st, tubes, states):
                out.line(jsonl({"kind": "job", "id": j.id, "tube": j.tube.name,
                                "state": STATE_NAMES[j.state], "pri": j.pri, "delay": j.delay,
                                "ttr": j.ttr, "created": j.created,
                                "deadline": j.deadline if j.state in (DELAYED, RESERVED) else None,
                                "reserver": j.reserver or None, "reserves": j.reserves,
                                "timeouts": j.timeouts, "releases": j.releases,
                                "buries": j.buries, "kicks": j.kicks,
                                "expires": st.expires.get(j.id), "body": j.body}))
        return EXIT_OK

    at = (f"at {clock.fmt(rb.now)} (after seq {st.last_seq})" if until_time is not None
          else f"at seq {st.last_seq} ({clock.fmt(rb.now) if st.last_seq else 'no records'})")
    out.line(f"state {at}: {rb.base} + {plural(rb.applied, 'record')}")
    counts = [st.ready_n, st.delayed_n, st.reserved_n, st.buried_n]
    out.line(f"{plural(len(st.jobs), 'job')}: "
             + ", ".join(f"{n} {name}" for n, name in zip(counts, STATE_NAMES, strict=True))
             + f"; {plural(sum(1 for c in st.conns.values() if c.logged), 'connection')}; "
             f"{st.total_jobs} put in all, {plural(st.job_timeouts, 'TTR timeout')}")
    out.line()
    rows = []
    for name in st.tube_order:
        if tubes and name not in tubes:
            continue
        c = _tube_counts(st, name)
        t = st.tubes[name]
        paused = fmt_dur(t.unpause_at - rb.now) if t.unpause_at > rb.now else "-"
        rows.append([name, c["ready"], c["delayed"], c["reserved"], c["buried"], c["total"],
                     c["expired"], c["discarded"], paused])
    for line in table(["tube", "ready", "delayed", "reserved", "buried", "total", "expired",
                       "discarded", "paused"], rows, "lrrrrrrrr", {8: DUR_WIDTH}):
        out.line(line)
    shown = [(parent, children) for parent, children in st.fanout.items()
             if not tubes or parent in tubes]
    if shown:
        out.line()
        for parent, children in shown:
            out.line(f"fanout: puts into {parent} are copied into {', '.join(children)}")
    if args.jobs:
        out.line()
        rows = []
        for j in _jobs(st, tubes, states):
            left = (fmt_dur(j.deadline - rb.now) if j.state in (DELAYED, RESERVED) else "-")
            at = st.expires.get(j.id)
            expires = fmt_dur(at - rb.now) if at else "-"
            rows.append([j.id, j.tube.name, STATE_NAMES[j.state], j.pri, fmt_dur(rb.now - j.created),
                         j.delay, j.ttr, left, expires, j.reserver if j.state == RESERVED else "-",
                         j.reserves, j.timeouts, j.releases, j.buries, j.kicks, preview(j.body)])
        if rows:
            for line in table(["id", "tube", "state", "pri", "age", "delay", "ttr", "time-left",
                               "expires", "reserver", "reserves", "timeouts", "releases",
                               "buries", "kicks", "body"], rows, "rllrrrrrrrrrrrr",
                              {4: DUR_WIDTH, 7: DUR_WIDTH, 8: DUR_WIDTH}):
                out.line(line)
        else:
            out.line("no jobs")
    return EXIT_OK


def _tube_counts(st: State, name: str) -> dict[str, Any]:
    t = st.tubes[name]
    return {"name": name, "ready": t.ready_n, "delayed": t.delayed_n, "reserved": t.reserved_n,
            "buried": len(t.buried), "total": t.jobs_n, "total_jobs": t.total_jobs,
            "cmd_delete": t.cmd_delete, "cmd_pause": t.cmd_pause, "pause": t.pause,
            "unpause_at": t.unpause_at, "expired": t.expired_n, "discarded": t.discarded_n}


def _jobs(st: State, tubes: set[str], states: set[int]) -> Iterator[Any]:
    for jid in sorted(st.jobs):
        j = st.jobs[jid]
        if (tubes and j.tube.name not in tubes) or (states and j.state not in states):
            continue
        yield j


def _refuse_inside(target: Path, data_dir: Path) -> None:
    t, d = target.resolve(), data_dir.resolve()
    if t == d or d in t.parents:
        raise UsageError(f"--write-snapshot {target}: inside the data directory; these tools "
                         f"never write there (write it elsewhere, into a copy)")


def write_snapshot(state: State, target: Path) -> Path:
    """Write `state` as a snapshot file (the server's format, via snapshot.write).

    `target` an existing directory: `<seq>.snap` in it, the name a server looks
    for in `DATA_DIR/snapshots/`. Otherwise the file `target` itself.
    """
    if target.is_dir():
        return snapshot.write(target, state.last_seq, snapshot_codec.dump(state))
    parent = target.parent
    aof.make_dirs(parent)
    tmp = Path(tempfile.mkdtemp(prefix=".smallstalk-replay-", dir=parent))
    try:
        written = snapshot.write(tmp, state.last_seq, snapshot_codec.dump(state))
        os.replace(written, target)
        aof.fsync_dir(parent)  # the recovery procedure serves this file next
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str], stdout: IO[str] | None = None,
                stderr: IO[str] | None = None) -> int:
    return run(argv, _parse_replay, cmd_replay, stdout, stderr)
