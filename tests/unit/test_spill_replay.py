"""Replaying puts under a body budget when every job of a file was deleted in between.

Found by the power-cut rounds: recovery (and the compactor's fold) cached a
file's key, the store closed the file once no job referred to it, and the
next spilled put of that file got the stale key: start-up died with a
KeyError.
"""

from __future__ import annotations

from pathlib import Path

from smallstalk.core import records as r
from smallstalk.storage import compactor
from smallstalk.storage.aof import SegmentWriter
from smallstalk.storage.bodies import BodyStore
from smallstalk.storage.recovery import recover


def write_log(data: Path) -> None:
    """put 1, delete 1, put 2 (both bodies past a 10-byte budget), then the next segment."""
    (data / "aof").mkdir(parents=True)
    seg = SegmentWriter(data / "aof", 1)
    recs = [r.Put(1, 0, 0, 1, "default", 0, 0, 60, b"a" * 100),
            r.Delete(2, 0, 0, 1),
            r.Put(3, 0, 0, 2, "default", 0, 0, 60, b"b" * 100)]
    for rec in recs:
        seg.append(r.encode(rec), rec.seq)
    seg.write()
    seg.sync()
    seg.close()
    SegmentWriter(data / "aof", 4).close()


def test_recovery_spills_a_put_after_the_file_lost_every_reference(tmp_path: Path) -> None:
    write_log(tmp_path)
    store = BodyStore(max_memory=10)
    state = recover(tmp_path, bodies=store).state
    assert sorted(state.jobs) == [2]
    assert type(state.jobs[2].body) is int, "the body was not left on disk"
    assert store.read(state.jobs[2].body) == b"b" * 100
    store.close()


def test_the_compactor_folds_them_under_a_budget(tmp_path: Path) -> None:
    write_log(tmp_path)
    snap = compactor.fold(tmp_path, [tmp_path / "aof" / f"{1:020d}.aof"], max_memory=10)
    state = recover(tmp_path).state
    assert snap.exists() and sorted(state.jobs) == [2] and state.jobs[2].body == b"b" * 100
