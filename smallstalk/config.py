"""Server configuration: beanstalkd's flags and smallstalk's own, parsed.

Kept free of trio and the server modules so that `smallstalk serve` can parse
its flags and open its listening socket within a few milliseconds of
starting (see launch.py): client test set-ups that start a server and connect
after 0.1 s must not find the port closed.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from . import protocol
from .aof import FSYNC_ALWAYS, FSYNC_INTERVAL, FSYNC_NEVER

VERSION = "0.1.0"

SERVE_HELP = """\
Usage: smallstalk serve [OPTIONS]     (or: smallstalk [beanstalkd flags])

Serve the beanstalkd protocol. Without a data directory jobs live in memory
only; with one, every acknowledged change is in the append-only file first.

beanstalkd's flags, same meaning:
 -l ADDR   listen on address, or unix:PATH for a Unix socket
           (default 127.0.0.1; beanstalkd's default is 0.0.0.0)
 -p PORT   listen on port (default 11300)
 -z BYTES  maximum job size in bytes (default 65535, at most 1073741824)
 -b DIR    data directory: turns persistence on (same as --data-dir)
 -f MS     fsync at most every MS milliseconds; -f0 fsyncs before every reply
 -F        never fsync (the kernel writes back when it likes)
 -s BYTES  size at which an AOF segment is closed (same as --segment-bytes)
 -u USER   become this user after opening the listeners
 -V        more log output (repeat for more)
 -v        print the version and exit
 -h        this help

smallstalk's own:
 --data-dir DIR          same as -b
 --fsync MODE            always (default: INSERTED means on disk), everysec, never
 --fsync-interval MS     the interval for everysec (default 1000)
 --segment-records N     close a segment after N records (default 100000)
 --segment-bytes BYTES   close a segment at this size (default 16777216)
 --compact-interval SEC  fold closed segments into a snapshot this often (default 10)
 --compact-segments N    ...or as soon as N segments are closed (default 4)
 --no-compact            never compact (the AOF keeps every record)
 --keep-segments-hours H keep folded segments for H hours (for the replay tools)
 --keep-segments-bytes B ...and/or at most B bytes of them, newest first

Replication (needs a data directory; see the README):
 --replica-of HOST:PORT  follow that primary as a read-only hot standby
 --min-replica-acks N    answer changes only once N replicas have them on disk
                         (default 0: asynchronous)
 --replica-ack-timeout S how long to wait for those acks before answering
                         NOT_REPLICATED (default 5)
"""

class UsageError(Exception):
    pass


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


def _int(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"invalid number for {flag}: {text}") from None
    if value < 0:
        raise UsageError(f"{flag} must not be negative")
    return value


LONG_OPTIONS = {
    "--data-dir", "--fsync", "--fsync-interval", "--segment-records", "--segment-bytes",
    "--compact-interval", "--compact-segments", "--keep-segments-hours",
    "--keep-segments-bytes", "--replica-of", "--min-replica-acks", "--replica-ack-timeout",
    "--listen", "--port", "--max-job-size",
}


def parse_serve(argv: list[str]) -> ServeConfig | str:
    """Parse serve's flags; returns a config, or text to print and exit 0."""
    cfg = ServeConfig()
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if name in ("--help",):
                return SERVE_HELP
            if name == "--no-compact":
                cfg.compact = False
                continue
            if name == "--version":
                return f"smallstalk {VERSION}"
            if name not in LONG_OPTIONS:
                raise UsageError(f"unknown option: {arg}")
            if not eq:
                if not args:
                    raise UsageError(f"option requires an argument: {name}")
                value = args.pop(0)
            _set_long(cfg, name, value)
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
                _set_short(cfg, ch, value)
            elif ch == "F":
                cfg.fsync = FSYNC_NEVER
            elif ch == "V":
                cfg.verbose += 1
            elif ch == "v":
                return f"smallstalk {VERSION}"
            elif ch == "h":
                return SERVE_HELP
            elif ch in "cn":
                pass  # removed in beanstalkd too (compaction is always on)
            else:
                raise UsageError(f"unknown flag: -{ch}")
    return cfg


def _set_short(cfg: ServeConfig, ch: str, value: str) -> None:
    if ch == "l":
        cfg.addr = value
    elif ch == "p":
        cfg.port = _int(value, "-p")
    elif ch == "z":
        cfg.max_job_size = min(_int(value, "-z"), protocol.MAX_JOB_SIZE_LIMIT)
    elif ch == "b":
        cfg.data_dir = Path(value)
    elif ch == "f":
        ms = _int(value, "-f")
        cfg.fsync = FSYNC_ALWAYS if ms == 0 else FSYNC_INTERVAL
        cfg.fsync_interval = ms / 1000
    elif ch == "s":
        cfg.segment_bytes = max(_int(value, "-s"), 4096)
    elif ch == "u":
        cfg.user = value


def _set_long(cfg: ServeConfig, name: str, value: str) -> None:
    if name == "--data-dir":
        cfg.data_dir = Path(value)
    elif name == "--fsync":
        modes = {"always": FSYNC_ALWAYS, "everysec": FSYNC_INTERVAL, "never": FSYNC_NEVER}
        if value not in modes:
            raise UsageError("--fsync takes always, everysec or never")
        cfg.fsync = modes[value]
    elif name == "--fsync-interval":
        cfg.fsync_interval = _int(value, name) / 1000
    elif name == "--segment-records":
        cfg.segment_records = max(_int(value, name), 1)
    elif name == "--segment-bytes":
        cfg.segment_bytes = max(_int(value, name), 4096)
    elif name == "--compact-interval":
        cfg.compact_interval = float(value)
    elif name == "--compact-segments":
        cfg.compact_segments = max(_int(value, name), 1)
    elif name == "--keep-segments-hours":
        cfg.keep_hours = float(value)
    elif name == "--keep-segments-bytes":
        cfg.keep_bytes = _int(value, name)
    elif name == "--replica-of":
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit():
            raise UsageError("--replica-of takes HOST:PORT")
        cfg.replica_of = (host, int(port))
    elif name == "--min-replica-acks":
        cfg.min_replica_acks = _int(value, name)
    elif name == "--replica-ack-timeout":
        cfg.replica_ack_timeout = float(value)
    elif name == "--listen":
        cfg.addr = value
    elif name == "--port":
        cfg.port = _int(value, name)
    elif name == "--max-job-size":
        cfg.max_job_size = min(_int(value, name), protocol.MAX_JOB_SIZE_LIMIT)


