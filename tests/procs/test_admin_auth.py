"""The admin commands with real processes: the token (`auth`), the admin-allowed
addresses, and the operator commands and replicas that send the token
(docs/SECURITY.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smallstalk.client.security import TOKEN_ENV
from smallstalk.server.admin import AUTH_FAIL_DELAY

from ..support.bsclient import Client, connect
from ..support.procs import Server, start_smallstalk, wait_for, wait_for_log

TOKEN = "s3cr3t-0123456789abcdef"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    f = tmp_path / "admin.token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    return f


def from_address(port: int, source: str) -> Client:
    """A raw client whose socket is bound to `source` (a 127.0.0.x address)
    before it connects to 127.0.0.1: still loopback, another peer address."""
    return Client(port, source=source)


def nothing_more(c: Client) -> None:
    """No stray bytes (a feed's records) before the reply to a probe."""
    assert c.call(b"list-tube-used\r\n").status == b"USING"
    assert not c.buf


def ext(port: int) -> dict[str, str]:
    c = connect(port)
    try:
        return c.ext_stats()
    finally:
        c.close()


def smallstalk(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "smallstalk", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_wrong_or_missing_token_streams_nothing(tmp_path: Path, token_file: Path) -> None:
    srv = start_smallstalk(tmp_path, "--admin-token-file", str(token_file),
                           data_dir=tmp_path / "data")
    try:
        c = connect(srv.port)
        c.put(b"a secret body")
        # No auth: refused at once, and the connection stays an ordinary one.
        assert c.call(b"replicate 0 - 0\r\n").status == b"UNAUTHORIZED"
        nothing_more(c)
        # A wrong token: UNAUTHORIZED only after the fixed delay; still nothing streamed.
        started = time.monotonic()
        replies = c.pipeline([b"auth wrong-token\r\n", b"replicate 0 - 0\r\n",
                              b"config\r\n", b"reload-config\r\n", b"flush-tube default\r\n"])
        assert time.monotonic() - started >= AUTH_FAIL_DELAY
        assert [r.status for r in replies] == [b"UNAUTHORIZED"] * 5
        nothing_more(c)
        # Ordinary commands are untouched.
        assert c.call(b"peek-ready\r\n").body == b"a secret body"
        # The right token: `config` answers, and `replicate` streams.
        assert c.call(b"auth %s\r\n" % TOKEN.encode()).status == b"OK"
        assert c.call(b"config\r\n").status == b"OK"
        assert c.call(b"replicate 0 - 0\r\n").status in (b"REPLICATING", b"FULLRESYNC")
        c.close()
        log = srv.log()
        assert "auth failed" in log and "127.0.0.1" in log
        assert "wrong-token" not in log and TOKEN not in log
    finally:
        srv.stop()


def test_a_replica_with_the_token_converges_and_one_without_never_connects(
        tmp_path: Path, token_file: Path) -> None:
    primary = start_smallstalk(tmp_path, "--admin-token-file", str(token_file),
                               data_dir=tmp_path / "primary")
    replica = bad = None
    try:
        replica = start_smallstalk(tmp_path, "--replica-of", f"127.0.0.1:{primary.port}",
                                   "--admin-token-file", str(token_file),
                                   data_dir=tmp_path / "replica")
        bad = start_smallstalk(tmp_path, "--replica-of", f"127.0.0.1:{primary.port}",
                               data_dir=tmp_path / "bad")
        c = connect(primary.port)
        for i in range(50):
            c.put(b"job %d" % i)
        c.close()
        # Against the primary's figure each time: the close's Disconnect record may be
        # logged after a first read.
        wait_for(lambda: ext(replica.port)["last-seq"] == ext(primary.port)["last-seq"],
                 what="replica catching up")
        assert ext(replica.port)["replication-connected"] == "true"
        r = connect(replica.port)
        assert r.call(b"peek 50\r\n").body == b"job 49"
        r.close()
        # Without a token: refused, says so in its log, holds nothing of the primary's.
        wait_for_log(bad.log_path, "UNAUTHORIZED", bad.proc)
        st = ext(bad.port)
        assert st["replication-connected"] == "false" and st["last-seq"] == "0"
    finally:
        for s in (bad, replica, primary):
            if s is not None:
                s.stop()


def test_promote_needs_the_token_from_a_file_or_the_environment(
        tmp_path: Path, token_file: Path) -> None:
    primary = start_smallstalk(tmp_path, "--admin-token-file", str(token_file),
                               data_dir=tmp_path / "primary")
    replica = start_smallstalk(tmp_path, "--replica-of", f"127.0.0.1:{primary.port}",
                               "--admin-token-file", str(token_file),
                               data_dir=tmp_path / "replica")
    try:
        where = f"127.0.0.1:{replica.port}"
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        out = smallstalk("promote", where, env=env)
        assert out.returncode == 1 and out.stdout.startswith("UNAUTHORIZED"), out
        wrong = tmp_path / "wrong.token"
        wrong.write_text("not-it\n")
        out = smallstalk("promote", "--token-file", str(wrong), where, env=env)
        assert out.returncode == 1 and "refused the admin token" in out.stderr, out
        assert ext(replica.port)["role"] == "replica"  # nothing promoted
        # `config dump --server` takes the same file.
        out = smallstalk("config", "dump", "--server", where, env=env)
        assert out.returncode == 1 and "UNAUTHORIZED" in out.stderr, out
        out = smallstalk("config", "dump", "--server", where, "--token-file", str(token_file),
                         env=env)
        assert out.returncode == 0 and "default:" in out.stdout, out
        out = smallstalk("promote", where, env={**env, TOKEN_ENV: TOKEN})
        assert out.returncode == 0 and out.stdout.startswith("PROMOTED"), out
        assert ext(replica.port)["role"] == "primary"
        out = smallstalk("promote", where, env={**env, TOKEN_ENV: TOKEN})  # once more
        assert (out.returncode, out.stdout, out.stderr) == (1, "", (
            f"smallstalk promote: {where} is not a replica (NOT_A_REPLICA): it takes writes "
            "already; give the address of a replica that follows it\n"))
        assert TOKEN not in primary.log() + replica.log()
    finally:
        replica.stop()
        primary.stop()


def test_without_a_token_loopback_may_and_other_peers_may_not(tmp_path: Path) -> None:
    srv: Server = start_smallstalk(tmp_path, "--admin-allow", "127.0.0.1/32",
                                   data_dir=tmp_path / "data")
    try:
        local = connect(srv.port)
        assert local.call(b"config\r\n").status == b"OK"
        other = from_address(srv.port, "127.0.0.2")
        reply = other.call(b"replicate 0 - 0\r\n")
        assert reply.status == b"UNAUTHORIZED"
        text = b" ".join(reply.args).decode()
        assert "127.0.0.2" in text and "--admin-token-file" in text and "--admin-allow" in text
        nothing_more(other)
        assert other.call(b"promote\r\n").status == b"UNAUTHORIZED"
        assert other.call(b"flush-tube default\r\n").status == b"UNAUTHORIZED"
        # An `auth` cannot help: there is no token to match.
        assert other.call(b"auth anything\r\n").status == b"UNAUTHORIZED"
        assert other.call(b"config\r\n").status == b"UNAUTHORIZED"
        # Ordinary commands from there work as ever.
        assert other.put(b"x").status == b"INSERTED"
        assert local.call(b"flush-tube default\r\n").status == b"FLUSHED"
        local.close()
        other.close()
    finally:
        srv.stop()


def test_the_default_admin_addresses_are_loopback(tmp_path: Path) -> None:
    srv = start_smallstalk(tmp_path)
    try:
        c = from_address(srv.port, "127.0.0.2")  # in 127.0.0.0/8
        assert c.call(b"config\r\n").status == b"OK"
        c.close()
    finally:
        srv.stop()


def test_an_unreadable_token_file_stops_the_start_with_one_line(tmp_path: Path) -> None:
    out = smallstalk("serve", "-p", "0", "--admin-token-file", str(tmp_path / "missing"))
    assert out.returncode != 0
    assert "cannot read the admin token file" in out.stderr
    assert "No such file or directory (make one: `openssl rand -hex 32 > FILE`" in out.stderr
    assert "Traceback" not in out.stderr and "Errno" not in out.stderr
    out = smallstalk("serve", "-p", "0", "--admin-allow", "not-a-network")
    assert out.returncode != 0 and "not an address or CIDR" in out.stderr
