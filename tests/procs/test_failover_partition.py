"""A network partition that cuts the primary off from the store but not from its clients.

The test makes its own network: a bridge in the root namespace (the test's
clients live there), and one network namespace per process, each joined to
the bridge by a veth pair on addresses of a private /24 of its own: etcd in
one, each of the three smallstalk members in another. Cutting the primary
off from the store is a blackhole route to etcd's address inside the
primary's namespace: clients and the other members still reach it.

With --min-replica-acks 1: the primary stops acknowledging before its lease
can have run out, a member on the store's side takes over, no acknowledged
put is lost; after healing, the old primary follows the new one and all
three hold one history (same epoch, history id and last seq).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ..support.hacluster import (
    ETCD,
    Ledger,
    check_history,
    present_bodies,
    producer,
    start_cluster,
    start_etcd,
    worker,
)
from ..support.procs import wait_for
from ..support.threads import start as start_thread

pytestmark = [pytest.mark.skipif(ETCD is None, reason="etcd is not installed "
                                 "(make system-packages installs etcd-server)"),
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
              pytest.mark.timeout(300)]
TTL = 2


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Network:
    """A bridge, and namespaces on it: `add(name, last_octet)` gives a namespace
    its own address in 10.213.<k>.0/24."""

    def __init__(self) -> None:
        self.k = 100 + os.getpid() % 150
        self.tag = f"ss{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.spaces: list[str] = []
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"10.213.{self.k}.254/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def addr(self, octet: int) -> str:
        return f"10.213.{self.k}.{octet}"

    def add(self, name: str, octet: int) -> tuple[str, ...]:
        ns = f"{self.tag}{name}"
        ip("netns", "add", ns)
        self.spaces.append(ns)
        outer, inner = f"{self.tag}{name}o", f"{self.tag}{name}i"
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", outer, "master", self.bridge)
        ip("link", "set", outer, "up")
        ip("link", "set", inner, "netns", ns)
        run = ("ip", "netns", "exec", ns)
        subprocess.run([*run, "ip", "addr", "add", f"{self.addr(octet)}/24", "dev", inner],
                       check=True)
        subprocess.run([*run, "ip", "link", "set", inner, "up"], check=True)
        subprocess.run([*run, "ip", "link", "set", "lo", "up"], check=True)
        return run

    def cut(self, run: tuple[str, ...], octet: int) -> None:
        subprocess.run([*run, "ip", "route", "add", "blackhole", f"{self.addr(octet)}/32"],
                       check=True)

    def heal(self, run: tuple[str, ...], octet: int) -> None:
        subprocess.run([*run, "ip", "route", "del", "blackhole", f"{self.addr(octet)}/32"],
                       check=True)

    def close(self) -> None:
        for ns in self.spaces:
            ip("netns", "del", ns, check=False)  # its veth ends go with it
        ip("link", "del", self.bridge, check=False)


@pytest.fixture
def net():
    n = Network()
    try:
        yield n
    finally:
        n.close()


def test_a_primary_cut_off_from_the_store_stops_and_one_history_remains(tmp_path, net, capsys):
    etcd_ns = net.add("e", 10)
    store = start_etcd(tmp_path, host=net.addr(10), prefix=etcd_ns)
    spaces = [net.add(f"n{i + 1}", i + 1) for i in range(3)]
    hosts = [net.addr(i + 1) for i in range(3)]
    c = None
    try:
        # Replication is an admin command: members on other addresses need a
        # token or to be allowed (docs/SECURITY.md).
        c = start_cluster(tmp_path, store, "--min-replica-acks", "1",
                          "--admin-allow", f"{net.addr(0)}/24", ttl=TTL, hosts=hosts,
                          prefixes=spaces)
        old = c.wait_leader(30)
        c.wait_members({c.node(i): ("primary" if c.node(i) == old else "replica")
                        for i in range(3)})
        o = c.index(old)
        ledger = Ledger()
        threads = [start_thread(producer, c, ledger, f"p{k}") for k in range(2)]
        threads.append(start_thread(worker, c, ledger))
        try:
            wait_for(lambda: sum(1 for *_x, n, _b, _i in
                                 [(t, n, b, i) for t, n, b, i in ledger.puts] if n == old) > 30,
                     30, "puts on the primary")
            t_cut = time.monotonic()
            net.cut(spaces[o], 10)
            new = c.wait_leader(TTL + 20, not_=old)
            wait_for(lambda: any(t > t_cut and n == new for t, n, _b, _i in ledger.puts), 30,
                     "puts acknowledged by the new primary")
            time.sleep(1.0)
            net.heal(spaces[o], 10)
            c.wait_members({old: "replica", new: "primary"}, 60)
            time.sleep(0.5)
        finally:
            ledger.stop.set()
            for t in threads:
                t.join(60)
        late = [t - t_cut for t, n, _b, _i in ledger.puts if n == old and t > t_cut]
        first_new = min(t for t, n, _b, _i in ledger.puts if n == new and t > t_cut) - t_cut
        result = check_history(ledger, present_bodies(c, c.index(new), ledger))
        # One history: every member at the same epoch, history id and seq.
        wait_for(lambda: len({(m.epoch, m.history, m.seq)
                              for m in c.view().members.values()}) == 1, 30,
                 "the three members to agree")
        with capsys.disabled():
            print(f"\npartition: old primary's last acknowledgement "
                  f"{max(late, default=0.0):.2f} s after the cut (lease {TTL} s); "
                  f"new primary's first {first_new:.2f} s after it; history {result}")
        assert max(late, default=0.0) < TTL
        assert result["lost"] == 0, result
        assert len(c.view().members) == 3
    finally:
        if c is not None:
            c.stop()
        store.stop()
