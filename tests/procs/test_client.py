"""smallstalk.client against real server processes: every case runs against smallstalk
and against beanstalkd 1.12, with the synchronous and the trio client alike.

Cases that need the same code for both clients are written once as async
scenarios that await `aw(client.method(...))`: for the synchronous client
the call has already happened and `aw` just hands the result back.
Waits are bounded; tubes are unique per test so tests can share servers.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio

from smallstalk.client import (
    AsyncClient,
    Client,
    ConnectionFailed,
    DeadlineSoon,
    Draining,
    Job,
    JobRef,
    JobTooBig,
    NotFound,
    NotIgnored,
    OutOfMemory,
    ReadTimeout,
    ServerStats,
    TimedOut,
    TubeStats,
    UnknownCommand,
)

from ..support.procs import (
    SERVER_KINDS,
    Server,
    beanstalkd_path,
    free_port,
    start_beanstalkd,
    start_smallstalk,
)


def start(kind: str, tmp) -> Server:
    return start_smallstalk(tmp) if kind == "smallstalk" else start_beanstalkd(tmp)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[dict[str, Server]]:
    """One smallstalk and one beanstalkd for the whole module (started on demand)."""
    started: dict[str, Server] = {}

    class Lazy(dict):
        def __missing__(self, kind: str) -> Server:
            self[kind] = started[kind] = start(kind, tmp_path_factory.mktemp(kind))
            return self[kind]

    yield Lazy()
    for srv in started.values():
        srv.stop()


@pytest.fixture(params=SERVER_KINDS)
def addr(request, shared) -> str:
    return f"127.0.0.1:{shared[request.param].port}"


@pytest.fixture
def tube(request) -> str:
    return "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[:150]


async def aw(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def run_with(kind: str, addr: str | list[str], scenario: Callable[..., Any], *args: Any,
             **kw: Any) -> None:
    """Run an async scenario with a sync or a trio client on `addr`."""

    async def main() -> None:
        if kind == "sync":
            with Client(addr, **kw) as c:
                await scenario(c, *args)
        else:
            async with AsyncClient(addr, **kw) as c:
                await scenario(c, *args)

    trio.run(main)


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


CLIENT_KINDS = ["sync", "trio"]


def drain(srv: Server) -> None:
    """SIGUSR1, once the server answers commands (before that its handler may be missing)."""
    with Client(f"127.0.0.1:{srv.port}") as probe:
        probe.stats()
        os.kill(srv.pid, signal.SIGUSR1)
        wait_until(lambda: probe.stats().draining, what="drain mode")


# --- every command, both clients, both servers -------------------------------


async def every_command(c: Any, tube: str) -> None:
    server = c.servers[0]
    assert await aw(c.use(tube)) == tube
    assert await aw(c.list_tube_used()) == tube
    one = await aw(c.put(b"one", priority=10, ttr=30))
    assert one.server == server and isinstance(one, JobRef)
    two = await aw(c.put("two", priority=5, delay=100))
    assert await aw(c.watch(tube)) == 2
    assert await aw(c.ignore("default")) == 1
    assert await aw(c.list_tubes_watched()) == [tube]
    assert tube in await aw(c.list_tubes())
    assert await aw(c.peek_ready()) == Job(one.id, server, b"one")
    assert (await aw(c.peek_delayed())).id == two.id
    ts = await aw(c.stats_tube(tube))
    assert isinstance(ts, TubeStats)
    assert (ts.name, ts.current_jobs_ready, ts.current_jobs_delayed, ts.total_jobs) == (
        tube, 1, 1, 2)

    job = await aw(c.reserve(timeout=0))
    assert job == Job(one.id, server, b"one")
    js = await aw(c.stats_job(job))
    assert (js.state, js.pri, js.ttr, js.tube, js.reserves) == ("reserved", 10, 30, tube, 1)
    await aw(c.touch(job))
    await aw(c.release(job))  # keeps its priority
    js = await aw(c.stats_job(one))
    assert (js.state, js.pri, js.releases) == ("ready", 10, 1)

    job = await aw(c.reserve(timeout=1, tubes=[tube]))
    await aw(c.bury(job, priority=7))
    assert (await aw(c.peek_buried())).id == one.id
    assert (await aw(c.stats_job(one))).state == "buried"
    assert await aw(c.kick(10)) == 1
    assert (await aw(c.stats_job(one))).pri == 7
    await aw(c.kick_job(two))  # delayed -> ready
    assert (await aw(c.stats_job(two))).state == "ready"
    got = await aw(c.reserve_job(two))
    assert got.body == b"two"
    await aw(c.delete(got))
    await aw(c.delete(one))
    with pytest.raises(NotFound):
        await aw(c.peek(one))

    await aw(c.pause_tube(tube, 60))
    assert (await aw(c.stats_tube(tube))).pause == 60
    await aw(c.pause_tube(tube, 0))
    stats = await aw(c.stats())
    assert isinstance(stats, ServerStats)
    assert stats.version.startswith("1.12") and stats.cmd_put >= 2
    assert stats.current_connections >= 1 and stats.max_job_size == 65535


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_every_command(kind: str, addr: str, tube: str) -> None:
    run_with(kind, addr, every_command, tube)


async def error_replies(c: Any, tube: str) -> None:
    missing = JobRef(2**63, c.servers[0])
    for call in (c.delete, c.touch, c.peek, c.stats_job, c.kick_job, c.reserve_job):
        with pytest.raises(NotFound):
            await aw(call(missing))
    with pytest.raises(NotFound):
        await aw(c.release(missing, priority=1))
    with pytest.raises(NotFound):
        await aw(c.bury(missing, priority=1))
    with pytest.raises(NotFound):
        await aw(c.stats_tube(tube + "-none"))
    with pytest.raises(NotFound):
        await aw(c.pause_tube(tube + "-none", 1))
    with pytest.raises(NotFound):
        await aw(c.peek_ready(tube=tube))
    with pytest.raises(NotIgnored):
        await aw(c.ignore("default"))
    assert await aw(c.list_tubes_watched()) == ["default"]  # still watched
    await aw(c.watch(tube))
    with pytest.raises(TimedOut):
        await aw(c.reserve(timeout=0, tubes=[tube]))
    with pytest.raises(JobTooBig):
        await aw(c.put(b"x" * 65536, tube=tube))
    # A reserved job in the last second of its TTR: reserve answers DEADLINE_SOON.
    await aw(c.put(b"soon", ttr=1, tube=tube))
    job = await aw(c.reserve(timeout=0))
    with pytest.raises(DeadlineSoon):
        await aw(c.reserve(timeout=5))
    await aw(c.delete(job))


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_error_replies(kind: str, addr: str, tube: str) -> None:
    run_with(kind, addr, error_replies, tube)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_beanstalkd_refusing_a_command_with_a_body_leaves_the_client_in_step(
        kind: str, shared, tube: str) -> None:
    """beanstalkd answers smallstalk's put-unique, put-expiring and search-jobs
    UNKNOWN_COMMAND, then reads their body as a command and answers that too:
    the client drops the connection, and the next call gets its own reply."""
    if beanstalkd_path() is None:
        pytest.skip("needs beanstalkd")
    addr = f"127.0.0.1:{shared['beanstalkd'].port}"

    async def scenario(c: Any) -> None:
        await aw(c.use(tube))
        for refused in (lambda: c.put(b"keyed", key="k-1"),
                        lambda: c.put(b"short", max_age=5),
                        lambda: c.search_jobs(tube, b"x")):
            with pytest.raises(UnknownCommand):
                await aw(refused())
            ref = await aw(c.put(b"after"))  # its own INSERTED, in the tube it uses
            assert (await aw(c.peek(ref))).body == b"after"
            assert (await aw(c.stats_job(ref))).tube == tube
            await aw(c.delete(ref))

    run_with(kind, addr, scenario)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
@pytest.mark.parametrize("server_kind", SERVER_KINDS)
def test_draining(kind: str, server_kind: str, tmp_path) -> None:
    srv = start(server_kind, tmp_path)
    try:
        addr = f"127.0.0.1:{srv.port}"
        drain(srv)

        async def scenario(c: Any) -> None:
            with pytest.raises(Draining):
                await aw(c.put(b"x"))

        run_with(kind, addr, scenario)
    finally:
        srv.stop()


# --- connections: timeouts, failures, context managers ---------------------


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_read_timeout(kind: str, silent_server: str) -> None:
    async def scenario(c: Any) -> None:
        started = time.monotonic()
        with pytest.raises(ReadTimeout) as info:
            await aw(c.stats())
        assert 0.2 <= time.monotonic() - started < 3
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, ConnectionFailed)
        # A reserve may take its own timeout on top of the read timeout.
        started = time.monotonic()
        with pytest.raises(ReadTimeout):
            await aw(c.reserve(timeout=1))
        assert 1.2 <= time.monotonic() - started < 4

    run_with(kind, silent_server, scenario, read_timeout=0.3)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_connection_refused(kind: str) -> None:
    async def scenario(c: Any) -> None:
        with pytest.raises(ConnectionFailed):
            await aw(c.put(b"x"))

    run_with(kind, f"127.0.0.1:{free_port()}", scenario, connect_timeout=2)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
@pytest.mark.parametrize("server_kind", SERVER_KINDS)
def test_reconnects_with_its_tubes_after_a_restart(kind: str, server_kind: str,
                                                   tmp_path) -> None:
    srv = start(server_kind, tmp_path)
    port = srv.port

    async def scenario(c: Any) -> None:
        nonlocal srv
        await aw(c.use("after"))
        await aw(c.watch("after"))
        await aw(c.ignore("default"))
        srv.stop()
        srv = start_smallstalk(tmp_path, port=port) if server_kind == "smallstalk" else \
            start_beanstalkd(tmp_path, port=port)
        with pytest.raises(ConnectionFailed):
            await aw(c.list_tube_used())  # the old connection is gone
        # The next call reconnects and restores the used and watched tubes.
        ref = await aw(c.put(b"again"))
        assert await aw(c.list_tube_used()) == "after"
        assert await aw(c.list_tubes_watched()) == ["after"]
        assert (await aw(c.reserve(timeout=0))).id == ref.id

    try:
        run_with(kind, f"127.0.0.1:{port}", scenario)
    finally:
        srv.stop()


@pytest.mark.parametrize("server_kind", SERVER_KINDS)
def test_context_managers_give_reserved_jobs_back(server_kind: str, shared, tube: str) -> None:
    addr = f"127.0.0.1:{shared[server_kind].port}"
    with Client(addr) as c:
        ref = c.put(b"x", tube=tube)
        assert c.reserve(timeout=0, tubes=[tube]).id == ref.id
    with Client(addr) as other:
        wait_until(lambda: other.stats_job(ref).state == "ready", what="release on close")

    async def trio_side() -> None:
        async with AsyncClient(addr) as c:
            assert (await c.reserve(timeout=0, tubes=[tube])).id == ref.id

    trio.run(trio_side)
    with Client(addr) as other:
        wait_until(lambda: other.stats_job(ref).state == "ready", what="release on aclose")
        other.delete(ref)


@pytest.mark.parametrize("server_kind", SERVER_KINDS)
def test_cancelled_trio_call_drops_its_connection(server_kind: str, shared, tube: str) -> None:
    """A reserve cancelled while waiting leaves the stream out of step: the
    client drops that connection, so the server releases what it held."""
    addr = f"127.0.0.1:{shared[server_kind].port}"

    async def scenario() -> None:
        async with AsyncClient(addr) as c:
            ref = await c.put(b"held", tube=tube)
            assert (await c.reserve(timeout=0, tubes=[tube])).id == ref.id
            with trio.move_on_after(0.3) as scope:
                await c.reserve()  # nothing else to reserve: waits
            assert scope.cancelled_caught
            async with AsyncClient(addr) as other:
                with trio.fail_after(10):
                    while (await other.stats_job(ref)).state != "ready":
                        await trio.sleep(0.02)
            # And the client goes on with a new connection.
            again = await c.reserve(timeout=0)
            assert again.id == ref.id
            await c.delete(again)

    trio.run(scenario)


# --- several servers -----------------------------------------------------------


@pytest.fixture
def pair(shared) -> list[str]:
    """Two independent servers: a smallstalk and a beanstalkd."""
    if beanstalkd_path() is None:
        pytest.skip("needs beanstalkd")
    return [f"127.0.0.1:{shared[kind].port}" for kind in ("smallstalk", "beanstalkd")]


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_several_servers_spread_puts_and_reserve_everything(kind: str, pair: list[str],
                                                            tube: str) -> None:
    async def scenario(c: Any) -> None:
        refs = [await aw(c.put(b"%d" % n, tube=tube)) for n in range(10)]
        assert {r.server for r in refs} == set(pair)
        for server in pair:  # round-robin: five each
            assert (await aw(c.stats_tube(tube, server=server))).current_jobs_ready == 5
        assert (await aw(c.peek_ready(tube=tube))).server == pair[0]  # the first that has one
        await aw(c.pause_tube(tube, 0))  # on both
        await aw(c.watch(tube))
        await aw(c.ignore("default"))
        got = []
        for _ in range(10):
            job = await aw(c.reserve(timeout=0))
            await aw(c.delete(job))  # goes to the job's own server
            got.append((job.server, job.id))
        assert sorted(got) == sorted((r.server, r.id) for r in refs)
        started = time.monotonic()
        with pytest.raises(TimedOut):
            await aw(c.reserve(timeout=1))
        assert time.monotonic() - started < 4
        with pytest.raises(ValueError):
            await aw(c.delete(refs[0].id))  # a bare id names no server
        with pytest.raises(ValueError):
            await aw(c.stats())  # which one?
        assert tube in await aw(c.list_tubes())

    run_with(kind, pair, scenario)


def test_several_servers_blocking_reserve_finds_work_anywhere(pair: list[str],
                                                              tube: str) -> None:
    """A reserve without timeout waits on one server at a time and still picks
    up a job that arrives on the other one."""

    def consume(got: list[Job], errors: list[BaseException]) -> None:
        try:
            with Client(pair, poll_interval=1) as c:
                got.append(c.reserve(tubes=[tube]))
                c.delete(got[0])
        except BaseException as e:  # reported below
            errors.append(e)

    for server in pair:
        got: list[Job] = []
        errors: list[BaseException] = []
        thread = threading.Thread(target=consume, args=(got, errors), daemon=True)
        thread.start()
        with Client(server) as producer:
            ref = producer.put(b"late", tube=tube)
        thread.join(timeout=5)
        assert not thread.is_alive() and not errors, errors
        assert (got[0].server, got[0].id) == (ref.server, ref.id)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_several_servers_survive_a_dead_or_draining_one(kind: str, shared, tube: str,
                                                       tmp_path, request) -> None:
    live = f"127.0.0.1:{shared['smallstalk'].port}"
    starter = start_beanstalkd if beanstalkd_path() else start_smallstalk
    dead = starter(tmp_path)
    request.addfinalizer(dead.kill)
    draining = starter(tmp_path)
    request.addfinalizer(draining.kill)
    drain(draining)
    dead_addr = f"127.0.0.1:{dead.port}"
    drain_addr = f"127.0.0.1:{draining.port}"

    async def scenario(c: Any) -> None:
        await aw(c.connect())
        dead.kill()
        refs, broken = [], 0
        while len(refs) < 6:
            try:
                refs.append(await aw(c.put(b"x", tube=tube)))
            except ConnectionFailed:
                # The open connection to the dead server broke under a put: it may
                # have been stored, so a put without a key is not sent twice.
                broken += 1
        assert broken <= 1
        assert {r.server for r in refs} == {live}
        for _ in refs:
            await aw(c.delete(await aw(c.reserve(timeout=0, tubes=[tube]))))

    run_with(kind, [dead_addr, live, drain_addr], scenario)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_a_key_goes_to_one_of_several_independent_servers(kind: str, tmp_path, tube: str,
                                                          request) -> None:
    """Independent servers do not know each other's keys: every try of a key
    goes to the key's own server, the same for every client with the list;
    while that one cannot answer, the put fails rather than make a second job
    on another server."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = start_smallstalk(tmp_path / "a"), start_smallstalk(tmp_path / "b")
    for srv in (a, b):
        request.addfinalizer(srv.kill)
    addrs = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
    home_of = {}

    async def scenario(c: Any) -> None:
        for n in range(8):  # keys spread over both servers; each key's tries agree
            refs = [await aw(c.put(b"charge %d" % n, tube=tube, key=f"order-{n}"))
                    for _ in range(4)]
            assert len(set(refs)) == 1, refs
            home_of[n] = refs[0]
        assert {r.server for r in home_of.values()} == set(addrs)
        for server in addrs:  # one job a key, on its server alone
            stats = await aw(c.stats_tube(tube, server=server))
            assert stats.current_jobs_ready == sum(r.server == server
                                                   for r in home_of.values())

    run_with(kind, addrs, scenario)
    if kind != "sync":
        return  # the rest is the core's, which both clients share
    # The key's server stops answering: the put fails once its rounds are
    # over, and the other server gets nothing; once it answers again, the
    # same job.
    ref = home_of[0]
    home = a if ref.server == addrs[0] else b
    other = addrs[1] if ref.server == addrs[0] else addrs[0]
    os.kill(home.pid, signal.SIGSTOP)
    try:
        with Client(addrs, read_timeout=0.5, connect_timeout=0.5) as c:
            with pytest.raises(ConnectionFailed):
                c.put(b"charge 0", tube=tube, key="order-0", rounds=3)
            assert c.stats_tube(tube, server=other).current_jobs_ready == \
                sum(r.server == other for r in home_of.values())
    finally:
        os.kill(home.pid, signal.SIGCONT)
    with Client(list(reversed(addrs))) as c:  # another list order: the same server
        assert c.put(b"charge 0", tube=tube, key="order-0") == ref


async def smallstalk_extensions(c: Any, tube: str) -> None:
    """max_age, a full tube's OutOfMemory, and delete_tube: smallstalk's own."""
    job = await aw(c.put(b"short-lived", max_age=1, tube=tube))
    assert (await aw(c.peek(job))).body == b"short-lived"
    await aw(c.put(b"one", tube="full"))
    with pytest.raises(OutOfMemory):
        await aw(c.put(b"two", tube="full"))
    await aw(c.watch(tube + "+copy"))  # a fanout tube of `tube`
    parent = await aw(c.put(b"fan", tube=tube))
    copy = JobRef(parent.id + 1, parent.server)
    assert (await aw(c.stats_job(copy))).tube == tube + "+copy"
    await aw(c.delete_tube(tube + "+copy"))
    with pytest.raises(NotFound):
        await aw(c.delete_tube(tube + "+copy"))
    with trio.fail_after(10):  # expires 1 s after its put: poll with a generous bound
        while True:
            try:
                await aw(c.peek(job))
            except NotFound:
                break
            await trio.sleep(0.05)


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_smallstalk_extensions(kind: str, tmp_path, tube: str) -> None:
    cfg = tmp_path / "smallstalk.toml"
    cfg.write_text('[tubes.full]\nmax-jobs = 1\n')
    srv = start_smallstalk(tmp_path, "--config", str(cfg))
    try:
        run_with(kind, f"127.0.0.1:{srv.port}", smallstalk_extensions, tube)
    finally:
        srv.stop()
