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

from smallstalk.journal import INLINE_SYNC_RECORDS, Journal
from smallstalk.loop import RETRY_AFTER_FAILURE, MutationLoop
from smallstalk.recovery import recover
from smallstalk.syncer import Syncer

from .harness import Client, mock_wall_clock

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
    return b"".join(b"put 0 0 60 3\r\n%s%02d\r\n" % (tag, i) for i in range(n))


def inserted(first: int, n: int) -> bytes:
    return b"".join(b"INSERTED %d\r\n" % i for i in range(first, first + n))


async def test_big_turns_fsync_in_the_thread_and_land_on_disk(tmp_path, nursery, autojump_clock):
    lp = start(tmp_path)
    nursery.start_soon(lp.run)
    a, b = Client(lp), Client(lp)
    a.send(puts(MANY, b"a"))
    b.send(puts(MANY, b"b"))
    assert await a.recv() == inserted(1, MANY)
    assert await b.recv() == inserted(MANY + 1, MANY)
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
    assert producer.outbox.statistics().current_buffer_used == 0
    assert reader.outbox.statistics().current_buffer_used == 0
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
