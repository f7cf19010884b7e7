# cython: annotation_typing=False
# (For the compiled build, tools/compile.py: these `bytes` annotations also
# take bytearray slices, which a typed argument would refuse.)
"""The beanstalkd text protocol as a pure state machine over bytes (no sockets, no trio).

Theory of operation (in the manner of h11): a `Parser` is fed whatever bytes a socket
produced (`feed`) and hands back complete events (`events`): a command object, or an
`ErrorReply` carrying the exact bytes beanstalkd would answer for malformed input.
Commands are in commands.py, replies in replies.py.

Rules kept here, taken from beanstalkd 1.12 (prot.c) and checked against the real server:

- A command line ends with CRLF and is at most 224 bytes including it. A longer
  line is discarded in 224-byte windows up to its CRLF and answered BAD_FORMAT;
  the connection then goes on. Like beanstalkd, only the first CR of a window
  counts: a CR not followed by LF hides any line end after it in that window.
- Command names match by prefix in beanstalkd's order ("quitx" quits,
  "statsx" is BAD_FORMAT, "put" without a space is UNKNOWN_COMMAND).
- Integers are unsigned decimal; leading spaces are skipped; a value past
  2**32-1 (2**64-1 for ids) is BAD_FORMAT.
- `put` reads exactly <bytes>+2 body bytes, which must end in CRLF
  (EXPECTED_CRLF otherwise). A body larger than the job size limit is skipped
  without being buffered and answered JOB_TOO_BIG.

Memory is bounded: the parser holds at most one line (224 bytes) or one body
(max job size + 2) of unparsed input.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs

from smallstalk.core.commands import (
    CONFIG,
    EXT_STATS,
    KEY_MAX,
    LIST_JOBS_MAX,
    LIST_JOBS_STATES,
    LIST_TUBE_USED,
    LIST_TUBES,
    LIST_TUBES_WATCHED,
    PEEK_BURIED,
    PEEK_DELAYED,
    PEEK_READY,
    PROMOTE,
    QUIT,
    RELOAD_CONFIG,
    RESERVE,
    RESERVE_BATCH_MAX,
    STATS,
    Auth,
    BulkJobs,
    Bury,
    Command,
    Delete,
    DeleteTube,
    ErrorReply,
    Event,
    ExplainJob,
    ExtStatsTube,
    FlushTube,
    Ignore,
    Kick,
    KickJob,
    ListJobs,
    MoveJob,
    PauseTube,
    Peek,
    Put,
    PutUnique,
    Release,
    ReplicaAck,
    Replicate,
    Reserve,
    ReserveBatch,
    ReserveJob,
    SearchJobs,
    StatsJob,
    StatsTube,
    Touch,
    Use,
    Watch,
)
from smallstalk.core.replies import (
    BAD_FORMAT,
    EXPECTED_CRLF,
    JOB_TOO_BIG,
    UNKNOWN_COMMAND,
    bad_search,
)
from smallstalk.core.search import ACTIONS, HOWS, PATTERN_MAX, SEARCH_PAGE_MAX

try:  # the compiled build's scan of a keyed put's key (keyscan.pyx)
    from smallstalk.core import keyscan
    _KEY_SCAN = True
except ImportError:  # the pure build: _PUT_UNIQUE_KEY, the reference
    _KEY_SCAN = False
LINE_MAX = 224  # bytes, including CRLF (beanstalkd's LINE_BUF_SIZE)
# `put-unique <key> <pri> <delay> <ttr> <bytes>`: a 200-byte key and four
# 10-digit numbers do not fit beanstalkd's line, so this command of our own
# has a longer one (no beanstalkd command starts with its name).
_PUT_UNIQUE = b"put-unique "
_PUT_UNIQUE_LINE_MAX = len(_PUT_UNIQUE) + 200 + 4 * 11 + 2
# The everyday put-unique, whole line, as `_PUT_LINE` is the everyday put's.
_PUT_UNIQUE_LINE = re.compile(
    rb"put-unique ([-A-Za-z0-9+/;.$_()]{1,200}) ([0-9]{1,10}) ([0-9]{1,10}) ([0-9]{1,10}) "
    rb"([0-9]{1,10})\r\n")
# A put-unique's key alone: `take` matches the rest of the line against the
# last put-unique line's rest (`Parser._last_unique`), as it does a put's line.
# (Faster than a find and `bytes.translate` of the key chars, pure or compiled.)
_PUT_UNIQUE_KEY = re.compile(rb"put-unique ([-A-Za-z0-9+/;.$_()]{1,200})")
TUBE_NAME_MAX = 200
# `search-jobs` and `bulk-jobs` name up to two tubes of 200 bytes: their lines
# may be longer than beanstalkd's (no beanstalkd command starts with their names).
_SEARCH_LINES = (b"search-jobs ", b"bulk-jobs ")
_SEARCH_LINE_MAX = 480
DEFAULT_MAX_JOB_SIZE = 65535
MAX_JOB_SIZE_LIMIT = 1073741824  # beanstalkd's JOB_DATA_SIZE_LIMIT_MAX
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

NAME_CHARS = frozenset(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-+/;.$_()"
)


def valid_tube_name(name: bytes) -> bool:
    return (
        0 < len(name) <= TUBE_NAME_MAX
        and name[0] != 0x2D  # '-'
        and all(c in NAME_CHARS for c in name)
    )


class _Bad(Exception):
    pass


class _BadCounted(_Bad):
    """BAD_FORMAT, but beanstalkd has already counted the command."""

    def __init__(self, counted_as: type):
        self.counted_as = counted_as


_UINT = re.compile(rb" *([0-9]+)")
_PUT = re.compile(rb"put +([0-9]+) +([0-9]+) +([0-9]+) +([0-9]+)")
# The everyday put, whole line and CRLF, matched in the input buffer itself: digits and
# single spaces hold no CR, so beanstalkd's line rules agree when the line fits its window.
_PUT_LINE = re.compile(rb"put ([0-9]{1,10}) ([0-9]{1,10}) ([0-9]{1,10}) ([0-9]{1,10})\r\n")
# `Parser._last` before any put: a line and its true numbers (a repeat gets the regex's answer).
_FIRST_PUT = (b"put 0 0 1 0\r\n", 0, 0, 1, 0)
# ...and `Parser._last_unique` before any put-unique: what follows a key, likewise.
_FIRST_UNIQUE = (b" 0 0 1 0\r\n", 0, 0, 1, 0)


def _read_uint(line: bytes, pos: int, limit: int, to_end: bool) -> tuple[int, int]:
    """beanstalkd's read_u32/read_u64: skip spaces, digits, bounded value."""
    m = _UINT.match(line, pos)
    if m is None:
        raise _Bad
    end = m.end()
    if to_end and end != len(line):
        raise _Bad
    value = int(m.group(1))
    if value > limit:
        raise _Bad
    return value, end


def _strtoul_u32(text: bytes) -> int:
    """`kick`'s bound as beanstalkd reads it: C strtoul, then cast to uint32."""
    s = text.lstrip(b" \t\n\v\f\r")
    neg = False
    if s[:1] in (b"+", b"-"):
        neg = s[:1] == b"-"
        s = s[1:]
    digits = len(s) - len(s.lstrip(b"0123456789"))
    if digits == 0:
        raise _Bad
    value = int(s[:digits])
    if value > U64_MAX:
        raise _Bad  # ERANGE
    if neg:
        value = (-value) % 2**64
    return value & U32_MAX


def _p_list_jobs(rest: bytes) -> Command:
    parts = rest.split(b" ")
    if (len(parts) != 4 or not valid_tube_name(parts[0])
            or parts[1].decode("ascii", "replace") not in LIST_JOBS_STATES):
        raise _Bad
    after, _ = _read_uint(parts[2], 0, U64_MAX, True)
    count, _ = _read_uint(parts[3], 0, U32_MAX, True)
    return ListJobs(parts[0].decode("ascii"), parts[1].decode("ascii"), after,
                    min(count, LIST_JOBS_MAX))


def _tube(rest: bytes) -> str:
    if not valid_tube_name(rest):
        raise _Bad
    return rest.decode("ascii")


# Parsers for commands whose name is followed by a space and arguments.
def _p_peek(rest: bytes) -> Command:
    return Peek(_read_uint(rest, 0, U64_MAX, True)[0])


def _p_reserve_timeout(rest: bytes) -> Command:
    """beanstalkd 1.12 reads the timeout with strtol and keeps it in an int.

    So junk reads as 0, values wrap to 32 bits, and a negative result means
    no timeout at all; only a value past the range of a long is BAD_FORMAT.
    """
    s = rest.lstrip(b" \t\n\v\f\r")
    neg = s[:1] == b"-"
    if s[:1] in (b"+", b"-"):
        s = s[1:]
    digits = len(s) - len(s.lstrip(b"0123456789"))
    value = int(s[:digits]) if digits else 0
    if neg:
        value = -value
    if not -(2**63) <= value <= 2**63 - 1:
        raise _Bad  # ERANGE
    value &= 0xFFFFFFFF
    if value >= 2**31:
        return RESERVE  # negative as an int: wait without a timeout
    return Reserve(value)


def _p_reserve_job(rest: bytes) -> Command:
    return ReserveJob(_read_uint(rest, 0, U64_MAX, True)[0])


def _p_delete(rest: bytes) -> Command:
    return Delete(_read_uint(rest, 0, U64_MAX, True)[0])


def _p_release(rest: bytes) -> Command:
    job_id, pos = _read_uint(rest, 0, U64_MAX, False)
    pri, pos = _read_uint(rest, pos, U32_MAX, False)
    delay, _ = _read_uint(rest, pos, U32_MAX, True)
    return Release(job_id, pri, delay)


def _p_bury(rest: bytes) -> Command:
    job_id, pos = _read_uint(rest, 0, U64_MAX, False)
    pri, _ = _read_uint(rest, pos, U32_MAX, True)
    return Bury(job_id, pri)


def _p_kick(rest: bytes) -> Command:
    return Kick(_strtoul_u32(rest))


def _p_kick_job(rest: bytes) -> Command:
    return KickJob(_read_uint(rest, 0, U64_MAX, True)[0])


def _p_touch(rest: bytes) -> Command:
    return Touch(_read_uint(rest, 0, U64_MAX, True)[0])


def _p_stats_job(rest: bytes) -> Command:
    return StatsJob(_read_uint(rest, 0, U64_MAX, True)[0])


def _p_pause_tube(rest: bytes) -> Command:
    pos, n = 0, len(rest)
    while pos < n and rest[pos] == 0x20:
        pos += 1
    start = pos
    while pos < n and rest[pos] in NAME_CHARS:
        pos += 1
    if pos == start:
        raise _Bad
    delay, _ = _read_uint(rest, pos, U32_MAX, True)
    name = rest[start:pos]
    if not valid_tube_name(name):
        raise _BadCounted(PauseTube)
    return PauseTube(name.decode("ascii"), delay)


def _p_replicate(rest: bytes) -> Command:
    parts = rest.split(b" ")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[2].isdigit():
        raise _Bad
    history = parts[1].decode("ascii", "replace")
    return Replicate(int(parts[0]), "" if history == "-" else history, int(parts[2]))


def _p_put_expiring(line: bytes, max_job_size: int) -> _PutHeader:
    """`put-expiring <pri> <delay> <ttr> <max-age> <bytes>`: a put whose job expires."""
    pri, pos = _read_uint(line, len(b"put-expiring "), U32_MAX, False)
    delay, pos = _read_uint(line, pos, U32_MAX, False)
    ttr, pos = _read_uint(line, pos, U32_MAX, False)
    max_age, pos = _read_uint(line, pos, U32_MAX, False)
    size, _ = _read_uint(line, pos, U32_MAX, True)
    if size > max_job_size:
        return _PutHeader(pri, delay, ttr, -size)  # skip the body
    return _PutHeader(pri, delay, max(ttr, 1), size, max_age)


def _p_put_unique(line: bytes, max_job_size: int) -> _PutHeader:
    """`put-unique <key> <pri> <delay> <ttr> <bytes>`: a put with an idempotency key."""
    key, space, rest = line[len(_PUT_UNIQUE):].partition(b" ")
    if not space or not valid_key(key):
        raise _Bad
    pri, pos = _read_uint(rest, 0, U32_MAX, False)
    delay, pos = _read_uint(rest, pos, U32_MAX, False)
    ttr, pos = _read_uint(rest, pos, U32_MAX, False)
    size, _ = _read_uint(rest, pos, U32_MAX, True)
    if size > max_job_size:
        return _PutHeader(pri, delay, ttr, -size)  # skip the body
    return _PutHeader(pri, delay, max(ttr, 1), size, 0, key.decode("ascii"))


def valid_key(key: bytes) -> bool:
    """An idempotency key: 1 to 200 bytes of the characters tube names use."""
    return 0 < len(key) <= KEY_MAX and all(c in NAME_CHARS for c in key)


def _p_search(line: bytes) -> _PutHeader | ErrorReply:
    """`search-jobs <tube> <state> <how> <after-id> <count> <bytes>` or
    `bulk-jobs <tube> <state> <how> <action> <target> <max> <bytes>`, the
    pattern as a body. The byte count is read first: once it is known, the
    body is read (or skipped, when too long) whatever else is wrong with the
    line, so no pattern byte is ever taken for a command."""
    head, _, size_text = line.rpartition(b" ")
    size, _ = _read_uint(size_text, 0, U32_MAX, True)  # unreadable: BAD_FORMAT, no body
    if size > PATTERN_MAX:
        return _PutHeader(0, 0, 0, -size, skip_reply=ErrorReply(
            bad_search(f"pattern longer than {PATTERN_MAX} bytes")))
    try:
        cmd = _search_command(head)
    except _Bad:
        return _PutHeader(0, 0, 0, size, make=ErrorReply(BAD_FORMAT))
    return _PutHeader(0, 0, 0, size, make=cmd)


def _search_command(head: bytes) -> Command:
    word, _, rest = head.partition(b" ")
    parts = rest.split(b" ")
    n = 5 if word == b"search-jobs" else 6
    if len(parts) != n or not valid_tube_name(parts[0]):
        raise _Bad
    tube, state, how = (x.decode("ascii", "replace") for x in parts[:3])
    if state not in LIST_JOBS_STATES or how not in HOWS:
        raise _Bad
    if n == 5:
        after, _ = _read_uint(parts[3], 0, U64_MAX, True)
        count, _ = _read_uint(parts[4], 0, U32_MAX, True)
        return SearchJobs(tube, state, how, after, min(count, SEARCH_PAGE_MAX))
    action = parts[3].decode("ascii", "replace")
    target = parts[4]
    if action not in ACTIONS or (target != b"-" and not valid_tube_name(target)):
        raise _Bad
    if (action == "move") != (target != b"-"):
        raise _Bad  # a move names its tube, nothing else does
    bound, _ = _read_uint(parts[5], 0, U32_MAX, True)
    return BulkJobs(tube, state, how, action, "" if target == b"-" else target.decode("ascii"),
                    bound)


def _p_reserve_batch(rest: bytes) -> Command:
    count, pos = _read_uint(rest, 0, RESERVE_BATCH_MAX, False)
    timeout, pos = _read_uint(rest, pos, U32_MAX, True)
    if count == 0 or pos != len(rest):
        raise _Bad
    return ReserveBatch(count, timeout)


def _p_auth(rest: bytes) -> Command:
    if not rest or not all(0x21 <= b <= 0x7E for b in rest):
        raise _Bad
    return Auth(rest.decode("ascii"))


# (prefix, parser or constant), in beanstalkd's matching order. Entries whose
# prefix carries no trailing space must match the whole line exactly.
_TABLE: list[tuple[bytes, object]] = [
    (b"peek ", _p_peek),
    (b"peek-ready", PEEK_READY),
    (b"peek-delayed", PEEK_DELAYED),
    (b"peek-buried", PEEK_BURIED),
    (b"reserve-with-timeout ", _p_reserve_timeout),
    (b"reserve-job ", _p_reserve_job),
    (b"reserve", RESERVE),
    (b"delete ", _p_delete),
    (b"release ", _p_release),
    (b"bury ", _p_bury),
    (b"kick ", _p_kick),
    (b"kick-job ", _p_kick_job),
    (b"touch ", _p_touch),
    (b"stats-job ", _p_stats_job),
    (b"stats-tube ", lambda rest: StatsTube(_tube(rest))),
    (b"stats", STATS),
    (b"use ", lambda rest: Use(_tube(rest))),
    (b"watch ", lambda rest: Watch(_tube(rest))),
    (b"ignore ", lambda rest: Ignore(_tube(rest))),
    (b"list-tubes-watched", LIST_TUBES_WATCHED),
    (b"list-tube-used", LIST_TUBE_USED),
    (b"list-tubes", LIST_TUBES),
]
# Exact-match fast path for the argument-less commands, and for a worker's
# commonest line with an argument (what `_p_reserve_timeout` makes of it).
_EXACT = {prefix: cmd for prefix, cmd in _TABLE if not callable(cmd)}
_EXACT[b"reserve-with-timeout 0"] = Reserve(0)
# The same as whole reads, CRLF included: `take` looks a read up as it came.
_EXACT_READS = {line + b"\r\n": cmd for line, cmd in _EXACT.items()}


@attrs.frozen(slots=True)
class _PutHeader:
    pri: int
    delay: int
    ttr: int
    size: int
    max_age: int = 0
    key: str = ""  # put-unique
    # search-jobs, bulk-jobs: the command the body completes (or the error
    # that answers it once read), and the answer to a pattern skipped unread.
    make: object = None
    skip_reply: ErrorReply | None = None


# A worker's everyday commands in their plain form (one space between plain
# digits that cannot overflow): exactly what `_TABLE`'s parsers make of such
# lines, without trying every prefix first (tests/unit/test_protocol.py holds the
# two to the same result). Each answers None for anything else, which then
# takes the general path. `bytes.isdigit` is true for ASCII digits only, and
# for at least one: `[0-9]+`, the class `_read_uint` reads.


def _plain_id(cls: type) -> Callable[[bytes], Command | None]:
    def parse(rest: bytes) -> Command | None:
        return cls(int(rest)) if rest.isdigit() and len(rest) < 19 else None
    return parse


def _plain_reserve_timeout(rest: bytes) -> Command | None:
    return Reserve(int(rest)) if rest.isdigit() and len(rest) < 10 else None


def _plain_release(rest: bytes) -> Command | None:
    parts = rest.split(b" ")
    if len(parts) == 3:
        i, pri, delay = parts
        if (i.isdigit() and pri.isdigit() and delay.isdigit() and len(i) < 19
                and len(pri) < 10 and len(delay) < 10):
            return Release(int(i), int(pri), int(delay))
    return None


def _plain_bury(rest: bytes) -> Command | None:
    i, space, pri = rest.partition(b" ")
    if i.isdigit() and pri.isdigit() and len(i) < 19 and len(pri) < 10:
        return Bury(int(i), int(pri))
    return None


_PLAIN_ARGS: dict[bytes, Callable[[bytes], Command | None]] = {
    b"delete": _plain_id(Delete),
    b"reserve-with-timeout": _plain_reserve_timeout,
    b"release": _plain_release,
    b"bury": _plain_bury,
    b"touch": _plain_id(Touch),
}


def parse_line(line: bytes, max_job_size: int) -> Command | ErrorReply | _PutHeader:
    """One command line (without CRLF) to a command, an error, or a put header."""
    exact = _EXACT.get(line)
    if exact is not None:
        return exact
    word, space, rest = line.partition(b" ")
    plain = _PLAIN_ARGS.get(word) if space else None
    if plain is not None:
        cmd = plain(rest)
        if cmd is not None:
            return cmd
    if 0 in line:
        return ErrorReply(BAD_FORMAT)
    m = _PUT.fullmatch(line)
    if m is not None:  # the common put, without trailing oddities
        pri, delay, ttr, size = map(int, m.groups())
        if pri <= U32_MAX and delay <= U32_MAX and ttr <= U32_MAX and size <= U32_MAX:
            if size > max_job_size:
                return _PutHeader(pri, delay, ttr, -size)
            return _PutHeader(pri, delay, max(ttr, 1), size)
    try:
        if line.startswith(b"put "):
            pri, pos = _read_uint(line, 4, U32_MAX, False)
            delay, pos = _read_uint(line, pos, U32_MAX, False)
            ttr, pos = _read_uint(line, pos, U32_MAX, False)
            size, pos = _read_uint(line, pos, U32_MAX, False)
            if size > max_job_size:
                return _PutHeader(pri, delay, ttr, -size)  # skip the body
            if pos != len(line):
                return ErrorReply(BAD_FORMAT, Put)
            return _PutHeader(pri, delay, max(ttr, 1), size)
        if line.startswith(b"reserve-batch "):  # before `reserve`, which is a prefix of it
            return _p_reserve_batch(line[len(b"reserve-batch "):])
        for prefix, what in _TABLE:
            if line.startswith(prefix):
                if callable(what):
                    return what(line[len(prefix):])
                return ErrorReply(BAD_FORMAT)  # trailing garbage after a bare command
        if line.startswith(b"quit"):
            return QUIT
        if line.startswith(b"put-expiring "):
            return _p_put_expiring(line, max_job_size)
        if line.startswith(_PUT_UNIQUE):
            return _p_put_unique(line, max_job_size)
        if line.startswith(b"pause-tube"):
            return _p_pause_tube(line[len(b"pause-tube"):])
        if line.startswith(b"replicate "):
            return _p_replicate(line[len(b"replicate "):])
        if line.startswith(b"replica-ack "):
            return ReplicaAck(_read_uint(line, len(b"replica-ack "), U64_MAX, True)[0])
        if line == b"promote":
            return PROMOTE
        if line.startswith(b"delete-tube "):
            return DeleteTube(_tube(line[len(b"delete-tube "):]))
        if line.startswith(b"list-jobs "):
            return _p_list_jobs(line[len(b"list-jobs "):])
        if line.startswith(b"flush-tube "):
            return FlushTube(_tube(line[len(b"flush-tube "):]))
        if line == b"config":
            return CONFIG
        if line == b"reload-config":
            return RELOAD_CONFIG
        if line.startswith(b"auth "):
            return _p_auth(line[len(b"auth "):])
        if line == b"ext-stats":
            return EXT_STATS
        if line.startswith(b"explain-job "):
            return ExplainJob(_read_uint(line, len(b"explain-job "), U64_MAX, True)[0])
        if line.startswith(b"move-job "):
            jid, pos = _read_uint(line, len(b"move-job "), U64_MAX, False)
            if pos >= len(line) or line[pos] != 0x20:
                raise _Bad
            return MoveJob(jid, _tube(line[pos + 1:]))
        if line.startswith(_SEARCH_LINES):
            return _p_search(line)
        if line.startswith(b"ext-stats-tube "):
            return ExtStatsTube(_tube(line[len(b"ext-stats-tube "):]))
    except _BadCounted as e:
        return ErrorReply(BAD_FORMAT, e.counted_as)
    except _Bad:
        return ErrorReply(BAD_FORMAT)
    return ErrorReply(UNKNOWN_COMMAND)


_LINE, _BODY, _SKIP, _DISCARD = range(4)


class Parser:
    """Incremental parser for one connection's input stream.

    `feed(data)` then `events()` returns every complete event so far, in order.
    """

    __slots__ = ("_buf", "_mode", "_put", "_skip", "max_job_size", "_last", "_skip_reply",
                 "_last_unique", "_exact_read", "_exact_cmd")

    def __init__(self, max_job_size: int = DEFAULT_MAX_JOB_SIZE) -> None:
        self.max_job_size = max_job_size
        self._buf = bytearray()
        self._mode = _LINE
        self._put: _PutHeader | None = None
        self._skip = 0  # body bytes still to throw away in _SKIP mode
        self._skip_reply: ErrorReply | None = None  # its answer, when not JOB_TOO_BIG
        # The last everyday put line that passed, whole, and its numbers: a producer repeats
        # it, and matching its bytes skips the regex and the ints (a third of a put's parse).
        self._last: tuple[bytes, int, int, int, int] = _FIRST_PUT
        self._last_unique: tuple[bytes, int, int, int, int] = _FIRST_UNIQUE
        self._exact_read, self._exact_cmd = b"", None  # take's last exact read, likewise

    def buffered(self) -> int:
        """Bytes held that do not yet form a complete event."""
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        if self._mode == _SKIP and not self._buf:
            # Throw away an oversized body without ever holding it.
            take = min(self._skip, len(data))
            self._skip -= take
            data = data[take:]
        self._buf += data

    def take(self, data: bytes) -> tuple[list[Event], int]:
        """`feed(data)`, then `events()` and `buffered()`: a connection's read in one call.

        A read that is exactly one command, with nothing held before it (a
        request/response client's every read), is answered from `data` itself:
        a repeat of the last put line with its body, a put-unique whose line after the
        key repeats the last one's, or one line whose only CR is its CRLF and that fits
        the window (so `events` would find the same line end). Anything else, and a
        line that starts a put, goes the general way (tests/unit/test_protocol.py
        holds the two to the same events)."""
        mode = self._mode
        if mode == _LINE and not self._buf:
            n = len(data)
            last = self._last
            line = last[0]
            stop = len(line)
            raw = data  # compiled, a char pointer: its slices are bytes made in place
            if n == stop + last[4] + 2 and data[-1] == 0x0A and data[-2] == 0x0D \
                    and raw[:stop] == line:
                # Put(last[1], last[2], last[3], body) without __init__'s call: cheaper
                # interpreted, and compiled a direct allocation.
                put: Put = Put.__new__(Put)
                put.pri, put.delay, put.ttr = last[1], last[2], last[3]
                put.body = raw[stop:n - 2]
                put.max_age = 0
                return [put], 0
            if n > 11 and data[3] == 0x2D and data[-1] == 0x0A:
                # A put-unique with its body: a new key, the rest of the line most often the last's.
                if _KEY_SCAN:
                    end = keyscan.key_end(data, 11) if raw[:11] == _PUT_UNIQUE else 11
                else:
                    m = _PUT_UNIQUE_KEY.match(data)
                    end = m.end() if m is not None else 11
                if end > 11:  # a key
                    rest, pri, delay, ttr, size = self._last_unique
                    stop = end + len(rest)
                    if n == stop + size + 2 and data[-2] == 0x0D and raw[end:stop] == rest:
                        keyed: PutUnique = PutUnique.__new__(PutUnique)  # as Put's, above
                        keyed.key = raw[11:end].decode("ascii")
                        keyed.pri, keyed.delay, keyed.ttr = pri, delay, ttr
                        keyed.body = raw[stop:n - 2]
                        return [keyed], 0
            elif 1 < n <= LINE_MAX and data[-1] == 0x0A and data[-2] == 0x0D:
                if n > 9 and data[0] == 0x64 and raw[:7] == b"delete ":
                    # A worker's every other line, first: parse_line's way (the exact lines'
                    # lookup, a partition, the argument parsers' table) costs more than this.
                    rest = raw[7:n - 2]
                    if rest.isdigit() and len(rest) < 19:
                        return [Delete(int(rest))], 0
                # A worker repeats its reserve: compared with the last exact read, where
                # the lookup would hash each new read.
                exact = self._exact_cmd if data == self._exact_read else _EXACT_READS.get(data)
                if exact is not None:
                    self._exact_read, self._exact_cmd = data, exact
                    return [exact], 0
                line = raw[:n - 2]
                if 13 not in line:  # (a memchr: `find` parses its arguments first)
                    ev = parse_line(line, self.max_job_size)
                    if type(ev) is not _PutHeader:
                        return [ev], 0
        if mode == _SKIP and not self._buf:
            self.feed(data)
        else:
            self._buf += data
        return self.events(), len(self._buf)

    def events(self) -> list[Event]:
        out: list[Event] = []
        buf = self._buf
        pos = 0
        n = len(buf)
        put_line = _PUT_LINE.match
        max_size = self.max_job_size
        last = self._last
        while True:
            mode = self._mode
            lim = LINE_MAX
            if mode == _LINE and pos < n and buf[pos] == 0x70:  # b"p": a put's fast paths
                if buf.startswith(last[0], pos):
                    line, pri, delay, ttr, size = last
                    stop = pos + len(line)
                    if n - stop >= size + 2 and buf[stop + size:stop + size + 2] == b"\r\n":
                        same: Put = Put.__new__(Put)  # as in `take`
                        same.pri, same.delay, same.ttr = pri, delay, ttr
                        same.body = bytes(buf[stop:stop + size])
                        same.max_age = 0
                        out.append(same)
                        pos = stop + size + 2
                        continue
                # `put-unique` (a '-' after "put"): its key differs line to line,
                # so the last line never matches; its own regex, not the put's.
                m = None if n - pos > 3 and buf[pos + 3] == 0x2D else put_line(buf, pos)
                if m is not None:
                    stop = m.end()
                    pri, delay, ttr, size = map(int, m.groups())
                    if (stop - pos <= LINE_MAX and size <= max_size and pri <= U32_MAX
                            and delay <= U32_MAX and ttr <= U32_MAX
                            and n - stop >= size + 2 and buf[stop + size:stop + size + 2] == b"\r\n"):
                        ttr = ttr or 1
                        out.append(Put(pri, delay, ttr, bytes(buf[stop:stop + size])))
                        last = self._last = (bytes(buf[pos:stop]), pri, delay, ttr, size)
                        pos = stop + size + 2
                        continue
                if buf.startswith(_PUT_UNIQUE, pos):
                    m = _PUT_UNIQUE_LINE.match(buf, pos)
                    if m is not None:
                        stop = m.end()
                        key, pri, delay, ttr, size = m.groups()
                        pri, delay, ttr, size = int(pri), int(delay), int(ttr), int(size)
                        if (size <= max_size and pri <= U32_MAX and delay <= U32_MAX
                                and ttr <= U32_MAX and n - stop >= size + 2
                                and buf[stop + size:stop + size + 2] == b"\r\n"):
                            ttr = ttr or 1
                            out.append(PutUnique(key.decode("ascii"), pri, delay, ttr,
                                                 bytes(buf[stop:stop + size])))
                            self._last_unique = (bytes(buf[m.end(1):stop]), pri, delay, ttr,
                                                 size)
                            pos = stop + size + 2
                            continue
                    lim = _PUT_UNIQUE_LINE_MAX
            if mode == _LINE or mode == _DISCARD:
                # Where the line at `pos` ends, as beanstalkd finds it: it reads
                # a line into a 224-byte buffer and looks only at the first CR in
                # it, not counting the buffer's last byte; a first CR not followed
                # by LF means no line in this window. Less than a window: wait
                # for more bytes; a full window and no line: discard it.
                w = n - pos
                if w > lim:
                    w = lim
                end = buf.find(b"\r", pos, pos + w - 1)
                if end < 0 or buf[end + 1] != 0x0A:
                    if w < lim:
                        break  # wait for more bytes
                    end = -1
                    if mode == _LINE and lim == LINE_MAX and buf.startswith(_SEARCH_LINES, pos):
                        # Our search commands' longer line: look again in its window.
                        w = min(n - pos, _SEARCH_LINE_MAX)
                        end = buf.find(b"\r", pos, pos + w - 1)
                        if end < 0 or buf[end + 1] != 0x0A:
                            if w < _SEARCH_LINE_MAX:
                                break
                            end = -1
                            lim = _SEARCH_LINE_MAX
                if end < 0:  # a full window and no line: drop it, keep dropping
                    pos += lim
                    self._mode = _DISCARD
                    continue
                if mode == _DISCARD:
                    pos = end + 2
                    self._mode = _LINE
                    out.append(ErrorReply(BAD_FORMAT))
                    continue
                line = bytes(buf[pos:end])
                pos = end + 2
                ev = parse_line(line, self.max_job_size)
                if type(ev) is _PutHeader:
                    if ev.size < 0:
                        self._mode = _SKIP
                        self._skip = -ev.size + 2
                        self._skip_reply = ev.skip_reply
                        self._put = None
                    else:
                        self._mode = _BODY
                        self._put = ev
                    continue
                out.append(ev)
                if ev is QUIT:
                    pos = n  # nothing after quit matters
                    break
            elif mode == _BODY:
                put = self._put
                need = put.size + 2
                if n - pos < need:
                    break
                body = bytes(buf[pos:pos + put.size])
                trailer = buf[pos + put.size:pos + need]
                pos += need
                self._mode = _LINE
                self._put = None
                if put.make is not None:  # search-jobs, bulk-jobs
                    if trailer != b"\r\n":
                        out.append(ErrorReply(EXPECTED_CRLF))
                    elif type(put.make) is ErrorReply:
                        out.append(put.make)
                    else:
                        out.append(attrs.evolve(put.make, pattern=body))
                elif trailer != b"\r\n":
                    out.append(ErrorReply(EXPECTED_CRLF, Put))
                elif put.key:
                    out.append(PutUnique(put.key, put.pri, put.delay, put.ttr, body))
                else:
                    out.append(Put(put.pri, put.delay, put.ttr, body, put.max_age))
            elif mode == _SKIP:
                take = min(self._skip, n - pos)
                pos += take
                self._skip -= take
                if self._skip:
                    break
                self._mode = _LINE
                out.append(self._skip_reply or ErrorReply(JOB_TOO_BIG, Put))
                self._skip_reply = None
        if pos:
            del buf[:pos]
        return out
