"""The poller (one epoll set for every client socket) on real loopback sockets:
replies reach their own connection while fd numbers are reused, and a
connection that ends leaves the set; without it, a connection reads for itself."""

from __future__ import annotations

import trio
import trio.testing

from ..support.harness import serve_on_loopback


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


async def test_without_the_poller_a_connection_reads_for_itself(nursery) -> None:
    """No epoll (not Linux), or a stream without an fd: the connection's own
    task reads, throttles and ends the connection as the poller would."""
    from smallstalk.core import protocol as p
    from smallstalk.server.connection import serve_connection

    from ..support.harness import make_loop

    lp = make_loop()
    nursery.start_soon(lp.run)
    a, b = trio.socket.socketpair()
    nursery.start_soon(serve_connection, lp, trio.SocketStream(a), p.DEFAULT_MAX_JOB_SIZE, None)
    client = trio.SocketStream(b)
    left, right = trio.testing.memory_stream_pair()  # no socket at all
    nursery.start_soon(serve_connection, lp, left, p.DEFAULT_MAX_JOB_SIZE, None)
    await client.send_all(b"put 0 0 60 2\r\nhi\r\n")
    assert await recv_until(client, b"\r\n") == b"INSERTED 1\r\n"
    await right.send_all(b"reserve-with-timeout 0\r\ndelete 1\r\n")
    assert await recv_until(right, b"DELETED\r\n") == b"RESERVED 1 2\r\nhi\r\nDELETED\r\n"
    await client.send_all(b"quit\r\n")
    assert await client.receive_some(10) == b""
    await right.aclose()
    with trio.fail_after(10):
        while lp.sessions:
            await trio.sleep(0.01)
