"""Clients for the beanstalkd protocol: `Client` (plain sockets) and `AsyncClient` (trio).

Both speak to smallstalk and to beanstalkd alike, have the same method names,
return typed results (`JobRef`, `Job`, `JobStats`, `TubeStats`, `ServerStats`)
and raise one exception class per error reply (`NotFound`, `TimedOut`, ...).

Theory of operation. The protocol lives in one place, without I/O:

- commands are `smallstalk.protocol`'s command classes, rendered by
  `protocol.render` (the server's own definition of the protocol);
- `ReplyReader` is a sans-I/O reply parser over a bytes buffer, and
  `interpret(command, reply)` turns one reply into a result or an exception;
- `_Core` holds what a client knows (its servers, the tube it uses, the tubes
  it watches, which servers are down) and implements every method as a
  generator that yields `_Exchange`s (commands for one server) and receives
  the replies. It is where multi-server behaviour lives.

The two clients are thin drivers that run those generators over a socket or a
trio stream: they connect, pipeline the commands in one write, feed the
reader, and throw connection errors back into the generator.

Several servers (kestrel style: the servers do not know each other). Puts
go round-robin from a random start, skipping servers that refuse or drain;
reserves poll every server with `reserve-with-timeout 0` from a rotating start
and, when none has work, block on one server for `poll_interval` seconds at a
time (beanstalkd cannot wait on two servers at once, and a waiting reserve
blocks its connection). Every job carries the address of the server it lives
on, and commands on a job go to that server; a bare integer id is only
accepted when the client has a single server.
"""

from __future__ import annotations

import math
import os
import random
import socket
import threading
import time
from collections.abc import Generator, Sequence
from typing import Any, TypeAlias, TypeVar

import attrs
import trio

from smallstalk.core import protocol as p

DEFAULT_PORT = 11300
DEFAULT_SERVER = f"127.0.0.1:{DEFAULT_PORT}"
SERVERS_ENV = "SMALLSTALK_SERVERS"
DEFAULT_PRIORITY = 2**31
DEFAULT_TTR = 60
REPLY_LINE_MAX = 1024  # a reply line is short: a word and at most two numbers or a tube name

__all__ = [
    "DEFAULT_PRIORITY", "DEFAULT_SERVER", "DEFAULT_TTR", "AsyncClient", "BadFormat",
    "BeanstalkError", "Buried", "Client", "CommandError", "ConnectionFailed", "DeadlineSoon",
    "Draining", "ExpectedCRLF", "InternalError", "Job", "JobRef", "JobStats", "JobTooBig",
    "NotFound", "NotIgnored", "OutOfMemory", "ProtocolError", "ReadTimeout", "Reply",
    "ReplyReader", "ServerStats", "TimedOut", "TubeStats", "UnknownCommand", "interpret",
    "normalize_address", "resolve_servers",
]


# --- exceptions ------------------------------------------------------------


class BeanstalkError(Exception):
    """Base of everything this module raises about the server or the connection."""


class ConnectionFailed(BeanstalkError, ConnectionError):
    """Could not connect, or the connection broke; the next call reconnects."""

    def __init__(self, server: str, reason: str) -> None:
        super().__init__(f"{server}: {reason}")
        self.server = server


class ReadTimeout(ConnectionFailed, TimeoutError):
    """No reply within the read timeout; the connection was dropped."""


class ProtocolError(BeanstalkError):
    """The server sent something that is not a beanstalkd reply to the command."""


class CommandError(BeanstalkError):
    """The server answered a command with an error reply (`reply` is its first word)."""

    reply = b""

    def __init__(self, server: str = "", detail: str = "") -> None:
        text = self.reply.decode()
        super().__init__(f"{text} from {server}{': ' + detail if detail else ''}"
                         if server else text)
        self.server = server


class OutOfMemory(CommandError):
    reply = b"OUT_OF_MEMORY"


class InternalError(CommandError):
    reply = b"INTERNAL_ERROR"


class BadFormat(CommandError):
    reply = b"BAD_FORMAT"


class UnknownCommand(CommandError):
    reply = b"UNKNOWN_COMMAND"


class ExpectedCRLF(CommandError):
    reply = b"EXPECTED_CRLF"


class JobTooBig(CommandError):
    reply = b"JOB_TOO_BIG"


class Draining(CommandError):
    reply = b"DRAINING"


class NotFound(CommandError):
    reply = b"NOT_FOUND"


class NotIgnored(CommandError):
    reply = b"NOT_IGNORED"


class TimedOut(CommandError):
    """`reserve` with a timeout found no job in time."""

    reply = b"TIMED_OUT"


class DeadlineSoon(CommandError):
    """`reserve` while a job this connection holds is in the last second of its TTR."""

    reply = b"DEADLINE_SOON"


class Buried(CommandError):
    """The server buried the job instead (out of memory): after `put` or `release`."""

    reply = b"BURIED"

    def __init__(self, server: str = "", detail: str = "", job_id: int | None = None) -> None:
        super().__init__(server, detail)
        self.job_id = job_id


_ERRORS: dict[bytes, type[CommandError]] = {
    cls.reply: cls
    for cls in (OutOfMemory, InternalError, BadFormat, UnknownCommand, ExpectedCRLF, JobTooBig,
                Draining, NotFound, NotIgnored, TimedOut, DeadlineSoon, Buried)
}


# --- results ---------------------------------------------------------------


def _short(body: bytes) -> str:
    return repr(body if len(body) <= 40 else body[:40] + b"...")


@attrs.frozen
class JobRef:
    """A job by id on one server (what `put` returns)."""

    id: int
    server: str


@attrs.frozen
class Job(JobRef):
    """A job with its body (what `reserve` and the peeks return)."""

    body: bytes = attrs.field(repr=_short)


def _yaml_map(body: bytes) -> dict[str, str]:
    """beanstalkd's flat YAML dictionaries (`stats*`)."""
    out: dict[str, str] = {}
    for line in body.decode("utf-8", "replace").splitlines():
        if not line or line == "---":
            continue
        key, sep, value = line.partition(": ")
        if not sep:
            key, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError(f"not a YAML mapping line: {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        out[key.strip()] = value
    return out


def _yaml_list(body: bytes) -> list[str]:
    """beanstalkd's YAML lists (`list-tubes*`)."""
    out = []
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("- "):
            out.append(line[2:].strip())
        elif line and line != "---":
            raise ProtocolError(f"not a YAML list line: {line!r}")
    return out


_S = TypeVar("_S", "JobStats", "TubeStats", "ServerStats")


def _from_yaml(cls: type[_S], body: bytes) -> _S:
    """Fill an attrs stats class: keys with '-' become '_', values take the
    type of the field's default; keys the class does not know go to `extra`."""
    fields = {f.name: f for f in attrs.fields(cls)}
    kwargs: dict[str, Any] = {}
    extra: dict[str, str] = {}
    for key, raw in _yaml_map(body).items():
        name = key.replace("-", "_")
        field = fields.get(name)
        if field is None or name == "extra":
            extra[key] = raw
            continue
        default = field.default
        try:
            if isinstance(default, bool):
                value: object = raw == "true"
            elif isinstance(default, int):
                value = int(raw)
            elif isinstance(default, float):
                value = float(raw)
            else:
                value = raw
        except ValueError:
            extra[key] = raw
            continue
        kwargs[name] = value
    return cls(**kwargs, extra=extra)


@attrs.frozen
class JobStats:
    """`stats-job`."""

    id: int = 0
    tube: str = ""
    state: str = ""  # ready, delayed, reserved or buried
    pri: int = 0
    age: int = 0
    delay: int = 0
    ttr: int = 0
    time_left: int = 0
    file: int = 0
    reserves: int = 0
    timeouts: int = 0
    releases: int = 0
    buries: int = 0
    kicks: int = 0
    extra: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class TubeStats:
    """`stats-tube`."""

    name: str = ""
    current_jobs_urgent: int = 0
    current_jobs_ready: int = 0
    current_jobs_reserved: int = 0
    current_jobs_delayed: int = 0
    current_jobs_buried: int = 0
    total_jobs: int = 0
    current_using: int = 0
    current_watching: int = 0
    current_waiting: int = 0
    cmd_delete: int = 0
    cmd_pause_tube: int = 0
    pause: int = 0
    pause_time_left: int = 0
    extra: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class ServerStats:
    """`stats` (beanstalkd 1.12's keys; others land in `extra`)."""

    current_jobs_urgent: int = 0
    current_jobs_ready: int = 0
    current_jobs_reserved: int = 0
    current_jobs_delayed: int = 0
    current_jobs_buried: int = 0
    cmd_put: int = 0
    cmd_peek: int = 0
    cmd_peek_ready: int = 0
    cmd_peek_delayed: int = 0
    cmd_peek_buried: int = 0
    cmd_reserve: int = 0
    cmd_reserve_with_timeout: int = 0
    cmd_delete: int = 0
    cmd_release: int = 0
    cmd_use: int = 0
    cmd_watch: int = 0
    cmd_ignore: int = 0
    cmd_bury: int = 0
    cmd_kick: int = 0
    cmd_touch: int = 0
    cmd_stats: int = 0
    cmd_stats_job: int = 0
    cmd_stats_tube: int = 0
    cmd_list_tubes: int = 0
    cmd_list_tube_used: int = 0
    cmd_list_tubes_watched: int = 0
    cmd_pause_tube: int = 0
    job_timeouts: int = 0
    total_jobs: int = 0
    max_job_size: int = 0
    current_tubes: int = 0
    current_connections: int = 0
    current_producers: int = 0
    current_workers: int = 0
    current_waiting: int = 0
    total_connections: int = 0
    pid: int = 0
    version: str = ""
    rusage_utime: float = 0.0
    rusage_stime: float = 0.0
    uptime: int = 0
    binlog_oldest_index: int = 0
    binlog_current_index: int = 0
    binlog_records_migrated: int = 0
    binlog_records_written: int = 0
    binlog_max_size: int = 0
    draining: bool = False
    id: str = ""
    hostname: str = ""
    os: str = ""
    platform: str = ""
    extra: dict[str, str] = attrs.field(factory=dict)


# --- replies: sans-I/O -----------------------------------------------------


@attrs.frozen
class Reply:
    """One reply: its first word, the rest of the line split on spaces, the body if any."""

    word: bytes
    args: tuple[bytes, ...]
    body: bytes | None = None


_WITH_BODY = {b"RESERVED": 2, b"FOUND": 2, b"OK": 1}  # words followed by a body: arg count


class ReplyReader:
    """Incremental reply parser: `feed(bytes)`, then `next_reply()` until it returns None.

    A malformed reply raises ProtocolError; the stream is then unusable.
    """

    def __init__(self, max_body: int = p.MAX_JOB_SIZE_LIMIT) -> None:
        self.max_body = max_body
        self._buf = bytearray()
        self._head: tuple[bytes, tuple[bytes, ...], int] | None = None

    def feed(self, data: bytes | bytearray) -> None:
        self._buf += data

    def buffered(self) -> int:
        return len(self._buf)

    def next_reply(self) -> Reply | None:
        buf = self._buf
        if self._head is None:
            end = buf.find(b"\r\n", 0, REPLY_LINE_MAX)
            if end < 0:
                if len(buf) >= REPLY_LINE_MAX:
                    raise ProtocolError(f"reply line too long: {bytes(buf[:60])!r}...")
                return None
            word, *rest = bytes(buf[:end]).split(b" ")
            args = tuple(rest)
            del buf[:end + 2]
            nargs = _WITH_BODY.get(word)
            if nargs is None:
                return Reply(word, args)
            if len(args) != nargs or not all(a.isdigit() for a in args):
                raise ProtocolError(f"malformed {word.decode()} line: {args!r}")
            size = int(args[-1])
            if size > self.max_body:
                raise ProtocolError(f"{word.decode()} body of {size} bytes is too large")
            self._head = (word, args, size)
        word, args, size = self._head
        if len(buf) < size + 2:
            return None
        if buf[size:size + 2] != b"\r\n":
            raise ProtocolError(f"{word.decode()} body not followed by CRLF")
        body = bytes(buf[:size])
        del buf[:size + 2]
        self._head = None
        return Reply(word, args, body)


def _int_arg(reply: Reply, n: int = 1) -> int:
    if len(reply.args) != n or not reply.args[0].isdigit():
        raise ProtocolError(f"malformed {reply.word.decode()} reply: {reply.args!r}")
    return int(reply.args[0])


def _job(reply: Reply, server: str) -> Job:
    assert reply.body is not None
    return Job(_int_arg(reply, 2), server, reply.body)


def _ok_body(reply: Reply) -> bytes:
    assert reply.body is not None
    return reply.body


def _name_arg(reply: Reply) -> str:
    if len(reply.args) != 1:
        raise ProtocolError(f"malformed {reply.word.decode()} reply: {reply.args!r}")
    return reply.args[0].decode("ascii", "replace")


# Success reply of each command: (word, how to build the result).
_SUCCESS: dict[type, tuple[bytes, Any]] = {
    p.Put: (b"INSERTED", lambda r, s: JobRef(_int_arg(r), s)),
    p.Reserve: (b"RESERVED", _job),
    p.ReserveJob: (b"RESERVED", _job),
    p.Delete: (b"DELETED", None),
    p.Release: (b"RELEASED", None),
    p.Bury: (b"BURIED", None),
    p.Touch: (b"TOUCHED", None),
    p.Use: (b"USING", lambda r, s: _name_arg(r)),
    p.Watch: (b"WATCHING", lambda r, s: _int_arg(r)),
    p.Ignore: (b"WATCHING", lambda r, s: _int_arg(r)),
    p.Peek: (b"FOUND", _job),
    p.PeekReady: (b"FOUND", _job),
    p.PeekDelayed: (b"FOUND", _job),
    p.PeekBuried: (b"FOUND", _job),
    p.Kick: (b"KICKED", lambda r, s: _int_arg(r)),
    p.KickJob: (b"KICKED", None),
    p.StatsJob: (b"OK", lambda r, s: _from_yaml(JobStats, _ok_body(r))),
    p.StatsTube: (b"OK", lambda r, s: _from_yaml(TubeStats, _ok_body(r))),
    p.Stats: (b"OK", lambda r, s: _from_yaml(ServerStats, _ok_body(r))),
    p.ListTubes: (b"OK", lambda r, s: _yaml_list(_ok_body(r))),
    p.ListTubeUsed: (b"USING", lambda r, s: _name_arg(r)),
    p.ListTubesWatched: (b"OK", lambda r, s: _yaml_list(_ok_body(r))),
    p.PauseTube: (b"PAUSED", None),
    p.DeleteTube: (b"DELETED", None),
    p.ListJobs: (b"OK", lambda r, s: [int(i) for i in _yaml_list(_ok_body(r))]),
    p.FlushTube: (b"FLUSHED", lambda r, s: _int_arg(r)),
}


def interpret(cmd: p.Command, reply: Reply, server: str = "") -> Any:
    """The result of `cmd` given its reply, or the error reply raised as an exception."""
    word, build = _SUCCESS[type(cmd)]
    if reply.word == word:
        return None if build is None else build(reply, server)
    error = _ERRORS.get(reply.word)
    if error is Buried:
        job_id = int(reply.args[0]) if reply.args and reply.args[0].isdigit() else getattr(
            cmd, "id", None)
        raise Buried(server, "", job_id)
    if error is not None:
        raise error(server)
    raise ProtocolError(f"unexpected reply to {type(cmd).__name__}: "
                        f"{b' '.join((reply.word, *reply.args))!r}")


# --- addresses and argument checks ----------------------------------------


def normalize_address(addr: str) -> str:
    """"host", "host:port", "[v6]:port" or "unix:/path" to one spelling."""
    addr = addr.strip()
    if addr.startswith("unix:"):
        return addr
    host, port = _split(addr)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split(addr: str) -> tuple[str, int]:
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif addr.count(":") == 1:
        host, _, port = addr.partition(":")
    else:
        host, port = addr, ""
    if not host:
        raise ValueError(f"no host in server address {addr!r}")
    try:
        number = int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"bad port in server address {addr!r}") from None
    return host, number


def resolve_servers(servers: str | Sequence[str] | None) -> list[str]:
    """Server list from an argument, else $SMALLSTALK_SERVERS, else 127.0.0.1:11300.

    A string may hold several addresses separated by commas.
    """
    if servers is None:
        servers = os.environ.get(SERVERS_ENV) or DEFAULT_SERVER
    if isinstance(servers, str):
        servers = [s for s in servers.split(",") if s.strip()]
    out = [normalize_address(s) for s in servers]
    if not out:
        raise ValueError("no servers given")
    if len(set(out)) != len(out):
        raise ValueError(f"a server is listed twice: {out}")
    return out


def _check_tube(tube: str) -> str:
    # Also what keeps a tube name from injecting a second command line.
    if not isinstance(tube, str) or not p.valid_tube_name(tube.encode("utf-8", "replace")):
        raise ValueError(f"invalid tube name {tube!r} (1-200 of A-Za-z0-9 -+/;.$_(), "
                         "not starting with '-')")
    return tube


def _check_uint(value: int, what: str, limit: int = p.U32_MAX) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise ValueError(f"{what} must be an integer from 0 to {limit}, not {value!r}")
    return value


def _seconds(timeout: float) -> int:
    """A timeout in whole seconds, rounded up (the protocol counts seconds)."""
    if timeout < 0:
        raise ValueError("timeout must not be negative")
    return min(math.ceil(timeout), 2**31 - 1)


def _body(body: bytes | str) -> bytes:
    if isinstance(body, str):
        return body.encode("utf-8")
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    raise TypeError(f"a job body is bytes or str, not {type(body).__name__}")


# --- the protocol core: every method as a generator of exchanges ----------

_T = TypeVar("_T")


@attrs.frozen
class _Exchange:
    """Send `commands` to server number `server` and hand back one reply each.

    `wait` is how long the server may legitimately take beyond an ordinary
    reply (a reserve's timeout); None means no bound at all.
    """

    server: int
    commands: tuple[p.Command, ...]
    wait: float | None = 0.0


_Op: TypeAlias = Generator[_Exchange, list[Reply], _T]
JobLike: TypeAlias = JobRef | int


class _Core:
    """What a client knows and how each command is carried out, without I/O."""

    def __init__(self, servers: list[str], poll_interval: float, retry_interval: float) -> None:
        self.servers = servers
        self.index = {s: i for i, s in enumerate(servers)}
        self.poll_interval = max(1.0, poll_interval)
        self.retry_interval = retry_interval
        self.using = "default"
        self.watching = ["default"]
        n = len(servers)
        # What each connection is known to use and watch (None: not connected).
        self._used: list[str | None] = [None] * n
        self._watched: list[list[str] | None] = [None] * n
        self._down_until = [0.0] * n
        self._next_put = random.randrange(n)
        self._next_reserve = random.randrange(n)

    # Driver hooks -----------------------------------------------------------

    def connected(self, i: int) -> None:
        self._used[i] = "default"
        self._watched[i] = ["default"]

    def disconnected(self, i: int) -> None:
        self._used[i] = None
        self._watched[i] = None

    def outgoing(self, i: int, commands: Sequence[p.Command]) -> tuple[list[p.Command], int]:
        """The commands to send: first whatever brings the connection to the
        client's used and watched tubes, then `commands`."""
        pre: list[p.Command] = []
        if self._used[i] != self.using:
            pre.append(p.Use(self.using))
        watched = self._watched[i] or []
        pre += [p.Watch(t) for t in self.watching if t not in watched]
        pre += [p.Ignore(t) for t in watched if t not in self.watching]
        return pre + list(commands), len(pre)

    def incoming(self, i: int, sent: list[p.Command], n_pre: int,
                 replies: list[Reply]) -> list[Reply]:
        """Account for the prelude's replies; the rest belong to the exchange."""
        error: BeanstalkError | None = None
        for cmd, reply in zip(sent[:n_pre], replies[:n_pre], strict=True):
            try:
                interpret(cmd, reply, self.servers[i])
            except BeanstalkError as e:
                error = error or e
                continue
            watched = self._watched[i]
            assert watched is not None
            if type(cmd) is p.Use:
                self._used[i] = cmd.tube
            elif type(cmd) is p.Watch:
                watched.append(cmd.tube)
            elif type(cmd) is p.Ignore and cmd.tube in watched:
                watched.remove(cmd.tube)
        if error is not None:
            raise error
        return replies[n_pre:]

    # Helpers ------------------------------------------------------------------

    @property
    def multi(self) -> bool:
        return len(self.servers) > 1

    def _mark_down(self, i: int) -> None:
        self._down_until[i] = time.monotonic() + self.retry_interval

    def _order(self, start: int) -> list[int]:
        """Every server from `start` round, the ones recently down last."""
        n = len(self.servers)
        ring = [(start + k) % n for k in range(n)]
        now = time.monotonic()
        return ([i for i in ring if self._down_until[i] <= now]
                + [i for i in ring if self._down_until[i] > now])

    def _live(self, start: int = 0) -> list[int]:
        """Servers not recently down (all of them if all are)."""
        now = time.monotonic()
        order = self._order(start)
        live = [i for i in order if self._down_until[i] <= now]
        return live or order

    def locate(self, job: JobLike) -> tuple[int, int]:
        if isinstance(job, JobRef):
            i = self.index.get(job.server)
            if i is None:
                raise ValueError(f"job {job.id} lives on {job.server}, not one of {self.servers}")
            return i, _check_uint(job.id, "job id", p.U64_MAX)
        if self.multi:
            raise ValueError("a bare job id is ambiguous with several servers: "
                             "pass the Job or JobRef (or JobRef(id, server))")
        return 0, _check_uint(job, "job id", p.U64_MAX)

    def _one_server(self, server: str | None) -> int:
        if server is None:
            if self.multi:
                raise ValueError("several servers: say which one with server=")
            return 0
        i = self.index.get(normalize_address(server))
        if i is None:
            raise ValueError(f"{server} is not one of {self.servers}")
        return i

    def _with_tube(self, tube: str | None, cmd: p.Command) -> tuple[tuple[p.Command, ...], int]:
        """`cmd`, or use/cmd/use-back if it is meant for another tube than the used one."""
        if tube is None or tube == self.using:
            return (cmd,), 0
        return (p.Use(_check_tube(tube)), cmd, p.Use(self.using)), 1

    def _results(self, i: int, cmds: tuple[p.Command, ...], at: int,
                 replies: list[Reply]) -> Any:
        for k, (cmd, reply) in enumerate(zip(cmds, replies, strict=True)):
            if k != at:
                interpret(cmd, reply, self.servers[i])
        return interpret(cmds[at], replies[at], self.servers[i])

    def one(self, i: int, cmd: p.Command, wait: float | None = 0.0) -> _Op[Any]:
        replies = yield _Exchange(i, (cmd,), wait)
        return interpret(cmd, replies[0], self.servers[i])

    def _each(self, cmds: tuple[p.Command, ...], at: int) -> _Op[list[tuple[int, Any]]]:
        """Send `cmds` to every reachable server: (server, result or CommandError) each."""
        out: list[tuple[int, Any]] = []
        last: ConnectionFailed | None = None
        for i in range(len(self.servers)):
            try:
                replies = yield _Exchange(i, cmds)
            except ConnectionFailed as e:
                self._mark_down(i)
                last = e
                continue
            try:
                out.append((i, self._results(i, cmds, at, replies) if cmds else None))
            except CommandError as e:
                out.append((i, e))
        if not out:
            assert last is not None
            raise last
        return out

    # Commands -----------------------------------------------------------------

    def put(self, body: bytes | str, priority: int, delay: int, ttr: int, tube: str | None,
            server: str | None, max_age: int = 0) -> _Op[JobRef]:
        cmd = p.Put(_check_uint(priority, "priority"), _check_uint(delay, "delay"),
                    _check_uint(ttr, "ttr"), _body(body), _check_uint(max_age, "max_age"))
        cmds, at = self._with_tube(tube, cmd)
        if server is not None:
            order = [self._one_server(server)]
        else:
            order = self._order(self._next_put)
            self._next_put = (self._next_put + 1) % len(self.servers)
        last: BeanstalkError | None = None
        for i in order:
            try:
                replies = yield _Exchange(i, cmds)
                return self._results(i, cmds, at, replies)
            except ConnectionFailed as e:
                # The put may have reached the server: at-least-once, like the protocol.
                self._mark_down(i)
                last = e
            except Draining as e:
                last = e
        assert last is not None
        raise last

    def use(self, tube: str) -> _Op[str]:
        self.using = _check_tube(tube)
        yield from self._each((), 0)
        return tube

    def watch(self, tube: str) -> _Op[int]:
        if _check_tube(tube) not in self.watching:
            self.watching.append(tube)
        yield from self._each((), 0)
        return len(self.watching)

    def ignore(self, tube: str) -> _Op[int]:
        _check_tube(tube)
        before = list(self.watching)
        if tube in self.watching:
            self.watching.remove(tube)
        try:
            yield from self._each((), 0)
        except NotIgnored:
            self.watching = before
            raise
        return len(self.watching)

    def set_watching(self, tubes: Sequence[str]) -> None:
        tubes = list(dict.fromkeys(_check_tube(t) for t in tubes))
        if not tubes:
            raise ValueError("watch at least one tube")
        self.watching = tubes

    def reserve(self, timeout: float | None, tubes: Sequence[str] | None) -> _Op[Job]:
        if tubes is not None:
            self.set_watching(tubes)
        if not self.multi:
            secs = None if timeout is None else _seconds(timeout)
            return (yield from self.one(0, p.Reserve(secs), secs))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            start = self._next_reserve
            self._next_reserve = (start + 1) % len(self.servers)
            reachable = 0
            last: ConnectionFailed | None = None
            for i in self._live(start):
                try:
                    return (yield from self.one(i, p.Reserve(0)))
                except TimedOut:
                    reachable += 1
                except ConnectionFailed as e:
                    self._mark_down(i)
                    last = e
            if not reachable:
                assert last is not None
                raise last
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimedOut(", ".join(self.servers))
            # Nobody has work: wait on one server for a slice, then poll again.
            i = self._live(start)[0]
            secs = _seconds(self.poll_interval if left is None else min(self.poll_interval, left))
            try:
                return (yield from self.one(i, p.Reserve(secs), secs))
            except TimedOut:
                pass
            except ConnectionFailed:
                self._mark_down(i)

    def reserve_job(self, job: JobLike) -> _Op[Job]:
        i, jid = self.locate(job)
        return (yield from self.one(i, p.ReserveJob(jid)))

    def delete(self, job: JobLike) -> _Op[None]:
        i, jid = self.locate(job)
        yield from self.one(i, p.Delete(jid))

    def _priority(self, i: int, jid: int, priority: int | None) -> _Op[int]:
        if priority is None:
            stats = yield from self.one(i, p.StatsJob(jid))
            return stats.pri
        return _check_uint(priority, "priority")

    def release(self, job: JobLike, priority: int | None, delay: int) -> _Op[None]:
        i, jid = self.locate(job)
        pri = yield from self._priority(i, jid, priority)
        yield from self.one(i, p.Release(jid, pri, _check_uint(delay, "delay")))

    def bury(self, job: JobLike, priority: int | None) -> _Op[None]:
        i, jid = self.locate(job)
        pri = yield from self._priority(i, jid, priority)
        yield from self.one(i, p.Bury(jid, pri))

    def touch(self, job: JobLike) -> _Op[None]:
        i, jid = self.locate(job)
        yield from self.one(i, p.Touch(jid))

    def peek(self, job: JobLike) -> _Op[Job]:
        i, jid = self.locate(job)
        return (yield from self.one(i, p.Peek(jid)))

    def peek_first(self, cmd: p.Command, tube: str | None) -> _Op[Job]:
        """peek-ready/-delayed/-buried: the first server (in order) that has one."""
        cmds, at = self._with_tube(tube, cmd)
        for _, result in (yield from self._each(cmds, at)):
            if isinstance(result, Job):
                return result
            if not isinstance(result, NotFound):
                raise result
        raise NotFound(", ".join(self.servers))

    def kick(self, bound: int, tube: str | None) -> _Op[int]:
        """Up to `bound` jobs in all, server after server."""
        left = _check_uint(bound, "bound")
        total = 0
        reached = 0
        last: ConnectionFailed | None = None
        for i in range(len(self.servers)):
            if left == 0:
                break
            cmds, at = self._with_tube(tube, p.Kick(left))
            try:
                replies = yield _Exchange(i, cmds)
            except ConnectionFailed as e:
                self._mark_down(i)
                last = e
                continue
            reached += 1
            kicked = self._results(i, cmds, at, replies)
            total += kicked
            left -= kicked
        if not reached and last is not None:
            raise last
        return total

    def kick_job(self, job: JobLike) -> _Op[None]:
        i, jid = self.locate(job)
        yield from self.one(i, p.KickJob(jid))

    def stats_job(self, job: JobLike) -> _Op[JobStats]:
        i, jid = self.locate(job)
        return (yield from self.one(i, p.StatsJob(jid)))

    def stats_tube(self, tube: str, server: str | None) -> _Op[TubeStats]:
        return (yield from self.one(self._one_server(server), p.StatsTube(_check_tube(tube))))

    def stats(self, server: str | None) -> _Op[ServerStats]:
        return (yield from self.one(self._one_server(server), p.STATS))

    def list_tubes(self) -> _Op[list[str]]:
        names: dict[str, None] = {}
        for _, result in (yield from self._each((p.LIST_TUBES,), 0)):
            if isinstance(result, Exception):
                raise result
            names.update(dict.fromkeys(result))
        return list(names)

    def first_reachable(self, cmd: p.Command) -> _Op[Any]:
        last: ConnectionFailed | None = None
        for i in self._live():
            try:
                return (yield from self.one(i, cmd))
            except ConnectionFailed as e:
                self._mark_down(i)
                last = e
        assert last is not None
        raise last

    def pause_tube(self, tube: str, delay: int) -> _Op[None]:
        cmd = p.PauseTube(_check_tube(tube), _check_uint(delay, "delay"))
        yield from self._on_every_server_that_has_it(cmd)

    def delete_tube(self, tube: str) -> _Op[None]:
        yield from self._on_every_server_that_has_it(p.DeleteTube(_check_tube(tube)))

    def list_jobs(self, tube: str, state: str, after: int, count: int,
                  server: str | None) -> _Op[list[int]]:
        if state not in p.LIST_JOBS_STATES:
            raise ValueError(f"state must be one of {', '.join(p.LIST_JOBS_STATES)}")
        cmd = p.ListJobs(_check_tube(tube), state, _check_uint(after, "after"),
                         _check_uint(count, "count"))
        return (yield from self.one(self._one_server(server), cmd))

    def flush_tube(self, tube: str, server: str | None) -> _Op[int]:
        return (yield from self.one(self._one_server(server), p.FlushTube(_check_tube(tube))))

    def _on_every_server_that_has_it(self, cmd: p.Command) -> _Op[None]:
        results = [r for _, r in (yield from self._each((cmd,), 0))]
        if all(isinstance(r, NotFound) for r in results):
            raise results[0]
        for r in results:
            if isinstance(r, Exception) and not isinstance(r, NotFound):
                raise r

    def connect(self) -> _Op[None]:
        yield from self._each((), 0)


# --- the synchronous client -----------------------------------------------


class _SyncConn:
    def __init__(self, addr: str, connect_timeout: float) -> None:
        if addr.startswith("unix:"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(connect_timeout)
            try:
                sock.connect(addr[5:])
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection(_split(addr), timeout=connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.reader = ReplyReader()

    def exchange(self, data: bytes, count: int, timeout: float | None) -> list[Reply]:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.sock.settimeout(timeout)
        self.sock.sendall(data)
        replies: list[Reply] = []
        while len(replies) < count:
            reply = self.reader.next_reply()
            if reply is not None:
                replies.append(reply)
                continue
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("the server closed the connection")
            self.reader.feed(chunk)
        return replies

    def close(self, quit: bool = False) -> None:
        if quit:
            try:
                self.sock.settimeout(0.5)
                self.sock.sendall(p.render(p.QUIT))
            except OSError:
                pass
        self.sock.close()


class Client:
    """A synchronous beanstalkd client over one or several servers.

    `servers` is an address ("host:port", "unix:/path"), a comma-separated
    string or a list; None means $SMALLSTALK_SERVERS or 127.0.0.1:11300.
    Connections open on first use. Safe to share between threads (one call
    at a time).
    """

    def __init__(self, servers: str | Sequence[str] | None = None, *,
                 connect_timeout: float = 5.0, read_timeout: float = 10.0,
                 poll_interval: float = 1.0, retry_interval: float = 5.0) -> None:
        self._core = _Core(resolve_servers(servers), poll_interval, retry_interval)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._conns: list[_SyncConn | None] = [None] * len(self._core.servers)
        self._lock = threading.RLock()

    # driver -----------------------------------------------------------------

    def _exchange(self, req: _Exchange) -> list[Reply]:
        i = req.server
        server = self._core.servers[i]
        conn = self._conns[i]
        if conn is None:
            try:
                conn = _SyncConn(server, self.connect_timeout)
            except OSError as e:
                raise ConnectionFailed(server, f"cannot connect: {e}") from e
            self._conns[i] = conn
            self._core.connected(i)
        cmds, n_pre = self._core.outgoing(i, req.commands)
        if not cmds:
            return []
        timeout = None if req.wait is None else self.read_timeout + req.wait
        try:
            replies = conn.exchange(b"".join(map(p.render, cmds)), len(cmds), timeout)
        except TimeoutError as e:
            self._drop(i)
            raise ReadTimeout(server, f"no reply within {timeout:.1f}s") from e
        except OSError as e:
            self._drop(i)
            raise ConnectionFailed(server, str(e) or type(e).__name__) from e
        except BaseException:
            self._drop(i)  # a reply may still be on its way: the stream is out of step
            raise
        return self._core.incoming(i, cmds, n_pre, replies)

    def _drop(self, i: int) -> None:
        conn, self._conns[i] = self._conns[i], None
        self._core.disconnected(i)
        if conn is not None:
            conn.close()

    def _run(self, op: _Op[_T]) -> _T:
        with self._lock:
            try:
                req = next(op)
                while True:
                    try:
                        replies = self._exchange(req)
                    except BeanstalkError as e:
                        req = op.throw(e)
                    else:
                        req = op.send(replies)
            except StopIteration as stop:
                return stop.value

    # lifecycle ----------------------------------------------------------------

    @property
    def servers(self) -> list[str]:
        return list(self._core.servers)

    def connect(self) -> None:
        """Connect to every server now (else on first use); fails if none is reachable."""
        self._run(self._core.connect())

    def close(self) -> None:
        """Send `quit` and close every connection (jobs still reserved go back to ready)."""
        with self._lock:
            for i, conn in enumerate(self._conns):
                if conn is not None:
                    self._conns[i] = None
                    self._core.disconnected(i)
                    conn.close(quit=True)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # producer -----------------------------------------------------------------

    def put(self, body: bytes | str, priority: int = DEFAULT_PRIORITY, delay: int = 0,
            ttr: int = DEFAULT_TTR, *, tube: str | None = None,
            server: str | None = None, max_age: int = 0) -> JobRef:
        """Insert a job (str bodies are UTF-8); `tube` puts into another tube than
        the used one without changing it; `server` picks the server, else
        round-robin; `max_age` (seconds, smallstalk only: beanstalkd answers
        BAD_FORMAT) expires the job if it is still waiting then. Raises
        JobTooBig, OutOfMemory (a full tube), Draining, Buried, ExpectedCRLF."""
        return self._run(self._core.put(body, priority, delay, ttr, tube, server, max_age))

    def use(self, tube: str) -> str:
        """Put into `tube` from now on (on every server)."""
        return self._run(self._core.use(tube))

    # worker ---------------------------------------------------------------------

    def reserve(self, timeout: float | None = None, *,
                tubes: Sequence[str] | None = None) -> Job:
        """Reserve a job from the watched tubes; `timeout` in seconds (rounded
        up; 0 polls), None waits for ever. `tubes` first makes these exactly
        the watched tubes (in the same round trip). Raises TimedOut, DeadlineSoon."""
        return self._run(self._core.reserve(timeout, tubes))

    def reserve_job(self, job: JobLike) -> Job:
        """Reserve this job whatever its state (beanstalkd 1.12 and smallstalk)."""
        return self._run(self._core.reserve_job(job))

    def delete(self, job: JobLike) -> None:
        self._run(self._core.delete(job))

    def release(self, job: JobLike, priority: int | None = None, delay: int = 0) -> None:
        """Give a reserved job back; priority None keeps the job's (costs a stats-job)."""
        self._run(self._core.release(job, priority, delay))

    def bury(self, job: JobLike, priority: int | None = None) -> None:
        """Bury a reserved job; priority None keeps the job's (costs a stats-job)."""
        self._run(self._core.bury(job, priority))

    def touch(self, job: JobLike) -> None:
        """Ask for another TTR on a reserved job."""
        self._run(self._core.touch(job))

    def watch(self, tube: str) -> int:
        """Also reserve from `tube`; returns the number of watched tubes."""
        return self._run(self._core.watch(tube))

    def ignore(self, tube: str) -> int:
        """Stop reserving from `tube`; NotIgnored if it is the last one."""
        return self._run(self._core.ignore(tube))

    # other ---------------------------------------------------------------------

    def peek(self, job: JobLike) -> Job:
        return self._run(self._core.peek(job))

    def peek_ready(self, *, tube: str | None = None) -> Job:
        """The next ready job of the used tube (or `tube`); NotFound if none."""
        return self._run(self._core.peek_first(p.PEEK_READY, tube))

    def peek_delayed(self, *, tube: str | None = None) -> Job:
        return self._run(self._core.peek_first(p.PEEK_DELAYED, tube))

    def peek_buried(self, *, tube: str | None = None) -> Job:
        return self._run(self._core.peek_first(p.PEEK_BURIED, tube))

    def kick(self, bound: int, *, tube: str | None = None) -> int:
        """Kick up to `bound` buried (else delayed) jobs of the used tube (or `tube`)."""
        return self._run(self._core.kick(bound, tube))

    def kick_job(self, job: JobLike) -> None:
        self._run(self._core.kick_job(job))

    def stats_job(self, job: JobLike) -> JobStats:
        return self._run(self._core.stats_job(job))

    def stats_tube(self, tube: str, *, server: str | None = None) -> TubeStats:
        """With several servers, say which one (`server=`)."""
        return self._run(self._core.stats_tube(tube, server))

    def stats(self, *, server: str | None = None) -> ServerStats:
        """With several servers, say which one (`server=`)."""
        return self._run(self._core.stats(server))

    def list_tubes(self) -> list[str]:
        """Every tube on every reachable server."""
        return self._run(self._core.list_tubes())

    def list_tube_used(self) -> str:
        return self._run(self._core.first_reachable(p.LIST_TUBE_USED))

    def list_tubes_watched(self) -> list[str]:
        return self._run(self._core.first_reachable(p.LIST_TUBES_WATCHED))

    def pause_tube(self, tube: str, delay: int) -> None:
        """No reserves from `tube` for `delay` seconds (on every server that has it)."""
        self._run(self._core.pause_tube(tube, delay))

    def delete_tube(self, tube: str) -> None:
        """Stop copying puts into the fanout tube `parent+child` (smallstalk only)."""
        self._run(self._core.delete_tube(tube))

    def list_jobs(self, tube: str, state: str = "ready", after: int = 0, count: int = 100, *,
                  server: str | None = None) -> list[int]:
        """Ids of a tube's jobs in `state`, in hand-out order, after job `after`
        (smallstalk only; at most 1000 per call)."""
        return self._run(self._core.list_jobs(tube, state, after, count, server))

    def flush_tube(self, tube: str, *, server: str | None = None) -> int:
        """Delete a tube's ready, delayed and buried jobs; how many (smallstalk only)."""
        return self._run(self._core.flush_tube(tube, server))


# --- the trio client -------------------------------------------------------


class _AsyncConn:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.reader = ReplyReader()

    @classmethod
    async def open(cls, addr: str, connect_timeout: float) -> _AsyncConn:
        with trio.fail_after(connect_timeout):
            if addr.startswith("unix:"):
                stream: trio.abc.Stream = await trio.open_unix_socket(addr[5:])
            else:
                host, port = _split(addr)
                tcp = await trio.open_tcp_stream(host, port)
                tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                stream = tcp
        return cls(stream)

    async def exchange(self, data: bytes, count: int, timeout: float | None) -> list[Reply]:
        with trio.fail_after(math.inf if timeout is None else timeout):
            await self.stream.send_all(data)
            replies: list[Reply] = []
            while len(replies) < count:
                reply = self.reader.next_reply()
                if reply is not None:
                    replies.append(reply)
                    continue
                chunk = await self.stream.receive_some(65536)
                if not chunk:
                    raise ConnectionResetError("the server closed the connection")
                self.reader.feed(chunk)
        return replies

    async def close(self, quit: bool = False) -> None:
        if quit:
            with trio.move_on_after(0.5):
                try:
                    await self.stream.send_all(p.render(p.QUIT))
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
        await trio.aclose_forcefully(self.stream)


class AsyncClient:
    """The trio client: `Client`'s methods, awaited. Use one per task that
    reserves (a waiting reserve blocks its connection); calls on one client
    are serialized. Cancelling a call drops the connection it was using
    (jobs reserved on it go back to ready)."""

    def __init__(self, servers: str | Sequence[str] | None = None, *,
                 connect_timeout: float = 5.0, read_timeout: float = 10.0,
                 poll_interval: float = 1.0, retry_interval: float = 5.0) -> None:
        self._core = _Core(resolve_servers(servers), poll_interval, retry_interval)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._conns: list[_AsyncConn | None] = [None] * len(self._core.servers)
        self._lock = trio.Lock()

    async def _exchange(self, req: _Exchange) -> list[Reply]:
        i = req.server
        server = self._core.servers[i]
        conn = self._conns[i]
        if conn is None:
            try:
                conn = await _AsyncConn.open(server, self.connect_timeout)
            except trio.TooSlowError as e:
                raise ConnectionFailed(server, "cannot connect: timed out") from e
            except OSError as e:
                raise ConnectionFailed(server, f"cannot connect: {e}") from e
            self._conns[i] = conn
            self._core.connected(i)
        cmds, n_pre = self._core.outgoing(i, req.commands)
        if not cmds:
            return []
        timeout = None if req.wait is None else self.read_timeout + req.wait
        try:
            replies = await conn.exchange(b"".join(map(p.render, cmds)), len(cmds), timeout)
        except trio.TooSlowError as e:
            await self._drop(i)
            raise ReadTimeout(server, f"no reply within {timeout:.1f}s") from e
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            await self._drop(i)
            raise ConnectionFailed(server, str(e) or type(e).__name__) from e
        except BaseException:
            await self._drop(i)  # cancelled or broken mid-exchange: the stream is out of step
            raise
        return self._core.incoming(i, cmds, n_pre, replies)

    async def _drop(self, i: int) -> None:
        conn, self._conns[i] = self._conns[i], None
        self._core.disconnected(i)
        if conn is not None:
            await trio.aclose_forcefully(conn.stream)

    async def _run(self, op: _Op[_T]) -> _T:
        async with self._lock:
            try:
                req = next(op)
                while True:
                    try:
                        replies = await self._exchange(req)
                    except BeanstalkError as e:
                        req = op.throw(e)
                    else:
                        req = op.send(replies)
            except StopIteration as stop:
                return stop.value

    @property
    def servers(self) -> list[str]:
        return list(self._core.servers)

    async def connect(self) -> None:
        await self._run(self._core.connect())

    async def aclose(self) -> None:
        """Send `quit` and close every connection."""
        for i, conn in enumerate(self._conns):
            if conn is not None:
                self._conns[i] = None
                self._core.disconnected(i)
                await conn.close(quit=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def put(self, body: bytes | str, priority: int = DEFAULT_PRIORITY, delay: int = 0,
                  ttr: int = DEFAULT_TTR, *, tube: str | None = None,
                  server: str | None = None, max_age: int = 0) -> JobRef:
        return await self._run(self._core.put(body, priority, delay, ttr, tube, server, max_age))

    async def use(self, tube: str) -> str:
        return await self._run(self._core.use(tube))

    async def reserve(self, timeout: float | None = None, *,
                      tubes: Sequence[str] | None = None) -> Job:
        return await self._run(self._core.reserve(timeout, tubes))

    async def reserve_job(self, job: JobLike) -> Job:
        return await self._run(self._core.reserve_job(job))

    async def delete(self, job: JobLike) -> None:
        await self._run(self._core.delete(job))

    async def release(self, job: JobLike, priority: int | None = None, delay: int = 0) -> None:
        await self._run(self._core.release(job, priority, delay))

    async def bury(self, job: JobLike, priority: int | None = None) -> None:
        await self._run(self._core.bury(job, priority))

    async def touch(self, job: JobLike) -> None:
        await self._run(self._core.touch(job))

    async def watch(self, tube: str) -> int:
        return await self._run(self._core.watch(tube))

    async def ignore(self, tube: str) -> int:
        return await self._run(self._core.ignore(tube))

    async def peek(self, job: JobLike) -> Job:
        return await self._run(self._core.peek(job))

    async def peek_ready(self, *, tube: str | None = None) -> Job:
        return await self._run(self._core.peek_first(p.PEEK_READY, tube))

    async def peek_delayed(self, *, tube: str | None = None) -> Job:
        return await self._run(self._core.peek_first(p.PEEK_DELAYED, tube))

    async def peek_buried(self, *, tube: str | None = None) -> Job:
        return await self._run(self._core.peek_first(p.PEEK_BURIED, tube))

    async def kick(self, bound: int, *, tube: str | None = None) -> int:
        return await self._run(self._core.kick(bound, tube))

    async def kick_job(self, job: JobLike) -> None:
        await self._run(self._core.kick_job(job))

    async def stats_job(self, job: JobLike) -> JobStats:
        return await self._run(self._core.stats_job(job))

    async def stats_tube(self, tube: str, *, server: str | None = None) -> TubeStats:
        return await self._run(self._core.stats_tube(tube, server))

    async def stats(self, *, server: str | None = None) -> ServerStats:
        return await self._run(self._core.stats(server))

    async def list_tubes(self) -> list[str]:
        return await self._run(self._core.list_tubes())

    async def list_tube_used(self) -> str:
        return await self._run(self._core.first_reachable(p.LIST_TUBE_USED))

    async def list_tubes_watched(self) -> list[str]:
        return await self._run(self._core.first_reachable(p.LIST_TUBES_WATCHED))

    async def pause_tube(self, tube: str, delay: int) -> None:
        await self._run(self._core.pause_tube(tube, delay))

    async def delete_tube(self, tube: str) -> None:
        await self._run(self._core.delete_tube(tube))

    async def list_jobs(self, tube: str, state: str = "ready", after: int = 0,
                        count: int = 100, *, server: str | None = None) -> list[int]:
        return await self._run(self._core.list_jobs(tube, state, after, count, server))

    async def flush_tube(self, tube: str, *, server: str | None = None) -> int:
        return await self._run(self._core.flush_tube(tube, server))
