"""An in-process broker for tests: the real mutation loop, clients without sockets
(server/local.py's `LocalSession`).

Time comes from trio's clock, so tests run under pytest-trio's `autojump_clock`
(MockClock with autojump_threshold=0) and a 60-second TTR takes no real time.
"""

from __future__ import annotations

from pathlib import Path

import trio

from smallstalk.core import protocol as p
from smallstalk.core.state import State
from smallstalk.server.local import LocalSession
from smallstalk.server.loop import MutationLoop
from smallstalk.storage.journal import FSYNC_NEVER, Journal

EPOCH = 1_700_000_000 * 10**9  # wall-clock origin of the tests' clock (ns)


def mock_wall_clock() -> int:
    return EPOCH + int(trio.current_time() * 1e9)


class Client(LocalSession):
    """One connection as the tests use it: raw protocol bytes in (`send`, `ask`), the
    reply bytes out (`recv`), on the server's own in-process session."""

    async def recv(self) -> bytes:
        """Replies until the submitted batch is fully answered."""
        return await self.replies()


class Broker:
    def __init__(self, lp: MutationLoop):
        self.lp = lp

    def client(self) -> Client:
        return Client(self.lp)


def make_loop(data_dir: Path | None = None, **journal_kw) -> MutationLoop:
    journal = None
    state = State()
    if data_dir is not None:
        from smallstalk.storage.recovery import recover

        state = recover(data_dir).state
        journal = Journal(data_dir, state.last_seq + 1, fsync=journal_kw.pop("fsync", FSYNC_NEVER),
                          **journal_kw)
    return MutationLoop(state, journal, data_dir, clock=mock_wall_clock)


async def serve_on_loopback(nursery: trio.Nursery, max_job_size: int = p.DEFAULT_MAX_JOB_SIZE
                            ) -> tuple[MutationLoop, int]:
    """An in-memory loop and the real server in front of it on 127.0.0.1: (loop, port)."""
    from smallstalk.server.connection import open_listeners, serve_listeners

    lp = make_loop()
    nursery.start_soon(lp.run)
    listeners = await open_listeners("127.0.0.1", 0)
    nursery.start_soon(serve_listeners, lp, listeners, max_job_size)
    return lp, listeners[0].socket.getsockname()[1]
