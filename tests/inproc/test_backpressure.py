"""A client that sends without reading cannot make the server buffer without bound.

In-process server on a real loopback socket: a connection whose reserve waits
pipelines puts behind it; the reader must stop reading once about
INPUT_AHEAD of its commands wait in the loop, so the rest stays in the
kernel's socket buffers and, when those are full, the client's send blocks.
"""

from __future__ import annotations

import trio

from smallstalk.core import protocol as p
from smallstalk.server import session
from smallstalk.server.connection import INPUT_AHEAD, MAX_QUEUED_BYTES, RECV_SIZE

from ..support.harness import serve_on_loopback

OFFERED = 64 << 20  # what the client tries to send: far past every buffer


async def test_commands_behind_a_waiting_reserve_are_not_read_without_bound(nursery) -> None:
    lp, port = await serve_on_loopback(nursery)
    client = await trio.open_tcp_stream("127.0.0.1", port)
    await client.send_all(b"reserve\r\n")  # no job: it waits, and so does all after it
    body = b"x" * 60_000
    chunk = p.render(p.Put(0, 0, 60, body)) * 16
    sent = 0
    # Bounded in time: a server that stops reading makes send_all block here.
    with trio.move_on_after(3):
        while sent < OFFERED:
            await client.send_all(chunk)
            sent += len(chunk)
    waiting = [s for s in lp.sessions.values() if s.blocked]
    assert len(waiting) == 1
    queued = sum(len(cmd.body) for cmd in waiting[0].pending if isinstance(cmd, p.Put))
    assert queued <= MAX_QUEUED_BYTES + RECV_SIZE + len(chunk)
    assert sent < OFFERED
    assert waiting[0].inflight > INPUT_AHEAD  # it read that far: two puts at least
    # Nothing was lost: a job for the reserve lets everything behind it run.
    other = await trio.open_tcp_stream("127.0.0.1", port)
    await other.send_all(b"put 0 0 60 1\r\nx\r\n")
    assert await other.receive_some(100) == b"INSERTED 1\r\n"
    # Only what the server read before it stopped, at least INPUT_AHEAD (two
    # puts), is sure to be there: the client's send was cancelled mid-chunk,
    # and how much the kernel's buffers took depends on their autotuning
    # (waiting for more than that hung whenever the first chunk did not fit).
    expected = b"RESERVED 1 1\r\nx\r\nINSERTED 2\r\nINSERTED 3\r\n"
    got = b""
    with trio.fail_after(10):
        while len(got) < len(expected):
            got += await client.receive_some(1 << 16)
    assert got.startswith(expected)
    await client.aclose()
    await other.aclose()


async def test_a_throttled_connection_that_hangs_up_is_cleaned_up(nursery) -> None:
    """While throttled, a connection is out of the poller's set: its hang-up
    is seen once its backlog moves again, and nothing else is held up."""
    lp, port = await serve_on_loopback(nursery)
    client = await trio.open_tcp_stream("127.0.0.1", port)
    await client.send_all(b"reserve\r\n")
    chunk = p.render(p.Put(0, 0, 60, b"x" * 60_000)) * 16
    with trio.move_on_after(3):
        for _ in range(OFFERED // len(chunk)):
            await client.send_all(chunk)
    await client.aclose()
    other = await trio.open_tcp_stream("127.0.0.1", port)
    await other.send_all(b"put 0 0 60 1\r\ny\r\n")
    assert await other.receive_some(100) == b"INSERTED 1\r\n"
    with trio.fail_after(20):  # bounded: the dead connection's session must go
        while len(lp.sessions) > 1:
            await trio.sleep(0.01)
    # The job went to the dead client's reserve, and came back when it closed.
    await other.send_all(b"stats-job 1\r\n")
    stats = await other.receive_some(4096)
    assert b"state: ready\n" in stats and b"reserves: 1\n" in stats
    await other.aclose()


async def test_replies_a_client_does_not_read_hold_its_commands_in_order(nursery) -> None:
    """Past OUT_BOUND unsent, a session's commands wait (its reserve too: a
    job goes to another client meanwhile); once the client reads, they run on
    in order and every reply arrives."""
    from smallstalk.server.session import OUT_BOUND

    lp, port = await serve_on_loopback(nursery)
    other = await trio.open_tcp_stream("127.0.0.1", port)
    body = b"z" * 60_000
    await other.send_all(p.render(p.Put(0, 0, 60, body)))
    assert await other.receive_some(100) == b"INSERTED 1\r\n"
    peeks = 2_000  # 120 MB of replies: far past every socket buffer
    slow = await trio.open_tcp_stream("127.0.0.1", port)
    await slow.send_all(b"peek 1\r\n" * peeks + b"reserve-with-timeout 0\r\n")
    with trio.fail_after(10):
        while not any(s.held for s in lp.sessions.values()):
            await trio.sleep(0.01)
    held = next(s for s in lp.sessions.values() if s.held)
    assert held.owed <= OUT_BOUND + len(p.found(1, body))
    assert held.pending  # commands wait, nothing was dropped
    # The slow client's reserve has not run: another client gets the job.
    await other.send_all(b"reserve-with-timeout 0\r\n")
    got = b""
    while not got.endswith(body + b"\r\n"):
        got += await other.receive_some(1 << 16)
    assert got.startswith(b"RESERVED 1 60000\r\n")
    # Reading lets everything run, in order.
    want = p.found(1, body) * peeks + b"TIMED_OUT\r\n"
    got = bytearray()
    with trio.fail_after(30):
        while len(got) < len(want):
            got += await slow.receive_some(1 << 20)
    assert bytes(got) == want
    assert not held.held and held.owed == 0
    await slow.aclose()
    await other.aclose()


async def test_a_paused_connection_whose_last_reply_is_big_is_read_again(nursery) -> None:
    """Read ahead past INPUT_AHEAD, a connection leaves the poller's set; its
    last command's reply (a 2 MiB peek) goes out whole. It must be read again:
    the room check once counted that reply as still unsent, and nothing woke
    the connection after, so its next command was never read."""
    lp, port = await serve_on_loopback(nursery, max_job_size=4 << 20)
    body = b"b" * (2 << 20)
    client = await trio.open_tcp_stream("127.0.0.1", port)
    await client.send_all(p.render(p.Put(0, 0, 60, body)))
    assert await client.receive_some(100) == b"INSERTED 1\r\n"
    filler = p.render(p.Put(0, 0, 60, b"f" * 60_000)) * 3  # > INPUT_AHEAD behind the wait
    await client.send_all(b"watch t\r\nignore default\r\nreserve-with-timeout 1\r\n" + filler
                          + b"peek 1\r\n")
    got = bytearray()
    with trio.fail_after(10):
        while not got.endswith(body + b"\r\n"):
            got += await client.receive_some(1 << 20)
    assert got.startswith(b"WATCHING 2\r\nWATCHING 1\r\nTIMED_OUT\r\nINSERTED 2\r\n"
                          b"INSERTED 3\r\nINSERTED 4\r\nFOUND 1 %d\r\n" % len(body))
    await client.send_all(b"peek 1\r\n")  # never read while the connection stayed paused
    more = bytearray()
    with trio.fail_after(10):
        while not more.endswith(body + b"\r\n"):
            more += await client.receive_some(1 << 20)
    assert more.startswith(b"FOUND 1 %d\r\n" % len(body))
    await client.aclose()


async def test_commands_a_read_held_back_all_run_in_order_and_then_its_end(nursery) -> None:
    """One send of thousands of commands, then a half-close: the parser
    makes TAKE_MAX per read and the connection hands on the rest as room
    comes; every one is answered, in order, and only then is the end seen."""
    lp, port = await serve_on_loopback(nursery)
    client = await trio.open_tcp_stream("127.0.0.1", port)
    n = 5 * p.TAKE_MAX + 3
    await client.send_all(b"".join(b"put 0 0 60 2\r\n%02d\r\n" % (i % 100) for i in range(n)))
    await client.send_eof()
    expected = b"".join(b"INSERTED %d\r\n" % (i + 1) for i in range(n))
    got = b""
    with trio.fail_after(20):
        while chunk := await client.receive_some(1 << 16):
            got += chunk
    assert got == expected
    await client.aclose()


def test_a_turn_shares_its_commands_and_bytes_once_many_sessions_are_busy() -> None:
    share, whole = session.turn_share, (session.SLICE_COMMANDS, session.SLICE_BYTES)
    assert share(1) == share(session.TURN_BYTES // session.SLICE_BYTES) == whole
    assert share(32) == (session.SLICE_COMMANDS, session.TURN_BYTES // 32)
    for busy in (17, 64, 65, 100, 400, 5000, 100_000):
        commands, nbytes = share(busy)
        assert 1 <= commands <= session.SLICE_COMMANDS and 1 <= nbytes < session.SLICE_BYTES
        assert commands * busy <= session.TURN_COMMANDS or commands == 1
        assert nbytes * busy <= session.TURN_BYTES or nbytes == 1


async def test_without_the_poller_held_commands_all_run_in_order_too(nursery) -> None:
    """The streamed path (TLS, or no epoll): its reader hands on what the
    parser held back before it reads again, and sees the end only after."""
    from smallstalk.server.connection import serve_connection

    from ..support.harness import make_loop

    lp = make_loop()
    nursery.start_soon(lp.run)
    a, b = trio.socket.socketpair()
    nursery.start_soon(serve_connection, lp, trio.SocketStream(a), p.DEFAULT_MAX_JOB_SIZE, None)
    client = trio.SocketStream(b)
    n = 3 * p.TAKE_MAX + 1
    await client.send_all(b"".join(b"put 0 0 60 1\r\n%d\r\n" % (i % 10) for i in range(n)))
    await client.send_eof()
    got = b""
    with trio.fail_after(20):
        while chunk := await client.receive_some(1 << 16):
            got += chunk
    assert got == b"".join(b"INSERTED %d\r\n" % (i + 1) for i in range(n))
    await client.aclose()
