"""The compactor: fold closed AOF segments into a new snapshot, then delete them.

The server's compactor task picks a fixed list of closed segments (never
"whatever is closed when it deletes"), and runs the fold in a child process
(`python -m smallstalk.storage.compactor DATA_DIR SEGMENT...`) that replays those
files on top of the newest snapshot into its own State and writes the new
snapshot crash-safely (snapshot.write). The mutation loop is never paused:
the child reads only immutable files, on the other core.

Only after the child reports the snapshot's path does the task delete the
folded segments and the older snapshots. A crash anywhere in between leaves
either the old snapshot with all its segments, or the new snapshot with some
segments it covers; start-up skips records at or below the snapshot's seq.

Read-behind (storage/bodies.py): when the server keeps bodies on disk, the child
gets `--max-memory N` (a small budget of its own) and does not load every body
either: past N it refers to them in the old snapshot and the segments and
reads them back while writing the new snapshot. It also writes the body index
`<seq>.bodies` (snapshot.write), from which the server moves references that
point into the files just folded to the new snapshot (`remap`), so the
deleted files' fds can close and their disk space is freed.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from pathlib import Path

import trio

from smallstalk.core.state import State, StateError
from smallstalk.storage import aof, datadir, snapshot
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.bodies import COMPACTOR_BUDGET, PUTS, BodyError, BodyStore, spill_record
from smallstalk.storage.logread import LogReader
from smallstalk.storage.recovery import apply_next, body_offset

log = logging.getLogger("smallstalk.storage.compactor")


def fold(data_dir: Path, segments: list[Path], max_memory: int = 0) -> Path:
    """Replay `segments` (closed, in order) onto the newest snapshot; write the result.

    `max_memory` > 0: keep at most that many body bytes in memory (the rest
    are read back from the old files while writing), and write the body index.
    """
    aof_dir, snap_dir = datadir.paths(data_dir)
    snaps = datadir.list_snapshots(snap_dir)
    store = BodyStore(max_memory) if max_memory else None
    state = snapshot.load(snaps[-1][1], store) if snaps else State()
    state.on_body_dropped = store.drop if store is not None else None
    keys: dict = {}
    # Closed segments only: a bad frame in any of them is damage (torn_tail=False).
    reader = LogReader(segments, state.last_seq, after=state.last_seq, torn_tail=False)
    try:
        for path, data, offsets, recs in reader.batches():
            for offset, rec in zip(offsets, recs, strict=True):
                if apply_next(state, path, offset, rec) and store and type(rec) in PUTS:
                    spill_record(store, state, rec, path, body_offset(data, offset, rec), keys)
        return snapshot.write_state(snap_dir, state, store, index=store is not None)
    finally:
        if store is not None:
            store.close()


def remove_folded(data_dir: Path, snap: Path, keep=None) -> int:
    """Delete segments wholly at or below the snapshot, and older snapshots.

    `keep(covered)` may spare some of the covered segments (retention for the
    replay tools); it gets them oldest first and returns the set to keep.
    """
    aof_dir, snap_dir = datadir.paths(data_dir)
    last_seq = int(snap.stem)
    segments = datadir.list_segments(aof_dir)
    covered = [
        path for i, (_first, path) in enumerate(segments)
        # covered when the next segment starts at or below last_seq + 1
        if i + 1 < len(segments) and segments[i + 1][0] <= last_seq + 1
    ]
    spared = keep(covered) if keep else set()
    removed = 0
    for path in covered:
        if path not in spared:
            path.unlink(missing_ok=True)
            removed += 1
    for seq, path in datadir.list_snapshots(snap_dir):
        if seq < last_seq:
            path.unlink(missing_ok=True)
    for tmp in datadir.temporaries(snap_dir):
        tmp.unlink(missing_ok=True)
    for idx in snap_dir.iterdir():  # body indexes of earlier compactions
        if datadir.is_index(idx) and int(idx.stem) < last_seq:
            idx.unlink(missing_ok=True)
    aof.fsync_dir(aof_dir)
    aof.fsync_dir(snap_dir)
    return removed


def retention(hours: float | None, max_bytes: int | None):
    """A `keep` policy: folded segments younger than `hours`, newest first up to `max_bytes`."""
    if hours is None and max_bytes is None:
        return None

    def keep(covered: list[Path]) -> set[Path]:
        now = time.time()
        kept: set[Path] = set()
        total = 0
        for path in reversed(covered):
            st = path.stat()
            if hours is not None and now - st.st_mtime > hours * 3600:
                break
            if max_bytes is not None and total + st.st_size > max_bytes:
                break
            total += st.st_size
            kept.add(path)
        return kept

    return keep


REMAP_CHUNK = 20_000  # index entries looked at per loop turn


async def remap(lp, snap: Path, folded: list[Path]) -> int:
    """Move spilled bodies off the files a compaction folded, onto its snapshot.

    `folded`: the segments it folded; snapshots older than `snap` count too.
    Bodies there are readable through the store's open fds even once the
    files are deleted; this points their jobs at their copies in the new
    snapshot (found in its body index), so those fds close. The index is read
    in a thread and applied REMAP_CHUNK entries per loop turn, so the loop
    never stalls long and nothing per job is built. Returns the jobs moved.
    """
    idx = datadir.index_path(snap)
    store = lp.bodies
    try:
        if store is None or not idx.exists():
            return 0
        snap_seq = int(snap.stem)
        old_snaps = [p for p in store_paths(store) if _is_older_snapshot(p, snap, snap_seq)]
        keys = await lp.call(store.keys_of, [*folded, *old_snaps])
        if not keys:
            return 0
        entries = await trio.to_thread.run_sync(snapshot.index_entries, idx)
        size = snapshot.BODY_INDEX_ENTRY.size
        new_key: list[int] = []

        def move(chunk) -> int:
            if lp.bodies is not store:
                return 0  # the state was rebuilt meanwhile: its references are new
            jobs = lp.state.jobs
            moved = 0
            for jid, offset, length in snapshot.BODY_INDEX_ENTRY.iter_unpack(chunk):
                j = jobs.get(jid)
                if j is None or type(j.body) is not int or j.body >> 72 not in keys \
                        or j.body & 0xFFFFFFFF != length:
                    continue
                if not new_key:
                    new_key.append(store.key(snap))
                old = j.body
                # Same length, on disk either way: the state's byte counts stay.
                j.body = store.ref(snap, offset, length, new_key[0])
                store.drop(old)
                moved += 1
            return moved

        moved = 0
        step = REMAP_CHUNK * size
        for start in range(0, len(entries), step):
            if lp.bodies is not store or not store.refs_to(keys):
                break
            moved += await lp.call(move, entries[start:start + step])
        left = store.refs_to(keys) if lp.bodies is store else 0
        if left:
            log.warning("%d spilled bodies still refer to folded files", left)
        return moved
    finally:
        idx.unlink(missing_ok=True)


def store_paths(store: BodyStore) -> list[str]:
    return [f.path for f in store.files.values()]


def _is_older_snapshot(path: str, snap: Path, snap_seq: int) -> bool:
    p = Path(path)
    return (str(p.parent) == os.path.abspath(snap.parent) and p.suffix == datadir.SNAPSHOT_SUFFIX
            and p.stem.isdigit() and int(p.stem) < snap_seq)


def child_args(lp) -> list[str]:
    """`--max-memory N` for the compactor child when the server keeps bodies on disk."""
    store = getattr(lp, "bodies", None)
    if store is None or not (store.max_memory or store.files):
        return []
    budget = min(store.max_memory, COMPACTOR_BUDGET) if store.max_memory else COMPACTOR_BUDGET
    return ["--max-memory", str(budget)]


async def run(journal, data_dir: Path, interval: float, max_closed: int = 4,
              keep=None, lp=None) -> None:
    """The server's compactor task.

    Folds the closed segments every `interval` seconds, or as soon as
    `max_closed` of them have piled up (heavy churn), whichever comes first.
    `lp`: the mutation loop, whose spilled bodies are remapped after a fold.
    A disk error in any step is logged (one line) and the attempt is retried
    an interval later: the server serves on, and nothing is deleted after a
    step failed.
    """
    last = trio.current_time()
    while True:
        with trio.move_on_after(max(interval - (trio.current_time() - last), 0)):
            try:
                while len(journal.closed_segments()) < max_closed:
                    await journal.rotated.wait()
            except OSError:
                pass  # the attempt lists the segments again, and logs the error
        try:
            done = await compact_once(journal, data_dir, keep, lp)
        except OSError as e:
            log.error("compaction failed: %s; retrying in %gs", e, interval)
            done = False
        last = trio.current_time()
        if not done:
            await trio.sleep(interval)


async def compact_once(journal, data_dir: Path, keep=None, lp=None) -> bool:
    """One attempt: fold the closed segments, delete them, remap bodies. False: it failed.

    An OSError from listing, spawning, or deleting propagates; the caller logs it.
    """
    closed = journal.closed_segments()
    if not closed:
        return True
    fixed = list(closed)  # exactly these are folded, whatever rotates meanwhile
    started = time.monotonic()
    result = await trio.run_process(
        [sys.executable, "-m", "smallstalk.storage.compactor", *child_args(lp),
         str(data_dir), *map(str, fixed)],
        capture_stdout=True, capture_stderr=True, check=False)
    if result.returncode != 0:
        log.error("compaction failed: %s", result.stderr.decode(errors="replace").strip())
        return False
    snap = Path(result.stdout.decode().strip())
    removed = remove_folded(data_dir, snap, keep)
    moved = 0
    if lp is not None:
        try:
            moved = await remap(lp, snap, fixed)
        except OSError as e:  # the fds stay open: bodies stay readable, disk space is not freed
            log.error("could not move spilled bodies to %s: %s", snap.name, e)
        except Exception:
            log.exception("could not move spilled bodies to %s", snap.name)
    took = time.monotonic() - started
    metrics = getattr(journal, "metrics", None)
    if metrics is not None:
        metrics.last_compaction = (time.time(), took)
        metrics.compactions += 1
    log.info("compacted %d segments into %s in %.2fs%s", removed, snap.name, took,
             f"; {moved} spilled bodies now read from it" if moved else "")
    return True


def main(argv: list[str] | None = None) -> int:
    # A short-lived child that loads a whole state and makes no garbage cycles:
    # the cyclic collector would only slow the fold down.
    gc.disable()
    args = list(sys.argv[1:] if argv is None else argv)
    max_memory = 0
    if args[:1] == ["--max-memory"] and len(args) > 1 and args[1].isdigit():
        max_memory = int(args[1])
        del args[:2]
    if len(args) < 2:
        print("usage: python -m smallstalk.storage.compactor [--max-memory BYTES] DATA_DIR SEGMENT...",
              file=sys.stderr)
        return 2
    try:
        print(fold(Path(args[0]), [Path(a) for a in args[1:]], max_memory))
    except (CorruptionError, StateError, BodyError, OSError) as e:
        print(f"compaction stopped: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
