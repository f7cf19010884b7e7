"""Server configuration: beanstalkd's flags and smallstalk's own, parsed.

Kept free of trio and of the running server (of server/ it uses only the
parsers in server/admin.py and server/policy.py, which import neither) so
that `smallstalk serve` can parse its flags and open its listening socket
within a few milliseconds of starting (see launch.py): client test set-ups
that start a server and connect after 0.1 s must not find the port closed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from smallstalk import __version__
from smallstalk.core import protocol
from smallstalk.server.admin import LOOPBACK, parse_allow, read_token
from smallstalk.server.policy import (
    ConfigError,
    Policies,
    parse_duration,
    parse_size,
    policies_from,
    read_toml,
)
from smallstalk.storage.aof import FSYNC_ALWAYS, FSYNC_INTERVAL, FSYNC_NEVER
from smallstalk.usage import UsageError

SERVE_HELP = """\
Usage: smallstalk serve [OPTIONS]     (or: smallstalk [beanstalkd flags])

Serve the beanstalkd protocol. Without a data directory jobs live in memory
only; with one, every acknowledged change is in the append-only file first.

beanstalkd's flags, same meaning:
 -l ADDR, --listen ADDR      listen on address, or unix:PATH for a Unix socket
                             (default 127.0.0.1; beanstalkd's default is 0.0.0.0)
 -p PORT, --port PORT        listen on port (default 11300; 0: any free port)
 -z BYTES, --max-job-size BYTES
                             largest job body (default 65535, at most 1 GiB)
 -b DIR, --data-dir DIR      data directory: turns persistence on
 -f MS                       fsync at most every MS ms; -f0 fsyncs before every reply
 -F                          never fsync (the kernel writes back when it likes)
 -s BYTES, --segment-bytes BYTES
                             close an AOF segment at this size (default 16777216)
 -u USER                     become this user after opening the listeners, before
                             reading the data directory (which USER must own)
 -V                          debug log output
 -v, --version               print the version and exit
 -h, --help                  this help

Under systemd socket activation (LISTEN_FDS) the sockets passed in are served
and -l/-p are ignored; with NOTIFY_SOCKET set, readiness is reported (Type=notify).

smallstalk's own:
 --fsync MODE            always (default: INSERTED means on disk), everysec, never
 --fsync-interval MS     the interval for everysec (default 1000)
 --segment-records N     close a segment after N records (default 100000)
 --compact-interval SEC  fold closed segments into a snapshot this often (default 10)
 --compact-segments N    ...or as soon as N segments are closed (default 4)
 --no-compact            never compact (the AOF keeps every record)
 --keep-segments-hours H keep folded segments for H hours (for the replay tools)
 --keep-segments-bytes B ...and/or at most B bytes of them, newest first
 --max-memory BYTES      job bodies kept in memory, all tubes together (e.g. 512MB;
                         default 0: unlimited); the rest is read back from the AOF
 --max-connections N     refuse connections past N with TOO_MANY_CONNECTIONS
                         (default 10000, less if the fd limit is lower)

Configuration file (see docs/CONFIG.md):
 --config FILE           TOML: a [server] table with the long options' names
                         (port = 11301, data-dir = "/var/lib/smallstalk", ...)
                         and per-tube [tubes.default] / [tubes."NAME"] tables.
                         Flags given on the command line win over the file.
                         SIGHUP or the reload-config command re-reads the tube
                         tables; [server] changes need a restart.

kestrel's memcache protocol (see docs/KESTREL.md):
 --memcache-port PORT    answer memcache clients (SET/GET queue...) on this port,
                         on -l's address (127.0.0.1 when -l is unix:PATH);
                         default: off

Replication (needs a data directory; see the README):
 --replica-of HOST:PORT  follow that primary as a read-only hot standby
 --min-replica-acks N    answer changes only once N replicas have them on disk
                         (default 0: asynchronous)
 --replica-ack-timeout S how long to wait for those acks before answering
                         NOT_REPLICATED (default 5)

Automatic failover (needs a data directory and the extra smallstalk[ha]; docs/HA.md):
 --ha-etcd URL[,URL...]  join the HA cluster kept in this etcd (v3 JSON gateway,
                         e.g. http://10.0.0.1:2379): the member holding its leader
                         lock is the primary, every other one follows it
 --ha-cluster NAME       the cluster's name in the store (default smallstalk)
 --ha-name NODE          this member's name (default: the host name)
 --ha-advertise HOST:PORT
                         where the others and clients reach this server's port
                         (default: -l and -p; must not be 0.0.0.0)
 --ha-ttl SEC            the leader lease, renewed every third of it (default 10)
 --ha-max-lag N          a member may take a free lock only if no other member
                         is more than N records ahead of it (default 0)

TLS (see docs/SECURITY.md; certificates and keys are PEM files):
 --tls-port PORT         serve TLS clients on this port, beside the plaintext -p
 --tls-cert FILE         the server's certificate (chain), for --tls-port
 --tls-key FILE          its private key (not encrypted)
 --tls-listen ADDR       the TLS port's address (default: -l's, or 127.0.0.1
                         when -l is unix:PATH)
 --tls-client-ca FILE    mutual TLS: only clients with a certificate signed by
                         a CA in FILE get in (the console too)
 --tls-handshake-timeout SEC
                         drop a client whose TLS handshake takes longer (default 10)
 --no-plaintext          no plaintext TCP port (-p); a unix:PATH socket stays
 --replica-tls-ca FILE   follow the --replica-of primary over TLS, trusting
                         the CAs in FILE (the system's CAs when only
                         --replica-tls-cert is given)
 --replica-tls-cert FILE, --replica-tls-key FILE
                         the replica's own certificate, for a primary with
                         --tls-client-ca

Admin commands (replicate, promote, config, reload-config, flush-tube;
see docs/SECURITY.md):
 --admin-token-file FILE every connection must send `auth <token>` first; FILE holds
                         the token (replicas send their own file's token to the primary)
 --admin-allow CIDR,...  without a token: the addresses that may run them
                         (default 127.0.0.0/8,::1; the unix socket always may)
 --extended-stats        stats and stats-tube carry smallstalk's own keys too (default:
                         beanstalkd's keys only; ext-stats and ext-stats-tube serve ours)

Operator console (needs the extra: pip install smallstalk[console]):
 --http ADDR:PORT        serve /metrics and the web console there (default: off);
                         over HTTPS with --tls-cert
"""


@attrs.define
class ServeConfig:
    addr: str = "127.0.0.1"
    port: int = 11300
    max_job_size: int = protocol.DEFAULT_MAX_JOB_SIZE
    data_dir: Path | None = None
    fsync: str = FSYNC_ALWAYS
    fsync_interval: float = 1.0
    segment_records: int = 100_000
    segment_bytes: int = 16 << 20
    compact_interval: float = 10.0
    compact_segments: int = 4
    compact: bool = True
    keep_hours: float | None = None
    keep_bytes: int | None = None
    replica_of: tuple[str, int] | None = None
    min_replica_acks: int = 0
    replica_ack_timeout: float = 5.0
    user: str | None = None
    verbose: int = 0
    max_memory: int = 0  # job-body bytes kept in memory, all tubes together; 0 = unlimited
    max_connections: int = 0  # 0: 10,000, or fewer under a lower RLIMIT_NOFILE
    http: tuple[str, int] | None = None  # --http ADDR:PORT: metrics and the web console
    # TLS (server/tls.py): a port of its own beside the plaintext one.
    tls_port: int | None = None
    tls_listen: str | None = None  # None: -l's address (127.0.0.1 for unix:PATH)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # mutual TLS
    tls_handshake_timeout: float = 10.0
    plaintext: bool = True  # --no-plaintext: no plaintext TCP listener
    memcache_port: int | None = None  # kestrel's memcache protocol (server/memcache.py)
    replica_tls_ca: Path | None = None
    replica_tls_cert: Path | None = None
    replica_tls_key: Path | None = None
    config_path: Path | None = None  # --config FILE (absolute), reread on SIGHUP
    policies: Policies = attrs.Factory(Policies)  # the file's tube tables
    # The file's [server] settings as read at start ({TOML key: value}), to
    # tell on a reload whether the file now asks for something else.
    file_settings: dict[str, Any] = attrs.Factory(dict)
    # The [server] keys a command-line flag set: the file's value of these is not used.
    flag_keys: frozenset[str] = frozenset()
    # Admin commands (server/admin.py): the token's file, the CIDRs trusted without one.
    admin_token_file: Path | None = None
    admin_allow: tuple[str, ...] = LOOPBACK
    extended_stats: bool = False  # stats and stats-tube append smallstalk's keys
    # Automatic failover (replication/ha.py): on with ha_etcd.
    ha_etcd: tuple[str, ...] = ()
    ha_cluster: str = "smallstalk"
    ha_name: str = ""
    ha_advertise: str = ""
    ha_ttl: int = 10
    ha_max_lag: int = 0


def _int(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"invalid number for {flag}: {text}") from None
    if value < 0:
        raise UsageError(f"{flag} must not be negative")
    return value


def _port_flag(text: str, flag: str) -> int:
    port = _int(text, flag)
    if port > 65535:
        raise UsageError(f"{flag} {text}: a port is 0 to 65535 (0: any free port)")
    return port


LONG_OPTIONS = {
    "--data-dir", "--fsync", "--fsync-interval", "--segment-records", "--segment-bytes",
    "--compact-interval", "--compact-segments", "--keep-segments-hours",
    "--keep-segments-bytes", "--replica-of", "--min-replica-acks", "--replica-ack-timeout",
    "--listen", "--port", "--max-job-size", "--max-memory", "--config", "--http",
    "--max-connections",
    "--tls-port", "--tls-listen", "--tls-cert", "--tls-key", "--tls-client-ca",
    "--tls-handshake-timeout", "--replica-tls-ca", "--replica-tls-cert", "--replica-tls-key",
    "--admin-token-file", "--admin-allow", "--memcache-port",
    "--ha-etcd", "--ha-cluster", "--ha-name", "--ha-advertise", "--ha-ttl", "--ha-max-lag",
}

# Long options without a value.
SWITCHES = {"--no-compact", "--no-plaintext", "--extended-stats"}

# Options that name a file: --tls-cert FILE -> ServeConfig.tls_cert.
PATH_OPTIONS = {f"--{key}": key.replace("-", "_") for key in (
    "tls-cert", "tls-key", "tls-client-ca", "replica-tls-ca", "replica-tls-cert",
    "replica-tls-key")}

FSYNC_MODES = {"always": FSYNC_ALWAYS, "everysec": FSYNC_INTERVAL, "never": FSYNC_NEVER}


def version_line() -> str:
    """What `--version` prints: beanstalkd's "NAME VERSION", and the build."""
    from smallstalk.core.state import BUILD  # not on the way to serving: see launch.py

    return f"smallstalk {__version__} ({BUILD})"


def parse_serve(argv: list[str]) -> ServeConfig | str:
    """Parse serve's flags; returns a config, or text to print and exit 0.

    With `--config FILE` the file is read first and every flag is applied
    over it, wherever `--config` stands on the command line.
    """
    flags_seen: list[tuple[str, str]] = []  # (flag, value), applied after the file
    config_path: Path | None = None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if name in ("--help",):
                return SERVE_HELP
            if name in SWITCHES:
                flags_seen.append((name, ""))
                continue
            if name == "--version":
                return version_line()
            if name not in LONG_OPTIONS:
                raise UsageError(f"unknown option: {arg}")
            if not eq:
                if not args:
                    raise UsageError(f"option requires an argument: {name}")
                value = args.pop(0)
            if name == "--config":
                if config_path is not None:
                    raise UsageError("--config given twice")
                config_path = Path(value)
            else:
                flags_seen.append((name, value))
            continue
        if not arg.startswith("-") or arg == "-":
            raise UsageError(f"unknown argument: {arg}")
        flags = arg[1:]
        while flags:
            ch, flags = flags[0], flags[1:]
            if ch in "lpzbfsu":
                if flags:
                    value, flags = flags, ""
                elif args:
                    value = args.pop(0)
                else:
                    raise UsageError(f"flag requires an argument: -{ch}")
                flags_seen.append((f"-{ch}", value))
            elif ch in "FV":
                flags_seen.append((f"-{ch}", ""))
            elif ch == "v":
                return version_line()
            elif ch == "h":
                return SERVE_HELP
            elif ch in "cn":
                pass  # removed in beanstalkd too (compaction is always on)
            else:
                raise UsageError(f"unknown flag: -{ch}")
    cfg = ServeConfig()
    if config_path is not None:
        load_file(cfg, config_path)
    for flag, value in flags_seen:
        if flag.startswith("--"):
            _set_long(cfg, flag, value)
        else:
            _set_short(cfg, flag[1], value)
    cfg.flag_keys = frozenset(key for flag, _ in flags_seen
                              for key in FLAG_KEYS.get(flag, (flag[2:],)) if key in SERVER_KEYS)
    check_settings(cfg)
    return cfg


def check_settings(cfg: ServeConfig) -> None:
    """The settings fit together, whether from flags or a file: TLS, the admin
    token and allowed addresses, HA. UsageError says what to change."""
    check_tls(cfg)
    _check_admin(cfg)
    check_ha(cfg)


def check_file(path: Path) -> ServeConfig:
    """A configuration file read and checked as `serve --config FILE` reads it
    with no flags (`smallstalk config dump --config`): UsageError names the
    file."""
    cfg = ServeConfig()
    load_file(cfg, path)
    try:
        check_settings(cfg)
    except UsageError as e:
        raise UsageError(f"{path}: {e} (the file's keys are the flags' names)") from None
    return cfg


def check_ha(cfg: ServeConfig) -> None:
    """The HA settings fit together; fills in the name and the advertised address."""
    if not cfg.ha_etcd:
        return
    if cfg.replica_of is not None:
        raise UsageError("--replica-of and --ha-etcd exclude each other: an HA member "
                         "follows whoever holds the leader lock")
    if cfg.data_dir is None:
        raise UsageError("--ha-etcd needs a data directory (-b DIR or --data-dir DIR)")
    for url in cfg.ha_etcd:
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--ha-etcd takes http://HOST:PORT URLs, got {url!r}")
    if cfg.ha_ttl < 2:
        raise UsageError("--ha-ttl must be at least 2 seconds")
    if not cfg.ha_name:
        import socket

        cfg.ha_name = socket.gethostname()
    if not cfg.ha_advertise:
        if cfg.addr in ("0.0.0.0", "::", "") or cfg.addr.startswith("unix:") or not cfg.port:
            raise UsageError("--ha-advertise HOST:PORT is needed: -l/-p do not say where "
                             "the other members reach this server")
        cfg.ha_advertise = f"{cfg.addr}:{cfg.port}"
    elif _host_port(cfg.ha_advertise) is None:
        raise UsageError("--ha-advertise takes HOST:PORT")


def check_tls(cfg: ServeConfig) -> None:
    """The TLS settings fit together (the files themselves are read by server/tls.py)."""
    if cfg.tls_port is not None and (cfg.tls_cert is None or cfg.tls_key is None):
        raise UsageError("--tls-port needs --tls-cert FILE and --tls-key FILE")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    if cfg.tls_cert is not None and cfg.tls_port is None and cfg.http is None:
        raise UsageError("--tls-cert is for --tls-port PORT (or the --http console)")
    if cfg.tls_client_ca is not None and cfg.tls_cert is None:
        raise UsageError("--tls-client-ca needs --tls-cert and --tls-key")
    if not cfg.plaintext and cfg.tls_port is None and not cfg.addr.startswith("unix:"):
        raise UsageError("--no-plaintext leaves nothing to listen on: add --tls-port PORT "
                         "with --tls-cert and --tls-key")
    if (cfg.replica_tls_cert is None) != (cfg.replica_tls_key is None):
        raise UsageError("--replica-tls-cert and --replica-tls-key go together")
    if cfg.replica_of is None and not cfg.ha_etcd and (cfg.replica_tls_ca or cfg.replica_tls_cert):
        raise UsageError("--replica-tls-* are for --replica-of HOST:PORT or --ha-etcd")


def tls_address(cfg: ServeConfig) -> str:
    """Where the TLS port listens: --tls-listen, else -l's address (never a unix socket)."""
    if cfg.tls_listen is not None:
        return cfg.tls_listen
    return "127.0.0.1" if cfg.addr.startswith("unix:") else cfg.addr


def memcache_address(cfg: ServeConfig) -> str:
    """Where the memcache port listens: -l's address (never a unix socket)."""
    return "127.0.0.1" if cfg.addr.startswith("unix:") else cfg.addr


def _check_admin(cfg: ServeConfig) -> None:
    """A token file that cannot be read, or an address that is none, stops the start."""
    try:
        parse_allow(cfg.admin_allow)
        if cfg.admin_token_file is not None:
            read_token(cfg.admin_token_file)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _set_short(cfg: ServeConfig, ch: str, value: str) -> None:
    if ch == "l":
        cfg.addr = value
    elif ch == "p":
        cfg.port = _port_flag(value, "-p")
    elif ch == "z":
        cfg.max_job_size = _as_key("max-job-size", value, "-z")
    elif ch == "b":
        cfg.data_dir = Path(value)
    elif ch == "f":
        ms = _int(value, "-f")
        cfg.fsync = FSYNC_ALWAYS if ms == 0 else FSYNC_INTERVAL
        cfg.fsync_interval = ms / 1000
    elif ch == "s":
        cfg.segment_bytes = _as_key("segment-bytes", value, "-s")
    elif ch == "u":
        cfg.user = value
    elif ch == "F":
        cfg.fsync = FSYNC_NEVER
    elif ch == "V":
        cfg.verbose += 1


def _set_long(cfg: ServeConfig, name: str, value: str) -> None:
    if name == "--data-dir":
        cfg.data_dir = Path(value)
    elif name == "--fsync":
        if value not in FSYNC_MODES:
            raise UsageError("--fsync takes always, everysec or never")
        cfg.fsync = FSYNC_MODES[value]
    elif name == "--fsync-interval":
        cfg.fsync_interval = _as_key("fsync-interval", value, name)
    elif name == "--segment-records":
        cfg.segment_records = _as_key("segment-records", value, name)
    elif name == "--segment-bytes":
        cfg.segment_bytes = _as_key("segment-bytes", value, name)
    elif name == "--compact-interval":
        cfg.compact_interval = _as_key("compact-interval", value, name)
    elif name == "--compact-segments":
        cfg.compact_segments = _as_key("compact-segments", value, name)
    elif name == "--no-compact":
        cfg.compact = False
    elif name == "--no-plaintext":
        cfg.plaintext = False
    elif name == "--tls-port":
        cfg.tls_port = _port_flag(value, name)
    elif name == "--memcache-port":
        cfg.memcache_port = _port_flag(value, name)
    elif name == "--tls-listen":
        if value.startswith("unix:"):
            raise UsageError("--tls-listen takes an IP address or host name: a unix "
                             "socket stays plaintext (use -l unix:PATH)")
        cfg.tls_listen = value
    elif name == "--tls-handshake-timeout":
        cfg.tls_handshake_timeout = _as_key("tls-handshake-timeout", value, name)
    elif name in PATH_OPTIONS:
        setattr(cfg, PATH_OPTIONS[name], Path(value))
    elif name == "--extended-stats":
        cfg.extended_stats = True
    elif name == "--admin-token-file":
        cfg.admin_token_file = Path(value).absolute()
    elif name == "--admin-allow":
        try:
            cfg.admin_allow = _cidrs(value, name)
        except ConfigError as e:
            raise UsageError(str(e)) from None
    elif name == "--keep-segments-hours":
        cfg.keep_hours = _as_key("keep-segments-hours", value, name)
    elif name == "--keep-segments-bytes":
        cfg.keep_bytes = _as_key("keep-segments-bytes", value, name)
    elif name == "--replica-of":
        cfg.replica_of = _host_port(value)
        if cfg.replica_of is None:
            raise UsageError("--replica-of takes HOST:PORT")
    elif name == "--min-replica-acks":
        cfg.min_replica_acks = _as_key("min-replica-acks", value, name)
    elif name == "--replica-ack-timeout":
        cfg.replica_ack_timeout = _as_key("replica-ack-timeout", value, name)
    elif name == "--ha-etcd":
        cfg.ha_etcd = tuple(u.strip() for u in value.split(",") if u.strip())
    elif name in ("--ha-cluster", "--ha-name", "--ha-advertise"):
        if not value or "/" in value:
            raise UsageError(f"{name} takes a name without '/'")
        setattr(cfg, name[2:].replace("-", "_"), value)
    elif name == "--ha-ttl":
        cfg.ha_ttl = _int(value, name)
    elif name == "--ha-max-lag":
        cfg.ha_max_lag = _int(value, name)
    elif name == "--listen":
        cfg.addr = value
    elif name == "--port":
        cfg.port = _port_flag(value, name)
    elif name == "--max-job-size":
        cfg.max_job_size = _as_key("max-job-size", value, name)
    elif name == "--http":
        cfg.http = _host_port(value)
        if cfg.http is None:
            raise UsageError("--http takes ADDR:PORT (e.g. 127.0.0.1:11380)")
    elif name == "--max-connections":
        cfg.max_connections = _as_key("max-connections", value, name)
    elif name == "--max-memory":
        cfg.max_memory = _as_key("max-memory", value, name)


def _cidrs(value: object, where: str) -> tuple[str, ...]:
    """"CIDR,CIDR" (a flag, or the file's string), or the file's list of strings."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{where}: expected \"CIDR,...\" or a list of CIDRs, got {value!r}")
    out = tuple(i.strip() for i in items if i.strip())
    try:
        parse_allow(out)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    return out


def _as_key(key: str, text: str, flag: str) -> Any:
    """A flag's value read as the `[server]` key of the same name reads it, so
    each flag takes what the file takes ("64MB", "10s", 1.5) and means the
    same: digits are a number, as TOML would give them, anything else a string."""
    value: object = text
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            pass
    try:
        return SERVER_KEYS[key][1](value, flag)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _host_port(text: str) -> tuple[str, int] | None:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        return None
    return host, int(port)


# --- the configuration file ---------------------------------------------------------


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: expected a whole number >= 0, got {value!r}")
    return value


def _seconds(value: object, where: str) -> float:
    """A number of seconds (int or float), or a duration string like "2m"."""
    if isinstance(value, float) and not isinstance(value, bool):
        if not value >= 0:
            raise ConfigError(f"{where}: must not be negative")
        return value
    return float(parse_duration(value, where))


def _hours(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{where}: expected a number of hours >= 0, got {value!r}")
    return float(value)


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _port(value: object, where: str) -> int:
    if _count(value, where) > 65535:
        raise ConfigError(f"{where}: expected a port number up to 65535, got {value!r}")
    return value  # type: ignore[return-value]


def _fsync(value: object, where: str) -> str:
    if value not in FSYNC_MODES:
        raise ConfigError(f"{where}: expected \"always\", \"everysec\" or \"never\", got {value!r}")
    return FSYNC_MODES[value]  # type: ignore[index]


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _tls_listen(value: object, where: str) -> str:
    text = _text(value, where)
    if text.startswith("unix:"):
        raise ConfigError(f"{where}: a unix socket stays plaintext: expected an address")
    return text


def _replica_of(value: object, where: str) -> tuple[str, int]:
    hp = _host_port(value) if isinstance(value, str) else None
    if hp is None:
        raise ConfigError(f"{where}: expected \"HOST:PORT\", got {value!r}")
    return hp


# [server] key -> (ServeConfig attribute, converter(value, where) -> value).
# The keys are the long options' names; data-dir is handled by load_file
# (relative to the file's directory).
SERVER_KEYS: dict[str, tuple[str, Callable[[object, str], Any]]] = {
    "listen": ("addr", _text),
    "port": ("port", _port),
    "max-job-size": ("max_job_size",
                     lambda v, w: min(parse_size(v, w), protocol.MAX_JOB_SIZE_LIMIT)),
    "data-dir": ("data_dir", _text),
    "fsync": ("fsync", _fsync),
    "fsync-interval": ("fsync_interval", lambda v, w: _count(v, w) / 1000),
    "segment-records": ("segment_records", lambda v, w: max(_count(v, w), 1)),
    "segment-bytes": ("segment_bytes", lambda v, w: max(parse_size(v, w), 4096)),
    "compact-interval": ("compact_interval", _seconds),
    "compact-segments": ("compact_segments", lambda v, w: max(_count(v, w), 1)),
    "compact": ("compact", _bool),
    "keep-segments-hours": ("keep_hours", _hours),
    "keep-segments-bytes": ("keep_bytes", parse_size),
    "replica-of": ("replica_of", _replica_of),
    "min-replica-acks": ("min_replica_acks", _count),
    "replica-ack-timeout": ("replica_ack_timeout", _seconds),
    "max-memory": ("max_memory", parse_size),
    "max-connections": ("max_connections", lambda v, w: max(_count(v, w), 1)),
    "http": ("http", _replica_of),
    "tls-port": ("tls_port", _port),
    "memcache-port": ("memcache_port", _port),
    "tls-listen": ("tls_listen", _tls_listen),
    "tls-cert": ("tls_cert", _text),
    "tls-key": ("tls_key", _text),
    "tls-client-ca": ("tls_client_ca", _text),
    "tls-handshake-timeout": ("tls_handshake_timeout", _seconds),
    "plaintext": ("plaintext", _bool),
    "replica-tls-ca": ("replica_tls_ca", _text),
    "replica-tls-cert": ("replica_tls_cert", _text),
    "replica-tls-key": ("replica_tls_key", _text),
    "admin-token-file": ("admin_token_file", _text),
    "admin-allow": ("admin_allow", _cidrs),
    "extended-stats": ("extended_stats", _bool),
}

# Flags whose [server] keys are not their own names: beanstalkd's short flags
# and the switches (every other long option sets the key of its name).
FLAG_KEYS = {"-l": ("listen",), "-p": ("port",), "-z": ("max-job-size",), "-b": ("data-dir",),
             "-f": ("fsync", "fsync-interval"), "-F": ("fsync",), "-s": ("segment-bytes",),
             "-u": (), "-V": (), "--no-compact": ("compact",), "--no-plaintext": ("plaintext",)}

# Keys that name files or directories: relative to the configuration file's directory.
PATH_KEYS = {"data-dir", "admin-token-file", "tls-cert", "tls-key", "tls-client-ca",
             "replica-tls-ca", "replica-tls-cert", "replica-tls-key"}

def server_settings(doc: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The `[server]` table as {TOML key: converted value}; ConfigError names file and key."""
    table = doc.get("server", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: server: expected a table")
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in SERVER_KEYS:
            raise ConfigError(f"{path}: server: unknown key {key!r} "
                              f"(known: {', '.join(SERVER_KEYS)})")
        where = f"{path}: server.{key}"
        out[key] = SERVER_KEYS[key][1](value, where)
        if key in PATH_KEYS:  # relative to the file, not to wherever the server starts
            out[key] = path.parent / out[key]
    return out


def _etcd_urls(value: object, where: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{where}: expected \"URL,...\" or a list of URLs, got {value!r}")
    return tuple(i.strip() for i in items if i.strip())


# [ha] key -> (ServeConfig attribute, converter): the --ha-* flags' names.
HA_KEYS: dict[str, tuple[str, Callable[[object, str], Any]]] = {
    "etcd": ("ha_etcd", _etcd_urls),
    "cluster": ("ha_cluster", _text),
    "name": ("ha_name", _text),
    "advertise": ("ha_advertise", _text),
    "ttl": ("ha_ttl", lambda v, w: int(_seconds(v, w))),
    "max-lag": ("ha_max_lag", _count),
}


def ha_settings(doc: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The `[ha]` table as {"ha." + key: converted value}."""
    table = doc.get("ha", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: ha: expected a table")
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in HA_KEYS:
            raise ConfigError(f"{path}: ha: unknown key {key!r} (known: {', '.join(HA_KEYS)})")
        out["ha." + key] = HA_KEYS[key][1](value, f"{path}: ha.{key}")
    return out


def read_file(path: Path) -> tuple[dict[str, Any], Policies]:
    """A configuration file's `[server]` and `[ha]` settings and tube policies, checked."""
    doc = read_toml(path)
    policies = policies_from(doc, str(path))  # also checks the top-level tables
    return {**server_settings(doc, path), **ha_settings(doc, path)}, policies


def load_file(cfg: ServeConfig, path: Path) -> None:
    """Fill `cfg` from a configuration file (flags are applied over it afterwards)."""
    path = path.absolute()
    try:
        settings, policies = read_file(path)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    for key, value in settings.items():
        attr = HA_KEYS[key[3:]][0] if key.startswith("ha.") else SERVER_KEYS[key][0]
        setattr(cfg, attr, value)
    cfg.config_path = path
    cfg.policies = policies
    cfg.file_settings = settings


def server_changes(cfg: ServeConfig) -> list[str]:
    """The `[server]` keys whose value in the file now differs from the file at start.

    Raises ConfigError when the file cannot be read or its `[server]` table
    is wrong.
    """
    if cfg.config_path is None:
        return []
    doc = read_toml(cfg.config_path)
    now = {**server_settings(doc, cfg.config_path), **ha_settings(doc, cfg.config_path)}
    before = cfg.file_settings
    keys = [*SERVER_KEYS, *("ha." + k for k in HA_KEYS)]
    return [k for k in keys if now.get(k) != before.get(k)]
