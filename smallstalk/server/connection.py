"""Listeners and connections: sockets in, parsed batches to the loop, replies out.

A connection is a parser fed by the poller, one task of its own, and the
loop's `deliver` callback:

- the poller (poller.py: one task, one epoll set for every socket) calls the
  connection's `on_readable` when bytes arrive: it reads once, feeds the
  sans-I/O parser and hands every complete command of that read to the
  mutation loop in one hop; the connection is read on without waiting for
  replies, since commands of one connection run in order in the loop
  whatever their batches. The connection's task sleeps unless the socket is
  full (it sends what is queued), the poller stopped reading it (throttled:
  it puts it back once the backlog has shrunk), or the connection ends;
- at the end of each turn the loop calls `deliver(replies)`, which writes them
  straight to the socket without blocking. Only what the socket does not take
  at once is queued, and the connection's task sends it.

Where there is no epoll, or the stream has no fd of its own (TLS), a
connection has two tasks instead: one reads, one sends (`serve_connection`).

So a command costs a read, a parse and a share of one poller wake-up and one
loop turn: no task switch of its own (docs/PERFORMANCE.md, "Measured choices
the code refers to", says what a reader task per connection cost).

Backpressure: reading stops while more than INPUT_AHEAD of its commands
wait in the loop (each counted as its bytes plus COMMAND_COST), or more than
MAX_QUEUED_BYTES of them and its unsent replies together, and while the
parser holds commands beyond the TAKE_MAX one read makes (the task hands
them on as room comes). The loop itself runs none of a session's commands
while more than session.OUT_BOUND of its replies are unsent (session.py),
nor, past session.UNSENT_BUDGET over all connections, while any are: a
client that never reads holds at most that, one reply, and its unread
commands; the rest stays in the kernel's socket buffers. Such a client is
logged once (one line a second for all of them).

Limits: past `max_connections` a new connection is sent REFUSED and closed;
when accept fails for want of file descriptors the listener retries every
ACCEPT_RETRY seconds and says so at most once a second.

A client that hangs up or half-closes is noticed at once, also while a reserve
waits (beanstalkd answers TIMED_OUT then); the connection closes when every
command before the end of input is answered. A replication feed (`replicate`)
hands the connection a Feed: its task streams it while its reading (the
poller's) passes the replica's acks on.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket as stdsocket
from os import read as os_read
from os import write as os_write

import trio

from smallstalk.core.parser import TAKE_MAX, Parser
from smallstalk.server import poller as poller_mod
from smallstalk.server import tls
from smallstalk.server.loop import MutationLoop
from smallstalk.server.poller import Poller
from smallstalk.server.session import OUT_BOUND, sent

log = logging.getLogger("smallstalk.server.connection")
# os_read and os_write (imported above) are what every read and reply call:
# compiled, `os.write` is a lookup in the os module on each call, a global of
# this module's own is looked up once.

RECV_SIZE = 65536
MAX_QUEUED_BYTES = 1 << 20
# What a parsed command counts for in backpressure, beyond its bytes: its
# object, and its parse, done ahead of its turn; at 512 a connection has a
# few hundred small commands parsed ahead, and hundreds of pipelining
# clients' parses do not hold up a pass (and a new client's first command).
COMMAND_COST = 512
# Commands read ahead of the loop: a flood is not parsed faster than the loop
# runs it, so a poller wake-up parses at most one read of it (the others'
# requests wait behind that parse, not behind a megabyte of it).
INPUT_AHEAD = 128 << 10
# The line a connection past --max-connections gets before it is closed
# (docs/PROTOCOL-EXTENSIONS.md).
REFUSED = b"TOO_MANY_CONNECTIONS\r\n"
ACCEPT_RETRY = 0.05  # seconds between accepts while the process is out of fds
ACCEPT_BATCH = 64  # connections taken from the backlog after each wake-up, at most
NO_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
MAX_CONNECTIONS = 10_000
FDS_KEPT = 64  # for data files, when the default limit follows RLIMIT_NOFILE


class _Once:
    """When the "not reading its replies" line was last logged, and how many
    connections were left out since (one line a second for all of them)."""

    __slots__ = ("at", "left_out")

    def __init__(self) -> None:
        self.at = -1e9
        self.left_out = 0


_slow = _Once()


def default_max_connections() -> int:
    """10,000, or fewer if the fd limit would run out first."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(min(MAX_CONNECTIONS, soft - FDS_KEPT), 1)


class _Connection:
    __slots__ = (
        "lp", "sock", "stream", "fd", "poller", "parser", "read_bytes", "submitted_bytes",
        "unsent", "done", "closing", "broken", "closed", "eof", "feed", "paused", "sending",
        "waiter", "woken", "room", "slow_logged", "session",
    )

    def __init__(self, lp: MutationLoop, sock, stream: trio.abc.Stream | None,
                 max_job_size: int, poller: Poller | None, dialect=None):
        self.lp = lp
        self.sock = sock  # a trio socket (the polled path), or None
        self.stream = stream  # made on first use on the polled path (a full socket, a feed)
        self.fd = sock.fileno() if sock is not None else -1
        # None: this connection's tasks read for themselves (no epoll, or no fd).
        self.poller = poller if self.fd >= 0 else None
        # Another protocol's connection (a listener's `dialect()`, e.g. the
        # memcache port's) brings its own parser and session side.
        self.parser = Parser(max_job_size) if dialect is None else dialect.parser(max_job_size)
        # Input bytes that became commands, for backpressure: all bytes read
        # minus what the parser still holds, counted once per submitted batch.
        self.read_bytes = 0
        self.submitted_bytes = 0
        self.unsent: list = []  # replies the socket has not taken yet (counted in session.owed)
        self.done = True  # nothing submitted is left unanswered
        self.closing = False  # quit: close once the replies are out
        self.broken = False
        self.closed = False  # the socket is closed: its fd number may belong to another
        self.eof = False
        self.feed = None
        self.paused = False  # out of the poller's set, or the reader waits: backlog too big
        self.sending = False  # in send_all: later replies queue behind it
        # The sending task, asleep until `_wake` (something it cares about
        # changed): a trio.Event and its frames would cost every idle connection.
        self.waiter = None
        self.woken = False
        self.room = None  # the streamed path's reader waits on it for the backlog to shrink
        self.slow_logged = False
        self.session = lp.open_session(self.deliver, *peer_of(sock if sock is not None else stream),
                                       dialect=dialect)

    # --- called by the loop (synchronously, at the end of a turn) -----------------

    def deliver(self, blob, done: bool, close: bool) -> None:
        if self.closed:
            return  # replies held for an fsync or a replica outlived the connection
        if not isinstance(blob, bytes):
            self.feed = blob
            self._wake()
            return
        self.done = done
        if blob and not self.broken:
            if self.unsent or self.sending or self.fd < 0:
                self._queue(blob)  # never in the middle of what is being sent
            else:  # written here: every reply of the polled path passes this line
                try:
                    n = os_write(self.fd, blob)
                except BlockingIOError:
                    n = 0
                except OSError:
                    self.broken = True  # the reader sees the hang-up and ends the connection
                    n = len(blob)
                if n < len(blob):
                    self._queue(memoryview(blob)[n:])
        if close:
            self.closing = True
        # Wake the sender or a throttled reader only when they have work:
        # a wake-up per reply would cost as much as the reply itself.
        if self.unsent or close or (done and self.eof):
            self._wake()
        if self.paused:
            self._maybe_room()

    def _maybe_room(self) -> None:
        if not self._over_limit():
            if self.room is not None:
                self.room.set()
            else:
                self._wake()

    def _queue(self, data) -> None:
        self.unsent.append(data)
        s = self.session
        s.owed += len(data)
        self.lp.note_unsent(len(data))
        if s.owed > OUT_BOUND and not self.slow_logged:
            self._log_slow()

    def _drop_unsent(self) -> None:
        """The connection ended: what it never sent no longer counts."""
        self.lp.note_unsent(-sum(map(len, self.unsent)))
        self.unsent = []

    def _log_slow(self) -> None:
        self.slow_logged = True
        now = trio.current_time()
        if now - _slow.at < 1.0:  # many such clients at once make one line a second
            _slow.left_out += 1
            return
        more, _slow.at, _slow.left_out = _slow.left_out, now, 0
        try:
            peer = self.sock.getpeername() if self.sock is not None else "?"
        except OSError:
            peer = "?"
        log.warning("client %s (connection %d) is not reading its replies: %d bytes wait; "
                    "its further commands wait until it reads (logged once a connection%s)",
                    _addr(peer), self.session.id, self.session.owed,
                    f"; {more} more such connections since the last line" if more else "")

    # --- reading ---------------------------------------------------------------------

    def on_readable(self) -> None:
        """Bytes arrived (the poller calls this): read once, hand on the commands."""
        text: Parser  # (compiled: the text protocol's `take` a C call, not a lookup)
        try:
            data = os_read(self.fd, RECV_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:  # _received and _over_limit, inlined: a request/response command's path
            parser = self.parser
            if type(parser) is Parser:
                text = parser
                events, held = text.take(data)
                more = text.more
            else:  # another protocol's (server/memcache.py)
                events, held = parser.take(data)
                more = parser.more
            self.read_bytes += len(data)
            s = self.session
            if events:
                self.done = False
                used = self.read_bytes - held
                cost = COMMAND_COST  # (compiled, a C integer: the sum makes no int object)
                self.lp.submit(s, events, used - self.submitted_bytes + len(events) * cost)
                self.submitted_bytes = used
            if not (more or s.inflight > INPUT_AHEAD or s.inflight + s.owed > MAX_QUEUED_BYTES) \
                    or self.broken:
                return
        else:
            self._received(data)
        # Not read again while its commands wait, or while the parser holds
        # more than one read's worth of them (`_parse_held` goes on with those).
        if self.eof or self._over_limit() or self.parser.more:
            self.poller.remove(self.fd)  # the connection's task puts it back (`_polled`)
            self.paused = True
            if not self.eof and self.session.owed > OUT_BOUND and not self.slow_logged:
                self._log_slow()
            self._wake()

    def _over_limit(self) -> bool:
        s = self.session
        return (s.inflight > INPUT_AHEAD or s.inflight + s.owed > MAX_QUEUED_BYTES) \
            and not self.broken

    def _received(self, data: bytes | bytearray) -> None:
        if not data:
            self.eof = True
            self.lp.end_of_input(self.session)
            self._wake()
            return
        if type(data) is not bytes:  # a TLS stream's read may be a bytearray
            data = bytes(data)
        events, held = self.parser.take(data)
        self.read_bytes += len(data)
        if events:
            self._submit(events, held)

    def _parse_held(self) -> None:
        """The parser stopped at TAKE_MAX commands: hand on the next of them."""
        events = self.parser.events(TAKE_MAX)
        if events:
            self._submit(events, self.parser.buffered())

    def _submit(self, events: list, held: int) -> None:
        self.done = False
        used = self.read_bytes - held
        self.lp.submit(self.session, events,
                       used - self.submitted_bytes + len(events) * COMMAND_COST)
        self.submitted_bytes = used

    # --- the tasks -------------------------------------------------------------------

    def _wake(self) -> None:
        task = self.waiter
        if task is not None:
            self.waiter = None
            trio.lowlevel.reschedule(task)
        else:
            self.woken = True

    def _abort(self, _raise_cancel) -> trio.lowlevel.Abort:
        self.waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _flush(self) -> None:
        """Send what the socket did not take at once (the session owes it until then)."""
        if self.stream is None:
            self.stream = trio.SocketStream(self.sock)
        chunks, self.unsent = self.unsent, []
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.sending = True
        try:
            await self.stream.send_all(data)
        finally:
            self.sending = False
            self.lp.note_unsent(-len(data))  # sent, or dropped with the connection
        sent(self.session, len(data))
        if self.paused:
            self._maybe_room()

    async def serve_polled(self, gate: Gate | None = None) -> None:
        """The polled path's one task: send what queued, put the connection
        back in the poller's set once a throttled backlog has shrunk, end it
        (one frame while it sleeps: an idle connection's whole task)."""
        poller = self.poller
        try:
            poller.add(self.fd, self)
            while True:
                if self.feed is not None:
                    await self._run_feed()
                    return
                if self.unsent:
                    await self._flush()
                    continue
                if self.closing or self.broken or (self.eof and self.done):
                    return
                if self.paused and not self.eof and not self._over_limit():
                    if self.parser.more:
                        self._parse_held()
                        continue
                    self.paused = False
                    poller.add(self.fd, self)
                if self.woken:
                    self.woken = False
                    continue
                self.waiter = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the peer went away; closing below releases what it held
        finally:
            poller.remove(self.fd)  # before the socket closes: its fd may be reused
            self.closed = True
            self._drop_unsent()
            self.lp.close_session(self.session)
            self.sock.close()
            if gate is not None:
                gate.open -= 1

    async def _run_feed(self) -> None:
        # A replication feed (replication/feed.py) streams itself.
        if self.stream is None:
            self.stream = trio.SocketStream(self.sock)
        await self.feed.run(self.stream, lambda: self.lp.journal.committed_seq)

    async def reader(self) -> None:
        """The streamed path's reader (no epoll, or no fd: TLS)."""
        while True:
            while self._over_limit():
                self.paused = True
                self.room = trio.Event()
                await self.room.wait()
            self.paused = False
            self.room = None
            if self.parser.more:
                self._parse_held()
                continue
            try:
                data = await self.stream.receive_some(RECV_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            self._received(data)
            if self.eof:
                return

    async def flusher(self, cancel: trio.CancelScope) -> None:
        """The streamed path's sender."""
        while True:
            if self.feed is not None:
                await self._run_feed()
                break
            if self.unsent:
                await self._flush()
                continue
            if self.closing or self.broken or (self.eof and self.done):
                break
            if self.woken:
                self.woken = False
                continue
            self.waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        cancel.cancel()


def _addr(peer) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) or "unix socket"


def peer_of(stream) -> tuple[str | None, str]:
    """(peer address, transport) of a connection (a stream or a trio socket), for the
    admin check (server/admin.py)."""
    sock = stream if hasattr(stream, "family") else getattr(stream, "socket", None)
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
                           poller: Poller | None = None, dialect=None) -> None:
    """Serve one connection given as a stream (two tasks; a SocketStream
    with a poller is read by the poller, as `serve_socket` does)."""
    sock = getattr(stream, "socket", None)
    if poller is not None and sock is not None:
        await _Connection(lp, sock, None, max_job_size, poller, dialect).serve_polled()
        return
    conn = _Connection(lp, None, stream, max_job_size, None, dialect)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.reader)
            nursery.start_soon(conn.flusher, nursery.cancel_scope)
    except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the peer went away; closing below releases what it held
    finally:
        conn.closed = True
        conn._drop_unsent()
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


class Gate:
    """The connection count against --max-connections."""

    __slots__ = ("limit", "open", "logged_at")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.logged_at = -1.0  # the last refusal logged (once a second at most)


async def serve_listeners(lp: MutationLoop, listeners, max_job_size: int,
                          handshake_timeout: float = tls.HANDSHAKE_TIMEOUT,
                          max_connections: int = 0) -> None:
    """Accept on every listener and serve each connection (max_connections 0: the
    default limit); a TLS listener's clients shake hands first (tls.py); a
    listener with a `dialect()` (server/memcache.py) makes each connection's
    parser and session side."""
    poller = Poller(lp) if poller_mod.available() else None
    gate = Gate(max_connections or default_max_connections())
    async with trio.open_nursery() as nursery:
        if poller is not None:
            nursery.start_soon(poller.run)
        for listener in listeners:
            nursery.start_soon(_accept, lp, listener, max_job_size, poller, gate,
                               handshake_timeout, nursery)


async def _accept(lp: MutationLoop, listener, max_job_size: int, poller: Poller | None,
                  gate: Gate, handshake_timeout: float, nursery: trio.Nursery) -> None:
    lsock = listener.socket
    # The same listening socket as a plain one (the fd duplicated, so closing
    # it leaves the listener open): after each wake-up the backlog is taken
    # without a wait per connection. trio's accept yields to the scheduler
    # once per call, and while the poller's passes are long (a flood) that
    # is one connection a pass: a new client waited behind a queue of others.
    raw = stdsocket.socket(fileno=os.dup(lsock.fileno()))
    raw.setblocking(False)
    logged_at = -1.0
    try:
        while True:
            try:
                sock, _addr_ = await lsock.accept()
            except OSError as e:
                if e.errno in NO_FDS:
                    # The connection waits in the backlog; no busy retry, one line a second.
                    now = trio.current_time()
                    if now - logged_at >= 1.0:
                        logged_at = now
                        log.error("cannot accept connections: %s (%d open); retrying",
                                  os.strerror(e.errno), gate.open)
                    await trio.sleep(ACCEPT_RETRY)
                    continue
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that one connection is gone
                raise
            _admit(lp, listener, sock, max_job_size, poller, gate, handshake_timeout, nursery)
            for _ in range(ACCEPT_BATCH):
                try:
                    plain, _addr_ = raw.accept()
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                        continue
                    break  # out of fds, or worse: the awaited accept above says so
                _admit(lp, listener, trio.socket.from_stdlib_socket(plain), max_job_size,
                       poller, gate, handshake_timeout, nursery)
    finally:
        raw.close()


def _admit(lp: MutationLoop, listener, sock, max_job_size: int, poller: Poller | None,
           gate: Gate, handshake_timeout: float, nursery: trio.Nursery) -> None:
    """Serve one accepted socket, or refuse it past --max-connections."""
    if gate.open >= gate.limit:
        _refuse(lp, sock, gate)
        return
    if sock.family != stdsocket.AF_UNIX:
        try:
            sock.setsockopt(stdsocket.IPPROTO_TCP, stdsocket.TCP_NODELAY, True)
        except OSError:
            pass
    gate.open += 1
    dialect = listener.dialect() if hasattr(listener, "dialect") else None
    if isinstance(listener, tls.Listener):
        nursery.start_soon(_serve_tls, lp, listener.stream(sock), max_job_size,
                           handshake_timeout, gate)
    elif poller is not None:
        nursery.start_soon(_Connection(lp, sock, None, max_job_size, poller,
                                       dialect).serve_polled, gate)
    else:
        nursery.start_soon(_serve_streamed, lp, sock, max_job_size, gate, dialect)


async def _serve_streamed(lp: MutationLoop, sock, max_job_size: int, gate: Gate,
                          dialect=None) -> None:
    try:
        await serve_connection(lp, trio.SocketStream(sock), max_job_size, None, dialect)
    finally:
        gate.open -= 1


async def _serve_tls(lp: MutationLoop, stream: trio.SSLStream, max_job_size: int,
                     handshake_timeout: float, gate: Gate) -> None:
    """A TLS client: its handshake within the timeout, then its own task reads it
    (an SSLStream has no fd for the poller); it counts from its accept."""
    try:
        if await tls.handshake(stream, handshake_timeout):
            await serve_connection(lp, stream, max_job_size, None)
    finally:
        gate.open -= 1


def _refuse(lp: MutationLoop, sock, gate: Gate) -> None:
    """One line saying why, then close: a client past --max-connections never hangs."""
    lp.count_refused()
    now = trio.current_time()
    if now - gate.logged_at >= 1.0:
        gate.logged_at = now
        log.warning("refusing connections: %d open, --max-connections is %d (%d refused so far)",
                    gate.open, gate.limit, lp.refused)
    try:
        os.write(sock.fileno(), REFUSED)  # an empty socket buffer takes it at once
    except OSError:
        pass
    sock.close()
