"""`smallstalk aof ls`: a data directory's snapshots and segments, with their sequence and
time ranges, record counts and sizes. Read-only (storage/history.py lists and opens the
files, storage/logread.py reads the segments)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import IO

import attrs

from smallstalk.ops.command import EXIT_OK, parser, run
from smallstalk.ops.text import Clock, Out, fmt_size, jsonl, plural, table
from smallstalk.storage import history, logread
from smallstalk.storage.aof import CorruptionError


def _parse_ls(argv: list[str]) -> argparse.Namespace:
    p = parser("aof ls", "Snapshots and segments of DATA_DIR with their sequence and time "
               "ranges, record counts and sizes.")
    p.add_argument("--format", choices=("text", "jsonl"), default="text")
    return p.parse_args(argv)


@attrs.define
class SegmentSummary:
    path: Path
    first: int
    size: int
    header_seq: int | None = None
    records: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    first_time: int | None = None
    last_time: int | None = None
    end: int = 0
    status: str = "ok"  # ok | torn | damaged
    why: str | None = None
    last: bool = False


def summarize_segment(path: Path, first: int, size: int, last: bool,
                      progress: Callable[[int], None] | None = None,
                      file: IO[bytes] | None = None) -> SegmentSummary:
    """One segment as the log's reader finds it on its own (its seqs are not
    checked against its neighbours'); `last`: it may end torn."""
    reader = logread.LogReader([path], None, keep_going=True, files=[file],
                               torn_tail=last, stream=True, settle=history.TAIL_SETTLE)
    for _path, _data, offsets, _recs in reader.batches():
        if progress is not None:
            progress(offsets[-1])
    (read,) = reader.read
    s = SegmentSummary(path, first, size, last=last, header_seq=read.header_seq,
                       records=read.records, first_seq=read.first_seq, last_seq=read.last_seq,
                       first_time=read.first_time, last_time=read.last_time, end=read.end)
    if read.problems:
        e = read.problems[0]
        s.status, s.why, s.end = "damaged", f"{e.why} at offset {e.offset}", e.offset
    elif read.torn is not None:
        s.status, s.why = "torn", f"{read.torn} at offset {read.end}"
    return s


@attrs.define
class SnapshotSummary:
    path: Path
    seq: int
    size: int
    time: int | None = None
    items: dict[str, int] = attrs.Factory(dict)
    status: str = "ok"
    why: str | None = None


def summarize_snapshot(path: Path, seq: int, size: int,
                       file: IO[bytes] | None = None) -> SnapshotSummary:
    s = SnapshotSummary(path, seq, size)
    try:
        for item in history.iter_snapshot(path, file):
            kind = str(item[0])
            s.items[kind] = s.items.get(kind, 0) + 1
            if kind == "meta":
                s.time = item[2]
    except CorruptionError as e:
        s.status, s.why = "damaged", f"{e.why} at offset {e.offset}"
    return s


def cmd_ls(args: argparse.Namespace, out: Out) -> int:
    clock = Clock(args.utc)
    with history.open_dir(args.data_dir) as od:
        lay = od.layout
        total = sum(seg.size for seg in lay.segments)
        prog = out.start_progress("reading segments")
        snaps = [summarize_snapshot(s.path, s.seq, s.size, f)
                 for s, f in zip(lay.snapshots, od.snapshots, strict=True)]
        segs = []
        done = 0
        for i, (seg, f) in enumerate(zip(lay.segments, od.segments, strict=True)):
            segs.append(summarize_segment(seg.path, seg.first, seg.size,
                                          i == len(lay.segments) - 1,
                                          lambda off, base=done: prog(base + off, total), f))
            done += seg.size
        out.end_progress()
    newest = lay.newest_snapshot
    if args.format == "jsonl":
        for s in snaps:
            out.line(jsonl({"kind": "snapshot", "file": out.rel(s.path), "seq": s.seq,
                            "time": s.time, "size": s.size, "items": s.items,
                            "status": s.status, "why": s.why}))
        for g in segs:
            out.line(jsonl({"kind": "segment", "file": out.rel(g.path), "first": g.first,
                            "header_seq": g.header_seq, "records": g.records,
                            "first_seq": g.first_seq, "last_seq": g.last_seq,
                            "first_time": g.first_time, "last_time": g.last_time,
                            "size": g.size, "end": g.end, "status": g.status, "why": g.why,
                            "last": g.last,
                            "covered": bool(newest and g.last_seq and g.last_seq <= newest.seq)}))
        for p in lay.others:
            out.line(jsonl({"kind": "other", "file": out.rel(p), "size": _size(p)}))
        return EXIT_OK

    out.line(f"data directory {args.data_dir} ({clock.label})")
    out.line()
    if snaps:
        out.line("snapshots")
        rows = []
        for s in snaps:
            note = s.status if s.status == "ok" else f"DAMAGED: {s.why}"
            if s is snaps[-1]:
                note += " (newest: start-up loads it)"
            rows.append([s.path.name, str(s.seq), clock.fmt(s.time), str(s.items.get("job", 0)),
                         str(s.items.get("tube", 0)), str(s.items.get("conn", 0)),
                         fmt_size(s.size), note])
        for line in table(["file", "seq", "time", "jobs", "tubes", "conns", "size", "status"],
                          rows, "lrlrrrr", {2: clock.width}, "  "):
            out.line(line)
    else:
        out.line("snapshots: none")
    out.line()
    if segs:
        out.line("segments")
        rows = []
        for g in segs:
            seqs = f"{g.first_seq}..{g.last_seq}" if g.records else "-"
            notes = []
            if g.header_seq is not None and g.header_seq != g.first:
                notes.append(f"header says seq {g.header_seq}")
            if g.status == "torn":
                notes.append(f"torn tail: {fmt_size(g.size - g.end)} after offset {g.end}")
            elif g.status == "ok" and g.size > g.end:
                notes.append(f"records end at {g.end}, then {fmt_size(g.size - g.end)} "
                             f"allocated ahead")
            elif g.status == "damaged":
                notes.append(f"DAMAGED: {g.why}")
            if not g.records and g.status == "ok":
                notes.append("no records yet")
            if newest and g.records and g.last_seq <= newest.seq:
                notes.append("covered by the snapshot")
            if g.last:
                notes.append("last (open while a server runs)")
            rows.append([g.path.name, seqs, str(g.records), clock.fmt(g.first_time),
                         clock.fmt(g.last_time), fmt_size(g.size), "; ".join(notes)])
        for line in table(["file", "seqs", "records", "first record", "last record", "size",
                           "note"], rows, "llrllr", {3: clock.width, 4: clock.width}, "  "):
            out.line(line)
    else:
        out.line("segments: none")
    if lay.others:
        out.line()
        out.line("other files (never read)")
        rows = []
        for p in lay.others:
            what = ("a torn tail start-up cut off, kept for you" if p.name.endswith(".broken")
                    else "an unfinished snapshot (being written, or left by a crash)")
            rows.append([out.rel(p), fmt_size(_size(p) or 0), what])
        for line in table(["file", "size", "what"], rows, "lr", indent="  "):
            out.line(line)
    out.line()
    n_records = sum(g.records for g in segs)
    kept = [g for g in segs if g.records]
    span = f", seqs {kept[0].first_seq}..{kept[-1].last_seq}" if kept else ""
    out.line(f"{plural(len(segs), 'segment')}: {plural(n_records, 'record')}{span}, "
             f"{fmt_size(total)}")
    if snaps:
        out.line(f"{plural(len(snaps), 'snapshot')}: newest at seq {snaps[-1].seq}, "
                 f"{fmt_size(sum(s.size for s in snaps))}")
    gone = lay.folded(1)
    if gone is not None and gone.snapshot is not None:
        first = lay.first_kept
        upto = first - 1 if first is not None else gone.snapshot_seq
        out.line(f"seqs 1..{upto} are no longer in the log: folded away by the compactor into "
                 f"{out.rel(gone.snapshot)} (only the state is kept)")
    elif gone is not None:
        out.line(f"DAMAGED: {out.rel(gone)}")
    return EXIT_OK


def _size(p: Path) -> int | None:
    try:
        return p.stat().st_size
    except OSError:
        return None


def main(argv: list[str], stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    return run(argv, _parse_ls, cmd_ls, stdout, stderr)
