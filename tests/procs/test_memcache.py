"""The memcache port (kestrel's dialect) of a real server process, over real sockets.

Case by case in raw bytes; pymemcache, unchanged, as producer and consumer
(reliable reads across a dropped connection included); jobs crossing between
the memcache and the beanstalkd ports; waits, fanout, expiry, the admin
rules, restarts; and hostile input. docs/KESTREL.md says what is promised.
"""

from __future__ import annotations

import random
import socket
import time

import attrs
import pytest
from pymemcache.client.base import Client as MemcacheClient
from pymemcache.exceptions import MemcacheClientError

from ..support.bsclient import connect
from ..support.configfile import write
from ..support.procs import Server, free_port, start_smallstalk, wait_for


class Raw:
    """A memcache connection in raw bytes: send, then read exactly what is expected."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""

    def ask(self, data: bytes, expect_len: int | None = None) -> bytes:
        """The replies to `data`: exactly `expect_len` bytes, or else all of
        them up to a `version` sent behind (answered after everything before
        it, so no quiet period is guessed), whose own reply is left out."""
        if expect_len is not None:
            self.sock.sendall(data)
            return self.read(expect_len)
        self.sock.sendall(data + b"version\r\n")
        out = b""
        self.sock.settimeout(10)
        while True:
            chunk = self.sock.recv(65536)
            assert chunk, f"closed before answering {data!r}: got {out!r}"
            out += chunk
            end = out.rfind(b"VERSION ")
            if end >= 0 and out.endswith(b"\r\n") and (end == 0 or out[end - 2:end] == b"\r\n"):
                return out[:end]

    def ask_until_closed(self, data: bytes) -> bytes:
        """The replies to `data` when the server hangs up after them."""
        self.sock.sendall(data)
        out = b""
        self.sock.settimeout(10)
        try:
            while chunk := self.sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out

    def read(self, expect_len: int) -> bytes:
        """Exactly `expect_len` bytes (or fewer if the server hangs up)."""
        out = b""
        self.sock.settimeout(10)
        while len(out) < expect_len:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            out += chunk
        return out

    def closed_by_server(self) -> bool:
        self.sock.settimeout(10)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def start(tmp_path, *args: str, data: bool = True) -> tuple[Server, int]:
    mport = free_port()
    srv = start_smallstalk(tmp_path, "--memcache-port", str(mport), "--fsync", "never", *args,
                           data_dir=tmp_path / "data" if data else None)
    return srv, mport


@attrs.frozen
class Both:
    """A server and its memcache port."""

    srv: Server
    memcache_port: int

    @property
    def port(self) -> int:
        return self.srv.port

    @property
    def proc(self):
        return self.srv.proc

    def log(self) -> str:
        return self.srv.log()


@pytest.fixture
def server(tmp_path):
    srv, mport = start(tmp_path)
    yield Both(srv, mport)
    srv.stop()


def mc(server: Both) -> MemcacheClient:
    return MemcacheClient(("127.0.0.1", server.memcache_port), connect_timeout=10, timeout=10)


# (sent, exact answer): one connection, in order.
SCRIPT = [
    (b"get work\r\n", b"END\r\n"),  # an empty queue answers END at once
    (b"set work 0 0 5\r\nhello\r\n", b"STORED\r\n"),
    (b"set work 0 0 5 noreply\r\nworld\r\n", b""),
    (b"get work/peek\r\n", b"VALUE work/peek 0 5\r\nhello\r\nEND\r\n"),
    (b"get work/open\r\n", b"VALUE work/open 0 5\r\nhello\r\nEND\r\n"),
    (b"get work/peek\r\n", b"VALUE work/peek 0 5\r\nworld\r\nEND\r\n"),  # hello is open
    (b"get work/abort\r\n", b"END\r\n"),  # hello is back at the head
    (b"get work/close/open\r\n", b"VALUE work/close/open 0 5\r\nhello\r\nEND\r\n"),
    (b"get work/close/open\r\n", b"VALUE work/close/open 0 5\r\nworld\r\nEND\r\n"),
    (b"get work/close\r\n", b"END\r\n"),
    (b"get work/close\r\n", b"END\r\n"),  # nothing open: ignored
    (b"get work/t=50\r\n", b"END\r\n"),
    (b"set work 0 0 0\r\n\r\n", b"STORED\r\n"),
    (b"GET work\r\n", b"VALUE work 0 0\r\n\r\nEND\r\n"),
    (b"set a/b 0 0 1\r\nx\r\n", b"CLIENT_ERROR bad queue name (up to 200 letters, digits and "
     b"-+;.$_(), not starting with -)\r\n"),
    (b"version\r\n", None),  # VERSION <smallstalk's>
    (b"flush work\r\n", b"END\r\n"),
    (b"delete work\r\n", b"DELETED\r\n"),
    (b"flush_all\r\n", b"Flushed all queues.\r\n"),
    (b"set big 0 0 70000\r\n" + b"z" * 70000 + b"\r\n", b"NOT_STORED\r\n"),  # past -z
]


def test_the_protocol_case_by_case(server) -> None:
    c = Raw(server.memcache_port)
    for sent, expected in SCRIPT:
        got = c.ask(sent)
        if expected is None:
            assert got.startswith(b"VERSION ") and got.endswith(b"\r\n"), got
        else:
            assert got == expected, sent
    # kestrel's answers that end the connection:
    for sent, expected in [
        (b"get work/open/peek\r\n", b"CLIENT_ERROR bad option combination\r\n"),
        (b"frobnicate\r\n", b"CLIENT_ERROR unknown command\r\n"),
        (b"set work 0 0 1\r\nxy\r\n", b"CLIENT_ERROR bad data chunk\r\n"),
        (b"get " + b"w" * 5000 + b"\r\n", b"CLIENT_ERROR line too long\r\n"),
    ]:
        c = Raw(server.memcache_port)
        assert c.ask_until_closed(sent) == expected
        assert c.closed_by_server(), sent
    # A plain GET over an open read of the same queue: ERROR, and closed.
    c = Raw(server.memcache_port)
    c.ask(b"set work 0 0 1\r\nx\r\nset work 0 0 1\r\ny\r\n")
    assert c.ask(b"get work/open\r\n") == b"VALUE work/open 0 1\r\nx\r\nEND\r\n"
    assert c.ask_until_closed(b"get work\r\n") == b"ERROR\r\n"
    assert c.closed_by_server()
    # ... which put the open item back.
    c = Raw(server.memcache_port)
    assert c.ask(b"get work\r\n") == b"VALUE work 0 1\r\nx\r\nEND\r\n"


def test_stats_and_dump_stats_in_kestrels_names(server) -> None:
    c = Raw(server.memcache_port)
    c.ask(b"set jobs 0 0 3\r\nabc\r\nset jobs 0 0 2\r\nde\r\nget jobs/open\r\n")
    stats = dict(line.split(b" ")[1:] for line in c.ask(b"stats\r\n").split(b"\r\n")
                 if line.startswith(b"STAT "))
    assert stats[b"queue_jobs_items"] == b"1" and stats[b"queue_jobs_open_transactions"] == b"1"
    assert stats[b"queue_jobs_bytes"] == b"5" and stats[b"queue_jobs_total_items"] == b"2"
    assert stats[b"cmd_set"] == b"2" and stats[b"cmd_get"] == b"1"
    assert stats[b"get_hits"] == b"1" and stats[b"curr_items"] == b"1"
    for key in (b"uptime", b"time", b"version", b"total_items", b"bytes", b"curr_connections",
                b"queue_jobs_expired_items", b"queue_jobs_age", b"queue_jobs_waiters"):
        assert key in stats, key
    dump = c.ask(b"dump_stats jobs\r\n")
    assert dump.startswith(b"queue 'jobs' {\r\n  items=1\r\n") and dump.endswith(b"}\r\nEND\r\n")


def test_pymemcache_produces_and_consumes_with_reliable_reads_across_a_dropped_connection(
        server) -> None:
    producer, consumer = mc(server), mc(server)
    for i in range(20):
        assert producer.set("tasks", b"task-%d" % i, noreply=False)
    assert producer.set("tasks", b"fire-and-forget")  # pymemcache's default: noreply
    got = [consumer.get("tasks") for _ in range(5)]
    assert got == [b"task-%d" % i for i in range(5)]
    # Reliable reads: open one, drop the connection: the item comes back first.
    assert consumer.get("tasks/open") == b"task-5"
    consumer.close()  # a dropped connection; the next call reconnects
    again = mc(server)
    assert again.get("tasks/close/open") == b"task-5"
    assert again.get("tasks/close/open") == b"task-6"  # closes task-5 for good
    assert again.get("tasks/abort") is None  # task-6 back at the head
    assert again.get("tasks/t=1000/open") == b"task-6"
    rest = []
    while (item := again.get("tasks/close/open")) is not None:
        rest.append(item)
    assert rest == [b"task-%d" % i for i in range(7, 20)] + [b"fire-and-forget"]
    assert again.get("tasks/peek") is None
    assert int(again.stats()[b"queue_tasks_items"]) == 0
    # A refused combination is a client error (and kestrel hangs up).
    with pytest.raises(MemcacheClientError):
        again.get("tasks/open/peek")
    assert again.version()


def test_pymemcache_gets_and_a_silent_delete_of_a_bad_name_lose_nothing(server) -> None:
    """pymemcache sends `delete` with noreply: a bad name must not answer (an
    answer would be read as the next get's, and that get's item lost); its
    `gets` expects a cas field, which is the job's id."""
    c = mc(server)
    assert c.set("keep", b"K1", noreply=False) and c.set("keep", b"K2", noreply=False)
    c.delete("bad~q")  # noreply: nothing comes back
    assert c.get("keep") == b"K1"
    value, cas = c.gets("keep")
    assert value == b"K2" and int(cas) > 0
    assert c.get("keep/peek") is None  # taken, as a get takes it
    c.set("keep", b"K3", noreply=False)
    with connect(server.port) as bs:  # the cas is the beanstalkd job's id
        bs.call(b"use keep\r\n")
        peeked = bs.call(b"peek-ready\r\n")
    value, cas = c.gets("keep/peek")
    assert value == b"K3" and peeked.status == b"FOUND" and peeked.args[0] == cas


def test_a_job_crosses_from_memcache_to_beanstalkd_and_back(server) -> None:
    m = mc(server)
    assert m.set("bridge", b"from memcache", noreply=False)
    with connect(server.port) as bs:
        bs.call(b"watch bridge\r\n")
        job = bs.call(b"reserve-with-timeout 5\r\n")
        assert job.body == b"from memcache"
        assert bs.stats_job(job.id)["tube"] == "bridge"
        assert bs.call(b"delete %d\r\n" % job.id).line == b"DELETED"
        bs.call(b"use bridge\r\n")
        bs.put(b"from beanstalkd")
    assert m.get("bridge") == b"from beanstalkd"
    # An open read is a reservation: beanstalkd's workers see it reserved.
    assert m.set("bridge", b"held", noreply=False)
    assert m.get("bridge/open") == b"held"
    with connect(server.port) as bs:
        assert bs.call(b"stats-tube bridge\r\n").yaml()["current-jobs-reserved"] == "1"
    m.close()
    with connect(server.port) as bs:  # the connection ended: the job is ready again
        wait_for(lambda: bs.call(b"stats-tube bridge\r\n").yaml()["current-jobs-ready"] == "1",
                 10, "the open read to be given back")


def test_a_waiting_get_is_woken_by_a_beanstalkd_put_and_times_out_in_milliseconds(
        server) -> None:
    waiter = Raw(server.memcache_port)
    waiter.sock.sendall(b"get slow/t=10000\r\n")
    with connect(server.port) as bs:
        def waiting() -> bool:  # the tube exists once the GET has arrived
            reply = bs.call(b"stats-tube slow\r\n")
            return reply.status == b"OK" and reply.yaml()["current-waiting"] == "1"

        wait_for(waiting, 10, "the GET to wait")
        bs.call(b"use slow\r\n")
        bs.put(b"woken")
    assert waiter.read(len(b"VALUE slow/t=10000 0 5\r\nwoken\r\nEND\r\n")) == \
        b"VALUE slow/t=10000 0 5\r\nwoken\r\nEND\r\n"
    t0 = time.monotonic()
    assert waiter.ask(b"get slow/t=300\r\n", len(b"END\r\n")) == b"END\r\n"
    took = time.monotonic() - t0
    assert 0.25 <= took < 3.0, took  # milliseconds, not rounded to beanstalkd's seconds
    # A client that half-closes while it waits gets its empty answer at once.
    waiter.sock.sendall(b"get slow/t=60000\r\n")
    waiter.sock.shutdown(socket.SHUT_WR)
    assert waiter.read(len(b"END\r\n")) == b"END\r\n"


def test_fanout_queues_as_kestrels(server) -> None:
    m = mc(server)
    assert m.get("orders+audit") is None  # naming a fanout queue creates it
    assert m.get("orders+billing") is None
    assert m.set("orders", b"o-1", noreply=False)
    assert [m.get(q) for q in ("orders", "orders+audit", "orders+billing")] == [b"o-1"] * 3
    assert m.delete("orders+billing", noreply=False)  # stops its copies
    assert m.set("orders", b"o-2", noreply=False)
    assert m.get("orders+audit") == b"o-2" and m.get("orders+billing") is None


def test_expiry_is_the_jobs_max_age_and_expire_to_applies(tmp_path) -> None:
    cfg = write(tmp_path, '[tubes."short"]\nexpire-to = "dead"\n')
    srv, mport = start(tmp_path, "--config", str(cfg))
    try:
        c = Raw(mport)
        assert c.ask(b"set short 0 1 4\r\ngone\r\nset short 0 0 4\r\nkept\r\n") == \
            b"STORED\r\nSTORED\r\n"
        absolute = int(time.time()) + 3600  # a Unix time: an hour from now
        assert c.ask(b"set short 0 %d 5\r\nlater\r\n" % absolute) == b"STORED\r\n"
        with connect(srv.port) as bs:
            wait_for(lambda: bs.call(b"ext-stats-tube short\r\n").yaml()["jobs-expired"] == "1",
                     10, "the expiry")
            later = [j for j in (bs.call(b"peek %d\r\n" % i) for i in range(1, 5))
                     if j.line.startswith(b"FOUND") and j.body == b"later"]
            assert later
        assert c.ask(b"get dead\r\n") == b"VALUE dead 0 4\r\ngone\r\nEND\r\n"
        assert c.ask(b"get short\r\n") == b"VALUE short 0 4\r\nkept\r\nEND\r\n"
        assert b"STAT queue_short_expired_items 1\r\n" in c.ask(b"stats\r\n")
    finally:
        srv.stop()


def test_items_and_open_reads_survive_a_crash(tmp_path) -> None:
    data = tmp_path / "data"
    srv, mport = start(tmp_path)
    c = Raw(mport)
    c.ask(b"set durable 0 0 3\r\none\r\nset durable 0 0 3\r\ntwo\r\nset durable 0 0 5\r\nthree\r\n")
    assert c.ask(b"get durable\r\n") == b"VALUE durable 0 3\r\none\r\nEND\r\n"
    assert c.ask(b"get durable/open\r\n") == b"VALUE durable/open 0 3\r\ntwo\r\nEND\r\n"
    srv.kill()  # SIGKILL: the open read was never closed
    srv = start_smallstalk(tmp_path, "--memcache-port", str(mport), "--fsync", "never",
                           data_dir=data)
    try:
        c = Raw(mport)
        assert c.ask(b"get durable\r\n") == b"VALUE durable 0 3\r\ntwo\r\nEND\r\n"
        assert c.ask(b"get durable\r\n") == b"VALUE durable 0 5\r\nthree\r\nEND\r\n"
        assert c.ask(b"get durable\r\n") == b"END\r\n"
    finally:
        srv.stop()


def test_admin_commands_follow_the_beanstalkd_ports_rules(tmp_path) -> None:
    # No token, and loopback not among the admin addresses: refused.
    srv, mport = start(tmp_path, "--admin-allow", "10.9.0.0/16", data=False)
    try:
        c = Raw(mport)
        for cmd in (b"flush q\r\n", b"delete q\r\n", b"flush_all\r\n", b"reload\r\n",
                    b"shutdown\r\n"):
            assert c.ask(cmd).startswith(b"CLIENT_ERROR UNAUTHORIZED: 127.0.0.1 is not an "
                                         b"admin address"), cmd
        assert c.ask(b"set q 0 0 1\r\nx\r\nget q\r\n") == b"STORED\r\nVALUE q 0 1\r\nx\r\nEND\r\n"
    finally:
        srv.stop()
    token = tmp_path / "token"
    token.write_text("tok-" + "a" * 40 + "\n")
    cfg = write(tmp_path, '[tubes."q"]\nmax-jobs = 5\n')
    srv, mport = start(tmp_path, "--admin-token-file", str(token), "--config", str(cfg),
                       data=False)
    try:
        c = Raw(mport)
        assert c.ask(b"flush q\r\n") == b"CLIENT_ERROR UNAUTHORIZED: send `auth <token>` first\r\n"
        t0 = time.monotonic()
        assert c.ask(b"auth wrong\r\n", len(b"UNAUTHORIZED\r\n")) == b"UNAUTHORIZED\r\n"
        assert time.monotonic() - t0 >= 0.09
        assert c.ask(b"auth tok-" + b"a" * 40 + b"\r\n") == b"OK\r\n"
        assert c.ask(b"set q 0 0 1\r\nx\r\nflush q\r\nget q\r\n") == b"STORED\r\nEND\r\nEND\r\n"
        assert c.ask(b"reload\r\n") == b"Reloaded config.\r\n"
        c.sock.sendall(b"shutdown\r\n")
        assert c.closed_by_server()  # kestrel answers nothing and hangs up
        assert srv.proc.wait(timeout=20) == 0
        assert "SHUTDOWN from 127.0.0.1 on the memcache port" in srv.log()
    finally:
        srv.stop()


def test_byte_soup_on_the_memcache_port_neither_crashes_nor_stops_service(server) -> None:
    rng = random.Random(7)
    words = [b"set q 0 0 3\r\n", b"get q/t=5/open\r\n", b"\r\n", b"get ", b"/", b"set q 0 0 ",
             b"999999999\r\n", b"\x00\xff", b"stats\r\n", b"flush_all\r\n", b" noreply"]
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", server.memcache_port), timeout=10)
        try:
            s.sendall(b"".join(rng.choice(words) if rng.random() < 0.5 else
                               rng.randbytes(rng.randrange(1, 200)) for _ in range(60)))
        except OSError:
            pass  # the server may have closed it: fine
        s.close()
    c = mc(server)
    assert c.set("after", b"still serving", noreply=False)
    assert c.get("after") == b"still serving"
    with connect(server.port) as bs:
        assert bs.call(b"list-tube-used\r\n").line == b"USING default"
    assert server.proc.poll() is None
    assert "Traceback" not in server.log()


def test_a_replica_sees_memcache_changes_and_refuses_them_itself(tmp_path) -> None:
    primary, mport = start(tmp_path)
    rport = free_port()
    (tmp_path / "r").mkdir()
    replica = start_smallstalk(tmp_path / "r",
                               "--replica-of", f"127.0.0.1:{primary.port}",
                               "--memcache-port", str(rport), data_dir=tmp_path / "replica")
    try:
        c = Raw(mport)
        assert c.ask(b"set mirrored 0 0 2\r\nm1\r\nset mirrored 0 0 2\r\nm2\r\n") == \
            b"STORED\r\nSTORED\r\n"
        assert c.ask(b"get mirrored\r\n") == b"VALUE mirrored 0 2\r\nm1\r\nEND\r\n"
        with connect(replica.port) as bs:
            wait_for(lambda: bs.call(b"stats-tube mirrored\r\n").line.startswith(b"OK") and
                     bs.call(b"stats-tube mirrored\r\n").yaml()["current-jobs-ready"] == "1",
                     20, "the replica to have the memcache changes")
        r = Raw(rport)
        assert r.ask(b"get mirrored/peek\r\n") == b"VALUE mirrored/peek 0 2\r\nm2\r\nEND\r\n"
        assert r.ask(b"get mirrored\r\n") == b"SERVER_ERROR read-only: this server is a replica\r\n"
        assert r.ask(b"set mirrored 0 0 1\r\nx\r\n") == \
            b"SERVER_ERROR read-only: this server is a replica\r\n"
    finally:
        replica.stop()
        primary.stop()
