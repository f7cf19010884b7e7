"""`explain-job` through the real mutation loop on trio's mock clock: each
reason the issue lists, checked against a state built for that reason alone
(delayed, paused, jobs ahead, no watcher, every watcher busy, concurrency and
rate limits, back-off, exhausted, buried, reserved, body on disk only)."""

from __future__ import annotations

import trio

from smallstalk.console import views
from smallstalk.core import protocol as p
from smallstalk.core.explain import iso

from ..support.harness import EPOCH, Client
from .test_holdback import configure, settle, started
from .test_readbehind import make_loop as make_spilling_loop
from .test_readbehind import put_many


def reasons(reply: bytes) -> list[str]:
    """The `reasons` list of an explain-job reply, unquoted."""
    assert reply.startswith(b"OK "), reply
    head, _, body = reply.partition(b"\r\n")
    assert int(head.split()[1]) == len(body) - 2  # the OK count is the YAML's length
    out = []
    for line in body.decode().splitlines():
        if line.startswith('- "'):
            out.append(line[3:-1].replace('\\"', '"'))
    return out


def field(reply: bytes, key: str) -> str:
    for line in reply.decode().splitlines():
        if line.startswith(key + ": "):
            return line.split(": ", 1)[1]
    raise KeyError(key)


async def explain(c: Client, jid: int) -> bytes:
    return await c.ask(b"explain-job %d\r\n" % jid)


async def test_unknown_job_and_bad_id(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    assert await explain(c, 9) == p.NOT_FOUND
    assert await c.ask(b"explain-job x\r\n") == p.BAD_FORMAT


async def test_delayed(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    await c.ask(b"put 0 30 60 1\r\na\r\n")
    await trio.sleep(10)
    reply = await explain(c, 1)
    assert field(reply, "state") == "delayed"
    until = EPOCH + 30 * 10**9
    assert reasons(reply) == [f"delayed until {iso(until)} (in 20 s)"]


async def test_tube_paused(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    w = Client(lp)
    await w.ask(b"watch default\r\n")
    await c.ask(b"put 0 0 60 1\r\na\r\n")
    assert await c.ask(b"pause-tube default 100\r\n") == p.PAUSED
    reply = await explain(c, 1)
    assert field(reply, "state") == "ready"
    (r,) = [x for x in reasons(reply) if "paused" in x]
    assert r == f"tube default paused until {iso(EPOCH + 100 * 10**9)} (in 100 s)"


async def test_jobs_ahead_and_watchers(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    for pri in (5, 5, 1, 9):  # ids 1..4: 1, 2 and 3 come before 4; 3 before 1 and 2
        await c.ask(b"put %d 0 60 1\r\na\r\n" % pri)
    assert [x for x in reasons(await explain(c, 4)) if "ahead" in x] == [
        "3 jobs ahead of it in tube default (higher priority or older); "
        "1 connections watch the tube"]
    assert [x for x in reasons(await explain(c, 2)) if "ahead" in x] == [
        "2 jobs ahead of it in tube default (higher priority or older); "
        "1 connections watch the tube"]
    assert not [x for x in reasons(await explain(c, 3)) if "ahead" in x]


async def test_no_connection_watches_the_tube(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    await c.ask(b"use emails\r\n")
    await c.ask(b"put 0 0 60 1\r\na\r\n")
    w = Client(lp)
    await w.ask(b"watch sms\r\n")
    assert reasons(await explain(c, 1)) == [
        "no connection watches tube emails; the tubes watched are: default, sms"]


async def test_every_watcher_busy(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    await c.ask(b"put 0 0 60 1\r\na\r\n")
    await c.ask(b"put 0 0 60 1\r\nb\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    assert reasons(await explain(c, 2)) == [
        "every watcher busy: none of the 1 connections watching tube default is waiting "
        "in a reserve (1 jobs reserved among them)"]


async def test_reserved_by_a_connection_with_ttr_left(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    await c.ask(b"put 0 0 60 1\r\na\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    await trio.sleep(15)
    reply = await explain(Client(lp), 1)
    assert field(reply, "state") == "reserved"
    cid = c.session.id
    assert reasons(reply) == [
        f"reserved by connection {cid} (local) with 45 s of TTR left "
        f"(until {iso(EPOCH + 60 * 10**9)})"]


async def test_concurrency_limit(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, "[tubes.work]\nmax-reserved = 1\n")
    c = Client(lp)
    await c.ask(b"use work\r\n")
    await c.ask(b"watch work\r\n")
    await c.ask(b"put 0 0 60 1\r\na\r\n")
    await c.ask(b"put 0 0 60 1\r\nb\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    assert "tube work at its concurrency limit: 1 reserved (max-reserved 1)" in reasons(
        await explain(c, 2))


async def test_rate_limit(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, '[tubes.work]\nmax-rate = "1/m"\n')
    c = Client(lp)
    await c.ask(b"use work\r\n")
    await c.ask(b"watch work\r\n")
    await c.ask(b"put 0 0 60 1\r\na\r\n")
    await c.ask(b"put 0 0 60 1\r\nb\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    (r,) = [x for x in reasons(await explain(c, 2)) if "rate" in x]
    assert r.startswith("tube work at its rate limit (1 per 60 s): next token at ")
    assert r.endswith("(in 60 s)"), r


async def test_backing_off(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, '[tubes.work]\nrelease-backoff = "5s..60s"\n')
    c = Client(lp)
    await c.ask(b"use work\r\n")
    await c.ask(b"watch work\r\n")
    await c.ask(b"put 0 0 60 1\r\na\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    now = lp.now
    assert await c.ask(b"release 1 0 0\r\n") == p.RELEASED
    reply = await explain(c, 1)
    assert field(reply, "state") == "delayed"
    assert reasons(reply) == [
        f"backing off until {iso(now + 5 * 10**9)} (in 5 s) after 0 timeouts and 1 releases"]


async def test_exhausted_and_plainly_buried(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, "[tubes.work]\nmax-reserves = 1\n")
    c = Client(lp)
    await c.ask(b"use work\r\n")
    await c.ask(b"watch work\r\n")
    await c.ask(b"put 0 0 60 1\r\na\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    assert await c.ask(b"release 1 0 0\r\n") == p.RELEASED
    reply = await explain(c, 1)
    assert field(reply, "state") == "buried"
    assert reasons(reply) == ["buried: exhausted: reserved 1 times (max-reserves 1)"]
    page = await lp.call(views.job, lp, 1, 100)  # the console's job page shows the same
    assert page["reasons"] == ["buried: exhausted: reserved 1 times (max-reserves 1)"]
    await c.ask(b"use default\r\n")
    await c.ask(b"put 0 0 60 1\r\nb\r\n")
    await c.ask(b"reserve-job 2\r\n")
    assert await c.ask(b"bury 2 0\r\n") == p.BURIED
    assert reasons(await explain(c, 2)) == [
        "buried (buried 1 times); `kick-job 2` makes it ready"]


async def test_body_on_disk_only(nursery, tmp_path, autojump_clock) -> None:
    lp = make_spilling_loop(tmp_path, 1000)
    nursery.start_soon(lp.run)
    c = Client(lp)
    jobs = await put_many(c, [bytes([65 + i % 26]) * 400 for i in range(10)])
    await settle()
    spilled = [jid for jid in jobs if isinstance(lp.state.jobs[jid].body, int)]
    assert spilled
    assert ("body on disk only (read-behind): 400 bytes are read back from the log when "
            "it is handed out") in reasons(await explain(c, spilled[-1]))
    in_mem = [jid for jid in jobs if not isinstance(lp.state.jobs[jid].body, int)]
    assert not [x for x in reasons(await explain(c, in_mem[0])) if "disk" in x]
