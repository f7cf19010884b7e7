"""Hot standby with real processes: convergence, resume, resync, failover, fencing."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import cbor2
import greenstalk

from smallstalk.storage import snapshot_codec
from smallstalk.storage.recovery import recover

from ..support.bsclient import connect
from ..support.procs import Server, free_port, start_smallstalk, wait_for
from ..support.threads import start as start_thread


def stats(port: int) -> dict:
    """`stats` and smallstalk's `ext-stats` together, numbers as ints."""
    c = connect(port)
    try:
        both = {**c.stats(), **c.ext_stats()}
    finally:
        c.close()
    return {k: int(v) if v.isdigit() else v for k, v in both.items()}


def caught_up(primary: Server, replica: Server) -> bool:
    return stats(replica.port)["last-seq"] == stats(primary.port)["last-seq"]


def durable_state(data: Path) -> bytes:
    return cbor2.dumps(list(snapshot_codec.dump(recover(data, repair=False).state)))


def replica_of(tmp: Path, primary: Server, name: str = "replica", *flags: str) -> Server:
    return start_smallstalk(tmp, "--replica-of", f"127.0.0.1:{primary.port}", *flags,
                            data_dir=tmp / name)


@attrs.define
class Work:
    """What a load run got acknowledged: the ids put, and those it deleted again."""

    acked: list[int] = attrs.Factory(list)
    deleted: set[int] = attrs.Factory(set)


def load(port: int, tube: str, n: int, stop: threading.Event | None = None,
         work: Work | None = None) -> Work:
    """A producer/worker mix, recording every acknowledged put and delete. Only a
    run given `stop` (its server is killed under it) may end early on a lost
    connection; any other run puts all n jobs or fails."""
    work = work or Work()
    try:
        with greenstalk.Client(("127.0.0.1", port), use=tube, watch=tube) as c:
            for i in range(n):
                if stop is not None and stop.is_set():
                    break
                work.acked.append(c.put(f"{tube}-{i}", priority=i % 7,
                                        delay=(i % 5 == 0) * 100))
                if i % 3 == 0:
                    try:
                        job = c.reserve(timeout=0)
                    except greenstalk.TimedOutError:
                        continue
                    if i % 2:
                        c.delete(job)
                        work.deleted.add(job.id)
                    else:
                        c.release(job, priority=3)
    except (ConnectionError, OSError, greenstalk.UnknownResponseError):
        if stop is None:
            raise
    if stop is None:
        assert len(work.acked) == n, f"{len(work.acked)} of {n} puts acknowledged"
    return work


def assert_holds(port: int, *works: Work) -> None:
    """Some work was acknowledged, and the server on `port` holds every job of
    it that was not deleted."""
    live = [j for w in works for j in w.acked if j not in w.deleted]
    assert live, "no acknowledged put to look for"
    missing = []
    with greenstalk.Client(("127.0.0.1", port)) as c:
        for job_id in live:
            try:
                c.stats_job(job_id)
            except greenstalk.NotFoundError:
                missing.append(job_id)
    assert not missing, f"{len(missing)} of {len(live)} acknowledged jobs missing: {missing[:10]}"


def test_replica_converges_under_concurrent_load(tmp_path: Path) -> None:
    primary = start_smallstalk(tmp_path, "--segment-records", "50", "--compact-interval", "0.5",
                               data_dir=tmp_path / "primary")
    replica = replica_of(tmp_path, primary)
    try:
        works: list[Work] = []
        threads = [start_thread(lambda k=k: works.append(load(primary.port, f"t{k}", 300)))
                   for k in range(4)]
        for t in threads:
            t.join(120)
        wait_for(lambda: caught_up(primary, replica), what="replica catching up")
        assert len(works) == 4
        assert_holds(replica.port, *works)
        st = stats(replica.port)
        assert st["role"] == "replica" and st["replication-connected"] == "true"
        assert st["current-jobs-ready"] == stats(primary.port)["current-jobs-ready"]
    finally:
        primary.stop()
        replica.stop()
    assert durable_state(tmp_path / "replica") == durable_state(tmp_path / "primary")


def test_replica_refuses_writes_and_serves_reads(tmp_path: Path) -> None:
    primary = start_smallstalk(tmp_path, data_dir=tmp_path / "primary")
    replica = replica_of(tmp_path, primary)
    try:
        with greenstalk.Client(("127.0.0.1", primary.port), use="r") as c:
            job_id = c.put("payload")
        wait_for(lambda: caught_up(primary, replica))
        with socket.create_connection(("127.0.0.1", replica.port), timeout=10) as s:
            s.sendall(b"put 0 0 10 1\r\nx\r\nreserve\r\nwatch r\r\nuse r\r\npeek-ready\r\n"
                      b"stats-job %d\r\n" % job_id)
            reply = b""
            while b"\r\nOK " not in reply or not reply.endswith(b"\n\r\n"):
                reply += s.recv(65536)
        assert reply.startswith(b"READ_ONLY\r\nREAD_ONLY\r\nREAD_ONLY\r\nUSING r\r\n"
                                b"FOUND %d 7\r\npayload\r\n" % job_id)
        assert b"state: ready\n" in reply
    finally:
        primary.stop()
        replica.stop()


def test_replica_restart_resumes(tmp_path: Path) -> None:
    primary = start_smallstalk(tmp_path, data_dir=tmp_path / "primary")
    replica = replica_of(tmp_path, primary)
    try:
        a = load(primary.port, "a", 100)
        wait_for(lambda: caught_up(primary, replica))
        replica.kill()
        b = load(primary.port, "b", 100)
        replica = replica_of(tmp_path, primary)
        wait_for(lambda: caught_up(primary, replica))
        assert "full resync" not in replica.log()
        assert_holds(replica.port, a, b)
    finally:
        primary.stop()
        replica.stop()
    assert durable_state(tmp_path / "replica") == durable_state(tmp_path / "primary")


def test_replica_far_behind_a_compacted_primary_resyncs_from_a_snapshot(tmp_path: Path) -> None:
    primary = start_smallstalk(tmp_path, "--segment-records", "20", "--compact-interval", "0.2",
                               "--compact-segments", "1", data_dir=tmp_path / "primary")
    replica = replica_of(tmp_path, primary)
    try:
        a = load(primary.port, "a", 30)
        wait_for(lambda: caught_up(primary, replica))
        replica.stop()
        b = load(primary.port, "b", 200)
        aof_dir = tmp_path / "primary" / "aof"
        wait_for(lambda: min(int(p.stem) for p in aof_dir.glob("*.aof")) > 100,
                 what="primary compacting its early segments")
        replica = replica_of(tmp_path, primary)
        wait_for(lambda: caught_up(primary, replica))
        assert "full resync" in replica.log()
        assert_holds(replica.port, a, b)
    finally:
        primary.stop()
        replica.stop()
    assert durable_state(tmp_path / "replica") == durable_state(tmp_path / "primary")


def test_failover_with_min_replica_acks_loses_no_acknowledged_put(tmp_path: Path) -> None:
    primary = start_smallstalk(tmp_path, "--min-replica-acks", "1",
                               data_dir=tmp_path / "primary")
    replica = replica_of(tmp_path, primary)
    works = [Work() for _ in range(3)]
    stop = threading.Event()
    try:
        wait_for(lambda: stats(primary.port)["replicas"] == 1)
        threads = [start_thread(load, primary.port, f"f{k}", 10_000, stop, w)
                   for k, w in enumerate(works)]
        wait_for(lambda: sum(len(w.acked) for w in works) > 300, what="some acknowledged puts")
        with greenstalk.Client(("127.0.0.1", primary.port), use="held", watch="held") as c:
            c.put("reserved on the old primary", ttr=3600)
            held = c.reserve(timeout=5)
            primary.kill()  # SIGKILL under load
            stop.set()
        for t in threads:
            t.join(30)
        acked = [j for w in works for j in w.acked]
        assert len(acked) > 300
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "smallstalk", "promote",
                              f"127.0.0.1:{replica.port}"], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0 and out.stdout.startswith("PROMOTED 2"), out
        with greenstalk.Client(("127.0.0.1", replica.port), watch="held") as c:
            # The dead primary's reservation is ready again on the new one.
            assert c.reserve(timeout=5).id == held.id
            failover = time.monotonic() - started
            missing = []
            for job_id in acked:
                try:
                    c.stats_job(job_id)
                except greenstalk.NotFoundError:
                    missing.append(job_id)
            new_id = c.put("after failover")
        # Deleted jobs are legitimately gone; everything else must be there.
        deleted = _deleted_ids(tmp_path / "replica")
        assert [j for j in missing if j not in deleted] == []
        assert new_id > max(acked)
        assert stats(replica.port)["role"] == "primary"
        print(f"failover (promote + first reserve): {failover:.3f}s")
    finally:
        stop.set()
        primary.kill()
        replica.stop()


def _deleted_ids(data: Path) -> set[int]:
    from smallstalk.core import records
    from smallstalk.storage import aof

    out = set()
    for _first, path in aof.list_segments(data / "aof"):
        for entry in aof.iter_segment(path):
            if isinstance(entry, aof.FrameScan):
                break
            if isinstance(entry[1], records.Delete):
                out.add(entry[1].id)
    return out


def test_min_replica_acks_without_replica_never_acknowledges(tmp_path: Path) -> None:
    primary = start_smallstalk(tmp_path, "--min-replica-acks", "1", "--replica-ack-timeout",
                               "0.5", data_dir=tmp_path / "primary")
    try:
        with socket.create_connection(("127.0.0.1", primary.port), timeout=10) as s:
            started = time.monotonic()
            s.sendall(b"put 0 0 10 1\r\nx\r\nlist-tube-used\r\n")
            reply = b""
            while not reply.endswith(b"USING default\r\n"):
                reply += s.recv(4096)
            assert reply == b"NOT_REPLICATED\r\nUSING default\r\n"
            assert time.monotonic() - started >= 0.45
    finally:
        primary.stop()


def test_old_primary_cannot_feed_the_promoted_one(tmp_path: Path) -> None:
    primary = start_smallstalk(tmp_path, data_dir=tmp_path / "primary")
    replica = replica_of(tmp_path, primary)
    try:
        a = load(primary.port, "a", 50)
        wait_for(lambda: caught_up(primary, replica))
        assert_holds(replica.port, a)
        primary.stop()
        out = subprocess.run([sys.executable, "-m", "smallstalk", "promote",
                              f"127.0.0.1:{replica.port}"], capture_output=True, text=True,
                             timeout=30)
        assert out.stdout.startswith("PROMOTED")
        with greenstalk.Client(("127.0.0.1", replica.port), use="new") as c:
            c.put("written on the new primary")
        replica.stop()
        new_state = durable_state(tmp_path / "replica")
        # The old primary comes back (as a primary) and the promoted server is
        # wrongly pointed at it: it must refuse to take the old history.
        port = primary.port
        primary = start_smallstalk(tmp_path, data_dir=tmp_path / "primary", port=port)
        old = load(primary.port, "old", 20)
        assert_holds(primary.port, old)
        replica = replica_of(tmp_path, primary)
        wait_for(lambda: "newer than ours" in replica.log(), what="the refusal")
        assert stats(replica.port)["replication-connected"] == "false"
    finally:
        primary.stop()
        replica.stop()
    # The promoted server's files still hold exactly its own history.
    assert durable_state(tmp_path / "replica") == new_state


def test_lag_is_reported(tmp_path: Path) -> None:
    primary = start_smallstalk(tmp_path, data_dir=tmp_path / "primary")
    replica = replica_of(tmp_path, primary)
    try:
        a = load(primary.port, "a", 20)
        wait_for(lambda: caught_up(primary, replica))
        assert_holds(replica.port, a)
        st = stats(replica.port)
        assert st["replication-lag-records"] == 0
        assert float(st["replication-lag-seconds"]) == 0.0
        assert st["replica-of"] == f"127.0.0.1:{primary.port}"
        assert stats(primary.port)["replicas"] == 1
    finally:
        primary.stop()
        replica.stop()


def test_replication_needs_a_data_directory() -> None:
    out = subprocess.run([sys.executable, "-m", "smallstalk", "serve", "-p", str(free_port()),
                          "--replica-of", "127.0.0.1:1"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode != 0 and "data directory" in out.stderr
