"""The memcache port: listeners whose connections speak kestrel's memcache dialect.

A memcache connection is connection.py's connection in every way (the poller
reads it, backpressure, --max-connections, hang-ups), with the dialect's
parser (core/memcache.py) and session side (memcache_dispatch.McSession):
the listener's `dialect()` makes both for each connection it accepts. Its
commands go to the one mutation loop like any other (docs/KESTREL.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import trio

from smallstalk.server.memcache_dispatch import McService, McSession


@attrs.frozen
class Listener:
    """A bound socket whose clients speak memcache; connection.py accepts on `socket`."""

    socket: trio.socket.SocketType
    service: McService

    def dialect(self) -> McSession:
        """An accepted client's side of its session."""
        return self.service.session()


def listeners(socks: Iterable[trio.socket.SocketType],
              shutdown: Callable[[], None] | None = None) -> list[Listener]:
    """Memcache listeners on bound sockets, sharing one service (its counters,
    and `shutdown`: what SHUTDOWN calls; None refuses it)."""
    service = McService(shutdown)
    return [Listener(s, service) for s in socks]
