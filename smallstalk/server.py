"""Listeners and connection tasks: sockets in, parsed batches to the loop, replies out.

Each connection runs two tasks in its own nursery:

- the reader receives bytes, feeds the sans-I/O parser and hands every batch
  of complete commands to the mutation loop in one hop. While a batch is
  being answered, further commands queue here, up to `MAX_QUEUED_BYTES`;
  past that the reader stops reading, so a client that never reads its
  replies holds no more than that (TCP flow control does the rest);
- the writer sends each reply blob the loop produces with one send and,
  when a batch is fully answered, submits whatever queued meanwhile.

End of input is reported to the loop at once (a waiting reserve is answered
TIMED_OUT, as beanstalkd does for a half-closed socket); the connection
closes when everything before it has been answered.
"""

from __future__ import annotations

import errno
import logging
import os
import socket as stdsocket

import trio

from .loop import MutationLoop
from .protocol import Parser, Put

log = logging.getLogger("smallstalk.server")

RECV_SIZE = 65536
MAX_QUEUED_BYTES = 1 << 20


class _Conn:
    __slots__ = ("queued", "queued_bytes", "idle", "eof", "space", "finished", "feed")

    def __init__(self) -> None:
        self.queued: list = []
        self.queued_bytes = 0
        self.idle = True  # no batch is with the loop
        self.eof = False
        self.space = trio.Event()
        self.finished = trio.Event()
        self.feed = False  # a replication feed: acks go straight to the loop


def _size(ev) -> int:
    return len(ev.body) + 32 if type(ev) is Put else 32


async def serve_connection(lp: MutationLoop, stream: trio.abc.Stream, max_job_size: int) -> None:
    session, outbox = lp.open_session()
    parser = Parser(max_job_size)
    c = _Conn()

    def flush_queue() -> None:
        if c.queued:
            lp.submit(session, c.queued)
            c.queued = []
            c.queued_bytes = 0
            c.idle = False
            c.space.set()
            c.space = trio.Event()
        else:
            c.idle = True
            if c.eof:
                c.finished.set()

    async def reader() -> None:
        while True:
            try:
                data = await stream.receive_some(RECV_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                c.eof = True
                lp.end_of_input(session)
                if c.idle and not c.queued:
                    c.finished.set()
                return
            parser.feed(data)
            events = parser.events()
            if not events:
                continue
            c.queued.extend(events)
            c.queued_bytes += sum(_size(ev) for ev in events)
            if c.idle or c.feed:
                flush_queue()
            while c.queued_bytes > MAX_QUEUED_BYTES:
                await c.space.wait()

    async def writer() -> None:
        async for blob, done, close in outbox:
            if not isinstance(blob, bytes):  # a replication feed takes the connection over
                from .replication import run_feed

                c.feed = True
                await run_feed(stream, blob, lambda: lp.journal.committed_seq)
                c.finished.set()
                return
            if blob:
                await stream.send_all(blob)
            if close:
                c.finished.set()
                return
            if done:
                flush_queue()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(writer)
            await c.finished.wait()
            nursery.cancel_scope.cancel()
    except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the peer went away; closing below releases what it held
    finally:
        lp.close_session(session)
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


async def serve_listeners(lp: MutationLoop, listeners, max_job_size: int) -> None:
    async def handler(stream) -> None:
        if isinstance(stream, trio.SocketStream):
            try:
                stream.setsockopt(stdsocket.IPPROTO_TCP, stdsocket.TCP_NODELAY, True)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOPROTOOPT, errno.EINVAL):
                    raise
        await serve_connection(lp, stream, max_job_size)

    await trio.serve_listeners(handler, listeners)
