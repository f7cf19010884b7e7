"""The compactor: fold closed AOF segments into a new snapshot, then delete them.

The server's compactor task picks a fixed list of closed segments (never
"whatever is closed when it deletes"), and runs the fold in a child process
(`python -m smallstalk.compactor DATA_DIR SEGMENT...`) that replays those
files on top of the newest snapshot into its own State and writes the new
snapshot crash-safely (snapshot.write). The mutation loop is never paused:
the child reads only immutable files, on the other core.

Only after the child reports the snapshot's path does the task delete the
folded segments and the older snapshots. A crash anywhere in between leaves
either the old snapshot with all its segments, or the new snapshot with some
segments it covers; start-up skips records at or below the snapshot's seq.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import trio

from . import aof, snapshot
from .aof import CorruptionError
from .recovery import apply_next, paths
from .state import State, StateError

log = logging.getLogger("smallstalk.compactor")


def fold(data_dir: Path, segments: list[Path]) -> Path:
    """Replay `segments` (closed, in order) onto the newest snapshot; write the result."""
    aof_dir, snap_dir = paths(data_dir)
    snaps = aof.list_snapshots(snap_dir)
    state = snapshot.load(snaps[-1][1]) if snaps else State()
    for path in segments:
        for entry in aof.iter_segment(path):
            if isinstance(entry, aof.FrameScan):
                if not entry.clean:
                    raise CorruptionError(path, entry.end, state.last_seq, entry.why)
                break
            apply_next(state, path, *entry)
    return snapshot.write_state(snap_dir, state)


def remove_folded(data_dir: Path, snap: Path, keep=None) -> int:
    """Delete segments wholly at or below the snapshot, and older snapshots.

    `keep(covered)` may spare some of the covered segments (retention for the
    replay tools); it gets them oldest first and returns the set to keep.
    """
    aof_dir, snap_dir = paths(data_dir)
    last_seq = int(snap.stem)
    segments = aof.list_segments(aof_dir)
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
    for seq, path in aof.list_snapshots(snap_dir):
        if seq < last_seq:
            path.unlink(missing_ok=True)
    for tmp in snap_dir.glob("*.tmp"):
        tmp.unlink(missing_ok=True)
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


async def run(journal, data_dir: Path, interval: float, max_closed: int = 4,
              keep=None) -> None:
    """The server's compactor task.

    Folds the closed segments every `interval` seconds, or as soon as
    `max_closed` of them have piled up (heavy churn), whichever comes first.
    """
    last = trio.current_time()
    while True:
        with trio.move_on_after(max(interval - (trio.current_time() - last), 0)):
            while len(journal.closed_segments()) < max_closed:
                await journal.rotated.wait()
        closed = journal.closed_segments()
        if not closed:
            last = trio.current_time()
            continue
        fixed = list(closed)  # exactly these are folded, whatever rotates meanwhile
        started = time.monotonic()
        try:
            result = await trio.run_process(
                [sys.executable, "-m", "smallstalk.compactor", str(data_dir),
                 *map(str, fixed)],
                capture_stdout=True, capture_stderr=True, check=False)
        except OSError:
            log.exception("could not start the compactor")
            await trio.sleep(interval)
            continue
        last = trio.current_time()
        if result.returncode != 0:
            log.error("compaction failed: %s", result.stderr.decode(errors="replace").strip())
            await trio.sleep(interval)
            continue
        snap = Path(result.stdout.decode().strip())
        try:
            removed = remove_folded(data_dir, snap, keep)
        except OSError:
            log.exception("could not delete the segments folded into %s", snap.name)
            await trio.sleep(interval)
            continue
        log.info("compacted %d segments into %s in %.2fs", removed, snap.name,
                 time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m smallstalk.compactor DATA_DIR SEGMENT...", file=sys.stderr)
        return 2
    try:
        print(fold(Path(args[0]), [Path(a) for a in args[1:]]))
    except (CorruptionError, StateError) as e:
        print(f"compaction stopped: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
