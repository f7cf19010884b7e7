"""`serve --config FILE` parsed: values, flags over the file, `config dump --config`, the docs."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from smallstalk import __version__, cli
from smallstalk.config import (
    SERVE_HELP,
    ServeConfig,
    UsageError,
    parse_serve,
    server_changes,
    tls_address,
)
from smallstalk.core.state import BUILD
from smallstalk.launch import listen_address
from smallstalk.ops import config_dump as configcmd
from smallstalk.server import tls
from smallstalk.server.policy import TubePolicy, render
from smallstalk.storage.aof import FSYNC_ALWAYS, FSYNC_INTERVAL, FSYNC_NEVER

from ..support.configfile import parse_yaml, run_dump, write
from ..support.procs import REPO

FULL = """\
[server]
listen = "127.0.0.1"
port = 12345
max-job-size = "128k"
data-dir = "data"
fsync = "everysec"
fsync-interval = 250
segment-records = 5000
segment-bytes = "8MiB"
compact-interval = "2m"
compact-segments = 8
compact = false
keep-segments-hours = 1.5
keep-segments-bytes = "1GB"
replica-of = "primary.example:11300"
min-replica-acks = 1
replica-ack-timeout = 2.5
max-memory = "64MB"

[tubes.default]
max-age = "7d"
max-job-size = 65536

[tubes."orders"]
max-jobs = 10000
max-bytes = "512MB"
discard-old-when-full = true
expire-to = "orders-expired"

[tubes."orders+audit"]
max-age = 0
max-memory = "16MB"
"""


def parse(*argv: str) -> ServeConfig:
    cfg = parse_serve(list(argv))
    assert isinstance(cfg, ServeConfig), cfg
    return cfg


# --- the file --------------------------------------------------------------------------


def test_every_server_key(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    cfg = parse("--config", str(path))
    assert cfg.addr == "127.0.0.1" and cfg.port == 12345
    assert cfg.max_job_size == 128 << 10
    assert cfg.data_dir == tmp_path / "data"  # relative to the file
    assert cfg.fsync == FSYNC_INTERVAL and cfg.fsync_interval == 0.25
    assert cfg.segment_records == 5000 and cfg.segment_bytes == 8 << 20
    assert cfg.compact_interval == 120.0 and cfg.compact_segments == 8
    assert cfg.compact is False
    assert cfg.keep_hours == 1.5 and cfg.keep_bytes == 1 << 30
    assert cfg.replica_of == ("primary.example", 11300)
    assert cfg.min_replica_acks == 1 and cfg.replica_ack_timeout == 2.5
    assert cfg.max_memory == 64 << 20
    assert cfg.config_path == path.absolute()


def test_defaults_without_a_file() -> None:
    cfg = parse()
    assert cfg.max_memory == 0 and cfg.config_path is None
    assert cfg.policies.of("anything") == TubePolicy()
    assert cfg == ServeConfig()


@pytest.mark.parametrize("text, attr, want", [
    ("max-memory = 1048576", "max_memory", 1 << 20),
    ('max-memory = "512k"', "max_memory", 512 << 10),
    ('max-memory = "2GiB"', "max_memory", 2 << 30),
    ("max-memory = 0", "max_memory", 0),
    ('segment-bytes = "1k"', "segment_bytes", 4096),  # the flag's floor too
    ('max-job-size = "4GB"', "max_job_size", 1 << 30),  # capped like -z
    ("compact-interval = 30", "compact_interval", 30.0),
    ("compact-interval = 0.5", "compact_interval", 0.5),
    ('replica-ack-timeout = "1m"', "replica_ack_timeout", 60.0),
    ('fsync = "never"', "fsync", FSYNC_NEVER),
    ('fsync = "always"', "fsync", FSYNC_ALWAYS),
    ('data-dir = "/var/lib/smallstalk"', "data_dir", Path("/var/lib/smallstalk")),
])
def test_sizes_durations_and_values(tmp_path: Path, text: str, attr: str, want) -> None:
    cfg = parse("--config", str(write(tmp_path, f"[server]\n{text}\n")))
    assert getattr(cfg, attr) == want


def test_tube_tables_inherit_from_default(tmp_path: Path) -> None:
    cfg = parse("--config", str(write(tmp_path, FULL)))
    pol = cfg.policies
    week = 7 * 86400
    assert pol.of("default") == TubePolicy(max_age=week, max_job_size=65536)
    assert pol.of("never-configured") == pol.default
    assert pol.of("orders") == TubePolicy(
        max_jobs=10000, max_bytes=512 << 20, max_job_size=65536, discard_old_when_full=True,
        max_age=week, expire_to="orders-expired")
    # A named tube overrides the default's max-age with 0 (never).
    assert pol.of("orders+audit") == TubePolicy(max_age=0, max_job_size=65536,
                                                max_memory=16 << 20)


def test_a_file_with_tubes_only(tmp_path: Path) -> None:
    cfg = parse("--config", str(write(tmp_path, '[tubes.default]\nmax-jobs = 3\n')))
    assert cfg.policies.default.max_jobs == 3
    assert cfg.port == 11300 and cfg.file_settings == {}


@pytest.mark.parametrize("text, key", [
    ("[server]\nprot = 1\n", "'prot'"),
    ('[server]\nport = "11300"\n', "server.port"),
    ("[server]\nport = 70000\n", "server.port"),
    ("[server]\nport = -1\n", "server.port"),
    ("[server]\ncompact = 1\n", "server.compact"),
    ('[server]\nfsync = "sometimes"\n', "server.fsync"),
    ("[server]\nfsync-interval = 0.5\n", "server.fsync-interval"),
    ('[server]\nmax-memory = "lots"\n', "server.max-memory"),
    ("[server]\nmax-memory = true\n", "server.max-memory"),
    ('[server]\nreplica-of = "nohost"\n', "server.replica-of"),
    ('[server]\ncompact-interval = "soon"\n', "server.compact-interval"),
    ("[server]\nkeep-segments-hours = -2\n", "server.keep-segments-hours"),
    ('[server]\nlisten = ""\n', "server.listen"),
    ("server = 3\n", "server"),
    ("[sever]\nport = 1\n", "'sever'"),
    ("[tubes.default]\nmax-jobz = 1\n", "'max-jobz'"),
    ('[tubes.default]\nmax-age = "forever"\n', "tubes.default.max-age"),
    ('[tubes."orders"]\nmax-jobs = -1\n', "tubes.orders.max-jobs"),
    ('[tubes."orders"]\nexpire-to = "orders"\n', "tubes.orders.expire-to"),
    ('[tubes."bad name"]\nmax-jobs = 1\n', "'bad name'"),
    ("[server\n", "not valid TOML"),
])
def test_errors_name_the_file_and_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(UsageError) as e:
        parse_serve(["--config", str(path)])
    assert str(path.absolute()) in str(e.value) and key in str(e.value), str(e.value)


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="nope.toml: cannot read"):
        parse_serve(["--config", str(tmp_path / "nope.toml")])


def test_config_twice_is_an_error(tmp_path: Path) -> None:
    path = str(write(tmp_path, ""))
    with pytest.raises(UsageError, match="twice"):
        parse_serve(["--config", path, "--config", path])


@pytest.mark.parametrize("before", [True, False], ids=["flags-first", "flags-last"])
def test_flags_win_over_the_file_wherever_they_stand(tmp_path: Path, before: bool) -> None:
    path = write(tmp_path, FULL)
    flags = ["-p", "7000", "-l", "::1", "--fsync", "always", "--max-memory", "1k",
             "-b", "elsewhere", "--compact-segments=2", "-z", "100"]
    argv = [*flags, f"--config={path}"] if before else ["--config", str(path), *flags]
    cfg = parse(*argv)
    assert (cfg.addr, cfg.port) == ("::1", 7000)
    assert cfg.fsync == FSYNC_ALWAYS
    assert cfg.fsync_interval == 0.25  # not named by a flag: the file's
    assert cfg.max_memory == 1024
    assert cfg.data_dir == Path("elsewhere")
    assert cfg.compact_segments == 2 and cfg.max_job_size == 100
    assert cfg.segment_records == 5000 and cfg.compact is False  # the file's


def test_beanstalkd_short_flags_over_the_file(tmp_path: Path) -> None:
    path = str(write(tmp_path, '[server]\nfsync = "always"\nsegment-bytes = "1MB"\n'))
    assert parse("-F", "--config", path).fsync == FSYNC_NEVER
    cfg = parse("--config", path, "-f", "200", "-s", "8192", "-VV")
    assert cfg.fsync == FSYNC_INTERVAL and cfg.fsync_interval == 0.2
    assert cfg.segment_bytes == 8192 and cfg.verbose == 2
    on = str(write(tmp_path, "[server]\ncompact = true\n", "on.toml"))
    assert parse("--no-compact", "--config", on).compact is False


def test_max_memory_flag() -> None:
    assert parse("--max-memory", "65536").max_memory == 65536
    assert parse("--max-memory=64MB").max_memory == 64 << 20
    with pytest.raises(UsageError, match="--max-memory"):
        parse_serve(["--max-memory", "a lot"])


def test_flags_take_what_the_file_takes() -> None:
    """Each flag reads its value as the [server] key of its name does."""
    cfg = parse("--keep-segments-bytes", "2GB", "--compact-interval", "10s", "-z", "64k",
                "--segment-bytes", "1MiB", "--replica-ack-timeout", "1.5",
                "--keep-segments-hours", "0.5", "--fsync-interval", "250")
    assert (cfg.keep_bytes, cfg.compact_interval, cfg.max_job_size) == (2 << 30, 10.0, 64 << 10)
    assert (cfg.segment_bytes, cfg.replica_ack_timeout, cfg.keep_hours) == (1 << 20, 1.5, 0.5)
    assert cfg.fsync_interval == 0.25
    assert parse("-s", "1k").segment_bytes == 4096  # the least, as from the file
    for argv, words in ((["--compact-interval", "soon"], 'like "15m"'),
                        (["--segment-records", "-3"], "whole number >= 0"),
                        (["-z", "big"], 'like 65536 or "64MB"')):
        with pytest.raises(UsageError, match=words) as e:
            parse_serve(argv)
        assert str(e.value).startswith(argv[0])


def test_the_keys_flags_set_are_known(tmp_path: Path) -> None:
    """A reload says which changed keys a flag overrides (cli._reload)."""
    path = str(write(tmp_path, "[server]\nport = 1\n"))
    cfg = parse("--config", path, "-p", "5", "-F", "--no-compact", "--max-memory", "1MB", "-V")
    assert cfg.flag_keys == {"port", "fsync", "compact", "max-memory"}
    assert parse("--config", path).flag_keys == frozenset()


def test_help_mentions_the_file_and_max_memory() -> None:
    assert parse_serve(["-h"]) == SERVE_HELP
    assert "--config FILE" in SERVE_HELP and "--max-memory BYTES" in SERVE_HELP


def test_server_changes_compares_values_not_spelling(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nport = 12000\nmax-memory = "64MB"\n[tubes.default]\n')
    cfg = parse("--config", str(path), "-p", "5")
    assert server_changes(cfg) == []
    path.write_text("[server]\nport = 12000\nmax-memory = 67108864\n")
    assert server_changes(cfg) == []
    path.write_text('[server]\nport = 12001\nfsync = "never"\nmax-memory = "64MB"\n')
    assert server_changes(cfg) == ["port", "fsync"]
    path.write_text("[tubes.default]\nmax-jobs = 1\n")
    assert server_changes(cfg) == ["port", "max-memory"]


def test_the_early_socket_is_dropped_when_the_file_moves_the_port(tmp_path: Path) -> None:
    path = str(write(tmp_path, "[server]\nport = 12000\n"))
    # With a file, launch.py does not bind early at all (the file may move the port)...
    for argv in (["--config", path], ["--config", path, "-p", "12000"],
                 ["-l", "unix:/tmp/x.sock", "--config", path]):
        assert listen_address(argv) is None
        assert not cli._early_socket_fits(argv, parse(*argv))
    # ...and without one, the early socket is the one the flags ask for.
    argv = ["-p", "12000"]
    assert cli._early_socket_fits(argv, parse(*argv))


# --- config dump --config --------------------------------------------------------------


def test_config_dump_from_a_file(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    code, out, err = run_dump("--config", str(path))
    assert code == 0, err
    cfg = parse("--config", str(path))
    assert out == render(cfg.policies.dump([])).decode()
    tubes = parse_yaml(out.encode())
    assert list(tubes) == ["default", "orders", "orders+audit"]
    assert tubes["default"]["max-age"] == str(7 * 86400)
    assert tubes["orders"] == {
        "max-jobs": "10000", "max-bytes": str(512 << 20), "max-job-size": "65536",
        "discard-old-when-full": "true", "max-age": str(7 * 86400),
        "expire-to": "orders-expired", "fanout-only": "false", "max-memory": "0",
        "unique": "", "unique-for": "3600", "unique-keys-max": "100000"}
    assert tubes["orders+audit"]["max-memory"] == str(16 << 20)


def test_unique_tube_keys(tmp_path: Path) -> None:
    cfg = parse("--config", str(write(tmp_path, '[tubes.mail]\nunique = "body"\n'
                                                 'unique-for = "10m"\nunique-keys-max = 7\n')))
    pol = cfg.policies.of("mail")
    assert (pol.unique, pol.unique_for, pol.unique_keys_max, pol.plain) == ("body", 600, 7, False)
    assert cfg.policies.of("other").plain
    code, out, err = run_dump("--config", str(write(tmp_path, '[tubes.mail]\nunique = "id"\n')))
    assert code == 1 and "tubes.mail.unique" in err and '"body"' in err


def test_config_dump_of_a_bad_file_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 1\nbogus = 2\n")
    code, out, err = run_dump("--config", str(path))
    assert code == 1 and out == ""
    assert str(path) in err and "'bogus'" in err


@pytest.mark.parametrize("text, words", [
    ('[server]\ntls-cert = "c.pem"\ntls-key = "k.pem"\n', "--tls-cert is for --tls-port"),
    ("[server]\nplaintext = false\n", "leaves nothing to listen on"),
    ('[server]\nadmin-token-file = "nosuch"\n', "cannot read the admin token file"),
    ('[ha]\netcd = "http://etcd:2379"\n', "--ha-etcd needs a data directory"),
    ('[server]\ntls-port = 11999\ntls-cert = "c.pem"\ntls-key = "k.pem"\n',
     "c.pem: No such file or directory: give the path of a readable PEM file"),
])
def test_config_dump_refuses_what_serve_refuses(tmp_path: Path, text: str, words: str) -> None:
    """`config dump --config` checks the file as a start would: settings that
    do not fit together, a token or certificate file that cannot be read."""
    path = write(tmp_path, text)
    code, out, err = run_dump("--config", str(path))
    assert code == 1 and out == "" and words in err and err.count("\n") == 1
    # ...where `serve --config` stops too: parsing, or reading the certificate.
    with pytest.raises((UsageError, tls.TLSFileError)):
        tls.contexts_for(parse_serve(["--config", str(path)]))


def test_config_dump_usage() -> None:
    assert run_dump("--config", "a", "--server", "b:1")[0] == 2
    assert run_dump("--bogus")[0] == 2
    assert run_dump("--server", "no-port")[0] == 2
    assert configcmd.main(["show"], stdout=io.StringIO(), stderr=io.StringIO()) == 2
    code, out, _ = run_dump("-h")
    assert code == 0 and "--server HOST:PORT" in out


# --- docs/CONFIG.md --------------------------------------------------------------------


def test_the_documented_example_is_a_valid_file(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "CONFIG.md").read_text()
    example = re.search(r"```toml\n(.*?)```", doc, re.S).group(1)
    cfg = parse("--config", str(write(tmp_path, example)))
    assert cfg.max_memory == 512 << 20 and cfg.keep_hours == 24.0
    assert cfg.policies.of("emails").expire_to == "emails.expired"
    assert cfg.policies.of("emails.expired").max_age == 30 * 86400
    assert cfg.policies.of("orders").fanout_only


def test_every_key_is_documented() -> None:
    from smallstalk.config import SERVER_KEYS
    from smallstalk.server.policy import TUBE_KEYS

    doc = (REPO / "docs" / "CONFIG.md").read_text()
    for key in [*SERVER_KEYS, *TUBE_KEYS]:
        assert f"| `{key}` |" in doc, key


def test_version_flag_prints_the_package_version() -> None:
    assert parse_serve(["--version"]) == f"smallstalk {__version__} ({BUILD})"
    assert parse_serve(["-v"]) == f"smallstalk {__version__} ({BUILD})"  # beanstalkd's short flag


def test_admin_settings_from_flags_and_the_file(tmp_path: Path) -> None:
    from smallstalk.config import parse_serve
    from smallstalk.server.admin import LOOPBACK

    (tmp_path / "tok").write_text("s3cr3t\n")
    cfg = tmp_path / "smallstalk.toml"
    cfg.write_text('[server]\nadmin-token-file = "tok"\nadmin-allow = ["10.0.0.0/8", "::1"]\n'
                   'extended-stats = true\n')
    got = parse_serve(["--config", str(cfg)])
    assert got.admin_token_file == tmp_path / "tok"  # relative to the file
    assert got.admin_allow == ("10.0.0.0/8", "::1") and got.extended_stats
    assert parse_serve([]).admin_allow == LOOPBACK and not parse_serve([]).extended_stats
    assert parse_serve(["--admin-allow", "192.168.1.0/24, 127.0.0.1"]).admin_allow == (
        "192.168.1.0/24", "127.0.0.1")
    with pytest.raises(UsageError, match="not an address or CIDR: 'nope'"):
        parse_serve(["--admin-allow", "10.0.0.0/8,nope"])
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UsageError, match="must hold one word"):
        parse_serve(["--admin-token-file", str(tmp_path / "empty")])


# --- TLS ---------------------------------------------------------------------------


def test_tls_keys_from_the_file_and_flags(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nreplica-of = "p:11443"\ntls-port = 11443\n'
                 'tls-cert = "tls/server.pem"\ntls-key = "/etc/k.pem"\n'
                 'tls-client-ca = "ca.pem"\ntls-handshake-timeout = "30s"\nplaintext = false\n'
                 'tls-listen = "0.0.0.0"\nreplica-tls-ca = "ca.pem"\n'
                 'replica-tls-cert = "r.pem"\nreplica-tls-key = "r.key"\n')
    cfg = parse("--config", str(path))
    assert cfg.tls_port == 11443 and cfg.tls_listen == "0.0.0.0" and cfg.plaintext is False
    assert cfg.tls_cert == tmp_path / "tls/server.pem"  # relative to the file
    assert cfg.tls_key == Path("/etc/k.pem") and cfg.tls_client_ca == tmp_path / "ca.pem"
    assert cfg.tls_handshake_timeout == 30.0
    assert (cfg.replica_tls_ca, cfg.replica_tls_cert, cfg.replica_tls_key) == (
        tmp_path / "ca.pem", tmp_path / "r.pem", tmp_path / "r.key")
    flags = parse("--tls-port", "1", "--tls-cert", "c", "--tls-key", "k", "--no-plaintext",
                  "-l", "unix:/tmp/s.sock")
    assert (flags.tls_port, flags.tls_cert, flags.plaintext) == (1, Path("c"), False)
    assert tls_address(flags) == "127.0.0.1"  # never the unix socket
    assert tls_address(parse("-l", "10.0.0.1")) == "10.0.0.1"
    assert parse("--tls-port", "1", "--tls-cert", "c", "--tls-key", "k").plaintext


@pytest.mark.parametrize("argv, why", [
    (["--tls-port", "1"], "--tls-port needs --tls-cert"),
    (["--tls-port", "1", "--tls-cert", "c"], "--tls-port needs"),
    (["--tls-cert", "c", "--tls-key", "k"], "--tls-cert is for --tls-port"),
    (["--tls-key", "k", "--http", "a:1"], "go together"),
    (["--http", "a:1", "--tls-client-ca", "ca"], "--tls-client-ca needs"),
    (["--no-plaintext"], "nothing to listen on"),
    (["--tls-port", "70000"], "a port is 0 to 65535"),
    (["--tls-listen", "unix:/x"], "stays plaintext"),
    (["--replica-tls-ca", "ca"], "are for --replica-of"),
    (["--replica-of", "p:1", "--replica-tls-cert", "c"], "go together"),
])
def test_tls_flag_mistakes(argv: list[str], why: str) -> None:
    with pytest.raises(UsageError, match=why):
        parse_serve(argv)


def test_a_unix_socket_alone_may_go_without_plaintext_tcp() -> None:
    assert parse("-l", "unix:/tmp/s.sock", "--no-plaintext").plaintext is False


def test_ha_settings_from_flags_and_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\ndata-dir = "d"\n\n[ha]\n'
                 'etcd = ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]\n'
                 'cluster = "jobs"\nname = "node1"\nadvertise = "10.0.0.1:11300"\n'
                 'ttl = "5s"\nmax-lag = 10\n')
    cfg = parse_serve(["--config", str(path)])
    assert cfg.ha_etcd == ("http://10.0.0.1:2379", "http://10.0.0.2:2379")
    assert (cfg.ha_cluster, cfg.ha_name, cfg.ha_advertise, cfg.ha_ttl, cfg.ha_max_lag) == (
        "jobs", "node1", "10.0.0.1:11300", 5, 10)
    cfg = parse_serve(["--config", str(path), "--ha-ttl", "3", "--ha-name", "other"])
    assert (cfg.ha_ttl, cfg.ha_name) == (3, "other")
    # Without --ha-advertise: -l and -p, and the host name as the member's name.
    cfg = parse_serve(["-b", "d", "-l", "10.0.0.7", "-p", "11400",
                       "--ha-etcd", "http://127.0.0.1:2379"])
    assert cfg.ha_advertise == "10.0.0.7:11400" and cfg.ha_name
    assert cfg.ha_ttl == 10 and cfg.ha_cluster == "smallstalk"
    assert parse_serve(["-b", "d"]).ha_etcd == ()


@pytest.mark.parametrize("argv,why", [
    (["--ha-etcd", "http://127.0.0.1:2379"], "needs a data directory"),
    (["-b", "d", "--ha-etcd", "127.0.0.1:2379"], "http://HOST:PORT"),
    (["-b", "d", "--ha-etcd", "http://e:2379", "--replica-of", "h:1"], "exclude each other"),
    (["-b", "d", "--ha-etcd", "http://e:2379", "--ha-ttl", "1"], "at least 2"),
    (["-b", "d", "--ha-etcd", "http://e:2379", "-l", "0.0.0.0"], "--ha-advertise"),
    (["-b", "d", "--ha-etcd", "http://e:2379", "--ha-advertise", "nope"], "HOST:PORT"),
    (["-b", "d", "--ha-etcd", "http://e:2379", "--ha-name", "a/b"], "without '/'"),
])
def test_ha_flag_mistakes(argv: list[str], why: str) -> None:
    with pytest.raises(UsageError, match=re.escape(why)):
        parse_serve(argv)


def test_an_unknown_ha_key_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[ha]\netcd = "http://e:2379"\nleader = "me"\n')
    with pytest.raises(UsageError, match="ha: unknown key 'leader'"):
        parse_serve(["--config", str(path)])


def test_the_ha_example_in_the_docs_is_a_valid_file(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "HA.md").read_text()
    example = re.search(r"```toml\n(.*?)```", doc, re.S).group(1)
    cfg = parse_serve(["--config", str(write(tmp_path, example))])
    assert len(cfg.ha_etcd) == 3 and cfg.ha_name == "node1" and cfg.min_replica_acks == 1
