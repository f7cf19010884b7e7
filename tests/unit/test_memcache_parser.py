"""kestrel's memcache dialect, sans I/O: case by case, split input, and byte soup."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smallstalk.core import memcache as m
from smallstalk.core.commands import Auth


def parse_all(data: bytes, chunk: int | None = None, max_job_size: int = 65535) -> list:
    parser = m.Parser(max_job_size)
    out = []
    step = chunk or max(len(data), 1)
    for i in range(0, len(data), step):
        parser.feed(data[i:i + step])
        out += parser.events()
    return out


def fatal(why: str) -> m.McError:
    return m.McError(m.client_error(why), True)


CASES = [
    (b"set work 0 0 5\r\nhello\r\n", [m.McSet("work", 0, b"hello")]),
    (b"SET work 7 60 0\r\n\r\n", [m.McSet("work", 60, b"")]),  # flags are ignored
    (b"set work 0 -1 1 noreply\r\nx\r\n", [m.McSet("work", -1, b"x", noreply=True)]),
    (b"set work 0 0 3\r\na\r\n\r\n", [m.McSet("work", 0, b"a\r\n")]),
    (b"set orders+audit 0 0 1\nx\r\n", [m.McSet("orders+audit", 0, b"x")]),  # bare LF line
    (b"set work 0 0 2\r\nabc\r\nget work\r\n", [fatal("bad data chunk")]),
    (b"set work 0 0\r\n", [fatal("bad command line format")]),
    (b"set work x 0 1\r\n", [fatal("bad command line format")]),
    (b"set work 0 0 1 maybe\r\n", [fatal("bad command line format")]),
    (b"set a/b 0 0 1\r\nx\r\nversion\r\n", [m.McError(m.NAME_ERROR), m.McVersion()]),
    (b"get work\r\n", [m.McGet("work", key=b"work")]),
    (b"gets work other\r\n", [m.McGet("work", key=b"work", cas=True)]),  # one key, as kestrel
    (b"get work/t=500/open\r\n", [m.McGet("work", 500, open=True, key=b"work/t=500/open")]),
    (b"GET work/close/open\r\n",
     [m.McGet("work", None, open=True, close=True, key=b"work/close/open")]),
    (b"get work/close\r\n", [m.McGet("work", close=True, key=b"work/close")]),
    (b"get work/abort\r\n", [m.McGet("work", abort=True, key=b"work/abort")]),
    (b"get work/peek/t=10\r\n", [m.McGet("work", 10, peek=True, key=b"work/peek/t=10")]),
    (b"get work/shiny\r\n", [m.McGet("work", key=b"work/shiny")]),  # unknown: ignored
    (b"get work/open/peek\r\n", [fatal("bad option combination")]),
    (b"get work/close/peek\r\n", [fatal("bad option combination")]),
    (b"get work/open/abort\r\n", [fatal("bad option combination")]),
    (b"get work/close/abort\r\n", [fatal("bad option combination")]),
    (b"get work/peek/abort\r\n", [fatal("bad option combination")]),
    (b"get /close/open\r\n", [fatal("no queue name")]),
    (b"get work/t=soon\r\n", [fatal("bad /t= timeout (milliseconds)")]),
    (b"get\r\n", [fatal("no queue name")]),  # as docs/KESTREL.md says: closed
    (b"delete bad~q noreply\r\nflush bad~q noreply\r\nflush bad~q\r\n",
     [m.McError(b""), m.McError(b""), m.McError(m.NAME_ERROR)]),  # noreply: not a word
    (b"get -bad\r\n", [m.McError(m.NAME_ERROR)]),
    (b"delete work\r\nflush work noreply\r\nflush_all\r\nflush_all 0 noreply\r\n",
     [m.McDelete("work"), m.McFlush("work", True), m.McFlushAll(), m.McFlushAll(True)]),
    (b"stats\r\nstats items\r\ndump_stats\r\ndump_stats a b\r\n",
     [m.McStats(), m.McStats(), m.McDumpStats(), m.McDumpStats(("a", "b"))]),
    (b"version\r\nreload\r\nshutdown\r\n", [m.McVersion(), m.McReload(), m.McShutdown()]),
    (b"auth s3cret\r\n", [Auth("s3cret")]),
    (b"auth\r\n", [m.McError(m.client_error("auth takes one word: the admin token"))]),
    (b"\r\n", [m.McError(m.ERROR)]),
    (b"quit\r\nversion\r\n", [m.QUIT]),  # nothing after quit
    (b"monitor work 1\r\nversion\r\n", [fatal("unknown command")]),  # and nothing after
    (b"add work 0 0 1\r\nx\r\n", [fatal("unknown command")]),
]


@pytest.mark.parametrize("chunk", [None, 1, 3])
@pytest.mark.parametrize(("data", "expected"), CASES)
def test_cases(data: bytes, expected: list, chunk: int | None) -> None:
    assert parse_all(data, chunk) == expected


def test_a_line_past_the_limit_is_fatal_and_nothing_more_is_held() -> None:
    parser = m.Parser()
    parser.feed(b"get " + b"q" * (m.LINE_MAX - 4))
    assert parser.events() == [fatal("line too long")]
    assert parser.ended and parser.buffered() == 0
    parser.feed(b"\r\nversion\r\n" * 1000)
    assert parser.events() == [] and parser.buffered() == 0


def test_a_line_just_under_the_limit_is_a_command() -> None:
    line = b"get work/" + b"x" * (m.LINE_MAX - len(b"get work/") - 2) + b"\r\n"
    assert len(line) == m.LINE_MAX
    assert parse_all(line)[0].queue == "work"


def test_an_oversized_body_is_skipped_without_being_held() -> None:
    parser = m.Parser(max_job_size=10)
    parser.feed(b"set work 0 0 100000\r\n")
    assert parser.events() == []
    for _ in range(100):
        parser.feed(b"z" * 1000)
        assert parser.events() == [] and parser.buffered() == 0
    parser.feed(b"\r")
    assert parser.events() == [] and parser.buffered() == 1  # its CRLF, not yet whole
    parser.feed(b"\nset work 0 0 1 noreply\r\n")
    parser.feed(b"x\r\n")
    assert parser.events() == [m.McSet("work", 0, b"", too_big=True),
                               m.McSet("work", 0, b"x", noreply=True)]
    # An oversized body not followed by CRLF is the same error as a body's.
    for chunk in (None, 1, 7):
        assert parse_all(b"set work 0 0 100\r\n" + b"z" * 100 + b"XXversion\r\n", chunk,
                         max_job_size=10) == [fatal("bad data chunk")]


def test_render_is_the_inverse_of_parsing() -> None:
    cmds = [m.McSet("work", 30, b"body\r\n"), m.McSet("w", 0, b"", noreply=True),
            m.McGet("work", 250, open=True, close=True), m.McGet("work", peek=True),
            m.McGet("work", cas=True),
            m.McDelete("a+b"), m.McFlush("work", True), m.McFlushAll(), m.McStats(),
            m.McDumpStats(("a", "b")), m.McVersion(), m.McReload(), m.McShutdown(),
            Auth("tok")]
    data = b"".join(m.render(c) for c in cmds)
    got = parse_all(data, 7)
    assert [g if type(g) is not m.McGet else type(g)(*[getattr(g, f) for f in
            ("queue", "timeout_ms", "open", "close", "abort", "peek")], cas=g.cas)
            for g in got] == cmds


def test_replies_are_memcache_lines() -> None:
    assert m.value(b"work/open", b"hi") == b"VALUE work/open 0 2\r\nhi\r\nEND\r\n"
    assert m.value(b"work", b"hi", 42) == b"VALUE work 0 2 42\r\nhi\r\nEND\r\n"  # gets
    assert m.stat_lines([("uptime", 3), ("queue_a_items", 0)]) == \
        b"STAT uptime 3\r\nSTAT queue_a_items 0\r\nEND\r\n"
    assert m.dump_stats([("a", [("items", 1)])]) == b"queue 'a' {\r\n  items=1\r\n}\r\nEND\r\n"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=300) | st.sampled_from(
    [b"\r\n", b"\n", b"set q 0 0 3\r\n", b"get q/t=1/open\r\n", b"set q 0 0 99999999\r\n",
     b"get " + b"/" * 50, b" ", b"\x00", b"quit"]), max_size=40), st.integers(1, 64))
def test_byte_soup_never_raises_and_memory_stays_bounded(parts: list[bytes], chunk: int) -> None:
    data = b"".join(parts)
    parser = m.Parser(max_job_size=1000)
    for i in range(0, len(data), chunk):
        parser.feed(data[i:i + chunk])
        for ev in parser.events():
            assert isinstance(ev, (*m.McCommand.__args__, m.McError))
        assert parser.buffered() <= max(m.LINE_MAX, 1000 + 2) + chunk
    # Split anywhere, the same events.
    assert parse_all(data, chunk, 1000) == parse_all(data, None, 1000)


UNITS = [  # whole commands, each parsed alone by a fresh parser as the reference
    b"set q 0 0 3\r\nabc\r\n", b"set q 0 0 3\r\nxyz\r\n", b"set q 0 0 3 noreply\r\nabc\r\n",
    b"set q 0 60 2\r\nhi\r\n", b"set a/b 0 0 1\r\nx\r\n", b"set q 0 0 20\r\n" + b"z" * 20 + b"\r\n",
    b"get q\r\n", b"get q/t=5/open\r\n", b"get q/close\r\n", b"get -bad\r\n", b"gets q\r\n",
    b"\r\n", b"version\r\n", b"stats\r\n",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(UNITS), max_size=30), st.integers(1, 40))
def test_a_repeated_line_parses_as_it_did_the_first_time(units: list[bytes], chunk: int) -> None:
    """The parser reuses the last set and get lines' values: the events are those
    of each command parsed by a parser that has seen nothing before it."""
    want = [ev for u in units for ev in m.Parser(max_job_size=10).take(u)[0]]
    parser = m.Parser(max_job_size=10)
    data = b"".join(units)
    got = []
    for i in range(0, len(data), chunk):
        events, held = parser.take(data[i:i + chunk])
        got += events
        assert held == parser.buffered()
    assert got == want
    assert parser.buffered() == 0
