"""`smallstalk backup DIR DEST`: a consistent copy of a live data directory.

Safe while the server serves, as Redis's BGSAVE or etcd's `snapshot save`:
the newest snapshot, the closed segments after it (hard links when DEST is on
the same file system: they never change again), and the active segment up
to its last whole record. Every job acknowledged before the backup began is
in DEST; DEST is checked with the reader start-up uses, then fsynced.
The layout is docs/ARCHITECTURE.md's; the compactor may fold and delete files
meanwhile, so files are opened as soon as they are listed and a listing the
compactor overtook is taken again.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

import attrs

from smallstalk.core.state import StateError
from smallstalk.storage import aof, datadir
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.bodies import COMPACTOR_BUDGET, BodyStore
from smallstalk.storage.recovery import recover
from smallstalk.usage import Parser

ATTEMPTS = 20  # listings the compactor may overtake before the backup gives up
CHUNK = 1 << 20


class BackupError(Exception):
    """The backup cannot be made: one line saying why."""


@attrs.frozen
class Backup:
    """What was copied: the snapshot's seq (0: none), the last seq in DEST, and files."""

    snapshot_seq: int
    last_seq: int
    files: int
    linked: int


@attrs.define
class _Source:
    """One file of the source, open: deleting it now does not take it away."""

    path: Path
    fd: int
    seq: int  # a snapshot's last seq, a segment's first


def backup(src: Path, dest: Path, link: bool = True) -> Backup:
    """Copy the data directory `src` to `dest` (absent or empty); see the module doc."""
    src_aof, src_snaps = datadir.paths(src)
    if not datadir.is_data_dir(src):
        raise BackupError(f"{src}: not a data directory (no aof/ or snapshots/)")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BackupError(f"{dest}: exists and is not an empty directory")
    for _attempt in range(ATTEMPTS):
        opened = _open_consistent(src_aof, src_snaps)
        if opened is None:
            continue  # the compactor moved on while we listed: list again
        snap, segments = opened
        try:
            result = _copy(snap, segments, dest, link)
        finally:
            for f in ([snap] if snap else []) + segments:
                os.close(f.fd)
        _check(dest)
        _sync_tree(dest)
        return result
    raise BackupError(f"{src}: the compactor kept changing the files: try again, "
                      "or with a longer --compact-interval")


def _open_consistent(aof_dir: Path, snap_dir: Path) -> tuple[_Source | None, list[_Source]] | None:
    """The newest snapshot and the segments after it, open; None if they do not join up."""
    snaps = datadir.list_snapshots(snap_dir)
    segments = datadir.list_segments(aof_dir)
    opened: list[_Source] = []
    try:
        snap = _open(snaps[-1][1], snaps[-1][0]) if snaps else None
        if snap is not None:
            opened.append(snap)
        last = snap.seq if snap else 0
        # Segments wholly at or below the snapshot are folded into it (compactor.remove_folded).
        needed = [(first, path) for i, (first, path) in enumerate(segments)
                  if not (i + 1 < len(segments) and segments[i + 1][0] <= last + 1)]
        for first, path in needed:
            opened.append(_open(path, first))
    except FileNotFoundError:
        _close(opened)
        return None
    segs = opened[1:] if snap else opened
    if segs and segs[0].seq > last + 1:
        # A newer snapshot took the segments after ours away: there is a gap.
        _close(opened)
        return None
    return snap, segs


def _open(path: Path, seq: int) -> _Source:
    return _Source(path, os.open(path, os.O_RDONLY | os.O_CLOEXEC), seq)


def _close(files: list[_Source]) -> None:
    for f in files:
        os.close(f.fd)


def _copy(snap: _Source | None, segments: list[_Source], dest: Path, link: bool) -> Backup:
    dest_aof, dest_snaps = datadir.paths(dest)
    aof.make_dirs(dest_aof)  # DEST and any parent it needs, each durable in its own parent
    aof.make_dirs(dest_snaps)
    linked = 0
    if snap is not None:
        linked += _link_or_copy(snap, dest_snaps / snap.path.name, link)
    last_seq = snap.seq if snap else 0
    for i, seg in enumerate(segments):
        target = dest_aof / seg.path.name
        if i + 1 < len(segments):  # closed: it never changes again
            linked += _link_or_copy(seg, target, link)
            continue
        data = _read_all(seg.fd)  # the active segment, as far as it is written now
        try:
            aof.read_header(seg.path, data, aof.SEGMENT_MAGIC)
        except CorruptionError:
            continue  # created a moment ago, its header not written yet: no records
        end, count = aof.HEADER_SIZE, 0
        for entry in aof.read_frames(data):
            if isinstance(entry, aof.FrameScan):
                end = entry.end  # the last whole record; a record half written is left out
            else:
                count += 1
        _write_new(target, data[:end])
        last_seq = seg.seq + count - 1 if count else last_seq
    files = (1 if snap else 0) + len(segments)
    return Backup(snap.seq if snap else 0, last_seq, files, linked)


def _link_or_copy(src: _Source, target: Path, link: bool) -> int:
    """1 if `target` is a hard link to the source file, 0 if it is a copy."""
    if link:
        try:
            os.link(src.path, target)
            if os.path.samestat(os.fstat(src.fd), os.stat(target)):
                return 1
            target.unlink()  # the name now belongs to another file: copy ours
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOENT, errno.EPERM, errno.EMLINK):
                raise
    _write_new(target, _read_all(src.fd))
    return 0


def _read_all(fd: int) -> bytes:
    parts = []
    offset = 0
    while chunk := os.pread(fd, CHUNK, offset):
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _check(dest: Path) -> None:
    """DEST reads as start-up reads it (nothing is repaired or written).

    Bodies past a small budget stay on disk, as in the compactor: a backlog
    larger than memory can be checked too.
    """
    store = BodyStore(COMPACTOR_BUDGET)
    try:
        recover(dest, repair=False, bodies=store)
    except (CorruptionError, StateError) as e:
        raise BackupError(f"the copy in {dest} does not read back: {e}") from None
    finally:
        store.close()


def _sync_tree(dest: Path) -> None:
    """fsync every file, then the directories, then DEST's entry in its parent."""
    for sub in datadir.paths(dest):
        for path in sorted(sub.iterdir()):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        aof.fsync_dir(sub)
    aof.fsync_dir(dest)
    aof.fsync_dir(dest.absolute().parent)


HELP_EPILOG = """\
The server keeps serving. DEST gets the newest snapshot, the closed segments
after it (hard links when DEST is on the same file system; --copy copies), and
the active segment up to its last whole record: every job acknowledged before
the backup began. Segments kept only for the replay tools are not copied.
Restore: stop the server, move DEST into place as its data directory, start it.
Check a backup with `smallstalk aof verify DEST`.
"""


def main(argv: list[str]) -> int:
    p = Parser(prog="smallstalk backup", epilog=HELP_EPILOG,
               description="Copy a live data directory consistently.",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_dir", metavar="DIR", type=Path, help="the server's data directory")
    p.add_argument("dest", metavar="DEST", type=Path, help="where the copy goes (new or empty)")
    p.add_argument("--copy", action="store_true",
                   help="copy closed segments and the snapshot instead of hard-linking them")
    args = p.parse_args(argv)
    try:
        made = backup(args.data_dir, args.dest, link=not args.copy)
    except BackupError as e:
        print(f"smallstalk backup: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"smallstalk backup: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"backed up {args.data_dir} to {args.dest}: up to seq {made.last_seq} "
          f"(snapshot at seq {made.snapshot_seq}, {made.files} files, "
          f"{made.linked} hard-linked)")
    return 0
