"""The client's admin methods (`promote`, `config`, `reload_config`, `ext_stats`,
`ext_stats_tube`) against real `smallstalk serve` processes started with an admin
token and a --config file, with the sync and the trio client: what each returns,
and the error each refusal raises, in the server's own words."""

from __future__ import annotations

from pathlib import Path

import pytest

from smallstalk.client import (
    AsyncClient,
    Client,
    NotAReplica,
    NotFound,
    NotReloaded,
    Unauthorized,
)

from ..support.configfile import parse_yaml, write
from ..support.procs import Server, start_smallstalk, wait_for

TOKEN = "admin-0123456789abcdef"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    f = tmp_path / "admin.token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    return f


@pytest.fixture
def primary(tmp_path: Path, token_file: Path):
    config = write(tmp_path, '[tubes."emails"]\nmax-jobs = 7\n')
    srv = start_smallstalk(tmp_path, "--admin-token-file", str(token_file), "--config",
                           str(config), data_dir=tmp_path / "primary")
    yield srv, config
    srv.stop()


def address(srv: Server) -> str:
    return f"127.0.0.1:{srv.port}"


def test_config_reload_and_ext_stats_with_the_token(primary) -> None:
    srv, config = primary
    with Client(address(srv), token=TOKEN) as c:
        c.put(b"x", tube="emails")
        tubes = parse_yaml(c.config().encode())
        assert tubes["emails"]["max-jobs"] == "7" and "default" in tubes
        config.write_text('[tubes."emails"]\nmax-jobs = 9\n')
        c.reload_config()
        assert parse_yaml(c.config().encode())["emails"]["max-jobs"] == "9"
        config.write_text('[tubes."emails"]\nmax-jobs = "many"\n')
        with pytest.raises(NotReloaded) as refused:
            c.reload_config()
        assert "max-jobs" in refused.value.said and refused.value.reply_line().startswith(
            "NOT_RELOADED ")
        assert parse_yaml(c.config().encode())["emails"]["max-jobs"] == "9"  # old ones stay
        st = c.ext_stats()
        assert st["role"] == "primary" and int(st["last-seq"]) > 0
        assert c.ext_stats_tube("emails")["current-bytes"] == "1"
        with pytest.raises(NotFound):
            c.ext_stats_tube("nowhere")
        with pytest.raises(NotAReplica) as not_replica:
            c.promote()
        assert not_replica.value.reply_line() == "NOT_A_REPLICA"


def test_without_the_token_admin_commands_raise_unauthorized(primary) -> None:
    srv, _ = primary
    with Client(address(srv)) as c:
        c.put(b"ordinary work needs no token")
        for call in (c.config, c.reload_config, c.promote, lambda: c.flush_tube("default")):
            with pytest.raises(Unauthorized) as refused:
                call()
            assert refused.value.reply_line().startswith("UNAUTHORIZED")
            assert "admin token" in str(refused.value)
    with pytest.raises(Unauthorized, match="refused the token"), \
            Client(address(srv), token="not-the-token") as c:
        c.config()


def test_promote_turns_a_replica_into_a_primary(tmp_path: Path, token_file: Path,
                                                primary) -> None:
    srv, _ = primary
    replica = start_smallstalk(tmp_path, "--replica-of", address(srv), "--admin-token-file",
                               str(token_file), data_dir=tmp_path / "replica")
    try:
        with Client(address(replica), token=TOKEN) as c, \
                Client(address(srv), token=TOKEN) as p:
            # Connected is not caught up: records (the primary's epoch among
            # them) follow the handshake, and a replica promoted before they
            # arrive rightly starts history 1 of its own.
            primary_seq = int(p.ext_stats()["last-seq"])
            wait_for(lambda: c.ext_stats()["replication-connected"] == "true"
                     and int(c.ext_stats()["last-seq"]) >= primary_seq,
                     what="the replica to follow and catch up")
            epoch = c.promote()
            assert epoch == int(c.ext_stats()["epoch"]) and epoch >= 2
            assert c.ext_stats()["role"] == "primary"
            with pytest.raises(NotAReplica):
                c.promote()
    finally:
        replica.stop()


async def test_the_trio_client_has_them_too(primary) -> None:
    srv, _ = primary
    async with AsyncClient(address(srv), token=TOKEN) as c:
        assert "emails" in parse_yaml((await c.config()).encode())
        await c.reload_config()
        assert (await c.ext_stats())["role"] == "primary"
        with pytest.raises(NotAReplica):
            await c.promote()
