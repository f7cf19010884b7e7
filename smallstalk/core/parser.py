# cython: annotation_typing=False
# (For the compiled build, tools/compile.py: these `bytes` annotations also
# take bytearray slices, which a typed argument would refuse.)
"""The beanstalkd text protocol's framing as a pure state machine over bytes (no sockets, no trio).

Theory of operation (in the manner of h11): a `Parser` is fed whatever bytes a socket
produced (`feed`) and hands back complete events (`events`): a command object, or an
`ErrorReply` carrying the exact bytes beanstalkd would answer for malformed input.
Each line it frames goes to lines.py's `parse_line` (the argument rules) unless a
fast path here answers it. Commands are in commands.py, replies in replies.py.

Rules kept here, taken from beanstalkd 1.12 (prot.c) and checked against the real server:

- A command line ends with CRLF and is at most 224 bytes including it. A longer
  line is discarded in 224-byte windows up to its CRLF and answered BAD_FORMAT;
  the connection then goes on. Like beanstalkd, only the first CR of a window
  counts: a CR not followed by LF hides any line end after it in that window.
- `put` reads exactly <bytes>+2 body bytes, which must end in CRLF
  (EXPECTED_CRLF otherwise). A body larger than the job size limit is skipped
  without being buffered and answered JOB_TOO_BIG.
- beanstalkd counts a put, takes its job id and marks a producer at its line,
  before the body: a put line whose body is not all here yet is an event of its
  own (`PutHeard`), and the put then a `PutRest` (or an uncounted error).

Memory is bounded: the parser holds at most one line (224 bytes) or one body
(max job size + 2) of unparsed input.
"""

from __future__ import annotations

import re

import attrs

from smallstalk.core import lines
from smallstalk.core.commands import (
    PUT_HEARD,
    QUIT,
    TOO_BIG_PUT_HEARD,
    Delete,
    ErrorReply,
    Event,
    Put,
    PutRest,
    PutUnique,
)
from smallstalk.core.lines import (
    _PUT_UNIQUE,
    _SEARCH_LINES,
    DEFAULT_MAX_JOB_SIZE,
    U32_MAX,
    _PutHeader,
)
from smallstalk.core.replies import BAD_FORMAT, EXPECTED_CRLF, JOB_TOO_BIG

try:  # the compiled build's scan of a keyed put's key (keyscan.pyx)
    from smallstalk.core import keyscan
    _KEY_SCAN = True
except ImportError:  # the pure build: _PUT_UNIQUE_KEY, the reference
    _KEY_SCAN = False
LINE_MAX = 224  # bytes, including CRLF (beanstalkd's LINE_BUF_SIZE)
_PUT_UNIQUE_LINE_MAX = len(_PUT_UNIQUE) + 200 + 4 * 11 + 2  # its window: key and numbers
# The everyday put-unique, whole line, as `_PUT_LINE` is the everyday put's.
_PUT_UNIQUE_LINE = re.compile(
    rb"put-unique ([-A-Za-z0-9+/;.$_()]{1,200}) ([0-9]{1,10}) ([0-9]{1,10}) ([0-9]{1,10}) "
    rb"([0-9]{1,10})\r\n")
# A put-unique's key alone: `take` matches the rest of the line against the
# last put-unique line's rest (`Parser._last_unique`), as it does a put's line.
# (Faster than a find and `bytes.translate` of the key chars, pure or compiled.)
_PUT_UNIQUE_KEY = re.compile(rb"put-unique ([-A-Za-z0-9+/;.$_()]{1,200})")
_SEARCH_LINE_MAX = 480  # `search-jobs`' and `bulk-jobs`' longer line (lines.py)
# The everyday put, whole line and CRLF, matched in the input buffer itself: digits and
# single spaces hold no CR, so beanstalkd's line rules agree when the line fits its window.
_PUT_LINE = re.compile(rb"put ([0-9]{1,10}) ([0-9]{1,10}) ([0-9]{1,10}) ([0-9]{1,10})\r\n")
# `Parser._last` before any put: a line and its true numbers (a repeat gets the regex's answer).
_FIRST_PUT = (b"put 0 0 1 0\r\n", 0, 0, 1, 0)
# ...and `Parser._last_unique` before any put-unique: what follows a key, likewise.
_FIRST_UNIQUE = (b" 0 0 1 0\r\n", 0, 0, 1, 0)
# The exact lines as whole reads, CRLF included: `take` looks a read up as it came.
_EXACT_READS = lines._EXACT_READS


_LINE, _BODY, _SKIP, _DISCARD = range(4)
# Events one `take` makes at most; the rest wait, as bytes, for `events()`
# (`more` says so): 64 KiB of 7-byte commands would be 9,000 objects at once,
# parsed before any of them runs (a connection reads no more while they wait).
TAKE_MAX = 256
NO_LIMIT = 1 << 62


class Parser:
    """Incremental parser for one connection's input stream.

    `feed(data)` then `events()` returns every complete event so far, in order;
    `take(data)` at most TAKE_MAX of them, and sets `more` when it stopped there.
    """

    __slots__ = ("_buf", "_mode", "_put", "_skip", "max_job_size", "_last", "_skip_reply",
                 "_last_unique", "_exact_read", "_exact_cmd", "more", "_heard")

    def __init__(self, max_job_size: int = DEFAULT_MAX_JOB_SIZE) -> None:
        self.max_job_size = max_job_size
        self._buf = bytearray()
        self._mode = _LINE
        self._put: _PutHeader | None = None
        self._skip = 0  # body bytes still to throw away in _SKIP mode
        self._skip_reply: ErrorReply | None = None  # its answer, when not JOB_TOO_BIG
        self._heard = False  # the put in _BODY or _SKIP mode was a PutHeard event
        # The last everyday put line that passed, whole, and its numbers: a producer repeats
        # it, and matching its bytes skips the regex and the ints (a third of a put's parse).
        self._last: tuple[bytes, int, int, int, int] = _FIRST_PUT
        self._last_unique: tuple[bytes, int, int, int, int] = _FIRST_UNIQUE
        self._exact_read, self._exact_cmd = b"", None  # take's last exact read, likewise
        self.more = False  # `take` stopped at TAKE_MAX: `events(TAKE_MAX)` again for the rest

    def buffered(self) -> int:
        """Bytes held: not yet a complete event, or more than `take` returned."""
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
                    and data.startswith(line):
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
                    end = keyscan.key_end(data, 11) if data.startswith(_PUT_UNIQUE) else 11
                else:
                    m = _PUT_UNIQUE_KEY.match(data)
                    end = m.end() if m is not None else 11
                if end > 11:  # a key
                    rest, pri, delay, ttr, size = self._last_unique
                    stop = end + len(rest)
                    if n == stop + size + 2 and data[-2] == 0x0D and data.startswith(rest, end):
                        keyed: PutUnique = PutUnique.__new__(PutUnique)  # as Put's, above
                        keyed.key = raw[11:end].decode("ascii")
                        keyed.pri, keyed.delay, keyed.ttr = pri, delay, ttr
                        keyed.body = raw[stop:n - 2]
                        return [keyed], 0
            elif 1 < n <= LINE_MAX and data[-1] == 0x0A and data[-2] == 0x0D:
                if n > 9 and data[0] == 0x64 and data.startswith(b"delete "):
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
                    ev = lines.parse_line(line, self.max_job_size)
                    if type(ev) is not _PutHeader:
                        return [ev], 0
        if mode == _SKIP and not self._buf:
            self.feed(data)
        else:
            self._buf += data
        return self.events(TAKE_MAX), len(self._buf)

    def events(self, limit: int = NO_LIMIT) -> list[Event]:
        """The complete events so far, in order (at most `limit`: `more`)."""
        out: list[Event] = []
        buf = self._buf
        pos = 0
        n = len(buf)
        put_line = _PUT_LINE.match
        max_size = self.max_job_size
        last = self._last
        self.more = False
        while True:
            if len(out) >= limit:
                self.more = True
                break
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
                ev = lines.parse_line(line, self.max_job_size)
                if type(ev) is _PutHeader:
                    if ev.size < 0:
                        self._mode = _SKIP
                        self._skip = -ev.size + 2
                        self._skip_reply = ev.skip_reply
                        self._put = None
                        if ev.skip_reply is None and n - pos < self._skip:
                            out.append(TOO_BIG_PUT_HEARD)  # a put's body, not all here
                            self._heard = True
                    else:
                        self._mode = _BODY
                        self._put = ev
                        if ev.make is None and not ev.key and n - pos < ev.size + 2:
                            out.append(PUT_HEARD)
                            self._heard = True
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
                heard = self._heard
                self._heard = False
                if put.make is not None:  # search-jobs, bulk-jobs
                    if trailer != b"\r\n":
                        out.append(ErrorReply(EXPECTED_CRLF))
                    elif type(put.make) is ErrorReply:
                        out.append(put.make)
                    else:
                        out.append(attrs.evolve(put.make, pattern=body))
                elif trailer != b"\r\n":
                    out.append(ErrorReply(EXPECTED_CRLF, None if heard else Put))
                elif put.key:
                    out.append(PutUnique(put.key, put.pri, put.delay, put.ttr, body))
                elif heard:
                    out.append(PutRest(put.pri, put.delay, put.ttr, body, put.max_age))
                else:
                    out.append(Put(put.pri, put.delay, put.ttr, body, put.max_age))
            elif mode == _SKIP:
                take = min(self._skip, n - pos)
                pos += take
                self._skip -= take
                if self._skip:
                    break
                self._mode = _LINE
                out.append(self._skip_reply or ErrorReply(JOB_TOO_BIG, None if self._heard
                                                          else Put))
                self._skip_reply = None
                self._heard = False
        if pos:
            del buf[:pos]
        return out
