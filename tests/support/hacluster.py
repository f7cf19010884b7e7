"""Real HA clusters for tests: etcd from Debian, smallstalk members on 127.0.0.x, and a load.

- `start_etcd(tmp, n)`: an etcd cluster of `n` members on loopback ports
  (`EtcdCluster.pause/resume` = SIGSTOP/SIGCONT, `kill`), the store's view
  read through its JSON gateway (`view`).
- `HACluster`: smallstalk members `n1`.. on 127.0.0.1, .2, .3, each its own
  data directory, all with `--ha-etcd`; `leader()` / `wait_leader()` ask the
  store; `start(i)` starts (or restarts) a member, `kill(i)` is kill -9.
- `Ledger` and its threads: producers that follow the primary (trying each
  member until one answers INSERTED), workers that reserve and delete, every
  reply recorded with its time, so a test can check the whole acknowledged
  history afterwards (`check_history`).

Only processes started here are stopped, by PID; every wait is bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import attrs
import httpx

from smallstalk.core import protocol as p
from smallstalk.replication import cluster as cl
from smallstalk.replication.etcd import b64, prefix_end

from .bsclient import Client, peek_ids, put_cmd
from .procs import Server, free_port, start_smallstalk, wait_for

ETCD = shutil.which("etcd")


@attrs.define
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data: Path
    log: Path
    proc: subprocess.Popen | None = None
    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()  # e.g. ("ip", "netns", "exec", NS)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


@attrs.define
class EtcdCluster:
    members: list[EtcdMember]

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def start(self, i: int | None = None) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members if i is None else [self.members[i]]:
            cmd = [*m.prefix, ETCD, "--name", m.name, "--data-dir", str(m.data),
                   "--listen-client-urls", m.url, "--advertise-client-urls", m.url,
                   "--listen-peer-urls", m.peer_url,
                   "--initial-advertise-peer-urls", m.peer_url,
                   "--initial-cluster", initial, "--initial-cluster-state", "new",
                   "--heartbeat-interval", "100", "--election-timeout", "1000"]
            m.proc = subprocess.Popen(cmd, stdout=open(m.log, "ab"), stderr=subprocess.STDOUT)
        wait_for(lambda: self.healthy(i), 60, "etcd to answer")

    def healthy(self, i: int | None = None) -> bool:
        for m in self.members if i is None else [self.members[i]]:
            try:
                r = httpx.post(m.url + "/v3/kv/range", json={"key": b64("x")}, timeout=1)
                if r.status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True

    def signal(self, i: int, sig: int) -> None:
        p = self.members[i].proc
        if p is not None and p.poll() is None:
            os.kill(p.pid, sig)

    def pause(self, i: int = 0) -> None:
        self.signal(i, signal.SIGSTOP)

    def resume(self, i: int = 0) -> None:
        self.signal(i, signal.SIGCONT)

    def kill(self, i: int) -> None:
        self.signal(i, signal.SIGCONT)
        self.signal(i, signal.SIGKILL)
        self.members[i].proc.wait(timeout=30)

    def stop(self) -> None:
        for i, m in enumerate(self.members):
            if m.proc is not None and m.proc.poll() is None:
                self.signal(i, signal.SIGCONT)
                m.proc.terminate()
                try:
                    m.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(timeout=15)

    def leader_index(self) -> int | None:
        """Which etcd member leads the store's own Raft group."""
        for i, m in enumerate(self.members):
            try:
                st = httpx.post(m.url + "/v3/maintenance/status", json={}, timeout=1).json()
            except (httpx.HTTPError, ValueError):
                continue
            if st.get("leader") == st.get("header", {}).get("member_id"):
                return i
        return None

    def view(self, cluster: str, timeout: float = 1.0) -> cl.Cluster | None:
        pre = cl.prefix(cluster)
        for m in self.members:
            try:
                out = httpx.post(m.url + "/v3/kv/range",
                                 json={"key": b64(pre), "range_end": prefix_end(pre)},
                                 timeout=timeout).json()
            except (httpx.HTTPError, ValueError):
                continue
            from smallstalk.replication.etcd import _kv

            return cl.read_cluster(cluster, int(out["header"]["revision"]),
                                   [_kv(kv) for kv in out.get("kvs", [])])
        return None

    def put(self, key: str, value: bytes) -> None:
        httpx.post(self.members[0].url + "/v3/kv/put", json={"key": b64(key), "value": b64(value)},
                   timeout=2).raise_for_status()


def start_etcd(tmp: Path, n: int = 1, host: str = "127.0.0.1",
               prefix: tuple[str, ...] = ()) -> EtcdCluster:
    assert ETCD, "etcd is not installed (make system-packages installs etcd-server)"
    members = [EtcdMember(f"e{i}", free_port(), free_port(), tmp / f"etcd{i}",
                          tmp / f"etcd{i}.log", None, host, prefix) for i in range(n)]
    c = EtcdCluster(members)
    c.start()
    return c


HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


@attrs.define
class HACluster:
    tmp: Path
    store: EtcdCluster
    name: str
    flags: tuple[str, ...]
    ttl: int
    ports: list[int]
    servers: dict[int, Server] = attrs.Factory(dict)
    hosts: list[str] = HOSTS
    prefixes: list[tuple[str, ...]] | None = None  # per member: a command that runs it

    def node(self, i: int) -> str:
        return f"n{i + 1}"

    def index(self, node: str) -> int:
        return int(node[1:]) - 1

    def address(self, i: int) -> tuple[str, int]:
        return self.hosts[i], self.ports[i]

    def start(self, i: int) -> Server:
        host, port = self.address(i)
        s = start_smallstalk(self.tmp, "--ha-etcd", ",".join(self.store.urls),
                             "--ha-cluster", self.name, "--ha-name", self.node(i),
                             "--ha-ttl", str(self.ttl), *self.flags,
                             data_dir=self.tmp / self.node(i), port=port, host=host,
                             prefix=self.prefixes[i] if self.prefixes else ())
        self.servers[i] = s
        return s

    def kill(self, i: int) -> None:
        self.servers[i].kill()

    def stop(self) -> None:
        for s in self.servers.values():
            if s.proc.poll() is None:
                os.kill(s.pid, signal.SIGCONT)
            s.stop()

    def view(self) -> cl.Cluster | None:
        return self.store.view(self.name)

    def leader(self) -> str | None:
        v = self.view()
        if v is None or v.leader is None:
            return None
        m = v.members.get(v.leader.name)
        return v.leader.name if m is not None and m.role == "primary" else None

    def wait_leader(self, timeout: float = 30.0, not_: str | None = None) -> str:
        found: list[str] = []

        def ok() -> bool:
            name = self.leader()
            if name is not None and name != not_:
                found.append(name)
                return True
            return False

        wait_for(ok, timeout, f"a leader other than {not_}" if not_ else "a leader")
        return found[-1]

    def wait_members(self, roles: dict[str, str], timeout: float = 30.0) -> None:
        """Until each named member reports that role (and replicas no lag)."""
        def ok() -> bool:
            v = self.view()
            if v is None:
                return False
            for node, role in roles.items():
                m = v.members.get(node)
                if m is None or m.role != role or m.lag:
                    return False
            return True

        try:
            wait_for(ok, timeout, f"members {roles}")
        except AssertionError as e:
            raise AssertionError(f"{e}; store: {self.view()}\n{self.log_tails()}") from None

    def log_tails(self, lines: int = 15) -> str:
        """The end of every member's log, for a failure message."""
        out = []
        for i, s in sorted(self.servers.items()):
            tail = s.log().splitlines()[-lines:]
            out.append(f"--- {self.node(i)} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def client(self, i: int, timeout: float = 2.0) -> Client:
        host, port = self.address(i)
        return Client(port, timeout, host=host)


def start_cluster(tmp: Path, store: EtcdCluster, *flags: str, ttl: int = 2, n: int = 3,
                  name: str = "c", hosts: list[str] = HOSTS,
                  prefixes: list[tuple[str, ...]] | None = None) -> HACluster:
    ports = [free_port() for _ in range(n)]
    c = HACluster(tmp, store, name, flags, ttl, ports, {}, hosts, prefixes)
    for i in range(n):
        c.start(i)
    return c


# --- the load and its ledger ----------------------------------------------------------


@attrs.define
class Ledger:
    """Every reply a client got, with the time it arrived (time.monotonic())."""

    lock: threading.Lock = attrs.Factory(threading.Lock)
    puts: list[tuple[float, str, bytes, int]] = attrs.Factory(list)  # (t, node, body, id)
    put_errors: list[tuple[float, str, bytes, bytes]] = attrs.Factory(list)  # unknown outcome
    deletes: list[tuple[float, str, bytes]] = attrs.Factory(list)  # DELETED: (t, node, body)
    delete_tries: list[bytes] = attrs.Factory(list)  # bodies whose delete may have happened
    stop: threading.Event = attrs.Factory(threading.Event)

    def note(self, kind: str, item: tuple) -> None:
        with self.lock:
            getattr(self, kind).append(item)


def _connect_any(c: HACluster, start: int, ledger: Ledger) -> tuple[int, Client] | None:
    for k in range(len(c.ports)):
        i = (start + k) % len(c.ports)
        if ledger.stop.is_set():
            return None
        try:
            return i, c.client(i)
        except OSError:
            continue
    time.sleep(0.05)
    return None


def producer(c: HACluster, ledger: Ledger, tag: str, keyed: bool = False) -> None:
    """Put unique bodies on whichever member takes them, until `ledger.stop`.

    `keyed`: as `put-unique` with the body as its key, sent again (to the
    next member) until a member answers INSERTED or DUPLICATE: exactly-once
    enqueue, so every key the ledger holds names one job. Unkeyed puts are
    never repeated (a repeat could make a second job)."""
    n = 0
    i = 0
    conn: Client | None = None
    body = b""
    retry = False
    while not ledger.stop.is_set():
        if conn is None:
            got = _connect_any(c, i, ledger)
            if got is None:
                continue
            i, conn = got
        if not retry:
            body = f"{tag}-{n}".encode()
            n += 1
        cmd = (p.render(p.PutUnique(body.decode(), 0, 0, 60, body)) if keyed
               else put_cmd(body))
        try:
            reply = conn.call(cmd)
        except (OSError, ConnectionError, ValueError):
            reply = None
        if reply is not None and reply.status in (b"INSERTED", b"DUPLICATE"):
            ledger.note("puts", (time.monotonic(), c.node(i), body, reply.id))
            retry = False
            continue
        status = b"connection" if reply is None else reply.status
        # READ_ONLY: refused before anything was logged; anything else: unknown.
        retry = keyed or status == b"READ_ONLY"
        if status != b"READ_ONLY" and not keyed:
            ledger.note("put_errors", (time.monotonic(), c.node(i), body, status))
        conn.close()
        conn, i = None, i + 1
        time.sleep(0.02)
    if retry and keyed:
        ledger.note("put_errors", (time.monotonic(), "?", body, b"stopped while retrying"))
    if conn is not None:
        conn.close()


def worker(c: HACluster, ledger: Ledger) -> None:
    """Reserve and delete on whichever member is the primary, until `ledger.stop`."""
    i = 0
    conn: Client | None = None
    while not ledger.stop.is_set():
        if conn is None:
            got = _connect_any(c, i, ledger)
            if got is None:
                continue
            i, conn = got
        try:
            r = conn.call(b"reserve-with-timeout 0\r\n")
            if r.status == b"RESERVED":
                ledger.note("delete_tries", r.body)
                d = conn.call(b"delete %d\r\n" % r.id)
                if d.status == b"DELETED":
                    ledger.note("deletes", (time.monotonic(), c.node(i), r.body))
                    continue
            elif r.status == b"TIMED_OUT":
                time.sleep(0.01)
                continue
        except (OSError, ConnectionError, ValueError):
            pass
        conn.close()
        conn, i = None, i + 1
        time.sleep(0.02)
    if conn is not None:
        conn.close()


def present_bodies(c: HACluster, i: int, ledger: Ledger, margin: int = 2000) -> list[bytes]:
    """Every job body on member i, by peeking each id up to past the highest
    acknowledged one (peeks change nothing; ids are never reused)."""
    top = max((job_id for _t, _n, _b, job_id in ledger.puts), default=0) + margin
    with c.client(i, timeout=10) as conn:
        return list(peek_ids(conn, list(range(1, top + 1))).values())


def check_history(ledger: Ledger, present: list[bytes], strict: bool = True) -> dict[str, int]:
    """The Jepsen-style check of the whole acknowledged history against the
    bodies `present` on the primary: no job twice (each put, keyed or not,
    made at most one job), and with `strict` (synchronous mode) every
    acknowledged put present or deleted and no acknowledged delete undone.
    Asynchronous mode may lose both: they are counted, not asserted."""
    seen: dict[bytes, int] = {}
    for b in present:
        seen[b] = seen.get(b, 0) + 1
    deleted_n: dict[bytes, int] = {}
    for _t, _n, b in ledger.deletes:
        deleted_n[b] = deleted_n.get(b, 0) + 1
    acked = {body for _t, _n, body, _id in ledger.puts}
    deleted = set(deleted_n)
    tried = set(ledger.delete_tries)
    dup = [b for b, k in seen.items() if k > 1]
    lost = sorted(acked - set(seen) - tried)
    # An acknowledged delete undone: the job is back, or it was deleted again.
    back = sorted((deleted & set(seen)) | {b for b, k in deleted_n.items() if k > 1})
    assert not dup, f"jobs present twice: {dup[:5]}"
    if strict:
        assert not back, f"acknowledged deletes undone: {back[:5]}"
        assert not lost, f"acknowledged puts lost: {lost[:5]}"
    return {"acked": len(acked), "lost": len(lost), "deletes_undone": len(back),
            "deleted": len(deleted), "present": len(seen), "lost_examples": lost[:5]}


def ack_times(ledger: Ledger, node: str) -> list[float]:
    return [t for t, n, _b, _id in ledger.puts if n == node]


def first_ack_after(ledger: Ledger, t0: float, not_node: str) -> float | None:
    times = [t for t, n, _b, _id in ledger.puts if t > t0 and n != not_node]
    return min(times) if times else None


def ports_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
