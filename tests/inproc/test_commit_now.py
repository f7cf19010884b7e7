"""`Journal.commit_now`: a turn's commit in place under `never` and `everysec`,
declined (nothing written) where a rotation must follow or an fsync is due;
`await commit()` then writes and rotates. Each commit counts in the
commit-size histogram the console reports."""

from __future__ import annotations

from pathlib import Path

from smallstalk.core import records as r
from smallstalk.storage import datadir
from smallstalk.storage.aof import FSYNC_ALWAYS, FSYNC_NEVER, list_segments
from smallstalk.storage.journal import Journal


def stage(j: Journal, n: int) -> None:
    for _ in range(n):
        seq = j.take_seq()
        j.append(r.Put(seq, 1, 1, seq, "default", 0, 0, 60, b"body"))


async def test_commit_now_writes_in_place_and_declines_where_the_segment_fills(
        tmp_path: Path) -> None:
    j = Journal(tmp_path, 1, fsync=FSYNC_NEVER, segment_records=3)
    try:
        stage(j, 2)
        assert j.commit_now()
        assert (j.written_seq, j.committed_seq) == (2, 2) and not j.has_pending()
        h = j.metrics.commit_records
        assert (h.count, h.sum) == (1, 2)
        assert h.counts[h.bounds.index(2)] == 1  # a batch of two records
        assert len(list_segments(datadir.aof_dir(tmp_path))) == 1

        stage(j, 1)  # the third record fills the segment: a rotation follows
        assert not j.commit_now()
        assert j.written_seq == 2 and j.has_pending() and h.count == 1
        await j.commit()
        assert (j.written_seq, j.committed_seq) == (3, 3) and not j.has_pending()
        assert h.count == 2
        assert len(list_segments(datadir.aof_dir(tmp_path))) == 2  # rotated

        assert j.commit_now()  # nothing staged: nothing to do
        assert h.count == 2
    finally:
        j.close()


def test_commit_now_declines_under_always(tmp_path: Path) -> None:
    j = Journal(tmp_path, 1, fsync=FSYNC_ALWAYS)
    try:
        stage(j, 1)
        assert not j.commit_now()
        assert j.written_seq == 0 and j.has_pending()
    finally:
        j.close()
