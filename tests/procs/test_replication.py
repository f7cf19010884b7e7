"""Hot standby with real processes: convergence, resume, resync, failover, fencing.

Every test of the replication link runs twice (the `link` fixture): replicas
following their primary's plaintext port, and its TLS port under mutual TLS
(the replica checks the primary's certificate, the primary the replica's).
Clients (greenstalk, which has no TLS) use the plaintext port either way."""

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
import pytest

from smallstalk.storage import snapshot_codec
from smallstalk.storage.recovery import recover

from ..support.bsclient import connect
from ..support.procs import Server, free_port, start_smallstalk, wait_for
from ..support.threads import start as start_thread
from ..support.tlscerts import Certs, make_certs


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


@attrs.define
class Link:
    """How replicas reach their primary: its plaintext port, or (with `certs`) its
    TLS port, mutual TLS on both sides, and an admin token on every server (the
    replica sends it; `smallstalk promote` reads it from $SMALLSTALK_TOKEN)."""

    certs: Certs | None
    token_file: Path | None = None
    tls_ports: dict[int, int] = attrs.Factory(dict)  # a primary's port -> its TLS port

    def _token(self) -> list[str]:
        return [] if self.token_file is None else ["--admin-token-file", str(self.token_file)]

    def primary(self, tmp: Path, *flags: str, data_dir: Path, port: int | None = None) -> Server:
        if self.certs is None:
            return start_smallstalk(tmp, *flags, data_dir=data_dir, port=port)
        port = port or free_port()
        tls_port = self.tls_ports.setdefault(port, free_port())  # the same after a restart
        return start_smallstalk(tmp, *self.certs.server_flags(tls_port, mutual=True),
                                *self._token(), *flags, data_dir=data_dir, port=port)

    def address(self, primary: Server) -> str:
        return f"127.0.0.1:{self.tls_ports.get(primary.port, primary.port)}"

    def replica(self, tmp: Path, primary: Server, name: str = "replica", *flags: str) -> Server:
        tls = self.certs.replica_flags() if self.certs is not None else []
        return start_smallstalk(tmp, "--replica-of", self.address(primary), *tls,
                                *self._token(), *flags, data_dir=tmp / name)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(params=["plain", "tls"])
def link(request, certs: Certs, tmp_path: Path, monkeypatch) -> Link:
    if request.param == "plain":
        return Link(None)
    token = tmp_path / "admin.token"
    token.write_text("replication-s3cr3t\n")
    monkeypatch.setenv("SMALLSTALK_TOKEN", "replication-s3cr3t")  # for `smallstalk promote`
    return Link(certs, token)


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


def test_replica_converges_under_concurrent_load(tmp_path: Path, link: Link) -> None:
    primary = link.primary(tmp_path, "--segment-records", "50", "--compact-interval", "0.5",
                               data_dir=tmp_path / "primary")
    replica = link.replica(tmp_path, primary)
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


def test_a_replica_joining_under_load_gets_every_record(tmp_path: Path, link: Link) -> None:
    """Its `replicate` lands among other clients' commands: records staged in that
    turn (or written, awaiting their fsync) before the feed existed still reach it."""
    primary = link.primary(tmp_path, data_dir=tmp_path / "primary")
    replicas: list[Server] = []
    try:
        works: list[Work] = []
        threads = [start_thread(lambda k=k: works.append(load(primary.port, f"j{k}", 300)))
                   for k in range(2)]
        for name in ("r1", "r2", "r3"):  # each joins somewhere in the middle of the load
            replicas.append(link.replica(tmp_path, primary, name))
        for t in threads:
            t.join(120)
        for replica in replicas:
            wait_for(lambda r=replica: caught_up(primary, r), what="replica catching up")
            assert "gap in the feed" not in replica.log(), replica.log()
            assert_holds(replica.port, *works)
        assert stats(primary.port)["replicas"] == 3
    finally:
        primary.stop()
        for replica in replicas:
            replica.stop()


def test_replica_refuses_writes_and_serves_reads(tmp_path: Path, link: Link) -> None:
    primary = link.primary(tmp_path, data_dir=tmp_path / "primary")
    replica = link.replica(tmp_path, primary)
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


def test_a_replicas_own_clients_leave_the_primarys_connections_alone(
        tmp_path: Path, link: Link) -> None:
    """Clients of the replica come and go (a `use`, a hang-up) while a client of
    the primary holds a reservation: the replica's state keeps it reserved, as
    the primary's does, and the primary's later records still apply."""
    primary = link.primary(tmp_path, data_dir=tmp_path / "primary")
    replica = link.replica(tmp_path, primary)
    try:
        worker = connect(primary.port)
        job = worker.put(b"held").id
        assert worker.call(b"reserve-with-timeout 5\r\n").status == b"RESERVED"
        wait_for(lambda: caught_up(primary, replica))
        for _ in range(8):  # ids of the primary's connections, and more
            local = connect(replica.port)
            assert local.call(b"use elsewhere\r\n").status == b"USING"
            local.close()
        assert worker.call(b"release %d 0 0\r\n" % job).status == b"RELEASED"
        assert worker.call(b"reserve-with-timeout 5\r\n").status == b"RESERVED"
        wait_for(lambda: caught_up(primary, replica))
        with connect(replica.port) as c:
            assert c.call(b"stats-job %d\r\n" % job).yaml()["state"] == "reserved"
            assert c.call(b"stats-tube default\r\n").yaml()["current-jobs-reserved"] == "1"
        worker.close()
        wait_for(lambda: caught_up(primary, replica))
        with connect(replica.port) as c:
            assert c.call(b"stats-job %d\r\n" % job).yaml()["state"] == "ready"
    finally:
        primary.stop()
        replica.stop()


def test_replica_restart_resumes(tmp_path: Path, link: Link) -> None:
    primary = link.primary(tmp_path, data_dir=tmp_path / "primary")
    replica = link.replica(tmp_path, primary)
    try:
        a = load(primary.port, "a", 100)
        wait_for(lambda: caught_up(primary, replica))
        replica.kill()
        b = load(primary.port, "b", 100)
        replica = link.replica(tmp_path, primary)
        wait_for(lambda: caught_up(primary, replica))
        assert "full resync" not in replica.log()
        assert_holds(replica.port, a, b)
    finally:
        primary.stop()
        replica.stop()
    assert durable_state(tmp_path / "replica") == durable_state(tmp_path / "primary")


def test_replica_far_behind_a_compacted_primary_resyncs_from_a_snapshot(tmp_path: Path, link: Link) -> None:
    primary = link.primary(tmp_path, "--segment-records", "20", "--compact-interval", "0.2",
                               "--compact-segments", "1", data_dir=tmp_path / "primary")
    replica = link.replica(tmp_path, primary)
    try:
        a = load(primary.port, "a", 30)
        wait_for(lambda: caught_up(primary, replica))
        replica.stop()
        b = load(primary.port, "b", 200)
        aof_dir = tmp_path / "primary" / "aof"
        wait_for(lambda: min(int(p.stem) for p in aof_dir.glob("*.aof")) > 100,
                 what="primary compacting its early segments")
        replica = link.replica(tmp_path, primary)
        wait_for(lambda: caught_up(primary, replica))
        assert "full resync" in replica.log()
        assert_holds(replica.port, a, b)
    finally:
        primary.stop()
        replica.stop()
    assert durable_state(tmp_path / "replica") == durable_state(tmp_path / "primary")


def test_failover_with_min_replica_acks_loses_no_acknowledged_put(tmp_path: Path, link: Link) -> None:
    primary = link.primary(tmp_path, "--min-replica-acks", "1",
                               data_dir=tmp_path / "primary")
    replica = link.replica(tmp_path, primary)
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
    from smallstalk.storage import aof, logread

    out = set()
    for _first, path in aof.list_segments(data / "aof"):
        for entry in logread.iter_segment(path):
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


def test_min_replica_acks_released_by_a_replica_that_resyncs_from_a_snapshot(
        tmp_path: Path, link: Link) -> None:
    """Puts parked for want of a replica, all folded into the primary's snapshot: a new
    replica installs that snapshot (FULLRESYNC, no record after it) and acknowledges it,
    so the puts are answered INSERTED, long before the ack timeout."""
    n = 5
    primary = link.primary(tmp_path, "--min-replica-acks", "1", "--replica-ack-timeout", "60",
                           "--segment-records", str(n), "--compact-interval", "0.2",
                           "--compact-segments", "1", data_dir=tmp_path / "primary")
    replica = None
    try:
        with socket.create_connection(("127.0.0.1", primary.port), timeout=30) as s:
            s.sendall(b"".join(b"put 0 0 60 3\r\nj%02d\r\n" % i for i in range(n)))
            # The turn's records fill a segment, which rotates and is folded: the
            # snapshot holds every put, and the open segment no record.
            snaps = tmp_path / "primary" / "snapshots"

            def folded() -> bool:
                last = stats(primary.port)["last-seq"]
                return last >= n and [p.stem for p in snaps.glob("*.snap")] == [f"{last:020d}"]

            wait_for(folded, what="the puts folded into a snapshot")
            last = stats(primary.port)["last-seq"]
            s.settimeout(0.5)
            with pytest.raises(TimeoutError):
                s.recv(4096)  # no replica yet: every reply is parked
            started = time.monotonic()
            replica = link.replica(tmp_path, primary)
            s.settimeout(30)
            reply = b""
            while reply.count(b"\r\n") < n:
                chunk = s.recv(4096)
                assert chunk, "the primary closed the connection"
                reply += chunk
            took = time.monotonic() - started
            # Read while the producer is still connected: its close logs a Disconnect
            # record, which the replica may already hold by a later read.
            replica_last = stats(replica.port)["last-seq"]
        assert reply == b"".join(b"INSERTED %d\r\n" % (i + 1) for i in range(n))
        assert took < 20, f"the parked replies took {took:.1f}s"
        assert "full resync" in replica.log()
        assert replica_last == last
    finally:
        primary.stop()
        if replica is not None:
            replica.stop()


def test_old_primary_cannot_feed_the_promoted_one(tmp_path: Path, link: Link) -> None:
    primary = link.primary(tmp_path, data_dir=tmp_path / "primary")
    replica = link.replica(tmp_path, primary)
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
        primary = link.primary(tmp_path, data_dir=tmp_path / "primary", port=port)
        old = load(primary.port, "old", 20)
        assert_holds(primary.port, old)
        replica = link.replica(tmp_path, primary)
        wait_for(lambda: "newer than ours" in replica.log(), what="the refusal")
        assert stats(replica.port)["replication-connected"] == "false"
    finally:
        primary.stop()
        replica.stop()
    # The promoted server's files still hold exactly its own history.
    assert durable_state(tmp_path / "replica") == new_state


def test_lag_is_reported(tmp_path: Path, link: Link) -> None:
    primary = link.primary(tmp_path, data_dir=tmp_path / "primary")
    replica = link.replica(tmp_path, primary)
    try:
        a = load(primary.port, "a", 20)
        wait_for(lambda: caught_up(primary, replica))
        assert_holds(replica.port, a)
        st = stats(replica.port)
        assert st["replication-lag-records"] == 0
        assert float(st["replication-lag-seconds"]) == 0.0
        assert st["replica-of"] == link.address(primary)
        assert stats(primary.port)["replicas"] == 1
    finally:
        primary.stop()
        replica.stop()


def test_replication_needs_a_data_directory() -> None:
    out = subprocess.run([sys.executable, "-m", "smallstalk", "serve", "-p", str(free_port()),
                          "--replica-of", "127.0.0.1:1"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode != 0 and "data directory" in out.stderr


def test_over_tls_a_replica_follows_only_a_primary_it_can_verify_and_vice_versa(
        tmp_path: Path, certs: Certs) -> None:
    import trustme

    from ..support.tlscerts import write_pair

    link = Link(certs)
    primary = link.primary(tmp_path, data_dir=tmp_path / "primary")
    stranger_ca = tmp_path / "stranger-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(stranger_ca))
    mallory = write_pair(trustme.CA().issue_cert("mallory@example.org"), tmp_path, "mallory")
    address = ["--replica-of", link.address(primary)]
    replicas = {
        # Does not trust the primary's CA: refuses the primary's certificate.
        "CERTIFICATE_VERIFY_FAILED": start_smallstalk(
            tmp_path, *address, "--replica-tls-ca", str(stranger_ca),
            data_dir=tmp_path / "untrusting"),
        # Trusts it, but brings no certificate: the primary (mutual TLS) refuses it.
        "no cert": start_smallstalk(tmp_path, *address, "--replica-tls-ca", str(certs.ca_file),
                                    data_dir=tmp_path / "certless"),
        # A certificate from another CA.
        "another CA": start_smallstalk(
            tmp_path, *address, "--replica-tls-ca", str(certs.ca_file), "--replica-tls-cert",
            str(mallory[0]), "--replica-tls-key", str(mallory[1]), data_dir=tmp_path / "mallory"),
    }
    try:
        load(primary.port, "secret", 20)
        for what, replica in replicas.items():
            wait_for(lambda r=replica: "replication from 127.0.0.1" in r.log(),
                     what=f"the replica ({what}) to report its failed connection")
            st = stats(replica.port)
            assert st["replication-connected"] == "false", what
            assert st["current-jobs-ready"] == 0 and st["last-seq"] == 0, what
        assert "CERTIFICATE_VERIFY_FAILED" in replicas["CERTIFICATE_VERIFY_FAILED"].log()
        assert stats(primary.port)["replicas"] == 0
        wait_for(lambda: primary.log().count("TLS handshake with 127.0.0.1:") >= 2,
                 what="the primary logging the replicas it refused")
    finally:
        primary.stop()
        for replica in replicas.values():
            replica.stop()


def test_promote_over_the_replicas_tls_port(tmp_path: Path, certs: Certs) -> None:
    link = Link(certs)
    primary = link.primary(tmp_path, data_dir=tmp_path / "primary")
    replica_tls = free_port()
    replica = link.replica(tmp_path, primary, "replica",
                           *certs.server_flags(replica_tls, mutual=True))
    try:
        a = load(primary.port, "a", 20)
        wait_for(lambda: caught_up(primary, replica))
        target = f"127.0.0.1:{replica_tls}"

        def promote(*flags: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "smallstalk", "promote", *flags,
                                   target], capture_output=True, text=True, timeout=30)

        # Plaintext to the TLS port, or TLS without the client certificate: refused.
        assert promote().returncode != 0
        refused = promote("--tls-ca", str(certs.ca_file))
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused
        assert stats(replica.port)["role"] == "replica"
        done = promote("--tls-ca", str(certs.ca_file), "--tls-cert",
                       str(certs.client_cert_file), "--tls-key", str(certs.client_key_file))
        assert done.returncode == 0 and done.stdout.startswith("PROMOTED 2"), done
        assert stats(replica.port)["role"] == "primary"
        assert_holds(replica.port, a)
    finally:
        primary.stop()
        replica.stop()
