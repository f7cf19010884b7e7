"""Snapshot files: the durable state at one sequence number, written crash-safely.

`DATA_DIR/snapshots/<last seq, 20 digits>.snap` holds the same 24-byte header
as a segment (magic `SSTKSNP\\0`, the last sequence number it contains), then
one frame per item of `State.dump()` and a final `["end", item count]` frame;
a file without that final frame is incomplete and never used.

Writing follows the protocol Redis uses for its rewrite: write `<name>.tmp`,
fsync it, rename it into place, fsync the directory. Only then may older
snapshots and the segments it covers be deleted (by the caller).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import cbor2

from . import aof
from .aof import CorruptionError
from .state import State, StateError


def write(directory: Path, last_seq: int, items: Iterable[list]) -> Path:
    """Write a snapshot of `items` at `last_seq`; return its final path."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / aof.snapshot_name(last_seq)
    tmp = directory / f"{final.name}.{os.getpid()}.tmp"
    count = 0
    with open(tmp, "wb") as f:
        f.write(aof.header(aof.SNAPSHOT_MAGIC, last_seq))
        buf = bytearray()
        for item in items:
            buf += aof.frame(cbor2.dumps(item))
            count += 1
            if len(buf) > 1 << 20:
                f.write(buf)
                buf.clear()
        buf += aof.frame(cbor2.dumps(["end", count]))
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    aof.fsync_dir(directory)
    return final


def write_state(directory: Path, state: State) -> Path:
    return write(directory, state.last_seq, state.dump())


def read_items(path: Path) -> tuple[int, list[list]]:
    """All items of a snapshot, checked; raises CorruptionError naming the damage."""
    data = path.read_bytes()
    last_seq = aof.read_header(path, data, aof.SNAPSHOT_MAGIC)
    items: list[list] = []
    for entry in aof.read_frames(data):
        if isinstance(entry, aof.FrameScan):
            if not entry.clean:
                raise CorruptionError(path, entry.end, last_seq, entry.why)
            break
        offset, payload = entry
        try:
            item = cbor2.loads(payload)
        except Exception as e:
            raise CorruptionError(path, offset, last_seq, f"bad CBOR: {e}") from None
        if item[0] == "end":
            if item[1] != len(items):
                raise CorruptionError(path, offset, last_seq, "item count mismatch")
            return last_seq, items
        items.append(item)
    raise CorruptionError(path, len(data), last_seq, "snapshot has no end frame (incomplete)")


def load(path: Path) -> State:
    last_seq, items = read_items(path)
    try:
        state = State.load(items)
    except (StateError, TypeError, ValueError, KeyError, IndexError) as e:
        raise CorruptionError(path, 0, last_seq, f"snapshot items do not load: {e!r}") from None
    if state.last_seq != last_seq:
        raise CorruptionError(path, 0, last_seq, f"header says seq {last_seq}, body {state.last_seq}")
    return state
