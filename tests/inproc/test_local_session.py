"""`LocalSession` (server/local.py): an in-process connection to the real mutation loop,
on trio's mock clock. Command objects and protocol bytes reach the loop alike; replies
come back per submitted batch; closing and half-closing do what a socket's would.
"""

from __future__ import annotations

import pytest
import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.server.local import LocalSession
from smallstalk.storage import history
from smallstalk.storage.recovery import recover

from ..support.harness import make_loop


@pytest.fixture
async def lp(nursery, tmp_path):
    loop = make_loop(tmp_path)
    nursery.start_soon(loop.run)
    return loop


async def test_command_objects_and_bytes_get_the_same_replies(lp, autojump_clock) -> None:
    objects, raw = LocalSession(lp), LocalSession(lp)
    assert objects.id != raw.id
    got = await objects.ask([p.Use("t"), p.Put(5, 0, 60, b"one"), p.StatsJob(1)])
    assert got.startswith(b"USING t\r\nINSERTED 1\r\nOK ")
    assert b"tube: t\n" in got
    assert await raw.ask(b"use t\r\nput 5 0 60 3\r\ntwo\r\n") == b"USING t\r\nINSERTED 2\r\n"
    # The parser's error events are commands too: answered in their place.
    assert await objects.ask([p.ErrorReply(p.BAD_FORMAT), p.Peek(2)]) == (
        p.BAD_FORMAT + b"FOUND 2 3\r\ntwo\r\n")


async def test_bytes_cut_anywhere_wait_for_the_rest(lp, autojump_clock) -> None:
    s = LocalSession(lp)
    s.send(b"delete 9\r\ndel")
    assert await s.replies() == b"NOT_FOUND\r\n"
    await trio.sleep(1)
    assert s.unread() == 0  # half a line is not a command: nothing more is answered
    s.send(b"ete 9\r\nput 0 0 60 5\r\nhel")
    # The put's line is a command (beanstalkd counts it and takes its id
    # there), answered with nothing until its body is in.
    assert await s.replies() == b"NOT_FOUND\r\n"
    await trio.sleep(1)
    assert s.unread() == 0
    assert await s.ask(b"lo\r\npeek-ready\r\n") == b"INSERTED 1\r\nFOUND 1 5\r\nhello\r\n"


async def test_replies_wait_until_read(lp, autojump_clock) -> None:
    worker, producer = LocalSession(lp), LocalSession(lp)
    worker.submit([p.Reserve(None)])
    await trio.sleep(10)
    assert worker.unread() == 0  # still waiting for a job
    assert await producer.ask([p.Put(0, 0, 60, b"x")]) == b"INSERTED 1\r\n"
    await trio.sleep(0.1)
    assert worker.unread() == 1  # delivered, and kept here until read
    assert await worker.replies() == b"RESERVED 1 1\r\nx\r\n"
    assert worker.unread() == 0


async def test_close_gives_back_what_it_reserved_and_is_logged(lp, tmp_path,
                                                               autojump_clock) -> None:
    worker, other = LocalSession(lp), LocalSession(lp)
    await worker.ask([p.Put(0, 0, 60, b"x")])
    assert await worker.ask([p.RESERVE]) == b"RESERVED 1 1\r\nx\r\n"
    worker.close()
    assert await other.ask([p.Reserve(5)]) == b"RESERVED 1 1\r\nx\r\n"
    await lp.journal.commit()
    recs = [rec for _, _, rec in history.iter_records(tmp_path) if type(rec) is r.Disconnect]
    assert [rec.conn for rec in recs] == [worker.id]
    assert recover(tmp_path).state.jobs[1].reserver == other.id


async def test_end_of_input_ends_a_waiting_reserve(lp, autojump_clock) -> None:
    s = LocalSession(lp)
    assert await s.ask([p.Put(0, 0, 60, b"a"), p.RESERVE]) == b"INSERTED 1\r\nRESERVED 1 1\r\na\r\n"
    s.submit([p.RESERVE])
    await trio.sleep(30)
    s.end_of_input()
    assert await s.replies() == p.TIMED_OUT
    assert not s.closed  # the client closes when it has read what it wanted
    s.close()


async def test_quit_closes_the_session(lp, autojump_clock) -> None:
    s = LocalSession(lp)
    assert await s.ask([p.Put(0, 0, 60, b"a"), p.QUIT]) == b"INSERTED 1\r\n"
    assert s.closed
