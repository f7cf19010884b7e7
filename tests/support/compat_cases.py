"""Scripted raw-byte cases for test_compat_bytes (replies are compared against beanstalkd 1.12)."""

from __future__ import annotations

import attrs

from .bsclient import put_cmd

# Placeholders expanded per run, identically for both servers (see test_compat_bytes):
#   {T}, {U}  two tube names unique to this case and send mode
#   {1}, {2}  the first, second, ... job id created by this case
# Lines whose exact length matters use literal names and ids instead.

LINE_MAX = 224  # beanstalkd's LINE_BUF_SIZE: longest command line, CRLF included
MAX_JOB = 65535  # beanstalkd's default max-job-size (-z)
NAME200 = b"n" * 195 + b"-+/;."  # a valid tube name of exactly 200 bytes
NAME201 = b"m" * 201


@attrs.frozen
class Step:
    """Send `send` on connection `conn`, then read `replies` complete replies from it."""

    send: bytes
    replies: int = 1
    conn: int = 0
    closed: bool = False  # after the replies, the server must close the connection
    shut_wr: bool = False  # half-close (SHUT_WR) our side after sending


@attrs.frozen
class Case:
    name: str
    steps: tuple[Step, ...]
    # fresh: run on newly started servers, connections start on tube "default"
    # (for absolute job ids, global stats, list-tubes, the default tube).
    # Otherwise the case runs on the module's long-lived servers and every
    # connection first sends "use {T}", "watch {T}", "ignore default".
    fresh: bool = False


def S(send: bytes, replies: int = 1, conn: int = 0, *, closed: bool = False,
      shut_wr: bool = False) -> Step:
    return Step(send, replies, conn, closed, shut_wr)


def C(name: str, *steps: Step, fresh: bool = False) -> Case:
    return Case(name, tuple(steps), fresh)


put = put_cmd


def padded(prefix: bytes, suffix: bytes, total: int) -> bytes:
    """prefix + spaces + suffix + CRLF, exactly `total` bytes long."""
    line = prefix + b" " * (total - len(prefix) - len(suffix) - 2) + suffix + b"\r\n"
    assert len(line) == total
    return line


LTU = b"list-tube-used\r\n"
# Two commands with distinct replies: shows whether the first was swallowed.
SWALLOW_PROBE = b"use s1\r\nuse s2\r\n"
BIG_OK = bytes(range(256)) * (MAX_JOB // 256) + b"\r\n" * ((MAX_JOB % 256) // 2) + b"!"
assert len(BIG_OK) == MAX_JOB
TOO_BIG = b"z" * (MAX_JOB + 1)

CASES: list[Case] = [
    # ---------------------------------------------------------------- put
    C("put-reserve-delete",
      S(put(b"hello")), S(b"peek {1}\r\n"), S(b"reserve\r\n"),
      S(b"delete {1}\r\n"), S(b"delete {1}\r\n"), S(b"peek {1}\r\n")),
    C("put-body-cr-lf-nul",
      S(put(b"a\r\nb\x00c\rd\ne\r\n\r\n\x00")), S(put(b"\r\n")), S(put(b"\r")),
      S(put(b"\n")), S(put(b"\x00")),
      S(b"reserve\r\n"), S(b"reserve\r\n"), S(b"reserve\r\n"), S(b"reserve\r\n"),
      S(b"reserve\r\n"), S(b"peek {1}\r\n")),
    C("put-zero-length-body",
      S(b"put 0 0 60 0\r\n\r\n"), S(b"peek {1}\r\n"), S(b"reserve\r\n"),
      S(b"stats-job {1}\r\n")),
    C("put-max-job-size",
      S(put(BIG_OK)), S(b"peek-ready\r\n"), S(b"reserve-with-timeout 0\r\n")),
    C("put-job-too-big-skips-body",
      S(b"put 0 0 60 %d\r\n%s\r\n" % (len(TOO_BIG), TOO_BIG) + LTU, 2),
      S(put(b"after")), S(b"stats-tube {T}\r\n")),
    C("put-job-too-big-one-send-with-next-put",
      S(b"put 0 0 60 70000\r\n" + b"\x00" * 70000 + b"\r\n" + put(b"next"), 2),
      S(b"peek-ready\r\n")),
    C("put-job-too-big-with-trailing-garbage",
      S(b"put 0 0 60 65536x\r\n" + b"q" * 65536 + b"\r\n" + LTU, 2)),
    C("put-job-too-big-body-not-yet-sent",
      S(b"put 0 0 60 65536\r\n", 0), S(b"q" * 65536 + b"\r\n" + LTU, 2)),
    C("put-job-too-big-trailer-not-checked",
      S(b"put 0 0 60 65536\r\n" + b"q" * 65536 + b"XY" + LTU, 2)),
    C("put-expected-crlf",
      S(b"put 0 0 60 3\r\nabcXY"), S(LTU), S(put(b"ok")), S(b"peek {1}\r\n"),
      S(b"peek {2}\r\n"), S(b"stats-tube {T}\r\n")),
    C("put-expected-crlf-cr-only",
      S(b"put 0 0 60 3\r\nabc\r", 0), S(b"X" + LTU, 2)),
    C("put-expected-crlf-short-body-eats-next-command",
      S(b"put 0 0 60 10\r\nabc\r\n" + LTU, 2), S(LTU)),
    C("put-expected-crlf-then-pipelined-put",
      S(b"put 0 0 60 1\r\nab\r\n" + put(b"c"), 3), S(LTU)),
    C("put-body-split-across-sends",
      S(b"put 0 0 60 10\r\n01234", 0), S(b"56789", 0), S(b"\r\n"), S(b"peek {1}\r\n")),
    C("put-bad-format",
      S(b"put\r\n"), S(b"put \r\n"), S(b"put 0 0 60\r\n"), S(b"put 0 0\r\n"),
      S(b"put 1\r\n"), S(b"put -1 0 60 1\r\n"), S(b"put 0 -1 60 1\r\n"),
      S(b"put 0 0 -1 1\r\n"), S(b"put 0 0 60 -1\r\n"), S(b"put a 0 60 1\r\n"),
      S(b"put 0 a 60 1\r\n"), S(b"put 0 0 a 1\r\n"), S(b"put 0 0 60 a\r\n"),
      S(b"put +1 0 60 1\r\n"), S(b"put 0x1 0 60 1\r\n"), S(b"put 0\t0 60 1\r\n"),
      S(b"put 4294967296 0 60 1\r\n"), S(b"put 0 4294967296 60 1\r\n"),
      S(b"put 0 0 4294967296 1\r\n"), S(b"put 0 0 60 4294967296\r\n"),
      S(b"put 99999999999999999999 0 60 1\r\n"), S(b"PUT 0 0 60 1\r\n"),
      S(b"put 1.5 0 60 1\r\n"), S(b"stats-tube {T}\r\n")),
    # A fifth argument is BAD_FORMAT (smallstalk's per-job max age is put-expiring).
    C("put-fifth-argument-is-bad-format",
      S(b"put 0 0 60 1 2\r\nx\r\n", 2), S(b"put 0 0 60 1 0\r\nx\r\n", 2),
      S(b"put 0 0 60 1 4294967296\r\nx\r\n", 2), S(b"peek-ready\r\n"),
      S(b"stats-tube {T}\r\n")),
    C("put-trailing-garbage-then-body-is-a-command",
      S(b"put 0 0 60 5 \r\nhello\r\n", 2), S(b"put 0 0 60 5 6x\r\nhello\r\n", 2),
      S(b"put 0 0 60 5x\r\nhello\r\n", 2), S(b"put 0 0 60 5\r\nstats\r\n"), S(b"peek {1}\r\n")),
    C("put-odd-but-valid-numbers",
      S(b"put  0  0  60  1\r\na\r\n"), S(b"put 000000000000000000007 0 60 1\r\nb\r\n"),
      S(b"put 4294967295 0 4294967295 1\r\nc\r\n"), S(b"put 0 4294967295 1 1\r\nd\r\n"),
      S(b"put 0 0 60 0001\r\ne\r\n"),
      S(b"stats-job {1}\r\n"), S(b"stats-job {2}\r\n"), S(b"stats-job {3}\r\n"),
      S(b"stats-job {4}\r\n"), S(b"stats-job {5}\r\n")),
    C("put-ttr-zero-becomes-one",
      S(put(b"x", ttr=0)), S(b"stats-job {1}\r\n")),
    C("put-nul-in-command-line",
      S(b"put 0 0 60 1\x00\r\nx\r\n", 2), S(b"put 0 0\x0060 1\r\n"), S(LTU)),
    # ------------------------------------------------------ priorities
    C("priority-order-then-fifo",
      S(put(b"a", pri=5) + put(b"b", pri=1) + put(b"c", pri=5) + put(b"d", pri=0)
        + put(b"e", pri=4294967295) + put(b"f", pri=1) + put(b"g", pri=0), 7),
      S(b"peek-ready\r\n"),
      *[S(b"reserve\r\n") for _ in range(7)],
      S(b"reserve-with-timeout 0\r\n")),
    C("priority-across-watched-tubes",
      S(b"use {U}\r\nwatch {U}\r\n", 2),
      S(put(b"u5", pri=5)), S(b"use {T}\r\n"), S(put(b"t5", pri=5)), S(put(b"t4", pri=4)),
      S(b"reserve\r\n"), S(b"reserve\r\n"), S(b"reserve\r\n")),
    C("urgent-count-boundary",
      S(put(b"a", pri=1023) + put(b"b", pri=1024) + put(b"c", pri=0), 3),
      S(b"stats-tube {T}\r\n")),
    # ------------------------------------------------------------- use
    C("use-and-list-tube-used",
      S(LTU), S(b"use {U}\r\n"), S(LTU), S(put(b"in-u")), S(b"peek-ready\r\n"),
      S(b"use {T}\r\n"), S(b"peek-ready\r\n"), S(b"stats-job {1}\r\n")),
    C("use-name-rules",
      S(b"use a-b+c/d;e.f$g_h(i)j0\r\n"), S(b"use " + NAME200 + b"\r\n"),
      S(b"use " + NAME201 + b"\r\n"), S(b"use -a\r\n"), S(b"use a b\r\n"),
      S(b"use a*b\r\n"), S(b"use a:b\r\n"), S(b"use \r\n"), S(b"use\r\n"),
      S(b"use  {T}\r\n"), S(b"use {T} \r\n"), S(b"use {T}\t\r\n"), S(b"use \xc3\xa9\r\n"),
      S(b"use a-\r\n"), S(b"use 0\r\n"), S(b"use (\r\n"), S(LTU)),
    # -------------------------------------------------------- reserve
    C("reserve-with-timeout-zero",
      S(b"reserve-with-timeout 0\r\n"), S(put(b"x")), S(b"reserve-with-timeout 0\r\n"),
      S(b"reserve-with-timeout 0\r\n")),
    C("reserve-with-timeout-strtol-quirks",
      S(b"reserve-with-timeout 0x\r\n"), S(b"reserve-with-timeout abc\r\n"),
      S(b"reserve-with-timeout \r\n"), S(b"reserve-with-timeout  0\r\n"),
      S(b"reserve-with-timeout +0\r\n"), S(b"reserve-with-timeout -0\r\n"),
      S(b"reserve-with-timeout 0 junk\r\n"), S(b"reserve-with-timeout 4294967296\r\n"),
      S(b"reserve-with-timeout 99999999999999999999\r\n"),
      S(b"reserve-with-timeout\r\n"), S(b"reserve-with-timeoutx 0\r\n"),
      S(put(b"a") + put(b"b") + put(b"c"), 3),
      S(b"reserve-with-timeout 5x\r\n"), S(b"reserve-with-timeout -1\r\n"),
      S(b"reserve-with-timeout 9223372036854775807\r\n")),
    C("reserve-bad-format",
      S(b"reservex\r\n"), S(b"reserve \r\n"), S(b"reserve 0\r\n"), S(b"RESERVE\r\n"),
      S(b"reserve-\r\n"), S(b"reserve-job\r\n")),
    C("reserve-blocks-until-put",
      S(b"reserve\r\n", 0, conn=1), S(put(b"wake")), S(b"", 1, conn=1),
      S(b"delete {1}\r\n", conn=1)),
    C("reserve-half-closed-connection-times-out",
      S(b"reserve\r\n", 1, shut_wr=True, closed=True)),
    C("disconnect-releases-reserved-job",
      S(put(b"x")), S(b"reserve\r\n", conn=1), S(b"quit\r\n", 0, conn=1, closed=True),
      S(b"reserve-with-timeout 2\r\n"), S(b"stats-job {1}\r\n")),
    C("reserve-with-timeout-1-times-out",
      S(b"reserve-with-timeout 1\r\n")),
    C("reserve-with-timeout-int-truncation-4294967297",
      S(b"reserve-with-timeout 4294967297\r\n")),
    C("deadline-soon",
      S(put(b"x", ttr=1)), S(b"reserve\r\n"), S(b"reserve\r\n"),
      S(b"reserve-with-timeout 0\r\n"), S(put(b"y", ttr=60)), S(b"reserve\r\n"),
      S(b"delete {1}\r\n"), S(b"delete {2}\r\n")),
    # beanstalkd 1.12 loses a connection's TTR timer now and then (it computes
    # the tick time from two clock reads, wakes a few ns before the deadline
    # and drops the timer), so the TTR must have passed (conn 1 waits 2 s on
    # an empty tube) and conn 0 must do something before the job is looked at.
    C("ttr-expiry-releases-job",
      S(put(b"x", ttr=1)), S(b"reserve\r\n"),
      S(b"watch {U}\r\nignore {T}\r\n", 2, conn=1), S(b"reserve-with-timeout 2\r\n", conn=1),
      S(LTU), S(b"watch {T}\r\nreserve-with-timeout 2\r\n", 2, conn=1),
      S(b"stats-job {1}\r\n", conn=1), S(b"touch {1}\r\n"), S(b"delete {1}\r\n")),
    C("delayed-job-becomes-ready",
      S(put(b"x", delay=1)), S(b"reserve-with-timeout 0\r\n"), S(b"peek-delayed\r\n"),
      S(b"reserve-with-timeout 3\r\n"), S(b"stats-job {1}\r\n")),
    C("reserve-job",
      S(put(b"r") + put(b"d", delay=100) + put(b"b"), 3),
      S(b"reserve-job {3}\r\n"), S(b"bury {3} 9\r\n"),
      S(b"reserve-job {1}\r\n"), S(b"reserve-job {1}\r\n"), S(b"reserve-job {1}\r\n", conn=1),
      S(b"reserve-job {2}\r\n"), S(b"reserve-job {3}\r\n"),
      S(b"stats-job {2}\r\n"), S(b"stats-job {3}\r\n"), S(b"stats-tube {T}\r\n"),
      S(b"reserve-job 99999999\r\n"), S(b"reserve-job 0\r\n"), S(b"reserve-job x\r\n"),
      S(b"reserve-job {1} \r\n"), S(b"reserve-job -1\r\n"), S(b"reserve-job \r\n"),
      S(b"reserve-job  {1}\r\n")),
    # ---------------------------------------------------- delete etc.
    C("delete-states",
      S(put(b"ready") + put(b"delayed", delay=100) + put(b"res") + put(b"bur"), 4),
      S(b"reserve-job {3}\r\n"), S(b"reserve-job {4}\r\n"), S(b"bury {4} 0\r\n"),
      S(b"delete {3}\r\n", conn=1), S(b"delete {1}\r\n"), S(b"delete {2}\r\n"),
      S(b"delete {4}\r\n"), S(b"delete {3}\r\n"), S(b"delete {3}\r\n"),
      S(b"stats-tube {T}\r\n")),
    C("delete-bad-format",
      S(b"delete\r\n"), S(b"delete \r\n"), S(b"delete x\r\n"), S(b"delete 1 \r\n"),
      S(b"delete -1\r\n"), S(b"delete +1\r\n"), S(b"delete 1 2\r\n"),
      S(b"delete 18446744073709551615\r\n"), S(b"delete 18446744073709551616\r\n"),
      S(b"delete 0\r\n"), S(b"deletex 1\r\n"), S(put(b"x")), S(b"delete  {1}\r\n")),
    C("release",
      S(put(b"x", pri=10)), S(b"release {1} 1 0\r\n"), S(b"reserve\r\n"),
      S(b"release {1} 1 0\r\n", conn=1), S(b"release {1} 3 0\r\n"), S(b"stats-job {1}\r\n"),
      S(b"reserve\r\n"), S(b"release {1} 4 100\r\n"), S(b"stats-job {1}\r\n"),
      S(b"peek-delayed\r\n"), S(b"release {1} 0 0\r\n"), S(b"release 99999999 0 0\r\n"),
      S(b"release {1} 0\r\n"), S(b"release {1}\r\n"), S(b"release {1} 0 0 0\r\n"),
      S(b"release {1} 0 0 \r\n"), S(b"release {1} 4294967296 0\r\n"),
      S(b"release {1} 0 4294967296\r\n"), S(b"release {1} -1 0\r\n"), S(b"release\r\n"),
      S(b"release  {1}  0  0\r\n")),
    C("bury-and-peek-buried",
      S(put(b"a") + put(b"b") + put(b"c"), 3),
      S(b"peek-buried\r\n"), S(b"bury {1} 5\r\n"),
      S(b"reserve\r\n"), S(b"reserve\r\n"), S(b"bury {2} 7\r\n"), S(b"bury {1} 6\r\n"),
      S(b"peek-buried\r\n"), S(b"stats-job {1}\r\n"), S(b"stats-job {2}\r\n"),
      S(b"bury {3} 0\r\n"), S(b"bury 99999999 0\r\n"), S(b"bury {1}\r\n"),
      S(b"bury {1} 0 0\r\n"), S(b"bury {1} x\r\n"), S(b"bury\r\n"), S(b"bury \r\n"),
      S(b"bury {1} 4294967296\r\n"), S(b"stats-tube {T}\r\n")),
    C("touch",
      S(put(b"x")), S(b"touch {1}\r\n"), S(b"reserve\r\n"), S(b"touch {1}\r\n"),
      S(b"touch {1}\r\n", conn=1), S(b"touch 99999999\r\n"), S(b"touch x\r\n"),
      S(b"touch {1} \r\n"), S(b"touch\r\n"), S(b"stats-job {1}\r\n")),
    # --------------------------------------------------------- watch
    C("watch-ignore",
      S(b"list-tubes-watched\r\n"), S(b"watch {U}\r\n"), S(b"watch {U}\r\n"),
      S(b"list-tubes-watched\r\n"), S(b"ignore {U}\r\n"), S(b"ignore {U}\r\n"),
      S(b"ignore {T}\r\n"), S(b"ignore nope-never-used\r\n"), S(b"watch -x\r\n"),
      S(b"watch\r\n"), S(b"watch \r\n"), S(b"watch {U} \r\n"), S(b"ignore -x\r\n"),
      S(b"ignore\r\n"), S(b"ignore " + NAME201 + b"\r\n"), S(b"watch " + NAME201 + b"\r\n"),
      S(b"watch " + NAME200 + b"\r\n"), S(b"ignore " + NAME200 + b"\r\n"),
      S(b"list-tubes-watched\r\n")),
    C("watch-list-order-after-ignore",
      S(b"watch {U}\r\nwatch {U}a\r\nwatch {U}b\r\n", 3), S(b"list-tubes-watched\r\n"),
      S(b"ignore {T}\r\n"), S(b"list-tubes-watched\r\n"), S(b"ignore {U}a\r\n"),
      S(b"list-tubes-watched\r\n"), S(b"watch {T}\r\n"), S(b"list-tubes-watched\r\n")),
    C("reserve-only-from-watched",
      S(b"use {U}\r\n"), S(put(b"elsewhere")), S(b"reserve-with-timeout 0\r\n"),
      S(b"watch {U}\r\n"), S(b"reserve-with-timeout 0\r\n")),
    # ---------------------------------------------------------- peek
    C("peek-commands",
      S(b"peek-ready\r\n"), S(b"peek-delayed\r\n"), S(b"peek-buried\r\n"),
      S(put(b"d100", delay=100) + put(b"d50", delay=50) + put(b"r") + put(b"r0", pri=0), 4),
      S(b"peek-ready\r\n"), S(b"peek-delayed\r\n"), S(b"peek {1}\r\n"),
      S(b"reserve\r\n"), S(b"peek {4}\r\n"), S(b"peek-ready\r\n"),
      S(b"use {U}\r\n"), S(b"peek-ready\r\n"), S(b"peek-delayed\r\n"), S(b"peek {3}\r\n"),
      S(b"peek 0\r\n"), S(b"peek 18446744073709551615\r\n"),
      S(b"peek 18446744073709551616\r\n"), S(b"peek x\r\n"), S(b"peek\r\n"),
      S(b"peek \r\n"), S(b"peek {1} \r\n"), S(b"peekx\r\n"), S(b"peek-readyx\r\n"),
      S(b"peek-ready \r\n"), S(b"peek-delayed 1\r\n"), S(b"peek-buriedx\r\n"),
      S(b"peek-\r\n"), S(b"peek -1\r\n")),
    # ---------------------------------------------------------- kick
    C("kick-buried-before-delayed",
      S(put(b"d1", delay=100) + put(b"d2", delay=100) + put(b"b1") + put(b"b2"), 4),
      S(b"reserve\r\n"), S(b"reserve\r\n"), S(b"bury {3} 0\r\n"), S(b"bury {4} 0\r\n"),
      S(b"kick 1\r\n"), S(b"peek-ready\r\n"), S(b"kick 10\r\n"), S(b"peek-buried\r\n"),
      S(b"kick 10\r\n"), S(b"peek-delayed\r\n"), S(b"kick 10\r\n"), S(b"stats-job {1}\r\n"),
      S(b"stats-tube {T}\r\n")),
    C("kick-strtoul-quirks",
      S(b"".join(put(b"%d" % i, delay=1000) for i in range(8)), 8),
      S(b"kick 1x\r\n"), S(b"kick +1\r\n"), S(b"kick \t1\r\n"), S(b"kick  1\r\n"),
      S(b"kick 4294967296\r\n"), S(b"kick 4294967297\r\n"), S(b"kick 0\r\n"),
      S(b"kick 1 2\r\n"), S(b"kick -4294967295\r\n"),
      S(b"".join(put(b"%d" % i, delay=1000) for i in range(3)), 3),
      S(b"kick -1\r\n"), S(b"kick x\r\n"), S(b"kick \r\n"), S(b"kick\r\n"),
      S(b"kick -\r\n"), S(b"kick 99999999999999999999\r\n"), S(b"kickx 1\r\n")),
    C("kick-only-used-tube",
      S(put(b"x", delay=100)), S(b"use {U}\r\n"), S(b"kick 5\r\n"), S(b"use {T}\r\n"),
      S(b"kick 5\r\n")),
    C("kick-job",
      S(put(b"ready") + put(b"delayed", delay=100) + put(b"res") + put(b"bur"), 4),
      S(b"reserve-job {3}\r\n"), S(b"reserve-job {4}\r\n"), S(b"bury {4} 0\r\n"),
      S(b"kick-job {1}\r\n"), S(b"kick-job {2}\r\n"), S(b"kick-job {2}\r\n"),
      S(b"kick-job {3}\r\n"), S(b"use {U}\r\n"), S(b"kick-job {4}\r\n"),
      S(b"kick-job 99999999\r\n"), S(b"kick-job x\r\n"), S(b"kick-job {1} \r\n"),
      S(b"kick-job\r\n"), S(b"kick-job \r\n"), S(b"kick-jobx 1\r\n"),
      S(b"stats-job {2}\r\n"), S(b"stats-job {4}\r\n")),
    # --------------------------------------------------------- stats
    C("stats-job-states",
      S(put(b"r", pri=3, ttr=100) + put(b"d", delay=100) + put(b"b", pri=2000), 3),
      S(b"stats-job {1}\r\n"), S(b"stats-job {2}\r\n"), S(b"reserve\r\n"),
      S(b"stats-job {1}\r\n"), S(b"reserve\r\n"), S(b"bury {3} 4\r\n"),
      S(b"stats-job {3}\r\n"), S(b"stats-job 99999999\r\n"), S(b"stats-job x\r\n"),
      S(b"stats-job {1} \r\n"), S(b"stats-job\r\n"), S(b"stats-job \r\n"),
      S(b"stats-job 18446744073709551616\r\n")),
    C("stats-tube",
      S(b"stats-tube {T}\r\n"), S(b"stats-tube {U}\r\n"), S(b"watch {U}\r\n"),
      S(b"stats-tube {U}\r\n"), S(b"stats-tube -x\r\n"), S(b"stats-tube " + NAME201 + b"\r\n"),
      S(b"stats-tube\r\n"), S(b"stats-tube \r\n"), S(b"stats-tube {T} \r\n"),
      S(b"stats-tube  {T}\r\n"), S(b"stats-tubex\r\n")),
    # Key sets and order of every stats reply, on a fresh server (the default
    # tube, global counters): smallstalk's own keys must not appear.
    C("stats-keys-and-order",
      S(b"stats\r\n"), S(put(b"a", pri=1) + put(b"b", delay=50) + put(b"c"), 3),
      S(b"reserve\r\n"), S(b"bury {1} 5\r\n"), S(b"stats\r\n"),
      S(b"stats-tube default\r\n"), S(b"stats-job {1}\r\n"), S(b"stats-job {2}\r\n"),
      S(b"stats-job {3}\r\n"), S(b"use other\r\n"), S(put(b"d")),
      S(b"stats-tube other\r\n"), S(b"pause-tube other 30\r\n"),
      S(b"stats-tube other\r\n"), S(b"stats\r\n"), fresh=True),
    C("stats-prefix-quirks",
      S(b"statsx\r\n"), S(b"stats \r\n"), S(b"stats-\r\n"), S(b"stats-jobx 1\r\n"),
      S(b"list-tubesx\r\n"), S(b"list-tubes \r\n"), S(b"list-tubes-\r\n"),
      S(b"list-tube-usedx\r\n"), S(b"list-tube-used \r\n"), S(b"list-tubes-watchedx\r\n"),
      S(b"list-tubes-watched \r\n"), S(b"list-tube\r\n"), S(b"list\r\n"),
      S(b"list-tubes-watche\r\n")),
    # ---------------------------------------------------- pause-tube
    C("pause-tube",
      S(put(b"x")), S(b"pause-tube {T} 100\r\n"), S(b"reserve-with-timeout 0\r\n"),
      S(b"peek-ready\r\n"), S(b"stats-tube {T}\r\n"), S(b"pause-tube {T} 0\r\n"),
      S(b"stats-tube {T}\r\n"), S(b"reserve-with-timeout 0\r\n"),
      S(b"pause-tube nope-never-used 1\r\n"),
      S(b"pause-tube {T}\r\n"), S(b"pause-tube {T} \r\n"), S(b"pause-tube {T} 1 \r\n"),
      S(b"pause-tube {T} x\r\n"), S(b"pause-tube {T} -1\r\n"),
      S(b"pause-tube {T} 4294967296\r\n"), S(b"pause-tube -x 1\r\n"),
      S(b"pause-tube " + NAME201 + b" 1\r\n"), S(b"pause-tube\r\n"), S(b"pause-tube \r\n"),
      S(b"pause-tube {T}\t1\r\n"), S(b"pause-tube {T} 1 2\r\n")),
    C("pause-tube-spacing-quirks",
      S(b"pause-tube{T} 7\r\n"), S(b"pause-tube   {T}   8\r\n"), S(b"stats-tube {T}\r\n"),
      S(b"pause-tube {T} 00009\r\n"), S(b"pause-tube {T} 4294967295\r\n"),
      S(b"stats-tube {T}\r\n"), S(b"pause-tube {T}x 1\r\n"), S(b"pause-tubex 1\r\n"),
      S(b"pause-tube {T}*1\r\n")),
    C("pause-tube-expires",
      S(put(b"x")), S(b"pause-tube {T} 1\r\n"), S(b"reserve-with-timeout 0\r\n"),
      S(b"reserve-with-timeout 3\r\n")),
    C("pause-tube-line-exactly-224-bytes",
      S(b"use " + NAME200 + b"\r\n"),
      S(b"pause-tube " + NAME200 + b" 4294967295\r\n"),
      S(b"pause-tube " + NAME200 + b"  4294967295\r\n" + SWALLOW_PROBE, 2), S(LTU)),
    # ---------------------------------------------------------- quit
    C("quit", S(b"quit\r\n", 0, closed=True)),
    C("quit-prefix", S(b"quitx\r\n", 0, closed=True)),
    C("quit-with-args", S(b"quit now please\r\n", 0, closed=True)),
    C("quit-pipelined", S(LTU + b"quit\r\n" + LTU, 1, closed=True)),
    C("quit-other-connection-unaffected",
      S(LTU, conn=1), S(b"quit\r\n", 0, closed=True), S(LTU, conn=1)),
    C("quit-uppercase-unknown", S(b"QUIT\r\n"), S(b"quit\r\n", 0, closed=True)),
    # ----------------------------------------------- unknown commands
    C("unknown-command",
      S(b"foo\r\n"), S(b"\r\n"), S(b" \r\n"), S(b" list-tube-used\r\n"),
      S(b"List-tube-used\r\n"), S(b"stat\r\n"), S(b"deletex 1\r\n"), S(b"watchx\r\n"),
      S(b"use\r\n"), S(b"\t\r\n"), S(b"\n\r\n"), S(b"list-tube-used\n\r\n"),
      S(b"x" * (LINE_MAX - 2) + b"\r\n"), S(b"\xff\xfe\r\n"), S(LTU)),
    # ----------------------------------------------------- bad format
    C("nul-byte-in-command-line",
      S(b"list-tube-used\x00\r\n"), S(b"\x00\r\n"), S(b"\x00list-tube-used\r\n"),
      S(b"use {T}\x00x\r\n"), S(b"stats\x00\r\n"), S(b"foo\x00\r\n"), S(LTU)),
    C("line-length-limit",
      S(padded(b"put 0 0 60 ", b"1", LINE_MAX) + b"x\r\n"),
      S(padded(b"put 0 0 60 ", b"1", LINE_MAX + 1) + b"y\r\n" + LTU, 2),
      S(padded(b"put 0 0 60 ", b"1", LINE_MAX + 2) + b"y\r\n" + LTU, 3),
      S(b"peek-ready\r\n")),
    C("overlong-line-swallows-next-line-when-cr-is-byte-224",
      S(b"x" * (LINE_MAX - 1) + b"\r\n" + SWALLOW_PROBE, 2), S(LTU)),
    C("overlong-line-226-bytes",
      S(b"x" * LINE_MAX + b"\r\n" + LTU, 2), S(LTU)),
    C("overlong-line-1000-bytes",
      S(b"use " + b"a" * 994 + b"\r\n"), S(LTU)),
    C("overlong-line-449-bytes",
      S(b"x" * (2 * LINE_MAX - 1) + b"\r\n" + SWALLOW_PROBE, 2)),
    C("overlong-line-then-put",
      S(b"stats-tube " + b"t" * 500 + b"\r\n" + put(b"after"), 2), S(b"peek {1}\r\n")),
    C("overlong-line-sent-in-pieces",
      S(b"y" * 200, 0), S(b"y" * 200, 0), S(b"\r\n", 1), S(LTU)),
    # beanstalkd only looks at the first CR of its buffer: a bare CR hides
    # every later CRLF until 224 bytes have piled up and are discarded.
    C("bare-cr-in-command-line",
      S(b"use a\rb\r\n", 0), S(b"".join(b"use pad%02d\r\n" % i for i in range(22)), 3),
      S(LTU)),
    C("bare-cr-then-crlf-in-command-line",
      S(b"list-tube-used\r\r\n" + b"".join(b"use pad%02d\r\n" % i for i in range(22)), 4)),
    C("bare-lf-is-not-a-line-end",
      S(b"list-tube-used\n" + LTU), S(LTU)),
    # ---------------------------------------------------- pipelining
    C("pipelined-put-reserve-delete",
      S(b"".join(put(b"job-%03d" % i, pri=i % 3) for i in range(40)), 40),
      S(b"reserve\r\n" * 40, 40),
      S(b"".join(b"delete {%d}\r\n" % i for i in range(1, 41)), 40),
      S(b"stats-tube {T}\r\n")),
    C("pipelined-mixed-errors",
      S(put(b"a") + b"bogus\r\n" + b"put 0 0 60 1\r\nxyz\r\n" + b"peek {1}\r\n"
        + b"put 0 0 60 70000\r\n" + b"p" * 70000 + b"\r\n" + b"use -bad\r\n"
        + b"x" * 300 + b"\r\n" + b"reserve\r\n" + b"delete {1}\r\n" + LTU, 11)),
    C("pipelined-everything-one-send",
      S(b"use {U}\r\nwatch {U}\r\nignore {T}\r\n" + put(b"one") + put(b"two", pri=1)
        + b"peek-ready\r\nreserve\r\nrelease {1} 5 0\r\nreserve\r\nbury {2} 1\r\n"
        + b"peek-buried\r\nkick 1\r\nreserve-job {2}\r\ntouch {2}\r\ndelete {2}\r\n"
        + b"stats-job {1}\r\nlist-tubes-watched\r\nlist-tube-used\r\n"
        + b"pause-tube {U} 0\r\nstats-tube {U}\r\n", 20)),
    # ------------------------------------------- fresh server (global)
    C("fresh-ids-start-at-1-and-default-tube",
      S(LTU), S(b"list-tubes-watched\r\n"), S(b"list-tubes\r\n"),
      S(put(b"first")), S(put(b"second")), S(b"stats-job 1\r\n"),
      S(b"reserve\r\n"), S(b"stats-tube default\r\n"), S(b"ignore default\r\n"),
      fresh=True),
    C("fresh-stats",
      S(b"stats\r\n"), fresh=True),
    C("fresh-stats-after-activity",
      S(put(b"a", pri=1) + put(b"b", pri=2000) + put(b"c", delay=100), 3),
      S(b"reserve\r\n"), S(b"reserve\r\n"), S(b"bury 2 0\r\n"),
      S(b"use other\r\n", conn=1), S(put(b"d"), conn=1),
      S(b"watch other\r\n", conn=2), S(b"reserve-with-timeout 0\r\n", conn=2),
      S(b"peek 1\r\npeek-ready\r\npeek-delayed\r\npeek-buried\r\n", 4, conn=1),
      S(b"kick 1\r\nkick-job 3\r\ntouch 1\r\nrelease 1 0 0\r\n", 4),
      S(b"stats-job 1\r\nstats-tube other\r\nlist-tubes\r\nlist-tube-used\r\n", 4),
      S(b"list-tubes-watched\r\npause-tube other 0\r\nignore other\r\ndelete 4\r\n", 4, conn=2),
      S(b"stats\r\n"), S(b"stats\r\n", conn=1), fresh=True),
    C("fresh-stats-counts-failed-commands",
      S(b"put 0 0 60 1 x\r\n"), S(b"put 0 0 60 70000x\r\n" + b"j" * 70000 + b"\r\n"),
      S(b"put x\r\n"), S(b"put 0 0 60 2\r\nabcd"), S(b"pause-tube -bad 1\r\n"),
      S(b"pause-tube nope 1\r\n"), S(b"use -bad\r\n"), S(b"watch -bad\r\n"),
      S(b"ignore -bad\r\n"), S(b"stats-tube -bad\r\n"), S(b"statsx\r\n"),
      S(b"list-tubesx\r\n"), S(b"reserve-with-timeout 0\r\n"), S(b"reservex\r\n"),
      S(b"delete x\r\n"), S(b"delete 9\r\n"), S(b"kick x\r\n"), S(b"kick 1\r\n"),
      S(b"kick-job 9\r\n"), S(b"reserve-job 9\r\n"), S(b"stats-job 9\r\n"),
      S(b"peek 9\r\n"), S(b"touch 9\r\n"), S(b"bury 9 0\r\n"), S(b"release 9 0 0\r\n"),
      S(b"stats\r\n"), fresh=True),
    C("fresh-negative-reserve-timeout-counts-as-reserve-with-timeout",
      S(put(b"a")), S(b"reserve-with-timeout -5\r\n"), S(b"release 1 0 0\r\n"),
      S(b"reserve-with-timeout 4294967295x\r\n"), S(b"stats\r\n"), fresh=True),
    C("fresh-expected-crlf-burns-an-id",
      S(b"put 0 0 60 1\r\nabc"), S(put(b"c")), S(b"put 0 0 60 70000\r\n" + b"b" * 70002),
      S(b"put 0 0 60 1 \r\n"), S(put(b"d")), S(b"stats\r\n"), fresh=True),
    C("fresh-list-tubes-order-after-tube-is-freed",
      S(b"watch a\r\nwatch b\r\nwatch c\r\nuse d\r\n", 4), S(b"list-tubes\r\n"),
      S(b"ignore a\r\n"), S(b"list-tubes\r\n"), S(b"list-tubes-watched\r\n"),
      S(b"use default\r\n"), S(b"list-tubes\r\n"), S(b"watch a\r\n"), S(b"list-tubes\r\n"),
      fresh=True),
    C("fresh-tube-kept-alive-by-jobs",
      S(b"use keep\r\n"), S(put(b"x")), S(b"use default\r\n"), S(b"list-tubes\r\n"),
      S(b"stats-tube keep\r\n"), S(b"delete 1\r\n"), S(b"list-tubes\r\n"),
      S(b"stats-tube keep\r\n"), fresh=True),
    C("fresh-stats-tube-default-connections",
      S(LTU, conn=1), S(LTU, conn=2), S(b"use x\r\n", conn=2), S(b"stats-tube default\r\n"),
      S(b"ignore default\r\n", conn=1), S(b"watch y\r\n", conn=1),
      S(b"ignore default\r\n", conn=1), S(b"stats-tube default\r\n"), S(b"stats-tube y\r\n"),
      S(b"stats\r\n"), fresh=True),
    C("fresh-job-ids-are-global-across-tubes",
      S(put(b"a")), S(b"use t2\r\n", conn=1), S(put(b"b"), conn=1), S(put(b"c")),
      S(b"peek 2\r\n"), S(b"stats-job 2\r\n"), S(b"reserve\r\n"), S(b"reserve\r\n"),
      fresh=True),
]
