"""Start-up recovery: newest snapshot + the segments after it = the state to serve.

Rules (snapshots/README.md, "Recovery"):
- the newest snapshot must read cleanly; damage there stops start-up;
- records at or below the snapshot's sequence number are skipped (a crash
  between writing a snapshot and deleting the segments it covers is harmless);
- sequence numbers follow on by one across all segments: a gap or an overlap
  (two processes that wrote one directory) is damage, never skipped;
- a frame that does not check out at the end of the *last* segment, with no
  valid frame after it, is a torn write: the tail is copied aside to
  `<segment>.broken`, cut off, and start-up goes on with a warning;
- any other damage raises CorruptionError naming file, offset and the last
  good sequence number, and nothing is written. `smallstalk aof verify`
  reports the same (`refusal` words start-up's one line).

The rules are logread.py's (`LogReader`, the one reader of the log, which
start-up reads each file whole with); what is start-up's own is applying the
records and the repair: cutting a torn tail (kept as `.broken`) and the
zeros allocated ahead.

With a body store (`bodies`, read-behind), bodies past the memory budgets
are not loaded: the snapshot's are referenced where they are in the snapshot
file, and replayed puts' where they are in their segment (bodies.py).
"""

from __future__ import annotations

import gc
import logging
import os
import struct
from pathlib import Path

import attrs

from smallstalk.core import records
from smallstalk.core.state import State, StateError
from smallstalk.storage import aof, datadir, snapshot
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.bodies import PUTS, BodyStore, spill_record
from smallstalk.storage.logread import LogReader, SegmentRead

log = logging.getLogger("smallstalk.storage.recovery")


@attrs.define
class Recovered:
    state: State
    segments: list[Path]  # segments holding records after the snapshot
    snapshot: Path | None
    records_replayed: int = 0
    warnings: list[str] = attrs.Factory(list)


def recover(data_dir: Path, repair: bool = True, until_seq: int | None = None,
            bodies: BodyStore | None = None) -> Recovered:
    """Rebuild the state from `data_dir`. With repair=False nothing is written.

    `bodies`: keep bodies past its budgets on disk; the state tells it which go
    (`state.on_body_dropped`).
    """
    # Loading allocates millions of objects and no garbage cycles: the cyclic
    # collector would run over and over for nothing (docs/PERFORMANCE.md, Restart).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _recover(data_dir, repair, until_seq, bodies)
    finally:
        if enabled:
            gc.enable()


def _recover(data_dir: Path, repair: bool, until_seq: int | None,
             bodies: BodyStore | None) -> Recovered:
    aof_dir, snap_dir = datadir.paths(data_dir)
    snaps = datadir.list_snapshots(snap_dir)
    if snaps:
        snap_path = snaps[-1][1]
        state = snapshot.load(snap_path, bodies)
    else:
        snap_path = None
        state = State()
    state.on_body_dropped = bodies.drop if bodies is not None else None
    spill = bodies if bodies is not None and bodies.active else None
    keys: dict = {}
    result = Recovered(state, [], snap_path)
    floor = state.last_seq
    log_reader = LogReader([path for _first, path in datadir.list_segments(aof_dir)], floor,
                           put_lists=True, after=floor, until_seq=until_seq)
    apply_put = state.apply_put
    replayed = 0
    for path, data, offsets, recs in log_reader.batches():
        # LogReader has checked the seqs and left out the snapshot's: apply the rest.
        for offset, rec in zip(offsets, recs, strict=True):
            if type(rec) is list:
                # A format-1 Put, the bulk of a log (see records.is_put_list):
                # apply_next's rules, applied from the fields.
                _, seq, time, conn, jid, tube, pri, delay, ttr, body = rec
                try:
                    apply_put(seq, time, conn, jid, tube, pri, delay, ttr, body)
                except StateError as e:
                    raise CorruptionError(path, offset, state.last_seq,
                                          f"record does not apply: {e}") from None
                if spill is not None:
                    rec = records.from_list(rec)
                    spill_record(spill, state, rec, path, body_offset(data, offset, rec), keys)
                continue
            apply_next(state, path, offset, rec)
            if spill is not None and type(rec) in PUTS:
                spill_record(spill, state, rec, path, body_offset(data, offset, rec), keys)
        replayed += len(recs)
        if not result.segments or result.segments[-1] != path:
            result.segments.append(path)
    result.records_replayed = replayed
    if not log_reader.stopped:
        for seg in log_reader.read:
            if seg.torn is not None:
                _cut_torn_tail(seg, repair, result)
            elif repair and seg.end < seg.size:
                # The zeros it was allocated ahead of its records (aof.SegmentWriter):
                # start-up's next segment follows the last record.
                _truncate(seg)
    return result


def refusal(e: CorruptionError, data_dir: Path) -> str:
    """Start-up's one line for damage: what and where, and how to recover what is intact."""
    if e.path.suffix == datadir.SNAPSHOT_SUFFIX:
        return (f"{e}; start-up changed nothing. The newest snapshot is damaged: "
                f"`smallstalk aof verify {data_dir}` shows what is intact")
    seq = e.seq if e.seq is not None else 0
    return (f"{e}; start-up changed nothing. To recover the records up to seq {seq}: copy the "
            f"directory to COPY, run `smallstalk replay COPY --until-seq {seq} --write-snapshot "
            f"SNAP`, and serve a new directory holding only that snapshot in snapshots/ "
            f"(`smallstalk aof verify {data_dir}` shows all the damage)")


def body_offset(data: bytes, offset: int, rec) -> int:
    """Where the body of the Put/PutJobs record in the frame at `offset` starts:
    the body is the record's last field, so its bytes end where the frame does."""
    (length,) = struct.unpack_from("<I", data, offset)
    return offset + aof.FRAME.size + length - len(rec.body)


def apply_next(state: State, path: Path, offset: int, rec) -> bool:
    """Apply `rec` if it is the state's next record; False if the state has it already.

    A gap, or a record that does not apply, is damage: CorruptionError names
    the file, offset and the last good sequence number.
    """
    if rec.seq <= state.last_seq:
        return False
    if rec.seq != state.last_seq + 1:
        raise CorruptionError(path, offset, state.last_seq,
                              f"sequence gap: expected {state.last_seq + 1}, found {rec.seq}")
    try:
        state.apply(rec)
    except StateError as e:
        raise CorruptionError(path, offset, state.last_seq,
                              f"record does not apply: {e}") from None
    return True


def _truncate(seg: SegmentRead) -> None:
    """Cut a segment durably at the end of its good records."""
    with open(seg.path, "r+b") as f:
        f.truncate(seg.end)
        os.fsync(f.fileno())


def _cut_torn_tail(seg: SegmentRead, repair: bool, result: Recovered) -> None:
    if seg.header_seq is None:
        result.warnings.append(f"{seg.path}: last segment has no complete header; removed")
        if repair:
            seg.path.unlink()
            aof.fsync_dir(seg.path.parent)  # gone for good before a new segment takes its place
        return
    msg = (f"{seg.path}: torn write at offset {seg.end} after seq {result.state.last_seq} "
           f"({seg.size - seg.end} bytes, {seg.torn}); truncated")
    result.warnings.append(msg)
    log.warning("%s", msg)
    if repair:
        datadir.broken_path(seg.path).write_bytes(seg.tail)
        _truncate(seg)
