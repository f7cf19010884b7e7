"""Operator tools over a data directory: `smallstalk aof ls|dump|verify`, `replay`, `job-history`.

The AOF is the broker's flight recorder; these commands read it. They never
write into the data directory, so they are safe on the directory of a live
server: they read the closed segments and the readable prefix of the open one
(see smallstalk.history, which does the reading, a chunk at a time).

Output is for people first: aligned tables, human times and sizes, times in
local time (`--utc` for UTC). `--format jsonl` gives every field, one JSON
object per line, for other tools. On a terminal, long reads show progress on
stderr.

Exit codes: 0 done; 1 damage, a missing job, or another error; 2 bad usage;
3 the history needed was folded away into a snapshot by the compactor.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import attrs

from smallstalk.core import records
from smallstalk.core import records as r
from smallstalk.core.state import BURIED, DELAYED, READY, RESERVED, State, StateError
from smallstalk.storage import aof, history, snapshot
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.history import HistoryFolded
from smallstalk.storage.recovery import apply_next

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_FOLDED = 0, 1, 2, 3
NS = 1_000_000_000
STATES = ("ready", "delayed", "reserved", "buried")
DUR_WIDTH = 7  # durations are at most this wide below 100 days: columns stay put
PREVIEW = 24  # body bytes shown in a preview


class ToolError(Exception):
    """A plain failure to report (not damage, not folded history)."""


class UsageError(Exception):
    pass


# --- formatting ----------------------------------------------------------------------


@attrs.define
class Clock:
    """How times are shown: local time with its offset, or UTC with `Z`."""

    utc: bool = False
    # The last second formatted (records come dense in time): (secs, text, zone).
    _last: tuple[int, str, str] = attrs.field(default=(-1, "", ""), eq=False, repr=False)

    def fmt(self, ns: int | None) -> str:
        if ns is None:
            return "-"
        secs, rest = divmod(ns, NS)
        last_secs, text, zone = self._last
        if secs != last_secs:
            if self.utc:
                dt = datetime.fromtimestamp(secs, UTC)
                zone = "Z"
            else:
                dt = datetime.fromtimestamp(secs).astimezone()
                off = dt.strftime("%z")
                zone = f"{off[:3]}:{off[3:]}"
            text = f"{dt:%Y-%m-%d %H:%M:%S}"
            self._last = (secs, text, zone)
        return f"{text}.{rest // 1_000_000:03d}{zone}"

    @property
    def width(self) -> int:
        return 24 if self.utc else 29

    @property
    def label(self) -> str:
        if self.utc:
            return "times in UTC"
        return f"times in local time (UTC{datetime.now().astimezone().strftime('%z')})"

    def parse(self, text: str) -> int:
        """An ISO date/time to ns since the epoch; without a zone it is local (UTC with --utc)."""
        try:
            dt = datetime.fromisoformat(text.strip())
        except ValueError:
            raise UsageError(f"not an ISO date/time: {text!r} (e.g. 2025-06-01T14:02:00)") from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC) if self.utc else dt.astimezone()
        delta = dt - datetime(1970, 1, 1, tzinfo=UTC)
        return (delta.days * 86400 + delta.seconds) * NS + delta.microseconds * 1000


def fmt_dur(ns: int | None) -> str:
    """A duration in at most 7 characters: 0s, <1ms, 850ms, 1.25s, 12.3s, 3m05s, 2h07m, 3d04h."""
    if ns is None:
        return "?"
    if ns < 0:
        return "-" + fmt_dur(-ns)
    if ns == 0:
        return "0s"
    if ns < 1_000_000:
        return "<1ms"
    if ns < NS:
        return f"{ns // 1_000_000}ms"
    if ns < 10 * NS:
        return f"{ns // 10_000_000 / 100:.2f}s"
    if ns < 60 * NS:
        return f"{ns // 100_000_000 / 10:.1f}s"
    s = ns // NS
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError  # not reached


def escape(data: bytes) -> str:
    """Bytes as printable ASCII: `\\"`, `\\\\`, `\\r`, `\\n`, `\\t`, else `\\xNN`."""
    if data.isascii():
        text = data.decode("ascii")
        if text.isprintable() and '"' not in text and "\\" not in text:
            return text  # the common case, fast
    out = []
    for b in data:
        if b == 0x22 or b == 0x5C:
            out.append("\\" + chr(b))
        elif 0x20 <= b < 0x7F:
            out.append(chr(b))
        elif b == 0x0A:
            out.append("\\n")
        elif b == 0x0D:
            out.append("\\r")
        elif b == 0x09:
            out.append("\\t")
        else:
            out.append(f"\\x{b:02x}")
    return "".join(out)


def preview(body: bytes) -> str:
    """`7 B "email-1"`: the length and the first bytes, escaped."""
    more = "..." if len(body) > PREVIEW else ""
    return f'{fmt_size(len(body))} "{escape(body[:PREVIEW])}{more}"'


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


def table(headers: list[str], rows: Iterable[list[str]], right: str = "",
          min_widths: dict[int, int] | None = None, indent: str = "") -> list[str]:
    """Rows aligned under headers; `right` has 'r' at the index of right-aligned columns."""
    rows = [list(map(str, row)) for row in rows]
    widths = [len(h) for h in headers]
    for i, w in (min_widths or {}).items():
        widths[i] = max(widths[i], w)
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    out = []
    for row in [headers, *rows]:
        cells = []
        for i, cell in enumerate(row):
            if i < len(right) and right[i] == "r":
                cells.append(cell.rjust(widths[i]))
            else:
                cells.append(cell.ljust(widths[i]))
        out.append((indent + "  ".join(cells)).rstrip())
    return out


class ProgressLine:
    """Progress on stderr, only when it is a terminal; at most five updates a second."""

    def __init__(self, label: str, stream: IO[str] | None = None, enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self.label = label
        self.started = time.monotonic()
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < 0.2:
            return
        self.last = now
        pct = f"{done * 100 // total}%" if total else "-"
        rate = done / max(now - self.started, 1e-9)
        self.stream.write(f"\r{self.label}: {fmt_size(done)} of {fmt_size(total)} ({pct}), "
                          f"{fmt_size(int(rate))}/s\x1b[K")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Out:
    """Where a command writes: stdout for results, stderr for notes and warnings."""

    def __init__(self, data_dir: Path, stdout: IO[str] | None = None, stderr: IO[str] | None = None):
        self.data_dir = data_dir
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr
        self.progress: ProgressLine | None = None

    def line(self, text: str = "") -> None:
        self.stdout.write(text + "\n")

    def rel(self, text: object) -> str:
        """Paths inside the data directory, shown relative to it."""
        return str(text).replace(f"{self.data_dir}{os.sep}", "")

    def note(self, text: str) -> None:
        self._err(f"note: {self.rel(text)}")

    def warn(self, text: str) -> None:
        self._err(f"warning: {self.rel(text)}")

    def _err(self, text: str) -> None:
        if self.progress is not None:
            self.progress.clear()
        self.stderr.write(text + "\n")
        self.stderr.flush()

    def start_progress(self, label: str) -> ProgressLine:
        self.progress = ProgressLine(label, self.stderr)
        return self.progress

    def end_progress(self) -> None:
        if self.progress is not None:
            self.progress.clear()
            self.progress = None


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON: {value!r}")


_ENCODER = json.JSONEncoder(default=_json_default, separators=(",", ":"))


def jsonl(obj: dict) -> str:
    return _ENCODER.encode(obj)


# --- running a command -------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def _parser(prog: str, description: str) -> _Parser:
    p = _Parser(prog=f"smallstalk {prog}", description=description,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_dir", metavar="DATA_DIR", type=Path, help="the server's --data-dir")
    p.add_argument("--utc", action="store_true", help="show (and read) times in UTC")
    return p


def _seq(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a sequence number: {text}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def _run(argv: list[str], parse: Callable[[list[str]], argparse.Namespace],
         body: Callable[[argparse.Namespace, Out], int],
         stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    err = stderr if stderr is not None else sys.stderr
    try:
        args = parse(argv)
    except UsageError as e:
        err.write(f"{e}\n")
        return EXIT_USAGE
    except SystemExit as e:  # --help
        return int(e.code or 0)
    data_dir = args.data_dir
    out = Out(data_dir, stdout, stderr)
    if not data_dir.is_dir():
        err.write(f"smallstalk: {data_dir}: no such directory\n")
        return EXIT_ERROR
    try:
        return body(args, out)
    except UsageError as e:
        out.end_progress()
        err.write(f"smallstalk: {e}\n")
        return EXIT_USAGE
    except HistoryFolded as e:
        out.end_progress()
        err.write(f"smallstalk: {out.rel(e)}\n")
        return EXIT_FOLDED
    except CorruptionError as e:
        out.end_progress()
        err.write(f"smallstalk: damage: {out.rel(e)}\n")
        return EXIT_ERROR
    except BrokenPipeError:
        # Output piped into `head` and friends: stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (ToolError, OSError) as e:
        out.end_progress()
        err.write(f"smallstalk: {out.rel(e)}\n")
        return EXIT_ERROR
    finally:
        out.end_progress()


# --- aof ls ---------------------------------------------------------------------------------


AOF_HELP = """\
usage: smallstalk aof {ls,dump,verify} DATA_DIR [OPTIONS]

Inspect the append-only log of a data directory (read-only; safe while the
server runs):
  ls       snapshots and segments: sequence and time ranges, record counts, sizes
  dump     the records, one per line (--format text or jsonl), with filters
  verify   check checksums, sequence continuity and replay; exit 1 on damage

`smallstalk aof COMMAND -h` explains a command.
"""


def main_aof(argv: list[str], stdout: IO[str] | None = None,
             stderr: IO[str] | None = None) -> int:
    commands = {"ls": (_parse_ls, cmd_ls), "dump": (_parse_dump, cmd_dump),
                "verify": (_parse_verify, cmd_verify)}
    if not argv or argv[0] in ("-h", "--help", "help"):
        (stdout or sys.stdout).write(AOF_HELP)
        return EXIT_OK if argv else EXIT_USAGE
    if argv[0] not in commands:
        (stderr or sys.stderr).write(f"smallstalk aof: unknown command {argv[0]!r}\n\n{AOF_HELP}")
        return EXIT_USAGE
    parse, body = commands[argv[0]]
    return _run(argv[1:], parse, body, stdout, stderr)


def _parse_ls(argv: list[str]) -> argparse.Namespace:
    p = _parser("aof ls", "Snapshots and segments of DATA_DIR with their sequence and time "
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
    reader = history.SegmentReader(path, file, last=last)
    s = SegmentSummary(path, first, size, last=last)
    try:
        for n, (offset, _rec) in enumerate(reader, 1):
            if progress is not None and n & 0xFFF == 0:
                progress(offset)
    except CorruptionError as e:
        s.status, s.why, s.end = "damaged", f"{e.why} at offset {e.offset}", e.offset
    s.header_seq = reader.header_seq
    s.records, s.first_seq, s.last_seq = reader.records, reader.first_seq, reader.last_seq
    s.first_time, s.last_time = reader.first_time, reader.last_time
    if s.status == "ok":
        s.end = reader.end
        if not reader.clean:
            torn = last and reader.tail_is_torn()
            s.status = "torn" if torn else "damaged"
            s.why = f"{reader.why} at offset {reader.end}"
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


# --- aof dump ---------------------------------------------------------------------------------


def _parse_dump(argv: list[str]) -> argparse.Namespace:
    p = _parser("aof dump", "The records of DATA_DIR, one per line, oldest first.\n\n"
                "Filters combine (all must match). --job matches every record naming the job, "
                "also kick, promote and timeout records that list it among others.")
    p.add_argument("--from-seq", type=_seq, metavar="N", help="start at this sequence number")
    p.add_argument("--to-seq", type=_seq, metavar="N", help="stop after this sequence number")
    p.add_argument("--since", metavar="TIME", help="records at or after this ISO time")
    p.add_argument("--until", metavar="TIME", help="records at or before this ISO time")
    p.add_argument("--tube", action="append", metavar="NAME",
                   help="records about this tube or its jobs (repeatable)")
    p.add_argument("--job", action="append", type=_seq, metavar="ID",
                   help="records about this job (repeatable)")
    p.add_argument("--op", action="append", metavar="OP",
                   help="only these record types, e.g. put,reserve (repeatable)")
    p.add_argument("--conn", action="append", type=_seq, metavar="ID",
                   help="records of this connection (repeatable)")
    p.add_argument("--format", choices=("text", "jsonl"), default="text",
                   help="text: aligned, body as a short preview; jsonl: every field, body base64")
    args = p.parse_args(argv)
    ops: set[str] = set()
    for spec in args.op or []:
        ops.update(o.strip() for o in spec.split(",") if o.strip())
    unknown = ops - set(records.OP_NAMES.values())
    if unknown:
        raise UsageError(f"smallstalk aof dump: unknown --op {', '.join(sorted(unknown))} (known: "
                         f"{', '.join(records.OP_NAMES.values())})")
    args.ops = ops
    return args


def job_ids(rec: records.Record) -> tuple[int, ...]:
    """The jobs a record names (a put-jobs: the jobs it makes, then those it discards)."""
    jid = getattr(rec, "id", None)
    if jid is not None:
        return (jid,)
    t = type(rec)
    if t is r.PutJobs:
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
    if t is r.PutJobs:
        jobs = ", ".join(f"{i} {tube}" for i, tube in rec.jobs) or "none"
        dropped = f"  dropped {','.join(map(str, rec.dropped))}" if rec.dropped else ""
        return (f"jobs {jobs}  pri {rec.pri}  delay {rec.delay}s  ttr {rec.ttr}s  "
                f"expires {_expiry(rec.expires, rec.time)}{dropped}  body {preview(rec.body)}")
    if t is r.Expire:
        return "  ".join(f"{i} " + (f"moved to {to}, expires {_expiry(expires, rec.time)}"
                                    if to else "deleted") for i, to, expires in rec.moves)
    if t is r.DeleteTube:
        return f"tube {rec.tube}  (no more fanout copies)"
    # Any other record: its own fields (those not in the columns), by name.
    return "  ".join(f"{name} {getattr(rec, name)}" for name in records.FIELDS.get(t, ())
                     if name not in _IN_COLUMNS)


_IN_COLUMNS = {"seq", "time", "conn", "id", "ids"}


def _expiry(expires: int, now: int) -> str:
    """An expiry time (ns, 0 = never) as the time it leaves from `now`: `+1h00m`, `never`."""
    return "never" if not expires else "+" + fmt_dur(expires - now)


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
        if t is r.PutJobs:
            hit = any([self.tubes.pop(jid, None) in wanted for jid in rec.dropped])
            for jid, tube in rec.jobs:
                self.tubes[jid] = tube
                hit = hit or tube in wanted
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


# --- replaying -----------------------------------------------------------------------------------

PRUNE_EVERY = 1 << 16  # records applied between two prunings of the state's heaps


# --- aof verify --------------------------------------------------------------------------------


def _parse_verify(argv: list[str]) -> argparse.Namespace:
    p = _parser("aof verify", "Check every frame's checksum, sequence continuity across the "
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
        if first > newest.seq + 1:
            rep.problems.append(
                f"records {newest.seq + 1}..{first - 1} are missing: the snapshot ends at seq "
                f"{newest.seq} and the log starts at seq {first}")
        else:
            state = _try_load(newest, newest_file, rep, newest_row)
            base = f"snapshot {newest.path.name}"
    elif newest is None:
        rep.problems.append(f"records 1..{first - 1} are missing: the log starts at seq {first} "
                            f"and there is no snapshot")
    replaying = state is not None
    stopped = ""  # why replay stopped early
    applied = 0
    agreed = False
    expected: int | None = None
    total = sum(seg.size for seg in lay.segments)
    done = 0
    last_seq: int | None = None
    first_seq: int | None = None
    for i, (seg, f) in enumerate(zip(lay.segments, files, strict=True)):
        is_last = i == len(lay.segments) - 1
        reader = history.SegmentReader(seg.path, f, last=is_last)
        status, detail = "ok", ""
        try:
            for n, (offset, rec) in enumerate(reader, 1):
                if progress is not None and n & 0xFFF == 0:
                    progress(done + offset, total)
                if first_seq is None:
                    first_seq = rec.seq
                if expected is not None and rec.seq != expected:
                    rep.problems.append(f"{seg.path}: sequence gap at offset {offset}: expected "
                                        f"seq {expected}, found {rec.seq}")
                    status = "DAMAGED"
                    if replaying:
                        replaying, stopped = False, f"the sequence gap after seq {expected - 1}"
                expected = rec.seq + 1
                last_seq = rec.seq
                if not replaying:
                    continue
                if rec.seq <= state.last_seq:
                    continue  # in the snapshot already
                if rec.seq != state.last_seq + 1:
                    rep.problems.append(f"{seg.path}: sequence gap at offset {offset}: expected "
                                        f"seq {state.last_seq + 1}, found {rec.seq}")
                    status = "DAMAGED"
                    replaying, stopped = False, f"the sequence gap after seq {state.last_seq}"
                    continue
                try:
                    state.apply(rec)
                except Exception as e:  # StateError, or a record with fields of the wrong type
                    rep.problems.append(f"{seg.path}: record seq {rec.seq} at offset {offset} "
                                        f"does not apply: {e}")
                    status = "DAMAGED"
                    replaying, stopped = False, f"seq {rec.seq}, which does not apply"
                    continue
                applied += 1
                if compare_at is not None and rec.seq == compare_at:
                    items = history.iter_snapshot(newest.path, newest_file)
                    try:
                        diff = _mismatch(items, state.dump())
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
                    else:
                        agreed = True
        except CorruptionError as e:
            rep.problems.append(str(e))
            status, detail = "DAMAGED", f"{e.why} at offset {e.offset}"
            expected = None
            if replaying:
                replaying, stopped = False, f"the damage in {seg.path.name}"
        if status == "ok" and not reader.clean:
            if is_last and reader.tail_is_torn():
                rep.warnings.append(reader.torn_warning())
                status = "ok"
                detail = f"torn tail: {fmt_size(reader.size - reader.end)} after offset {reader.end}"
            else:
                rep.problems.append(str(reader.damage()))
                status, detail = "DAMAGED", f"{reader.why} at offset {reader.end}"
                expected = None
                if replaying:
                    replaying, stopped = False, f"the damage in {seg.path.name}"
        if reader.header_seq is not None and reader.header_seq != seg.first:
            rep.warnings.append(f"{seg.path}: its name says seq {seg.first}, its header "
                                f"{reader.header_seq}")
        span = (f"seqs {reader.first_seq}..{reader.last_seq}, {plural(reader.records, 'record')}"
                if reader.records else "no records")
        rep.rows.append(["segment", str(seg.path), status, "; ".join(filter(None, [span, detail]))])
        done += seg.size

    if compare_at is not None and replaying and state.last_seq < compare_at:
        # The log ends before the snapshot: start-up serves the snapshot.
        state = _try_load(newest, newest_file, rep, newest_row)
        base, applied = f"snapshot {newest.path.name}", 0
    if first_seq is not None:
        gaps = sum("sequence gap" in p for p in rep.problems)
        rep.rows.append(["log", "", "DAMAGED" if gaps else "ok",
                         f"seqs {first_seq}..{last_seq}, "
                         + (plural(gaps, "gap") if gaps else "no gaps")])
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


def _try_load(snap: history.SnapshotFile, file: IO[bytes] | None, rep: VerifyReport,
              row: list[str] | None) -> State | None:
    """The snapshot's state, or None with the damage reported."""
    try:
        return _load_snapshot(snap.path, file)
    except CorruptionError as e:
        rep.problems.append(f"{e} (start-up refuses to load it)")
        if row is not None:
            row[2], row[3] = "DAMAGED", f"{row[3]}; {e.why}"
        return None


def _load_snapshot(path: Path, file: IO[bytes] | None = None) -> State:
    try:
        return State.load(history.iter_snapshot(path, file))
    except (StateError, TypeError, ValueError, KeyError, IndexError) as e:
        raise CorruptionError(path, 0, None, f"snapshot items do not load: {e!r}") from None


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


# --- replay ----------------------------------------------------------------------------------


def _parse_replay(argv: list[str]) -> argparse.Namespace:
    p = _parser("replay", "Rebuild the state as it was after record N (--until-seq) or at a "
                "time (--until: every record up to that time) and show it: per tube the "
                "ready, delayed, reserved and buried counts and the jobs expired and "
                "discarded, the fanout tubes; with --jobs every job. "
                "--write-snapshot writes it as a snapshot file a server can start from.")
    point = p.add_mutually_exclusive_group(required=True)
    point.add_argument("--until-seq", type=_seq, metavar="N", help="the state after record N")
    point.add_argument("--until", metavar="TIME", help="the state at this ISO time")
    p.add_argument("--jobs", action="store_true", help="list the jobs too")
    p.add_argument("--tube", action="append", metavar="NAME", help="only these tubes")
    p.add_argument("--state", action="append", choices=STATES, help="only jobs in this state")
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
        state = _load_snapshot(chosen.path, od.snapshot_file(chosen))
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
    states = {STATES.index(s) for s in args.state or ()}
    if target is not None:
        path = write_snapshot(st, target)
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
                                "state": STATES[j.state], "pri": j.pri, "delay": j.delay,
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
             + ", ".join(f"{n} {name}" for n, name in zip(counts, STATES, strict=True))
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
            rows.append([j.id, j.tube.name, STATES[j.state], j.pri, fmt_dur(rb.now - j.created),
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
        return snapshot.write(target, state.last_seq, state.dump())
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smallstalk-replay-", dir=parent))
    try:
        written = snapshot.write(tmp, state.last_seq, state.dump())
        os.replace(written, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main_replay(argv: list[str], stdout: IO[str] | None = None,
                stderr: IO[str] | None = None) -> int:
    return _run(argv, _parse_replay, cmd_replay, stdout, stderr)


# --- job-history -------------------------------------------------------------------------------


def _parse_job_history(argv: list[str]) -> argparse.Namespace:
    p = _parser("job-history", "The whole life of one job as a timeline: its put (or fanout "
                "copy), each reservation (by which connection, held how long, and how it ended: "
                "release, bury, delete, TTR timeout, disconnect, server restart), kicks and "
                "delays, expiry (deleted, or moved to a dead-letter tube where its life goes "
                "on) or being discarded from a full tube, with the time between steps.")
    p.add_argument("job", type=_seq, metavar="ID")
    p.add_argument("--format", choices=("text", "jsonl"), default="text")
    return p.parse_args(argv)


@attrs.define
class Step:
    seq: int | None
    time: int | None
    event: str  # put, reserve, timeout, release, bury, kick, promote, touch, delete,
    #             disconnect, restart, expire, move, discard, snapshot, end
    state: str  # the job's state after the step (or "?" when not known)
    text: str
    conn: int | None = None
    held: int | None = None  # ns a reservation lasted, on steps that end one
    since_prev: int | None = None


@attrs.define
class JobHistory:
    job: int
    steps: list[Step] = attrs.Factory(list)
    tube: str | None = None  # the tube it was put into (or was in at the snapshot)
    moved_to: list[str] = attrs.Factory(list)  # dead-letter tubes an expiry moved it to
    put_seq: int | None = None
    complete: bool = False  # the put is in the log
    folded: HistoryFolded | None = None  # set when earlier history is gone
    alive: bool = False
    time_in: dict[str, int] = attrs.Factory(dict)
    reservations: list[str] = attrs.Factory(list)  # how each one ended
    counts: dict[str, int] = attrs.Factory(dict)
    log_end: tuple[int, int] | None = None  # (seq, time) of the last record read


class _JobTracker:
    def __init__(self, jid: int, hist: JobHistory):
        self.jid = jid
        self.h = hist
        self.state: str | None = None
        self.holder: int | None = None
        self.reserved_at: int | None = None
        self.since: int | None = None
        self.ttr: int | None = None
        self.tube: str | None = None  # where the job is now

    def step(self, rec: records.Record, event: str, state: str, text: str,
             conn: int | None = None, held: int | None = None) -> None:
        if self.state is not None and self.since is not None:
            self.h.time_in[self.state] = self.h.time_in.get(self.state, 0) + rec.time - self.since
        self.state, self.since = state, rec.time
        self.h.counts[event] = self.h.counts.get(event, 0) + 1
        self.h.steps.append(Step(rec.seq, rec.time, event, state, text, conn, held))

    def end_reservation(self, rec: records.Record, how: str) -> int | None:
        held = rec.time - self.reserved_at if self.reserved_at is not None else None
        self.h.reservations.append(how)
        self.holder = self.reserved_at = None
        return held

    def feed(self, rec: records.Record) -> None:
        t = type(rec)
        jid = self.jid
        if t is r.Put:
            if rec.id != jid:
                return
            self.ttr = max(rec.ttr, 1)
            self.tube = rec.tube
            self.h.tube, self.h.put_seq, self.h.complete, self.h.alive = rec.tube, rec.seq, True, True
            self.step(rec, "put", "delayed" if rec.delay else "ready",
                      f"put by conn {rec.conn} into {rec.tube}: pri {rec.pri}, delay {rec.delay}s, "
                      f"ttr {rec.ttr}s, body {preview(rec.body)}", rec.conn)
        elif t in (r.Reserve, r.Release, r.Bury, r.Touch, r.Delete):
            if rec.id != jid:
                return
            self.h.alive = True
            if t is r.Reserve:
                self.holder, self.reserved_at = rec.conn, rec.time
                self.step(rec, "reserve", "reserved", f"reserved by conn {rec.conn}", rec.conn)
            elif t is r.Release:
                held = self.end_reservation(rec, "released")
                self.step(rec, "release", "delayed" if rec.delay else "ready",
                          f"released by conn {rec.conn}: pri {rec.pri}, delay {rec.delay}s",
                          rec.conn, held)
            elif t is r.Bury:
                held = self.end_reservation(rec, "buried")
                self.step(rec, "bury", "buried", f"buried by conn {rec.conn}: pri {rec.pri}",
                          rec.conn, held)
            elif t is r.Touch:
                self.holder = rec.conn
                self.step(rec, "touch", "reserved",
                          f"touched by conn {rec.conn}: its TTR starts again", rec.conn)
            else:
                was = self.state
                held = self.end_reservation(rec, "deleted") if was == "reserved" else None
                what = f" (it was {was})" if was not in (None, "reserved") else ""
                self.step(rec, "delete", "deleted", f"deleted by conn {rec.conn}{what}",
                          rec.conn, held)
                self.h.alive = False
        elif t in (r.Kick, r.Promote, r.Timeout):
            if jid not in rec.ids:
                return
            self.h.alive = True
            others = len(rec.ids) - 1
            with_others = f" (with {plural(others, 'other job')})" if others else ""
            if t is r.Kick:
                was = f" out of {self.state}" if self.state in ("buried", "delayed") else ""
                self.step(rec, "kick", "ready", f"kicked{was} by conn {rec.conn}{with_others}",
                          rec.conn)
            elif t is r.Promote:
                self.step(rec, "promote", "ready", f"its delay ran out{with_others}")
            else:
                holder = self.holder
                held = self.end_reservation(rec, "timed out")
                ttr = f" ({self.ttr}s)" if self.ttr else ""
                who = f": conn {holder} lost it" if holder is not None else ""
                self.step(rec, "timeout", "ready", f"TTR{ttr} ran out{who}", holder, held)
        elif t is r.PutJobs:
            self._put_jobs(rec)
        elif t is r.Expire:
            for i, to, expires in rec.moves:
                if i == jid:
                    self._expire(rec, to, expires)
        elif t is r.FlushTube:
            if jid in rec.ids:
                others = len(rec.ids) - 1
                with_others = f" (with {plural(others, 'other job')})" if others else ""
                self.step(rec, "flush", "deleted",
                          f"deleted by conn {rec.conn}'s flush-tube {rec.tube}{with_others}",
                          rec.conn)
                self.h.alive = False
        elif t is r.Disconnect:
            if self.state == "reserved" and rec.conn == self.holder:
                held = self.end_reservation(rec, "ended by disconnect")
                self.step(rec, "disconnect", "ready",
                          f"conn {rec.conn} disconnected while holding it", rec.conn, held)
        elif t is r.Restart:
            if self.state == "reserved":
                holder = self.holder
                held = self.end_reservation(rec, "ended by a server restart")
                who = f"conn {holder}'s" if holder is not None else "the"
                self.step(rec, "restart", "ready",
                          f"server restarted: {who} reservation ended", holder, held)

    def _put_jobs(self, rec: r.PutJobs) -> None:
        jid = self.jid
        if jid in rec.dropped:
            made = ", ".join(f"{i} ({tube})" for i, tube in rec.jobs) or "none kept"
            self.step(rec, "discard", "discarded",
                      f"discarded to make room in full {self.tube or 'tube'} by conn {rec.conn}'s "
                      f"put (jobs {made})", rec.conn)
            self.h.alive = False
            return
        ids = [i for i, _tube in rec.jobs]
        if jid not in ids:
            return
        n = ids.index(jid)
        tube = rec.jobs[n][1]
        first_id, first_tube = rec.jobs[0]
        if n:
            made = f" into {tube}, a fanout copy of job {first_id} ({first_tube})"
        else:
            copies = ", ".join(f"{i} ({t})" for i, t in rec.jobs[1:])
            made = f" into {tube}" + (f" (fanout copies: {copies})" if copies else "")
        expires = f", expires {_expiry(rec.expires, rec.time)}" if rec.expires else ""
        dropped = (f"; discarded {plural(len(rec.dropped), 'job')} "
                   f"({', '.join(map(str, rec.dropped))}) to make room" if rec.dropped else "")
        self.ttr = max(rec.ttr, 1)
        self.tube = tube
        self.h.tube, self.h.put_seq, self.h.complete, self.h.alive = tube, rec.seq, True, True
        self.step(rec, "put", "delayed" if rec.delay else "ready",
                  f"put by conn {rec.conn}{made}: pri {rec.pri}, delay {rec.delay}s, "
                  f"ttr {rec.ttr}s{expires}, body {preview(rec.body)}{dropped}", rec.conn)

    def _expire(self, rec: r.Expire, to: str, expires: int) -> None:
        where = f" in {self.tube}" if self.tube else ""
        was = f" ({self.state})" if self.state in ("delayed",) else ""
        if not to:
            self.step(rec, "expire", "expired", f"expired{where}{was}: deleted")
            self.h.alive = False
            return
        self.h.alive = True
        self.h.moved_to.append(to)
        self.tube = to
        self.step(rec, "move", "ready",
                  f"expired{where}{was}: moved to {to}, expires {_expiry(expires, rec.time)}")

    def from_snapshot(self, item: list, snap: history.SnapshotFile, meta_time: int,
                      clock: Clock) -> None:
        (_, _jid, tube, pri, delay, ttr, body, st, created, _deadline, reserver, reserves,
         timeouts, releases, buries, kicks, *rest) = item
        expires = rest[0] if rest else 0  # format 2 on
        name = STATES[st]
        self.h.tube, self.h.alive, self.ttr, self.tube = tube, True, ttr, tube
        self.state, self.since = name, meta_time  # time in states counts from the snapshot
        holder = ""
        if st == RESERVED:
            self.holder, self.reserved_at = reserver, None
            holder = f" by conn {reserver}"
        text = (f"in snapshot {snap.path.name}: {name}{holder}; put at {clock.fmt(created)} into "
                f"{tube}, pri {pri}, delay {delay}s, ttr {ttr}s"
                f"{f', expires {_expiry(expires, meta_time)}' if expires else ''}, "
                f"body {preview(body)}; so far "
                f"{plural(reserves, 'reservation')}, {plural(timeouts, 'timeout')}, "
                f"{plural(releases, 'release')}, {plural(buries, 'bury', 'buries')}, "
                f"{plural(kicks, 'kick')}")
        self.h.steps.append(Step(snap.seq, meta_time, "snapshot", name, text,
                                 reserver if st == RESERVED else None))


def job_history(data_dir: Path, jid: int, warn: Callable[[str], None] | None = None,
                progress: Callable[[int, int], None] | None = None,
                clock: Clock | None = None) -> JobHistory:
    """Every step of job `jid` the log (and, for folded history, the snapshot) knows."""
    hist = JobHistory(jid)
    tracker = _JobTracker(jid, hist)
    with history.open_dir(data_dir) as od:
        return _job_history(od, hist, tracker, jid, warn, progress, clock or Clock())


def _job_history(od: history.OpenDir, hist: JobHistory, tracker: _JobTracker, jid: int,
                 warn: Callable[[str], None] | None,
                 progress: Callable[[int, int], None] | None, clock: Clock) -> JobHistory:
    lay = od.layout
    data_dir = lay.data_dir
    first = lay.first_kept
    snap_item: list | None = None
    snap: history.SnapshotFile | None = None
    meta_time = 0
    next_job_id = 1
    gone = lay.folded(1)
    if gone is not None:
        upto = first - 1 if first is not None else gone.snapshot_seq
        snap = lay.covering_snapshot(upto) if upto is not None else None
        if snap is not None:
            for item in history.iter_snapshot(snap.path, od.snapshot_file(snap)):
                if item[0] == "meta":
                    meta_time, next_job_id = item[2], item[3]
                elif item[0] == "job" and item[1] == jid:
                    snap_item = item
    pending = snap_item is not None
    last: tuple[int, int] | None = None
    for _path, _offset, rec in history.iter_records(data_dir, warn=warn, progress=progress,
                                                    opened=od):
        if pending and rec.seq > snap.seq:
            pending = False
            if not hist.steps:  # the log showed nothing of it before: the snapshot tells
                tracker.from_snapshot(snap_item, snap, meta_time, clock)
        tracker.feed(rec)
        last = (rec.seq, rec.time)
    if pending and not hist.steps:
        tracker.from_snapshot(snap_item, snap, meta_time, clock)
    if hist.tube is None and snap_item is not None:
        hist.tube = snap_item[2]
    if last is None and snap is not None:
        last = (snap.seq, meta_time)
    hist.log_end = last
    if not hist.complete and gone is not None:
        what = (f"job {jid}'s history before seq {first} is gone" if hist.steps
                else f"job {jid}")
        if hist.steps or jid < next_job_id:
            hist.folded = HistoryFolded(1, first, gone.snapshot, gone.snapshot_seq, what=what)
    if hist.alive and hist.steps and last is not None:
        prev = hist.steps[-1]
        held = None
        if tracker.state == "reserved" and tracker.reserved_at is not None:
            held = last[1] - tracker.reserved_at
        if tracker.state is not None and tracker.since is not None:
            hist.time_in[tracker.state] = hist.time_in.get(tracker.state, 0) + last[1] - tracker.since
        holder = f" by conn {tracker.holder}" if tracker.state == "reserved" else ""
        hist.steps.append(Step(None, last[1], "end", prev.state,
                               f"end of the log (seq {last[0]}): still {prev.state}{holder}",
                               tracker.holder if tracker.state == "reserved" else None, held))
        if tracker.state == "reserved":
            hist.reservations.append("still held")
    prev_time = None
    for s in hist.steps:
        if prev_time is not None and s.time is not None:
            s.since_prev = s.time - prev_time
        if s.time is not None:
            prev_time = s.time
    return hist


def cmd_job_history(args: argparse.Namespace, out: Out) -> int:
    clock = Clock(args.utc)
    prog = out.start_progress("reading the log")
    h = job_history(args.data_dir, args.job, out.warn, prog, clock)
    out.end_progress()
    if not h.steps:
        if h.folded is not None:
            raise HistoryFolded(h.folded.first_needed, h.folded.first_kept, h.folded.snapshot,
                                h.folded.snapshot_seq,
                                what=f"job {args.job} was put and deleted by seq "
                                     f"{h.folded.snapshot_seq}: its whole history is gone")
        end = f" (the log ends at seq {h.log_end[0]})" if h.log_end else ""
        raise ToolError(f"no job {args.job} in the log{end}")
    if h.folded is not None:
        out.note(str(h.folded))
    if args.format == "jsonl":
        for s in h.steps:
            out.line(jsonl({"kind": "step", "seq": s.seq, "time": s.time, "event": s.event,
                            "state": s.state, "conn": s.conn, "held_ns": s.held,
                            "since_prev_ns": s.since_prev, "text": s.text}))
        out.line(jsonl(_summary(h)))
        return EXIT_OK
    first, last = h.steps[0], h.steps[-1]
    if h.complete:
        began = f"put at seq {first.seq} by conn {first.conn}"
    else:
        began = "put before the log begins"
    if last.event == "delete":
        ended = f"deleted at seq {last.seq} by conn {last.conn}"
    elif last.event == "discard":
        ended = f"discarded at seq {last.seq} by conn {last.conn}'s put"
    elif last.event == "expire":
        ended = f"expired at seq {last.seq} (deleted)"
    else:
        ended = f"{last.state} at the end of the log"
    tubes = ", then ".join([h.tube or "?", *h.moved_to])
    out.line(f"job {h.job} (tube {tubes}): {began}; {ended}")
    out.line()
    rows = []
    for s in h.steps:
        rows.append(["" if s.seq is None else s.seq, clock.fmt(s.time),
                     "" if s.since_prev is None else "+" + fmt_dur(s.since_prev),
                     fmt_dur(s.held) if s.held is not None or _ends_reservation(s) else "",
                     s.state, s.text])
    for line in table(["seq", "time", "step", "held", "state", "event"], rows, "rlrrll",
                      {1: clock.width, 2: DUR_WIDTH + 1, 3: DUR_WIDTH}):
        out.line(line)
    out.line()
    for label, value, note in _summary_lines(h):
        out.line(f"{label:<14}{value:>{DUR_WIDTH}}  {note}".rstrip())
    return EXIT_OK


def _ends_reservation(s: Step) -> bool:
    """Steps that end (or, at the end of the log, stop watching) a reservation."""
    return (s.event in ("timeout", "release", "bury", "disconnect", "restart")
            or (s.event == "end" and s.state == "reserved"))


def _summary(h: JobHistory) -> dict:
    return {"kind": "summary", "job": h.job, "tube": h.tube, "moved_to": h.moved_to,
            "complete": h.complete,
            "alive": h.alive, "put_seq": h.put_seq, "time_in_ns": h.time_in,
            "reservations": h.reservations, "counts": h.counts,
            "log_end_seq": h.log_end[0] if h.log_end else None,
            "folded": str(h.folded) if h.folded else None}


_ENDS = {"delete": "delete", "expire": "expiry", "discard": "discard"}


def _summary_lines(h: JobHistory) -> list[tuple[str, str, str]]:
    out = []
    timed = [s for s in h.steps if s.time is not None]
    if len(timed) >= 2:
        span = timed[-1].time - timed[0].time
        end = _ENDS.get(h.steps[-1].event, "end of the log, still alive")
        if h.complete:
            out.append(("lifetime", fmt_dur(span), f"put to {end}"))
        else:
            first = "the snapshot" if timed[0].event == "snapshot" else "its first step shown"
            out.append((f"since seq {timed[0].seq}", fmt_dur(span), f"{first} to {end}"))
    for name in STATES:
        if name in h.time_in:
            note = ""
            if name == "reserved" and h.reservations:
                how: dict[str, int] = {}
                for end in h.reservations:
                    how[end] = how.get(end, 0) + 1
                note = (f"{plural(len(h.reservations), 'reservation')}: "
                        + ", ".join(f"{n} {end}" for end, n in how.items()))
            out.append((f"  {name}", fmt_dur(h.time_in[name]), note))
    return out


def main_job_history(argv: list[str], stdout: IO[str] | None = None,
                     stderr: IO[str] | None = None) -> int:
    return _run(argv, _parse_job_history, cmd_job_history, stdout, stderr)
