"""The real server process over real sockets, driven as users drive it (greenstalk, raw bytes)."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import greenstalk
import pytest

from ..support.bsclient import put_cmd
from ..support.procs import free_port, start_smallstalk


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_smallstalk(tmp_path_factory.mktemp("srv"))
    yield srv
    srv.stop()


def client(srv, **kw) -> greenstalk.Client:
    return greenstalk.Client(("127.0.0.1", srv.port), **kw)


def raw(srv, data: bytes, expect: bytes, timeout: float = 10.0, done=None) -> bytes:
    """Send bytes, read until the reply ends with `expect` or done(reply) (bounded)."""
    done = done or (lambda out: out.endswith(expect))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        deadline = time.monotonic() + timeout
        while not done(out) and time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def test_greenstalk_round_trip(server) -> None:
    with client(server, use="gs1", watch="gs1") as c:
        job_id = c.put("hello", priority=10, ttr=30)
        job = c.reserve(timeout=5)
        assert (job.id, job.body) == (job_id, "hello")
        stats = c.stats_job(job)
        assert stats["state"] == "reserved" and stats["tube"] == "gs1" and stats["pri"] == 10
        c.delete(job)
        with pytest.raises(greenstalk.NotFoundError):
            c.stats_job(job_id)


def test_binary_bodies_survive(server) -> None:
    body = bytes(range(256)) + b"\r\n\x00\r\n"
    with client(server, encoding=None, use="bin", watch="bin") as c:
        c.put(body)
        job = c.reserve(timeout=5)
        assert job.body == body
        c.delete(job)


def test_blocking_reserve_woken_by_another_connections_put(server) -> None:
    got = {}

    def worker() -> None:
        with client(server, watch="wake") as w:
            job = w.reserve(timeout=20)
            got["body"] = job.body
            w.delete(job)

    t = threading.Thread(target=worker)
    t.start()
    deadline = time.monotonic() + 10
    with client(server, use="wake") as p:
        while p.stats_tube("wake")["current-waiting"] != 1:
            assert time.monotonic() < deadline, "worker never started waiting"
            time.sleep(0.01)
        p.put("wake up")
    t.join(20)
    assert got["body"] == "wake up"


def test_ttr_expiry_returns_the_job(server) -> None:
    with client(server, use="ttr", watch="ttr") as a, client(server, watch="ttr") as b:
        a.put("x", ttr=1)
        job = a.reserve(timeout=5)
        started = time.monotonic()
        again = b.reserve(timeout=10)  # comes back after the TTR
        assert again.id == job.id
        assert time.monotonic() - started >= 0.9
        assert b.stats_job(again)["timeouts"] == 1
        b.delete(again)


def test_disconnect_releases_reservation(server) -> None:
    with client(server, use="disc", watch="disc") as a:
        a.put("x", ttr=100)
        job = a.reserve(timeout=5)
    with client(server, watch="disc") as b:
        again = b.reserve(timeout=10)
        assert again.id == job.id
        b.delete(again)


def test_pipelined_commands_in_one_send(server) -> None:
    n = 200
    data = b"use pipe\r\n" + b"".join(put_cmd(b"%03d" % i, ttr=10) for i in range(n))
    data += b"watch pipe\r\nignore default\r\n" + b"reserve\r\n" * n
    reply = raw(server, data, b"", timeout=20,
                done=lambda out: out.count(b"RESERVED") == n and out.endswith(b"\r\n"))
    first = int(reply.split(b"INSERTED ", 1)[1].split(b"\r\n", 1)[0])
    expected = (
        b"USING pipe\r\n"
        + b"".join(b"INSERTED %d\r\n" % (first + i) for i in range(n))
        + b"WATCHING 2\r\nWATCHING 1\r\n"
        + b"".join(b"RESERVED %d 3\r\n%03d\r\n" % (first + i, i) for i in range(n))
    )
    assert reply == expected


def test_byte_exact_errors_and_recovery(server) -> None:
    long_line = b"x" * 300 + b"\r\n"
    reply = raw(server, long_line + b"put 0 0 1 2\r\nabcd\r\nlist-tube-used\r\n", b"USING default\r\n")
    assert reply == b"BAD_FORMAT\r\nEXPECTED_CRLF\r\nUNKNOWN_COMMAND\r\nUSING default\r\n"
    big = b"put 0 0 1 70000\r\n" + b"z" * 70000 + b"\r\nlist-tube-used\r\n"
    assert raw(server, big, b"USING default\r\n") == b"JOB_TOO_BIG\r\nUSING default\r\n"


def test_a_client_that_never_reads_does_not_grow_the_server(server) -> None:
    """Flood stats commands without reading: the server stops reading too."""
    rss_before = _rss_kb(server.pid)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(0.5)
        sent = 0
        try:
            while sent < 200 << 20:
                sent += s.send(b"stats\r\n" * 10000)
        except (TimeoutError, BlockingIOError):
            pass
        assert sent < 200 << 20, "the server kept accepting input it could not answer"
        # Other clients are still served meanwhile.
        with client(server) as c:
            assert c.stats()["current-connections"] >= 2
    assert _rss_kb(server.pid) - rss_before < 100_000


def test_many_idle_connections_cost_little(server) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = min(2000, soft - 100)
    rss_before = _rss_kb(server.pid)
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(count)]
    try:
        with client(server) as c:
            deadline = time.monotonic() + 20
            while c.stats()["current-connections"] < count:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        per_conn = (_rss_kb(server.pid) - rss_before) * 1024 / count
        assert per_conn < 50_000, f"{per_conn:.0f} bytes per idle connection"
    finally:
        for s in socks:
            s.close()


def test_jobs_survive_a_restart(tmp_path) -> None:
    data = tmp_path / "data"
    srv = start_smallstalk(tmp_path, data_dir=data)
    try:
        with client(srv, use="keep") as c:
            ids = [c.put(f"job {i}", delay=100 if i == 0 else 0) for i in range(5)]
            c.watch("keep")
            reserved = c.reserve(timeout=5)
            c.release(reserved, priority=7)
            c.delete(ids[4])
    finally:
        srv.kill()
    srv = start_smallstalk(tmp_path, data_dir=data)
    try:
        with client(srv) as c:
            assert c.stats_job(ids[0])["state"] == "delayed"
            assert c.stats_job(reserved.id)["pri"] == 7
            with pytest.raises(greenstalk.NotFoundError):
                c.stats_job(ids[4])
            assert c.put("new") > max(ids)
    finally:
        srv.stop()


def test_unix_socket(tmp_path) -> None:
    path = tmp_path / "bs.sock"
    proc = subprocess.Popen([sys.executable, "-m", "smallstalk", "-l", f"unix:{path}"],
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not path.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        with greenstalk.Client(str(path)) as c:
            assert c.put("u") == 1
    finally:
        proc.kill()
        proc.wait()


def test_cli_flags() -> None:
    run = [sys.executable, "-m", "smallstalk"]
    out = subprocess.run(run + ["-v"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("smallstalk ")
    out = subprocess.run(run + ["-h"], capture_output=True, text=True, check=True)
    for flag in ("-l ADDR", "-p PORT", "-z BYTES", "-b DIR", "-f MS", "-F", "-s BYTES", "-V", "-v"):
        assert flag in out.stdout
    out = subprocess.run(run + ["-x"], capture_output=True, text=True)
    assert out.returncode != 0 and "unknown flag: -x" in out.stderr


def test_max_job_size_flag(tmp_path) -> None:
    port = free_port()
    srv = start_smallstalk(tmp_path, "-z", "10", port=port)
    try:
        assert raw(srv, b"put 0 0 1 11\r\n" + b"a" * 11 + b"\r\n", b"\r\n") == b"JOB_TOO_BIG\r\n"
        with client(srv) as c:
            assert c.stats()["max-job-size"] == 10
    finally:
        srv.stop()


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")
