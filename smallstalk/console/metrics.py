"""`/metrics`: the server's numbers in the Prometheus text format.

A scrape first takes a `Snapshot` (plain data, read inside loop turns by
views.py, tubes in chunks), then renders it with prometheus_client's own
exposition code in a worker thread: the rendering of many tubes costs CPU
that must not run in the loop's thread. A custom collector yields the
families from the snapshot; each server has its own registry (never the
library's global one). Names follow the common beanstalkd exporters
(`beanstalkd_<stats key>`, `beanstalkd_tube_<stats-tube key>{tube=...}`);
what only smallstalk knows is `smallstalk_*` (docs/CONSOLE.md has the table).
"""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from smallstalk.console import views
from smallstalk.server import stats as server_stats
from smallstalk.server.loop import MutationLoop

# `stats` keys that are beanstalkd's (the rest of `stats` is smallstalk's own).
BEANSTALKD_STATS_END = "platform"
TUBE_STATS_END = "pause-time-left"
SKIP = {"pid", "version", "id", "hostname", "os", "platform", "name", "smallstalk-version",
        "role", "history", "replica-of"}


@attrs.define
class Snapshot:
    server: list[tuple[str, Any]]
    tubes: list[dict[str, Any]]
    disk: dict[str, int]
    rss: int
    fsync: tuple[tuple[float, ...], list[int], float, int] | None
    batches: tuple[tuple[float, ...], list[int], float, int] | None
    compaction: tuple[float, float] | None
    compactions: int
    feeds: list[dict[str, Any]]
    loop_seconds: float  # time spent inside loop turns to take it
    loop_longest: float  # ...in the longest of those turns


def _hist(h) -> tuple[tuple[float, ...], list[int], float, int]:
    return h.bounds, list(h.counts), h.sum, h.count


async def take(lp: MutationLoop, data_dir) -> Snapshot:
    """Read everything a scrape reports; the tubes in chunks of TUBE_CHUNK, a turn each."""
    spent, longest = 0.0, 0.0

    def timed(fn, *args):
        nonlocal spent, longest
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            took = time.perf_counter() - t0
            spent += took
            longest = max(longest, took)

    def server_part(lp: MutationLoop) -> tuple:
        j = lp.journal
        m = j.metrics if j is not None else None
        stats = server_stats.server_stats(lp)
        feeds = [{"session": sid, "acked": f.acked} for sid, f in sorted(lp.feeds.items())]
        return (stats, list(lp.state.tube_order), feeds,
                _hist(m.fsync_seconds) if m else None, _hist(m.commit_records) if m else None,
                m.last_compaction if m else None, m.compactions if m else 0)

    stats, names, feeds, fsync, batches, compaction, compactions = await lp.call(
        timed, server_part, lp)
    rows: list[dict[str, Any]] = []
    for i in range(0, len(names), views.TUBE_CHUNK):
        rows += await lp.call(timed, views.tube_rows, lp, names[i:i + views.TUBE_CHUNK])
    return Snapshot(stats, rows, views.disk_use(data_dir), views.rss_bytes(), fsync, batches,
                    compaction, compactions, feeds, spent, longest)


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (bytes, str)):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _metric_name(key: str) -> str:
    return key.replace("-", "_")


class SnapshotCollector:
    """Yields the families of the snapshot it was last handed."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        own = False
        stats = dict(snap.server)
        for key, value in snap.server:
            prefix = "smallstalk_" if own else "beanstalkd_"
            if key == BEANSTALKD_STATS_END:
                own = True
            if key in SKIP:
                continue
            number = _number(value)
            if number is not None:
                yield GaugeMetricFamily(prefix + _metric_name(key), f"stats: {key}", value=number)
        yield from self._tubes(snap.tubes)
        info = GaugeMetricFamily("smallstalk_info", "version and role (value 1)",
                                 labels=["version", "protocol", "role"])
        info.add_metric([str(stats.get("smallstalk-version", "")), str(stats.get("version", "")),
                         _text(stats.get("role", ""))], 1)
        yield info
        for name, doc, value in (
            ("smallstalk_aof_bytes", "bytes of AOF segments on disk", snap.disk["aof_bytes"]),
            ("smallstalk_aof_segments", "AOF segment files", snap.disk["segments"]),
            ("smallstalk_snapshot_bytes", "bytes of snapshot files", snap.disk["snapshot_bytes"]),
            ("smallstalk_snapshots", "snapshot files", snap.disk["snapshots"]),
            ("smallstalk_process_resident_bytes", "resident memory of the server", snap.rss),
            ("smallstalk_scrape_loop_seconds", "time this scrape spent inside loop turns",
             snap.loop_seconds),
            ("smallstalk_scrape_loop_longest_seconds",
             "the longest loop turn this scrape took", snap.loop_longest),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        if snap.compaction is not None:
            at, took = snap.compaction
            yield GaugeMetricFamily("smallstalk_last_compaction_timestamp_seconds",
                                    "when the last compaction ended (unix time)", value=at)
            yield GaugeMetricFamily("smallstalk_last_compaction_duration_seconds",
                                    "how long the last compaction took", value=took)
        yield CounterMetricFamily("smallstalk_compactions", "compactions since start",
                                  value=snap.compactions)
        for name, doc, h in (
            ("smallstalk_fsync_seconds", "fsync latency of the AOF", snap.fsync),
            ("smallstalk_commit_records", "records made durable (or written) per commit",
             snap.batches),
        ):
            if h is not None:
                yield _histogram(name, doc, h)
        if snap.feeds:
            acked = GaugeMetricFamily("smallstalk_feed_acked_seq",
                                      "last seq a replica has on disk", labels=["session"])
            lag = GaugeMetricFamily("smallstalk_feed_lag_records",
                                    "records a replica has not acknowledged", labels=["session"])
            last = _number(stats.get("last-seq")) or 0
            for f in snap.feeds:
                acked.add_metric([str(f["session"])], f["acked"])
                lag.add_metric([str(f["session"])], max(last - f["acked"], 0))
            yield acked
            yield lag

    def _tubes(self, rows: list[dict[str, Any]]) -> Iterator[Metric]:
        if not rows:
            return
        families: dict[str, GaugeMetricFamily] = {}
        keys = [k for k in rows[0] if k != "name" and k != "next-ready-age"]
        for key in keys:
            prefix = "smallstalk_tube_" if keys.index(key) > keys.index(TUBE_STATS_END) \
                else "beanstalkd_tube_"
            families[key] = GaugeMetricFamily(prefix + _metric_name(key), f"stats-tube: {key}",
                                              labels=["tube"])
        for row in rows:
            label = [row["name"]]
            for key, fam in families.items():
                number = _number(row.get(key))
                if number is not None:
                    fam.add_metric(label, number)
        yield from families.values()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _histogram(name: str, doc: str, h) -> HistogramMetricFamily:
    bounds, counts, total, count = h
    buckets, running = [], 0
    for bound, n in zip(bounds, counts, strict=False):
        running += n
        buckets.append((repr(float(bound)), running))
    buckets.append(("+Inf", count))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class Exporter:
    """One server's registry and collector.

    The library's exposition costs ~30 us of CPU per sample here (10,000
    tubes: 200,000 samples, seconds): rendered in a thread of the server it
    would share the GIL with the loop for that long. So past
    `CHILD_RENDER_TUBES` tubes the snapshot is pickled to a child process
    (`python -m smallstalk.console.metrics`) that renders it with the same
    collector; below, a worker thread does it.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)
        self._lock = trio.Lock()  # one scrape at a time: the collector holds one snapshot

    async def render(self, lp: MutationLoop, data_dir) -> bytes:
        async with self._lock:
            snap = await take(lp, data_dir)
            if len(snap.tubes) > CHILD_RENDER_TUBES:
                data = await trio.to_thread.run_sync(pickle.dumps, snap, pickle.HIGHEST_PROTOCOL)
                proc = await trio.run_process(
                    [sys.executable, "-m", "smallstalk.console.metrics"], stdin=data,
                    capture_stdout=True, capture_stderr=True)
                return proc.stdout
            self.collector.snapshot = snap
            try:
                return await trio.to_thread.run_sync(generate_latest, self.registry)
            finally:
                self.collector.snapshot = None


CHILD_RENDER_TUBES = 200


def main() -> None:
    """The child: a pickled Snapshot on stdin, its exposition on stdout."""
    exporter = Exporter()
    exporter.collector.snapshot = pickle.load(sys.stdin.buffer)
    sys.stdout.buffer.write(generate_latest(exporter.registry))


if __name__ == "__main__":
    main()
