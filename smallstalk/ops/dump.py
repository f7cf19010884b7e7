"""`smallstalk aof dump`: the records of a data directory, one per line, with filters.
Read-only, safe beside a running server (storage/history.py reads)."""

from __future__ import annotations

import argparse
from typing import IO

from smallstalk.core import records
from smallstalk.core import records as r
from smallstalk.ops.command import EXIT_OK, UsageError, parser, run, seq_arg
from smallstalk.ops.text import Clock, Out, expiry, jsonl, preview
from smallstalk.storage import history


def _parse_dump(argv: list[str]) -> argparse.Namespace:
    p = parser("aof dump", "The records of DATA_DIR, one per line, oldest first.\n\n"
               "Filters combine (all must match). --job matches every record naming the job, "
               "also kick, promote and timeout records that list it among others.")
    p.add_argument("--from-seq", type=seq_arg, metavar="N", help="start at this sequence number")
    p.add_argument("--to-seq", type=seq_arg, metavar="N", help="stop after this sequence number")
    p.add_argument("--since", metavar="TIME", help="records at or after this ISO time")
    p.add_argument("--until", metavar="TIME", help="records at or before this ISO time")
    p.add_argument("--tube", action="append", metavar="NAME",
                   help="records about this tube or its jobs (repeatable)")
    p.add_argument("--job", action="append", type=seq_arg, metavar="ID",
                   help="records about this job (repeatable)")
    p.add_argument("--op", action="append", metavar="OP",
                   help="only these record types, e.g. put,reserve (repeatable)")
    p.add_argument("--conn", action="append", type=seq_arg, metavar="ID",
                   help="records of this connection (repeatable)")
    p.add_argument("--format", choices=("text", "jsonl"), default="text",
                   help="text: aligned, body as a short preview; jsonl: every field, body base64")
    args = p.parse_args(argv)
    ops: set[str] = set()
    for spec in args.op or []:
        ops.update(o.strip() for o in spec.split(",") if o.strip())
    unknown = ops - set(records.OP_NAMES.values())
    if unknown:
        raise UsageError(f"unknown --op {', '.join(sorted(unknown))} (known: "
                         f"{', '.join(records.OP_NAMES.values())})", "smallstalk aof dump")
    args.ops = ops
    return args


def job_ids(rec: records.Record) -> tuple[int, ...]:
    """The jobs a record names (a put-jobs: the jobs it makes, then those it discards)."""
    jid = getattr(rec, "id", None)
    if jid is not None:
        return (jid,) if jid else ()  # a Fire that made no job names none
    t = type(rec)
    if t is r.Requeue:
        return tuple(m[0] for m in rec.outcomes)
    if t is r.PutJobs or t is r.PutUnique:
        return (*(i for i, _tube in rec.jobs), *rec.dropped)
    if t is r.Expire:
        return tuple(i for i, _to, _expires in rec.moves)
    return getattr(rec, "ids", ())


OP_WIDTH = max(map(len, records.OP_NAMES.values()))


class DumpLine:
    """The text form of records: fixed columns, so a stream of them stays aligned."""

    def __init__(self, clock: Clock, seq_width: int):
        self.clock = clock
        self.w = max(seq_width, 5)

    def header(self) -> str:
        w = self.w
        return (f"{'seq':>{w}}  {'time':<{self.clock.width}}  {'op':<{OP_WIDTH}}  {'conn':>6}  "
                f"{'job':>{w}}  details")

    def __call__(self, rec: records.Record) -> str:
        op = records.OP_NAMES[type(rec)]
        conn = getattr(rec, "conn", None)
        ids = job_ids(rec)
        job = str(ids[0]) if len(ids) == 1 else ""
        line = (f"{rec.seq:>{self.w}}  {self.clock.fmt(rec.time)}  {op:<{OP_WIDTH}}  "
                f"{'' if conn is None else conn:>6}  {job:>{self.w}}  {details(rec)}")
        return line.rstrip()


def details(rec: records.Record) -> str:
    t = type(rec)
    if t is r.Put:
        return (f"tube {rec.tube}  pri {rec.pri}  delay {rec.delay}s  ttr {rec.ttr}s  "
                f"body {preview(rec.body)}")
    if t is r.Release:
        return f"pri {rec.pri}  delay {rec.delay}s"
    if t is r.Bury:
        return f"pri {rec.pri}"
    if t is r.PauseTube:
        return f"tube {rec.tube}  delay {rec.delay}s"
    if t in (r.Kick, r.Promote, r.Timeout) and len(rec.ids) != 1:
        return f"jobs {','.join(map(str, rec.ids))}"
    if t is r.Restart:
        return "server started: earlier connections are gone"
    if t is r.PutUnique:
        return (f"key {rec.key} in {rec.tube} (kept {rec.unique_for}s after, at most "
                f"{rec.keys_max})  " + details(r.PutJobs(*records.to_list(rec)[1:4],
                                                          *records.to_list(rec)[8:])))
    if t is r.PutJobs:
        jobs = ", ".join(f"{i} {tube}" for i, tube in rec.jobs) or "none"
        dropped = f"  dropped {','.join(map(str, rec.dropped))}" if rec.dropped else ""
        return (f"jobs {jobs}  pri {rec.pri}  delay {rec.delay}s  ttr {rec.ttr}s  "
                f"expires {expiry(rec.expires, rec.time)}{dropped}  body {preview(rec.body)}")
    if t is r.Expire:
        return "  ".join(f"{i} " + (f"moved to {to}, expires {expiry(expires, rec.time)}"
                                    if to else "deleted") for i, to, expires in rec.moves)
    if t is r.DeleteTube:
        return f"tube {rec.tube}  (no more fanout copies)"
    if t is r.Move:
        return f"moved to tube {rec.tube}"
    if t is r.Requeue:
        cause = ("timeout", "release", "disconnect")[rec.cause] if 0 <= rec.cause < 3 else "?"
        pri = f"  pri {rec.pri}" if rec.cause == r.REQUEUE_RELEASE else ""
        return f"{cause}{pri}  " + "  ".join(
            f"{i} " + (f"{why}: moved to {to}" if why and to else f"{why}: buried" if why
                       else f"delayed until {expiry(until, rec.time)}" if until else "ready")
            for i, until, to, why in rec.outcomes)
    if t is r.Limits:
        rate = f"{rec.rate} per {rec.period / 1e9:g}s" if rec.rate else "none"
        return f"tube {rec.tube}  max-reserved {rec.max_reserved or 'none'}  rate {rate}"
    if t is r.Fire:
        made = (f"tube {rec.tube}  pri {rec.pri}  ttr {rec.ttr}s  body {preview(rec.body)}"
                if rec.id else "skipped")
        return f"schedule {rec.schedule}  due {Clock(utc=True).fmt(rec.at)}  {made}"
    # Any other record: its own fields (those not in the columns), by name.
    return "  ".join(f"{name} {getattr(rec, name)}" for name in records.FIELDS.get(t, ())
                     if name not in _IN_COLUMNS)


_IN_COLUMNS = {"seq", "time", "conn", "id", "ids"}


def record_json(rec: records.Record, file: str | None = None, offset: int | None = None) -> dict:
    """Every field of a record by name (op first, as records.as_dict), and where it is."""
    cls = type(rec)
    d: dict[str, object] = {"op": records.OP_NAMES[cls]}
    for name in records.FIELDS[cls]:
        d[name] = getattr(rec, name)
    if file is not None:
        d["file"] = file
        d["offset"] = offset
    return d


class TubeOfJobs:
    """Which tube each live job is in, for `--tube`: seeded from a snapshot, kept by Put/Delete."""

    def __init__(self, od: history.OpenDir):
        self.tubes: dict[int, str] = {}
        lay = od.layout
        first = lay.first_kept
        if first is not None and first > 1:
            snap = lay.covering_snapshot(first - 1)
            if snap is not None:
                for item in history.iter_snapshot(snap.path, od.snapshot_file(snap)):
                    if item[0] == "job":
                        self.tubes[item[1]] = item[2]

    def matches(self, rec: records.Record, wanted: set[str]) -> bool:
        t = type(rec)
        if t is r.Put:
            self.tubes[rec.id] = rec.tube
            return rec.tube in wanted
        if t is r.PutJobs or t is r.PutUnique:
            hit = any([self.tubes.pop(jid, None) in wanted for jid in rec.dropped])
            for jid, tube in rec.jobs:
                self.tubes[jid] = tube
                hit = hit or tube in wanted
            return hit
        if t is r.Fire:
            if rec.id:
                self.tubes[rec.id] = rec.tube
            return rec.tube in wanted
        if t is r.Requeue:
            hit = False
            for jid, _until, to, _why in rec.outcomes:
                hit = hit or self.tubes.get(jid) in wanted or to in wanted
                if to:
                    self.tubes[jid] = to
            return hit
        if t is r.Move:
            hit = self.tubes.get(rec.id) in wanted or rec.tube in wanted
            self.tubes[rec.id] = rec.tube
            return hit
        if t is r.Expire:
            hit = False
            for jid, to, _expires in rec.moves:
                hit = hit or self.tubes.get(jid) in wanted or to in wanted
                if to:
                    self.tubes[jid] = to
                else:
                    self.tubes.pop(jid, None)
            return hit
        tube = getattr(rec, "tube", None)
        if tube is not None:
            return tube in wanted
        ids = job_ids(rec)
        hit = any(self.tubes.get(jid) in wanted for jid in ids)
        if t is r.Delete:
            self.tubes.pop(rec.id, None)
        return hit


def cmd_dump(args: argparse.Namespace, out: Out) -> int:
    with history.open_dir(args.data_dir) as od:
        return _dump(args, out, od)


def _dump(args: argparse.Namespace, out: Out, opened: history.OpenDir) -> int:
    clock = Clock(args.utc)
    since = clock.parse(args.since) if args.since else None
    until = clock.parse(args.until) if args.until else None
    lay = opened.layout
    from_seq = args.from_seq
    first = lay.first_kept
    gone = lay.folded(from_seq or 1)
    if gone is not None:
        # Say plainly what is missing, then show what the log still holds.
        out.note(f"{gone} Showing the records the log holds.")
        if from_seq is not None:
            from_seq = first
    wanted_ops = {cls for cls, name in records.OP_NAMES.items() if name in args.ops}
    jobs = set(args.job or ())
    conns = set(args.conn or ())
    tubes = set(args.tube or ())
    tube_of = TubeOfJobs(opened) if tubes else None
    text = args.format == "text"
    last = lay.segments[-1] if lay.segments else None
    # Job ids and seqs are at most the last seq: a cheap bound for the column width.
    bound = (last.first + last.size // 12) if last else 1
    fmt = DumpLine(clock, len(str(bound)))
    write = out.stdout.write
    if text:
        out.line(fmt.header())
    prog = out.start_progress("dumping")
    # --tube needs every put to know the tube of later records: read from the start then.
    read_from = None if tube_of is not None else from_seq
    last_path, last_file = None, ""
    for path, offset, rec in history.iter_records(args.data_dir, from_seq=read_from,
                                                  warn=out.warn, progress=prog, opened=opened):
        if args.to_seq is not None and rec.seq > args.to_seq:
            break
        if tube_of is not None and not tube_of.matches(rec, tubes):
            continue
        if from_seq is not None and rec.seq < from_seq:
            continue
        if wanted_ops and type(rec) not in wanted_ops:
            continue
        if jobs and not jobs.intersection(job_ids(rec)):
            continue
        if conns and getattr(rec, "conn", None) not in conns:
            continue
        if (since is not None and rec.time < since) or (until is not None and rec.time > until):
            continue
        if text:
            write(fmt(rec) + "\n")
        else:
            if path is not last_path:
                last_path, last_file = path, out.rel(path)
            write(jsonl(record_json(rec, last_file, offset)) + "\n")
    out.end_progress()
    return EXIT_OK


def main(argv: list[str], stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    return run(argv, _parse_dump, cmd_dump, stdout, stderr)
