"""One client connection as the mutation loop sees it (see docs/ARCHITECTURE.md)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class Session:
    """One client connection as the loop sees it."""

    __slots__ = (
        "id", "pending", "out", "out_mut", "blocked", "halfclosed", "closing", "producer",
        "worker", "deliver", "wait_deadline", "feed", "view_use", "inflight", "pending_bytes",
        "need", "peer", "transport", "admin", "parked",
    )

    def __init__(self, sid: int, deliver: Callable, peer: str | None = None,
                 transport: str = "local"):
        self.id = sid
        self.pending: deque = deque()
        self.out: list[bytes] = []
        self.out_mut: list[bool] = []  # did the command behind each reply log a record?
        self.blocked = False
        self.halfclosed = False
        self.closing = False
        self.producer = False
        self.worker = False
        # deliver(blob, done, close): hands replies to the connection (sync, never
        # blocks); `done` says nothing of what was submitted is left unanswered.
        self.deliver = deliver
        # Backpressure: bytes of commands submitted and not yet run, of which
        # `pending_bytes` are in `pending` (counted until it empties: a waiting
        # reserve holds up everything behind it).
        self.inflight = 0
        self.pending_bytes = 0
        self.wait_deadline = None
        self.feed = None  # a replication feed: the connection streams records instead
        self.view_use: str | None = None  # `use` on a replica: this connection's view only
        # Under --fsync always: the seq that must be durable before its replies
        # so far may go. Never goes down, so its replies leave in order.
        self.need = 0
        # Who is at the other end: the peer's address (None on a unix socket or
        # in-process), "tcp", "unix" or "local"; may it run admin commands
        # (server/admin.py); `parked`: blocked until a timer answers (a failed auth).
        self.peer = peer
        self.transport = transport
        self.admin = False
        self.parked = False


def deliver(delivery: tuple) -> None:
    """Hand one turn's replies of a session to its connection."""
    s, out, _mut, done, closing = delivery
    s.deliver(b"".join(out), done, closing)
