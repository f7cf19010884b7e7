"""A put whose body comes after its line, through the real mutation loop: its
count, its producer and its job id taken at the line, as beanstalkd takes
them; the put then answered with that id, through a fanout and an expiry,
while draining, on a replica, and after a hang-up mid-body; and the data
directory, whose records then hold ids out of order, replays to the same state.
"""

from __future__ import annotations

import pytest
import trio

from smallstalk.core import protocol as p
from smallstalk.server.policy import TubePolicy

from ..support.harness import Client, make_loop
from .test_tube_policies import assert_replays, policies, stat


@pytest.fixture
async def lp(nursery, tmp_path):
    loop = make_loop(tmp_path)
    nursery.start_soon(loop.run)
    return loop


async def stats(c: Client, *names: str) -> list[str]:
    reply = await c.ask(b"stats\r\n")
    return [stat(reply, n) for n in names]


async def test_the_line_takes_the_id_and_the_count(lp, tmp_path, autojump_clock) -> None:
    a, b = Client(lp), Client(lp)
    assert await b.ask(b"put 9 0 60 1\r\nx\r\n") == b"INSERTED 1\r\n"
    a.send(b"put 5 0 60 5\r\nhel")
    assert await a.replies() == b""  # the line: nothing answered yet
    assert await stats(b, "cmd-put", "current-producers") == ["2", "2"]
    assert await b.ask(b"put 5 0 60 1\r\ny\r\n") == b"INSERTED 3\r\n"
    assert await a.ask(b"lo\r\n") == b"INSERTED 2\r\n"
    assert await stats(b, "cmd-put", "total-jobs") == ["3", "3"]
    # Same priority: the lower id first, though its record came second.
    assert await b.ask(b"reserve-with-timeout 0\r\n") == b"RESERVED 2 5\r\nhello\r\n"
    # A bad trailer: the id was used, the put counted once.
    a.send(b"put 0 0 60 2\r\nab")
    await a.replies()
    assert await a.ask(b"XY") == p.EXPECTED_CRLF
    assert await b.ask(b"put 0 0 60 1\r\nz\r\n") == b"INSERTED 5\r\n"
    assert await stats(b, "cmd-put", "total-jobs") == ["5", "4"]
    # Too big: counted at the line, no id, no producer.
    c = Client(lp)
    c.send(b"put 0 0 60 70000\r\n" + b"z" * 10)
    await c.replies()
    assert await stats(b, "cmd-put", "current-producers") == ["6", "2"]
    assert await c.ask(b"z" * 69990 + b"\r\n") == p.JOB_TOO_BIG
    assert await b.ask(b"put 0 0 60 1\r\nw\r\n") == b"INSERTED 6\r\n"
    assert_replays(lp, tmp_path)


async def test_a_hang_up_mid_body_has_used_its_id(lp, tmp_path, autojump_clock) -> None:
    a, b = Client(lp), Client(lp)
    a.send(b"put 0 0 60 5\r\nhe")
    await a.replies()
    a.close()
    await trio.sleep(1)
    assert await b.ask(b"put 0 0 60 1\r\nx\r\n") == b"INSERTED 2\r\n"
    assert await stats(b, "cmd-put", "current-producers", "total-jobs") == ["2", "1", "1"]
    assert_replays(lp, tmp_path)


async def test_policies_use_the_id_the_line_took(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(orders=TubePolicy(max_age=30))
    prod, other, audit = Client(lp), Client(lp), Client(lp)
    await audit.ask(b"watch orders+audit\r\nignore default\r\n")
    await prod.ask(b"use orders\r\n")
    prod.send(b"put 0 0 60 2\r\nA")
    await prod.replies()
    assert await other.ask(b"put 0 0 60 1\r\nx\r\n") == b"INSERTED 2\r\n"
    assert await prod.ask(b"1\r\n") == b"INSERTED 1\r\n"  # a copy made, 3, for the child
    assert await audit.ask(b"reserve\r\n") == b"RESERVED 3 2\r\nA1\r\n"
    prod.send(b"put-expiring 0 0 60 10 2\r\nB")
    await prod.replies()
    assert await prod.ask(b"2\r\n") == b"INSERTED 4\r\n"
    assert await audit.ask(b"reserve\r\n") == b"RESERVED 5 2\r\nB2\r\n"
    assert_replays(lp, tmp_path)
    await trio.sleep(31)  # both jobs in orders expired, by their own max-age
    assert await prod.ask(b"peek 1\r\n") == p.NOT_FOUND
    assert await prod.ask(b"peek 4\r\n") == p.NOT_FOUND


async def test_draining_answers_draining_with_the_id_used(lp, tmp_path,
                                                          autojump_clock) -> None:
    a, b = Client(lp), Client(lp)
    a.send(b"put 0 0 60 2\r\nh")
    await a.replies()
    lp.start_draining()
    assert await a.ask(b"i\r\n") == p.DRAINING
    lp.draining = False
    assert await b.ask(b"put 0 0 60 1\r\nx\r\n") == b"INSERTED 2\r\n"
    assert await stats(b, "cmd-put") == ["2"]


async def test_a_replica_counts_and_takes_nothing(nursery, autojump_clock) -> None:
    lp = make_loop()
    nursery.start_soon(lp.run)
    lp.read_only = "replica of 127.0.0.1:11300"
    a = Client(lp)
    a.send(b"put 0 0 60 2\r\nh")
    assert await a.replies() == b""
    assert await a.ask(b"i\r\n") == p.READ_ONLY
    assert await stats(a, "cmd-put", "current-producers") == ["0", "0"]
