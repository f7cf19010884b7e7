"""`AsyncClient`: the trio driver of the client core over trio (or TLS) streams."""

from __future__ import annotations

import math
import os
import socket
import ssl
from collections.abc import Sequence

import trio

from smallstalk.core import protocol as p

from .addresses import Servers, resolve_servers, split_address
from .core import (
    _T,
    DEFAULT_PRIORITY,
    DEFAULT_TTR,
    KEY_RETRIES,
    JobLike,
    _Core,
    _Exchange,
    _Op,
    _Pause,
)
from .errors import BeanstalkError, ConnectionFailed, NotConnected, ReadTimeout
from .replies import (
    Explanation,
    Job,
    JobRef,
    JobStats,
    Reply,
    ReplyReader,
    ServerStats,
    TubeStats,
)
from .security import security


class _AsyncConn:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.reader = ReplyReader()

    @classmethod
    async def open(cls, addr: str, connect_timeout: float,
                   ssl_context: ssl.SSLContext | None) -> _AsyncConn:
        with trio.fail_after(connect_timeout):
            if addr.startswith("unix:"):
                # A unix socket stays plaintext: the file's permissions guard it.
                stream: trio.abc.Stream = await trio.open_unix_socket(addr[5:])
            else:
                host, port = split_address(addr)
                tcp = await trio.open_tcp_stream(host, port)
                tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                stream = tcp
                if ssl_context is not None:
                    tls = trio.SSLStream(tcp, ssl_context, server_hostname=host)
                    try:
                        await tls.do_handshake()
                    except BaseException:
                        await trio.aclose_forcefully(tcp)
                        raise
                    stream = tls
        return cls(stream)

    async def exchange(self, data: bytes, count: int, timeout: float | None) -> list[Reply]:
        with trio.fail_after(math.inf if timeout is None else timeout):
            await self.stream.send_all(data)
            replies: list[Reply] = []
            while len(replies) < count:
                reply = self.reader.next_reply()
                if reply is not None:
                    replies.append(reply)
                    continue
                chunk = await self.stream.receive_some(65536)
                if not chunk:
                    raise ConnectionResetError("the server closed the connection")
                self.reader.feed(chunk)
        return replies

    async def close(self, quit: bool = False) -> None:
        if quit:
            with trio.move_on_after(0.5):
                try:
                    await self.stream.send_all(p.render(p.QUIT))
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
        await trio.aclose_forcefully(self.stream)


class AsyncClient:
    """The trio client: `Client`'s methods and arguments, awaited. Use one per
    task that reserves (a waiting reserve blocks its connection); calls on one
    client are serialized. Cancelling a call drops the connection it was using
    (jobs reserved on it go back to ready)."""

    def __init__(self, servers: Servers = None, *, connect_timeout: float = 5.0,
                 read_timeout: float = 10.0, poll_interval: float = 1.0,
                 retry_interval: float = 5.0, tls: bool = False,
                 ssl_context: ssl.SSLContext | None = None, token: str | None = None,
                 token_file: str | os.PathLike[str] | None = None) -> None:
        self.security = security(tls=tls, ssl_context=ssl_context, token=token,
                                 token_file=token_file)
        self._core = _Core(resolve_servers(servers), poll_interval, retry_interval,
                           self.security.token)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._conns: list[_AsyncConn | None] = [None] * len(self._core.servers)
        self._lock = trio.Lock()

    async def _exchange(self, req: _Exchange) -> list[Reply]:
        i = req.server
        if self._conns[i] is None:
            await self._open(i)
        cmds, n_pre = self._core.outgoing(i, req.commands)
        if not cmds:
            return []
        replies = await self._send(i, cmds, req.wait)
        stale = self._core.out_of_step(cmds, replies)
        try:
            return self._core.incoming(i, cmds, n_pre, replies)
        finally:
            if stale:
                await self._drop(i)

    async def _open(self, i: int) -> None:
        server = self._core.servers[i]
        try:
            conn = await _AsyncConn.open(server, self.connect_timeout,
                                         self.security.ssl_context)
        except trio.TooSlowError as e:
            raise NotConnected(server, "cannot connect: timed out") from e
        except trio.BrokenResourceError as e:
            # trio's SSLStream wraps the ssl module's error.
            raise NotConnected(server, f"TLS handshake failed: {e.__cause__ or e}") from e
        except OSError as e:
            raise NotConnected(server, f"cannot connect: {e}") from e
        self._conns[i] = conn
        self._core.connected(i)
        hello = self._core.hello()
        if hello:
            try:
                self._core.greeted(i, hello, await self._send(i, hello, 0.0))
            except BaseException:
                await self._drop(i)
                raise

    async def _send(self, i: int, cmds: list[p.Command], wait: float | None) -> list[Reply]:
        conn = self._conns[i]
        assert conn is not None
        server = self._core.servers[i]
        timeout = None if wait is None else self.read_timeout + wait
        try:
            return await conn.exchange(b"".join(map(p.render, cmds)), len(cmds), timeout)
        except trio.TooSlowError as e:
            await self._drop(i)
            raise ReadTimeout(server, f"no reply within {timeout:.1f}s") from e
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            await self._drop(i)
            raise ConnectionFailed(server, str(e) or type(e).__name__) from e
        except BaseException:
            await self._drop(i)  # cancelled or broken mid-exchange: the stream is out of step
            raise

    async def _drop(self, i: int) -> None:
        conn, self._conns[i] = self._conns[i], None
        self._core.disconnected(i)
        if conn is not None:
            await trio.aclose_forcefully(conn.stream)

    async def _run(self, op: _Op[_T]) -> _T:
        async with self._lock:
            try:
                req = next(op)
                while True:
                    if type(req) is _Pause:
                        await trio.sleep(req.seconds)
                        req = op.send([])
                        continue
                    try:
                        replies = await self._exchange(req)
                    except BeanstalkError as e:
                        req = op.throw(e)
                    else:
                        req = op.send(replies)
            except StopIteration as stop:
                return stop.value

    @property
    def servers(self) -> list[str]:
        return list(self._core.servers)

    async def connect(self) -> None:
        await self._run(self._core.connect())

    async def aclose(self) -> None:
        """Send `quit` and close every connection."""
        for i, conn in enumerate(self._conns):
            if conn is not None:
                self._conns[i] = None
                self._core.disconnected(i)
                await conn.close(quit=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def put(self, body: bytes | str, priority: int = DEFAULT_PRIORITY, delay: int = 0,
                  ttr: int = DEFAULT_TTR, *, tube: str | None = None,
                  server: str | None = None, max_age: int = 0,
                  key: str | None = None, rounds: int = KEY_RETRIES) -> JobRef:
        """As `Client.put` (`key`: exactly-once, retried; see docs/CLIENT.md)."""
        return await self._run(self._core.put(body, priority, delay, ttr, tube, server, max_age,
                                              key, rounds))

    async def use(self, tube: str) -> str:
        return await self._run(self._core.use(tube))

    async def reserve(self, timeout: float | None = None, *,
                      tubes: Sequence[str] | None = None) -> Job:
        return await self._run(self._core.reserve(timeout, tubes))

    async def reserve_many(self, count: int, timeout: float | None = None, *,
                           tubes: Sequence[str] | None = None) -> list[Job]:
        """Up to `count` jobs in one round trip (`reserve-batch`); as the sync client's."""
        return await self._run(self._core.reserve_many(count, timeout, tubes))

    async def reserve_job(self, job: JobLike) -> Job:
        return await self._run(self._core.reserve_job(job))

    async def delete(self, job: JobLike) -> None:
        await self._run(self._core.delete(job))

    async def delete_many(self, jobs: Sequence[JobLike]) -> list[JobLike]:
        """As `Client.delete_many`: the deletes in one write per server."""
        return await self._run(self._core.delete_many(jobs))

    async def release(self, job: JobLike, priority: int | None = None, delay: int = 0) -> None:
        await self._run(self._core.release(job, priority, delay))

    async def bury(self, job: JobLike, priority: int | None = None) -> None:
        await self._run(self._core.bury(job, priority))

    async def touch(self, job: JobLike) -> None:
        await self._run(self._core.touch(job))

    async def watch(self, tube: str) -> int:
        return await self._run(self._core.watch(tube))

    async def ignore(self, tube: str) -> int:
        return await self._run(self._core.ignore(tube))

    async def peek(self, job: JobLike) -> Job:
        return await self._run(self._core.peek(job))

    async def peek_ready(self, *, tube: str | None = None) -> Job:
        return await self._run(self._core.peek_first(p.PEEK_READY, tube))

    async def peek_delayed(self, *, tube: str | None = None) -> Job:
        return await self._run(self._core.peek_first(p.PEEK_DELAYED, tube))

    async def peek_buried(self, *, tube: str | None = None) -> Job:
        return await self._run(self._core.peek_first(p.PEEK_BURIED, tube))

    async def kick(self, bound: int, *, tube: str | None = None) -> int:
        return await self._run(self._core.kick(bound, tube))

    async def kick_job(self, job: JobLike) -> None:
        await self._run(self._core.kick_job(job))

    async def stats_job(self, job: JobLike) -> JobStats:
        return await self._run(self._core.stats_job(job))

    async def move_job(self, job: JobLike, tube: str) -> None:
        """Move a ready, delayed or buried job to `tube` (smallstalk only, `move-job`)."""
        await self._run(self._core.move_job(job, tube))

    async def explain(self, job: JobLike) -> Explanation:
        """Why the job is (or is not) handed out now (smallstalk only, `explain-job`)."""
        return await self._run(self._core.explain(job))

    async def stats_tube(self, tube: str, *, server: str | None = None) -> TubeStats:
        return await self._run(self._core.stats_tube(tube, server))

    async def stats(self, *, server: str | None = None) -> ServerStats:
        return await self._run(self._core.stats(server))

    async def list_tubes(self) -> list[str]:
        return await self._run(self._core.list_tubes())

    async def list_tube_used(self) -> str:
        return await self._run(self._core.first_reachable(p.LIST_TUBE_USED))

    async def list_tubes_watched(self) -> list[str]:
        return await self._run(self._core.first_reachable(p.LIST_TUBES_WATCHED))

    async def pause_tube(self, tube: str, delay: int) -> None:
        await self._run(self._core.pause_tube(tube, delay))

    async def delete_tube(self, tube: str) -> None:
        await self._run(self._core.delete_tube(tube))

    async def list_jobs(self, tube: str, state: str = "ready", after: int = 0,
                        count: int = 100, *, server: str | None = None) -> list[int]:
        return await self._run(self._core.list_jobs(tube, state, after, count, server))

    async def search_jobs(self, tube: str, pattern: bytes | str, *, state: str = "ready",
                          how: str = "substr", after: int = 0, count: int = 100,
                          server: str | None = None) -> list[int]:
        """As `Client.search_jobs`."""
        return await self._run(self._core.search_jobs(tube, pattern, state, how, after, count,
                                                      server))

    async def bulk_jobs(self, tube: str, pattern: bytes | str, action: str, *,
                        state: str = "ready", how: str = "substr", to: str | None = None,
                        max: int = 2**32 - 1, server: str | None = None) -> int:
        """As `Client.bulk_jobs`."""
        return await self._run(self._core.bulk_jobs(tube, pattern, action, state, how, to,
                                                    max, server))

    async def flush_tube(self, tube: str, *, server: str | None = None) -> int:
        return await self._run(self._core.flush_tube(tube, server))

    # admin (smallstalk only: the server's admin token, or an address it trusts) ----

    async def promote(self, *, server: str | None = None) -> int:
        """Make a replica a primary; its new epoch. NotAReplica if it is not one."""
        return await self._run(self._core.promote(server))

    async def config(self, *, server: str | None = None) -> str:
        """The server's effective per-tube settings, as YAML (`smallstalk config dump`)."""
        return await self._run(self._core.config(server))

    async def reload_config(self, *, server: str | None = None) -> None:
        """Re-read the per-tube settings from the server's --config file; NotReloaded
        (its text says why) leaves the old ones in force."""
        await self._run(self._core.reload_config(server))

    async def ext_stats(self, *, server: str | None = None) -> dict[str, str]:
        """smallstalk's own server statistics (role, replication, storage)."""
        return await self._run(self._core.ext_stats(server))

    async def ext_stats_tube(self, tube: str, *, server: str | None = None) -> dict[str, str]:
        """smallstalk's own statistics of a tube (expired, discarded, bytes)."""
        return await self._run(self._core.ext_stats_tube(tube, server))
