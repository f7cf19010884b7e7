"""`reserve-batch <n> <timeout>` through the real mutation loop on trio's mock
clock: the reply's frame, one Reserve record per job, TTR per job, the wait
when none is ready (filled by the loop's grant), limits, and replay."""

from __future__ import annotations

import os

import trio

from smallstalk.client.replies import ReplyReader
from smallstalk.core import protocol as p
from smallstalk.core import records as r

from ..support.harness import Client
from .test_holdback import configure, records_of, settle, started
from .test_readbehind import assert_replays as assert_replays_spilled
from .test_readbehind import make_loop as make_spilling_loop
from .test_readbehind import put_many
from .test_tube_policies import assert_replays


def batch(reply: bytes) -> list[tuple[int, bytes]]:
    """(id, body) of a RESERVED_BATCH reply, read strictly: the count line,
    then exactly that many RESERVED replies and nothing after them."""
    head, _, rest = reply.partition(b"\r\n")
    word, count = head.split(b" ")
    assert word == b"RESERVED_BATCH"
    reader = ReplyReader()
    reader.feed(rest)
    out = []
    for _ in range(int(count)):
        one = reader.next_reply()
        assert one is not None and one.word == b"RESERVED", reply
        out.append((int(one.args[0]), one.body))
    assert reader.next_reply() is None and reader.buffered() == 0, reply
    return out


async def test_takes_up_to_n_in_hand_out_order(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    for pri, body in ((5, b"a"), (1, b"bb"), (5, b"c"), (9, b"d\r\nx")):
        await c.ask(b"put %d 0 60 %d\r\n%s\r\n" % (pri, len(body), body))
    got = batch(await c.ask(b"reserve-batch 3 0\r\n"))
    assert got == [(2, b"bb"), (1, b"a"), (3, b"c")]
    st = lp.state
    assert [st.jobs[i].state for i in (1, 2, 3, 4)] == [2, 2, 2, 0]  # reserved x3, ready
    assert [rec.id for rec in records_of(tmp_path, r.Reserve)] == [2, 1, 3]
    # Fewer ready than asked for: what there is, no wait.
    assert batch(await c.ask(b"reserve-batch 10 5\r\n")) == [(4, b"d\r\nx")]
    assert await c.ask(b"reserve-batch 10 0\r\n") == p.TIMED_OUT
    assert await c.ask(b"reserve-batch 0 0\r\n") == p.BAD_FORMAT
    assert await c.ask(b"reserve-batch 1001 0\r\n") == p.BAD_FORMAT
    assert await c.ask(b"reserve-batch 2\r\n") == p.BAD_FORMAT
    st.check()
    assert_replays(lp, tmp_path)


async def test_ttr_runs_per_job(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    await c.ask(b"put 0 0 10 1\r\na\r\n")
    await c.ask(b"put 0 0 100 1\r\nb\r\n")
    assert [i for i, _ in batch(await c.ask(b"reserve-batch 2 0\r\n"))] == [1, 2]
    await trio.sleep(11)
    assert lp.state.jobs[1].state == 0 and lp.state.jobs[2].state == 2  # 1 timed out alone
    assert await c.ask(b"delete 2\r\n") == p.DELETED


async def test_waits_and_the_grant_fills_the_batch(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    worker, producer = Client(lp), Client(lp)
    worker.send(b"reserve-batch 3 30\r\n")
    await trio.sleep(1)
    assert worker.unread() == 0
    # Three puts in one turn: the waiting batch takes all three when it is granted.
    await producer.ask(b"put 0 0 60 1\r\na\r\nput 0 0 60 1\r\nb\r\nput 0 0 60 1\r\nc\r\n"
                       b"put 0 0 60 1\r\nd\r\n")
    got = batch(await worker.recv())
    assert [i for i, _ in got] == [1, 2, 3]
    assert lp.state.jobs[4].state == 0
    assert await producer.ask(b"delete 4\r\n") == p.DELETED
    # A wait that runs out answers TIMED_OUT, and the next put is not taken.
    worker.send(b"reserve-batch 2 5\r\n")
    await trio.sleep(6)
    assert await worker.recv() == p.TIMED_OUT
    await producer.ask(b"use other\r\nput 0 0 60 1\r\ne\r\n")
    assert lp.state.jobs[5].state == 0
    # After a batch wait, a plain reserve waits and gets one job as before.
    worker.send(b"watch other\r\nignore default\r\nreserve\r\n")
    await trio.sleep(1)
    assert (await worker.recv()).endswith(b"RESERVED 5 1\r\ne\r\n")
    lp.state.check()
    assert_replays(lp, tmp_path)


async def test_a_concurrency_limit_bounds_the_batch(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, "[tubes.work]\nmax-reserved = 2\n")
    c = Client(lp)
    await c.ask(b"use work\r\nwatch work\r\n")
    for _ in range(5):
        await c.ask(b"put 0 0 60 1\r\na\r\n")
    assert [i for i, _ in batch(await c.ask(b"reserve-batch 5 0\r\n"))] == [1, 2]
    assert await c.ask(b"reserve-batch 5 0\r\n") == p.TIMED_OUT


async def test_a_body_that_cannot_be_read_ends_the_batch_short(nursery, tmp_path,
                                                               autojump_clock) -> None:
    """A job is reserved only if it is in the reply: when a spilled body cannot
    be read, the batch ends before that job, which stays ready."""
    lp = make_spilling_loop(tmp_path, 1000)
    nursery.start_soon(lp.run)
    c = Client(lp)
    await put_many(c, [bytes([65 + i]) * 400 for i in range(6)])
    await settle()
    st = lp.state
    assert not isinstance(st.jobs[1].body, int)  # the newest bodies spill first
    first_spilled = min(jid for jid, j in st.jobs.items() if isinstance(j.body, int))
    # The body files' descriptors turn write-only under the store: reads fail
    # as a disk error would (EBADF), and the real ones come back after.
    bad = os.open(os.devnull, os.O_WRONLY)
    real = {f: f.fd for f in lp.bodies.files.values()}
    for f in real:
        f.fd = bad
    try:
        got = batch(await c.ask(b"reserve-batch 6 0\r\n"))
    finally:
        for f, fd in real.items():
            f.fd = fd
        os.close(bad)
    assert [i for i, _ in got] == list(range(1, first_spilled))
    assert st.jobs[first_spilled].state == 0  # not in the reply: still ready
    assert [rec.id for rec in records_of(tmp_path, r.Reserve)] == list(range(1, first_spilled))


class _UnreadableBodies:
    """While entered, the body files' descriptors turn write-only under the
    store: reads fail as a disk error would (EBADF); the real ones come back after."""

    def __init__(self, lp) -> None:
        self.lp = lp

    def __enter__(self) -> None:
        self.bad = os.open(os.devnull, os.O_WRONLY)
        self.real = {f: f.fd for f in self.lp.bodies.files.values()}
        for f in self.real:
            f.fd = self.bad

    def __exit__(self, *exc) -> None:
        for f, fd in self.real.items():
            f.fd = fd
        os.close(self.bad)


async def _spilled_first(c: Client, lp, delay: int = 0) -> int:
    """Six 400-byte jobs, the newest with the best priority: the newest bodies
    spill first, so the job a reserve takes first has its body on disk."""
    for i in range(6):
        body = bytes([65 + i]) * 400
        await c.ask(b"put %d %d 600 400\r\n%s\r\n" % (10 - i, delay, body))
    await settle()
    best = min(lp.state.jobs.values(), key=lambda j: (j.pri, j.id))
    assert isinstance(best.body, int), "the first job's body is on disk"
    return best.id


async def test_an_unreadable_first_body_reserves_nothing(nursery, tmp_path,
                                                         autojump_clock) -> None:
    """The first job's body cannot be read: INTERNAL_ERROR, the job stays
    ready and no Reserve record is written (a job is reserved only if it is
    in the reply), unlike plain `reserve`, which keeps the reservation."""
    lp = make_spilling_loop(tmp_path, 1000)
    nursery.start_soon(lp.run)
    c = Client(lp)
    first = await _spilled_first(c, lp)
    with _UnreadableBodies(lp):
        assert await c.ask(b"reserve-batch 3 0\r\n") == p.INTERNAL_ERROR
    st = lp.state
    assert all(j.state == 0 for j in st.jobs.values())
    assert records_of(tmp_path, r.Reserve) == []
    # Readable again: the same job leads the next batch.
    assert [i for i, _ in batch(await c.ask(b"reserve-batch 2 0\r\n"))] == [first, first - 1]
    assert_replays_spilled(lp, tmp_path)


async def test_an_unreadable_first_body_ends_a_granted_wait(nursery, tmp_path,
                                                            autojump_clock) -> None:
    """The same through a wait: the grant's job cannot be read, the waiting
    batch hears INTERNAL_ERROR with nothing reserved, and the connection's next
    wait is a plain reserve's again (one RESERVED, not a batch)."""
    lp = make_spilling_loop(tmp_path, 1000)
    nursery.start_soon(lp.run)
    worker, producer = Client(lp), Client(lp)
    worker.send(b"reserve-batch 3 30\r\n")
    await trio.sleep(1)
    first = await _spilled_first(producer, lp, delay=5)
    with _UnreadableBodies(lp):
        await trio.sleep(5)  # the delays run out: the grant finds the waiting batch
        assert await worker.recv() == p.INTERNAL_ERROR
    st = lp.state
    assert all(j.state == 0 for j in st.jobs.values())
    assert records_of(tmp_path, r.Reserve) == []
    assert not st.conns[min(st.conns)].waiting
    # The jobs go elsewhere; then a plain reserve's wait gets one job, plainly.
    got = batch(await producer.ask(b"reserve-batch 6 0\r\n"))
    assert got[0][0] == first and len(got) == 6
    worker.send(b"reserve-with-timeout 10\r\n")
    await trio.sleep(1)
    await producer.ask(b"put 0 0 60 1\r\na\r\nput 0 0 60 1\r\nb\r\n")
    assert await worker.recv() == p.reserved(7, b"a")
    assert_replays_spilled(lp, tmp_path)
