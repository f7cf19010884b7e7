"""Snapshot files: the durable state at one sequence number, written crash-safely.

`DATA_DIR/snapshots/<last seq, 20 digits>.snap` holds the same 24-byte header
as a segment (magic `SSTKSNP\\0`, the last sequence number it contains), then
one frame per item of `snapshot_codec.dump`, except that jobs go up to `JOBS_PER_ITEM`
to a frame as one `jobs` item (format 3; formats 1 and 2 had a `job` item per
job), and a final `["end", item count]` frame; a file without that final frame
is incomplete and never used.

Writing follows the protocol Redis uses for its rewrite: write a `.tmp` file,
fsync it, rename it into place, fsync the directory. Only then may older
snapshots and the segments it covers be deleted (by the caller).

Reading streams the file a frame at a time. With a body store that has a
budget (read-behind, bodies.py), `load` keeps a job's body in memory only
while the budget allows and otherwise puts a reference to the body's bytes
in this file in its place. A snapshot writer resolves references
(`bodies.resolve_items`), and can write a body index next to the snapshot
(`<seq>.bodies`: where each job's body is in the new file), which the server
uses to move its references off the files a compaction folded.
"""

from __future__ import annotations

import gc
import os
import struct
from collections.abc import Iterable, Iterator
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import BinaryIO

import cbor2

from smallstalk.core.state import State, StateError
from smallstalk.storage import aof, snapshot_codec
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.datadir import index_path, snapshot_name, tmp_path

BODY_INDEX_MAGIC = b"SSTKBDX\x00"
BODY_INDEX_ENTRY = struct.Struct("<QQI")  # job id, body offset in the snapshot, body length
_BUFFER = 1 << 20
# A `jobs` item holds at most this many jobs, and closes early once its bodies
# pass BATCH_BODY_BYTES: one CRC, one frame and one cbor2 call for many jobs
# halved decoding (400k jobs: 0.44 -> 0.20 s), and the byte bound keeps a frame
# of big bodies small for a streaming reader and far below MAX_FRAME.
JOBS_PER_ITEM = 128
BATCH_BODY_BYTES = 1 << 20


def _int_len(v: int) -> int:
    """Bytes of a CBOR integer in its shortest form (what cbor2 writes)."""
    if v < 0:
        v = -1 - v
    return 1 if v < 24 else 2 if v < 256 else 3 if v < 65536 else 5 if v < 1 << 32 else 9


def _tail_len(item: list) -> int:
    """Encoded length of a job item's fields after the body (index 6).

    The body is a byte string, so its bytes end exactly that many bytes before
    the end of the item's CBOR encoding.
    """
    n = 0
    for x in item[7:]:
        n += _int_len(x) if type(x) is int and -(1 << 64) <= x < 1 << 64 else len(cbor2.dumps(x))
    return n


def check_jobs_item(item: list) -> None:
    """Raise ValueError unless `item` is a well-formed `jobs` item (bodies not looked at)."""
    if not (len(item) == 3 and type(item[1]) is list and type(item[2]) is list
            and len(item[1]) == len(item[2])
            and all(type(row) is list and len(row) == 15 for row in item[1])):
        raise ValueError("malformed jobs item")


def job_rows(item: list) -> list[list]:
    """A `jobs` item's jobs as `job` items (the layout of formats 1 and 2); checked."""
    check_jobs_item(item)
    return [["job", *row[:5], body, *row[5:]] for row, body in zip(item[1], item[2], strict=True)]


def _body_ends(bodies: list[bytes], payload_end: int) -> list[int]:
    """Where each body of a `jobs` item ends, from where its payload ends.

    The bodies array is the item's last element, so the last body ends where
    the payload does and each one before it ends where the next one's CBOR
    head starts.
    """
    ends = [0] * len(bodies)
    end = payload_end
    for k in range(len(bodies) - 1, -1, -1):
        ends[k] = end
        n = len(bodies[k])
        end -= n + _int_len(n)  # a byte string's head is as long as an int's
    return ends


def write(directory: Path, last_seq: int, items: Iterable[list], index: bool = False) -> Path:
    """Write a snapshot of `items` (`snapshot_codec.dump` items) at `last_seq`; return its final path.

    Runs of `job` items are written as `jobs` items (see JOBS_PER_ITEM).
    `index`: also write `<seq>.bodies` (see `index_path`): for every job, its
    id and where its body's bytes are in the snapshot file.
    """
    aof.make_dirs(directory)  # its entry in DATA_DIR durable before segments are deleted
    final = directory / snapshot_name(last_seq)
    tmp = tmp_path(final)
    entries = bytearray()
    count = 0
    pack_entry = BODY_INDEX_ENTRY.pack
    with open(tmp, "wb") as f:
        head = aof.header(aof.SNAPSHOT_MAGIC, last_seq)
        f.write(head)
        flushed = len(head)  # file offset of buf[0]
        buf = bytearray()
        rows: list[list] = []
        bodies: list[bytes] = []
        batch_bytes = 0

        def put(item: list) -> None:
            nonlocal flushed, count
            payload = cbor2.dumps(item)
            if index and item[0] == "jobs":
                end = flushed + len(buf) + aof.FRAME.size + len(payload)
                for row, body, body_end in zip(item[1], item[2], _body_ends(item[2], end),
                                               strict=True):
                    entries.extend(pack_entry(row[0], body_end - len(body), len(body)))
            buf.extend(aof.frame(payload))
            count += 1
            if len(buf) > _BUFFER:
                f.write(buf)
                flushed += len(buf)
                buf.clear()

        for item in items:
            if item[0] == "job":
                if len(item) != 17:
                    raise ValueError(f"job item of {len(item)} fields, not 17: {item[:2]}")
                body = item[6]
                rows.append(item[1:6] + item[7:])
                bodies.append(body)
                batch_bytes += len(body)
                if len(rows) < JOBS_PER_ITEM and batch_bytes < BATCH_BODY_BYTES:
                    continue
            elif not rows:
                put(item)
                continue
            put(["jobs", rows, bodies])
            rows, bodies, batch_bytes = [], [], 0
            if item[0] != "job":
                put(item)
        if rows:
            put(["jobs", rows, bodies])
        buf += aof.frame(cbor2.dumps(["end", count]))
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    if index:
        # Read once by the server right after this compaction, then deleted: a
        # crash loses nothing (start-up reads bodies from the snapshot itself).
        idx = index_path(final)
        idx_tmp = tmp_path(idx)
        with open(idx_tmp, "wb") as f:
            f.write(aof.header(BODY_INDEX_MAGIC, last_seq))
            f.write(entries)
        os.rename(idx_tmp, idx)
    os.rename(tmp, final)
    aof.fsync_dir(directory)
    return final


def write_state(directory: Path, state: State, bodies=None, index: bool = False) -> Path:
    """Write `state`; bodies read-behind keeps on disk (in `bodies`) are read back as it goes."""
    from smallstalk.storage.bodies import resolve_items

    return write(directory, state.last_seq, resolve_items(snapshot_codec.dump(state), bodies),
                 index)


def index_entries(path: Path) -> memoryview:
    """The entries of a body index (see `write`), checked header, as bytes:
    unpack with `BODY_INDEX_ENTRY.iter_unpack`."""
    with open(path, "rb") as f:
        data = f.read()
    aof.read_header(path, data, BODY_INDEX_MAGIC)
    entries = memoryview(data)[aof.HEADER_SIZE:]
    return entries[:len(entries) - len(entries) % BODY_INDEX_ENTRY.size]


def iter_frames(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(frame offset, last seq, payload) per frame of a snapshot, up to and with `end`.

    Streams the file; raises CorruptionError as `aof.decode_frames` judges
    the damage (and for a file without an `end` frame).
    """
    for last_seq, offsets, payloads in _frame_batches(path):
        for offset, payload in zip(offsets, payloads, strict=True):
            yield offset, last_seq, payload


def _frame_batches(path: Path, file: BinaryIO | None = None,
                   ) -> Iterator[tuple[int, list[int], list[bytes]]]:
    """`iter_frames` a read at a time (aof.file_frames): (last seq, offsets, payloads).

    Damage raises after the good frames before it. A `file` given is read
    from its start and left open.
    """
    f = file if file is not None else open(path, "rb")  # noqa: SIM115
    try:
        f.seek(0)
        last_seq = aof.read_header(path, f.read(aof.HEADER_SIZE), aof.SNAPSHOT_MAGIC)
        for offsets, payloads, scan in aof.file_frames(f, aof.HEADER_SIZE):
            if offsets:
                yield last_seq, offsets, payloads
            if scan is not None:
                raise CorruptionError(path, scan.end, last_seq,
                                      scan.why or "snapshot has no end frame (incomplete)")
    finally:
        if file is None:
            f.close()


def iter_items(path: Path, bodies=None, jobs_items: bool = False,
               file: BinaryIO | None = None) -> Iterator[list]:
    """The snapshot reader: a snapshot's items, checked, streamed (meta first;
    the `end` item is checked, not yielded). Damage raises CorruptionError when
    the reader gets there: read to the end before trusting what came.

    A `jobs` item comes as its jobs' `job` items (`job_rows`), so a reader
    sees one layout whatever the format; `jobs_items`: as it is (for
    `snapshot_codec.load`, which reads it faster than as many `job` items).

    With a body store `bodies` that has a budget (read-behind), a job's body
    stays in its item while the server budget and its tube's budget allow
    (lowest ids first: in FIFO use, the head of each tube); past them the item
    carries a reference to the body's bytes in this file instead.
    """
    # Handed on a read's worth at a time and flattened in C: a generator step
    # per item costs a big snapshot's load measurably.
    return chain.from_iterable(_item_batches(path, bodies, jobs_items, file))


def _item_batches(path: Path, bodies, jobs_items: bool = False,
                  file: BinaryIO | None = None) -> Iterator[list[list]]:
    """`iter_items` a read at a time; damage raises after the good items before it."""
    if bodies is not None and not bodies.active:
        bodies = None
    total = 0
    per_tube: dict[str, int] = {}
    tube_max: dict[str, int] = {}
    key = None
    count = 0
    loads = cbor2.loads
    first = itemgetter(0)

    def over(tube: str, n: int) -> bool:
        """Would a body of `n` bytes more in memory pass a budget?"""
        limit = tube_max.get(tube)
        if limit is None:
            f = bodies.tube_budget
            limit = tube_max[tube] = f(tube) if f is not None else 0
        return bool(n) and bool((bodies.max_memory and total + n > bodies.max_memory)
                                or (limit and per_tube.get(tube, 0) + n > limit))

    def kept(tube: str, n: int) -> None:
        nonlocal total
        total += n
        per_tube[tube] = per_tube.get(tube, 0) + n

    def ref(offset: int, n: int) -> int:
        nonlocal key
        if key is None:
            key = bodies.key(path)
        return bodies.ref(path, offset, n, key)

    for last_seq, offsets, payloads in _frame_batches(path, file):
        try:
            decoded = list(map(loads, payloads))
        except Exception:  # cbor2 raises several types for garbage; the loop below says which
            decoded = None
        if (bodies is None and decoded is not None and set(map(type, decoded)) == {list}
                and all(decoded) and (count or decoded[0][:2] == ["meta", last_seq])):
            # The common case, checked in C: every payload decodes to a
            # non-empty list, and none is the `end` item (that batch, or one
            # with damage, takes the item-by-item path below); snapshot_codec.load's
            # unpacking checks the `jobs` items it gets. Expanding them is the
            # item-by-item path's job.
            kinds = set(map(first, decoded))
            if "end" not in kinds and (jobs_items or "jobs" not in kinds):
                count += len(decoded)
                yield decoded
                continue
        out: list[list] = []
        err = None
        for i, (offset, payload) in enumerate(zip(offsets, payloads, strict=True)):
            if decoded is not None:
                item = decoded[i]
            else:
                try:
                    item = loads(payload)
                except Exception as e:  # cbor2 raises several types for garbage
                    err = CorruptionError(path, offset, last_seq, f"bad CBOR: {e}")
                    break
            if not isinstance(item, list) or not item:
                err = CorruptionError(path, offset, last_seq, "snapshot item is not an array")
                break
            kind = item[0]
            if count == 0 and (kind != "meta" or item[1:2] != [last_seq]):
                err = CorruptionError(path, offset, last_seq,
                                      f"first item is not meta for seq {last_seq}")
                break
            if kind == "end":
                if item[1:2] != [count]:
                    err = CorruptionError(path, offset, last_seq, "item count mismatch")
                    break
                if out:
                    yield out
                return
            count += 1
            if kind == "jobs":
                try:
                    check_jobs_item(item)
                except ValueError as e:
                    err = CorruptionError(path, offset, last_seq, str(e))
                    break
                if bodies is not None:
                    payload_end = offset + aof.FRAME.size + len(payload)
                    jbodies = item[2]
                    ends = None
                    for k, (row, body) in enumerate(zip(item[1], jbodies, strict=True)):
                        if type(body) is not bytes:
                            continue
                        n = len(body)
                        if over(row[1], n):
                            if ends is None:
                                ends = _body_ends(jbodies, payload_end)
                            start = ends[k] - n - offset - aof.FRAME.size  # in the payload
                            if payload[start:start + n] == body:  # (else an encoding we do not know: keep it)
                                jbodies[k] = ref(ends[k] - n, n)
                                continue
                        kept(row[1], n)
                out.extend((item,) if jobs_items else job_rows(item))
                continue
            if (bodies is not None and kind == "job" and len(item) > 7
                    and isinstance(item[6], bytes)):
                body = item[6]
                n = len(body)
                if over(item[2], n):
                    end = len(payload) - _tail_len(item)
                    if payload[end - n:end] == body:  # (an encoding we do not know: keep it)
                        item[6] = ref(offset + aof.FRAME.size + end - n, n)
                        out.append(item)
                        continue
                kept(item[2], n)
            out.append(item)
        if out:
            yield out
        if err is not None:
            raise err


def read_items(path: Path) -> tuple[int, list[list]]:
    """All items of a snapshot, checked; raises CorruptionError naming the damage."""
    with open(path, "rb") as f:
        last_seq = aof.read_header(path, f.read(aof.HEADER_SIZE), aof.SNAPSHOT_MAGIC)
    return last_seq, list(iter_items(path))


def load(path: Path, bodies=None) -> State:
    """The state in a snapshot; with a body store, bodies past its budgets stay on disk."""
    with open(path, "rb") as f:
        last_seq = aof.read_header(path, f.read(aof.HEADER_SIZE), aof.SNAPSHOT_MAGIC)
    # As in recovery.recover: millions of objects and no cycles, so the cyclic
    # collector would only run over and over (and over the decoded batches
    # waiting for snapshot_codec.load). Also for callers with it on (a replica's resync).
    enabled = gc.isenabled()
    gc.disable()
    try:
        state = snapshot_codec.load(iter_items(path, bodies, jobs_items=True))
    except (StateError, TypeError, ValueError, KeyError, IndexError) as e:
        raise CorruptionError(path, 0, last_seq, f"snapshot items do not load: {e!r}") from None
    finally:
        if enabled:
            gc.enable()
    if state.last_seq != last_seq:
        raise CorruptionError(path, 0, last_seq, f"header says seq {last_seq}, body {state.last_seq}")
    state.on_body_dropped = bodies.drop if bodies is not None else None
    return state
