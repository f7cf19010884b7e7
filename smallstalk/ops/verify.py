"""`smallstalk aof verify`: check a data directory as start-up reads it, with start-up's
reader (`logread.LogReader`: checksums, sequence continuity, the torn tail), then replay
and agreement with the snapshot, without writing anything."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import attrs

from smallstalk.core.state import BURIED, READY, State
from smallstalk.ops.command import EXIT_ERROR, EXIT_OK, parser, run
from smallstalk.ops.text import Out, fmt_size, plural, table
from smallstalk.storage import history, logread, snapshot_codec
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.history import load_snapshot


def _parse_verify(argv: list[str]) -> argparse.Namespace:
    p = parser("aof verify", "Check every frame's checksum, sequence continuity across the "
               "snapshot and the segments, and that replaying them succeeds (and agrees with "
               "the snapshot where the log still covers it). Exit 0 if there is no damage, "
               "1 if there is; a torn tail at the end of the last segment is a warning.")
    return p.parse_args(argv)


@attrs.define
class VerifyReport:
    rows: list[list[str]] = attrs.Factory(list)  # [what, file, status, detail]
    problems: list[str] = attrs.Factory(list)
    warnings: list[str] = attrs.Factory(list)
    state: State | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _mismatch(snap_items: Iterator[list], live: Iterator[list]) -> str | None:
    """The first difference between a snapshot's items and a replayed state's, if any."""
    n = 0
    while True:
        a, b = next(snap_items, None), next(live, None)
        if a is not None:
            a = _current_layout(a)
        if a is None and b is None:
            return None
        if a is None or b is None:
            return "the snapshot and the log give a different number of items"
        if a != b and not _same_job(a, b):
            return f"item {n}: the snapshot has {a!r:.160}, the log gives {b!r:.160}"
        n += 1


def _same_job(a: list, b: list) -> bool:
    # A deadline means nothing for ready and buried jobs (README: readers ignore it).
    if a[:1] == ["job"] == b[:1] and len(a) == len(b) and a[7] == b[7] in (READY, BURIED):
        return a[:9] + a[10:] == b[:9] + b[10:]
    return False


# Snapshot items of an older format, padded to today's layout: fields are only ever
# appended, and State.load reads a missing one as 0 (snapshots/README.md, Versioning).
_ITEM_LENGTHS = {"tube": 9, "job": 17}


def _current_layout(item: list) -> list:
    n = _ITEM_LENGTHS.get(item[0]) if item else None
    if n is not None and len(item) < n:
        return [*item, *[0] * (n - len(item))]
    return item


def verify(data_dir: Path, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check a data directory the way start-up reads it, without writing anything.

    Problems (damage) and warnings (a torn tail at the end of the last segment,
    a damaged older snapshot) are collected in the report, not raised.
    """
    rep = VerifyReport()
    with history.open_dir(data_dir) as od:
        return _verify(od, rep, progress)


def _verify(od: history.OpenDir, rep: VerifyReport,
            progress: Callable[[int, int], None] | None) -> VerifyReport:
    lay, files = od.layout, od.segments
    newest = lay.newest_snapshot
    newest_file = od.snapshot_file(newest) if newest is not None else None
    newest_ok = False
    newest_row: list[str] | None = None
    for snap in lay.snapshots:
        try:
            counts: dict[str, int] = {}
            for item in history.iter_snapshot(snap.path, od.snapshot_file(snap)):
                counts[item[0]] = counts.get(item[0], 0) + 1
            detail = (f"seq {snap.seq}: {plural(counts.get('job', 0), 'job')}, "
                      f"{plural(counts.get('tube', 0), 'tube')}, "
                      f"{plural(counts.get('conn', 0), 'connection')}")
            if snap is newest:
                newest_ok = True
            else:
                detail += " (older: start-up does not read it)"
            rep.rows.append(["snapshot", str(snap.path), "ok", detail])
            if snap is newest:
                newest_row = rep.rows[-1]
        except (CorruptionError, FileNotFoundError) as e:
            msg = str(e)
            rep.rows.append(["snapshot", str(snap.path), "DAMAGED", getattr(e, "why", msg)])
            if snap is newest:
                rep.problems.append(f"{msg} (start-up refuses to load it)")
            else:
                rep.warnings.append(f"{msg} (an older snapshot: start-up does not read it)")

    first = lay.first_kept
    state: State | None = None
    compare_at: int | None = None
    base = ""
    if first is None or first == 1:
        state = State()
        base = "the empty state"
        if newest is not None and newest_ok:
            compare_at = newest.seq
    elif newest is not None and newest_ok:
        state = _try_load(newest, newest_file, rep, newest_row)
        base = f"snapshot {newest.path.name}"
    elif newest is None:
        state = State()  # the log must start at seq 1: the reader names the gap
        base = "the empty state"
    # The log's structure is start-up's reader's verdict (logread.LogReader), damage
    # collected instead of raised; replay and the snapshot comparison come on top.
    reader = logread.LogReader([seg.path for seg in lay.segments],
                                newest.seq if newest is not None else 0,
                                keep_going=True, files=files)
    replaying = state is not None
    stopped = ""  # why replay stopped early
    applied = 0
    agreed = False
    total = sum(seg.size for seg in lay.segments)
    done = 0  # bytes in the segments before the one being read
    current: Path | None = None
    first_seq: int | None = None
    unapplied: dict[Path, str] = {}
    for path, _data, offsets, recs in reader.batches():
        if path != current:
            done, current = sum(read.size for read in reader.read[:-1]), path
        if progress is not None:
            progress(done + offsets[-1], total)
        if first_seq is None:
            first_seq = recs[0].seq
        if replaying and reader.problems:
            replaying, stopped = False, _stop_reason(reader.problems[0])
        if not replaying:
            continue
        for offset, rec in zip(offsets, recs, strict=True):
            if rec.seq <= state.last_seq:
                continue  # in the snapshot already
            try:
                state.apply(rec)
            except Exception as e:  # StateError, or a record with fields of the wrong type
                rep.problems.append(f"{path}: record seq {rec.seq} at offset {offset} "
                                    f"does not apply: {e}")
                unapplied[path] = "DAMAGED"
                replaying, stopped = False, f"seq {rec.seq}, which does not apply"
                break
            applied += 1
            if compare_at is not None and rec.seq == compare_at:
                items = history.iter_snapshot(newest.path, newest_file)
                try:
                    diff = _mismatch(items, snapshot_codec.dump(state))
                finally:
                    items.close()
                compare_at = None
                if diff:
                    rep.problems.append(f"{newest.path}: disagrees with the log at seq "
                                        f"{newest.seq}: {diff}")
                    if newest_row is not None:
                        newest_row[2] = "DAMAGED"
                        newest_row[3] += f"; disagrees with the log at seq {newest.seq}"
                    # Go on from what start-up would serve.
                    state = _try_load(newest, newest_file, rep, newest_row)
                    base, applied = f"snapshot {newest.path.name}", 0
                    if state is None:
                        replaying, stopped = False, "the damaged snapshot"
                        break
                else:
                    agreed = True
    if replaying and reader.problems:
        replaying, stopped = False, _stop_reason(reader.problems[0])
    for seg, read in zip(lay.segments, reader.read, strict=False):
        status, detail = "ok", ""
        for e in read.problems:
            rep.problems.append(str(e))
            status = "DAMAGED"
            if not e.why.startswith("sequence "):
                detail = f"{e.why} at offset {e.offset}"
        status = unapplied.get(seg.path, status)
        if read.torn is not None:
            rep.warnings.append(read.torn_warning())
            if read.header_seq is not None:
                detail = f"torn tail: {fmt_size(read.size - read.end)} after offset {read.end}"
        if read.header_seq is not None and read.header_seq != seg.first:
            rep.warnings.append(f"{seg.path}: its name says seq {seg.first}, its header "
                                f"{read.header_seq}")
        span = (f"seqs {read.first_seq}..{read.last_seq}, {plural(read.records, 'record')}"
                if read.records else "no records")
        rep.rows.append(["segment", str(seg.path), status, "; ".join(filter(None, [span, detail]))])
    last_seq = reader.last_read

    if compare_at is not None and replaying and state.last_seq < compare_at:
        # The log ends before the snapshot: start-up serves the snapshot.
        state = _try_load(newest, newest_file, rep, newest_row)
        base, applied = f"snapshot {newest.path.name}", 0
    if first_seq is not None:
        gaps = sum("sequence gap" in p for p in rep.problems)
        overlaps = sum("sequence overlap" in p for p in rep.problems)
        breaks = ", ".join(filter(None, [plural(gaps, "gap") if gaps else "",
                                         plural(overlaps, "overlap") if overlaps else ""]))
        rep.rows.append(["log", "", "DAMAGED" if breaks else "ok",
                         f"seqs {first_seq}..{last_seq}, " + (breaks or "no gaps")])
    if state is not None and not stopped:
        rep.state = state
        detail = f"{base} + {plural(applied, 'record')} -> state at seq {state.last_seq}: " \
                 f"{plural(len(state.jobs), 'job')}, {plural(len(state.tubes), 'tube')}, " \
                 f"{plural(len(state.conns), 'connection')}"
        if agreed:
            detail += f"; agrees with snapshot {newest.path.name}"
        rep.rows.append(["replay", "", "ok", detail])
    elif state is not None:
        rep.rows.append(["replay", "", "STOPPED", f"at seq {state.last_seq}, at {stopped}"])
    else:
        rep.rows.append(["replay", "", "NOT RUN", "no state to start from (see above)"])
    return rep


def _stop_reason(e: CorruptionError) -> str:
    if e.why.startswith("sequence "):
        return f"the {e.why.split(':')[0]} after seq {e.seq}"
    return f"the damage in {e.path.name}"


def _try_load(snap: history.SnapshotFile, file: IO[bytes] | None, rep: VerifyReport,
              row: list[str] | None) -> State | None:
    """The snapshot's state, or None with the damage reported."""
    try:
        return load_snapshot(snap.path, file)
    except CorruptionError as e:
        rep.problems.append(f"{e} (start-up refuses to load it)")
        if row is not None:
            row[2], row[3] = "DAMAGED", f"{row[3]}; {e.why}"
        return None


def cmd_verify(args: argparse.Namespace, out: Out) -> int:
    prog = out.start_progress("verifying")
    rep = verify(args.data_dir, prog)
    out.end_progress()
    out.line(f"verifying {args.data_dir}")
    rows = [[what, out.rel(path), status, detail] for what, path, status, detail in rep.rows]
    for line in table(["check", "file", "status", "detail"], rows, indent="  "):
        out.line(line)
    for w in rep.warnings:
        out.line(f"warning: {out.rel(w)}")
    if rep.ok:
        extra = f", {plural(len(rep.warnings), 'warning')}" if rep.warnings else ""
        out.line(f"verdict: OK (no damage{extra})")
        return EXIT_OK
    out.line(f"verdict: DAMAGED ({plural(len(rep.problems), 'problem')})")
    for p in rep.problems:
        out.line(f"  {out.rel(p)}")
    return EXIT_ERROR


def main(argv: list[str], stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    return run(argv, _parse_verify, cmd_verify, stdout, stderr)
