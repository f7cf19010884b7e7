"""The compactor in a real server: snapshots appear, folded segments go (or stay, by retention)."""

from __future__ import annotations

from pathlib import Path

import greenstalk

from smallstalk.storage import aof
from smallstalk.storage.recovery import recover

from ..support.procs import start_smallstalk, wait_for


def run_load(tmp_path: Path, *flags: str) -> tuple[Path, list[int]]:
    data = tmp_path / "data"
    srv = start_smallstalk(tmp_path, "--segment-records", "5", "--compact-interval", "0.2",
                           "--compact-segments", "2", *flags, data_dir=data)
    try:
        with greenstalk.Client(("127.0.0.1", srv.port)) as c:
            ids = [c.put(f"job {i}") for i in range(60)]
            for job_id in ids[:30]:
                c.delete(job_id)
            # Until a snapshot covers the load and the older ones are gone.
            wait_for(lambda: [seq >= 60 for seq, _ in aof.list_snapshots(data / "snapshots")]
                     == [True])
    finally:
        srv.stop()
    return data, ids


def test_compaction_folds_and_deletes_segments(tmp_path: Path) -> None:
    data, ids = run_load(tmp_path)
    snaps = aof.list_snapshots(data / "snapshots")
    assert len(snaps) == 1
    segments = aof.list_segments(data / "aof")
    assert all(first > snaps[0][0] - 5 for first, _ in segments), segments
    state = recover(data, repair=False).state
    assert sorted(state.jobs) == ids[30:]


def test_retention_keeps_folded_segments(tmp_path: Path) -> None:
    data, ids = run_load(tmp_path, "--keep-segments-hours", "1")
    snap_seq = aof.list_snapshots(data / "snapshots")[-1][0]
    segments = aof.list_segments(data / "aof")
    assert segments[0][0] == 1, "the oldest history is still there"
    assert len([s for s in segments if s[0] <= snap_seq]) >= 10
    assert sorted(recover(data, repair=False).state.jobs) == ids[30:]


def test_retention_by_bytes(tmp_path: Path) -> None:
    data, ids = run_load(tmp_path, "--keep-segments-bytes", "600")
    snap_seq = aof.list_snapshots(data / "snapshots")[-1][0]
    kept = [p for first, p in aof.list_segments(data / "aof") if first <= snap_seq - 5]
    assert 0 < sum(p.stat().st_size for p in kept) <= 600
