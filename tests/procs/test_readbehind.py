"""Read-behind with real processes: bounded RSS under a big backlog, SIGKILL rounds, a replica.

`SMALLSTALK_READBEHIND_BYTES` sets the backlog of the RSS test (default
512 MiB, about 15 s here); the issue's figure is 2 GiB
(`SMALLSTALK_READBEHIND_BYTES=2147483648`, or `bench/readbehind.py --total
2GiB`). `SMALLSTALK_READBEHIND_ROUNDS` sets the crash rounds (default 3).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import threading
import time
from pathlib import Path

from smallstalk.storage.recovery import recover

from ..support.bsclient import Client, peek_ids, put_cmd
from ..support.procs import REPO, Server, start_smallstalk, wait_for
from ..support.threads import start as start_thread

TOTAL = int(os.environ.get("SMALLSTALK_READBEHIND_BYTES", str(512 << 20)))
ROUNDS = int(os.environ.get("SMALLSTALK_READBEHIND_ROUNDS", "3"))
BUDGET = 64 << 20
PER_JOB = 1024  # bytes of RSS a job may cost besides its body (measured: ~480)
SLACK = 32 << 20  # buffers: a connection's 1 MiB of commands and replies, the turn's
#                   AOF batch, a compaction's index, allocator fragmentation

_spec = importlib.util.spec_from_file_location("readbehind", REPO / "bench" / "readbehind.py")
readbehind = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readbehind)


def test_rss_stays_bounded_and_every_body_comes_back(tmp_path: Path) -> None:
    """The issue's test: a backlog many times --max-memory, drained; RSS bound:
    RSS at start + budget + 1 KiB per job + 32 MiB."""
    srv = start_smallstalk(tmp_path, "--max-memory", "64MB", "--fsync", "never", "--extended-stats",
                           data_dir=tmp_path / "data")
    try:
        res = readbehind.drive(srv.port, srv.pid, TOTAL)
    finally:
        srv.stop()
    bound = res["rss_start"] + BUDGET + PER_JOB * res["jobs"] + SLACK
    print({**res, "bound": bound})
    assert res["bad_bodies"] == 0
    assert res["bytes_in_memory_after_puts"] <= BUDGET
    assert res["bytes_on_disk_after_puts"] >= TOTAL - BUDGET
    assert res["body_reads"] >= res["jobs"] - BUDGET // 1024  # bodies are 1 KiB or more
    assert res["vm_hwm"] <= bound, f"peak RSS {res['vm_hwm']} over {bound}"
    assert res["rss_max_sampled"] <= bound


def _producer(port: int, acked: dict[int, bytes], stop: threading.Event, seed: int) -> None:
    rnd = random.Random(seed)
    try:
        with Client(port) as c:
            while not stop.is_set():
                bodies = [rnd.randbytes(rnd.randint(1, 20_000)) for _ in range(8)]
                c.send(b"".join(put_cmd(b, ttr=600) for b in bodies))
                for b in bodies:
                    reply = c.read()
                    # A reply other than INSERTED fails the test (the thread's
                    # join re-raises it); only the kill ends the loop quietly.
                    assert reply.status == b"INSERTED", reply
                    acked[reply.id] = hashlib.sha256(b).digest()
    except (OSError, ConnectionError, EOFError):
        return  # the server was killed


def test_sigkill_rounds_keep_every_acknowledged_body(tmp_path: Path) -> None:
    """Kill the server during puts (spilling, rotating and compacting all the
    while), restart it under the budget: every acknowledged job is there with
    its exact body, and the data directory rebuilds the same jobs."""
    data = tmp_path / "data"
    flags = ("--max-memory", "1MB", "--fsync", "never", "--segment-bytes", "300000",
             "--compact-interval", "0.2", "--compact-segments", "2")
    acked: dict[int, bytes] = {}
    deleted: set[int] = set()
    rnd = random.Random(5)
    for rnd_i in range(ROUNDS):
        srv = start_smallstalk(tmp_path, *flags, data_dir=data)
        try:
            with Client(srv.port) as c:
                live = sorted(set(acked) - deleted)
                got = peek_ids(c, live)
                assert sorted(got) == live, f"round {rnd_i}: acknowledged jobs missing"
                bad = [j for j in live if hashlib.sha256(got[j]).digest() != acked[j]]
                assert not bad, f"round {rnd_i}: bodies differ: {bad[:5]}"
                for jid in rnd.sample(live, len(live) // 3):
                    assert c.call(b"delete %d\r\n" % jid).status == b"DELETED"
                    deleted.add(jid)
                stats = c.ext_stats()
                assert int(stats["bytes-in-memory"]) <= 1 << 20
            before = len(acked)
            stop = threading.Event()
            threads = [start_thread(_producer, srv.port, acked, stop, k + rnd_i) for k in range(2)]
            time.sleep(rnd.uniform(1.0, 2.5))
        finally:
            srv.kill()
        stop.set()
        for t in threads:
            t.join(30)
        assert len(acked) > before, f"round {rnd_i}: no put was acknowledged before the kill"
    state = recover(data, repair=False).state
    live = set(acked) - deleted
    assert live <= set(state.jobs)
    for jid in live:
        assert hashlib.sha256(state.jobs[jid].body).digest() == acked[jid]


def test_replica_under_a_budget_resyncs_and_follows(tmp_path: Path) -> None:
    """A replica with --max-memory: a full resync (the primary compacted its
    log away) installs the snapshot under the budget, then live records spill
    on the replica too; every body reads back on the replica."""
    flags = ("--max-memory", "256KB", "--segment-bytes", "100000", "--compact-interval", "0.1",
             "--compact-segments", "1")
    primary = start_smallstalk(tmp_path, *flags, data_dir=tmp_path / "primary")
    replica: Server | None = None
    rnd = random.Random(3)
    bodies: dict[int, bytes] = {}
    try:
        with Client(primary.port) as c:
            for _ in range(150):
                b = rnd.randbytes(rnd.randint(100, 8000))
                bodies[c.call(put_cmd(b, ttr=600)).id] = b
            wait_for(lambda: not (tmp_path / "primary" / "aof" / "00000000000000000001.aof")
                     .exists(), what="the primary compacting its first segment away")
            replica = start_smallstalk(tmp_path, *flags, "--replica-of",
                                       f"127.0.0.1:{primary.port}", data_dir=tmp_path / "replica")
            for _ in range(100):
                b = rnd.randbytes(rnd.randint(100, 8000))
                bodies[c.call(put_cmd(b, ttr=600)).id] = b
            last = int(c.ext_stats()["last-seq"])
        # At least: closing `c` logs a Disconnect after `last`, which may arrive first.
        with Client(replica.port) as r:
            wait_for(lambda: int(r.ext_stats()["last-seq"]) >= last,
                     what="the replica catching up")
            st = r.ext_stats()
            assert int(st["bytes-in-memory"]) <= 256 << 10 < int(st["bytes-on-disk"])
            assert peek_ids(r, sorted(bodies)) == bodies
        assert "full resync" in replica.log()
    finally:
        primary.stop()
        if replica is not None:
            replica.stop()
