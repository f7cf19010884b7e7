"""The `smallstalk` command: serve, and the operator tools.

`smallstalk serve` takes beanstalkd's own flags with the same meaning, so the
binary can be swapped into a service file or a client library's test set-up;
`smallstalk -l ADDR -p PORT ...` (flags and no subcommand) is `serve` too.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import socket
import ssl
import sys
from pathlib import Path

import trio

from smallstalk import __version__, listen
from smallstalk.config import (
    ServeConfig,
    memcache_address,
    parse_serve,
    server_changes,
    tls_address,
)
from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.state import BUILD, State
from smallstalk.replication.feed import Hooks, new_history
from smallstalk.server import tls
from smallstalk.server.admin import AdminPolicy, parse_allow, read_token
from smallstalk.server.connection import serve_listeners
from smallstalk.server.loop import MutationLoop
from smallstalk.server.policy import ConfigError
from smallstalk.storage import datadir
from smallstalk.storage.aof import FSYNC_INTERVAL, CorruptionError, make_dirs
from smallstalk.storage.bodies import BodyStore
from smallstalk.storage.journal import Journal
from smallstalk.usage import EXIT_USAGE, UsageError

log = logging.getLogger("smallstalk")

MAIN_HELP = """\
Usage: smallstalk COMMAND [ARGS]

Commands:
  serve         run the server (see `smallstalk serve -h`); beanstalkd's
                flags without a command also serve
  promote       promote [--token-file FILE] HOST:PORT: turn a replica into a primary
  ha            ha status | switchover [--to NODE] | pause | resume: an HA
                cluster (--ha-etcd; smallstalk[ha], docs/HA.md)
  config        config dump: the effective per-tube settings, from a
                --config FILE or a running --server HOST:PORT
  aof           inspect a data directory: aof ls | dump | verify
  backup        backup DIR DEST: a consistent copy of a live data directory
  replay        rebuild the state as it was at a sequence number or time
  job-history   the whole life of one job as a timeline
  explain       explain HOST:PORT ID: why a job is (or is not) handed out now
  search        search HOST:PORT TUBE PATTERN: find jobs by body or key;
                count, then kick, delete or move them
  analyze       job analytics over AOF archives on Spark (smallstalk[analytics])
  worker        run tasks from tubes (smallstalk.worker)
  help          this text

`smallstalk COMMAND -h` explains a command; `python -m smallstalk` is the same.
"""

# Commands that live in their own modules: "module:function", imported on use
# so the server never loads the tools (or PySpark) it does not need.
TOOL_COMMANDS = {
    "aof": "smallstalk.ops.aof:main",
    "backup": "smallstalk.ops.backup:main",
    "replay": "smallstalk.ops.replay:main",
    "job-history": "smallstalk.ops.job_history:main",
    "explain": "smallstalk.ops.explain:main",
    "search": "smallstalk.ops.search:main",
    "analyze": "smallstalk.analytics:main",
    "worker": "smallstalk.worker:main",
    "config": "smallstalk.ops.config_dump:main",
    "ha": "smallstalk.replication.hactl:main",
}


# Optional dependencies -> the extra that installs them.
EXTRAS = {"pyspark": "analytics", "pyarrow": "analytics", "httpx": "ha"}

# beanstalkd's exit statuses for the same mistakes.
EXIT_LISTEN, EXIT_USER = 111, 32


class StartError(Exception):
    """An operator's mistake found at start: one line to print, and the exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def _drop_privileges(user: str) -> None:
    import pwd

    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise StartError(f"-u {user}: no such user", EXIT_USER) from None
    try:
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
    except PermissionError:
        raise StartError(f"-u {user}: only root can become another user", EXIT_USER) from None


def _check_data_dir(path: Path) -> None:
    """The data directory exists (made if need be), is a directory, and is ours to write."""
    if path.exists() and not path.is_dir():
        raise StartError(f"data directory {path} is a file, not a directory (-b DIR)")
    if path.is_symlink() and not path.exists():
        raise StartError(f"data directory {path} is a link to {os.readlink(path)}, which does "
                         "not exist: create that directory, or give -b another")
    make_dirs(path)  # made durably: each new directory's entry fsynced into its parent
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartError(f"data directory {path}: not writable by {_whoami()}: "
                         "chown it to the server's user (see -u)")


def _whoami() -> str:
    import pwd

    try:
        return f"user {pwd.getpwuid(os.getuid()).pw_name}"
    except KeyError:
        return f"uid {os.getuid()}"


async def serve(cfg: ServeConfig, sockets: list[socket.socket],
                tls_sockets: list[socket.socket] | tuple = (),
                contexts: tls.Contexts | None = None,
                memcache_sockets: list[socket.socket] | tuple = ()) -> None:
    """Run the server on `sockets` (plaintext), `tls_sockets` (TLS with
    `contexts.server`) and `memcache_sockets` (kestrel's memcache protocol),
    bound already: nothing is written before they are."""
    contexts = contexts or tls.Contexts()
    console = None
    if cfg.http is not None:  # the optional extra, imported before clients are served
        from smallstalk.console import app as console
    journal = None
    lock = None
    if cfg.data_dir is not None:
        # Imported here: a server without a data directory never needs them (start-up time).
        from smallstalk.storage.recovery import recover

        # One directory, one process: taken before recovery writes anything, and
        # held until the server ends (a replica's follower runs in this process).
        lock = datadir.lock(cfg.data_dir)
        started = trio.current_time()
        # Read-behind: bodies past --max-memory (or a tube's max-memory) stay on disk.
        pol = cfg.policies
        bodies = BodyStore(cfg.max_memory, (lambda tube: pol.of(tube).max_memory)
                           if pol.memory_budgets else None)
        # What recovery loads lives long: frozen, the cyclic collector's full
        # passes do not walk it again and again (they stall the loop). Frozen
        # before the collector is back on: it would first sweep every object
        # recovery made, all still in its youngest generation (~0.3 s for 1M jobs).
        gc.disable()
        try:
            rec = recover(cfg.data_dir, bodies=bodies)
            gc.freeze()
        except BaseException:
            datadir.unlock(lock)  # damage: an in-process caller may try again after a repair
            raise
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
    token = read_token(cfg.admin_token_file) if cfg.admin_token_file else None
    member = _ha_member(lp, cfg, contexts, token) if cfg.ha_etcd else None
    lp.configure(policies=cfg.policies, config_path=cfg.config_path,
                 admin=AdminPolicy(token, parse_allow(cfg.admin_allow)),
                 extended_stats=cfg.extended_stats,
                 # server/ does not import replication/
                 replication=Hooks() if member is None else member.hooks(), ha=member)
    if journal is not None:
        lp.use_bodies(bodies)
    if cfg.config_path is not None:
        log.info("configuration from %s (tube policies: default and %d named tubes)",
                 cfg.config_path, len(cfg.policies.tubes))
    follower = None
    if member is not None:
        # It starts read-only, and follows or leads as the store's leader lock says.
        lp.become_replica(None)
        lp.fence("ha: waiting for the leader lock")
    elif cfg.replica_of:
        from smallstalk.client.security import TOKEN_ENV
        from smallstalk.replication.follower import Follower

        # A replica logs only what its primary sends, with the primary's seqs.
        # What it sends the primary first: its own admin token, or the client's variable.
        follower = Follower(lp, *cfg.replica_of, ssl_context=contexts.replica,
                            token=token or os.environ.get(TOKEN_ENV, "").strip() or None)
        lp.become_replica(follower)
    elif journal is not None:
        if not state.epochs:  # a fresh log gets its own history id
            lp.log(r.NewEpoch, 1, new_history())
        lp.log(r.Restart)  # connections of an earlier run are gone
        lp.sync_limits()
        await journal.commit()
    else:
        lp.sync_limits()  # in memory: the state takes the limits all the same
    listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in sockets]
    if contexts.server is not None:
        listeners += [tls.listener(trio.socket.from_stdlib_socket(s), contexts.server)
                      for s in tls_sockets]
    try:
        async with trio.open_nursery() as nursery:
            # Signals first: a SIGUSR1 or SIGTERM right after the server says it
            # serves must be handled, not kill the process.
            await nursery.start(_signals, nursery.cancel_scope, lp, cfg)
            if memcache_sockets:
                from smallstalk.server import memcache

                listeners += memcache.listeners(
                    [trio.socket.from_stdlib_socket(s) for s in memcache_sockets],
                    lambda: _shutdown(nursery.cancel_scope))
            where = ", ".join([listen.describe(s) for s in sockets] +
                              [f"{listen.describe(s)} (TLS)" for s in tls_sockets] +
                              [f"{listen.describe(s)} (memcache)" for s in memcache_sockets])
            log.info("smallstalk %s (%s) listening on %s (fsync %s%s)", __version__, BUILD, where,
                     cfg.fsync if journal else "n/a, in memory",
                     f", replica of {cfg.replica_of[0]}:{cfg.replica_of[1]}"
                     if cfg.replica_of else "")
            nursery.start_soon(lp.run)
            nursery.start_soon(serve_listeners, lp, listeners, cfg.max_job_size,
                               cfg.tls_handshake_timeout, cfg.max_connections)
            if follower is not None:
                nursery.start_soon(follower.run)
            if member is not None:
                nursery.start_soon(member.run)
            if journal is not None and cfg.compact:
                from smallstalk.storage import compactor

                nursery.start_soon(compactor.run, journal, cfg.data_dir, cfg.compact_interval,
                                   cfg.compact_segments,
                                   compactor.retention(cfg.keep_hours, cfg.keep_bytes), lp)
            if journal is not None and cfg.fsync == FSYNC_INTERVAL:
                nursery.start_soon(journal.run_interval_sync)
            if console is not None:
                await nursery.start(console.serve, lp, cfg)
            listen.notify("READY=1")  # systemd's Type=notify: recovered, serving
    finally:
        if journal is not None:
            journal.close()
        if lock is not None:
            datadir.unlock(lock)


def _ha_member(lp: MutationLoop, cfg: ServeConfig, contexts: tls.Contexts, token: str | None):
    """The HA member (replication/ha.py) of this server."""
    try:
        from smallstalk.replication.ha import HAConfig, HAMember
    except ImportError as e:
        raise StartError(f"--ha-etcd needs {e.name}, which is not installed: install "
                         "smallstalk[ha] (pip install 'smallstalk[ha]')") from None
    from smallstalk.client.security import TOKEN_ENV

    http = f"{cfg.http[0]}:{cfg.http[1]}" if cfg.http else ""
    hc = HAConfig(list(cfg.ha_etcd), cfg.ha_cluster, cfg.ha_name, cfg.ha_advertise, http,
                  cfg.ha_ttl, cfg.ha_max_lag)
    return HAMember(lp, hc, cfg.min_replica_acks, contexts.replica,
                    token or os.environ.get(TOKEN_ENV, "").strip() or None)


async def _signals(scope: trio.CancelScope, lp: MutationLoop, cfg: ServeConfig | None = None,
                   *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                   signal.SIGHUP) as sigs:
        task_status.started()
        # A reload waits for a loop turn; it must not hold up a SIGTERM behind it.
        async with trio.open_nursery() as reloads:
            async for sig in sigs:
                if sig == signal.SIGUSR1:
                    lp.start_draining()
                    log.info("drain mode: new jobs are refused")
                elif sig == signal.SIGHUP:
                    reloads.start_soon(_reload, lp, cfg)
                else:
                    log.info("shutting down")
                    _shutdown(scope)
                    return


def _shutdown(scope: trio.CancelScope) -> None:
    """SIGTERM, SIGINT, or the memcache port's SHUTDOWN: stop serving."""
    listen.notify("STOPPING=1")
    scope.cancel()


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
    pending = [k for k in changed if k not in cfg.flag_keys]
    unused = [k for k in changed if k in cfg.flag_keys]
    if pending:
        log.warning("SIGHUP: [server] settings changed in %s (%s): they take effect "
                    "only on a restart", cfg.config_path, ", ".join(pending))
    if unused:
        log.warning("SIGHUP: [server] settings changed in %s (%s): a command-line flag "
                    "sets them, so the file's values are not used", cfg.config_path,
                    ", ".join(unused))


PROMOTE_HELP = """\
usage: smallstalk promote [--token-file FILE] [--tls-ca FILE [--tls-cert FILE
                         --tls-key FILE]] HOST:PORT

Tell the replica at HOST:PORT to become a primary: it stops following its
primary and takes writes. Prints the replica's answer; exits 0 on PROMOTED.
A replica started with --admin-token-file needs its token: from
--token-file FILE, else from $SMALLSTALK_TOKEN (never an argument: `ps`
shows those). See docs/OPERATIONS.md for the failover runbook.

HOST:PORT may be the replica's TLS port: --tls-ca FILE checks its
certificate against the CAs in FILE; --tls-cert and --tls-key present this
client's certificate to a replica with --tls-client-ca.
"""

PROMOTE_FLAGS = ("--token-file", "--tls-ca", "--tls-cert", "--tls-key")


def _promote_tls(opts: dict[str, str]) -> ssl.SSLContext | None:
    """The TLS context of `promote`'s options, or None for plaintext."""
    if not any(k in opts for k in PROMOTE_FLAGS[1:]):
        return None
    if ("--tls-cert" in opts) != ("--tls-key" in opts):
        raise UsageError("promote: --tls-cert and --tls-key go together")
    try:
        ctx = ssl.create_default_context(cafile=opts.get("--tls-ca"))
        if "--tls-cert" in opts:
            ctx.load_cert_chain(opts["--tls-cert"], opts["--tls-key"], password=lambda: b"")
    except (OSError, ValueError) as e:
        raise UsageError(f"promote: cannot load the TLS files: {e}") from None
    return ctx



def promote_command(argv: list[str]) -> int:
    """`smallstalk promote HOST:PORT`: tell a replica to take over."""
    if argv and argv[0] in ("-h", "--help"):
        print(PROMOTE_HELP, end="")
        return 0
    args = list(argv)
    opts: dict[str, str] = {}
    while args and args[0].startswith("--"):
        flag, eq, value = args.pop(0).partition("=")
        if flag not in PROMOTE_FLAGS:
            raise UsageError(f"promote: unknown option {flag}")
        if not eq:
            if not args:
                raise UsageError(f"{flag} takes a FILE")
            value = args.pop(0)
        opts[flag] = value
    token_file = opts.get("--token-file")
    if len(args) != 1:
        raise UsageError("promote takes one argument, HOST:PORT (options first)")
    host, _, port = args[0].rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"promote: not HOST:PORT: {args[0]}")
    # Imported here: the client package is not on the server's start-up path.
    from smallstalk.client import BeanstalkError, Client, CommandError, NotAReplica
    from smallstalk.client.security import token_for_tool

    try:
        token = token_for_tool(token_file)
    except ValueError as e:
        raise UsageError(str(e)) from None
    ctx = _promote_tls(opts)
    client = Client(args[0], connect_timeout=30, read_timeout=30, ssl_context=ctx, token=token)
    try:
        print(f"{p.PROMOTED_WORD.decode()} {client.promote()}")
        return 0
    except CommandError as e:
        if token is not None and e.reply == p.UNAUTHORIZED_WORD:
            # With a token the command itself is never refused: `auth` was.
            print(f"smallstalk promote: {args[0]} refused the admin token: {e.reply_line()}",
                  file=sys.stderr)
        elif isinstance(e, NotAReplica):
            print(f"smallstalk promote: {args[0]} is not a replica (NOT_A_REPLICA): it takes "
                  "writes already; give the address of a replica that follows it",
                  file=sys.stderr)
        else:
            print(e.reply_line())  # the replica's answer: UNAUTHORIZED, with what to set
        return 1
    except BeanstalkError as e:
        print(f"smallstalk promote: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _early_socket_fits(argv: list[str], cfg: ServeConfig) -> bool:
    """Are launch.py's sockets, bound from the flags alone, the ones `cfg` asks for?

    Not when a --config file names another listen address or port.
    """
    early = listen.listen_address(argv)
    if early is None:
        return False
    if cfg.addr.startswith("unix:"):
        return early[0] == cfg.addr
    return early == (cfg.addr, cfg.port)


def _listen_sockets(argv: list[str], cfg: ServeConfig,
                    early: list[socket.socket] | None) -> list[socket.socket]:
    """systemd's sockets, else launch.py's early ones if they fit, else bound now."""
    passed = listen.systemd_sockets()
    plaintext = cfg.plaintext or cfg.addr.startswith("unix:")  # a unix socket stays
    if early and (passed or not plaintext or not _early_socket_fits(argv, cfg)):
        for sock in early:
            sock.close()
        early = None
    if passed:
        log.info("serving the %d socket(s) systemd passed in (-l/-p ignored)", len(passed))
        return passed
    if not plaintext:
        return []
    return early or listen.bind(cfg.addr, cfg.port)


def _setup_logging(verbose: int) -> None:
    level = logging.INFO if verbose == 0 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def serve_command(argv: list[str], early: list[socket.socket] | None = None) -> int:
    """`smallstalk serve`: bind (or take systemd's sockets), become -u, then recover and serve."""
    cfg = parse_serve(argv)
    if isinstance(cfg, str):
        print(cfg)
        return 0
    if (cfg.replica_of or cfg.min_replica_acks or cfg.ha_etcd) and cfg.data_dir is None:
        raise UsageError("replication needs a data directory (-b DIR or --data-dir DIR)")
    if cfg.http is not None:
        from smallstalk.console import preflight

        refused = preflight(cfg.http)
        if refused:
            why, address = refused
            print(f"smallstalk: {why}", file=sys.stderr)
            return EXIT_LISTEN if address else 5
    _setup_logging(cfg.verbose)
    try:
        contexts = tls.contexts_for(cfg)
        sockets = _listen_sockets(argv, cfg, early)
        tls_sockets = [] if cfg.tls_port is None else \
            listen.bind(tls_address(cfg), cfg.tls_port, ("--tls-listen", "--tls-port"))
        memcache_sockets = [] if cfg.memcache_port is None else \
            listen.bind(memcache_address(cfg), cfg.memcache_port, ("-l", "--memcache-port"))
        if cfg.user:
            _drop_privileges(cfg.user)
        if cfg.data_dir is not None:
            _check_data_dir(cfg.data_dir)
        trio.run(serve, cfg, sockets, tls_sockets, contexts, memcache_sockets)
    except KeyboardInterrupt:
        pass
    except BaseException as e:  # noqa: B036 -- only known mistakes are caught, bugs re-raised
        known = _start_error(e, cfg.data_dir)
        if known is None:
            raise
        print(f"smallstalk: {known}", file=sys.stderr)
        return known.status
    return 0


# A file the server cannot create, open or write: the operator's to fix.
_FILE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                errno.ENOTDIR, errno.EEXIST, errno.EISDIR}


def _start_error(e: BaseException, data_dir: Path | None) -> StartError | None:
    """The one line for an operator's mistake, or None for a bug (a traceback then)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    if isinstance(e, StartError):
        return e
    if isinstance(e, listen.ListenError):
        return StartError(str(e), EXIT_LISTEN)
    if isinstance(e, tls.TLSFileError):
        return StartError(str(e))
    if isinstance(e, datadir.Locked):
        return StartError(str(e), datadir.EXIT_LOCKED)
    if isinstance(e, CorruptionError):
        from smallstalk.storage.recovery import refusal

        return StartError(f"cannot start: {refusal(e, data_dir)}" if data_dir is not None
                          else f"damaged data directory: {e}")
    if isinstance(e, OSError) and e.filename is not None and e.errno in _FILE_ERRNOS:
        hint = ""
        if e.errno in (errno.EACCES, errno.EPERM):
            hint = f" (the server runs as {_whoami()}: chown the data directory, or use -u)"
        elif e.errno in (errno.EEXIST, errno.ENOTDIR) and not os.path.isdir(e.filename):
            hint = " (a file where the server keeps a directory: move it out of the way)"
        return StartError(f"{e.filename}: {e.strerror}{hint}")
    return None


def _tool(command: str, argv: list[str]) -> int:
    import importlib

    module, func = TOOL_COMMANDS[command].split(":")
    try:
        return getattr(importlib.import_module(module), func)(argv)
    except ImportError as e:
        # PySpark says "PyArrow ... must be installed" without a module name.
        name = (e.name or "").partition(".")[0] or next(
            (m for m in EXTRAS if m in str(e).lower()), "")
        extra = EXTRAS.get(name)
        if extra is None:
            raise
        print(f"smallstalk {command}: needs {name}, which is not installed: "
              f"install smallstalk[{extra}] (pip install 'smallstalk[{extra}]')", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None, listen_sockets: list[socket.socket] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") and argv[0] not in ("--help",):
        command, rest = "serve", argv
    else:
        command, rest = argv[0], argv[1:]
    try:
        if command == "serve":
            return serve_command(rest, listen_sockets)
        if command in ("help", "--help", "-h"):
            print(MAIN_HELP)
            return 0
        if command == "promote":
            return promote_command(rest)
        if command in TOOL_COMMANDS:
            return _tool(command, rest)
        raise UsageError(f"unknown command: {command}")
    except UsageError as e:
        known = command == "serve" or command == "promote" or command in TOOL_COMMANDS
        print(e.line("smallstalk", f"smallstalk {command} -h" if known else "smallstalk help"),
              file=sys.stderr)
        return 5 if command == "serve" else EXIT_USAGE
