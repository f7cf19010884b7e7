"""The `smallstalk` command: serve, and the operator tools.

`smallstalk serve` takes beanstalkd's own flags with the same meaning, so the
binary can be swapped into a service file or a client library's test set-up;
`smallstalk -l ADDR -p PORT ...` (flags and no subcommand) is `serve` too.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys

import trio

from smallstalk.config import (
    SERVE_HELP,
    VERSION,
    ServeConfig,
    UsageError,
    parse_serve,
    server_changes,
)
from smallstalk.core import records as r
from smallstalk.core.state import State
from smallstalk.launch import listen_address
from smallstalk.replication.feed import new_history
from smallstalk.replication.follower import Follower
from smallstalk.server.connection import open_listeners, serve_listeners
from smallstalk.server.loop import MutationLoop
from smallstalk.server.policy import ConfigError
from smallstalk.storage import compactor
from smallstalk.storage.aof import FSYNC_INTERVAL
from smallstalk.storage.bodies import BodyStore
from smallstalk.storage.journal import Journal
from smallstalk.storage.recovery import recover

log = logging.getLogger("smallstalk")

MAIN_HELP = """\
Usage: smallstalk COMMAND [ARGS]

Commands:
  serve         run the server (see `smallstalk serve -h`); beanstalkd's
                flags without a command also serve
  promote       promote HOST:PORT: turn a replica into a primary
  config        config dump: the effective per-tube settings, from a
                --config FILE or a running --server HOST:PORT
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
    "aof": "smallstalk.ops.tools:main_aof",
    "replay": "smallstalk.ops.tools:main_replay",
    "job-history": "smallstalk.ops.tools:main_job_history",
    "analyze": "smallstalk.analytics:main",
    "worker": "smallstalk.worker:main",
    "config": "smallstalk.ops.config_dump:main",
}


def _drop_privileges(user: str) -> None:
    import pwd

    pw = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)


async def serve(cfg: ServeConfig, listen_socket=None) -> None:
    """Run the server; `listen_socket` is one launch.py already bound."""
    console = None
    if cfg.http is not None:  # the optional extra, imported before clients are served
        from smallstalk.console import app as console
    journal = None
    if cfg.data_dir is not None:
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        started = trio.current_time()
        # Read-behind: bodies past --max-memory (or a tube's max-memory) stay on disk.
        pol = cfg.policies
        bodies = BodyStore(cfg.max_memory, (lambda tube: pol.of(tube).max_memory)
                           if pol.has_memory_budgets() else None)
        # What recovery loads lives long: frozen, the cyclic collector's full
        # passes do not walk it again and again (they stall the loop). Frozen
        # before the collector is back on: it would first sweep every object
        # recovery made, all still in its youngest generation (~0.3 s for 1M jobs).
        gc.disable()
        try:
            rec = recover(cfg.data_dir, bodies=bodies)
            gc.freeze()
        finally:
            gc.enable()
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
        if cfg.max_memory:
            log.warning("--max-memory needs a data directory to read bodies back from: "
                        "every body stays in memory")
    lp = MutationLoop(state, journal, cfg.data_dir, max_job_size=cfg.max_job_size,
                      min_replica_acks=cfg.min_replica_acks,
                      replica_ack_timeout=cfg.replica_ack_timeout)
    lp.policies = cfg.policies
    if journal is not None:
        lp.use_bodies(bodies)
    lp.config_path = cfg.config_path
    if cfg.config_path is not None:
        log.info("configuration from %s (tube policies: default and %d named tubes)",
                 cfg.config_path, len(cfg.policies.tubes))
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
            await nursery.start(_signals, nursery.cancel_scope, lp, cfg)
            if listen_socket is not None:
                listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(listen_socket))]
            else:
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
                                   compactor.retention(cfg.keep_hours, cfg.keep_bytes), lp)
            if journal is not None and cfg.fsync == FSYNC_INTERVAL:
                nursery.start_soon(journal.run_interval_sync)
            if console is not None:
                await nursery.start(console.serve, lp, cfg)
    finally:
        if journal is not None:
            journal.close()


async def _signals(scope: trio.CancelScope, lp: MutationLoop, cfg: ServeConfig | None = None,
                   *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                   signal.SIGHUP) as sigs:
        task_status.started()
        # A reload waits for a loop turn; it must not hold up a SIGTERM behind it.
        async with trio.open_nursery() as reloads:
            async for sig in sigs:
                if sig == signal.SIGUSR1:
                    lp.draining = True
                    log.info("drain mode: new jobs are refused")
                elif sig == signal.SIGHUP:
                    reloads.start_soon(_reload, lp, cfg)
                else:
                    log.info("shutting down")
                    scope.cancel()
                    return


async def _reload(lp: MutationLoop, cfg: ServeConfig | None) -> None:
    """SIGHUP: re-read the tube tables; [server] settings only take effect on a restart."""
    log.info("SIGHUP: reloading the tube policies")
    err = await lp.call(lp.reload_config)  # logs the outcome (and why a file failed)
    if err is not None:
        log.error("SIGHUP: the old tube policies stay in force%s",
                  "" if lp.config_path else f": {err}")
        return
    # The [server] table is read at start only.
    if cfg is None or cfg.config_path is None:
        return
    try:
        changed = server_changes(cfg)
    except ConfigError as e:
        log.warning("SIGHUP: the [server] table would not start a server: %s", e)
        return
    if changed:
        log.warning("SIGHUP: [server] settings changed in %s (%s): they take effect "
                    "only on a restart", cfg.config_path, ", ".join(changed))


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


def _early_socket_fits(argv: list[str], cfg: ServeConfig) -> bool:
    """Is launch.py's socket, bound from the flags alone, the one `cfg` asks for?

    Not when a --config file names another listen address or port.
    """
    early = listen_address(argv)
    if early is None:
        return False
    if cfg.addr.startswith("unix:"):
        return early[0] == cfg.addr
    return early == (cfg.addr, cfg.port)


def _setup_logging(verbose: int) -> None:
    level = logging.INFO if verbose == 0 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(argv: list[str] | None = None, listen_socket=None) -> int:
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
            if listen_socket is not None and not _early_socket_fits(rest, cfg):
                listen_socket.close()
                listen_socket = None
            if cfg.http is not None:
                from smallstalk.console import preflight

                why = preflight(cfg.http)
                if why:
                    print(f"smallstalk: {why}", file=sys.stderr)
                    return 5
            _setup_logging(cfg.verbose)
            try:
                trio.run(serve, cfg, listen_socket)
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
