"""Cheap measurements the storage layer keeps for whoever reports them (the console).

A histogram here is a list of bucket counts, a sum and a count: one bisect
and three additions per observation, no locks, no library (docs/CONSOLE.md
lists what they measure).
"""

from __future__ import annotations

from bisect import bisect_left

# fsync latency, seconds: 50 us (page cache only) to 1 s (a struggling disk).
FSYNC_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                 0.1, 0.25, 0.5, 1.0)
# Records made durable (or written) by one commit.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class Histogram:
    """Counts per bucket (`counts[i]`: observations <= bounds[i]; the last: above all)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value) -> None:  # unannotated: see storage/aof.pxd
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class StorageMetrics:
    """What the journal and the compactor measure as they work."""

    __slots__ = ("fsync_seconds", "commit_records", "last_compaction", "compactions")

    def __init__(self) -> None:
        self.fsync_seconds = Histogram(FSYNC_BUCKETS)
        self.commit_records = Histogram(BATCH_BUCKETS)
        self.last_compaction: tuple[float, float] | None = None  # (wall time, seconds)
        self.compactions = 0
