"""Replies into results: the sans-I/O reply parser (`ReplyReader`), the typed
results (`Job`, `JobStats`, ...) and `interpret`, which turns one reply to one
command into its result or its error (docs/CLIENT.md)."""

from __future__ import annotations

from typing import Any, TypeVar

import attrs

from smallstalk.core import protocol as p

from .errors import ERRORS, Buried, ProtocolError, Unauthorized, word_of

REPLY_LINE_MAX = 1024  # a reply line is short: a word and at most two numbers or a tube name


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


@attrs.frozen
class Explanation:
    """`explain-job`'s answer: the job's state and every reason that holds now."""

    id: int
    tube: str
    state: str
    pri: int
    reasons: list[str]


def _explanation(body: bytes) -> Explanation:
    fields: dict[str, str] = {}
    reasons: list[str] = []
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("- "):
            v = line[2:].strip()
            if len(v) >= 2 and v[0] == v[-1] == '"':
                v = v[1:-1].replace('\\"', '"').replace("\\\\", "\\")
            reasons.append(v)
        elif line and line != "---" and not line.startswith("reasons:"):
            fields.update(_yaml_map(line.encode()))
    try:
        return Explanation(int(fields["id"]), fields["tube"], fields["state"],
                           int(fields["pri"]), reasons)
    except (KeyError, ValueError):
        raise ProtocolError(f"malformed explain-job reply: {body[:200]!r}") from None


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
    parts: tuple[Reply, ...] = ()  # RESERVED_BATCH: its RESERVED replies


_INSERTED, _USING, _WATCHING = word_of(p.inserted(0)), word_of(p.using("")), word_of(p.watching(0))
_KICKED, _OK = word_of(p.KICKED), word_of(p.OK)
_DUPLICATE = word_of(p.duplicate(0))  # put-unique: the key's job exists (same id: success)
_RESERVED, _FOUND = p.RESERVED_WORD, p.FOUND_WORD
_RESERVED_BATCH = b"RESERVED_BATCH"
# Words followed by a body, and their argument count ("OK" alone answers `auth`).
_WITH_BODY = {_RESERVED: 2, _FOUND: 2, _OK: 1}


class ReplyReader:
    """Incremental reply parser: `feed(bytes)`, then `next_reply()` until it returns None.

    A malformed reply raises ProtocolError; the stream is then unusable.
    """

    def __init__(self, max_body: int = p.MAX_JOB_SIZE_LIMIT) -> None:
        self.max_body = max_body
        self._buf = bytearray()
        self._head: tuple[bytes, tuple[bytes, ...], int] | None = None
        self._batch: tuple[int, list[Reply]] | None = None  # RESERVED_BATCH being read

    def feed(self, data: bytes | bytearray) -> None:
        self._buf += data

    def buffered(self) -> int:
        return len(self._buf)

    def next_reply(self) -> Reply | None:
        """The next whole reply; a RESERVED_BATCH comes as one, its RESERVED
        replies in `parts`."""
        if self._batch is None:
            one = self._next_one()
            if one is None or one.word != _RESERVED_BATCH:
                return one
            if (len(one.args) != 1 or not one.args[0].isdigit()
                    or not 1 <= int(one.args[0]) <= p.RESERVE_BATCH_MAX):
                raise ProtocolError(f"malformed RESERVED_BATCH line: {one.args!r}")
            self._batch = (int(one.args[0]), [])
        n, got = self._batch
        while len(got) < n:
            one = self._next_one()
            if one is None:
                return None
            if one.word != _RESERVED:
                raise ProtocolError(f"{one.word.decode()} inside a RESERVED_BATCH reply")
            got.append(one)
        self._batch = None
        return Reply(_RESERVED_BATCH, (b"%d" % n,), None, tuple(got))

    def _next_one(self) -> Reply | None:
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
            if nargs is None or (word == _OK and not args):
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


_COUNTED = word_of(p.counted(0))

# Success reply of each command: (word, how to build the result).
_SUCCESS: dict[type, tuple[bytes, Any]] = {
    p.Put: (_INSERTED, lambda r, s: JobRef(_int_arg(r), s)),
    p.PutUnique: (_INSERTED, lambda r, s: JobRef(_int_arg(r), s)),
    p.Reserve: (_RESERVED, _job),
    p.ReserveJob: (_RESERVED, _job),
    p.MoveJob: (b"MOVED", None),
    p.ReserveBatch: (_RESERVED_BATCH, lambda r, s: [_job(x, s) for x in r.parts]),
    p.Delete: (word_of(p.DELETED), None),
    p.Release: (word_of(p.RELEASED), None),
    p.Bury: (word_of(p.BURIED), None),
    p.Touch: (word_of(p.TOUCHED), None),
    p.Use: (_USING, lambda r, s: _name_arg(r)),
    p.Watch: (_WATCHING, lambda r, s: _int_arg(r)),
    p.Ignore: (_WATCHING, lambda r, s: _int_arg(r)),
    p.Peek: (_FOUND, _job),
    p.PeekReady: (_FOUND, _job),
    p.PeekDelayed: (_FOUND, _job),
    p.PeekBuried: (_FOUND, _job),
    p.Kick: (_KICKED, lambda r, s: _int_arg(r)),
    p.KickJob: (_KICKED, None),
    p.StatsJob: (_OK, lambda r, s: _from_yaml(JobStats, _ok_body(r))),
    p.StatsTube: (_OK, lambda r, s: _from_yaml(TubeStats, _ok_body(r))),
    p.Stats: (_OK, lambda r, s: _from_yaml(ServerStats, _ok_body(r))),
    p.ListTubes: (_OK, lambda r, s: _yaml_list(_ok_body(r))),
    p.ListTubeUsed: (_USING, lambda r, s: _name_arg(r)),
    p.ListTubesWatched: (_OK, lambda r, s: _yaml_list(_ok_body(r))),
    p.PauseTube: (word_of(p.PAUSED), None),
    p.DeleteTube: (word_of(p.DELETED), None),
    p.Auth: (_OK, None),
    p.ListJobs: (_OK, lambda r, s: [int(i) for i in _yaml_list(_ok_body(r))]),
    p.FlushTube: (word_of(p.flushed(0)), lambda r, s: _int_arg(r)),
    p.SearchJobs: (_OK, lambda r, s: [int(i) for i in _yaml_list(_ok_body(r))]),
    p.BulkJobs: (word_of(p.acted(0)), lambda r, s: _int_arg(r)),  # or COUNTED (interpret)
    # The admin commands (smallstalk only; a token or a trusted address).
    p.PromoteReplica: (p.PROMOTED_WORD, lambda r, s: _int_arg(r)),
    p.ConfigDump: (_OK, lambda r, s: _ok_body(r).decode("utf-8", "replace")),
    p.ReloadConfig: (word_of(p.RELOADED), None),
    p.ExtStats: (_OK, lambda r, s: _yaml_map(_ok_body(r))),
    p.ExtStatsTube: (_OK, lambda r, s: _yaml_map(_ok_body(r))),
    p.ExplainJob: (_OK, lambda r, s: _explanation(_ok_body(r))),
}


def interpret(cmd: p.Command, reply: Reply, server: str = "") -> Any:
    """The result of `cmd` given its reply, or the error reply raised as an exception."""
    word, build = _SUCCESS[type(cmd)]
    if reply.word == word or (reply.word == _DUPLICATE and type(cmd) is p.PutUnique) or (
            reply.word == _COUNTED and type(cmd) is p.BulkJobs):
        return None if build is None else build(reply, server)
    error = ERRORS.get(reply.word)
    if error is Buried:
        job_id = int(reply.args[0]) if reply.args and reply.args[0].isdigit() else getattr(
            cmd, "id", None)
        raise Buried(server, "", job_id)
    if error is not None:
        said = b" ".join(reply.args).decode("utf-8", "replace")
        if said:  # the server's own words: why a reload failed, how to get admin rights
            raise error(server, said, said=said)
        if error is Unauthorized and type(cmd) is not p.Auth:
            raise Unauthorized(server, "an admin command: connect with the admin token")
        raise error(server)
    raise ProtocolError(f"unexpected reply to {type(cmd).__name__}: "
                        f"{b' '.join((reply.word, *reply.args))!r}")


# --- addresses and argument checks ----------------------------------------
