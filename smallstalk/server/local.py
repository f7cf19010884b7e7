"""`LocalSession`: a connection to the mutation loop from inside the process.

What a connection task does over a socket, without one: submit parsed commands
to the loop and await their replies. The console's writes run on one (as a
client's commands would, checked and logged the same way), and so do the
in-process tests (tests/support/harness.py). It uses only the loop's public
side: `open_session`, `submit`, `end_of_input` and `close_session`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import trio

from smallstalk.core import protocol as p
from smallstalk.server.loop import MutationLoop
from smallstalk.server.session import Session


class LocalSession:
    """One in-process connection: `submit` commands, then `replies()` once per batch.

    The loop hands replies over as it makes them (one blob per turn); they
    wait here, unbounded, until read, so the loop never blocks on this side.
    """

    def __init__(self, lp: MutationLoop, peer: str | None = None, transport: str = "local"):
        self.lp = lp
        self._send, self._recv = trio.open_memory_channel(math.inf)
        self.session: Session = lp.open_session(self._deliver, peer, transport)
        self._parser: p.Parser | None = None  # made on the first `send` of bytes
        self.closed = False  # the loop closed this session (after `quit`, say)

    def _deliver(self, blob: bytes, done: bool, close: bool) -> None:
        if blob or done or close:  # a turn that answered nothing of ours yet hands b""
            self._send.send_nowait((blob, done, close))

    @property
    def id(self) -> int:
        """The connection id the loop gave this session (it shows in records)."""
        return self.session.id

    def submit(self, commands: Sequence[p.Event]) -> None:
        """Hand the loop a batch of commands (the parser's events, or command objects)."""
        if commands:
            self.lp.submit(self.session, list(commands))

    def send(self, data: bytes) -> None:
        """Protocol bytes, as a client writes them: parsed here, then submitted;
        a command cut short waits for the rest in the next `send`."""
        if self._parser is None:
            self._parser = p.Parser(self.lp.max_job_size)
        self._parser.feed(data)
        self.submit(self._parser.events())

    async def replies(self) -> bytes:
        """The reply bytes up to the end of what was submitted (or until the loop
        closes the session)."""
        out = []
        while True:
            blob, done, close = await self._recv.receive()
            out.append(blob)
            if close:
                self.closed = True
            if done or close:
                return b"".join(out)

    async def ask(self, commands: Sequence[p.Event] | bytes) -> bytes:
        """Submit (or send) and await the replies."""
        if isinstance(commands, bytes | bytearray):
            self.send(bytes(commands))
        else:
            self.submit(commands)
        return await self.replies()

    def unread(self) -> int:
        """How many reply blobs the loop handed over that `replies` has not read."""
        return self._recv.statistics().current_buffer_used

    def end_of_input(self) -> None:
        """Nothing more will be sent (a half-close): a reserve still waiting is
        answered TIMED_OUT, as beanstalkd does; `close` once the replies are read."""
        self.lp.end_of_input(self.session)

    def close(self) -> None:
        """Hang up: what this session had reserved goes back to ready."""
        self.lp.close_session(self.session)
