"""The poller (one epoll set for every client socket) on real loopback sockets:
replies reach their own connection while fd numbers are reused, and a
connection that ends leaves the set."""

from __future__ import annotations

import trio

from .harness import serve_on_loopback


async def recv_until(stream: trio.SocketStream, end: bytes) -> bytes:
    got = b""
    with trio.fail_after(10):
        while not got.endswith(end):
            data = await stream.receive_some(4096)
            assert data, f"connection closed after {got!r}"
            got += data
    return got


async def test_replies_reach_their_own_connection_while_fds_are_reused(nursery) -> None:
    lp, port = await serve_on_loopback(nursery)
    steady = await trio.open_tcp_stream("127.0.0.1", port)
    for i in range(40):
        # Each short-lived connection closes before the next opens: the server
        # side of it most likely gets the same fd number every time.
        brief = await trio.open_tcp_stream("127.0.0.1", port)
        await brief.send_all(b"use t%d\r\nput 0 0 60 2\r\n%02d\r\n" % (i, i))
        assert await recv_until(brief, b"INSERTED %d\r\n" % (i + 1)) == \
            b"USING t%d\r\nINSERTED %d\r\n" % (i, i + 1)
        await steady.send_all(b"list-tube-used\r\n")
        assert await recv_until(steady, b"\r\n") == b"USING default\r\n"
        if i % 2:
            await brief.send_all(b"quit\r\n")  # the server closes it
            assert await brief.receive_some(10) == b""
        await brief.aclose()
    with trio.fail_after(10):
        while len(lp.sessions) > 1:
            await trio.sleep(0.01)
    await steady.send_all(b"peek 40\r\n")
    assert await recv_until(steady, b"39\r\n") == b"FOUND 40 2\r\n39\r\n"
    await steady.aclose()
