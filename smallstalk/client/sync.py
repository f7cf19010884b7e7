"""`Client`: the synchronous driver of the client core over plain (or TLS) sockets."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Sequence

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


class _SyncConn:
    def __init__(self, addr: str, connect_timeout: float,
                 ssl_context: ssl.SSLContext | None) -> None:
        if addr.startswith("unix:"):
            # A unix socket stays plaintext: the file's permissions guard it.
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(connect_timeout)
            try:
                sock.connect(addr[5:])
            except BaseException:
                sock.close()
                raise
        else:
            host, port = split_address(addr)
            sock = socket.create_connection((host, port), timeout=connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                try:
                    sock = ssl_context.wrap_socket(sock, server_hostname=host)
                except BaseException:
                    sock.close()
                    raise
        self.sock = sock
        self.reader = ReplyReader()

    def exchange(self, data: bytes, count: int, timeout: float | None) -> list[Reply]:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.sock.settimeout(timeout)
        self.sock.sendall(data)
        replies: list[Reply] = []
        while len(replies) < count:
            reply = self.reader.next_reply()
            if reply is not None:
                replies.append(reply)
                continue
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("the server closed the connection")
            self.reader.feed(chunk)
        return replies

    def close(self, quit: bool = False) -> None:
        if quit:
            try:
                self.sock.settimeout(0.5)
                self.sock.sendall(p.render(p.QUIT))
            except OSError:
                pass
        self.sock.close()


class Client:
    """A synchronous beanstalkd client over one or several servers.

    `servers` is an address ("host:port", "unix:/path", a (host, port)
    tuple), a comma-separated string or a list; None means
    $SMALLSTALK_SERVERS or 127.0.0.1:11300. `ssl_context` (or `tls=True`,
    the system's CAs) speaks TLS to TCP servers; `token` (or `token_file`)
    is sent with `auth` first on every connection. Connections open on first
    use. Safe to share between threads (one call at a time).
    """

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
        self._conns: list[_SyncConn | None] = [None] * len(self._core.servers)
        self._lock = threading.RLock()

    # driver -----------------------------------------------------------------

    def _exchange(self, req: _Exchange) -> list[Reply]:
        i = req.server
        if self._conns[i] is None:
            self._open(i)
        cmds, n_pre = self._core.outgoing(i, req.commands)
        if not cmds:
            return []
        replies = self._send(i, cmds, req.wait)
        stale = self._core.out_of_step(cmds, replies)
        try:
            return self._core.incoming(i, cmds, n_pre, replies)
        finally:
            if stale:
                self._drop(i)

    def _open(self, i: int) -> None:
        server = self._core.servers[i]
        try:
            conn = _SyncConn(server, self.connect_timeout, self.security.ssl_context)
        except ssl.SSLError as e:
            raise NotConnected(server, f"TLS handshake failed: {e}") from e
        except OSError as e:
            raise NotConnected(server, f"cannot connect: {e}") from e
        self._conns[i] = conn
        self._core.connected(i)
        hello = self._core.hello()
        if hello:
            try:
                self._core.greeted(i, hello, self._send(i, hello, 0.0))
            except BaseException:
                self._drop(i)
                raise

    def _send(self, i: int, cmds: list[p.Command], wait: float | None) -> list[Reply]:
        conn = self._conns[i]
        assert conn is not None
        timeout = None if wait is None else self.read_timeout + wait
        try:
            return conn.exchange(b"".join(map(p.render, cmds)), len(cmds), timeout)
        except TimeoutError as e:
            self._drop(i)
            raise ReadTimeout(self._core.servers[i], f"no reply within {timeout:.1f}s") from e
        except OSError as e:
            self._drop(i)
            raise ConnectionFailed(self._core.servers[i], str(e) or type(e).__name__) from e
        except BaseException:
            self._drop(i)  # a reply may still be on its way: the stream is out of step
            raise

    def _drop(self, i: int) -> None:
        conn, self._conns[i] = self._conns[i], None
        self._core.disconnected(i)
        if conn is not None:
            conn.close()

    def _run(self, op: _Op[_T]) -> _T:
        with self._lock:
            try:
                req = next(op)
                while True:
                    if type(req) is _Pause:
                        time.sleep(req.seconds)
                        req = op.send([])
                        continue
                    try:
                        replies = self._exchange(req)
                    except BeanstalkError as e:
                        req = op.throw(e)
                    else:
                        req = op.send(replies)
            except StopIteration as stop:
                return stop.value

    # lifecycle ----------------------------------------------------------------

    @property
    def servers(self) -> list[str]:
        return list(self._core.servers)

    def connect(self) -> None:
        """Connect to every server now (else on first use); fails if none is reachable."""
        self._run(self._core.connect())

    def close(self) -> None:
        """Send `quit` and close every connection (jobs still reserved go back to ready)."""
        with self._lock:
            for i, conn in enumerate(self._conns):
                if conn is not None:
                    self._conns[i] = None
                    self._core.disconnected(i)
                    conn.close(quit=True)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # producer -----------------------------------------------------------------

    def put(self, body: bytes | str, priority: int = DEFAULT_PRIORITY, delay: int = 0,
            ttr: int = DEFAULT_TTR, *, tube: str | None = None,
            server: str | None = None, max_age: int = 0, key: str | None = None,
            rounds: int = KEY_RETRIES) -> JobRef:
        """Insert a job (str bodies are UTF-8); `tube` puts into another tube than
        the used one without changing it; `server` picks the server, else
        round-robin; `max_age` (seconds, smallstalk only: sent as `put-expiring`,
        which beanstalkd answers UNKNOWN_COMMAND) expires the job if it is still
        waiting then. Raises
        JobTooBig, OutOfMemory (a full tube), Draining, Buried, ExpectedCRLF.

        `key` (smallstalk only: `put-unique`) makes the put exactly-once: a
        put whose connection broke, or that met a replica or NOT_REPLICATED,
        is sent again (to the key's own server among independent servers, to
        any member of one replicated cluster; `rounds` rounds at most, about
        16 s of pauses for the default 8), and every try returns the id of the
        one job the key made. A put without a key is never sent twice: it may
        have been stored (docs/CLIENT.md)."""
        return self._run(self._core.put(body, priority, delay, ttr, tube, server, max_age,
                                        key, rounds))

    def use(self, tube: str) -> str:
        """Put into `tube` from now on (on every server)."""
        return self._run(self._core.use(tube))

    # worker ---------------------------------------------------------------------

    def reserve(self, timeout: float | None = None, *,
                tubes: Sequence[str] | None = None) -> Job:
        """Reserve a job from the watched tubes; `timeout` in seconds (rounded
        up; 0 polls), None waits for ever. `tubes` first makes these exactly
        the watched tubes (in the same round trip). Raises TimedOut, DeadlineSoon."""
        return self._run(self._core.reserve(timeout, tubes))

    def reserve_many(self, count: int, timeout: float | None = None, *,
                     tubes: Sequence[str] | None = None) -> list[Job]:
        """Up to `count` (1-1000) jobs in one round trip (`reserve-batch`,
        smallstalk only), waiting as `reserve` does when none is ready; each
        job has its own TTR. Raises TimedOut, DeadlineSoon."""
        return self._run(self._core.reserve_many(count, timeout, tubes))

    def reserve_job(self, job: JobLike) -> Job:
        """Reserve this job whatever its state (beanstalkd 1.12 and smallstalk)."""
        return self._run(self._core.reserve_job(job))

    def delete(self, job: JobLike) -> None:
        self._run(self._core.delete(job))

    def delete_many(self, jobs: Sequence[JobLike]) -> list[JobLike]:
        """Delete `jobs` with one write per server holding some of them (the
        replies read after): the jobs answered NOT_FOUND; other errors raise."""
        return self._run(self._core.delete_many(jobs))

    def release(self, job: JobLike, priority: int | None = None, delay: int = 0) -> None:
        """Give a reserved job back; priority None keeps the job's (costs a stats-job)."""
        self._run(self._core.release(job, priority, delay))

    def bury(self, job: JobLike, priority: int | None = None) -> None:
        """Bury a reserved job; priority None keeps the job's (costs a stats-job)."""
        self._run(self._core.bury(job, priority))

    def touch(self, job: JobLike) -> None:
        """Ask for another TTR on a reserved job."""
        self._run(self._core.touch(job))

    def watch(self, tube: str) -> int:
        """Also reserve from `tube`; returns the number of watched tubes."""
        return self._run(self._core.watch(tube))

    def ignore(self, tube: str) -> int:
        """Stop reserving from `tube`; NotIgnored if it is the last one."""
        return self._run(self._core.ignore(tube))

    # other ---------------------------------------------------------------------

    def peek(self, job: JobLike) -> Job:
        return self._run(self._core.peek(job))

    def peek_ready(self, *, tube: str | None = None) -> Job:
        """The next ready job of the used tube (or `tube`); NotFound if none."""
        return self._run(self._core.peek_first(p.PEEK_READY, tube))

    def peek_delayed(self, *, tube: str | None = None) -> Job:
        return self._run(self._core.peek_first(p.PEEK_DELAYED, tube))

    def peek_buried(self, *, tube: str | None = None) -> Job:
        return self._run(self._core.peek_first(p.PEEK_BURIED, tube))

    def kick(self, bound: int, *, tube: str | None = None) -> int:
        """Kick up to `bound` buried (else delayed) jobs of the used tube (or `tube`)."""
        return self._run(self._core.kick(bound, tube))

    def kick_job(self, job: JobLike) -> None:
        self._run(self._core.kick_job(job))

    def stats_job(self, job: JobLike) -> JobStats:
        return self._run(self._core.stats_job(job))

    def move_job(self, job: JobLike, tube: str) -> None:
        """Move a ready, delayed or buried job to `tube`, keeping its id
        (smallstalk only, `move-job`; NotFound if it is reserved or gone)."""
        self._run(self._core.move_job(job, tube))

    def explain(self, job: JobLike) -> Explanation:
        """Why the job is (or is not) handed out now: its state and every
        reason that holds (smallstalk only, `explain-job`)."""
        return self._run(self._core.explain(job))

    def stats_tube(self, tube: str, *, server: str | None = None) -> TubeStats:
        """With several servers, say which one (`server=`)."""
        return self._run(self._core.stats_tube(tube, server))

    def stats(self, *, server: str | None = None) -> ServerStats:
        """With several servers, say which one (`server=`)."""
        return self._run(self._core.stats(server))

    def list_tubes(self) -> list[str]:
        """Every tube on every reachable server."""
        return self._run(self._core.list_tubes())

    def list_tube_used(self) -> str:
        return self._run(self._core.first_reachable(p.LIST_TUBE_USED))

    def list_tubes_watched(self) -> list[str]:
        return self._run(self._core.first_reachable(p.LIST_TUBES_WATCHED))

    def pause_tube(self, tube: str, delay: int) -> None:
        """No reserves from `tube` for `delay` seconds (on every server that has it)."""
        self._run(self._core.pause_tube(tube, delay))

    def delete_tube(self, tube: str) -> None:
        """Stop copying puts into the fanout tube `parent+child` (smallstalk only)."""
        self._run(self._core.delete_tube(tube))

    def list_jobs(self, tube: str, state: str = "ready", after: int = 0, count: int = 100, *,
                  server: str | None = None) -> list[int]:
        """Ids of a tube's jobs in `state`, in hand-out order, after job `after`
        (smallstalk only; at most 1000 per call)."""
        return self._run(self._core.list_jobs(tube, state, after, count, server))

    def search_jobs(self, tube: str, pattern: bytes | str, *, state: str = "ready",
                    how: str = "substr", after: int = 0, count: int = 100,
                    server: str | None = None) -> list[int]:
        """Ids of a tube's jobs in `state` whose body holds `pattern` (`how`:
        substr), matches it (regex, RE2 syntax) or whose idempotency key it is
        (key), ascending, after job `after` (smallstalk only, admin; at most
        1000 per call). A search over many jobs takes as long as it takes."""
        return self._run(self._core.search_jobs(tube, pattern, state, how, after, count, server))

    def bulk_jobs(self, tube: str, pattern: bytes | str, action: str, *, state: str = "ready",
                  how: str = "substr", to: str | None = None, max: int = 2**32 - 1,
                  server: str | None = None) -> int:
        """Count, kick, delete or move (`to` a tube) up to `max` of the jobs
        `search_jobs` would find; how many (smallstalk only, admin). Count
        first, then act with that count as `max`."""
        return self._run(self._core.bulk_jobs(tube, pattern, action, state, how, to, max,
                                              server))

    def flush_tube(self, tube: str, *, server: str | None = None) -> int:
        """Delete a tube's ready, delayed and buried jobs; how many (smallstalk only)."""
        return self._run(self._core.flush_tube(tube, server))

    # admin (smallstalk only: the server's admin token, or an address it trusts) ----

    def promote(self, *, server: str | None = None) -> int:
        """Make a replica a primary; its new epoch. NotAReplica if it is not one."""
        return self._run(self._core.promote(server))

    def config(self, *, server: str | None = None) -> str:
        """The server's effective per-tube settings, as YAML (`smallstalk config dump`)."""
        return self._run(self._core.config(server))

    def reload_config(self, *, server: str | None = None) -> None:
        """Re-read the per-tube settings from the server's --config file; NotReloaded
        (its text says why) leaves the old ones in force."""
        self._run(self._core.reload_config(server))

    def ext_stats(self, *, server: str | None = None) -> dict[str, str]:
        """smallstalk's own server statistics (role, replication, storage)."""
        return self._run(self._core.ext_stats(server))

    def ext_stats_tube(self, tube: str, *, server: str | None = None) -> dict[str, str]:
        """smallstalk's own statistics of a tube (expired, discarded, bytes)."""
        return self._run(self._core.ext_stats_tube(tube, server))


# --- the trio client -------------------------------------------------------
