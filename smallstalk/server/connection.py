"""Listeners and connection tasks: sockets in, parsed batches to the loop, replies out.

A connection is a parser fed by the poller, a task of its own, and the
loop's `deliver` callback:

- the poller (poller.py: one task, one epoll set for every socket) calls the
  connection's `on_readable` when bytes arrive: it reads once, feeds the
  sans-I/O parser and hands every complete command of that read to the
  mutation loop in one hop; the connection is read on without waiting for
  replies, since commands of one connection run in order in the loop
  whatever their batches. The connection's own task steps in only when the
  poller stops reading it (throttled, or at the end of its input); where
  there is no epoll, that task reads for itself;
- at the end of each turn the loop calls `deliver(replies)`, which writes them
  straight to the socket without blocking. Only what the socket does not take
  at once is queued, and a flusher task (asleep otherwise) sends it.

So a command costs a read, a parse and a share of one poller wake-up and one
loop turn: no task switch of its own (docs/ARCHITECTURE.md, "The life of a
command", says what a reader task per connection cost).

Backpressure: reading stops while more than MAX_QUEUED_BYTES of
its commands wait in the loop (a reserve that waits holds up the commands
behind it) or of replies wait for the socket (a client that never reads).
Memory per connection is bounded by that, plus one partial line or body in
the parser.

A client that hangs up or half-closes is noticed at once, also while a reserve
waits (beanstalkd answers TIMED_OUT then); the connection closes when every
command before the end of input is answered. A replication feed (`replicate`)
hands the connection a Feed: the flusher streams it while its reading (the
poller's) passes the replica's acks on.
"""

from __future__ import annotations

import errno
import logging
import os
import socket as stdsocket

import trio

from smallstalk.core.protocol import Parser
from smallstalk.server import poller as poller_mod
from smallstalk.server import tls
from smallstalk.server.loop import MutationLoop
from smallstalk.server.poller import Poller

log = logging.getLogger("smallstalk.server.connection")

RECV_SIZE = 65536
MAX_QUEUED_BYTES = 1 << 20


class _Connection:
    def __init__(self, lp: MutationLoop, stream: trio.abc.Stream, max_job_size: int,
                 poller: Poller | None):
        self.lp = lp
        self.stream = stream
        sock = getattr(stream, "socket", None)
        self.fd = sock.fileno() if sock is not None else -1
        # None: this connection's task reads for itself (no epoll, or no fd).
        self.poller = poller if self.fd >= 0 else None
        self.parser = Parser(max_job_size)
        # Input bytes that became commands, for backpressure: all bytes read
        # minus what the parser still holds, counted once per submitted batch.
        self.read_bytes = 0
        self.submitted_bytes = 0
        self.unsent = bytearray()  # replies the socket has not taken yet
        self.done = True  # nothing submitted is left unanswered
        self.closing = False  # quit: close once the replies are out
        self.broken = False
        self.closed = False  # the socket is closed: its fd number may belong to another
        self.eof = False
        self.feed = None
        self.throttled = False  # the reader waits for the backlog to shrink
        self.sending = False  # the flusher is in send_all: later replies queue behind it
        # One event per task, each replaced only by its own waiter: a shared one
        # could be replaced under the other task, which then slept forever.
        self.changed = trio.Event()  # something the flusher cares about
        self.room = trio.Event()  # the backlog shrank (a throttled reader)
        self.stopped = trio.Event()  # the poller stopped reading this connection
        self.session = lp.open_session(self.deliver, *peer_of(stream))

    # --- called by the loop (synchronously, at the end of a turn) -----------------

    def deliver(self, blob, done: bool, close: bool) -> None:
        if self.closed:
            return  # replies held for an fsync or a replica outlived the connection
        if not isinstance(blob, bytes):
            self.feed = blob
            self.changed.set()
            return
        self.done = done
        if blob and not self.broken:
            if self.unsent or self.sending or self.fd < 0:
                self.unsent += blob  # never in the middle of what the flusher sends
            else:
                self._write_now(blob)
        if close:
            self.closing = True
        # Wake the flusher or a throttled reader only when they have work:
        # a wake-up per reply would cost as much as the reply itself.
        if self.unsent or close or (done and self.eof):
            self.changed.set()
        if self.throttled:
            self.room.set()

    def _write_now(self, blob: bytes) -> None:
        try:
            n = os.write(self.fd, blob)
        except BlockingIOError:
            n = 0
        except OSError:
            self.broken = True  # the reader sees the hang-up and ends the connection
            return
        if n < len(blob):
            self.unsent += blob[n:]

    # --- the tasks -------------------------------------------------------------------

    async def _wait_changed(self) -> None:
        await self.changed.wait()
        self.changed = trio.Event()

    async def _wait_room(self) -> None:
        await self.room.wait()
        self.room = trio.Event()

    # --- reading ---------------------------------------------------------------------

    def on_readable(self) -> None:
        """Bytes arrived (the poller calls this): read once, hand on the commands."""
        try:
            data = os.read(self.fd, RECV_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self._received(data)
        if self.eof or self._over_limit():
            self.poller.remove(self.fd)  # the connection's task takes over (`_polled`)
            self.stopped.set()

    def _over_limit(self) -> bool:
        return (self.session.inflight + len(self.unsent) > MAX_QUEUED_BYTES
                and not self.broken)

    def _received(self, data: bytes) -> None:
        if not data:
            self.eof = True
            self.lp.end_of_input(self.session)
            self.changed.set()
            return
        parser = self.parser
        parser.feed(data)
        self.read_bytes += len(data)
        events = parser.events()
        if events:
            self.done = False
            used = self.read_bytes - parser.buffered()
            self.lp.submit(self.session, events, used - self.submitted_bytes)
            self.submitted_bytes = used

    async def _wait_stopped(self) -> None:
        await self.stopped.wait()
        self.stopped = trio.Event()

    async def _throttle(self) -> None:
        """Wait while too much of this connection's input or output is queued."""
        while self._over_limit():
            self.throttled = True
            await self._wait_room()
        self.throttled = False

    async def reader(self) -> None:
        if self.poller is not None:
            await self._polled()
            return
        while True:
            await self._throttle()
            try:
                data = await self.stream.receive_some(RECV_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            self._received(data)
            if self.eof:
                return

    async def _polled(self) -> None:
        """The poller reads; this task puts the connection back in its set
        once a throttled backlog has shrunk, and ends at the end of input."""
        try:
            while not self.eof:
                await self._throttle()
                self.poller.add(self.fd, self)
                await self._wait_stopped()
        finally:
            self.poller.remove(self.fd)  # before the socket closes: its fd may be reused

    async def flusher(self, cancel: trio.CancelScope) -> None:
        while True:
            if self.feed is not None:
                # A replication feed (replication/feed.py) streams itself.
                await self.feed.run(self.stream, lambda: self.lp.journal.committed_seq)
                break
            if self.unsent:
                data = bytes(self.unsent)
                self.unsent.clear()
                self.sending = True
                try:
                    await self.stream.send_all(data)
                finally:
                    self.sending = False
                if self.throttled:
                    self.room.set()
                continue
            if self.closing or self.broken or (self.eof and self.done):
                break
            await self._wait_changed()
        cancel.cancel()


def peer_of(stream: trio.abc.Stream) -> tuple[str | None, str]:
    """(peer address, transport) of a connection, for the admin check (server/admin.py)."""
    sock = getattr(stream, "socket", None)
    if sock is None:  # a stream wrapping another (TLS)
        inner = getattr(stream, "transport_stream", None)
        sock = getattr(inner, "socket", None)
    if sock is None:  # not a socket we know: trusted with nothing
        return None, "unknown"
    if sock.family == stdsocket.AF_UNIX:
        return None, "unix"
    try:
        return sock.getpeername()[0], "tcp"
    except OSError:  # already gone: trusted with nothing
        return "?", "tcp"


async def serve_connection(lp: MutationLoop, stream: trio.abc.Stream, max_job_size: int,
                           poller: Poller | None = None) -> None:
    conn = _Connection(lp, stream, max_job_size, poller)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.reader)
            nursery.start_soon(conn.flusher, nursery.cancel_scope)
    except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the peer went away; closing below releases what it held
    finally:
        conn.closed = True
        lp.close_session(conn.session)
        with trio.CancelScope(shield=True):
            try:
                await stream.aclose()
            except (trio.BrokenResourceError, OSError):
                pass


async def open_listeners(addr: str, port: int) -> list[trio.SocketListener]:
    """TCP on addr:port, or a Unix socket for `unix:PATH` (beanstalkd's -l syntax)."""
    if addr.startswith("unix:"):
        path = addr[len("unix:"):]
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        await sock.bind(path)
        sock.listen(1024)
        return [trio.SocketListener(sock)]
    return await trio.open_tcp_listeners(port, host=addr or None, backlog=1024)


async def serve_listeners(lp: MutationLoop, listeners, max_job_size: int,
                          handshake_timeout: float = tls.HANDSHAKE_TIMEOUT) -> None:
    """Serve every listener; a TLS listener's clients shake hands first (tls.py)."""
    poller = Poller() if poller_mod.available() else None

    async def handler(stream) -> None:
        if isinstance(stream, trio.SSLStream):
            if not await tls.handshake(stream, handshake_timeout):
                return
        transport = getattr(stream, "transport_stream", stream)
        if isinstance(transport, trio.SocketStream):
            try:
                transport.setsockopt(stdsocket.IPPROTO_TCP, stdsocket.TCP_NODELAY, True)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOPROTOOPT, errno.EINVAL):
                    raise
        await serve_connection(lp, stream, max_job_size, poller)

    async with trio.open_nursery() as nursery:
        if poller is not None:
            nursery.start_soon(poller.run)
        await trio.serve_listeners(handler, listeners)
