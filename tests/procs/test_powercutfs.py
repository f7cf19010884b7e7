"""The power-cut file system on its own: a cut keeps exactly what strict POSIX made durable."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..support.powercut import PowerCutMount, mounted
from ..support.procs import wait_for


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[PowerCutMount]:
    yield from mounted(tmp_path)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes, sync: bool = False, datasync: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
        if datasync:
            os.fdatasync(fd)
    finally:
        os.close(fd)


def test_a_write_without_fsync_is_lost(disk: PowerCutMount) -> None:
    f = disk.path / "f"
    write_file(f, b"durable", sync=True)
    fsync_path(disk.path)
    with open(f, "ab") as out:
        out.write(b" and not")
    assert f.read_bytes() == b"durable and not"
    assert disk.pending() == {"files": 1, "dirs": 0}
    got = disk.cut()
    assert got["bytes-dropped"] == len(b" and not")
    assert f.read_bytes() == b"durable"
    assert disk.pending() == {"files": 0, "dirs": 0}


def test_a_file_never_fsynced_is_empty_after_the_cut(disk: PowerCutMount) -> None:
    f = disk.path / "f"
    write_file(f, b"page cache only")
    fsync_path(disk.path)  # the name is durable, the bytes are not
    disk.cut()
    assert f.read_bytes() == b""


def test_fsynced_data_and_a_dir_fsynced_create_survive(disk: PowerCutMount) -> None:
    f = disk.path / "f"
    write_file(f, b"x" * 100_000, sync=True)
    g = disk.path / "g"
    write_file(g, b"by fdatasync", datasync=True)
    fsync_path(disk.path)
    assert disk.cut()["nodes-lost"] == 0
    assert sorted(os.listdir(disk.path)) == ["f", "g"]
    assert f.read_bytes() == b"x" * 100_000
    assert g.read_bytes() == b"by fdatasync"


def test_an_fsynced_file_whose_directory_was_not_fsynced_disappears(disk: PowerCutMount) -> None:
    f = disk.path / "f"
    write_file(f, b"fsynced", sync=True)
    assert disk.cut()["nodes-lost"] == 1
    assert not f.exists()
    assert os.listdir(disk.path) == []


def test_a_rename_without_a_directory_fsync_is_undone(disk: PowerCutMount) -> None:
    tmp, final = disk.path / "snap.tmp", disk.path / "snap"
    write_file(tmp, b"the snapshot", sync=True)
    fsync_path(disk.path)
    os.rename(tmp, final)
    assert os.listdir(disk.path) == ["snap"]
    disk.cut()
    assert os.listdir(disk.path) == ["snap.tmp"]
    assert tmp.read_bytes() == b"the snapshot"
    # ... and with the directory fsync it stays
    os.rename(tmp, final)
    fsync_path(disk.path)
    disk.cut()
    assert os.listdir(disk.path) == ["snap"]
    assert final.read_bytes() == b"the snapshot"


def test_a_rename_over_a_file_is_undone(disk: PowerCutMount) -> None:
    old, new = disk.path / "current", disk.path / "next"
    write_file(old, b"old", sync=True)
    write_file(new, b"new", sync=True)
    fsync_path(disk.path)
    os.replace(new, old)
    disk.cut()
    assert old.read_bytes() == b"old" and new.read_bytes() == b"new"


def test_an_unlink_without_a_directory_fsync_comes_back(disk: PowerCutMount) -> None:
    f = disk.path / "segment"
    write_file(f, b"records", sync=True)
    fsync_path(disk.path)
    f.unlink()
    disk.cut()
    assert f.read_bytes() == b"records"
    f.unlink()
    fsync_path(disk.path)
    disk.cut()
    assert not f.exists()


def test_mkdir_needs_its_parent_fsynced(disk: PowerCutMount) -> None:
    d = disk.path / "snapshots"
    d.mkdir()
    write_file(d / "1.snap", b"snapshot", sync=True)
    fsync_path(d)  # the file is durable in d, but d itself is not durable in its parent
    disk.cut()
    assert not d.exists()
    d.mkdir()
    fsync_path(disk.path)
    write_file(d / "1.snap", b"snapshot", sync=True)
    fsync_path(d)
    disk.cut()
    assert (d / "1.snap").read_bytes() == b"snapshot"


def test_overwrites_and_truncation_go_back_to_the_durable_bytes(disk: PowerCutMount) -> None:
    f = disk.path / "f"
    write_file(f, bytes(range(256)) * 40, sync=True)
    fsync_path(disk.path)
    fd = os.open(f, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff" * 100, 1000)
        os.ftruncate(fd, 500)
        os.pwrite(fd, b"\xee" * 3000, 4000)  # a hole, then past the old end
        os.ftruncate(fd, 20)
    finally:
        os.close(fd)
    disk.cut()
    assert f.read_bytes() == bytes(range(256)) * 40


def test_a_torn_cut_keeps_a_prefix_of_the_appended_bytes(disk: PowerCutMount) -> None:
    f = disk.path / "f"
    write_file(f, b"head", sync=True)
    fsync_path(disk.path)
    tail = os.urandom(10_000)
    kept = set()
    for seed in range(6):
        with open(f, "ab") as out:
            out.write(tail)
        got = disk.cut(torn_seed=seed)
        data = f.read_bytes()
        assert data == (b"head" + tail)[:len(data)] and len(data) >= 4
        assert got["bytes-kept"] == len(data) - 4
        kept.add(len(data))
        fd = os.open(f, os.O_RDWR)
        os.ftruncate(fd, 4)
        os.fsync(fd)
        os.close(fd)
    assert len(kept) > 1, "every torn cut kept the same prefix"


def test_a_torn_cut_keeps_a_prefix_of_overwrites_into_allocated_space(
        disk: PowerCutMount) -> None:
    """How an AOF segment is written (aof.SegmentWriter): space allocated ahead
    and fsynced, then records written into it. A torn cut keeps the first few
    writes, the next one in part, and zeros after: never a later write alone."""
    f = disk.path / "seg"
    fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, 64 << 10)  # emulated by glibc here: FUSE has no fallocate
    os.fsync(fd)
    os.close(fd)
    fsync_path(disk.path)
    writes = [os.urandom(1000).replace(b"\0", b"\1") for _ in range(8)]
    kept = set()
    for seed in range(8):
        fd = os.open(f, os.O_RDWR)
        for i, w in enumerate(writes):
            os.pwrite(fd, w, i * 1000)
        os.close(fd)
        disk.cut(torn_seed=seed)
        data = f.read_bytes()
        assert len(data) == 64 << 10  # the allocation was durable
        k = len(data.rstrip(b"\0"))  # the written bytes hold no zero
        assert data[:k] == b"".join(writes)[:k] and data[k:] == bytes(len(data) - k)
        kept.add(k)
        fd = os.open(f, os.O_RDWR)  # zeros again, durably, for the next round
        os.pwrite(fd, bytes(8000), 0)
        os.fsync(fd)
        os.close(fd)
    assert len(kept) > 1, "every torn cut kept the same prefix"


def test_handles_from_before_the_cut_are_dead(disk: PowerCutMount) -> None:
    f = disk.path / "f"
    write_file(f, b"x", sync=True)
    fsync_path(disk.path)
    fd = os.open(f, os.O_RDWR)
    try:
        disk.cut()
        with pytest.raises(OSError) as e:
            os.write(fd, b"after the power went")
        assert e.value.errno == errno.EIO
    finally:
        os.close(fd)
    assert f.read_bytes() == b"x"


def test_a_deleted_file_stays_readable_while_open_and_its_bytes_go_after(
        disk: PowerCutMount) -> None:
    f = disk.path / "f"
    write_file(f, b"still here", sync=True)
    fsync_path(disk.path)
    fd = os.open(f, os.O_RDONLY)
    f.unlink()
    fsync_path(disk.path)
    assert os.pread(fd, 10, 0) == b"still here"
    assert len(os.listdir(disk.backing)) == 1
    os.close(fd)  # the kernel sends the release after close() returns
    wait_for(lambda: os.listdir(disk.backing) == [], 10.0, "the deleted file's bytes to go")


def test_an_armed_cut_comes_right_after_that_directory_fsync(disk: PowerCutMount) -> None:
    d = disk.path / "snapshots"
    d.mkdir()
    fsync_path(disk.path)
    write_file(d / "new", b"renamed and fsynced", sync=True)
    write_file(disk.path / "unsynced", b"lost")
    disk.arm("snapshots", drop=True)
    fsync_path(d)  # adds an entry, removes none: not the moment
    assert not disk.fired()
    (d / "new").unlink()
    fsync_path(d)  # the removal is durable, and then the power goes
    assert disk.fired()
    with pytest.raises(OSError) as e:
        os.listdir(disk.path)
    assert e.value.errno == errno.EIO
    disk.resume()
    assert os.listdir(disk.path) == ["snapshots"] and os.listdir(d) == []
