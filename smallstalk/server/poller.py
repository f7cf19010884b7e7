"""One task reads every client socket: an epoll set each socket joins once.

trio's `wait_readable` arms a one-shot registration for every wait, so a
reader task per connection costs an `epoll_ctl` and a task switch for every
request/response command, a large share of such a command's server CPU
(docs/PERFORMANCE.md, "Measured choices the code refers to"). The `Poller`
keeps an epoll set of its own (level-triggered, a socket registered once),
waits on it as a single fd in trio, and on each wake-up calls every readable
connection's `on_readable`, which reads once, parses, and hands the commands
to the mutation loop. When the pass ends it runs the loop's turn for everything it
read (`Batcher.end_batch_now`, and `end_batch_wait` where its commit must
wait): commands from many connections are answered in one turn, without a
task switch per connection nor one to the loop's task.

A connection leaves the set when it must not be read: throttled
(backpressure), at the end of its input, and before its socket closes (so a
reused fd number never reaches the old connection). Leaving rather than
masking the events matters: epoll reports a hang-up even for an empty mask,
and the poller would spin on it.

Linux only (`select.epoll`); elsewhere each connection's task reads for
itself (connection.py: `_Connection.reader`).
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Protocol

import trio


class Readable(Protocol):
    def on_readable(self) -> None: ...


class Batcher(Protocol):
    """The mutation loop, as the poller sees it (server/loop.py)."""

    def begin_batch(self) -> None: ...

    def end_batch_now(self) -> tuple | None: ...

    async def end_batch_wait(self, waiting: tuple) -> None: ...


def available() -> bool:
    return hasattr(select, "epoll")


class Poller:
    def __init__(self, batcher: Batcher) -> None:
        self._batcher = batcher
        self._ep = select.epoll()
        # Each socket's `on_readable`, bound once: the pass calls it without
        # looking the method up on every wake-up.
        self._conns: dict[int, Callable[[], None]] = {}

    def add(self, fd: int, conn: Readable) -> None:
        if fd not in self._conns:
            self._conns[fd] = conn.on_readable
            self._ep.register(fd, select.EPOLLIN)

    def remove(self, fd: int) -> None:
        if self._conns.pop(fd, None) is not None:
            try:
                self._ep.unregister(fd)
            except (OSError, ValueError):
                pass  # closed already: the kernel dropped it (or the poller ended)

    async def run(self) -> None:
        ep, conns, batcher = self._ep, self._conns, self._batcher
        # Looked up once, not on each wake-up: two attribute reads and a call.
        wait_readable, epfd = trio.lowlevel.wait_readable, ep.fileno()
        try:
            while True:
                await wait_readable(epfd)
                batcher.begin_batch()
                for fd, _events in ep.poll(0):
                    on_readable = conns.get(fd)
                    if on_readable is not None:
                        on_readable()
                waiting = batcher.end_batch_now()
                if waiting is not None:  # most passes: none, and no coroutine
                    await batcher.end_batch_wait(waiting)
        finally:
            ep.close()
