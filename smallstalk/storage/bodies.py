"""Read-behind: job bodies kept on disk and read back by offset (issue #8, "big tubes").

beanstalkd keeps every body in memory. With a memory budget (`--max-memory`,
or a tube's `max-memory`), smallstalk keeps only a job's small index entry
once the budget is spent: `Job.body` becomes an int **reference** to where
the body's bytes already are on disk, in an AOF segment (the `Put`/`PutJobs`
record's last field) or in a snapshot (a `job` item's body), and the body is
read back with one `pread` when the job is reserved or peeked.

A reference packs `key << 72 | offset << 32 | length`: `key` names a file
this store has open, `offset` (40 bits) is where the body's bytes start in
it, and the low 32 bits are the body's length (`state.body_len` relies on
that). References exist only in memory: nothing on disk ever holds one.

`BodyStore` opens each referenced file read-only once and keeps the fd while
any job refers to it (fanout copies may share one reference: every job
holding it counts). So a file the compactor deletes stays readable through
the open fd until the server has moved the references to the new snapshot
(`compactor.remap`), and the fd is closed as soon as nobody refers to it, so
the disk space is freed.

Read-ahead: after a read, the next `READAHEAD` bytes of that file are handed
to the kernel with `posix_fadvise(WILLNEED)`, so FIFO consumption (bodies
were written in arrival order) finds them in the page cache; the loop also
advises the next ready job of the tube it just read from. A read that fails
raises `BodyError` naming the file and offset: the loop answers that one
command INTERNAL_ERROR and goes on serving.

Who decides to spill: the mutation loop after a commit (`spill_record`, only
bodies whose record is written already), recovery and the compactor while
replaying segments, and `snapshot.load` while streaming a snapshot.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from smallstalk.core import records as r

log = logging.getLogger("smallstalk.storage.bodies")

READAHEAD = 1 << 20  # bytes advised ahead of each read
COMPACTOR_BUDGET = 32 << 20  # the compactor child's own budget when the server has one
_M32 = (1 << 32) - 1
_M40 = (1 << 40) - 1
PUTS = r.PUT_TYPES


class BodyError(Exception):
    """A spilled body could not be read back (the message names file and offset)."""


def pack(key: int, offset: int, length: int) -> int:
    if offset > _M40 or length > _M32:
        raise ValueError(f"body at {offset} ({length} bytes) does not fit a reference")
    return (key << 72) | (offset << 32) | length


def unpack(ref: int) -> tuple[int, int, int]:
    """(file key, offset, length) of a reference."""
    return ref >> 72, (ref >> 32) & _M40, ref & _M32


def job_ids(rec) -> list[int]:
    """The jobs a Put or PutJobs record makes (they share its body)."""
    return [rec.id] if type(rec) is r.Put else [jid for jid, _tube in rec.jobs]


class _File:
    __slots__ = ("key", "path", "fd", "ident", "refs", "advised_lo", "advised_hi")

    def __init__(self, key: int, path: str, fd: int, ident: tuple[int, int]):
        self.key, self.path, self.fd, self.ident = key, path, fd, ident
        self.refs = 0
        self.advised_lo = self.advised_hi = 0  # the window last handed to WILLNEED


class BodyStore:
    """Open files and reference counts behind spilled bodies; the budgets."""

    def __init__(self, max_memory: int = 0, tube_budget: Callable[[str], int] | None = None):
        self.max_memory = max_memory  # body bytes in memory, all tubes; 0 = no server budget
        self.tube_budget = tube_budget  # tube name -> its budget (0 = none); None: no tube has one
        self.files: dict[int, _File] = {}  # key -> open file
        self._by_path: dict[str, _File] = {}  # the current file at a path
        self._next_key = 1
        self.reads = 0  # bodies read back (stats: body-reads)
        self.read_errors = 0

    def fresh(self) -> BodyStore:
        """An empty store with the same budgets (a state rebuilt from disk gets one)."""
        return BodyStore(self.max_memory, self.tube_budget)

    # --- budgets -----------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Is there any budget (server or tube) to keep?"""
        return bool(self.max_memory) or self.tube_budget is not None

    def over(self, st, tube) -> bool:
        """Are `tube`'s or all tubes' bodies in memory past their budget?"""
        if self.max_memory and st.body_bytes - st.spilled_bytes > self.max_memory:
            return True
        if self.tube_budget is None:
            return False
        budget = self.tube_budget(tube.name)
        return bool(budget) and tube.bytes_n - tube.spilled_n > budget

    # --- references ----------------------------------------------------------------

    def key(self, path: Path | str) -> int:
        """The key of the file now at `path`, opening it if no reference uses it yet.

        A file replaced under the same name (a replica's resync starts its
        segments over) gets a new key; references into the old one keep the
        old fd.
        """
        name = os.path.abspath(path)
        f = self._by_path.get(name)
        try:
            st = os.stat(name)
        except FileNotFoundError:
            if f is not None:
                return f.key  # deleted, but we hold it open: the same file
            raise
        ident = (st.st_dev, st.st_ino)
        if f is not None:
            if f.ident == ident:
                return f.key
            del self._by_path[name]  # replaced: the old entry lives on for its references
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        f = _File(self._next_key, name, fd, (st.st_dev, st.st_ino))
        self._next_key += 1
        self.files[f.key] = f
        self._by_path[name] = f
        return f.key

    def ref(self, path: Path | str, offset: int, length: int, key: int | None = None) -> int:
        """A new reference to `length` bytes at `offset` of `path` (counted once)."""
        if key is None:
            key = self.key(path)
        ref = pack(key, offset, length)
        self.files[key].refs += 1
        return ref

    def share(self, ref: int) -> None:
        """One more job holds `ref` (a fanout copy)."""
        self.files[ref >> 72].refs += 1

    def drop(self, ref: int) -> None:
        """A job holding `ref` is gone; close the file when nobody refers to it."""
        f = self.files.get(ref >> 72)
        if f is None:
            return
        f.refs -= 1
        if f.refs <= 0:
            self._close(f)

    def _close(self, f: _File) -> None:
        self.files.pop(f.key, None)
        if self._by_path.get(f.path) is f:
            del self._by_path[f.path]
        try:
            os.close(f.fd)
        except OSError:
            pass

    def close(self) -> None:
        """Close every file (the state that referred to them is gone)."""
        for f in list(self.files.values()):
            self._close(f)

    def renamed(self, old: Path | str, new: Path | str) -> None:
        """A file we hold open was renamed (a replica's received snapshot)."""
        f = self._by_path.pop(os.path.abspath(old), None)
        if f is not None:
            f.path = os.path.abspath(new)
            self._by_path[f.path] = f

    def keys_of(self, paths) -> set[int]:
        """Keys of open files at these paths (deleted ones included)."""
        names = {os.path.abspath(p) for p in paths}
        return {f.key for f in self.files.values() if f.path in names}

    def refs_to(self, keys: set[int]) -> int:
        return sum(self.files[k].refs for k in keys if k in self.files)

    # --- reading -------------------------------------------------------------------

    def read(self, ref: int) -> bytes:
        key, offset, length = unpack(ref)
        f = self.files.get(key)
        if f is None:
            self.read_errors += 1
            raise BodyError(f"no open file for body reference {key}:{offset}+{length}")
        try:
            data = os.pread(f.fd, length, offset)
            while len(data) < length:  # very large bodies may come in parts
                more = os.pread(f.fd, length - len(data), offset + len(data))
                if not more:
                    break
                data += more
        except OSError as e:
            self.read_errors += 1
            raise BodyError(f"{f.path}: reading {length} bytes at offset {offset}: {e}") from e
        if len(data) != length:
            self.read_errors += 1
            raise BodyError(f"{f.path}: {length} bytes at offset {offset}: "
                            f"the file ends after {len(data)}")
        self.reads += 1
        end = offset + length
        if end > f.advised_hi - READAHEAD // 2 or end < f.advised_lo:
            self._advise(f, end, READAHEAD)
        return data

    def advise(self, ref: int) -> None:
        """The body at `ref` is likely read soon: ask the kernel to fetch it."""
        key, offset, length = unpack(ref)
        f = self.files.get(key)
        if f is None or (f.advised_lo <= offset and offset + length <= f.advised_hi):
            return
        self._advise(f, offset, max(length, READAHEAD))

    @staticmethod
    def _advise(f: _File, offset: int, length: int) -> None:
        f.advised_lo, f.advised_hi = offset, offset + length
        try:
            os.posix_fadvise(f.fd, offset, length, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):
            pass  # advice only


def spill_record(store: BodyStore, st, rec, path, body_offset: int, key_cache=None) -> int:
    """Replace the bodies of `rec`'s jobs by a reference at `body_offset` of
    `path` where a budget is exceeded; the record must be in that file
    already. Returns how many jobs were spilled."""
    body = rec.body
    ref = 0
    n = 0
    for jid in job_ids(rec):
        j = st.jobs.get(jid)
        if j is None or j.body is not body or not store.over(st, j.tube):
            continue  # gone already, or room for it
        if ref:
            store.share(ref)
        else:
            key = None
            if key_cache is not None:
                key = key_cache.get(path)
                if key not in store.files:  # (closed since, once no job referred to it)
                    key = key_cache[path] = store.key(path)
            ref = store.ref(path, body_offset, len(body), key)
        st.spill(j, ref)
        n += 1
    return n


def resolve_items(items, store: BodyStore | None):
    """`snapshot_codec.dump` items with every referenced body read back (for snapshot writers)."""
    for item in items:
        if item[0] == "job" and isinstance(item[6], int):
            if store is None:
                raise BodyError(f"job {item[1]}: body on disk but no body store")
            item[6] = store.read(item[6])
        yield item
