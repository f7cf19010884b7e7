"""How clients find the primary of an HA cluster, and the operator's verbs, with real processes.

One etcd, three smallstalk members with consoles (--http), and HAProxy from
Debian in front of them, configured as docs/HA.md says (`option httpchk
OPTIONS /primary`, `on-marked-down shutdown-sessions`):

- the health checks answer 200/503 as documented, for GET, HEAD and OPTIONS;
- greenstalk, unchanged, produces and consumes through HAProxy's one
  address across a kill -9 of the primary, reconnecting as clients do;
- `smallstalk ha status` lists the members, `switchover --to` moves the lock
  without losing an acknowledged put, `pause` stops automatic failover and
  `resume` brings it back;
- the package's own client, given every member's address, finds the
  primary and follows it after a failover.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import greenstalk
import httpx
import pytest

from smallstalk.client import Client as SmallClient

from ..support.hacluster import ETCD, HOSTS, Ledger, check_history, present_bodies, start_etcd
from ..support.hacluster import HACluster as _HACluster
from ..support.procs import REPO, free_port, wait_for
from ..support.threads import start as start_thread

HAPROXY = shutil.which("haproxy")
pytestmark = [pytest.mark.skipif(ETCD is None or HAPROXY is None,
                                 reason="etcd and haproxy are not installed "
                                 "(make system-packages installs them)"),
              pytest.mark.timeout(600)]
TTL = 2

HAPROXY_CFG = """\
global
    maxconn 200
defaults
    mode tcp
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    timeout check 1s
listen beanstalk
    bind 127.0.0.1:{port}
    option httpchk OPTIONS /primary
    http-check expect status 200
    default-server inter 200ms fall 2 rise 1 on-marked-down shutdown-sessions
{servers}
"""


@pytest.fixture
def setup(tmp_path):
    store = start_etcd(tmp_path)
    ports = [free_port() for _ in HOSTS]
    http = [free_port() for _ in HOSTS]
    c = _HACluster(tmp_path, store, "web", (), TTL, ports)
    procs = []
    try:
        for i in range(3):
            c.flags = ("--http", f"{HOSTS[i]}:{http[i]}")
            c.start(i)
        c.flags = ()
        front = free_port()
        servers = "\n".join(f"    server {c.node(i)} {HOSTS[i]}:{ports[i]} check port {http[i]}"
                            for i in range(3))
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(HAPROXY_CFG.format(port=front, servers=servers))
        hp = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)],
                              stdout=open(tmp_path / "haproxy.log", "ab"),
                              stderr=subprocess.STDOUT)
        procs.append(hp)
        yield c, store, http, front, tmp_path
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=15)
        c.stop()
        store.stop()


def codes(host: str, port: int, path: str) -> tuple[int, int, int]:
    url = f"http://{host}:{port}{path}"
    return (httpx.get(url, timeout=5).status_code, httpx.head(url, timeout=5).status_code,
            httpx.options(url, timeout=5).status_code)


def ha(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "smallstalk", "ha", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def with_flags(c: _HACluster, http: list[int], i: int) -> None:
    c.flags = ("--http", f"{HOSTS[i]}:{http[i]}")
    try:
        c.start(i)
    finally:
        c.flags = ()


def test_health_checks_haproxy_greenstalk_and_the_operator_verbs(setup, capsys):
    c, store, http, front, tmp = setup
    leader = c.wait_leader(30)
    c.wait_members({c.node(i): "primary" if c.node(i) == leader else "replica"
                    for i in range(3)})
    li = c.index(leader)
    for i in range(3):
        want = 200 if i == li else 503
        assert codes(HOSTS[i], http[i], "/primary") == (want,) * 3
        assert codes(HOSTS[i], http[i], "/replica") == (503 if i == li else 200,) * 3
        assert codes(HOSTS[i], http[i], "/replica?lag=0")[0] in ((503,) if i == li else (200,))
        assert codes(HOSTS[i], http[i], "/health") == (200, 200, 200)
    body = httpx.get(f"http://{HOSTS[li]}:{http[li]}/primary", timeout=5).json()
    assert body["role"] == "primary" and body["name"] == leader
    page = httpx.get(f"http://{HOSTS[li]}:{http[li]}/cluster", timeout=5).text
    assert 'id="leader">' + leader in page and "Last failovers" in page

    # greenstalk through HAProxy across a kill -9 of the primary, and the
    # package's own client given every member's address.
    ledger = Ledger()
    own = Ledger()
    addrs = [f"{HOSTS[i]}:{c.ports[i]}" for i in range(3)]
    threads = [start_thread(_green_producer, front, ledger),
               start_thread(_green_worker, front, ledger),
               start_thread(_own_producer, addrs, own)]
    try:
        wait_for(lambda: len(ledger.puts) > 30, 30, "puts through haproxy")
        t_kill = time.monotonic()
        c.kill(li)
        new = c.wait_leader(TTL + 20, not_=leader)
        wait_for(lambda: any(t > t_kill + 0.5 for t, *_ in ledger.puts), 30,
                 "greenstalk puts after the failover")
        wait_for(lambda: any(t > t_kill + 0.5 for t, *_ in own.puts), 30,
                 "the package client's puts after the failover")
        with_flags(c, http, li)
        c.wait_members({leader: "replica", new: "primary"}, 60)
    finally:
        ledger.stop.set()
        own.stop.set()
        for t in threads:
            t.join(60)
    result = check_history(ledger, present_bodies(c, c.index(new), ledger), strict=False)
    with capsys.disabled():
        print(f"\ngreenstalk through haproxy: {result}; "
              f"{sum(1 for t, *_ in ledger.puts if t > t_kill)} puts after the kill; "
              f"the package client: {len(own.puts)} puts, {len(own.put_errors)} errors")
    # Every put the package client was told INSERTED is there (asynchronous
    # mode may lose the last few of the old primary's, as with greenstalk).
    own_result = check_history(own, present_bodies(c, c.index(new), own), strict=False)
    assert own_result["acked"] > 0

    # The operator's verbs.
    st = ha("status", "--etcd", store.urls[0], "--cluster", "web")
    assert st.returncode == 0, st.stderr
    assert f"leader: {new}" in st.stdout and all(f"n{k}" in st.stdout for k in (1, 2, 3))
    target = next(c.node(i) for i in range(3) if c.node(i) != new)
    sw = ha("switchover", "--to", target, "--etcd", store.urls[0], "--cluster", "web")
    assert sw.returncode == 0, (sw.stdout, sw.stderr)
    assert c.wait_leader(10) == target
    assert ha("switchover", "--to", "nobody", "--etcd", store.urls[0],
              "--cluster", "web").returncode == 1
    assert ha("pause", "--etcd", store.urls[0], "--cluster", "web").returncode == 0
    c.kill(c.index(target))
    time.sleep(TTL + 2)
    assert c.leader() is None, "a failover while paused"
    assert "PAUSED" in ha("status", "--etcd", store.urls[0], "--cluster", "web").stdout
    assert ha("resume", "--etcd", store.urls[0], "--cluster", "web").returncode == 0
    c.wait_leader(TTL + 20, not_=target)


def _green_producer(port: int, ledger: Ledger) -> None:
    n = 0
    while not ledger.stop.is_set():
        try:
            with greenstalk.Client(("127.0.0.1", port)) as g:
                while not ledger.stop.is_set():
                    body = f"g-{n}"
                    n += 1
                    job_id = g.put(body)
                    ledger.note("puts", (time.monotonic(), "front", body.encode(), job_id))
        except (OSError, greenstalk.Error, ConnectionError):
            time.sleep(0.1)  # HAProxy cut the session, or nothing took it: reconnect


def _green_worker(port: int, ledger: Ledger) -> None:
    while not ledger.stop.is_set():
        try:
            with greenstalk.Client(("127.0.0.1", port)) as g:
                while not ledger.stop.is_set():
                    try:
                        job = g.reserve(timeout=1)
                    except greenstalk.TimedOutError:
                        continue
                    ledger.note("delete_tries", job.body.encode())
                    g.delete(job)
                    ledger.note("deletes", (time.monotonic(), "front", job.body.encode()))
        except (OSError, greenstalk.Error, ConnectionError):
            time.sleep(0.1)


def _own_producer(addrs: list[str], ledger: Ledger) -> None:
    """smallstalk.client with every member's address: it finds the primary itself."""
    n = 0
    with SmallClient(addrs, read_timeout=5.0) as client:
        while not ledger.stop.is_set():
            body = f"own-{n}"
            n += 1
            try:
                ref = client.put(body)
            except Exception as e:  # noqa: BLE001 -- any failure is counted, then retried
                ledger.note("put_errors", (time.monotonic(), "own", body.encode(),
                                           type(e).__name__.encode()))
                time.sleep(0.1)
                continue
            ledger.note("puts", (time.monotonic(), "own", body.encode(), ref.id))


def test_health_checks_without_ha(tmp_path):
    """A plain primary and its replica answer the same checks: HAProxy can
    front a manual-failover pair too."""
    from ..support.procs import start_smallstalk

    hp, hr = free_port(), free_port()
    primary = start_smallstalk(tmp_path, "--http", f"127.0.0.1:{hp}", data_dir=tmp_path / "p")
    replica = None
    try:
        replica = start_smallstalk(tmp_path, "--http", f"127.0.0.1:{hr}", "--replica-of",
                                   f"127.0.0.1:{primary.port}", data_dir=tmp_path / "r")
        assert codes("127.0.0.1", hp, "/primary") == (200, 200, 200)
        assert codes("127.0.0.1", hp, "/replica") == (503, 503, 503)
        wait_for(lambda: codes("127.0.0.1", hr, "/replica")[0] == 200, 30, "the replica")
        assert codes("127.0.0.1", hr, "/primary") == (503, 503, 503)
        assert codes("127.0.0.1", hr, "/replica?lag=0")[0] == 200
        assert httpx.get(f"http://127.0.0.1:{hr}/replica?lag=x", timeout=5).status_code == 400
        assert codes("127.0.0.1", hr, "/health") == (200, 200, 200)
        assert "not a member of an HA cluster" in httpx.get(
            f"http://127.0.0.1:{hp}/cluster", timeout=5).text
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()
