"""Group commit with the fsync thread (--fsync always): big turns fsync in the
thread while the loop goes on, replies wait for the fsync that covers them,
and a failed fsync answers INTERNAL_ERROR and loses nothing acknowledged.

Real files and a real thread; the tests hold the thread's fsync at a gate
(or make it fail with EIO, which no real disk here does on demand) to see
what waits for it.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import trio
import trio.testing

from smallstalk.core import protocol as p
from smallstalk.server.commit import LAZY_SYNC, RETRY_AFTER_FAILURE
from smallstalk.server.loop import MutationLoop
from smallstalk.storage.journal import INLINE_SYNC_RECORDS, Journal
from smallstalk.storage.recovery import recover
from smallstalk.storage.syncer import Syncer

from ..support.harness import Client, mock_wall_clock

MANY = INLINE_SYNC_RECORDS + 4  # puts in one turn: more than an inline fsync takes


class Gate:
    """An fsync the test lets through (or fails) when it wants."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        self.fail = False

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.entered.set()
        self.open.wait(timeout=30)
        if self.fail:
            raise OSError(errno.EIO, "injected fsync failure")
        os.fsync(fd)


def start(tmp_path: Path, gate=os.fsync) -> MutationLoop:
    state = recover(tmp_path).state
    journal = Journal(tmp_path, state.last_seq + 1, fsync="always")
    journal.syncer = Syncer(fsync=gate)
    return MutationLoop(state, journal, tmp_path, clock=mock_wall_clock)


def puts(n: int, tag: bytes) -> bytes:
    return b"".join(p.render(p.Put(0, 0, 60, b"%s%02d" % (tag, i))) for i in range(n))


def inserted(first: int, n: int) -> bytes:
    return b"".join(b"INSERTED %d\r\n" % i for i in range(first, first + n))


async def test_big_turns_fsync_in_the_thread_and_land_on_disk(tmp_path, nursery, autojump_clock):
    lp = start(tmp_path)
    nursery.start_soon(lp.run)
    a, b = Client(lp), Client(lp)
    a.send(puts(MANY, b"a"))
    b.send(puts(MANY, b"b"))
    # Each session runs in slices of SLICE_COMMANDS per turn: their ids interleave.
    got_a = [int(line.split()[1]) for line in (await a.recv()).splitlines()]
    got_b = [int(line.split()[1]) for line in (await b.recv()).splitlines()]
    assert len(got_a) == len(got_b) == MANY
    assert got_a == sorted(got_a) and got_b == sorted(got_b)
    assert sorted(got_a + got_b) == list(range(1, 2 * MANY + 1))
    assert lp.journal.committed_seq == lp.journal.written_seq == lp.state.last_seq
    assert len(recover(tmp_path, repair=False).state.jobs) == 2 * MANY
    # A small turn afterwards fsyncs inline and is answered at once.
    assert await a.ask(b"put 0 0 60 1\r\nx\r\n") == b"INSERTED %d\r\n" % (2 * MANY + 1)


async def test_replies_wait_for_the_fsync_that_covers_what_they_saw(tmp_path, nursery,
                                                                    autojump_clock):
    gate = Gate()
    lp = start(tmp_path, gate)
    nursery.start_soon(lp.run)
    producer, reader = Client(lp), Client(lp)
    producer.send(puts(MANY, b"p"))
    assert await trio.to_thread.run_sync(gate.entered.wait, 10)
    assert gate.calls == 1  # the thread holds the fsync; the loop is free
    # A later turn that changes nothing still saw the unsynced jobs: it waits too.
    reader.send(b"peek-ready\r\n")
    await trio.testing.wait_all_tasks_blocked()
    assert producer.unread() == 0
    assert reader.unread() == 0
    gate.open.set()
    assert await producer.recv() == inserted(1, MANY)
    assert await reader.recv() == b"FOUND 1 3\r\np00\r\n"
    assert len(recover(tmp_path, repair=False).state.jobs) == MANY


async def test_failed_fsync_answers_internal_error_and_keeps_what_was_acknowledged(
        tmp_path, nursery, autojump_clock):
    gate = Gate()
    gate.open.set()
    lp = start(tmp_path, gate)
    nursery.start_soon(lp.run)
    a, b = Client(lp), Client(lp)
    a.send(puts(MANY, b"a"))
    assert await a.recv() == inserted(1, MANY)  # durable: fsync went through
    gate.open.clear()
    gate.fail = True
    gate.entered.clear()
    a.send(puts(MANY, b"x"))
    assert await trio.to_thread.run_sync(gate.entered.wait, 10)
    b.send(b"stats-job 1\r\n")  # held behind the failing fsync
    await trio.testing.wait_all_tasks_blocked()
    gate.open.set()
    assert await a.recv() == b"INTERNAL_ERROR\r\n" * MANY
    assert await b.recv() == b"INTERNAL_ERROR\r\n"
    # The file was cut back to what was acknowledged, and so was the state.
    assert sorted(recover(tmp_path, repair=False).state.jobs) == list(range(1, MANY + 1))
    assert sorted(lp.state.jobs) == list(range(1, MANY + 1))
    gate.fail = False
    await trio.sleep(RETRY_AFTER_FAILURE + 0.1)
    reply = await a.ask(b"put 0 0 60 1\r\ny\r\n")
    assert reply.startswith(b"INSERTED ")
    jid = int(reply.split()[1])
    assert jid > MANY
    assert jid in recover(tmp_path, repair=False).state.jobs


async def test_a_reserve_answers_before_its_record_is_fsynced(tmp_path, nursery, autojump_clock):
    """A Reserve lost in a crash changes nothing a client was told (the restart
    releases every reservation, as beanstalkd, which never logs reserves): its
    reply does not wait for an fsync, and a lazy fsync follows within LAZY_SYNC."""
    lp = start(tmp_path)
    nursery.start_soon(lp.run)
    c = Client(lp)
    assert await c.ask(b"put 0 0 60 1\r\nx\r\n") == b"INSERTED 1\r\n"
    j = lp.journal
    assert j.committed_seq == j.written_seq  # the put waited for its fsync
    assert await c.ask(b"reserve-with-timeout 0\r\n") == b"RESERVED 1 1\r\nx\r\n"
    assert j.written_seq == j.committed_seq + 1  # answered with the Reserve unsynced
    await trio.sleep(LAZY_SYNC * 2)
    assert j.committed_seq == j.written_seq
    # The delete waits for its own fsync, which covers everything before it.
    assert await c.ask(b"delete 1\r\n") == b"DELETED\r\n"
    assert j.committed_seq == j.written_seq
    assert recover(tmp_path, repair=False).state.jobs == {}


async def test_a_reserve_of_an_unsynced_put_waits_for_it(tmp_path, nursery, autojump_clock):
    gate = Gate()
    lp = start(tmp_path, gate)
    nursery.start_soon(lp.run)
    producer, worker = Client(lp), Client(lp)
    producer.send(puts(MANY, b"p"))
    assert await trio.to_thread.run_sync(gate.entered.wait, 10)
    worker.send(b"reserve-with-timeout 0\r\n")
    await trio.testing.wait_all_tasks_blocked()
    # The job it would get is not on disk yet: no RESERVED before the fsync.
    assert worker.unread() == 0
    gate.open.set()
    assert await producer.recv() == inserted(1, MANY)
    assert await worker.recv() == b"RESERVED 1 3\r\np00\r\n"


def nothing_answered(c: Client) -> bool:
    return c.unread() == 0


async def test_a_reserve_of_a_durable_job_does_not_wait_for_other_records(tmp_path, nursery,
                                                                          autojump_clock):
    """What a RESERVED reply reveals is the job: once its put is durable the
    reply goes, however many other connections' records wait for an fsync."""
    gate = Gate()
    lp = start(tmp_path, gate)
    nursery.start_soon(lp.run)
    producer, worker = Client(lp), Client(lp)
    assert await worker.ask(b"put 0 0 60 1\r\nx\r\n") == b"INSERTED 1\r\n"  # inline fsync
    producer.send(puts(MANY, b"p"))
    assert await trio.to_thread.run_sync(gate.entered.wait, 10)
    assert await worker.ask(b"reserve-with-timeout 0\r\n") == b"RESERVED 1 1\r\nx\r\n"
    assert nothing_answered(producer)  # its puts still wait for the held fsync
    gate.open.set()
    assert await producer.recv() == inserted(2, MANY)


async def test_a_reserve_of_a_kicked_job_waits_for_the_kick(tmp_path, nursery, autojump_clock):
    """A kick lost in a crash buries the job again: a worker is not handed a
    kicked job before the kick is on disk."""
    gate = Gate()
    lp = start(tmp_path, gate)
    nursery.start_soon(lp.run)
    producer, worker = Client(lp), Client(lp)
    assert await worker.ask(b"put 0 0 60 1\r\nx\r\n") == b"INSERTED 1\r\n"
    assert await worker.ask(b"reserve-with-timeout 0\r\n") == b"RESERVED 1 1\r\nx\r\n"
    assert await worker.ask(b"bury 1 0\r\n") == b"BURIED\r\n"
    # Lower-priority puts fill the turn so its fsync goes to the (held) thread.
    producer.send(b"".join(b"put 5 0 60 3\r\np%02d\r\n" % i for i in range(MANY))
                  + b"kick 1\r\n")
    assert await trio.to_thread.run_sync(gate.entered.wait, 10)
    worker.send(b"reserve-with-timeout 0\r\n")
    await trio.testing.wait_all_tasks_blocked()
    assert nothing_answered(worker)
    gate.open.set()
    assert await producer.recv() == inserted(2, MANY) + b"KICKED 1\r\n"
    assert await worker.recv() == b"RESERVED 1 1\r\nx\r\n"


async def test_replies_to_one_connection_keep_their_order(tmp_path, nursery, autojump_clock):
    """A reserve that needs no wait does not overtake the same connection's
    earlier reply that still waits for the disk."""
    gate = Gate()
    lp = start(tmp_path, gate)
    nursery.start_soon(lp.run)
    a = Client(lp)
    assert await a.ask(b"put 0 0 60 1\r\nx\r\n") == b"INSERTED 1\r\n"
    a.send(puts(MANY, b"p"))
    assert await trio.to_thread.run_sync(gate.entered.wait, 10)
    a.send(b"reserve-with-timeout 0\r\n")  # would get job 1, whose put is durable
    await trio.testing.wait_all_tasks_blocked()
    assert nothing_answered(a)
    gate.open.set()
    assert await a.recv() == inserted(2, MANY)
    assert await a.recv() == b"RESERVED 1 1\r\nx\r\n"


async def test_a_reserve_answers_before_the_inline_fsync_of_its_turn(tmp_path, nursery,
                                                                     autojump_clock):
    """A turn with a put (which needs an fsync) and a reserve of a durable job:
    the RESERVED goes out before the fsync holds the loop's thread."""
    lp = start(tmp_path)
    nursery.start_soon(lp.run)
    producer, worker = Client(lp), Client(lp)
    assert await worker.ask(b"put 0 0 60 1\r\nx\r\n") == b"INSERTED 1\r\n"
    j = lp.journal
    seen: list[tuple[bytes, int, int]] = []  # (reply, committed, written) when delivered
    for c in (producer, worker):
        deliver = c.session.deliver

        def spy(blob, done, close, deliver=deliver):
            seen.append((blob, j.committed_seq, j.written_seq))
            deliver(blob, done, close)

        c.session.deliver = spy
    producer.send(b"put 5 0 60 1\r\ny\r\n")  # both reach the loop in one turn
    worker.send(b"reserve-with-timeout 0\r\n")
    assert await worker.recv() == b"RESERVED 1 1\r\nx\r\n"
    assert await producer.recv() == b"INSERTED 2\r\n"
    (first, committed, written), (second, committed2, _) = seen
    assert first.startswith(b"RESERVED") and committed < written  # before the fsync
    assert second == b"INSERTED 2\r\n" and committed2 == written
