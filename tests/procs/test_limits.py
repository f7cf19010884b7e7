"""What one hostile or careless client can make a real server do (README, Limits and abuse).

A real server process on 127.0.0.1, real sockets, memory read from
/proc/PID/status (VmHWM, the peak, reset before each flood through
clear_refs): floods that are never read keep the server's memory bounded,
and the bound holds again once the flooding connections are gone; idle
connections are cheap; past --max-connections a client is told why and
closed; running out of file descriptors neither crashes nor spins; a client
that stops reading still loses its reservations to TTR. Floods are bounded
in bytes and seconds. The floods, idle connections and the connection limit
are tried on the memcache port (docs/KESTREL.md) too.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from ..support.bsclient import Client, connect
from ..support.procs import Server, free_port, listening, start_smallstalk, wait_for

MiB = 1 << 20
FLOOD_SECONDS = 4.0  # how long a flood may take to fill every buffer


def status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flood(socks: list[socket.socket], data: bytes, seconds: float = FLOOD_SECONDS) -> int:
    """Send `data` on every socket without reading, until all is sent or the
    server has stopped taking any for a second (its reading is throttled)."""
    for s in socks:
        s.setblocking(False)
    views = {s: memoryview(data) for s in socks}
    sent, progress = 0, time.monotonic()
    deadline = progress + seconds
    while views and time.monotonic() < deadline and time.monotonic() - progress < 1.0:
        for s, view in list(views.items()):
            try:
                n = s.send(view[:1 << 20])
            except BlockingIOError:
                continue
            sent += n
            progress = time.monotonic()
            if n == len(view):
                del views[s]
            else:
                views[s] = view[n:]
        time.sleep(0.001)
    return sent


def settle(server: Server, connections: int) -> dict[str, str]:
    """Stats once the server has seen exactly `connections` (plus this one)."""
    with connect(server.port) as c:
        wait_for(lambda: int(c.stats()["current-connections"]) == connections + 1, 20,
                 "the connections to come and go")
        return c.stats()


def round_trip(c: Client, cmd: bytes) -> float:
    t0 = time.perf_counter()
    c.call(cmd)
    return time.perf_counter() - t0


@pytest.fixture
def memcache_port() -> int:
    return free_port()


@pytest.fixture
def server(tmp_path, memcache_port):
    srv = start_smallstalk(tmp_path, "--fsync", "never", "--memcache-port", str(memcache_port),
                           data_dir=tmp_path / "data")
    yield srv
    srv.stop()


# The ports a flood is tried on: the beanstalkd port, and kestrel's memcache dialect.
KINDS = ["beanstalkd", "memcache"]


def port_of(kind: str, server: Server, memcache_port: int) -> int:
    return server.port if kind == "beanstalkd" else memcache_port


@pytest.mark.parametrize("kind", KINDS)
def test_unread_peek_floods_stay_bounded_and_others_are_served(server, memcache_port,
                                                               kind) -> None:
    port = port_of(kind, server, memcache_port)
    with connect(server.port) as other:
        other.call(b"use big\r\n")
        job = other.put(b"x" * 60_000).id
        other.call(b"stats\r\n")  # warm: the first stats imports and allocates
        base = status(server.pid)["VmRSS"]
        reset_peak(server.pid)
        flooders = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        # All of it fits in the kernel's buffers on loopback; what the server
        # has not read yet stays there.
        peek = b"peek %d\r\n" % job if kind == "beanstalkd" else b"get big/peek\r\n"
        flood(flooders, peek * 200_000)
        wait_for(lambda: other.ext_stats()["current-connections-throttled"] == "4", 20,
                 "all four flooders to be throttled")
        waits = [round_trip(other, b"stats-job %d\r\n" % job) for _ in range(50)]
        grown = status(server.pid)["VmHWM"] - base
        print(f"4 unread peek floods ({kind}): RSS +{grown / MiB:.1f} MiB, other client max "
              f"{max(waits) * 1000:.1f} ms")
        assert grown <= 64 * MiB, f"RSS grew {grown / MiB:.1f} MiB"
        assert max(waits) < 1.0, waits  # beanstalkd-like: others are served meanwhile
        for s in flooders:
            s.close()
        settle(server, 1)
        assert status(server.pid)["VmRSS"] - base <= 64 * MiB
    log = server.log()
    # Four such clients within a second make one line (once a connection, at
    # most a line a second for all of them); the statistic counted all four.
    assert log.count("is not reading its replies") == 1
    assert "client 127.0.0.1:" in log


@pytest.mark.parametrize("kind", KINDS)
def test_unread_stats_flood_stays_bounded(server, memcache_port, kind) -> None:
    end = b"\r\n---\n" if kind == "beanstalkd" else b"\r\nEND\r\n"  # one per reply
    with connect(server.port) as other:
        other.call(b"stats\r\n")
        base = status(server.pid)["VmRSS"]
        reset_peak(server.pid)
        flooder = socket.create_connection(("127.0.0.1", port_of(kind, server, memcache_port)))
        data = b"stats\r\n" * 70_000
        sent = flood([flooder], data)
        assert round_trip(other, b"stats\r\n") < 1.0
        grown = status(server.pid)["VmHWM"] - base
        print(f"unread stats flood: RSS +{grown / MiB:.1f} MiB")
        assert grown <= 32 * MiB, f"RSS grew {grown / MiB:.1f} MiB"
        # Held, not lost: once the client reads, its commands run on.
        flooder.setblocking(True)
        flooder.settimeout(30)
        replies, tail = 0, b""
        with contextlib.closing(flooder):
            while replies < 5_000:
                chunk = flooder.recv(1 << 20)
                assert chunk, f"closed after {replies} replies"
                replies += (tail + chunk).count(end)
                tail = chunk[-(len(end) - 1):]
        assert sent > 5_000 * len(b"stats\r\n")
        settle(server, 1)
        assert status(server.pid)["VmRSS"] - base <= 32 * MiB


@pytest.mark.parametrize("kind", KINDS)
def test_idle_connections_are_cheap_and_leave_nothing(server, memcache_port, kind) -> None:
    n = 2000
    port = port_of(kind, server, memcache_port)
    settle(server, 0)
    base = status(server.pid)["VmRSS"]
    peaks, after = [], []
    for _round in range(3):
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
        try:
            settle(server, n)
            peaks.append(status(server.pid)["VmRSS"] - base)
        finally:
            for s in socks:
                s.close()
        settle(server, 0)
        after.append(status(server.pid)["VmRSS"] - base)
    per = peaks[0] / n
    print(f"idle connections ({kind}): {per:.0f} bytes each")
    assert per <= 4096, f"{per:.0f} bytes per idle connection"
    # Nothing leaks: the allocator keeps what it freed (RSS does not go back
    # down), and later rounds reuse it instead of growing each time.
    assert peaks[2] - peaks[1] <= 1 * MiB, peaks
    assert max(peaks + after) <= n * 4096 + 2 * MiB, (peaks, after)


def test_past_max_connections_a_client_is_told_and_closed(tmp_path) -> None:
    http, mport = free_port(), free_port()
    server = start_smallstalk(tmp_path, "--max-connections", "3", "--http", f"127.0.0.1:{http}",
                              "--memcache-port", str(mport))
    try:
        kept = [connect(server.port) for _ in range(3)]
        for port in (server.port, mport):  # one limit for both ports
            with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
                got = b""
                while chunk := extra.recv(100):
                    got += chunk
                assert got == b"TOO_MANY_CONNECTIONS\r\n"
        assert kept[0].ext_stats()["connections-refused"] == "2"
        assert "refusing connections: 3 open, --max-connections is 3" in server.log()
        kept[0].close()
        wait_for(lambda: kept[1].stats()["current-connections"] == "2", 10, "the close")
        with connect(server.port) as again:  # a place came free
            assert again.ext_stats()["connections-refused"] == "2"
        for c in kept[1:]:
            c.close()
        wait_for(lambda: listening(http), 20, "the console")
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=20) as resp:
            metrics = resp.read().decode()
        assert "\nsmallstalk_connections_refused 2.0\n" in metrics
        assert "\nsmallstalk_current_connections_throttled 0.0\n" in metrics
    finally:
        server.stop()


def test_out_of_file_descriptors_neither_crashes_nor_spins(tmp_path) -> None:
    server = start_smallstalk(tmp_path, "--max-connections", "1000")
    try:
        first = connect(server.port)
        first.call(b"stats\r\n")
        fds = len(os.listdir(f"/proc/{server.pid}/fd"))
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (fds + 4, fds + 4))
        clients = [connect(server.port) for _ in range(4)]  # the last fds
        for c in clients:
            c.call(b"list-tube-used\r\n")
        # Accepted by the kernel, not by the server: it waits in the backlog.
        waiting = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        waiting.sendall(b"list-tube-used\r\n")
        wait_for(lambda: "cannot accept connections" in server.log(), 10, "the EMFILE line")
        cpu0, t0 = cpu_seconds(server.pid), time.monotonic()
        time.sleep(1.5)
        assert first.call(b"list-tube-used\r\n").line == b"USING default"
        busy = (cpu_seconds(server.pid) - cpu0) / (time.monotonic() - t0)
        assert busy < 0.3, f"the server used {busy:.0%} of a core while out of fds"
        lines = server.log().count("cannot accept connections")
        assert 1 <= lines <= 1 + (time.monotonic() - t0) + 2
        clients[0].close()  # an fd comes free: the waiting client is served
        waiting.settimeout(10)
        assert waiting.recv(100) == b"USING default\r\n"
        waiting.close()
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_a_client_that_stops_reading_still_loses_its_reservation_to_ttr(server) -> None:
    with connect(server.port) as producer:
        job = producer.put(b"y" * 60_000, ttr=1).id
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(b"reserve\r\n")
        wait_for(lambda: producer.stats_job(job)["state"] == "reserved", 10, "the reserve")
        flood([slow], b"peek %d\r\n" % job * 100_000, seconds=2.0)
        # TTR gives the job back while the slow client's replies wait.
        wait_for(lambda: producer.stats_job(job)["state"] == "ready", 10, "the TTR")
        worker = connect(server.port)
        assert worker.call(b"reserve-with-timeout 5\r\n").id == job
        worker.close()
        slow.close()
    assert server.log().count("is not reading its replies") == 1


def test_many_clients_that_never_read_share_one_budget_and_others_are_served(server) -> None:
    """Hundreds of clients pipeline peeks of a 60 KB job and never read: a
    new client is still accepted and answered at once, and the replies the
    server holds for all of them stop at UNSENT_BUDGET plus about one reply
    each (each alone would hold OUT_BOUND: 400 x 316 KB, ~120 MiB)."""
    from smallstalk.server.session import OUT_BOUND, UNSENT_BUDGET

    n, reply = 400, 60_000
    assert n * (OUT_BOUND + reply) > UNSENT_BUDGET + n * 2 * reply  # the test can tell
    with connect(server.port) as other:
        job = other.put(b"x" * reply).id
        other.stats()  # warm: the first stats imports and allocates
        base = status(server.pid)["VmRSS"]
        peeks = b"peek %d\r\n" % job * 2_000
        flooders = []
        try:
            for _ in range(n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
                s.connect(("127.0.0.1", server.port))
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.send(peeks)
                flooders.append(s)
            waits = []
            for _ in range(5):  # while they fill: a new client, accepted behind all of them
                t0 = time.perf_counter()
                with connect(server.port) as fresh:
                    fresh.stats()
                waits.append(time.perf_counter() - t0)
                time.sleep(0.2)
            unsent = lambda: int(other.ext_stats()["unsent-bytes"])  # noqa: E731
            wait_for(lambda: unsent() > UNSENT_BUDGET, 120, "the budget to be reached")
            highs = [unsent()]
            for _ in range(10):
                time.sleep(0.2)
                highs.append(unsent())
            print(f"{n} unread peek floods: new client {[round(w * 1000) for w in waits]} ms, "
                  f"unsent {max(highs) / MiB:.1f} MiB")
            assert max(waits) < 5.0, waits  # a whole backlog's turns: 10-25 s before
            assert max(highs) <= UNSENT_BUDGET + n * (reply + 1024), highs
            assert round_trip(other, b"stats-job %d\r\n" % job) < 1.0
            assert int(other.ext_stats()["current-connections-throttled"]) >= n - 1
        finally:
            for s in flooders:
                s.close()
        wait_for(lambda: unsent() == 0, 30, "the flooders' replies to be dropped")
        settle(server, 1)
        # And the memory is back once they are gone (here the C allocator
        # mostly returns it by itself; tests/unit/test_unsent.py checks the
        # trim for replies that survivors keep apart).
        after = status(server.pid)["VmRSS"] - base
        print(f"RSS after they left: +{after / MiB:.1f} MiB")
        assert after <= 32 * MiB
    assert server.log().count("replies wait for clients that do not read them") == 1
