"""Start-up recovery: newest snapshot + the segments after it = the state to serve.

Rules (snapshots/README.md, "Recovery"):
- the newest snapshot must read cleanly; damage there stops start-up;
- records at or below the snapshot's sequence number are skipped (a crash
  between writing a snapshot and deleting the segments it covers is harmless);
- sequence numbers follow on by one across all segments (`LogSeq`): a gap or
  an overlap (two processes that wrote one directory) is damage, never skipped;
- a frame that does not check out at the end of the *last* segment, with no
  valid frame after it, is a torn write: the tail is copied aside to
  `<segment>.broken`, cut off, and start-up goes on with a warning;
- any other damage raises CorruptionError naming file, offset and the last
  good sequence number, and nothing is written. `smallstalk aof verify`
  reports the same (`refusal` words start-up's one line).

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
    # collector would run over and over for nothing (23% of a 1M-job restart).
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
    spill = bodies is not None and bodies.active
    keys: dict = {}
    result = Recovered(state, [], snap_path)
    log_seq = LogSeq(state.last_seq)
    segments = datadir.list_segments(aof_dir)
    for i, (_first, path) in enumerate(segments):
        last_segment = i == len(segments) - 1
        data = path.read_bytes()
        if len(data) < aof.HEADER_SIZE and last_segment:
            # Created, but its header never fully reached the disk: no records.
            result.warnings.append(f"{path}: last segment has no complete header; removed")
            if repair:
                path.unlink()
            continue
        try:
            replayed, stopped = _replay(state, path, data, last_segment, repair, until_seq,
                                        result, bodies if spill else None, keys, log_seq)
        except CorruptionError as e:
            if e.seq is None:  # damage before the file's first record: name the last good seq
                raise CorruptionError(e.path, e.offset, state.last_seq, e.why) from None
            raise
        result.records_replayed += replayed
        if stopped:
            return result
        if replayed:
            result.segments.append(path)
    return result


class LogSeq:
    """The log's sequence rule, one for start-up, `aof verify`, the compactor and replay.

    Sequence numbers run on by one across every segment, those the snapshot
    covers included; the first record read may be anywhere up to one past the
    snapshot (`floor`). A record below the next expected one is an overlap
    (two writers of one directory, or a segment restored twice), above it a
    gap: both are damage, never skipped, since skipping drops acknowledged
    records.
    """

    def __init__(self, floor: int, expected: int | None = None):
        self.floor = floor  # the snapshot's seq: records at or below it are in it
        self.expected = expected  # None: nothing read yet

    def problem(self, seq: int) -> str | None:
        """Why `seq` cannot come next (and then nothing changes), or None (it is taken)."""
        expected = self.expected
        if expected is None:
            if seq > self.floor + 1:
                return f"sequence gap: expected {self.floor + 1}, found {seq}"
        elif seq != expected:
            kind = "gap" if seq > expected else "overlap"
            return f"sequence {kind}: expected {expected}, found {seq}"
        self.expected = seq + 1
        return None

    def check(self, path: Path, offset: int, seq: int, last_good: int) -> None:
        why = self.problem(seq)
        if why is not None:
            raise CorruptionError(path, offset, last_good, why)


def _replay(state: State, path: Path, data: bytes, last_segment: bool, repair: bool,
            until_seq: int | None, result: Recovered, spill: BodyStore | None,
            keys: dict, log_seq: LogSeq) -> tuple[int, bool]:
    """Apply the records of one segment that follow the state: how many, and
    whether it stopped at `until_seq`."""
    apply_put = state.apply_put
    replayed = 0
    floor = log_seq.floor
    nxt = log_seq.expected  # LogSeq's rule, inlined for the bulk of a log
    for offsets, recs, scan in aof.segment_batches(path, data, put_lists=True):
        for offset, rec in zip(offsets, recs, strict=True):
            if type(rec) is list:
                # A format-1 Put, the bulk of a log (see records.is_put_list):
                # apply_next's rules, applied from the fields.
                _, seq, time, conn, jid, tube, pri, delay, ttr, body = rec
                if until_seq is not None and seq > until_seq:
                    log_seq.expected = nxt
                    return replayed, True
                if seq != nxt:
                    log_seq.expected = nxt
                    log_seq.check(path, offset, seq, state.last_seq)
                nxt = seq + 1
                if seq <= floor:
                    continue  # already in the snapshot
                try:
                    apply_put(seq, time, conn, jid, tube, pri, delay, ttr, body)
                except StateError as e:
                    raise CorruptionError(path, offset, state.last_seq,
                                          f"record does not apply: {e}") from None
                if spill is not None:
                    rec = records.from_list(rec)
                    spill_record(spill, state, rec, path, body_offset(data, offset, rec), keys)
                replayed += 1
                continue
            seq = rec.seq
            if until_seq is not None and seq > until_seq:
                log_seq.expected = nxt
                return replayed, True
            if seq != nxt:
                log_seq.expected = nxt
                log_seq.check(path, offset, seq, state.last_seq)
            nxt = seq + 1
            if seq <= floor:
                continue  # already in the snapshot
            apply_next(state, path, offset, rec)
            if spill is not None and type(rec) in PUTS:
                spill_record(spill, state, rec, path, body_offset(data, offset, rec), keys)
            replayed += 1
        if scan is not None:
            log_seq.expected = nxt
            if not scan.clean:
                _torn_or_corrupt(path, data, scan, state.last_seq, last_segment, repair, result)
            return replayed, False
    log_seq.expected = nxt
    return replayed, False


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


def _torn_or_corrupt(path, data, scan, last_seq, last_segment, repair, result) -> None:
    if not last_segment or aof.later_good_frame(data, scan.end, last_seq) is not None:
        raise CorruptionError(path, scan.end, last_seq, scan.why)
    msg = (f"{path}: torn write at offset {scan.end} after seq {last_seq} "
           f"({scan.size - scan.end} bytes, {scan.why}); truncated")
    result.warnings.append(msg)
    log.warning("%s", msg)
    if repair:
        broken = datadir.broken_path(path)
        broken.write_bytes(data[scan.end:])
        with open(path, "r+b") as f:
            f.truncate(scan.end)
            f.flush()
            os.fsync(f.fileno())
