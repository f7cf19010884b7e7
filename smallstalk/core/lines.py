# cython: annotation_typing=False
# (For the compiled build, tools/compile.py: as in parser.py, these `bytes`
# annotations are not types.)
"""One command line, without its CRLF, to the command it names: beanstalkd's argument rules.

`parse_line` is what core/parser.py calls for each line it frames that its
fast paths do not answer: it returns a command (commands.py), an `ErrorReply`
with the exact bytes beanstalkd would answer, or a `_PutHeader` that tells the
parser how many body bytes follow. Pure: bytes in, values out.

Rules kept here, taken from beanstalkd 1.12 (prot.c) and checked against the real server:

- Command names match by prefix in beanstalkd's order ("quitx" quits,
  "statsx" is BAD_FORMAT, "put" without a space is UNKNOWN_COMMAND).
- Integers are unsigned decimal; leading spaces are skipped; a value past
  2**32-1 (2**64-1 for ids) is BAD_FORMAT. `reserve-with-timeout` and `kick`
  read theirs as beanstalkd's strtol and strtoul do.
- Tube names are 1 to 200 of beanstalkd's name characters, not starting with '-'.
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
from smallstalk.core.replies import BAD_FORMAT, UNKNOWN_COMMAND, bad_search
from smallstalk.core.search import ACTIONS, HOWS, PATTERN_MAX, SEARCH_PAGE_MAX

# `put-unique <key> <pri> <delay> <ttr> <bytes>`: a 200-byte key and four
# 10-digit numbers do not fit beanstalkd's line, so this command of our own
# has a longer one, which parser.py frames (no beanstalkd command starts with its name).
_PUT_UNIQUE = b"put-unique "
TUBE_NAME_MAX = 200
# `search-jobs` and `bulk-jobs` name up to two tubes of 200 bytes: their lines
# may be longer than beanstalkd's (no beanstalkd command starts with their names).
_SEARCH_LINES = (b"search-jobs ", b"bulk-jobs ")
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
        return _TIMED_FOREVER  # negative as an int: wait without a timeout
    return Reserve(value)


# What a negative `reserve-with-timeout` parses to: it waits as `reserve` does,
# and counts as beanstalkd counts it, in cmd-reserve-with-timeout.
_TIMED_FOREVER = Reserve(-1)


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


def _read_u32s(line: bytes, pos: int, n: int) -> tuple[list[int], int]:
    """`n` u32 arguments from `pos` (each as `_read_uint` reads it), and
    where the last ends: a put's numbers. The caller decides what may follow."""
    values = []
    for _ in range(n):
        value, pos = _read_uint(line, pos, U32_MAX, False)
        values.append(value)
    return values, pos


def _p_put_expiring(line: bytes, max_job_size: int) -> _PutHeader:
    """`put-expiring <pri> <delay> <ttr> <max-age> <bytes>`: a put whose job expires."""
    (pri, delay, ttr, max_age, size), pos = _read_u32s(line, len(b"put-expiring "), 5)
    if pos != len(line):
        raise _Bad
    if size > max_job_size:
        return _PutHeader(pri, delay, ttr, -size)  # skip the body
    return _PutHeader(pri, delay, max(ttr, 1), size, max_age)


def _p_put_unique(line: bytes, max_job_size: int) -> _PutHeader:
    """`put-unique <key> <pri> <delay> <ttr> <bytes>`: a put with an idempotency key."""
    key, space, rest = line[len(_PUT_UNIQUE):].partition(b" ")
    if not space or not valid_key(key):
        raise _Bad
    (pri, delay, ttr, size), pos = _read_u32s(rest, 0, 4)
    if pos != len(rest):
        raise _Bad
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
# The same as whole reads, CRLF included: parser.py's `take` looks a read up as it came.
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
            (pri, delay, ttr, size), pos = _read_u32s(line, 4, 4)
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

