"""A FUSE file system that can lose power: what was not made durable is undone on a cut.

Run it in its own process (a FUSE server must not touch its own mount point
from the thread that serves it):

    python -m tests.support.powercutfs BACKING MOUNT CONTROL

and drive it through the Unix socket CONTROL (tests/support/powercut.py does).
File bytes pass through to BACKING, one file per inode (`BACKING/<ino>`); the
names live in this process, so a cut can put back exactly the durable tree.

The model is strict POSIX, the one Jepsen's LazyFS uses:

- a file's data and size become durable only by an fsync/fdatasync of that
  file (any descriptor of it);
- a create, mkdir, link, unlink, rmdir or rename becomes durable only by an
  fsync of the directory it changes (a rename across directories: each side
  by its own directory's fsync);
- a file fsynced whose directory entry is not durable is lost with the entry.

`cut` drops everything else: every directory's entries go back to the
listing of its last fsync, every reachable file's bytes to its last fsync,
and whatever is no longer reachable from the root is gone. `cut torn SEED`
instead keeps a random prefix of each file's unsynced appended bytes (what a
page-cache writeback that was under way may have left) and undoes the rest;
of unsynced overwrites (into space allocated ahead), it keeps the first few,
the next one in part, and undoes the later ones.
Handles opened before a cut answer EIO from then on: the processes that held
them died with the power.

`arm NAME [drop]` cuts at a precise point instead: right after the next
fsync of a directory named NAME (with `drop`: one that made a removal
durable). Then every request fails with EIO, as if the machine were off,
until `resume` (after the test has killed the writers).

Every request is handled without awaiting (blocking file I/O on BACKING is
quick), so a request and a cut never interleave.
"""

from __future__ import annotations

import errno
import os
import random
import stat
import sys
import time
from pathlib import Path

import pyfuse3
import trio

ROOT = pyfuse3.ROOT_INODE


class Node:
    """One inode: a directory (entries), a regular file (bytes in BACKING) or a symlink."""

    __slots__ = ("ino", "mode", "uid", "gid", "atime", "mtime", "ctime", "entries", "durable",
                 "fd", "dsize", "undo", "links", "handles", "target")

    def __init__(self, ino: int, mode: int, uid: int, gid: int):
        now = time.time_ns()
        self.ino, self.mode, self.uid, self.gid = ino, mode, uid, gid
        self.atime = self.mtime = self.ctime = now
        self.entries: dict[bytes, int] = {}  # directory: name -> ino, as seen now
        self.durable: dict[bytes, int] = {}  # directory: name -> ino, as of its last fsync
        self.fd = -1  # regular file: its bytes, BACKING/<ino>
        self.dsize = 0  # regular file: size as of its last fsync
        self.undo: list[tuple[int, bytes]] = []  # durable bytes overwritten since, oldest first
        self.links = 0  # directory entries naming it now
        self.handles = 0  # open handles
        self.target = b""  # symlink

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.mode)


class Model:
    """The tree as seen now, what of it is durable, and the cut."""

    def __init__(self, backing: Path):
        self.backing = backing
        self.nodes: dict[int, Node] = {}
        self.next_ino = ROOT + 1
        self.epoch = 0  # a cut starts a new one; handles of an older one are dead
        root = Node(ROOT, stat.S_IFDIR | 0o755, os.getuid(), os.getgid())
        self.nodes[ROOT] = root
        self.cuts = 0
        self.armed: tuple[bytes, bool] | None = None  # cut after fsyncdir of (name, drop only)
        self.dead = False  # cut by the trigger: every request fails until `resume`

    # --- nodes --------------------------------------------------------------------

    def node(self, ino: int) -> Node:
        if self.dead:
            raise pyfuse3.FUSEError(errno.EIO)  # the power is off
        n = self.nodes.get(ino)
        if n is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return n

    def new_node(self, mode: int, uid: int, gid: int) -> Node:
        n = Node(self.next_ino, mode, uid, gid)
        self.next_ino += 1  # never reused: the kernel may still know an old number
        if n.is_file:
            n.fd = os.open(self.backing / str(n.ino), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.nodes[n.ino] = n
        return n

    def size(self, n: Node) -> int:
        if n.is_file:
            return os.fstat(n.fd).st_size
        if n.is_dir:
            return 4096
        return len(n.target)

    def durably_named(self, ino: int) -> bool:
        return any(ino in d.durable.values() for d in self.nodes.values() if d.is_dir)

    def maybe_free(self, n: Node) -> None:
        """Drop a node nothing names (now or durably) and nobody has open."""
        if n.ino == ROOT or n.links or n.handles or self.durably_named(n.ino):
            return
        self._free(n)

    def _free(self, n: Node) -> None:
        if n.fd >= 0:
            os.close(n.fd)
            os.unlink(self.backing / str(n.ino))
            n.fd = -1
        self.nodes.pop(n.ino, None)

    # --- changes --------------------------------------------------------------------

    def link(self, parent: Node, name: bytes, n: Node) -> None:
        parent.entries[name] = n.ino
        n.links += 1
        parent.mtime = parent.ctime = time.time_ns()

    def unlink(self, parent: Node, name: bytes) -> Node:
        n = self.node(parent.entries.pop(name))
        n.links -= 1
        parent.mtime = parent.ctime = time.time_ns()
        return n

    def write(self, n: Node, offset: int, data: bytes) -> int:
        if offset < n.dsize:
            n.undo.append((offset, os.pread(n.fd, min(len(data), n.dsize - offset), offset)))
        done = 0
        while done < len(data):
            done += os.pwrite(n.fd, data[done:], offset + done)
        n.mtime = n.ctime = time.time_ns()
        return done

    def truncate(self, n: Node, size: int) -> None:
        if size < n.dsize:
            n.undo.append((size, os.pread(n.fd, n.dsize - size, size)))
        os.ftruncate(n.fd, size)
        n.mtime = n.ctime = time.time_ns()

    def fsync_file(self, n: Node) -> None:
        n.dsize = self.size(n)
        n.undo.clear()

    def fsync_dir(self, d: Node) -> None:
        dropped = set(d.durable.values()) - set(d.entries.values())
        d.durable = dict(d.entries)
        for ino in dropped:
            n = self.nodes.get(ino)
            if n is not None:
                self.maybe_free(n)
        if self.armed is not None and self.armed[0] == self.name_of(d) and (
                dropped or not self.armed[1]):
            self.armed = None
            self.cut()
            self.dead = True

    def name_of(self, d: Node) -> bytes:
        for parent in self.nodes.values():
            for name, ino in parent.entries.items():
                if ino == d.ino and parent.is_dir:
                    return name
        return b"/"

    # --- the power cut ------------------------------------------------------------

    def pending(self) -> dict[str, int]:
        """How much a cut would undo now."""
        files = sum(1 for n in self.nodes.values()
                    if n.is_file and (n.undo or self.size(n) != n.dsize))
        dirs = sum(1 for n in self.nodes.values() if n.is_dir and n.entries != n.durable)
        return {"files": files, "dirs": dirs}

    def cut(self, torn: random.Random | None = None) -> dict[str, int]:
        """Put the durable tree back (see the module docstring); count what was undone."""
        stats = {"files-reverted": 0, "bytes-dropped": 0, "bytes-kept": 0, "entries-undone": 0,
                 "nodes-lost": 0}
        reachable = {ROOT}
        todo = [ROOT]
        while todo:
            d = self.nodes[todo.pop()]
            if d.entries != d.durable:
                stats["entries-undone"] += len(set(d.entries.items()) ^ set(d.durable.items()))
            d.entries = dict(d.durable)
            for ino in d.entries.values():
                if ino not in reachable:
                    reachable.add(ino)
                    if self.nodes[ino].is_dir:
                        todo.append(ino)
        for n in list(self.nodes.values()):
            n.handles = 0
            if n.ino not in reachable:
                stats["nodes-lost"] += 1
                self._free(n)
                continue
            n.links = 0
            if n.is_file:
                self._revert(n, torn, stats)
        for d in list(self.nodes.values()):
            if d.is_dir:
                for ino in d.entries.values():
                    self.nodes[ino].links += 1
        self.epoch += 1
        self.cuts += 1
        return stats

    def _revert(self, n: Node, torn: random.Random | None, stats: dict[str, int]) -> None:
        size = self.size(n)
        if not n.undo and size == n.dsize:
            return
        stats["files-reverted"] += 1
        keep = n.dsize
        undo = n.undo
        if torn is not None and undo:
            # Overwrites (of space allocated ahead, say): the first few made it
            # to disk, the next one in part, no later one, nor appended bytes.
            k = torn.randint(0, len(undo))
            if k < len(undo):
                offset, data = undo[k]
                part = torn.randint(0, len(data))
                undo = [*undo[:k], (offset + part, data[part:]), *undo[k + 1:]]
                undo = undo[k:]
            else:
                undo = []
                keep = torn.randint(n.dsize, size)
        elif torn is not None and size > n.dsize:
            keep = torn.randint(n.dsize, size)  # only appended bytes: some made it to disk
        for offset, data in reversed(undo):
            os.pwrite(n.fd, data, offset)
        os.ftruncate(n.fd, keep)
        stats["bytes-dropped"] += max(size - keep, 0)
        stats["bytes-kept"] += keep - n.dsize
        n.dsize = keep
        n.undo.clear()


def entry(m: Model, n: Node) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino = n.ino
    a.generation = 0
    a.entry_timeout = 0  # the tree changes under the kernel at a cut: it must always ask
    a.attr_timeout = 0
    a.st_mode = n.mode
    a.st_nlink = max(n.links, 1) if not n.is_dir else 2
    a.st_uid, a.st_gid = n.uid, n.gid
    a.st_rdev = 0
    size = m.size(n)
    a.st_size = size
    a.st_blksize = 4096
    a.st_blocks = (size + 511) // 512
    a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = n.atime, n.mtime, n.ctime
    return a


class PowerCutOps(pyfuse3.Operations):
    """The FUSE requests, on a Model. Handles: fh -> (ino, epoch, append)."""

    supports_dot_lookup = False

    def __init__(self, model: Model):
        super().__init__()
        self.m = model
        self.handles: dict[int, tuple[int, int, bool]] = {}
        self.next_fh = 1

    def _handle(self, fh: int) -> Node:
        h = self.handles.get(fh)
        if h is None or h[1] != self.m.epoch:
            raise pyfuse3.FUSEError(errno.EIO)  # opened before the power went
        return self.m.node(h[0])

    def _open(self, n: Node, append: bool = False) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = (n.ino, self.m.epoch, append)
        n.handles += 1
        return fh

    def _dir(self, ino: int) -> Node:
        d = self.m.node(ino)
        if not d.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return d

    def _child(self, parent: int, name: bytes) -> Node:
        ino = self._dir(parent).entries.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.m.node(ino)

    def _make(self, parent: int, name: bytes, mode: int, ctx) -> Node:
        d = self._dir(parent)
        if name in d.entries:
            raise pyfuse3.FUSEError(errno.EEXIST)
        n = self.m.new_node(mode, ctx.uid, ctx.gid)
        self.m.link(d, name, n)
        return n

    # --- names --------------------------------------------------------------------

    async def lookup(self, parent_inode, name, ctx=None):
        return entry(self.m, self._child(parent_inode, name))

    async def getattr(self, inode, ctx=None):
        return entry(self.m, self.m.node(inode))

    async def setattr(self, inode, attr, fields, fh, ctx):
        n = self.m.node(inode)
        if fields.update_size:
            if not n.is_file:
                raise pyfuse3.FUSEError(errno.EINVAL)
            self.m.truncate(n, attr.st_size)
        if fields.update_mode:
            n.mode = stat.S_IFMT(n.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            n.uid = attr.st_uid
        if fields.update_gid:
            n.gid = attr.st_gid
        if fields.update_atime:
            n.atime = attr.st_atime_ns
        if fields.update_mtime:
            n.mtime = attr.st_mtime_ns
        n.ctime = time.time_ns()
        return entry(self.m, n)

    async def forget(self, inode_list):
        pass  # nodes live while something names them or has them open (Model.maybe_free)

    async def mkdir(self, parent_inode, name, mode, ctx):
        return entry(self.m, self._make(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode), ctx))

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if not stat.S_ISREG(mode):
            raise pyfuse3.FUSEError(errno.EPERM)  # only regular files here
        return entry(self.m, self._make(parent_inode, name, mode, ctx))

    async def create(self, parent_inode, name, mode, flags, ctx):
        n = self._make(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode), ctx)
        fh = self._open(n, bool(flags & os.O_APPEND))
        return pyfuse3.FileInfo(fh=fh, direct_io=True), entry(self.m, n)

    async def symlink(self, parent_inode, name, target, ctx):
        n = self._make(parent_inode, name, stat.S_IFLNK | 0o777, ctx)
        n.target = target
        return entry(self.m, n)

    async def readlink(self, inode, ctx):
        return self.m.node(inode).target

    async def link(self, inode, new_parent_inode, new_name, ctx):
        n = self.m.node(inode)
        d = self._dir(new_parent_inode)
        if n.is_dir:
            raise pyfuse3.FUSEError(errno.EPERM)
        if new_name in d.entries:
            raise pyfuse3.FUSEError(errno.EEXIST)
        self.m.link(d, new_name, n)
        return entry(self.m, n)

    async def unlink(self, parent_inode, name, ctx):
        n = self._child(parent_inode, name)
        if n.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        self.m.unlink(self.m.node(parent_inode), name)
        self.m.maybe_free(n)

    async def rmdir(self, parent_inode, name, ctx):
        n = self._child(parent_inode, name)
        if not n.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if n.entries:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        self.m.unlink(self.m.node(parent_inode), name)
        self.m.maybe_free(n)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        n = self._child(parent_inode_old, name_old)
        dst = self._dir(parent_inode_new)
        old = dst.entries.get(name_new)
        if old == n.ino:
            return
        replaced = None
        if old is not None:
            if flags & pyfuse3.RENAME_NOREPLACE:
                raise pyfuse3.FUSEError(errno.EEXIST)
            replaced = self.m.node(old)
            if replaced.is_dir and not n.is_dir:
                raise pyfuse3.FUSEError(errno.EISDIR)
            if n.is_dir and not replaced.is_dir:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            if replaced.is_dir and replaced.entries:
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)
            self.m.unlink(dst, name_new)
        self.m.unlink(self.m.node(parent_inode_old), name_old)
        self.m.link(dst, name_new, n)
        if replaced is not None:
            self.m.maybe_free(replaced)

    # --- files --------------------------------------------------------------------

    async def open(self, inode, flags, ctx):
        n = self.m.node(inode)
        if not n.is_file:
            raise pyfuse3.FUSEError(errno.EISDIR if n.is_dir else errno.EINVAL)
        # direct_io: no page cache in the kernel, every write comes here at once.
        return pyfuse3.FileInfo(fh=self._open(n, bool(flags & os.O_APPEND)), direct_io=True)

    async def read(self, fh, off, size):
        return os.pread(self._handle(fh).fd, size, off)

    async def write(self, fh, off, buf):
        n = self._handle(fh)
        if self.handles[fh][2]:
            off = self.m.size(n)  # O_APPEND: at the end as this file system sees it
        return self.m.write(n, off, bytes(buf))

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        self.m.fsync_file(self._handle(fh))

    async def release(self, fh):
        h = self.handles.pop(fh, None)
        if h is None or h[1] != self.m.epoch:
            return  # a handle from before a cut: its node's count was reset then
        n = self.m.nodes.get(h[0])
        if n is not None:
            n.handles -= 1
            self.m.maybe_free(n)

    # --- directories --------------------------------------------------------------

    async def opendir(self, inode, ctx):
        return self._open(self._dir(inode))

    async def readdir(self, fh, start_id, token):
        d = self._handle(fh)
        names = sorted(d.entries.items())
        for i in range(start_id, len(names)):
            name, ino = names[i]
            n = self.m.nodes.get(ino)
            if n is None:
                continue
            if not pyfuse3.readdir_reply(token, name, entry(self.m, n), i + 1):
                break

    async def fsyncdir(self, fh, datasync):
        self.m.fsync_dir(self._handle(fh))

    async def releasedir(self, fh):
        await self.release(fh)

    async def statfs(self, ctx):
        st = os.statvfs(self.m.backing)
        out = pyfuse3.StatvfsData()
        for attr in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):
            setattr(out, attr, getattr(st, attr))
        return out


# --- the control socket -------------------------------------------------------------


def command(m: Model, line: str) -> str:
    """One control command; the answer line (`ok k=v ...` or `error ...`)."""
    words = line.split()
    if words == ["ping"]:
        return "ok"
    if words == ["pending"]:
        return "ok " + " ".join(f"{k}={v}" for k, v in m.pending().items())
    if len(words) in (2, 3) and words[0] == "arm" and words[2:] in ([], ["drop"]):
        m.armed = (words[1].encode(), words[2:] == ["drop"])
        return "ok"
    if words == ["status"]:
        return f"ok armed={int(m.armed is not None)} dead={int(m.dead)} cuts={m.cuts}"
    if words == ["resume"]:
        m.dead = False
        return "ok"
    if words == ["cut"] or (len(words) == 3 and words[:2] == ["cut", "torn"]):
        torn = random.Random(int(words[2])) if len(words) == 3 else None
        return "ok " + " ".join(f"{k}={v}" for k, v in m.cut(torn).items())
    return (f"error unknown command {line.strip()!r} "
            "(ping, pending, status, cut, cut torn SEED, arm DIRNAME [drop], resume)")


async def serve_control(m: Model, path: Path, ready: trio.Event) -> None:
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    path.unlink(missing_ok=True)
    await sock.bind(str(path))
    sock.listen(8)
    ready.set()
    async with trio.open_nursery() as nursery:
        while True:
            conn, _ = await sock.accept()
            nursery.start_soon(_control_conn, m, trio.SocketStream(conn))


async def _control_conn(m: Model, stream: trio.SocketStream) -> None:
    buf = b""
    async with stream:
        while True:
            data = await stream.receive_some(4096)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                await stream.send_all(command(m, line.decode()).encode() + b"\n")


async def run(backing: Path, mount: Path, control: Path) -> None:
    m = Model(backing)
    opts = set(pyfuse3.default_options)
    opts.add("fsname=powercutfs")
    pyfuse3.init(PowerCutOps(m), str(mount), opts)
    try:
        async with trio.open_nursery() as nursery:
            ready = trio.Event()
            nursery.start_soon(serve_control, m, control, ready)
            await ready.wait()
            await pyfuse3.main()  # returns when the file system is unmounted
            nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=False)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m tests.support.powercutfs BACKING MOUNT CONTROL", file=sys.stderr)
        return 2
    backing, mount, control = map(Path, argv)
    trio.run(run, backing, mount, control)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
