"""One client connection as the mutation loop sees it (see docs/ARCHITECTURE.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

# Output backpressure: the loop runs none of a session's commands while more
# than this many bytes of its replies are unsent (made, and not yet taken by
# the socket). So a session holds at most this plus one reply, which may be a
# body as big as -z allows: it is queued alone, and nothing more of that
# session runs until it has drained.
OUT_BOUND = 256 << 10
# ...and while more than this many bytes are unsent over all sessions
# together, a session runs a command only when none of its replies is
# unsent (loop.py's `_run`): what clients that stop reading can make the
# server hold is this plus one reply each, however many they are.
UNSENT_BUDGET = 64 << 20
# Fairness: what one session may do in one loop turn before the others get
# theirs (the rest of its commands run in the next turns). While a session
# has commands left, the turn's fsync goes to the fsync thread however few
# records it has (commit._sync_written), so a flood does not hold the loop.
SLICE_COMMANDS = 64
SLICE_BYTES = 16 << 10  # of replies: a `stats` costs as much as ~20 puts
# ...and what all sessions together may do in one turn: once whole slices
# would add up to more, each session with commands gets an equal share (one
# command at least), so a turn with hundreds of flooding clients does not
# keep a new client's first command waiting for all their slices.
TURN_COMMANDS = 4096
TURN_BYTES = 256 << 10
SHARED_FROM = TURN_BYTES // SLICE_BYTES  # busy sessions a turn takes whole slices for


def turn_share(busy: int) -> tuple[int, int]:
    """The commands and reply bytes each session may run in a turn where
    `busy` sessions have commands: a whole slice, or with many an equal share
    of TURN_COMMANDS and TURN_BYTES (so the turn, and with it everyone's
    next read, a new client's first, stays short however many flood)."""
    if busy <= SHARED_FROM:
        return SLICE_COMMANDS, SLICE_BYTES
    if busy * SLICE_COMMANDS <= TURN_COMMANDS:
        return SLICE_COMMANDS, TURN_BYTES // busy
    return TURN_COMMANDS // busy or 1, TURN_BYTES // busy


class Session:
    """One client connection as the loop sees it."""

    __slots__ = (
        "id", "pending", "out", "out_mut", "blocked", "halfclosed", "closing", "producer",
        "worker", "deliver", "wait_deadline", "feed", "view_use", "inflight", "pending_bytes",
        "need", "owed", "held", "resume", "peer", "transport", "admin", "deferred", "dialect",
        "batch", "put_id",
    )

    def __init__(self, sid: int, deliver: Callable, resume: Callable,
                 peer: str | None = None, transport: str = "local", dialect=None):
        self.id = sid
        # Commands not run yet: a deque once any arrive (an empty deque costs
        # ~600 bytes, times every idle connection).
        self.pending = ()
        self.out: list[bytes] = []
        self.out_mut: list[bool] = []  # did the command behind each reply log a record?
        self.blocked = False
        self.halfclosed = False
        self.closing = False
        self.producer = False
        self.put_id = 0  # the job id a put's line took while its body comes (PutHeard)
        self.worker = False
        # deliver(blob, done, close): hands replies to the connection (sync, never
        # blocks); `done` says nothing of what was submitted is left unanswered.
        self.deliver = deliver
        # Backpressure: bytes of commands submitted and not yet run, of which
        # `pending_bytes` are in `pending` (counted until it empties: a waiting
        # reserve holds up everything behind it).
        self.inflight = 0
        self.pending_bytes = 0
        # Bytes of replies made and not yet taken by the socket: the loop adds
        # each reply, `deliver` takes off what the connection wrote at once, a
        # connection adds back what it had to queue and takes it off once sent
        # (`sent`). Past OUT_BOUND the loop holds the session's commands
        # (`held`) until `sent` brings it back under and calls `resume(s)`.
        self.owed = 0
        self.held = False
        self.resume = resume
        self.wait_deadline = None
        self.feed = None  # a replication feed: the connection streams records instead
        self.view_use: str | None = None  # `use` on a replica: this connection's view only
        # Under --fsync always: the seq that must be durable before its replies
        # so far may go. Never goes down, so its replies leave in order.
        self.need = 0
        # Who is at the other end: the peer's address (None on a unix socket or
        # in-process), "tcp", "unix" or "local"; may it run admin commands
        # (server/admin.py); `deferred`: blocked until a timer answers (a failed auth).
        self.peer = peer
        self.transport = transport
        self.admin = False
        self.deferred = False
        # Another protocol's session (server/memcache_dispatch.py's McSession),
        # None for beanstalkd's: a wait it started ends in its own words
        # (`granted`, `wait_ended`; see MutationLoop.grant_waiters, answer_wait).
        self.dialect = dialect
        self.batch = 0  # a waiting reserve-batch's count (0: a plain reserve waits)


def sent(s: Session, n: int) -> None:
    """`n` bytes of `s`'s replies left for the client: held commands may run again."""
    s.owed -= n
    if s.held and s.owed <= OUT_BOUND:
        s.held = False
        s.resume(s)


class Delivery(NamedTuple):
    """One turn's replies of one session, on their way to its connection.

    `mut[i]` says whether the command behind `out[i]` logged a record (such a
    reply may wait for replicas); `done`: nothing the session submitted is
    left unanswered; `closing`: close the connection after these bytes.
    """

    session: Session
    out: list[bytes]
    mut: list[bool]
    done: bool
    closing: bool

    def answered_instead(self, replies: list[bytes]) -> Delivery:
        """The same delivery with `replies` in place of `out` (an error or
        NOT_REPLICATED answers the commands instead); the session's count of
        reply bytes owed follows."""
        recount(self.session, self.out, replies)
        return self._replace(out=replies)


def deliver(d: Delivery) -> None:
    """Hand one turn's replies of a session to its connection."""
    deliver_replies(d.session, d.out, d.done, d.closing)


def deliver_replies(s: Session, out: list[bytes], done: bool, closing: bool) -> None:
    """`deliver` without the Delivery: what a turn whose replies wait for
    nothing (no fsync, no replica) sends each session."""
    blob = b"".join(out)
    # Taken off before the connection sees it (which adds back what the socket
    # did not take): its check for room to read again must see the true count,
    # or a paused connection whose last reply was big stayed paused for good.
    s.owed -= len(blob)  # sent(s, len(blob)), inlined
    if s.held and s.owed <= OUT_BOUND:
        s.held = False
        s.resume(s)
    s.deliver(blob, done, closing)


def recount(s: Session, before: list[bytes], after: list[bytes]) -> None:
    """Replies were replaced (an error answers them instead): what `s` owes changes."""
    s.owed += sum(map(len, after)) - sum(map(len, before))
