"""TLS on the server's own port, with real processes and real handshakes: raw `ssl`
clients, mutual TLS, TLS only, the unix socket, the handshake timeout, the
console over HTTPS, and the one-line start errors. Certificates from trustme.
(smallstalk.client over TLS: test_client_security.py; replication over TLS:
test_replication.py.)"""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from smallstalk.client import Client as SmallClient

from ..support.bsclient import Client, put_cmd
from ..support.procs import (
    REPO,
    Server,
    free_port,
    listening,
    smallstalk_cmd,
    start_smallstalk,
    wait_for,
    wait_for_log,
)
from ..support.tlscerts import Certs, make_certs, write_pair


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def mtls(tmp_path_factory, certs: Certs) -> Iterator[tuple[Server, int]]:
    """A server whose TLS port requires a client certificate from `certs.ca`."""
    tls_port = free_port()
    srv = start_smallstalk(tmp_path_factory.mktemp("mtls"),
                           *certs.server_flags(tls_port, mutual=True))
    yield srv, tls_port
    srv.stop()


def put_reserve_delete(c: Client, tube: bytes = b"tls") -> None:
    c.call(b"use %s\r\n" % tube)
    c.call(b"watch %s\r\n" % tube)
    inserted = c.call(put_cmd(b"over tls"))
    assert inserted.status == b"INSERTED"
    job = c.call(b"reserve-with-timeout 5\r\n")
    assert (job.status, job.id, job.body) == (b"RESERVED", inserted.id, b"over tls")
    assert c.call(b"delete %d\r\n" % job.id).status == b"DELETED"


def test_a_raw_ssl_socket_puts_and_reserves(tmp_path: Path, certs: Certs) -> None:
    tls_port = free_port()
    srv = start_smallstalk(tmp_path, *certs.server_flags(tls_port))
    try:
        assert f"127.0.0.1:{tls_port} (TLS)" in srv.log()
        with Client(tls_port, ssl_context=certs.client_context()) as c:
            assert c.sock.version() in ("TLSv1.2", "TLSv1.3")
            put_reserve_delete(c)
            # Pipelined commands over TLS, a large body among them.
            big = bytes(range(256)) * 200
            replies = c.pipeline([put_cmd(big), put_cmd(b"x"), b"peek-ready\r\n"])
            assert [r.status for r in replies] == [b"INSERTED", b"INSERTED", b"FOUND"]
            assert replies[2].body == big
        # The plaintext port serves the same jobs.
        with Client(srv.port) as plain:
            assert plain.call(b"use tls\r\n").status == b"USING"
            assert plain.call(b"peek-ready\r\n").body == big
            # A plaintext client on the TLS port gets no beanstalk reply.
        with socket.create_connection(("127.0.0.1", tls_port), timeout=10) as s:
            s.sendall(b"stats\r\n")
            assert not s.recv(100).startswith(b"OK")
    finally:
        srv.stop()


def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(
        mtls: tuple[Server, int], certs: Certs, tmp_path: Path) -> None:
    srv, tls_port = mtls
    with Client(srv.port) as plain:
        before = int(plain.stats()["total-connections"])  # this one counted
    # No certificate: TLS 1.3 finishes the client's side of the handshake first;
    # the server's refusal arrives as an alert, and no command is ever answered.
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with Client(tls_port, ssl_context=certs.client_context()) as c:
            put_reserve_delete(c)
    # A certificate from another CA.
    stranger = certs.client_context()
    other_cert, other_key = write_pair(trustme.CA().issue_cert("mallory@example.org"),
                                       tmp_path, "other")
    stranger.load_cert_chain(other_cert, other_key)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with Client(tls_port, ssl_context=stranger) as c:
            put_reserve_delete(c)
    # The CA's own client gets in.
    with Client(tls_port, ssl_context=certs.client_context(with_cert=True)) as c:
        put_reserve_delete(c)
        after = c.stats()
    # Refused handshakes never became connections: the last client is the only new one.
    assert int(after["total-connections"]) == before + 1
    wait_for(lambda: srv.log().count("TLS handshake with 127.0.0.1:") >= 2,
             what="the refusals logged")
    assert "certificate" in srv.log().split("TLS handshake with 127.0.0.1:")[-1].lower()


def test_smallstalk_client_with_and_without_a_client_certificate(
        mtls: tuple[Server, int], certs: Certs) -> None:
    from smallstalk.client import ConnectionFailed

    _srv, tls_port = mtls
    with SmallClient(f"127.0.0.1:{tls_port}",
                     ssl_context=certs.client_context(with_cert=True)) as c:
        ref = c.put(b"mtls", tube="mtls")
        assert c.reserve(5, tubes=["mtls"]).id == ref.id
    with pytest.raises(ConnectionFailed):
        with SmallClient(f"127.0.0.1:{tls_port}", ssl_context=certs.client_context()) as c:
            c.put(b"refused", tube="mtls")


def test_no_plaintext_leaves_only_the_tls_port(tmp_path: Path, certs: Certs) -> None:
    tls_port, plain_port = free_port(), free_port()
    # start_smallstalk waits for "listening on 127.0.0.1:PORT": the TLS port here.
    srv = start_smallstalk(tmp_path, *certs.server_flags(tls_port), "--no-plaintext",
                           "-p", str(plain_port), port=tls_port)
    try:
        assert not listening(plain_port)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", plain_port), timeout=10).close()
        with Client(tls_port, ssl_context=certs.client_context()) as c:
            put_reserve_delete(c)
        assert f"listening on 127.0.0.1:{tls_port} (TLS) (" in srv.log()
    finally:
        srv.stop()


def test_the_unix_socket_stays_plaintext(tmp_path: Path, certs: Certs) -> None:
    path, tls_port = tmp_path / "s.sock", free_port()
    log = tmp_path / "unix.log"
    proc = subprocess.Popen(smallstalk_cmd() + ["serve", "-l", f"unix:{path}",
                                                *certs.server_flags(tls_port), "--no-plaintext"],
                            cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        wait_for_log(log, "listening on", proc)
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(path))
            s.sendall(b"use unix\r\n")
            assert s.recv(100) == b"USING unix\r\n"
        # TLS listens on 127.0.0.1 (-l names a unix socket), on the same jobs.
        with Client(tls_port, ssl_context=certs.client_context()) as c:
            put_reserve_delete(c, b"unix")
    finally:
        Server(proc, 0, None).stop()


def test_a_stalled_handshake_is_dropped_and_holds_nothing(tmp_path: Path, certs: Certs) -> None:
    tls_port = free_port()
    srv = start_smallstalk(tmp_path, *certs.server_flags(tls_port),
                           "--tls-handshake-timeout", "0.5")
    try:
        stalled = [socket.create_connection(("127.0.0.1", tls_port), timeout=20)
                   for _ in range(20)]
        with Client(srv.port) as plain:
            # Clients in their handshake are no connections yet.
            assert plain.stats()["current-connections"] == "1"
            started = time.monotonic()
            for s in stalled:
                assert s.recv(100) == b""  # closed by the server
                s.close()
            assert time.monotonic() - started < 15
            assert plain.stats()["total-connections"] == "1"
        # A slow but finished handshake is served.
        with Client(tls_port, ssl_context=certs.client_context()) as c:
            put_reserve_delete(c)
        assert "not finished within 0.5s" in srv.log()
    finally:
        srv.stop()


def test_console_over_https(tmp_path: Path, certs: Certs) -> None:
    pytest.importorskip("hypercorn")
    tls_port, http_port = free_port(), free_port()
    srv = start_smallstalk(tmp_path, *certs.server_flags(tls_port), "--http",
                           f"127.0.0.1:{http_port}")
    try:
        wait_for(lambda: "console on https://" in srv.log(), what="the console")
        url = f"https://127.0.0.1:{http_port}/metrics"
        body = urllib.request.urlopen(url, context=certs.client_context(), timeout=30).read()
        assert b"smallstalk" in body
        # Plain http is not served there.
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30).read()
    finally:
        srv.stop()


def test_console_under_mutual_tls_needs_the_client_certificate(
        tmp_path: Path, certs: Certs) -> None:
    pytest.importorskip("hypercorn")
    tls_port, http_port = free_port(), free_port()
    srv = start_smallstalk(tmp_path, *certs.server_flags(tls_port, mutual=True), "--http",
                           f"127.0.0.1:{http_port}")
    try:
        wait_for(lambda: "console on https://" in srv.log(), what="the console")
        url = f"https://127.0.0.1:{http_port}/metrics"
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, context=certs.client_context(), timeout=30).read()
        body = urllib.request.urlopen(url, context=certs.client_context(with_cert=True),
                                      timeout=30).read()
        assert b"smallstalk" in body
    finally:
        srv.stop()


def serve_fails(tmp_path: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "smallstalk", "serve", "-p", "0", *args],
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert out.returncode != 0, out
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_unusable_certificate_files_stop_the_server_with_one_line(
        tmp_path: Path, certs: Certs) -> None:
    cert, key = str(certs.cert_file), str(certs.key_file)
    _, other_key = write_pair(trustme.CA().issue_cert("127.0.0.1"), tmp_path, "other")
    unreadable = tmp_path / "unreadable.pem"
    unreadable.mkdir()
    tls = ["--tls-port", "0"]
    assert "--tls-cert missing.pem: No such file" in serve_fails(
        tmp_path, *tls, "--tls-cert", "missing.pem", "--tls-key", key)
    assert "--tls-key" in serve_fails(tmp_path, *tls, "--tls-cert", cert, "--tls-key",
                                      str(unreadable))
    assert f"--tls-key {other_key} is not the key of --tls-cert {cert}" == serve_fails(
        tmp_path, *tls, "--tls-cert", cert, "--tls-key", str(other_key)).removeprefix(
        "smallstalk: ")
    assert "not a PEM certificate" in serve_fails(tmp_path, *tls, "--tls-cert", key,
                                                  "--tls-key", key)
    assert "--tls-client-ca" in serve_fails(tmp_path, *tls, "--tls-cert", cert, "--tls-key",
                                            key, "--tls-client-ca", key)
    assert "--tls-port needs --tls-cert" in serve_fails(tmp_path, *tls)
    assert "--no-plaintext leaves nothing" in serve_fails(tmp_path, "--no-plaintext")
    assert "--replica-tls-ca" in serve_fails(
        tmp_path, "-b", str(tmp_path / "d"), "--replica-of", "127.0.0.1:1",
        "--replica-tls-ca", "missing.pem")
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        assert "use --tls-port" in serve_fails(
            tmp_path, "--tls-port", str(busy.getsockname()[1]), "--tls-cert", cert,
            "--tls-key", key)
    finally:
        busy.close()


def test_tls_connections_count_against_max_connections(tmp_path: Path, certs: Certs) -> None:
    tls_port = free_port()
    srv = start_smallstalk(tmp_path, *certs.server_flags(tls_port), "--max-connections", "2")
    try:
        with Client(tls_port, ssl_context=certs.client_context()) as secure, \
                Client(srv.port) as plain:
            put_reserve_delete(secure)
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as extra:
                got = b""
                while chunk := extra.recv(100):
                    got += chunk
                assert got == b"TOO_MANY_CONNECTIONS\r\n"
            assert plain.ext_stats()["connections-refused"] == "1"
            secure.close()
            wait_for(lambda: plain.stats()["current-connections"] == "1", 10, "the TLS close")
            with Client(srv.port) as again:  # the TLS client's place came free
                assert again.stats()["current-connections"] == "2"
    finally:
        srv.stop()
