"""Segment files written straight from records, for tests that build a data
directory by hand (damage, gaps, big recoveries) without running a server."""

from __future__ import annotations

from pathlib import Path

from smallstalk.core import records as r
from smallstalk.storage import aof


def write_segment(aof_dir: Path, recs: list) -> Path:
    """One segment in `aof_dir` holding `recs` (named by the first one's seq)."""
    aof_dir.mkdir(parents=True, exist_ok=True)
    w = aof.SegmentWriter(aof_dir, recs[0].seq)
    for rec in recs:
        w.append(r.encode(rec), rec.seq)
    w.write()
    w.close()
    return w.path
