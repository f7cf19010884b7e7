"""The `smallstalk` command: serve, and the operator tools.

`smallstalk serve` takes beanstalkd's own flags with the same meaning, so the
binary can be swapped into a service file or a client library's test set-up;
`smallstalk -l ADDR -p PORT ...` (flags and no subcommand) is `serve` too.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import attrs
import trio

from . import compactor, protocol
from . import records as r
from .journal import FSYNC_ALWAYS, FSYNC_INTERVAL, FSYNC_NEVER, Journal
from .loop import MutationLoop
from .recovery import recover
from .replica import Follower
from .replication import new_history
from .server import open_listeners, serve_listeners
from .state import State

VERSION = "0.1.0"
log = logging.getLogger("smallstalk")

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

MAIN_HELP = """\
Usage: smallstalk COMMAND [ARGS]

Commands:
  serve         run the server (see `smallstalk serve -h`); beanstalkd's
                flags without a command also serve
  promote       promote HOST:PORT: turn a replica into a primary
  aof           inspect a data directory: aof ls | dump | verify
  replay        rebuild the state as it was at a sequence number or time
  job-history   the whole life of one job as a timeline
  analyze       job analytics over AOF archives on Spark (smallstalk[analytics])
  worker        run tasks from tubes (smallstalk.worker)
  help          this text

`smallstalk COMMAND -h` explains a command; `python -m smallstalk` is the same.
"""

# Commands that live in their own modules: "module:function", imported on use
# so the server never loads the tools (or PySpark) it does not need.
TOOL_COMMANDS = {
    "aof": "smallstalk.tools:main_aof",
    "replay": "smallstalk.tools:main_replay",
    "job-history": "smallstalk.tools:main_job_history",
    "analyze": "smallstalk.analytics:main",
    "worker": "smallstalk.worker:main",
}


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


def _drop_privileges(user: str) -> None:
    import pwd

    pw = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)


async def serve(cfg: ServeConfig) -> None:
    journal = None
    if cfg.data_dir is not None:
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        started = trio.current_time()
        rec = recover(cfg.data_dir)
        for w in rec.warnings:
            log.warning("%s", w)
        state = rec.state
        log.info("recovered %d jobs (snapshot %s + %d records) in %.2fs",
                 len(state.jobs), rec.snapshot.name if rec.snapshot else "none",
                 rec.records_replayed, trio.current_time() - started)
        journal = Journal(cfg.data_dir, state.last_seq + 1, cfg.fsync, cfg.fsync_interval,
                          cfg.segment_records, cfg.segment_bytes)
    else:
        state = State()
        log.warning("no data directory: jobs are kept in memory only "
                    "(use -b DIR or --data-dir DIR to persist them)")
    lp = MutationLoop(state, journal, cfg.data_dir, max_job_size=cfg.max_job_size,
                      min_replica_acks=cfg.min_replica_acks,
                      replica_ack_timeout=cfg.replica_ack_timeout)
    follower = None
    if cfg.replica_of:
        # A replica logs only what its primary sends, with the primary's seqs.
        follower = Follower(lp, *cfg.replica_of)
        lp.role, lp.follower = "replica", follower
        lp.read_only = "replica"
    elif journal is not None:
        if not state.epochs:  # a fresh log gets its own history id
            lp.log(r.NewEpoch, 1, new_history())
        lp.log(r.Restart)  # connections of an earlier run are gone
        await journal.commit()
    try:
        async with trio.open_nursery() as nursery:
            # Signals first: a SIGUSR1 or SIGTERM right after the port opens must
            # be handled, not kill the process.
            await nursery.start(_signals, nursery.cancel_scope, lp)
            listeners = await open_listeners(cfg.addr, cfg.port)
            if cfg.user:
                _drop_privileges(cfg.user)
            where = cfg.addr if cfg.addr.startswith("unix:") else f"{cfg.addr}:{cfg.port}"
            log.info("smallstalk %s listening on %s (fsync %s%s)", VERSION, where,
                     cfg.fsync if journal else "n/a, in memory",
                     f", replica of {cfg.replica_of[0]}:{cfg.replica_of[1]}"
                     if cfg.replica_of else "")
            nursery.start_soon(lp.run)
            nursery.start_soon(serve_listeners, lp, listeners, cfg.max_job_size)
            if follower is not None:
                nursery.start_soon(follower.run)
            if journal is not None and cfg.compact:
                nursery.start_soon(compactor.run, journal, cfg.data_dir, cfg.compact_interval,
                                   cfg.compact_segments,
                                   compactor.retention(cfg.keep_hours, cfg.keep_bytes))
            if journal is not None and cfg.fsync == FSYNC_INTERVAL:
                nursery.start_soon(journal.run_interval_sync)
    finally:
        if journal is not None:
            journal.close()


async def _signals(scope: trio.CancelScope, lp: MutationLoop,
                   *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as sigs:
        task_status.started()
        async for sig in sigs:
            if sig == signal.SIGUSR1:
                lp.draining = True
                log.info("drain mode: new jobs are refused")
            else:
                log.info("shutting down")
                scope.cancel()
                return


def promote_command(argv: list[str]) -> int:
    """`smallstalk promote HOST:PORT`: tell a replica to take over."""
    import socket

    if len(argv) != 1 or ":" not in argv[0]:
        print("usage: smallstalk promote HOST:PORT", file=sys.stderr)
        return 2
    host, _, port = argv[0].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"promote\r\n")
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    text = reply.decode(errors="replace").strip()
    print(text)
    return 0 if text.startswith("PROMOTED") else 1


def _setup_logging(verbose: int) -> None:
    level = logging.INFO if verbose == 0 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") and argv[0] not in ("--help",):
        command, rest = "serve", argv
    else:
        command, rest = argv[0], argv[1:]
    try:
        if command == "serve":
            cfg = parse_serve(rest)
            if isinstance(cfg, str):
                print(cfg)
                return 0
            if (cfg.replica_of or cfg.min_replica_acks) and cfg.data_dir is None:
                raise UsageError("replication needs a data directory (-b DIR or --data-dir DIR)")
            _setup_logging(cfg.verbose)
            try:
                trio.run(serve, cfg)
            except KeyboardInterrupt:
                pass
            return 0
        if command in ("help", "--help", "-h"):
            print(MAIN_HELP)
            return 0
        if command == "promote":
            return promote_command(rest)
        if command in TOOL_COMMANDS:
            import importlib

            module, func = TOOL_COMMANDS[command].split(":")
            return getattr(importlib.import_module(module), func)(rest)
        raise UsageError(f"unknown command: {command}")
    except UsageError as e:
        print(f"smallstalk: {e}\n", file=sys.stderr)
        print(SERVE_HELP if command == "serve" else MAIN_HELP, file=sys.stderr)
        return 5 if command == "serve" else 2
