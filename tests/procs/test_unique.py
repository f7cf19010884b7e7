"""Exactly-once enqueue against real servers: the client's keyed put and its retries,
unique tasks, and rounds of crashes (SIGKILL), power cuts (powercutfs) and failovers
(`smallstalk promote`, --min-replica-acks 1) under producers that put with keys.

After every round each key has exactly one job, and every acknowledged put's job
is there with the id the client was given. The rounds reuse test_crash's kill and
test_powercut's cut. Knobs: SMALLSTALK_CRASH_ROUNDS, SMALLSTALK_POWERCUT_ROUNDS,
SMALLSTALK_FAILOVER_ROUNDS (each defaults to a few here; hundreds for a long run),
SMALLSTALK_UNIQUE_SEED (replay a run; every test prints its seed).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from smallstalk.client import BeanstalkError, Client, ConnectionFailed
from smallstalk.storage import recovery

from ..support.bsclient import connect, peek_ids
from ..support.powercut import PowerCutMount, mounted, power_cut
from ..support.procs import Server, free_port, start_smallstalk, wait_for
from .test_crash import crash, wait_gone

CRASH_ROUNDS = int(os.environ.get("SMALLSTALK_CRASH_ROUNDS", "3"))
POWERCUT_ROUNDS = int(os.environ.get("SMALLSTALK_POWERCUT_ROUNDS", "3"))
FAILOVER_ROUNDS = int(os.environ.get("SMALLSTALK_FAILOVER_ROUNDS", "2"))
SEED = os.environ.get("SMALLSTALK_UNIQUE_SEED")
PRODUCERS = 3
TUBE = "keyed"
# Small segments and frequent compactions: keys cross snapshots every round.
SMALL = ("--fsync", "always", "--segment-records", "200", "--compact-interval", "0.5")


def seeded(what: str) -> random.Random:
    seed = int(SEED) if SEED else random.randrange(2**32)
    print(f"{what}: seed {seed} (SMALLSTALK_UNIQUE_SEED={seed} replays it)")
    return random.Random(seed)


class Producer:
    """Puts with keys `p<k>-<n>` (the body is the key) through smallstalk.client,
    which retries a keyed put whose reply it did not read."""

    def __init__(self, k: int, servers: list[str]) -> None:
        self.k = k
        self.client = Client(servers, connect_timeout=2.0, read_timeout=8.0,
                             retry_interval=0.2)
        self.client.use(TUBE)
        self.acked: dict[str, int] = {}
        self.errors: list[str] = []
        self.n = 0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            key = f"p{self.k}-{self.n}"
            try:
                ref = self.client.put(key.encode(), ttr=3600, key=key)
            except BeanstalkError as e:
                self.errors.append(f"{key}: {e!r}")
                return
            self.acked[key] = ref.id
            self.n += 1


def run_producers(producers: list[Producer], rng: random.Random,
                  between: Callable[[], None]) -> None:
    """Producers put; `between()` (the crash, cut or failover) runs meanwhile; then
    they go on a moment and stop, every put they began answered."""
    stop = threading.Event()
    threads = [threading.Thread(target=p.run, args=(stop,), daemon=True) for p in producers]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.2, 1.5))
    between()
    time.sleep(rng.uniform(0.3, 1.0))
    stop.set()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a producer is still retrying a minute after the round"
    for p in producers:
        assert not p.errors, p.errors


def check_exactly_once(port: int, producers: list[Producer], ctx: str) -> int:
    """Every key put so far has exactly one job: the one its put was answered with."""
    acked = {key: jid for p in producers for key, jid in p.acked.items()}
    assert len(set(acked.values())) == len(acked), f"{ctx}: two keys answered with one id"
    with connect(port) as c:
        assert c.call(b"use %s\r\n" % TUBE.encode()).status == b"USING"
        bodies = peek_ids(c, sorted(acked.values()))
        lost = sorted(k for k, jid in acked.items() if bodies.get(jid) != k.encode())
        assert not lost, f"{ctx}: acknowledged keys without their job: {lost[:10]}"
        st = c.call(b"stats-tube %s\r\n" % TUBE.encode()).yaml()
        held = sum(int(st[f"current-jobs-{s}"]) for s in ("ready", "reserved", "delayed",
                                                          "buried"))
        assert held == len(acked), f"{ctx}: {held} jobs for {len(acked)} keys"
        # Asking again changes nothing and names the same job.
        sample = list(acked.items())[-200:]
        for key, jid in sample:
            r = c.call(b"put-unique %s 0 0 3600 %d\r\n%s\r\n" % (key.encode(), len(key),
                                                                   key.encode()))
            assert (r.status, r.id) == (b"DUPLICATE", jid), (ctx, key, r)
    return len(acked)


# --- the client -------------------------------------------------------------------------


def test_keyed_put_client_and_unique_tasks(tmp_path: Path, servers: list[Server]) -> None:
    srv = start_smallstalk(tmp_path, data_dir=tmp_path / "data")
    servers.append(srv)
    addr = f"127.0.0.1:{srv.port}"
    with Client(addr) as c:
        a = c.put(b"one", key="order-1")
        assert c.put(b"one again", key="order-1") == a
        assert c.put(b"plain") != a
        with pytest.raises(ValueError):
            c.put(b"x", key="no spaces")
        # After a kill and a restart, the retried put finds its job.
        srv.kill()
        srv = start_smallstalk(tmp_path, data_dir=tmp_path / "data", port=srv.port)
        servers.append(srv)
        assert c.put(b"one", key="order-1") == a
        assert c.stats_job(a).tube == "default"

    from smallstalk.worker import App

    app = App(addr)
    calls: list = []

    @app.task(unique=True, tube="mail")
    def send(to: str, subject: str) -> None:
        calls.append((to, subject))

    @app.task(unique=lambda order_id: f"charge-{order_id}", tube="mail")
    def charge(order_id: int) -> None:
        pass

    first = send.publish("a@example.org", subject="hi")
    assert send.publish("a@example.org", subject="hi") == first
    assert send.publish("b@example.org", subject="hi") != first
    c1 = charge.publish(7)
    assert charge.publish(7) == c1 and charge.options(key="manual").publish(7) != c1
    with connect(srv.port) as c:
        assert c.call(b"stats-tube mail\r\n").yaml()["current-jobs-ready"] == "4"
    app.close()


def test_a_plain_put_is_not_sent_twice_a_keyed_one_is(tmp_path: Path,
                                                      servers: list[Server]) -> None:
    """A server that reads the put and drops the connection before answering."""
    import socket

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    port = lsock.getsockname()[1]
    seen: list[bytes] = []

    def serve() -> None:
        for _ in range(3):
            conn, _ = lsock.accept()
            data = conn.recv(65536)
            seen.append(data)
            if len(seen) < 3:
                conn.close()  # the reply is lost
            else:
                conn.sendall(b"USING t\r\n" * data.count(b"use ") + b"INSERTED 9\r\n")
                time.sleep(0.5)
                conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with Client(f"127.0.0.1:{port}", read_timeout=2) as c:
        with pytest.raises(ConnectionFailed):
            c.put(b"plain")
        assert len(seen) == 1
        assert c.put(b"keyed", key="k").id == 9
    t.join(5)
    lsock.close()
    assert [s.count(b"put-unique k ") for s in seen] == [0, 1, 1]


# --- crash rounds (SIGKILL) -------------------------------------------------------------


def test_crash_rounds_every_key_has_exactly_one_job(tmp_path: Path,
                                                    servers: list[Server]) -> None:
    rng = seeded("keyed crash rounds")
    data = tmp_path / "data"
    srv = start_smallstalk(tmp_path, *SMALL, data_dir=data)
    servers.append(srv)
    producers = [Producer(k, [f"127.0.0.1:{srv.port}"]) for k in range(PRODUCERS)]
    total = 0
    for rnd in range(CRASH_ROUNDS):
        def kill_and_restart() -> None:
            nonlocal srv
            orphans = crash(srv, with_children=rng.random() < 0.5)
            srv = start_smallstalk(tmp_path, *SMALL, data_dir=data, port=srv.port)
            servers.append(srv)
            wait_gone(orphans, 20.0)

        run_producers(producers, rng, kill_and_restart)
        total = check_exactly_once(srv.port, producers, f"crash round {rnd}")
    srv.kill()
    state = recovery.recover(data, repair=False).state
    state.check()
    assert len(state.keys.tubes[TUBE].live) == total
    print(f"{CRASH_ROUNDS} crash rounds: {total} keys, each with exactly one job")
    assert total > 0


# --- power-cut rounds (powercutfs) --------------------------------------------------------


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[PowerCutMount]:
    yield from mounted(tmp_path)


@pytest.mark.timeout(max(300, 30 * POWERCUT_ROUNDS))
def test_power_cut_rounds_every_key_has_exactly_one_job(tmp_path: Path, disk: PowerCutMount,
                                                        servers: list[Server]) -> None:
    rng = seeded("keyed power-cut rounds")
    data = disk.path / "data"
    srv = start_smallstalk(tmp_path, *SMALL, data_dir=data)
    servers.append(srv)
    producers = [Producer(k, [f"127.0.0.1:{srv.port}"]) for k in range(PRODUCERS)]
    total = 0
    undone = 0
    for rnd in range(POWERCUT_ROUNDS):
        def cut_and_restart() -> None:
            nonlocal srv, undone
            torn = rng.randrange(2**32) if rng.random() < 0.5 else None
            cut = power_cut(disk, srv.pid, torn)
            undone += cut.get("files-reverted", 0)
            srv.kill()
            srv = start_smallstalk(tmp_path, *SMALL, data_dir=data, port=srv.port)
            servers.append(srv)

        run_producers(producers, rng, cut_and_restart)
        total = check_exactly_once(srv.port, producers, f"power-cut round {rnd}")
    print(f"{POWERCUT_ROUNDS} power cuts ({undone} files reverted): {total} keys, "
          f"each with exactly one job")
    assert total > 0


# --- failover: three members, --min-replica-acks 1, a manual promote ------------------------


def ext_stats(port: int) -> dict[str, str]:
    with connect(port) as c:
        return {**c.stats(), **c.ext_stats()}


@pytest.mark.timeout(max(300, 90 * FAILOVER_ROUNDS))
def test_failover_rounds_every_key_has_exactly_one_job(tmp_path: Path,
                                                       servers: list[Server]) -> None:
    """Kill the primary under keyed producers, `smallstalk promote` a replica, give it
    two fresh replicas on the old members' ports; each key has exactly one job."""
    rng = seeded("keyed failover rounds")
    acks = ("--min-replica-acks", "1", "--replica-ack-timeout", "2", *SMALL[:2])
    ports = [free_port() for _ in range(3)]
    made = iter(range(1000))

    def member(port: int, primary: int | None) -> Server:
        extra = () if primary is None else ("--replica-of", f"127.0.0.1:{primary}")
        s = start_smallstalk(tmp_path, *acks, *extra, data_dir=tmp_path / f"m{next(made)}",
                             port=port)
        servers.append(s)
        return s

    members = {ports[0]: member(ports[0], None)}
    for port in ports[1:]:
        members[port] = member(port, ports[0])
    primary = ports[0]
    wait_for(lambda: int(ext_stats(primary)["replicas"]) == 2, what="two replicas")
    producers = [Producer(k, [f"127.0.0.1:{p}" for p in ports]) for k in range(PRODUCERS)]
    total = 0
    for rnd in range(FAILOVER_ROUNDS):
        def failover() -> None:
            nonlocal primary
            members[primary].kill()
            new = rng.choice([p for p in ports if p != primary])
            out = subprocess.run([sys.executable, "-m", "smallstalk", "promote",
                                  f"127.0.0.1:{new}"], capture_output=True, text=True,
                                 timeout=30)
            # Its own --min-replica-acks has no replica yet: the promotion is
            # done, its reply says nobody confirmed it.
            assert out.stdout.startswith(("PROMOTED", "NOT_REPLICATED")), out
            assert ext_stats(new)["role"] == "primary"
            for port in ports:
                if port != new:
                    members[port].kill()
                    members[port] = member(port, new)
            primary = new
            wait_for(lambda: int(ext_stats(primary)["replicas"]) == 2, timeout=60,
                     what="two replicas of the new primary")

        run_producers(producers, rng, failover)
        wait_for(lambda: all(ext_stats(p)["last-seq"] == ext_stats(primary)["last-seq"]
                             for p in ports), timeout=60, what="replicas caught up")
        total = check_exactly_once(primary, producers, f"failover round {rnd}")
    print(f"{FAILOVER_ROUNDS} failovers: {total} keys, each with exactly one job")
    assert total > 0


def test_a_key_s_server_gone_the_client_finds_the_cluster_and_its_new_primary(
        tmp_path: Path, servers: list[Server]) -> None:
    """A fresh client whose key belongs (by the independent servers' rule) to
    the primary, which is dead: it asks the other members, learns from `ext-stats`
    that they are replicas, and takes the put to whichever is promoted; the
    key's job is the one the old primary made (--min-replica-acks 1)."""
    acks = ("--min-replica-acks", "1", "--replica-ack-timeout", "2")
    primary = start_smallstalk(tmp_path, *acks, data_dir=tmp_path / "p")
    servers.append(primary)
    # The replica, once promoted, answers alone (no --min-replica-acks: it has no
    # replica of its own here); the primary's acks put the key on it first.
    replica = start_smallstalk(tmp_path, "--replica-of", f"127.0.0.1:{primary.port}",
                               data_dir=tmp_path / "r")
    servers.append(replica)
    wait_for(lambda: int(ext_stats(primary.port)["replicas"]) == 1, what="the replica")
    addrs = [f"127.0.0.1:{primary.port}", f"127.0.0.1:{replica.port}"]
    with Client(addrs) as probe:  # a key whose server, by the rule, is the primary
        key = next(k for k in (f"order-{n}" for n in range(100))
                   if probe._core._home(TUBE, k) == 0)
    with Client(addrs[0]) as c:
        made = c.put(b"charge", tube=TUBE, key=key)
    primary.kill()

    def promote_soon() -> None:
        time.sleep(1.5)
        out = subprocess.run([sys.executable, "-m", "smallstalk", "promote", addrs[1]],
                             capture_output=True, text=True, timeout=30)
        promoted.append(out.stdout)

    promoted: list[str] = []
    promoter = threading.Thread(target=promote_soon, daemon=True)
    promoter.start()
    with Client(addrs, connect_timeout=1.0, read_timeout=3.0) as c:
        ref = c.put(b"charge", tube=TUBE, key=key)
    promoter.join(30)
    assert promoted and promoted[0].startswith("PROMOTED"), promoted
    assert (ref.server, ref.id) == (addrs[1], made.id)
    with connect(replica.port) as c:
        assert c.call(b"use %s\r\n" % TUBE.encode()).status == b"USING"
        assert int(c.call(b"stats-tube %s\r\n" % TUBE.encode()).yaml()["current-jobs-ready"]) == 1
