"""smallstalk.client's TLS, admin token and address forms, against real server
processes: TLS on the server's own TLS port with trustme certificates, tokens
against the real server's answer to `auth`."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trustme

from smallstalk.client import (
    AsyncClient,
    Client,
    ConnectionFailed,
    Reply,
    ReplyReader,
    Unauthorized,
    UnknownCommand,
    interpret,
    normalize_address,
    resolve_servers,
)
from smallstalk.client.security import check_token, read_token_file, security
from smallstalk.core import protocol as p

from ..support.procs import (
    REPO,
    Server,
    beanstalkd_path,
    free_port,
    smallstalk_cmd,
    start_beanstalkd,
    start_smallstalk,
    wait_for_log,
)
from ..support.tlscerts import Certs, make_certs

CLIENT_KINDS = ["sync", "trio"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = start_smallstalk(tmp_path_factory.mktemp("smallstalk"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@attrs.frozen
class TLSServer:
    server: Server
    tls_port: int

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.tls_port}"

    def connections(self) -> int:
        """Connections served so far (a failed handshake never becomes one)."""
        with Client(f"127.0.0.1:{self.server.port}") as c:
            return c.stats().total_connections - 1  # not this one


def start_tls(tmp: Path, certs: Certs, *, mutual: bool = False,
              ports: tuple[int, int] | None = None) -> TLSServer:
    port, tls_port = ports or (free_port(), free_port())
    srv = start_smallstalk(tmp, *certs.server_flags(tls_port, mutual=mutual), port=port)
    return TLSServer(srv, tls_port)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certs: Certs) -> Iterator[TLSServer]:
    ts = start_tls(tmp_path_factory.mktemp("tls"), certs)
    yield ts
    ts.server.stop()


def run(kind: str, servers: Any, scenario, **kw: Any) -> Any:
    """Run `scenario(client)` (async; sync calls are awaited through `aw`) with either client."""

    async def main() -> Any:
        if kind == "sync":
            with Client(servers, **kw) as c:
                return await scenario(c)
        async with AsyncClient(servers, **kw) as c:
            return await scenario(c)

    return trio.run(main)


async def aw(value: Any) -> Any:
    return await value if hasattr(value, "__await__") else value


BODY = b"a job"


async def put_reserve_delete(c: Any) -> bytes:
    ref = await aw(c.put(BODY, tube="tls"))
    job = await aw(c.reserve(5, tubes=["tls"]))
    assert job.id == ref.id
    await aw(c.delete(job))
    return job.body


# --- TLS -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_put_and_reserve_over_tls(kind: str, tls_server: TLSServer, certs: Certs) -> None:
    before = tls_server.connections()
    assert run(kind, tls_server.addr, put_reserve_delete,
               ssl_context=certs.client_context()) == BODY
    assert tls_server.connections() == before + 2  # the client's, and the count's own


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_tls_reconnects_after_the_server_restarts(kind: str, certs: Certs,
                                                  tmp_path: Path) -> None:
    first = start_tls(tmp_path, certs)
    second: list[TLSServer] = []

    def restart() -> None:
        first.server.kill()
        second.append(start_tls(tmp_path, certs,
                                ports=(first.server.port, first.tls_port)))

    async def scenario(c: Any) -> None:
        await put_reserve_delete(c)
        await trio.to_thread.run_sync(restart)
        with pytest.raises(ConnectionFailed):
            await aw(c.stats())
        await put_reserve_delete(c)  # reconnects, with a new handshake

    try:
        run(kind, first.addr, scenario, ssl_context=certs.client_context())
        assert second[0].connections() == 1
    finally:
        first.server.kill()
        for ts in second:
            ts.server.stop()


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_a_wrong_ca_fails_the_handshake_clearly(kind: str, tls_server: TLSServer) -> None:
    other = ssl.create_default_context()
    trustme.CA().configure_trust(other)
    with pytest.raises(ConnectionFailed) as err:
        run(kind, tls_server.addr, put_reserve_delete, ssl_context=other)
    text = str(err.value)
    assert f"{tls_server.addr}: TLS handshake failed" in text, text
    assert "CERTIFICATE_VERIFY_FAILED" in text, text


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_tls_true_checks_against_the_system_cas(kind: str, tls_server: TLSServer) -> None:
    """trustme's CA is in no system store: tls=True must refuse it."""
    before = tls_server.connections()
    with pytest.raises(ConnectionFailed, match="CERTIFICATE_VERIFY_FAILED"):
        run(kind, tls_server.addr, put_reserve_delete, tls=True)
    assert tls_server.connections() == before + 1  # only the count's own


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_mutual_tls_needs_the_clients_certificate(kind: str, certs: Certs,
                                                  tmp_path: Path) -> None:
    ts = start_tls(tmp_path, certs, mutual=True)
    try:
        with pytest.raises(ConnectionFailed):
            run(kind, ts.addr, put_reserve_delete, ssl_context=certs.client_context())
        assert ts.connections() == 0
        assert run(kind, ts.addr, put_reserve_delete,
                   ssl_context=certs.client_context(with_cert=True)) == BODY
        assert ts.connections() == 2  # the client, and the count before it
    finally:
        ts.server.stop()


def test_a_unix_socket_stays_plaintext(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    log = tmp_path / "unix.log"
    proc = subprocess.Popen(smallstalk_cmd() + ["serve", "-l", f"unix:{path}"], cwd=REPO,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        wait_for_log(log, "listening on", proc)
        # The server speaks no TLS: only a plaintext unix connection can work.
        assert run("sync", f"unix:{path}", put_reserve_delete, tls=True) == BODY
        assert run("trio", f"unix:{path}", put_reserve_delete, tls=True) == BODY
    finally:
        Server(proc, 0, None).stop()


def test_ssl_context_must_be_one() -> None:
    with pytest.raises(TypeError, match="ssl.SSLContext"):
        Client("127.0.0.1:1", ssl_context="yes")  # type: ignore[arg-type]
    assert security(tls=True).ssl_context is not None
    assert security().ssl_context is None


# --- the admin token -------------------------------------------------------------


def test_auth_renders_and_its_replies_parse() -> None:
    assert p.render(p.Auth("s3cr3t")) == b"auth s3cr3t\r\n"
    reader = ReplyReader()
    reader.feed(p.OK + p.UNAUTHORIZED + p.ok_yaml(b"---\n"))
    ok, refused, yaml = reader.next_reply(), reader.next_reply(), reader.next_reply()
    assert ok == Reply(b"OK", ()) and refused == Reply(b"UNAUTHORIZED", ())
    assert yaml == Reply(b"OK", (b"4",), b"---\n")
    assert interpret(p.Auth("t"), ok) is None
    with pytest.raises(Unauthorized, match="UNAUTHORIZED from h:1: the server refused"):
        interpret(p.Auth("t"), refused, "h:1")


def test_tokens_are_checked_and_read_from_files(tmp_path: Path) -> None:
    assert check_token("a-B_9.~!") == "a-B_9.~!"
    for bad in ("", "two words", "new\nline", "é", "x" * 300):
        with pytest.raises(ValueError, match="printable ASCII"):
            check_token(bad)
    f = tmp_path / "token"
    f.write_text("  s3cr3t\n")
    assert read_token_file(f) == "s3cr3t"
    assert Client("127.0.0.1:1", token_file=f).security.token == "s3cr3t"
    assert "s3cr3t" not in repr(Client("127.0.0.1:1", token="s3cr3t").security)
    with pytest.raises(ValueError, match="cannot read the token file"):
        read_token_file(tmp_path / "missing")
    with pytest.raises(ValueError, match="not both"):
        Client("127.0.0.1:1", token="a", token_file=f)


def token_servers() -> list[Any]:
    kinds: list[Any] = ["smallstalk"]
    kinds.append(pytest.param("beanstalkd", marks=pytest.mark.skipif(
        beanstalkd_path() is None, reason="beanstalkd is not installed")))
    return kinds


@pytest.mark.parametrize("kind", CLIENT_KINDS)
@pytest.mark.parametrize("server_kind", token_servers())
def test_a_token_the_server_does_not_take_is_a_clear_error(
        kind: str, server_kind: str, server: Server, tmp_path: Path) -> None:
    """beanstalkd has no `auth` (UNKNOWN_COMMAND); a smallstalk without
    --admin-token-file refuses every token (UNAUTHORIZED): either way the client
    raises an error saying what to do before it sends anything else."""
    srv = server if server_kind == "smallstalk" else start_beanstalkd(tmp_path)
    addr = f"127.0.0.1:{srv.port}"
    want = (Unauthorized, "refused the token") if server_kind == "smallstalk" else (
        UnknownCommand, "no `auth` command.*without a token")
    try:
        with Client(addr) as plain:
            before = plain.stats()
            with pytest.raises(want[0], match=want[1]):
                run(kind, addr, lambda c: aw(c.put(b"x", tube="auth-test")), token="s3cr3t")
            after = plain.stats()
            assert after.cmd_put == before.cmd_put  # the put never went
            assert after.total_connections == before.total_connections + 1
            assert "auth-test" not in plain.list_tubes()
    finally:
        if srv is not server:
            srv.stop()


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_the_right_token_opens_admin_commands_and_a_wrong_one_nothing(
        kind: str, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cr3t\n")
    srv = start_smallstalk(tmp_path, "--admin-token-file", str(tmp_path / "token"))
    addr = f"127.0.0.1:{srv.port}"
    try:
        async def put_and_flush(c: Any) -> int:
            await aw(c.put(b"x", tube="tok"))
            return await aw(c.flush_tube("tok"))

        assert run(kind, addr, put_and_flush, token="s3cr3t") == 1
        assert run(kind, addr, put_and_flush, token_file=tmp_path / "token") == 1
        with pytest.raises(Unauthorized):
            run(kind, addr, put_and_flush, token="wrong")
        # Without a token, ordinary commands work and admin ones are refused.
        with pytest.raises(Unauthorized):
            run(kind, addr, put_and_flush)
        with Client(addr) as plain:
            assert plain.stats_tube("tok").current_jobs_ready == 1
    finally:
        srv.stop()


# --- addresses as the ecosystem writes them ---------------------------------------


def test_address_forms() -> None:
    assert resolve_servers(("127.0.0.1", 11300)) == ["127.0.0.1:11300"]
    assert resolve_servers([("a", 1), ("::1", 2), "b:3", "[::2]"]) == [
        "a:1", "[::1]:2", "b:3", "[::2]:11300"]
    assert resolve_servers((("a", 1), ("b", 2))) == ["a:1", "b:2"]
    assert normalize_address(("[::1]", 5)) == "[::1]:5"
    assert resolve_servers(("a:1",)) == ["a:1"]
    for bad in (11300, ("a", "11300"), ("a", 1, 2), {"a": 1}, b"a:1", [1], [None],
                ("a", True)):
        with pytest.raises(TypeError, match=r"\(host, port\) tuple"):
            resolve_servers(bad)  # type: ignore[arg-type]
    for bad_value in (("a", 0), ("a", 70000), ("", 1), "a:0", "a:x"):
        with pytest.raises(ValueError):
            resolve_servers(bad_value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="listed twice"):
        resolve_servers([("a", 1), "a:1"])


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_a_host_port_tuple_and_lists_of_them_connect(kind: str, server: Server) -> None:
    one = ("127.0.0.1", server.port)
    assert run(kind, one, put_reserve_delete) == BODY
    assert run(kind, [one], put_reserve_delete) == BODY
    assert run(kind, [f"127.0.0.1:{server.port}"], put_reserve_delete) == BODY
    with pytest.raises(TypeError, match="not 11300"):
        run(kind, 11300, put_reserve_delete)
