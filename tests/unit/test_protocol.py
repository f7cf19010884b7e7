"""The sans-I/O parser: byte-exact cases, split input, and arbitrary byte soup."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from smallstalk.core import lines, memcache, parser
from smallstalk.core import protocol as p


def parse_all(data: bytes, chunk: int | None = None, max_job_size: int = 65535,
              heard: bool = False) -> list:
    """The events of `data`, fed whole or `chunk` bytes at a time; a put line
    heard before its body and what ended it joined (`joined`) unless `heard`."""
    parser = p.Parser(max_job_size)
    out = []
    if chunk is None:
        parser.feed(data)
        out += parser.events()
    else:
        for i in range(0, len(data), chunk):
            parser.feed(data[i:i + chunk])
            out += parser.events()
    return out if heard else joined(out)


def joined(events: list) -> list:
    """Events as a read of the whole input makes them: each PutHeard with the
    event that ends its put as one (a PutHeard that nothing ended yet dropped).
    Checks that a PutHeard is always followed by its own end."""
    out = []
    it = iter(events)
    for ev in it:
        if type(ev) is not p.PutHeard:
            out.append(ev)
            continue
        end = next(it, None)
        if end is None:
            break
        if ev.job and type(end) is p.PutRest:
            out.append(p.Put(end.pri, end.delay, end.ttr, end.body, end.max_age))
        elif ev.job and end == p.ErrorReply(p.EXPECTED_CRLF):
            out.append(p.ErrorReply(p.EXPECTED_CRLF, p.Put))
        else:
            assert not ev.job and end == p.ErrorReply(p.JOB_TOO_BIG), (ev, end)
            out.append(p.ErrorReply(p.JOB_TOO_BIG, p.Put))
    return out


CASES = [
    (b"put 1 2 3 5\r\nhello\r\n", [p.Put(1, 2, 3, b"hello")]),
    (b"put 0 0 0 0\r\n\r\n", [p.Put(0, 0, 1, b"")]),  # ttr 0 becomes 1
    (b"put 4294967295 0 1 1\r\nx\r\n", [p.Put(2**32 - 1, 0, 1, b"x")]),
    (b"put 4294967296 0 1 1\r\nx\r\n", [p.ErrorReply(p.BAD_FORMAT), p.ErrorReply(p.UNKNOWN_COMMAND)]),
    (b"put 1 0 1 3\r\na\r\n\r\n", [p.Put(1, 0, 1, b"a\r\n")]),
    (b"put 1 0 1 3\r\na\x00b\r\n", [p.Put(1, 0, 1, b"a\x00b")]),
    (b"put 1 0 1 2\r\nabc\r\n", [p.ErrorReply(p.EXPECTED_CRLF, p.Put)]),  # "\n" waits for more
    (b"put 1 0 1 2\r\nabcd\r\nstats\r\n",
     [p.ErrorReply(p.EXPECTED_CRLF, p.Put), p.ErrorReply(p.UNKNOWN_COMMAND), p.STATS]),
    (b"put 1 0 1 2 \r\nab\r\n", [p.ErrorReply(p.BAD_FORMAT, p.Put), p.ErrorReply(p.UNKNOWN_COMMAND)]),
    (b"put 1 0 1\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"put -1 0 1 1\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"put\r\n", [p.ErrorReply(p.UNKNOWN_COMMAND)]),
    (b"reserve\r\n", [p.Reserve(None)]),
    (b"reservex\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"reserve-with-timeout 5\r\n", [p.Reserve(5)]),
    (b"reserve-with-timeout 5x\r\n", [p.Reserve(5)]),  # beanstalkd ignores the tail
    # beanstalkd 1.12 reads the timeout with strtol into an int:
    (b"reserve-with-timeout 2147483648\r\n", [p.Reserve(-1)]),  # negative: no timeout
    (b"reserve-with-timeout 4294967297\r\n", [p.Reserve(1)]),
    (b"reserve-with-timeout abc\r\n", [p.Reserve(0)]),
    (b"reserve-with-timeout -1\r\n", [p.Reserve(-1)]),
    (b"reserve-with-timeout 99999999999999999999\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"pause-tube -bad 1\r\n", [p.ErrorReply(p.BAD_FORMAT, p.PauseTube)]),
    # Only the first CR of beanstalkd's 224-byte window counts.
    (b"use a\rb\r\n" + b"use pad\r\n" * 30,
     [p.ErrorReply(p.BAD_FORMAT)] + [p.Use("pad")] * 5),
    (b"reserve-job 7\r\n", [p.ReserveJob(7)]),
    (b"delete 18446744073709551615\r\n", [p.Delete(2**64 - 1)]),
    (b"delete 18446744073709551616\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"delete 1 \r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"delete  1\r\n", [p.Delete(1)]),
    (b"release 1 2 3\r\n", [p.Release(1, 2, 3)]),
    (b"bury 1 2\r\n", [p.Bury(1, 2)]),
    (b"touch 3\r\n", [p.Touch(3)]),
    (b"use foo\r\n", [p.Use("foo")]),
    (b"use  foo\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"use -foo\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"use a*b\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"use " + b"a" * 200 + b"\r\n", [p.Use("a" * 200)]),
    (b"use " + b"a" * 201 + b"\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"watch A-Z+/;.$_()9\r\n", [p.Watch("A-Z+/;.$_()9")]),
    (b"ignore foo\r\n", [p.Ignore("foo")]),
    (b"peek 1\r\n", [p.Peek(1)]),
    (b"peek-ready\r\npeek-delayed\r\npeek-buried\r\n", [p.PEEK_READY, p.PEEK_DELAYED, p.PEEK_BURIED]),
    (b"peek-readyx\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"kick 10\r\n", [p.Kick(10)]),
    (b"kick 10abc\r\n", [p.Kick(10)]),
    (b"kick -1\r\n", [p.Kick(2**32 - 1)]),
    (b"kick x\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"kick\r\n", [p.ErrorReply(p.UNKNOWN_COMMAND)]),
    (b"kick-job 4\r\n", [p.KickJob(4)]),
    (b"stats-job 4\r\n", [p.StatsJob(4)]),
    (b"stats-tube default\r\n", [p.StatsTube("default")]),
    (b"stats\r\n", [p.STATS]),
    (b"statsx\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"list-tubes\r\nlist-tube-used\r\nlist-tubes-watched\r\n",
     [p.LIST_TUBES, p.LIST_TUBE_USED, p.LIST_TUBES_WATCHED]),
    (b"pause-tube foo 10\r\n", [p.PauseTube("foo", 10)]),
    (b"pause-tube  foo  10\r\n", [p.PauseTube("foo", 10)]),
    (b"pause-tube foo\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"quit\r\n", [p.QUIT]),
    (b"quitx\r\n", [p.QUIT]),
    (b"frobnicate\r\n", [p.ErrorReply(p.UNKNOWN_COMMAND)]),
    (b"stats\x00\r\n", [p.ErrorReply(p.BAD_FORMAT)]),
    (b"\r\n", [p.ErrorReply(p.UNKNOWN_COMMAND)]),
]


@pytest.mark.parametrize("data,expected", CASES, ids=[repr(c[0][:30]) for c in CASES])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_cases(data: bytes, expected: list, chunk: int | None) -> None:
    assert parse_all(data, chunk) == expected


def test_line_limit_is_224_bytes_including_crlf() -> None:
    ok = b"use " + b"a" * 200 + b"x" * 18  # 222 bytes + CRLF = 224
    assert len(ok) + 2 == p.LINE_MAX
    assert parse_all(ok + b"\r\n") == [p.ErrorReply(p.BAD_FORMAT)]  # name > 200: BAD_FORMAT
    too_long = b"x" * 224 + b"\r\nstats\r\n"  # 226 with CRLF
    for chunk in (None, 1, 7, 100):
        assert parse_all(too_long, chunk) == [p.ErrorReply(p.BAD_FORMAT), p.STATS]
    # A CR as the 224th byte falls outside the window: the next line is swallowed.
    swallowed = b"x" * 223 + b"\r\nuse s1\r\nuse s2\r\n"
    for chunk in (None, 1, 7, 100):
        assert parse_all(swallowed, chunk) == [p.ErrorReply(p.BAD_FORMAT), p.Use("s2")]


def test_over_long_line_is_not_buffered() -> None:
    parser = p.Parser()
    for _ in range(1000):
        parser.feed(b"y" * 1000)
        assert parser.events() == []
        assert parser.buffered() < p.LINE_MAX
    parser.feed(b"\r\nstats\r\n")
    assert parser.events() == [p.ErrorReply(p.BAD_FORMAT), p.STATS]


def test_job_too_big_skips_the_body_without_buffering_it() -> None:
    parser = p.Parser(max_job_size=10)
    parser.feed(b"put 0 0 1 100000\r\n")
    assert parser.events() == [p.TOO_BIG_PUT_HEARD]
    for _ in range(100):
        parser.feed(b"z" * 1000)
        assert parser.events() == []
        assert parser.buffered() == 0
    parser.feed(b"\r\nput 0 0 1 2\r\nok\r\n")
    assert parser.events() == [p.ErrorReply(p.JOB_TOO_BIG), p.Put(0, 0, 1, b"ok")]


def test_a_put_line_is_heard_before_its_body_only_when_the_body_is_not_in() -> None:
    """beanstalkd counts a put and takes its id at the line: a body still to
    come makes the line an event of its own, and the put then uncounted."""
    whole = b"put 1 2 3 5\r\nhello\r\n"
    assert parse_all(whole, heard=True) == [p.Put(1, 2, 3, b"hello")]
    assert parse_all(whole, 18, heard=True) == [p.PUT_HEARD, p.PutRest(1, 2, 3, b"hello")]
    assert parse_all(whole, 14, heard=True) == [p.PUT_HEARD, p.PutRest(1, 2, 3, b"hello")]
    # The line's CRLF split: the body came with the line's end.
    assert parse_all(whole, 12, heard=True) == [p.Put(1, 2, 3, b"hello")]
    assert parse_all(b"put 0 0 1 2\r\nabcd", 14, heard=True) == [
        p.PUT_HEARD, p.ErrorReply(p.EXPECTED_CRLF)]
    assert parse_all(b"put-expiring 0 0 1 9 2\r\nab\r\n", 25, heard=True) == [
        p.PUT_HEARD, p.PutRest(0, 0, 1, b"ab", 9)]
    big = b"put 0 0 1 12\r\n" + b"z" * 12 + b"\r\n"
    assert parse_all(big, 20, max_job_size=10, heard=True) == [
        p.TOO_BIG_PUT_HEARD, p.ErrorReply(p.JOB_TOO_BIG)]
    assert parse_all(big, max_job_size=10, heard=True) == [p.ErrorReply(p.JOB_TOO_BIG, p.Put)]
    # Not beanstalkd's: a keyed put and the search commands keep their count at the end.
    keyed = b"put-unique k 0 0 1 2\r\nab\r\n"
    assert parse_all(keyed, 23, heard=True) == [p.PutUnique("k", 0, 0, 1, b"ab")]


def test_body_split_anywhere() -> None:
    body = b"a\r\nb\x00c\rd\n" * 50
    data = b"put 5 0 60 %d\r\n%s\r\nreserve\r\n" % (len(body), body)
    for chunk in (1, 2, 5, 64, 1000):
        assert parse_all(data, chunk) == [p.Put(5, 0, 60, body), p.RESERVE]


def test_nothing_after_quit_is_parsed() -> None:
    assert parse_all(b"quit\r\nput 0 0 1 1\r\nx\r\n") == [p.QUIT]


tubes = st.text(alphabet="abcXYZ09-+/;.$_()", min_size=1, max_size=200).filter(
    lambda s: not s.startswith("-"))
u32 = st.integers(0, 2**32 - 1)
ids = st.integers(0, 2**64 - 1)
commands = st.one_of(
    st.builds(p.Put, u32, u32, st.integers(1, 2**32 - 1), st.binary(max_size=300)),
    st.builds(p.Reserve, st.none() | st.integers(0, 2**31 - 1)),
    st.builds(p.ReserveJob, ids), st.builds(p.Delete, ids),
    st.builds(p.Release, ids, u32, u32), st.builds(p.Bury, ids, u32), st.builds(p.Touch, ids),
    st.builds(p.Use, tubes), st.builds(p.Watch, tubes), st.builds(p.Ignore, tubes),
    st.builds(p.Peek, ids), st.just(p.PEEK_READY), st.just(p.PEEK_DELAYED),
    st.just(p.PEEK_BURIED), st.builds(p.Kick, u32), st.builds(p.KickJob, ids),
    st.builds(p.StatsJob, ids), st.builds(p.StatsTube, tubes), st.just(p.STATS),
    st.just(p.LIST_TUBES), st.just(p.LIST_TUBE_USED), st.just(p.LIST_TUBES_WATCHED),
    st.builds(p.PauseTube, tubes, u32),
    # smallstalk's own commands
    st.builds(p.Put, u32, u32, st.integers(1, 2**32 - 1), st.binary(max_size=300), u32),
    st.builds(p.Auth, st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                              min_size=1, max_size=100)),
    st.just(p.EXT_STATS), st.builds(p.ExtStatsTube, tubes),
    st.builds(p.SearchJobs, tubes, st.sampled_from(p.LIST_JOBS_STATES), st.sampled_from(p.HOWS),
              ids, st.integers(0, p.SEARCH_PAGE_MAX), st.binary(max_size=p.PATTERN_MAX)),
    st.builds(lambda tube, state, how, action, to, bound, pattern: p.BulkJobs(
        tube, state, how, action, to if action == "move" else "", bound, pattern),
        tubes, st.sampled_from(p.LIST_JOBS_STATES), st.sampled_from(p.HOWS),
        st.sampled_from(p.ACTIONS), tubes, u32, st.binary(max_size=p.PATTERN_MAX)),
)


def test_search_commands_carry_any_pattern_and_skip_a_long_one() -> None:
    cmd = p.SearchJobs("t", "ready", "regex", 7, 10, b"a\r\nput 0 0 1 1\r\nx\x00")
    data = p.render(cmd)
    assert parse_all(data) == parse_all(data, 1) == [cmd]
    # Two 200-byte tube names: longer than beanstalkd's line, within ours.
    bulk = p.BulkJobs("a" * 200, "buried", "substr", "move", "b" * 200, 5, b"x")
    assert len(p.render(bulk).split(b"\r\n")[0]) > p.LINE_MAX
    assert parse_all(p.render(bulk)) == parse_all(p.render(bulk), 1) == [bulk]
    # A pattern past the bound is skipped unread, never parsed as commands.
    long = b"search-jobs t ready substr 0 5 2000\r\n" + b"quit\r\n" * 333 + b"qu\r\n"
    assert parse_all(long + b"stats\r\n", 7) == [
        p.ErrorReply(p.bad_search(f"pattern longer than {p.PATTERN_MAX} bytes")), p.STATS]
    # A readable byte count, anything else wrong: the body is read, BAD_FORMAT.
    for bad in (b"search-jobs t nosuch substr 0 5 4", b"search-jobs t ready substr 0 4",
                b"search-jobs -t ready substr 0 5 4", b"bulk-jobs t ready key kick t 5 4",
                b"bulk-jobs t ready key move - 5 4", b"bulk-jobs t ready key nuke - 5 4",
                b"search-jobs t ready substr x 5 4"):
        assert parse_all(bad + b"\r\nquit\r\nstats\r\n") == [
            p.ErrorReply(p.BAD_FORMAT), p.STATS], bad
    # An unreadable count: BAD_FORMAT, and what follows is read as lines.
    assert parse_all(b"search-jobs t ready substr 0 5 x\r\nstats\r\n") == [
        p.ErrorReply(p.BAD_FORMAT), p.STATS]
    assert parse_all(b"search-jobs t ready substr 0 5 1\r\nabc") == [
        p.ErrorReply(p.EXPECTED_CRLF)]


def test_put_takes_four_arguments_as_in_beanstalkd() -> None:
    # A fifth argument is BAD_FORMAT (counted as a put); the body line is then a command.
    assert parse_all(b"put 0 0 60 1 2\r\nx\r\n") == [
        p.ErrorReply(p.BAD_FORMAT, p.Put), p.ErrorReply(p.UNKNOWN_COMMAND)]
    assert parse_all(b"put-expiring 0 0 60 5 1\r\nx\r\n") == [p.Put(0, 0, 60, b"x", 5)]
    assert p.render(p.Put(0, 0, 60, b"x", 5)) == b"put-expiring 0 0 60 5 1\r\nx\r\n"
    assert p.render(p.Put(0, 0, 60, b"x")) == b"put 0 0 60 1\r\nx\r\n"
    for bad in (b"put-expiring 0 0 60 1\r\n", b"put-expiring 0 0 60 5 1 9\r\n",
                b"put-expiring 0 0 60 99999999999 1\r\n", b"auth \r\n", b"auth a b\r\n",
                b"put-unique k 0 0 60\r\n", b"put-unique k 0 0 60 1 9\r\n",
                b"put-unique k 0 0 60 1 \r\n", b"put-unique k 0 0 4294967296 1\r\n",
                b"put-unique k 0 0 60 70000 9\r\n"):
        assert parse_all(bad) == [p.ErrorReply(p.BAD_FORMAT)], bad
    assert parse_all(b"put-expiring 0 0 60 5 70000\r\n" + b"z" * 70000 + b"\r\n") == [
        p.ErrorReply(p.JOB_TOO_BIG, p.Put)]
    assert parse_all(b"put-unique k 0 0 60 70000\r\n" + b"z" * 70000 + b"\r\n") == [
        p.ErrorReply(p.JOB_TOO_BIG, p.Put)]
    # A put's size is judged before what follows it, as beanstalkd does: too
    # big, its body is skipped even with a fifth argument (a keyed put's line
    # must end at its size first, above).
    assert parse_all(b"put 0 0 60 70000 9\r\n" + b"z" * 70000 + b"\r\n") == [
        p.ErrorReply(p.JOB_TOO_BIG, p.Put)]
    # Names beanstalkd answers UNKNOWN_COMMAND (never one it answers otherwise).
    assert parse_all(b"ext-stats\r\next-stats-tube t\r\n") == [
        p.EXT_STATS, p.ExtStatsTube("t")]


@given(st.lists(commands, max_size=20), st.integers(1, 50))
@settings(max_examples=300)
def test_round_trip(cmds: list, chunk: int) -> None:
    data = b"".join(p.render(c) for c in cmds)
    assert parse_all(data) == cmds
    assert parse_all(data, chunk) == cmds


@given(st.lists(st.binary(max_size=300) | st.sampled_from(
    [b"\r\n", b"put 0 0 1 3\r\n", b"put 0 0 1 70000\r\n", b"reserve", b"use ", b"\r"]),
    max_size=40), st.integers(1, 64))
@settings(max_examples=500)
def test_byte_soup_never_raises_and_stays_bounded(pieces: list, chunk: int) -> None:
    parser = p.Parser()
    data = b"".join(pieces)
    for i in range(0, len(data), chunk):
        parser.feed(data[i:i + chunk])
        for ev in parser.events():
            assert isinstance(ev, (p.ErrorReply, *p.Command.__args__))
        assert parser.buffered() <= max(p.LINE_MAX, 65535 + 2) + chunk


_put_lines = st.builds(
    lambda pri, delay, ttr, size, sep, body_ok: (
        b"put%s%d %d %d %d\r\n" % (sep, pri, delay, ttr, size)
        + b"b" * size + (b"\r\n" if body_ok else b"xy")),
    st.sampled_from([0, 1, 1024, 2**32 - 1, 2**32]), st.sampled_from([0, 5]),
    st.sampled_from([0, 1, 60]), st.sampled_from([0, 1, 3, 70]), st.sampled_from([b" ", b"  "]),
    st.booleans())


# Keyed puts, as one read each: keys good and bad, numbers repeated or not,
# bodies of the size the line says or not.
_put_unique_reads = st.builds(
    lambda key, pri, ttr, size, body_size, end: (
        b"put-unique %s %d 0 %d %d\r\n" % (key, pri, ttr, size) + b"b" * body_size + end),
    st.sampled_from([b"k1", b"k2", b"a-b", b"x" * 200, b"x" * 201, b"bad key", b"-", b"k\r",
                     b"k#1", b"(k)"]),
    st.sampled_from([0, 1024, 2**32 - 1, 2**32]), st.sampled_from([0, 1, 60]),
    st.sampled_from([0, 3, 70]), st.sampled_from([0, 3, 4, 70]),
    st.sampled_from([b"\r\n", b"\r\n", b"xy", b"\n", b""]))


@given(st.lists(_put_lines | st.sampled_from([b"put 0 0 1 0\r\n\r\n", b"use t\r\n"]),
                max_size=12), st.integers(1, 40))
@example([b"put 0 0 1 0\r\n\r\n", b"put 0 0 1 0\r\n\r\n"], 1)
@settings(max_examples=300)
def test_repeated_put_lines_parse_as_the_first_did(pieces: list, chunk: int) -> None:
    """The parser remembers the last put line that passed and matches its bytes
    again without the regex: a stream of puts, repeated or not and split
    anywhere, parses as it does when the parser forgets that line after every
    byte (so each put takes the regex path, or meets only the first line,
    which is a true parse of itself)."""
    data = b"".join(pieces)
    forgetful = p.Parser(64)
    expected = []
    for i in range(len(data)):
        forgetful.feed(data[i:i + 1])
        expected += forgetful.events()
        forgetful._last = parser._FIRST_PUT
    assert parse_all(data, chunk, max_job_size=64) == joined(expected)


def test_the_first_remembered_put_line_is_a_true_parse_of_itself() -> None:
    line, *numbers = parser._FIRST_PUT
    m = parser._PUT_LINE.fullmatch(line)
    pri, delay, ttr, size = map(int, m.groups())
    assert [pri, delay, ttr or 1, size] == numbers
    assert parse_all(line + b"\r\n") == [p.Put(*numbers[:3], b"")]


_PLAIN_WORDS = sorted(lines._PLAIN_ARGS)


@given(st.sampled_from(_PLAIN_WORDS),
       st.lists(st.text("0123456789", min_size=0, max_size=21), min_size=0, max_size=4),
       st.sampled_from([b" ", b"  ", b"\t"]), st.sampled_from([b"", b" ", b"x", b"-"]))
@example(b"bury", ["1", "4294967296"], b" ", b"")  # past U32: BAD_FORMAT
@example(b"release", ["1", "4294967295", "4294967296"], b" ", b"")
@example(b"reserve-with-timeout", ["2147483648"], b" ", b"")  # wraps negative: no timeout
@example(b"reserve-with-timeout", ["99999999999"], b" ", b"")
@example(b"delete", ["18446744073709551616"], b" ", b"")  # past U64
@example(b"touch", ["18446744073709551615"], b" ", b"")
@settings(max_examples=400, deadline=None)
def test_plain_argument_fast_path_parses_as_the_table_does(word, args, sep, tail) -> None:
    """parse_line's shortcut for `delete 5`, `release 5 1 0` and the like must
    give exactly what the general prefix table gives for the same line."""
    line = word + b" " + sep.join(a.encode() for a in args) + tail
    fast = p.parse_line(line, p.DEFAULT_MAX_JOB_SIZE)
    saved = dict(lines._PLAIN_ARGS)
    lines._PLAIN_ARGS.clear()
    try:
        general = p.parse_line(line, p.DEFAULT_MAX_JOB_SIZE)
    finally:
        lines._PLAIN_ARGS.update(saved)
    assert fast == general


def test_plain_argument_fast_path_is_taken() -> None:
    assert p.parse_line(b"release 12 1024 0", 100) == p.Release(12, 1024, 0)
    assert p.parse_line(b"reserve-with-timeout 0", 100) == p.Reserve(0)
    assert p.parse_line(b"delete 000123456789012345678", 100) == p.Delete(123456789012345678)


def test_protocol_exports_every_public_name_of_its_parts() -> None:
    """`protocol` is the face of commands, replies and the parser (parser, lines):
    nothing of theirs is missing."""
    from smallstalk.core import commands, replies

    for mod in (commands, replies, parser, lines):
        for name, value in vars(mod).items():
            if name.startswith("_") or type(value) is type(p):
                continue
            if getattr(value, "__module__", mod.__name__) != mod.__name__:
                continue  # imported from elsewhere
            assert getattr(p, name) is value, f"protocol.{name} (from {mod.__name__})"


@given(st.lists(st.binary(max_size=120) | _put_lines | _put_unique_reads | st.sampled_from(
    [b"\r\n", b"put 0 0 1 3\r\nabc\r\n", b"put 0 0 1 70000\r\n", b"reserve\r\n", b"delete 7\r\n",
     b"use ", b"\r"]), max_size=30), st.integers(1, 64))
@settings(max_examples=300)
def test_take_is_feed_then_events_then_buffered(pieces: list, chunk: int) -> None:
    """`take`, the connection's one call per read, answers exactly what the
    three calls it replaces do, read after read (oversized bodies skipped
    included)."""
    data = b"".join(pieces)
    one, three = p.Parser(64), p.Parser(64)
    for i in range(0, len(data), chunk):
        events, held = one.take(data[i:i + chunk])
        three.feed(data[i:i + chunk])
        assert (events, held) == (three.events(), three.buffered())


_WORDS = [b"put", b"reserve", b"reserve-with-timeout", b"delete", b"release", b"touch",
          b"bury", b"quit", b"peek", b"use", b"put-unique", b"kick", b"reserve-job", b""]
_ARG = st.text("0123456789", min_size=0, max_size=22) | st.sampled_from(
    ["+1", "-1", "007", "0", "4294967295", "4294967296", "18446744073709551615",
     "18446744073709551616", "99999999999999999999", " ", "", "x", "1x", "t", "k"])
_one_read = st.builds(
    lambda word, args, sep, tail, end, body: (
        word + (b" " if args else b"") + sep.join(a.encode() for a in args) + tail + end + body),
    st.sampled_from(_WORDS), st.lists(_ARG, max_size=5), st.sampled_from([b" ", b"  ", b"\t"]),
    st.sampled_from([b"", b" ", b"  ", b"\x00", b"\r", b"x"]),
    st.sampled_from([b"\r\n", b"\r\n", b"\n", b"\r", b""]),
    st.sampled_from([b"", b"", b"abc\r\n", b"\r\n", b"x" * 3 + b"\r\n", b"reserve\r\n"]))


@given(st.lists(_one_read | _put_lines | _put_unique_reads | st.binary(max_size=30),
                max_size=12))
@example([b"put-unique k1 0 0 1 3\r\nabc\r\n", b"put-unique k2 0 0 1 3\r\nabc\r\n",
          b"put-unique k3 0 0 1 3\r\nab\r\r\n", b"put-unique k4 0 0 1 3\r\nabcd\r\n",
          b"put-unique k5 0 0 1 3\r\nabc\r\n"])
@example([b"put-unique k 0 0 1 0\r\n\r\n", b"put-unique " + b"k" * 201 + b" 0 0 1 0\r\n\r\n"])
@example([b"put 0 0 1 3\r\nabc\r\n", b"put 0 0 1 3\r\nabc\r\n", b"put 0 0 1 3\r\nab\r\r\n"])
@example([b"delete 007\r\n", b"delete +1\r\n", b"delete 1 \r\n", b"release 1 2 3\r\n",
          b"release 1 2 4294967296\r\n", b"bury 1\r\n", b"bury 1 2 3\r\n", b"touch\r\n"])
@example([b"put 0 0 1 70000\r\n", b"delete 1\r\n", b"x" * 70000 + b"\r\n", b"delete 1\r\n"])
@example([b"reserve-with-timeout 0\r\n", b"reserve-with-timeout 00\r\n", b"quit\r\n"])
@example([b"delete 18446744073709551616\r\n", b"touch 018446744073709551615\r\n",
          b"reserve-with-timeout 2147483648\r\n", b"reserve-with-timeout 999999999\r\n",
          b"bury 1 4294967296\r\n", b"release 1 4294967296 0\r\n", b"delete 1\r\r\n"])
@example([b"use " + b"a" * 218 + b"\r\n", b"use " + b"a" * 219 + b"\r\n",
          b"delete " + b"0" * 215 + b"1\r\n", b"delete 1\r\n"])
@example([b"delete 1234567890123456789\r\n", b"delete 123456789012345678\r\n", b"delete \r\n",
          b"delete 5\x00\r\n", b"delete 5\n", b"delete 0\r\n", b"delete\r\n"])
@example([b"d\r\n", b"dele\r\n", b"delete 1\n", b"reserve\r\n", b"reserve\r\n",
          b"reserve \r\n", b"reserve\r\r\n"])
@example([b"stats\r\n", b"reserve\r\n", b"stats\r\n", b"stats\r\n",
          b"reserve-with-timeout 0\r\n", b"reserve-with-timeout 0\r\n", b"reserve\r\n"])
@settings(max_examples=500)
def test_a_read_of_one_command_parses_as_the_general_path_does(reads: list) -> None:
    """`take`'s shortcut for a read that is exactly one command (the last put
    line with its body, or one line) gives exactly the events and held bytes
    that `feed` and `events` give, read after read, whatever the line holds;
    the general side without parse_line's shortcuts (plain arguments, the
    exact `reserve-with-timeout 0`)."""
    one, three = p.Parser(64), p.Parser(64)
    plain, exact = dict(lines._PLAIN_ARGS), dict(lines._EXACT)
    for data in reads:
        events, held = one.take(data)
        three.feed(data)
        lines._PLAIN_ARGS.clear()
        del lines._EXACT[b"reserve-with-timeout 0"]
        try:
            expected = (three.events(), three.buffered())
        finally:
            lines._PLAIN_ARGS.update(plain)
            lines._EXACT.update(exact)
        assert (events, held) == expected


EVERYDAY = [p.Put(1, 2, 3, b"x"), p.Put(1, 2, 3, b"x", 9), p.Reserve(None), p.Reserve(0),
            p.Delete(7), p.Release(7, 1, 2), p.Bury(7, 1), p.Touch(7)]


@pytest.mark.parametrize("cmd", EVERYDAY, ids=lambda c: type(c).__name__)
def test_the_everyday_commands_behave_as_the_attrs_ones(cmd) -> None:
    # Plain slotted classes (extension types when compiled), not attrs ones:
    # compared, hashed and shown by their fields all the same.
    cls = type(cmd)
    values = tuple(getattr(cmd, f) for f in cls.FIELDS)
    twin = cls(*values)
    assert twin == cmd and not (twin != cmd) and hash(twin) == hash(cmd)
    assert repr(cmd) == f"{cls.__name__}(" + ", ".join(
        f"{f}={v!r}" for f, v in zip(cls.FIELDS, values, strict=True)) + ")"
    other = cls(*(v + 1 if isinstance(v, int) else v for v in values)) if any(
        isinstance(v, int) for v in values) else cls(5)
    assert other != cmd and not (other == cmd)
    assert cmd != p.Stats() and cmd != values
    with pytest.raises(AttributeError):
        cmd.not_a_field = 1  # slots: no stray fields, in either build


def test_a_delete_and_a_touch_of_the_same_id_differ() -> None:
    assert p.Delete(7) != p.Touch(7) and p.Touch(7) != p.Delete(7)
    assert len({p.Delete(7), p.Touch(7), p.Delete(7)}) == 2


@pytest.mark.parametrize("make", [p.Parser, memcache.Parser], ids=["beanstalkd", "memcache"])
def test_take_makes_at_most_take_max_events_and_more_says_the_rest_wait(make) -> None:
    """A read of thousands of small commands makes TAKE_MAX of them; the rest
    stay as bytes (`buffered`), `more` says so, and `events(TAKE_MAX)` goes
    on with them in order until none are left (then `more` is False)."""
    one, all_at_once = make(), make()
    line = b"get q\r\n" if make is memcache.Parser else b"peek 7\r\n"
    data = line * (2 * p.TAKE_MAX + 5) + line[:3]
    events, held = one.take(data)
    assert len(events) == p.TAKE_MAX and one.more
    assert held == len(data) - p.TAKE_MAX * len(line) == one.buffered()
    while one.more:
        events += one.events(p.TAKE_MAX)
    all_at_once.feed(data)
    assert events == all_at_once.events() and len(events) == 2 * p.TAKE_MAX + 5
    assert one.buffered() == 3 and not one.more
    assert one.take(line[3:]) == ([events[0]], 0)  # the cut command, whole again
