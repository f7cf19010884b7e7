# cython: annotation_typing=False
# (For the compiled build, tools/compile.py: these `bytes` annotations also
# take bytearray slices, which a typed argument would refuse.)
"""kestrel's memcache dialect as a pure state machine over bytes (no sockets, no trio).

Theory of operation, as core/parser.py does it for beanstalkd: a `Parser` is
fed whatever bytes a socket produced (`feed`) and hands back complete events
(`events`): a command object below, or an `McError` carrying the exact line to
answer. The replies are rendered here too (`value`, `stat_lines`, ...).

The dialect is kestrel 2.x's (its guide's "Memcache" section, and what its
MemcacheHandler answers):

- `set <queue> <flags> <expiry> <bytes> [noreply]` + body: enqueue. Flags are
  ignored; expiry is memcache's (seconds from now below 1,000,000, a Unix
  time above, 0 for never).
- `get <queue>[/t=<ms>][/open][/close][/abort][/peek]` (`gets` alike, with
  the job's id as memcache's cas field; keys after the first are ignored, as
  kestrel does): dequeue, wait, reliable reads. `/peek` or `/abort` with `/open` or `/close`, `/peek` with
  `/abort`, or no queue name: `CLIENT_ERROR`, then the connection closes.
- `delete <queue>`, `flush <queue>`, `flush_all`, `stats`, `dump_stats
  [queue ...]`, `version`, `shutdown`, `reload`, `quit`; and smallstalk's
  `auth <token>` (the beanstalkd port's, for the admin commands).

Rules kept here:

- A line ends with LF (CRLF as memcache sends it; a bare LF is taken too, as
  memcached does) and is at most LINE_MAX bytes including it. A longer line
  is answered `CLIENT_ERROR line too long` and ends the connection: past it
  nothing says where a body would end.
- A command this dialect does not have, or a `set` line that does not parse,
  is fatal the same way (kestrel answers `CLIENT_ERROR` and disconnects).
- A body larger than the job size limit is skipped without being buffered and
  answered `NOT_STORED` (kestrel's answer for an item it will not take); a
  body not followed by CRLF is `CLIENT_ERROR bad data chunk`, fatal.
- Queue names are beanstalkd tube names (so that a job can cross between the
  two ports) without `/`, which separates the options.

Memory is bounded: the parser holds at most one line (LINE_MAX) or one body
(max job size + 2) of unparsed input. After a fatal error it takes no more.
"""

from __future__ import annotations

import attrs

from smallstalk.core.commands import Auth
from smallstalk.core.lines import DEFAULT_MAX_JOB_SIZE, U32_MAX, valid_tube_name
from smallstalk.core.parser import NO_LIMIT, TAKE_MAX

LINE_MAX = 2048  # bytes, including the line end: a key (250) with options, with room
EXPIRY_ABSOLUTE = 1_000_000  # memcache: an expiry from here on is a Unix time

STORED = b"STORED\r\n"
NOT_STORED = b"NOT_STORED\r\n"
END = b"END\r\n"
DELETED = b"DELETED\r\n"
ERROR = b"ERROR\r\n"
FLUSHED_ALL = b"Flushed all queues.\r\n"  # kestrel's words
RELOADED = b"Reloaded config.\r\n"  # kestrel's words

# The queue name is followed by options; `/` cannot be part of it.
NAME_ERROR = (b"CLIENT_ERROR bad queue name (up to 200 letters, digits and -+;.$_(), "
              b"not starting with -)\r\n")


def client_error(why: str) -> bytes:
    return b"CLIENT_ERROR " + why.encode("ascii", "replace") + b"\r\n"


def server_error(why: str) -> bytes:
    return b"SERVER_ERROR " + why.encode("ascii", "replace") + b"\r\n"


@attrs.frozen(slots=True)
class McSet:
    queue: str
    expiry: int  # as the client sent it (memcache's meaning), 0: never
    body: bytes
    noreply: bool = False
    too_big: bool = False  # the body was larger than the limit (skipped)


@attrs.frozen(slots=True)
class McGet:
    queue: str
    timeout_ms: int | None = None  # /t=<ms>: wait that long for an item
    open: bool = False
    close: bool = False
    abort: bool = False
    peek: bool = False
    # The key as the client sent it, options and all: the VALUE line names it
    # (kestrel named the queue alone; clients that check the key need this).
    key: bytes = b""
    cas: bool = False  # `gets`: the VALUE line carries a cas number (the job's id)


@attrs.frozen(slots=True)
class McDelete:
    queue: str
    noreply: bool = False


@attrs.frozen(slots=True)
class McFlush:
    queue: str
    noreply: bool = False


@attrs.frozen(slots=True)
class McFlushAll:
    noreply: bool = False


@attrs.frozen(slots=True)
class McStats:
    pass


@attrs.frozen(slots=True)
class McDumpStats:
    queues: tuple[str, ...] = ()  # none: every queue


@attrs.frozen(slots=True)
class McVersion:
    pass


@attrs.frozen(slots=True)
class McShutdown:
    pass


@attrs.frozen(slots=True)
class McReload:
    pass


@attrs.frozen(slots=True)
class McQuit:
    pass


@attrs.frozen(slots=True)
class McError:
    """Malformed input: answer `reply`; `fatal`: then close the connection."""

    reply: bytes
    fatal: bool = False


McCommand = (McSet | McGet | McDelete | McFlush | McFlushAll | McStats | McDumpStats
             | McVersion | McShutdown | McReload | McQuit | Auth)
McEvent = McCommand | McError
QUIT = McQuit()


def valid_queue_name(name: bytes) -> bool:
    return b"/" not in name and valid_tube_name(name)


def parse_get(key: bytes, cas: bool = False) -> McGet | McError:
    """`queue/opt/opt...` as kestrel reads it (unknown options are ignored);
    `cas`: asked with `gets`."""
    name, *opts = key.split(b"/")
    timeout = None
    flags = {b"open": False, b"close": False, b"abort": False, b"peek": False}
    for opt in opts:
        if opt.startswith(b"t="):
            digits = opt[2:]
            if not digits.isdigit() or len(digits) > 10 or int(digits) > U32_MAX:
                return McError(client_error("bad /t= timeout (milliseconds)"), True)
            timeout = int(digits)
        elif opt in flags:
            flags[opt] = True
    opening, closing, aborting, peeking = flags.values()
    if not name or ((peeking or aborting) and (opening or closing)) or (peeking and aborting):
        return McError(client_error("bad option combination" if name else "no queue name"),
                       True)
    if not valid_queue_name(name):
        return McError(NAME_ERROR)
    return McGet(name.decode("ascii"), timeout, opening, closing, aborting, peeking, key, cas)


def _noreply(args: list[bytes], at: int) -> bool:
    return len(args) > at and args[-1] == b"noreply"


def _queue_command(cls: type, args: list[bytes]) -> McEvent:
    if len(args) < 2:
        return McError(client_error("no queue name"))
    if not valid_queue_name(args[1]):  # under noreply, no answer even to this
        return McError(b"" if _noreply(args, 2) else NAME_ERROR)
    return cls(args[1].decode("ascii"), _noreply(args, 2))


@attrs.frozen(slots=True)
class _SetHeader:
    queue: str | None  # None: a bad name (the body is read, then refused)
    expiry: int
    size: int
    noreply: bool


def _int(text: bytes, signed: bool = False) -> int | None:
    neg = signed and text.startswith(b"-")
    digits = text[1:] if neg else text
    if not digits.isdigit() or len(digits) > 10:
        return None
    value = int(digits)
    return -value if neg else value


def _parse_set(args: list[bytes]) -> _SetHeader | McError:
    if len(args) not in (5, 6) or (len(args) == 6 and args[5] != b"noreply"):
        return McError(client_error("bad command line format"), True)
    flags, expiry, size = _int(args[2]), _int(args[3], signed=True), _int(args[4])
    if flags is None or expiry is None or size is None or flags > U32_MAX or size > U32_MAX:
        return McError(client_error("bad command line format"), True)
    name = args[1].decode("ascii") if valid_queue_name(args[1]) else None
    return _SetHeader(name, expiry, size, len(args) == 6)


def parse_line(line: bytes) -> McEvent | _SetHeader:
    """One command line (without its line end) to an event or a set header."""
    args = line.split()
    if not args:
        return McError(ERROR)
    word = args[0].lower()
    if word == b"set":
        return _parse_set(args)
    if word in (b"get", b"gets"):
        if len(args) < 2:
            return McError(client_error("no queue name"), True)
        return parse_get(args[1], word == b"gets")
    if word == b"delete":
        return _queue_command(McDelete, args)
    if word == b"flush":
        return _queue_command(McFlush, args)
    if word == b"flush_all":
        return McFlushAll(_noreply(args, 1))
    if word == b"stats":
        return McStats()
    if word == b"dump_stats":
        names = args[1:]
        if not all(valid_queue_name(n) for n in names):
            return McError(NAME_ERROR)
        return McDumpStats(tuple(n.decode("ascii") for n in names))
    if word == b"version":
        return McVersion()
    if word == b"shutdown":
        return McShutdown()
    if word == b"reload":
        return McReload()
    if word == b"quit":
        return QUIT
    if word == b"auth":
        if len(args) != 2 or not all(0x21 <= b <= 0x7E for b in args[1]):
            return McError(client_error("auth takes one word: the admin token"))
        return Auth(args[1].decode("ascii"))
    return McError(client_error("unknown command"), True)


_LINE, _BODY, _SKIP, _DEAD = range(4)


class Parser:
    """Incremental parser for one memcache connection's input stream.

    `feed(data)` then `events()` returns every complete event so far, in order;
    `take(data)` at most TAKE_MAX of them, and sets `more` when it stopped there
    (as core/parser.py's).
    """

    __slots__ = ("_buf", "_mode", "_set", "_skip", "max_job_size", "_last_set", "_last_get",
                 "more")

    def __init__(self, max_job_size: int = DEFAULT_MAX_JOB_SIZE) -> None:
        self.max_job_size = max_job_size
        self._buf = bytearray()
        self._mode = _LINE
        self._set: _SetHeader | None = None
        self._skip = 0  # body bytes still to throw away in _SKIP mode
        # A client repeats its lines (a producer's `set q 0 0 <size>`, a
        # worker's `get q/t=<ms>`), and both parse to frozen values: the last
        # set and get lines and what they parsed to are used again when the
        # same bytes come, without `parse_line`. A line never holds b"\n".
        self._last_set: tuple[bytes, _SetHeader | None] = (b"\n", None)
        self._last_get: tuple[bytes, McGet | None] = (b"\n", None)
        self.more = False

    def buffered(self) -> int:
        """Bytes held: not yet a complete event, or more than `take` returned."""
        return len(self._buf)

    @property
    def ended(self) -> bool:
        """A fatal error or `quit` was parsed: nothing after it is read."""
        return self._mode == _DEAD

    def take(self, data: bytes) -> tuple[list[McEvent], int]:
        """`feed(data)`, then `events()` and `buffered()` (as protocol.Parser.take)."""
        if self._mode == _LINE:  # the everyday case, feed's test inlined
            self._buf += data
        else:
            self.feed(data)
        return self.events(TAKE_MAX), len(self._buf)

    def feed(self, data: bytes) -> None:
        if self._mode == _DEAD:
            return
        if self._mode == _SKIP and not self._buf:
            take = min(self._skip, len(data))  # an oversized body is never held
            self._skip -= take
            data = data[take:]
        self._buf += data

    def events(self, limit: int = NO_LIMIT) -> list[McEvent]:
        """The complete events so far, in order (at most `limit`: `more`)."""
        out: list[McEvent] = []
        buf = self._buf
        pos, n = 0, len(buf)
        self.more = False
        while self._mode != _DEAD:
            if len(out) >= limit:
                self.more = True
                break
            mode = self._mode
            if mode == _LINE:
                end = buf.find(b"\n", pos, pos + LINE_MAX)
                if end < 0:
                    if n - pos >= LINE_MAX:
                        out.append(McError(client_error("line too long"), True))
                        self._mode = _DEAD
                    break
                line = bytes(buf[pos:end])
                pos = end + 1
                if line.endswith(b"\r"):
                    line = line[:-1]
                if line == self._last_set[0]:
                    ev = self._last_set[1]
                elif line == self._last_get[0]:
                    ev = self._last_get[1]
                else:
                    ev = parse_line(line)
                    if type(ev) is _SetHeader:
                        self._last_set = (line, ev)
                    elif type(ev) is McGet:
                        self._last_get = (line, ev)
                if type(ev) is _SetHeader:
                    if ev.size > self.max_job_size:
                        self._mode = _SKIP
                        self._skip = ev.size  # then its CRLF, checked as a body's
                        self._set = ev
                    else:
                        self._mode = _BODY
                        self._set = ev
                    continue
                out.append(ev)
                if ev is QUIT or (type(ev) is McError and ev.fatal):
                    self._mode = _DEAD
            elif mode == _BODY:
                hdr = self._set
                need = hdr.size + 2
                if n - pos < need:
                    break
                body = bytes(buf[pos:pos + hdr.size])
                ok = buf[pos + hdr.size:pos + need] == b"\r\n"
                pos += need
                self._mode = _LINE
                self._set = None
                if not ok:
                    out.append(McError(client_error("bad data chunk"), True))
                    self._mode = _DEAD
                elif hdr.queue is None:
                    out.append(McError(b"" if hdr.noreply else NAME_ERROR))
                else:
                    out.append(McSet(hdr.queue, hdr.expiry, body, hdr.noreply))
            else:  # _SKIP
                take = min(self._skip, n - pos)
                pos += take
                self._skip -= take
                if self._skip:
                    break
                if n - pos < 2:
                    break
                ok = buf[pos:pos + 2] == b"\r\n"
                pos += 2
                hdr = self._set
                self._mode = _LINE
                self._set = None
                if not ok:
                    out.append(McError(client_error("bad data chunk"), True))
                    self._mode = _DEAD
                else:
                    out.append(McSet(hdr.queue or "", hdr.expiry, b"", hdr.noreply,
                                     too_big=True))
        if self._mode == _DEAD:
            buf.clear()
        elif pos:
            del buf[:pos]
        return out


# --- replies -------------------------------------------------------------------------


def value(key: bytes, body: bytes, cas: int | None = None) -> bytes:
    """An item handed out, under the key the client asked with (see `McGet.key`);
    with `cas` (a `gets`), memcache's fifth field."""
    if cas is not None:
        return b"VALUE %s 0 %d %d\r\n%s\r\nEND\r\n" % (key, len(body), cas, body)
    return b"VALUE %s 0 %d\r\n%s\r\nEND\r\n" % (key, len(body), body)


def stat_lines(pairs: list[tuple[str, object]]) -> bytes:
    """`STATS`: memcache's `STAT <name> <value>` lines, then END."""
    return b"".join(b"STAT %s %s\r\n" % (k.encode(), _text(v)) for k, v in pairs) + END


def dump_stats(groups: list[tuple[str, list[tuple[str, object]]]]) -> bytes:
    """`DUMP_STATS`: kestrel's readable form, a block per queue, then END."""
    lines = []
    for name, pairs in groups:
        lines.append(b"queue '%s' {" % name.encode())
        lines += [b"  %s=%s" % (k.encode(), _text(v)) for k, v in pairs]
        lines.append(b"}")
    return b"".join(line + b"\r\n" for line in lines) + END


def _text(v: object) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, bool):
        return b"true" if v else b"false"
    return str(v).encode()


def render(cmd: McCommand) -> bytes:
    """A command as a client sends it (the inverse of parsing; for tests and tools)."""
    t = type(cmd)
    if t is McSet:
        return b"set %s 0 %d %d%s\r\n%s\r\n" % (cmd.queue.encode(), cmd.expiry, len(cmd.body),
                                              b" noreply" if cmd.noreply else b"", cmd.body)
    if t is McGet:
        opts = b"".join([b"/t=%d" % cmd.timeout_ms] if cmd.timeout_ms is not None else [])
        for name in ("close", "open", "abort", "peek"):
            if getattr(cmd, name):
                opts += b"/" + name.encode()
        return b"%s %s%s\r\n" % (b"gets" if cmd.cas else b"get", cmd.queue.encode(), opts)
    if t in (McDelete, McFlush):
        word = b"delete" if t is McDelete else b"flush"
        return b"%s %s%s\r\n" % (word, cmd.queue.encode(), b" noreply" if cmd.noreply else b"")
    if t is McFlushAll:
        return b"flush_all noreply\r\n" if cmd.noreply else b"flush_all\r\n"
    if t is McDumpStats:
        return b" ".join([b"dump_stats", *(q.encode() for q in cmd.queues)]) + b"\r\n"
    if t is Auth:
        return b"auth %s\r\n" % cmd.token.encode()
    return _WORDS[t] + b"\r\n"


_WORDS = {McStats: b"stats", McVersion: b"version", McShutdown: b"shutdown",
          McReload: b"reload", McQuit: b"quit"}
