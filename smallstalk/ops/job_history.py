"""`smallstalk job-history`: the whole life of one job as a timeline, from the log.
Read-only, safe beside a running server (storage/history.py reads)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import IO

import attrs

from smallstalk.core import records
from smallstalk.core import records as r
from smallstalk.core.model import STATE_NAMES
from smallstalk.core.state import RESERVED
from smallstalk.ops.command import EXIT_OK, ToolError, parser, run, seq_arg
from smallstalk.ops.text import (
    DUR_WIDTH,
    Clock,
    Out,
    expiry,
    fmt_dur,
    jsonl,
    plural,
    preview,
    table,
)
from smallstalk.storage import history
from smallstalk.storage.history import HistoryFolded


def _parse_job_history(argv: list[str]) -> argparse.Namespace:
    p = parser("job-history", "The whole life of one job as a timeline: its put (or fanout "
               "copy), each reservation (by which connection, held how long, and how it ended: "
               "release, bury, delete, TTR timeout, disconnect, server restart), kicks and "
               "delays, expiry (deleted, or moved to a dead-letter tube where its life goes "
               "on) or being discarded from a full tube, with the time between steps.")
    p.add_argument("job", type=seq_arg, metavar="ID")
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
    key: str | None = None  # the idempotency key it was put with (put-unique)
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
        elif t is r.PutJobs or t is r.PutUnique:
            self._put_jobs(rec)
        elif t is r.Requeue:
            for i, until, to, reason in rec.outcomes:
                if i == jid:
                    self._requeue(rec, until, to, reason)
        elif t is r.Fire:
            if rec.id == jid and jid:
                self.ttr = max(rec.ttr, 1)
                self.tube = rec.tube
                self.h.tube, self.h.put_seq, self.h.complete, self.h.alive = (
                    rec.tube, rec.seq, True, True)
                self.step(rec, "put", "delayed" if rec.delay else "ready",
                          f"put by schedule {rec.schedule} (its firing due at "
                          f"{Clock(utc=True).fmt(rec.at)}) into {rec.tube}: pri {rec.pri}, "
                          f"ttr {rec.ttr}s, body {preview(rec.body)}")
        elif t is r.Expire:
            for i, to, expires in rec.moves:
                if i == jid:
                    self._expire(rec, to, expires)
        elif t is r.Move:
            if rec.id == jid:
                was = f" from {self.tube}" if self.tube else ""
                self.tube = self.h.tube = rec.tube
                self.step(rec, "move", self.state or "?",
                          f"moved by conn {rec.conn}{was} to {rec.tube} (move-job or bulk-jobs)",
                          rec.conn)
        elif t is r.FlushTube:
            if jid in rec.ids:
                others = len(rec.ids) - 1
                with_others = f" (with {plural(others, 'other job')})" if others else ""
                self.step(rec, "flush", "deleted",
                          f"deleted by conn {rec.conn}'s flush-tube or bulk-jobs delete in "
                          f"{rec.tube}{with_others}",
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

    def _put_jobs(self, rec: r.PutJobs | r.PutUnique) -> None:
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
        expires = f", expires {expiry(rec.expires, rec.time)}" if rec.expires else ""
        if type(rec) is r.PutUnique and not n:
            self.h.key = rec.key
            made += f" with key {rec.key}"
        dropped = (f"; discarded {plural(len(rec.dropped), 'job')} "
                   f"({', '.join(map(str, rec.dropped))}) to make room" if rec.dropped else "")
        self.ttr = max(rec.ttr, 1)
        self.tube = tube
        self.h.tube, self.h.put_seq, self.h.complete, self.h.alive = tube, rec.seq, True, True
        self.step(rec, "put", "delayed" if rec.delay else "ready",
                  f"put by conn {rec.conn}{made}: pri {rec.pri}, delay {rec.delay}s, "
                  f"ttr {rec.ttr}s{expires}, body {preview(rec.body)}{dropped}", rec.conn)

    def _requeue(self, rec: r.Requeue, until: int, to: str, reason: str) -> None:
        """A reservation that ended as the tube's policy decided (Requeue)."""
        holder = self.holder
        if rec.cause == r.REQUEUE_TIMEOUT:
            event, how = "timeout", "timed out"
            ttr = f" ({self.ttr}s)" if self.ttr else ""
            what = f"TTR{ttr} ran out" + (f": conn {holder} lost it" if holder is not None else "")
        elif rec.cause == r.REQUEUE_RELEASE:
            event, how = "release", "released"
            what = f"released by conn {rec.conn}: pri {rec.pri}"
        else:
            event, how = "disconnect", "ended by disconnect"
            what = f"conn {rec.conn} disconnected while holding it"
        held = self.end_reservation(rec, how)
        if reason and to:
            self.h.moved_to.append(to)
            self.tube = to
            self.step(rec, event, "ready", f"{what}; {reason}: moved to {to}", holder, held)
        elif reason:
            self.step(rec, event, "buried", f"{what}; {reason}: buried", holder, held)
        elif until:
            self.step(rec, event, "delayed",
                      f"{what}; backing off until {expiry(until, rec.time)}", holder, held)
        else:
            self.step(rec, event, "ready", what, holder, held)

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
                  f"expired{where}{was}: moved to {to}, expires {expiry(expires, rec.time)}")

    def from_snapshot(self, item: list, snap: history.SnapshotFile, meta_time: int,
                      clock: Clock) -> None:
        (_, _jid, tube, pri, delay, ttr, body, st, created, _deadline, reserver, reserves,
         timeouts, releases, buries, kicks, *rest) = item
        expires = rest[0] if rest else 0  # format 2 on
        name = STATE_NAMES[st]
        self.h.tube, self.h.alive, self.ttr, self.tube = tube, True, ttr, tube
        self.state, self.since = name, meta_time  # time in states counts from the snapshot
        holder = ""
        if st == RESERVED:
            self.holder, self.reserved_at = reserver, None
            holder = f" by conn {reserver}"
        text = (f"in snapshot {snap.path.name}: {name}{holder}; put at {clock.fmt(created)} into "
                f"{tube}, pri {pri}, delay {delay}s, ttr {ttr}s"
                f"{f', expires {expiry(expires, meta_time)}' if expires else ''}, "
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
            "alive": h.alive, "put_seq": h.put_seq, "key": h.key, "time_in_ns": h.time_in,
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
    for name in STATE_NAMES:
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


def main(argv: list[str], stdout: IO[str] | None = None,
                     stderr: IO[str] | None = None) -> int:
    return run(argv, _parse_job_history, cmd_job_history, stdout, stderr)
