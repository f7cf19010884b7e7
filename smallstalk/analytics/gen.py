"""Synthetic but valid AOF data directories, for sizing the analytics pipeline.

    python -m smallstalk.analytics.gen OUT --records 10000000 --servers 2

writes `OUT/server-1/aof/*.aof`, `OUT/server-2/...`: segment files made with
smallstalk's own `records.encode`, `aof.header` and `aof.frame`, holding what a
busy server would log. A small discrete-event simulation drives them: per tube
a Poisson stream of puts whose rate follows a daily curve (quiet at night,
busy in the afternoon), a pool of workers per tube (one tube under-provisioned,
so it backs up at the peak), service times from a log-normal distribution,
and the outcomes workers have in real life: delete, release (now or with a
delay), bury (kicked back later by an operator connection), touch, run past
the TTR (the server times the job out), or disconnect while holding a job.
Some puts are delayed (the server promotes them); one server restart happens
at about 60% of the records. Every record applies to `State` (recovery
accepts the directory; the tests check this on a small run).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from collections import deque
from pathlib import Path

from smallstalk.core import records as r
from smallstalk.core.model import NS
from smallstalk.storage import aof

DAY_NS = 86_400 * NS
DEFAULT_START_NS = 1_767_225_600 * NS  # 2026-01-01T00:00:00Z


class SegmentFiles:
    """Writes records into `aof/<first seq>.aof` files of `per_segment` records each."""

    def __init__(self, directory: Path, per_segment: int):
        self.dir = directory / "aof"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.per_segment = per_segment
        self.f = None
        self.count = 0
        self.buf = bytearray()
        self.seq = 0
        self.written = 0
        self.bytes = 0

    def add(self, rec: r.Record) -> None:
        if self.f is None or self.count >= self.per_segment:
            self._rotate(rec.seq)
        self.buf += aof.frame(r.encode(rec))
        self.count += 1
        self.written += 1
        if len(self.buf) > 1 << 20:
            self._flush()

    def _flush(self) -> None:
        if self.f is not None and self.buf:
            self.f.write(self.buf)
            self.bytes += len(self.buf)
            self.buf.clear()

    def _rotate(self, first_seq: int) -> None:
        self.close()
        self.f = open(self.dir / aof.segment_name(first_seq), "wb")  # noqa: SIM115
        self.f.write(aof.header(aof.SEGMENT_MAGIC, first_seq))
        self.bytes += aof.HEADER_SIZE
        self.count = 0

    def close(self) -> None:
        self._flush()
        if self.f is not None:
            self.f.close()
            self.f = None


class Done(Exception):
    """The simulation logged as many records as asked for."""


class Sim:
    """One server's traffic. `run(n)` logs exactly n records.

    Stopping in the middle of an event is fine: every prefix of a valid log
    is a valid log.
    """

    def __init__(self, out: SegmentFiles, rng: random.Random, start_ns: int, span_ns: int,
                 n_records: int, tubes: int):
        self.out = out
        self.rng = rng
        self.now = start_ns
        self.start = start_ns
        self.seq = 0
        self.limit = n_records
        self.next_job = 1
        self.next_conn = 1
        self.tubes = [f"tube-{i}" for i in range(tubes)]
        # Job rates: ~3.4 records per job on average.
        total_rate = n_records / 3.4 / (span_ns / NS)  # jobs per second
        weights = [1.0 / (i + 1) for i in range(tubes)]
        scale = total_rate / sum(weights)
        self.rate = {t: w * scale for t, w in zip(self.tubes, weights, strict=True)}
        self.service_mean = {t: 0.2 + 2.0 * i for i, t in enumerate(self.tubes)}  # seconds
        self.ready: dict[str, deque[int]] = {t: deque() for t in self.tubes}
        self.buried: dict[str, deque[int]] = {t: deque() for t in self.tubes}
        self.job_tube: dict[int, str] = {}
        self.job_ttr: dict[int, int] = {}
        self.state: dict[int, int] = {}  # id -> 0 ready, 1 delayed, 2 reserved, 3 buried
        self.reserver: dict[int, int] = {}
        self.held: dict[int, set[int]] = {}  # conn -> reserved job ids
        self.heap: list[tuple[int, int, str, tuple]] = []
        self.tick = 0
        self.epoch = 0  # bumped by a restart: events of older connections are void
        self.idle: dict[str, list[int]] = {t: [] for t in self.tubes}
        self.producers: dict[str, int] = {}
        self.admin = 0
        self.workers: dict[str, int] = {}
        for i, t in enumerate(self.tubes):
            # enough workers for the daily peak (1.8x the mean rate), except the
            # last tube: provisioned for the mean only, it backs up every afternoon
            load = self.rate[t] * self.service_mean[t]
            self.workers[t] = max(1, math.ceil(load * (1.15 if i == tubes - 1 else 2.0)))

    # -- plumbing --
    def log(self, cls: type, *fields: object) -> None:
        if self.seq >= self.limit:
            raise Done
        self.seq += 1
        self.out.add(cls(self.seq, self.now, *fields))

    def at(self, when: int, kind: str, *data: object) -> None:
        self.tick += 1
        heapq.heappush(self.heap, (when, self.tick, kind, (self.epoch, *data)))

    def conn(self) -> int:
        self.next_conn += 1
        return self.next_conn - 1

    def day_factor(self) -> float:
        # quiet at 04:00 UTC, busiest at 16:00
        phase = ((self.now - self.start) % DAY_NS) / DAY_NS
        return 1.0 + 0.8 * math.sin(2 * math.pi * (phase - 10 / 24))

    # -- connections --
    def connect_all(self) -> None:
        self.admin = self.conn()  # the operator's connection: kicks buried jobs
        for t in self.tubes:
            p = self.conn()
            self.producers[t] = p
            self.log(r.Use, p, t)
            self.idle[t] = []
            for _ in range(self.workers[t]):
                self.new_worker(t)

    def new_worker(self, tube: str) -> None:
        w = self.conn()
        self.log(r.Watch, w, tube)
        self.log(r.Ignore, w, "default")
        self.held[w] = set()
        self.idle[tube].append(w)

    # -- job life --
    def put(self, tube: str) -> None:
        jid = self.next_job
        self.next_job += 1
        rng = self.rng
        delay = rng.choice((5, 10, 30, 60)) if rng.random() < 0.08 else 0
        ttr = rng.choice((30, 60, 120))
        body = BODIES[rng.randrange(len(BODIES))]
        self.log(r.Put, self.producers[tube], jid, tube, rng.randrange(0, 2048), delay, ttr, body)
        self.job_tube[jid] = tube
        self.job_ttr[jid] = ttr
        if delay:
            self.state[jid] = 1
            self.at(self.now + delay * NS, "promote", jid)
        else:
            self.make_ready(jid)

    def make_ready(self, jid: int) -> None:
        self.state[jid] = 0
        self.ready[self.job_tube[jid]].append(jid)

    def dispatch(self, tube: str) -> None:
        """Idle workers of `tube` reserve ready jobs."""
        ready, idle = self.ready[tube], self.idle[tube]
        rng = self.rng
        while ready and idle:
            jid = ready.popleft()
            if self.state.get(jid) != 0:
                continue  # deleted or moved meanwhile
            w = idle.pop()
            self.log(r.Reserve, w, jid)
            self.state[jid] = 2
            self.reserver[jid] = w
            self.held[w].add(jid)
            x = rng.random()
            # log-normal with mean 1 (mu = -sigma^2 / 2), scaled to the tube's mean
            run = int(rng.lognormvariate(-0.32, 0.8) * self.service_mean[tube] * NS)
            ttr_ns = self.job_ttr[jid] * NS
            run = min(run, ttr_ns - NS)
            if x < 0.02:  # the handler dies silently: the server times the job out
                self.at(self.now + ttr_ns, "timeout", jid, w)
                self.at(self.now + run, "free", w, tube)  # the worker goes on with others
                continue
            if x < 0.025:  # the worker dies holding the job
                self.at(self.now + run, "disconnect", w, tube)
            elif x < 0.065:
                self.at(self.now + run, "release", jid, w, tube)
            elif x < 0.075:
                self.at(self.now + run, "bury", jid, w, tube)
            elif x < 0.085:
                self.at(self.now + run // 2, "touch", jid, w)
                self.at(self.now + run, "delete", jid, w, tube)
            else:
                self.at(self.now + run, "delete", jid, w, tube)

    def finish(self, jid: int, w: int, tube: str) -> None:
        self.held[w].discard(jid)
        self.reserver.pop(jid, None)
        self.idle[tube].append(w)

    def handle(self, kind: str, data: tuple) -> None:
        epoch, *args = data
        if epoch != self.epoch and kind not in ("promote", "arrival", "kick", "restart"):
            return  # a connection the restart ended
        if kind == "arrival":
            (tube,) = args
            self.put(tube)
            self.dispatch(tube)
            rate = self.rate[tube] * self.day_factor()
            self.at(self.now + int(self.rng.expovariate(rate) * NS) + 1, "arrival", tube)
        elif kind == "promote":
            (jid,) = args
            due = [jid]
            while self.heap and self.heap[0][2] == "promote" and self.heap[0][0] <= self.now:
                due.append(heapq.heappop(self.heap)[3][1])
            due = [j for j in due if self.state.get(j) == 1]
            if due:
                self.log(r.Promote, due)
                for j in due:
                    self.make_ready(j)
                for t in {self.job_tube[j] for j in due}:
                    self.dispatch(t)
        elif kind == "delete":
            jid, w, tube = args
            if self.reserver.get(jid) == w:
                self.log(r.Delete, w, jid)
                del self.state[jid]
                self.finish(jid, w, tube)
                self.dispatch(tube)
        elif kind == "touch":
            jid, w = args
            if self.reserver.get(jid) == w:
                self.log(r.Touch, w, jid)
        elif kind == "release":
            jid, w, tube = args
            if self.reserver.get(jid) == w:
                delay = self.rng.choice((0, 0, 5))
                self.log(r.Release, w, jid, self.rng.randrange(0, 2048), delay)
                self.finish(jid, w, tube)
                if delay:
                    self.state[jid] = 1
                    self.at(self.now + delay * NS, "promote", jid)
                else:
                    self.make_ready(jid)
                self.dispatch(tube)
        elif kind == "bury":
            jid, w, tube = args
            if self.reserver.get(jid) == w:
                self.log(r.Bury, w, jid, self.rng.randrange(0, 2048))
                self.state[jid] = 3
                self.buried[tube].append(jid)
                self.finish(jid, w, tube)
                self.dispatch(tube)
        elif kind == "timeout":
            jid, w = args
            if self.reserver.get(jid) == w:
                self.log(r.Timeout, [jid])
                self.held[w].discard(jid)
                self.reserver.pop(jid)
                self.make_ready(jid)
                self.dispatch(self.job_tube[jid])
        elif kind == "free":
            w, tube = args
            if w in self.held:  # not gone (disconnect) meanwhile
                self.idle[tube].append(w)
                self.dispatch(tube)
        elif kind == "disconnect":
            w, tube = args
            self.log(r.Disconnect, w)
            for jid in sorted(self.held.pop(w, ())):
                self.reserver.pop(jid, None)
                self.make_ready(jid)
            self.new_worker(tube)
            self.dispatch(tube)
        elif kind == "kick":
            for tube in self.tubes:
                fifo = self.buried[tube]
                ids = []
                while fifo and len(ids) < 100:
                    jid = fifo.popleft()
                    if self.state.get(jid) == 3:
                        ids.append(jid)
                if ids:
                    self.log(r.Kick, self.admin, ids)
                    for jid in ids:
                        self.make_ready(jid)
                    self.dispatch(tube)
            self.at(self.now + 600 * NS, "kick")
        elif kind == "restart":
            self.restart()

    def restart(self) -> None:
        """A server restart: every connection ends, reserved jobs go back to ready."""
        self.epoch += 1
        self.log(r.Restart)
        # Restart disconnects in ascending connection id; jobs in ascending id.
        for w in sorted(self.held):
            for jid in sorted(self.held[w]):
                self.reserver.pop(jid, None)
                self.make_ready(jid)
        self.held.clear()
        self.connect_all()
        for t in self.tubes:
            self.dispatch(t)

    def run(self) -> None:
        try:
            self._run()
        except Done:
            pass

    def _run(self) -> None:
        new_epoch = getattr(r, "NewEpoch", None)
        if new_epoch is not None:  # a fresh primary's log starts NewEpoch, Restart
            self.log(new_epoch, 1, f"{self.rng.getrandbits(64):016x}")
        self.log(r.Restart)
        self.connect_all()
        for t in self.tubes:
            self.at(self.now + int(self.rng.expovariate(self.rate[t]) * NS), "arrival", t)
        self.at(self.now + 600 * NS, "kick")
        restart_at = int(self.limit * 0.6)
        restarted = False
        heap = self.heap
        while True:
            when, _tick, kind, data = heapq.heappop(heap)
            if when > self.now:
                self.now = when
            if not restarted and self.seq >= restart_at:
                restarted = True
                self.restart()
            self.handle(kind, data)


BODIES = [bytes(random.Random(i).randbytes(n)) for i, n in enumerate((40, 80, 120, 200, 400, 90))]


def generate(out: Path, n_records: int, servers: int = 1, tubes: int = 4, seed: int = 1,
             per_segment: int = 100_000, start_ns: int = DEFAULT_START_NS,
             span_s: float = 86_400.0) -> list[Path]:
    """Write `servers` data directories under `out` with about `n_records` records in all."""
    dirs = []
    for i in range(servers):
        d = out / f"server-{i + 1}"
        files = SegmentFiles(d, per_segment)
        per_server = n_records // servers
        sim = Sim(files, random.Random(seed * 1000 + i), start_ns, int(span_s * NS),
                  per_server, tubes)
        try:
            sim.run()
        finally:
            files.close()
        dirs.append(d)
    return dirs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smallstalk.analytics.gen",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory to create the data directories in")
    ap.add_argument("--records", type=int, default=1_000_000, help="records in all (about)")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--tubes", type=int, default=4)
    ap.add_argument("--segment-records", type=int, default=100_000)
    ap.add_argument("--hours", type=float, default=24.0, help="time span the records cover")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    started = time.monotonic()
    dirs = generate(args.out, args.records, args.servers, args.tubes, args.seed,
                    args.segment_records, span_s=args.hours * 3600)
    size = sum(p.stat().st_size for d in dirs for p in (d / "aof").iterdir())
    print(f"wrote {args.records:,} records, {size / 1e6:.1f} MB, in {len(dirs)} data "
          f"directories under {args.out} ({time.monotonic() - started:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
