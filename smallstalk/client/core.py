"""The shared sans-I/O client core: what a client knows (servers, tubes, who is
down) and every command as a generator of exchanges that `Client` and
`AsyncClient` drive over their own I/O (theory in the package docstring)."""

from __future__ import annotations

import math
import random
import time
import zlib
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeAlias, TypeVar

import attrs

from smallstalk.core import protocol as p

from .addresses import normalize_address
from .errors import (
    BeanstalkError,
    CommandError,
    ConnectionFailed,
    Draining,
    InternalError,
    NotConnected,
    NotFound,
    NotIgnored,
    NotReplicated,
    ReadOnly,
    TimedOut,
    UnknownCommand,
)
from .replies import Explanation, Job, JobRef, JobStats, Reply, ServerStats, TubeStats, interpret

DEFAULT_PRIORITY = 2**31
DEFAULT_TTR = 60


def _check_tube(tube: str) -> str:
    # Also what keeps a tube name from injecting a second command line.
    if not isinstance(tube, str) or not p.valid_tube_name(tube.encode("utf-8", "replace")):
        raise ValueError(f"invalid tube name {tube!r} (1-200 of A-Za-z0-9 -+/;.$_(), "
                         "not starting with '-')")
    return tube


def _check_uint(value: int, what: str, limit: int = p.U32_MAX) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise ValueError(f"{what} must be an integer from 0 to {limit}, not {value!r}")
    return value


def _check_state(state: str) -> str:
    if state not in p.LIST_JOBS_STATES:
        raise ValueError(f"state must be one of {', '.join(p.LIST_JOBS_STATES)}")
    return state


def _check_how(how: str) -> str:
    if how not in p.HOWS:
        raise ValueError(f"a search is one of {', '.join(p.HOWS)}, not {how!r}")
    return how


def _check_pattern(pattern: bytes | str) -> bytes:
    data = pattern.encode("utf-8") if isinstance(pattern, str) else bytes(pattern)
    if len(data) > p.PATTERN_MAX:
        raise ValueError(f"a pattern is at most {p.PATTERN_MAX} bytes")
    return data


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not p.valid_key(key.encode("ascii", "replace")):
        raise ValueError(f"an idempotency key is 1 to {p.KEY_MAX} letters, digits or "
                         f"-+/;.$_() characters, not {key!r}")
    return key


def _seconds(timeout: float) -> int:
    """A timeout in whole seconds, rounded up (the protocol counts seconds)."""
    if timeout < 0:
        raise ValueError("timeout must not be negative")
    return min(math.ceil(timeout), 2**31 - 1)


def _body(body: bytes | str) -> bytes:
    if isinstance(body, str):
        return body.encode("utf-8")
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    raise TypeError(f"a job body is bytes or str, not {type(body).__name__}")


# --- the protocol core: every method as a generator of exchanges ----------

_T = TypeVar("_T")


@attrs.frozen
class _Exchange:
    """Send `commands` to server number `server` and hand back one reply each.

    `wait` is how long the server may legitimately take beyond an ordinary
    reply (a reserve's timeout); None means no bound at all.
    """

    server: int
    commands: tuple[p.Command, ...]
    wait: float | None = 0.0


@attrs.frozen
class _Pause:
    """Sleep `seconds` before going on (a keyed put waiting out a failover)."""

    seconds: float


_Op: TypeAlias = Generator[_Exchange | _Pause, list[Reply], _T]
KEY_RETRIES = 8  # rounds over the servers a keyed put makes before it gives up
KEY_PAUSE = 0.25  # seconds before the second round; doubled each round, at most 4 s
JobLike: TypeAlias = JobRef | int


class _Core:
    """What a client knows and how each command is carried out, without I/O."""

    def __init__(self, servers: list[str], poll_interval: float, retry_interval: float,
                 token: str | None = None) -> None:
        self.servers = servers
        self.token = token
        self.index = {s: i for i, s in enumerate(servers)}
        self.poll_interval = max(1.0, poll_interval)
        self.retry_interval = retry_interval
        self.using = "default"
        self.watching = ["default"]
        n = len(servers)
        # What each connection is known to use and watch (None: not connected).
        self._used: list[str | None] = [None] * n
        self._watched: list[list[str] | None] = [None] * n
        self._down_until = [0.0] * n
        self._next_put = random.randrange(n)
        self._next_reserve = random.randrange(n)
        # The servers are one replicated cluster's members (a replica, or an HA
        # member without the leader lock, answered READ_ONLY; or one said so in
        # `ext-stats`): any of them may take a keyed put, which the others know
        # by replication. Until then they are independent servers, and a key
        # goes to its own server only (`_put_keyed`).
        self.replicated = False

    # Driver hooks -----------------------------------------------------------

    def connected(self, i: int) -> None:
        self._used[i] = "default"
        self._watched[i] = ["default"]

    def hello(self) -> list[p.Command]:
        """What a new connection sends before anything else (and gets back in `greeted`)."""
        return [] if self.token is None else [p.Auth(self.token)]

    def greeted(self, i: int, sent: list[p.Command], replies: list[Reply]) -> None:
        """Check the replies to `hello`: the token refused raises Unauthorized."""
        for cmd, reply in zip(sent, replies, strict=True):
            try:
                interpret(cmd, reply, self.servers[i])
            except UnknownCommand:
                raise UnknownCommand(self.servers[i], "this server has no `auth` command "
                                     "(beanstalkd, or an older smallstalk): connect without "
                                     "a token") from None

    def disconnected(self, i: int) -> None:
        self._used[i] = None
        self._watched[i] = None

    def outgoing(self, i: int, commands: Sequence[p.Command]) -> tuple[list[p.Command], int]:
        """The commands to send: first whatever brings the connection to the
        client's used and watched tubes, then `commands`."""
        pre: list[p.Command] = []
        if self._used[i] != self.using:
            pre.append(p.Use(self.using))
        watched = self._watched[i] or []
        pre += [p.Watch(t) for t in self.watching if t not in watched]
        pre += [p.Ignore(t) for t in watched if t not in self.watching]
        return pre + list(commands), len(pre)

    def incoming(self, i: int, sent: list[p.Command], n_pre: int,
                 replies: list[Reply]) -> list[Reply]:
        """Account for the prelude's replies; the rest belong to the exchange."""
        error: BeanstalkError | None = None
        for cmd, reply in zip(sent[:n_pre], replies[:n_pre], strict=True):
            try:
                interpret(cmd, reply, self.servers[i])
            except BeanstalkError as e:
                error = error or e
                continue
            watched = self._watched[i]
            assert watched is not None
            if type(cmd) is p.Use:
                self._used[i] = cmd.tube
            elif type(cmd) is p.Watch:
                watched.append(cmd.tube)
            elif type(cmd) is p.Ignore and cmd.tube in watched:
                watched.remove(cmd.tube)
        if error is not None:
            raise error
        return replies[n_pre:]

    def out_of_step(self, sent: list[p.Command], replies: list[Reply]) -> bool:
        """Did a server that does not know a command with a body (beanstalkd,
        sent put-unique, put-expiring, search-jobs or bulk-jobs) answer
        UNKNOWN_COMMAND? It then reads the body as commands of its own and
        answers those too: the driver drops the connection, whose next reply
        would belong to no command of ours."""
        return any(r.word == b"UNKNOWN_COMMAND" and (hasattr(cmd, "body")
                                                       or hasattr(cmd, "pattern"))
                   for cmd, r in zip(sent, replies, strict=True))

    # Helpers ------------------------------------------------------------------

    @property
    def multi(self) -> bool:
        return len(self.servers) > 1

    def _mark_down(self, i: int) -> None:
        self._down_until[i] = time.monotonic() + self.retry_interval

    def _order(self, start: int) -> list[int]:
        """Every server from `start` round, the ones recently down last."""
        n = len(self.servers)
        ring = [(start + k) % n for k in range(n)]
        now = time.monotonic()
        return ([i for i in ring if self._down_until[i] <= now]
                + [i for i in ring if self._down_until[i] > now])

    def _live(self, start: int = 0) -> list[int]:
        """Servers not recently down (all of them if all are)."""
        now = time.monotonic()
        order = self._order(start)
        live = [i for i in order if self._down_until[i] <= now]
        return live or order

    def locate(self, job: JobLike) -> tuple[int, int]:
        if isinstance(job, JobRef):
            i = self.index.get(job.server)
            if i is None:
                raise ValueError(f"job {job.id} lives on {job.server}, not one of {self.servers}")
            return i, _check_uint(job.id, "job id", p.U64_MAX)
        if self.multi:
            raise ValueError("a bare job id is ambiguous with several servers: "
                             "pass the Job or JobRef (or JobRef(id, server))")
        return 0, _check_uint(job, "job id", p.U64_MAX)

    def _one_server(self, server: str | None) -> int:
        if server is None:
            if self.multi:
                raise ValueError("several servers: say which one with server=")
            return 0
        i = self.index.get(normalize_address(server))
        if i is None:
            raise ValueError(f"{server} is not one of {self.servers}")
        return i

    def _with_tube(self, tube: str | None, cmd: p.Command) -> tuple[tuple[p.Command, ...], int]:
        """`cmd`, or use/cmd/use-back if it is meant for another tube than the used one."""
        if tube is None or tube == self.using:
            return (cmd,), 0
        return (p.Use(_check_tube(tube)), cmd, p.Use(self.using)), 1

    def _results(self, i: int, cmds: tuple[p.Command, ...], at: int,
                 replies: list[Reply]) -> Any:
        for k, (cmd, reply) in enumerate(zip(cmds, replies, strict=True)):
            if k != at:
                interpret(cmd, reply, self.servers[i])
        return interpret(cmds[at], replies[at], self.servers[i])

    def one(self, i: int, cmd: p.Command, wait: float | None = 0.0) -> _Op[Any]:
        replies = yield _Exchange(i, (cmd,), wait)
        return interpret(cmd, replies[0], self.servers[i])

    def _each(self, cmds: tuple[p.Command, ...], at: int) -> _Op[list[tuple[int, Any]]]:
        """Send `cmds` to every reachable server: (server, result or CommandError) each."""
        out: list[tuple[int, Any]] = []
        last: ConnectionFailed | None = None
        for i in range(len(self.servers)):
            try:
                replies = yield _Exchange(i, cmds)
            except ConnectionFailed as e:
                self._mark_down(i)
                last = e
                continue
            try:
                out.append((i, self._results(i, cmds, at, replies) if cmds else None))
            except CommandError as e:
                out.append((i, e))
        if not out:
            assert last is not None
            raise last
        return out

    # Commands -----------------------------------------------------------------

    def put(self, body: bytes | str, priority: int, delay: int, ttr: int, tube: str | None,
            server: str | None, max_age: int = 0, key: str | None = None,
            retries: int = KEY_RETRIES) -> _Op[JobRef]:
        if key is not None:
            if max_age:
                raise ValueError("a keyed put takes no max_age (use the tube's max-age)")
            cmd = p.PutUnique(_check_key(key), _check_uint(priority, "priority"),
                              _check_uint(delay, "delay"), _check_uint(ttr, "ttr"), _body(body))
            cmds, at = self._with_tube(tube, cmd)
            home = self._home(self.using if tube is None else tube, key)
            return (yield from self._put_keyed(cmds, at, server, retries, home))
        cmd = p.Put(_check_uint(priority, "priority"), _check_uint(delay, "delay"),
                    _check_uint(ttr, "ttr"), _body(body), _check_uint(max_age, "max_age"))
        cmds, at = self._with_tube(tube, cmd)
        if server is not None:
            order = [self._one_server(server)]
        else:
            order = self._order(self._next_put)
            self._next_put = (self._next_put + 1) % len(self.servers)
        last: BeanstalkError | None = None
        for i in order:
            try:
                replies = yield _Exchange(i, cmds)
                return self._results(i, cmds, at, replies)
            except NotConnected as e:
                self._mark_down(i)  # nothing was sent: another server may take it
                last = e
            except ReadOnly as e:
                # Not the primary of an HA cluster (or a replica): nothing was
                # logged, so another server may take it; writes keep away from
                # this one until the retry interval passes.
                self._mark_down(i)
                last = e
            except ConnectionFailed:
                # The put may have reached the server: trying again could make a
                # second job. Only a keyed put is retried (docs/CLIENT.md).
                self._mark_down(i)
                raise
            except Draining as e:
                self._mark_down(i)  # it stores nothing more: puts keep away a while
                last = e
        assert last is not None
        raise last

    def _home(self, tube: str, key: str) -> int:
        """The server a key belongs to among independent servers: the same for
        every try of it, from any client that lists that server, in any order
        (rendezvous hashing: the highest of each server's hash of the key, so
        adding or removing a server moves only the keys that it gets or had)."""
        name = f"\0{tube}\0{key}".encode()
        return max(range(len(self.servers)),
                   key=lambda i: zlib.crc32(self.servers[i].encode() + name))

    def _put_keyed(self, cmds: tuple[p.Command, ...], at: int, server: str | None,
                   retries: int, home: int) -> _Op[JobRef]:
        """`put-unique` until a server answers it, `retries` rounds at most.

        A retry cannot make a second job where the key is known: a server
        answers a key it has seen with the first job's id, and a replicated
        cluster's members know each other's keys. So among one cluster's
        members a broken connection, a replica that refuses (READ_ONLY: a
        failover under way), NOT_REPLICATED and INTERNAL_ERROR lead to the next
        member. Independent servers do not know each other's keys: there every
        try goes to the key's own server (`_home`), which a round that could
        not reach it tries again after a pause; the others are asked once
        whether they are a cluster after all (`_learn_replicated`).
        """
        last: BeanstalkError | None = None
        pause = KEY_PAUSE
        learned = False  # this round found the servers replicated: the next one at once
        for round_ in range(max(1, retries)):
            if round_ and not learned:
                yield _Pause(pause)
                pause = min(pause * 2, 4.0)
            learned = False
            if server is not None:
                order = [self._one_server(server)]
            elif self.replicated:
                order = self._order(self._next_put)
                self._next_put = (self._next_put + 1) % len(self.servers)
            else:
                order = [home]
            for i in order:
                try:
                    replies = yield _Exchange(i, cmds)
                    return self._results(i, cmds, at, replies)
                except ConnectionFailed as e:
                    self._mark_down(i)
                    last = e
                except ReadOnly as e:
                    # Only a cluster's member refuses a change so: stored nowhere.
                    learned = learned or not self.replicated
                    self.replicated = True
                    self._mark_down(i)
                    last = e
                except (Draining, NotReplicated, InternalError) as e:
                    last = e
            if (server is None and not self.replicated and self.multi
                    and isinstance(last, ConnectionFailed)):
                found = yield from self._learn_replicated(home)
                learned = learned or found
        assert last is not None
        raise last

    def _learn_replicated(self, home: int) -> _Op[bool]:
        """The key's server cannot be reached: do the others say they are
        replicas (`ext-stats` role)? Then the list is one cluster, and a
        keyed put may go to whichever member takes writes."""
        for i in self._live(home):
            if i == home:
                continue
            try:
                stats = yield from self.one(i, p.EXT_STATS)
            except BeanstalkError:
                continue  # down too, or not smallstalk: no answer either way
            if stats.get("role") == "replica":
                self.replicated = True
                return True
        return False

    def use(self, tube: str) -> _Op[str]:
        self.using = _check_tube(tube)
        yield from self._each((), 0)
        return tube

    def watch(self, tube: str) -> _Op[int]:
        if _check_tube(tube) not in self.watching:
            self.watching.append(tube)
        yield from self._each((), 0)
        return len(self.watching)

    def ignore(self, tube: str) -> _Op[int]:
        _check_tube(tube)
        before = list(self.watching)
        if tube in self.watching:
            self.watching.remove(tube)
        try:
            yield from self._each((), 0)
        except NotIgnored:
            self.watching = before
            raise
        return len(self.watching)

    def set_watching(self, tubes: Sequence[str]) -> None:
        tubes = list(dict.fromkeys(_check_tube(t) for t in tubes))
        if not tubes:
            raise ValueError("watch at least one tube")
        self.watching = tubes

    def reserve(self, timeout: float | None, tubes: Sequence[str] | None) -> _Op[Job]:
        return (yield from self._reserve(p.Reserve, timeout, tubes))

    def reserve_many(self, count: int, timeout: float | None,
                     tubes: Sequence[str] | None) -> _Op[list[Job]]:
        """`reserve-batch`: up to `count` jobs of one server in one round trip."""
        n = _check_uint(count, "count", p.RESERVE_BATCH_MAX)
        if n == 0:
            raise ValueError("count must be at least 1")

        def batch(secs: int | None) -> p.ReserveBatch:
            return p.ReserveBatch(n, 2**31 - 1 if secs is None else secs)
        return (yield from self._reserve(batch, timeout, tubes))

    def _reserve(self, make: Callable[[int | None], p.Command], timeout: float | None,
                 tubes: Sequence[str] | None) -> _Op[Any]:
        """A reserve command made by `make(seconds)`, waited for as `reserve` does."""
        if tubes is not None:
            self.set_watching(tubes)
        if not self.multi:
            secs = None if timeout is None else _seconds(timeout)
            return (yield from self.one(0, make(secs), secs))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            start = self._next_reserve
            self._next_reserve = (start + 1) % len(self.servers)
            reachable = 0
            last: ConnectionFailed | ReadOnly | None = None
            for i in self._live(start):
                try:
                    return (yield from self.one(i, make(0)))
                except TimedOut:
                    reachable += 1
                except (ConnectionFailed, ReadOnly) as e:
                    self._mark_down(i)  # ReadOnly: not the primary of an HA cluster
                    last = e
            if not reachable:
                assert last is not None
                raise last
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimedOut(", ".join(self.servers))
            # Nobody has work: wait on one server for a slice, then poll again.
            i = self._live(start)[0]
            secs = _seconds(self.poll_interval if left is None else min(self.poll_interval, left))
            try:
                return (yield from self.one(i, make(secs), secs))
            except TimedOut:
                pass
            except (ConnectionFailed, ReadOnly):
                self._mark_down(i)

    def reserve_job(self, job: JobLike) -> _Op[Job]:
        i, jid = self.locate(job)
        return (yield from self.one(i, p.ReserveJob(jid)))

    def delete(self, job: JobLike) -> _Op[None]:
        i, jid = self.locate(job)
        yield from self.one(i, p.Delete(jid))

    def delete_many(self, jobs: Sequence[JobLike]) -> _Op[list[JobLike]]:
        """Delete `jobs` pipelined: one write per server holding some of them.
        Returns those answered NOT_FOUND; any other error is raised."""
        by_server: dict[int, list[tuple[JobLike, int]]] = {}
        for job in jobs:
            i, jid = self.locate(job)
            by_server.setdefault(i, []).append((job, jid))
        missing: list[JobLike] = []
        for i, items in by_server.items():
            cmds = tuple(p.Delete(jid) for _, jid in items)
            replies = yield _Exchange(i, cmds)
            for (job, _), cmd, reply in zip(items, cmds, replies, strict=True):
                try:
                    interpret(cmd, reply, self.servers[i])
                except NotFound:
                    missing.append(job)
        return missing

    def _priority(self, i: int, jid: int, priority: int | None) -> _Op[int]:
        if priority is None:
            stats = yield from self.one(i, p.StatsJob(jid))
            return stats.pri
        return _check_uint(priority, "priority")

    def release(self, job: JobLike, priority: int | None, delay: int) -> _Op[None]:
        i, jid = self.locate(job)
        pri = yield from self._priority(i, jid, priority)
        yield from self.one(i, p.Release(jid, pri, _check_uint(delay, "delay")))

    def bury(self, job: JobLike, priority: int | None) -> _Op[None]:
        i, jid = self.locate(job)
        pri = yield from self._priority(i, jid, priority)
        yield from self.one(i, p.Bury(jid, pri))

    def touch(self, job: JobLike) -> _Op[None]:
        i, jid = self.locate(job)
        yield from self.one(i, p.Touch(jid))

    def peek(self, job: JobLike) -> _Op[Job]:
        i, jid = self.locate(job)
        return (yield from self.one(i, p.Peek(jid)))

    def peek_first(self, cmd: p.Command, tube: str | None) -> _Op[Job]:
        """peek-ready/-delayed/-buried: the first server (in order) that has one."""
        cmds, at = self._with_tube(tube, cmd)
        for _, result in (yield from self._each(cmds, at)):
            if isinstance(result, Job):
                return result
            if not isinstance(result, NotFound):
                raise result
        raise NotFound(", ".join(self.servers))

    def kick(self, bound: int, tube: str | None) -> _Op[int]:
        """Up to `bound` jobs in all, server after server."""
        left = _check_uint(bound, "bound")
        total = 0
        reached = 0
        last: ConnectionFailed | None = None
        for i in range(len(self.servers)):
            if left == 0:
                break
            cmds, at = self._with_tube(tube, p.Kick(left))
            try:
                replies = yield _Exchange(i, cmds)
            except ConnectionFailed as e:
                self._mark_down(i)
                last = e
                continue
            reached += 1
            kicked = self._results(i, cmds, at, replies)
            total += kicked
            left -= kicked
        if not reached and last is not None:
            raise last
        return total

    def kick_job(self, job: JobLike) -> _Op[None]:
        i, jid = self.locate(job)
        yield from self.one(i, p.KickJob(jid))

    def stats_job(self, job: JobLike) -> _Op[JobStats]:
        i, jid = self.locate(job)
        return (yield from self.one(i, p.StatsJob(jid)))

    def move_job(self, job: JobLike, tube: str) -> _Op[None]:
        i, jid = self.locate(job)
        yield from self.one(i, p.MoveJob(jid, _check_tube(tube)))

    def explain(self, job: JobLike) -> _Op[Explanation]:
        i, jid = self.locate(job)
        return (yield from self.one(i, p.ExplainJob(jid)))

    def stats_tube(self, tube: str, server: str | None) -> _Op[TubeStats]:
        return (yield from self.one(self._one_server(server), p.StatsTube(_check_tube(tube))))

    def stats(self, server: str | None) -> _Op[ServerStats]:
        return (yield from self.one(self._one_server(server), p.STATS))

    def list_tubes(self) -> _Op[list[str]]:
        names: dict[str, None] = {}
        for _, result in (yield from self._each((p.LIST_TUBES,), 0)):
            if isinstance(result, Exception):
                raise result
            names.update(dict.fromkeys(result))
        return list(names)

    def first_reachable(self, cmd: p.Command) -> _Op[Any]:
        last: ConnectionFailed | None = None
        for i in self._live():
            try:
                return (yield from self.one(i, cmd))
            except ConnectionFailed as e:
                self._mark_down(i)
                last = e
        assert last is not None
        raise last

    def pause_tube(self, tube: str, delay: int) -> _Op[None]:
        cmd = p.PauseTube(_check_tube(tube), _check_uint(delay, "delay"))
        yield from self._on_every_server_that_has_it(cmd)

    def delete_tube(self, tube: str) -> _Op[None]:
        yield from self._on_every_server_that_has_it(p.DeleteTube(_check_tube(tube)))

    def list_jobs(self, tube: str, state: str, after: int, count: int,
                  server: str | None) -> _Op[list[int]]:
        if state not in p.LIST_JOBS_STATES:
            raise ValueError(f"state must be one of {', '.join(p.LIST_JOBS_STATES)}")
        cmd = p.ListJobs(_check_tube(tube), state, _check_uint(after, "after", p.U64_MAX),
                         _check_uint(count, "count"))
        return (yield from self.one(self._one_server(server), cmd))

    def search_jobs(self, tube: str, pattern: bytes | str, state: str, how: str, after: int,
                    count: int, server: str | None) -> _Op[list[int]]:
        cmd = p.SearchJobs(_check_tube(tube), _check_state(state), _check_how(how),
                           _check_uint(after, "after", p.U64_MAX), _check_uint(count, "count"),
                           _check_pattern(pattern))
        # A search over many jobs runs in slices: its answer has no time bound.
        return (yield from self.one(self._one_server(server), cmd, None))

    def bulk_jobs(self, tube: str, pattern: bytes | str, action: str, state: str, how: str,
                  to: str | None, bound: int, server: str | None) -> _Op[int]:
        if action not in p.ACTIONS:
            raise ValueError(f"action must be one of {', '.join(p.ACTIONS)}")
        if (action == "move") != (to is not None):
            raise ValueError("a move names the tube it moves to (to=...), nothing else does")
        cmd = p.BulkJobs(_check_tube(tube), _check_state(state), _check_how(how), action,
                         "" if to is None else _check_tube(to), _check_uint(bound, "max"),
                         _check_pattern(pattern))
        return (yield from self.one(self._one_server(server), cmd, None))

    def flush_tube(self, tube: str, server: str | None) -> _Op[int]:
        return (yield from self.one(self._one_server(server), p.FlushTube(_check_tube(tube))))

    # The admin commands (smallstalk only): one server each, the client's token first.

    def promote(self, server: str | None) -> _Op[int]:
        """`promote`: the replica's new epoch (NotAReplica if it is none)."""
        return (yield from self.one(self._one_server(server), p.PROMOTE))

    def config(self, server: str | None) -> _Op[str]:
        """`config`: the effective per-tube settings, as YAML text."""
        return (yield from self.one(self._one_server(server), p.CONFIG))

    def reload_config(self, server: str | None) -> _Op[None]:
        """`reload-config` (NotReloaded, saying why, if the file is refused)."""
        yield from self.one(self._one_server(server), p.RELOAD_CONFIG)

    def ext_stats(self, server: str | None) -> _Op[dict[str, str]]:
        return (yield from self.one(self._one_server(server), p.EXT_STATS))

    def ext_stats_tube(self, tube: str, server: str | None) -> _Op[dict[str, str]]:
        return (yield from self.one(self._one_server(server), p.ExtStatsTube(_check_tube(tube))))

    def _on_every_server_that_has_it(self, cmd: p.Command) -> _Op[None]:
        results = [r for _, r in (yield from self._each((cmd,), 0))]
        if all(isinstance(r, NotFound) for r in results):
            raise results[0]
        for r in results:
            if isinstance(r, Exception) and not isinstance(r, NotFound):
                raise r

    def connect(self) -> _Op[None]:
        yield from self._each((), 0)


