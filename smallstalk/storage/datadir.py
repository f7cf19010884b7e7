"""The data directory's layout: the one place that knows its file names, and its lock.

```
DATA_DIR/lock                          held (flock) by the process that owns the directory
DATA_DIR/aof/<first seq>.aof           segments (20 digits)
DATA_DIR/aof/<segment>.broken          a torn tail start-up cut off, kept for the operator
DATA_DIR/snapshots/<last seq>.snap     snapshots (20 digits)
DATA_DIR/snapshots/<seq>.bodies        a compaction's body index (read-behind)
DATA_DIR/snapshots/<name>.<pid>.tmp    a snapshot or index being written
DATA_DIR/resync.snap.tmp               a replica's full resync being received
DATA_DIR/diverged/<...>.aof            records a rejoining old primary set aside (HA)
```

The formats are in snapshots/README.md; who writes what in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

AOF = "aof"
SNAPSHOTS = "snapshots"
LOCK = "lock"
SEGMENT_SUFFIX = ".aof"
SNAPSHOT_SUFFIX = ".snap"
BROKEN_SUFFIX = ".broken"
TMP_SUFFIX = ".tmp"
INDEX_SUFFIX = ".bodies"
RESYNC = "resync.snap.tmp"
DIVERGED = "diverged"
# beanstalkd's exit status when its WAL directory is locked by another process
EXIT_LOCKED = 10


def aof_dir(data_dir: Path) -> Path:
    return data_dir / AOF


def diverged_dir(data_dir: Path) -> Path:
    """Where a rejoining old primary copies the records the new history lacks."""
    return data_dir / DIVERGED


def snap_dir(data_dir: Path) -> Path:
    return data_dir / SNAPSHOTS


def paths(data_dir: Path) -> tuple[Path, Path]:
    """(segment directory, snapshot directory)."""
    return data_dir / AOF, data_dir / SNAPSHOTS


def is_data_dir(data_dir: Path) -> bool:
    """Whether `data_dir` holds a server's files (an aof/ or a snapshots/):
    what a tool that reads one checks first, so a wrong path is not read as
    an empty history."""
    return (data_dir / AOF).is_dir() or (data_dir / SNAPSHOTS).is_dir()


def segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}{SEGMENT_SUFFIX}"


def snapshot_name(last_seq: int) -> str:
    return f"{last_seq:020d}{SNAPSHOT_SUFFIX}"


def broken_path(segment: Path) -> Path:
    """Where start-up keeps the torn tail it cut off `segment`."""
    return segment.with_name(segment.name + BROKEN_SUFFIX)


def index_path(snap: Path) -> Path:
    """The body index written next to a snapshot: `<seq>.bodies`."""
    return snap.with_suffix(INDEX_SUFFIX)


def is_index(path: Path) -> bool:
    return path.suffix == INDEX_SUFFIX and path.stem.isdigit()


def tmp_path(final: Path) -> Path:
    """A file being written before it is renamed to `final` (this process's own)."""
    return final.with_name(f"{final.name}.{os.getpid()}{TMP_SUFFIX}")


def resync_path(data_dir: Path) -> Path:
    """Where a replica receives a full resync's snapshot (outside snapshots/,
    whose `*.tmp` files a compaction deletes)."""
    return data_dir / RESYNC


def _numbered(directory: Path, suffix: str) -> list[tuple[int, Path]]:
    out = []
    if directory.is_dir():
        for p in directory.iterdir():
            if p.suffix == suffix and p.stem.isdigit():
                out.append((int(p.stem), p))
    return sorted(out)


def list_segments(aof_dir: Path) -> list[tuple[int, Path]]:
    """(first seq, path) of the segments in `DATA_DIR/aof`, oldest first."""
    return _numbered(aof_dir, SEGMENT_SUFFIX)


def list_snapshots(snap_dir: Path) -> list[tuple[int, Path]]:
    """(last seq, path) of the snapshots in `DATA_DIR/snapshots`, oldest first."""
    return _numbered(snap_dir, SNAPSHOT_SUFFIX)


def temporaries(snap_dir: Path) -> list[Path]:
    return sorted(snap_dir.glob(f"*{TMP_SUFFIX}")) if snap_dir.is_dir() else []


def strays(data_dir: Path) -> list[Path]:
    """Files no reader reads: `*.broken` tails and `*.tmp` snapshots."""
    a, s = paths(data_dir)
    out = sorted(p for p in a.iterdir() if p.name.endswith(BROKEN_SUFFIX)) if a.is_dir() else []
    return out + temporaries(s)


def owner_of(target: Path) -> Path | None:
    """The data directory a snapshot written at `target` lands in, if any:
    `target` is `D/snapshots` or a file in it."""
    if target.name == SNAPSHOTS and target.is_dir():
        return target.parent
    if target.parent.name == SNAPSHOTS:
        return target.parent.parent
    return None


# --- the lock ---------------------------------------------------------------------------


class Locked(Exception):
    """Another process holds the data directory."""

    def __init__(self, data_dir: Path, pid: int | None):
        self.data_dir, self.pid = data_dir, pid
        holder = f"process {pid}" if pid is not None else "another process"
        super().__init__(f"{data_dir}: data directory in use by {holder} "
                         f"(another smallstalk server?); one directory, one server")


def lock(data_dir: Path) -> int:
    """Take the data directory for this process: an open fd holding `flock` on `DATA_DIR/lock`.

    Keep the fd open for as long as the directory is ours; closing it (or the
    process ending, however it ends) lets go. The holder's pid is written in
    the file for the error a second process gets: `Locked`. Creates the
    directory if needed.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise Locked(data_dir, holder(data_dir)) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def holder(data_dir: Path) -> int | None:
    """The pid written in the lock file, if any (it may be stale when nobody holds it)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((data_dir / LOCK).read_text().split()[0])
    return None


def unlock(fd: int) -> None:
    os.close(fd)
