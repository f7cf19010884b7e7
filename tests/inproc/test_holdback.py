"""Tube policies that hold jobs back, through the real mutation loop on trio's
mock clock: attempt limits (bury with a reason, dead-letter), back-off after a
timeout and a release, concurrency (max-reserved) and rate (max-rate) limits,
each also across a reload. Every scenario checks that the data directory
replays, and a replica fed the primary's records reaches, the same state.
"""

from __future__ import annotations

from pathlib import Path

import trio

from smallstalk.console import views
from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.state import NS
from smallstalk.ops.dump import details
from smallstalk.ops.job_history import job_history
from smallstalk.server.loop import MutationLoop
from smallstalk.storage import aof, logread, snapshot_codec

from ..support.harness import EPOCH, Client, make_loop
from .test_tube_policies import assert_replays, stat


async def configure(lp: MutationLoop, tmp_path: Path, text: str) -> None:
    """Load `text` as the loop's configuration file, as a reload does."""
    path = tmp_path / "smallstalk.toml"
    path.write_text(text)
    lp.config_path = path
    err = await lp.call(lp.reload_config)
    assert err is None, err


async def started(nursery, tmp_path: Path) -> MutationLoop:
    lp = make_loop(tmp_path)
    lp.extended_stats = True
    nursery.start_soon(lp.run)
    return lp


async def assert_replica_agrees(lp: MutationLoop, data_dir: Path, nursery) -> None:
    """A replica fed every record of the primary's log has the primary's state."""
    replica = make_loop(data_dir.parent / (data_dir.name + "-replica"))
    replica.read_only = replica.role = "replica"
    nursery.start_soon(replica.run)
    records = []
    for _first, path in aof.list_segments(data_dir / "aof"):
        records += [e[1] for e in logread.iter_segment(path) if not isinstance(e, aof.FrameScan)]
    await replica.call(replica.apply_replicated, records)
    replica.state.check()
    live = [x for x in snapshot_codec.dump(lp.state) if x[0] != "conn"]
    assert [x for x in snapshot_codec.dump(replica.state) if x[0] != "conn"] == live


async def settle() -> None:
    """Let the loop run the turns that are due now."""
    for _ in range(5):
        await trio.sleep(0)
    await trio.sleep(0.001)


def records_of(data_dir: Path, cls: type) -> list:
    out = []
    for _first, path in aof.list_segments(data_dir / "aof"):
        out += [e[1] for e in logread.iter_segment(path)
                if not isinstance(e, aof.FrameScan) and isinstance(e[1], cls)]
    return out


# --- attempt limits ------------------------------------------------------------------


async def test_max_timeouts_buries_with_the_reason(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, "[tubes.work]\nmax-timeouts = 2\n")
    c = Client(lp)
    await c.ask(b"use work\r\n")
    await c.ask(b"watch work\r\n")
    assert await c.ask(b"put 0 0 1 3\r\nabc\r\n") == b"INSERTED 1\r\n"
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    await trio.sleep(2.5)  # the first timeout: ready again, as beanstalkd does
    info = await c.ask(b"stats-job 1\r\n")
    assert stat(info, "state") == "ready" and stat(info, "timeouts") == "1"
    assert stat(info, "held-back") == '""'
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    await trio.sleep(2.5)  # the second: the limit, so buried
    info = await c.ask(b"stats-job 1\r\n")
    assert stat(info, "state") == "buried" and stat(info, "timeouts") == "2"
    assert stat(info, "held-back") == '"exhausted: TTR ran out 2 times (max-timeouts 2)"'
    assert await c.ask(b"reserve-with-timeout 0\r\n") == p.TIMED_OUT
    page = await lp.call(views.job, lp, 1, 100)  # the console's job page
    assert page["stats"]["held-back"] == "exhausted: TTR ran out 2 times (max-timeouts 2)"
    ext = await c.ask(b"ext-stats-tube work\r\n")
    assert stat(ext, "jobs-exhausted") == "1"
    (req,) = records_of(tmp_path, r.Requeue)
    assert req.cause == r.REQUEUE_TIMEOUT and req.outcomes[0][2:] == (
        "", "exhausted: TTR ran out 2 times (max-timeouts 2)")
    assert len(records_of(tmp_path, r.Timeout)) == 1  # the first timeout: no policy needed
    # A kick gives it another go, and takes the reason away.
    await c.ask(b"kick-job 1\r\n")
    assert stat(await c.ask(b"stats-job 1\r\n"), "held-back") == '""'
    # The replay tools tell it: job-history's steps, aof dump's line.
    steps = [(s.event, s.state, s.text) for s in job_history(tmp_path, 1).steps]
    assert ("timeout", "buried",
            f"TTR (1s) ran out: conn {c.id} lost it; exhausted: TTR ran out 2 times "
            "(max-timeouts 2): buried") in steps
    assert details(req) == "timeout  1 exhausted: TTR ran out 2 times (max-timeouts 2): buried"
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


async def test_max_reserves_dead_letters_keeping_id_and_stats(nursery, tmp_path,
                                                              autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, '[tubes.work]\nmax-reserves = 3\ndead-letter = "work-dead"\n')
    c = Client(lp)
    await c.ask(b"use work\r\n")
    await c.ask(b"watch work\r\n")
    await c.ask(b"put 5 0 60 1\r\nx\r\n")
    for _ in range(3):
        assert (await c.ask(b"reserve-with-timeout 0\r\n")).startswith(b"RESERVED 1 ")
        assert await c.ask(b"release 1 7 0\r\n") == p.RELEASED
    assert await c.ask(b"reserve-with-timeout 0\r\n") == p.TIMED_OUT
    info = await c.ask(b"stats-job 1\r\n")
    assert stat(info, "tube") == "work-dead" and stat(info, "state") == "ready"
    assert stat(info, "reserves") == "3" and stat(info, "releases") == "3"
    assert stat(info, "pri") == "7"
    assert "max-reserves 3" in stat(info, "held-back") and "moved from work" in stat(
        info, "held-back")
    assert stat(await c.ask(b"ext-stats-tube work\r\n"), "jobs-dead-lettered") == "1"
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


async def test_a_worker_that_dies_on_the_job_each_time(nursery, tmp_path, autojump_clock) -> None:
    """max-reserves also stops a job whose worker's connection closes holding it."""
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, "[tubes.default]\nmax-reserves = 2\n")
    c = Client(lp)
    await c.ask(b"put 0 0 60 1\r\nx\r\n")
    for _ in range(2):
        w = Client(lp)
        assert (await w.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
        w.close()
        await settle()
    info = await c.ask(b"stats-job 1\r\n")
    assert stat(info, "state") == "buried"
    assert stat(info, "held-back") == '"exhausted: reserved 2 times (max-reserves 2)"'
    (req,) = records_of(tmp_path, r.Requeue)
    assert req.cause == r.REQUEUE_DISCONNECT
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


# --- back-off ------------------------------------------------------------------------


async def test_timeout_backoff_doubles_up_to_the_cap(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, '[tubes.default]\ntimeout-backoff = "5s..15s"\n')
    c, w = Client(lp), Client(lp)
    await c.ask(b"put 0 0 1 1\r\nx\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    waits = []
    for holder in (w, c, w, c):
        t0 = trio.current_time()
        assert (await holder.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")  # waits it out
        waits.append(trio.current_time() - t0)
    # TTR 1 s runs out strictly after its deadline, then 5, 10, 15 (cap), 15 s.
    assert [round(w) for w in waits] == [1 + 5, 1 + 10, 1 + 15, 1 + 15], waits
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


async def test_backing_off_is_visible_and_replays(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, '[tubes.default]\ntimeout-backoff = "30s..10m"\n')
    c = Client(lp)
    await c.ask(b"put 0 0 1 1\r\nx\r\n")
    await c.ask(b"reserve\r\n")
    await trio.sleep(2)
    info = await c.ask(b"stats-job 1\r\n")
    assert stat(info, "state") == "delayed"
    assert stat(info, "held-back").startswith('"backing off until 20')
    until = lp.state.jobs[1].deadline
    assert lp.state.held_back(1, lp.now) == ("backoff", until)
    assert until - EPOCH >= 30 * NS
    assert stat(await c.ask(b"ext-stats-tube default\r\n"), "jobs-backed-off") == "1"
    assert_replays(lp, tmp_path)  # the delay survives a restart, reason included
    await assert_replica_agrees(lp, tmp_path, nursery)


async def test_release_backoff_only_without_a_delay(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, '[tubes.default]\nrelease-backoff = "4s..1h"\n')
    c = Client(lp)
    await c.ask(b"put 0 0 60 1\r\nx\r\n")
    await c.ask(b"reserve\r\n")
    t0 = trio.current_time()
    assert await c.ask(b"release 1 0 0\r\n") == p.RELEASED
    assert stat(await c.ask(b"stats-job 1\r\n"), "time-left") == "4"
    await c.ask(b"reserve\r\n")
    assert round(trio.current_time() - t0) == 4
    await c.ask(b"release 1 0 0\r\n")  # the second release: 8 s
    assert stat(await c.ask(b"stats-job 1\r\n"), "time-left") == "8"
    await c.ask(b"reserve\r\n")
    await c.ask(b"release 1 0 3\r\n")  # the worker's own delay wins
    assert stat(await c.ask(b"stats-job 1\r\n"), "time-left") == "3"
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


# --- concurrency ---------------------------------------------------------------------


async def test_max_reserved_holds_the_tube_like_an_empty_one(nursery, tmp_path,
                                                             autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, "[tubes.work]\nmax-reserved = 2\n")
    c = Client(lp)
    await c.ask(b"use work\r\n")
    for i in range(4):
        await c.ask(b"put 0 0 60 1\r\n%d\r\n" % i)
    a, b = Client(lp), Client(lp)
    for x in (a, b):
        await x.ask(b"watch work\r\n")
        await x.ask(b"ignore default\r\n")
    assert (await a.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    assert (await a.ask(b"reserve\r\n")).startswith(b"RESERVED 2 ")
    assert await b.ask(b"reserve-with-timeout 0\r\n") == p.TIMED_OUT
    info = await c.ask(b"stats-job 3\r\n")
    assert stat(info, "held-back") == '"tube at its concurrency limit (max-reserved 2)"'
    assert stat(await c.ask(b"ext-stats-tube work\r\n"), "held-back") == (
        '"at its concurrency limit (max-reserved 2)"')
    # While it is full a reserve takes from the worker's other watched tubes...
    await c.ask(b"use other\r\n")
    await c.ask(b"put 0 0 60 1\r\no\r\n")
    await b.ask(b"watch other\r\n")
    assert (await b.ask(b"reserve-with-timeout 0\r\n")).startswith(b"RESERVED 5 ")
    await b.ask(b"delete 5\r\n")
    # ...or waits, and is woken when a slot frees.
    b.send(b"reserve\r\n")
    await settle()
    assert lp.state.waiting_n == 1
    assert await a.ask(b"delete 1\r\n") == b"DELETED\r\n"
    assert (await b.recv()).startswith(b"RESERVED 3 ")
    assert lp.state.tubes["work"].reserved_n == 2
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


async def test_reload_changes_the_limit_while_jobs_are_reserved(nursery, tmp_path,
                                                                autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, "[tubes.default]\n[tubes.work]\nmax-reserved = 3\n")
    c = Client(lp)
    await c.ask(b"use work\r\n")
    await c.ask(b"watch work\r\n")
    for i in range(6):
        await c.ask(b"put 0 0 60 1\r\n%d\r\n" % i)
    for jid in (1, 2, 3):
        assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED %d " % jid)
    # Down to 1 while 3 are held: nothing more until fewer than 1 are reserved.
    await configure(lp, tmp_path, "[tubes.work]\nmax-reserved = 1\n")
    w = Client(lp)
    await w.ask(b"watch work\r\n")
    w.send(b"reserve\r\n")
    await settle()
    await c.ask(b"delete 1\r\n")
    await c.ask(b"delete 2\r\n")
    await settle()
    assert lp.state.waiting_n == 1
    await c.ask(b"delete 3\r\n")
    assert (await w.recv()).startswith(b"RESERVED 4 ")
    # Up to 3: the waiting worker gets a job as the reload's turn ends.
    w2 = Client(lp)
    await w2.ask(b"watch work\r\n")
    w2.send(b"reserve\r\n")
    await settle()
    assert lp.state.waiting_n == 1
    await configure(lp, tmp_path, "[tubes.work]\nmax-reserved = 3\n")
    assert (await w2.recv()).startswith(b"RESERVED 5 ")
    # The limit removed: a Limits record with zeros, the state forgets it.
    await configure(lp, tmp_path, "")
    assert "work" not in lp.state.limits
    limits = records_of(tmp_path, r.Limits)
    assert [(x.tube, x.max_reserved) for x in limits] == [
        ("work", 3), ("work", 1), ("work", 3), ("work", 0)]
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


# --- rate ----------------------------------------------------------------------------


async def test_max_rate_is_a_token_bucket_and_wakes_waiters(nursery, tmp_path,
                                                            autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, '[tubes.api]\nmax-rate = "4/s"\n')
    c = Client(lp)
    await c.ask(b"use api\r\n")
    for i in range(12):
        await c.ask(b"put 0 0 60 2\r\n%02d\r\n" % i)
    w = Client(lp)
    await w.ask(b"watch api\r\n")
    t0 = trio.current_time()
    times = []
    for _ in range(12):
        reply = await w.ask(b"reserve\r\n")
        assert reply.startswith(b"RESERVED ")
        times.append(round(trio.current_time() - t0, 3))
        await w.ask(b"delete %s\r\n" % reply.split()[1])
    # A full bucket of 4 at once, then one token every 0.25 s.
    assert times == [0, 0, 0, 0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0], times
    # No polling: the loop slept until each token was due.
    assert lp.state.limits["api"].rate == 4
    await c.ask(b"put 0 0 60 1\r\nx\r\n")
    held = lp.state.held_back(13, lp.now)
    assert held is not None and held[0] == "rate"
    assert stat(await c.ask(b"stats-job 13\r\n"), "held-back").startswith(
        '"tube out of rate tokens until ')
    assert await w.ask(b"reserve-with-timeout 0\r\n") == p.TIMED_OUT
    await trio.sleep(1)
    assert stat(await c.ask(b"ext-stats-tube api\r\n"), "rate-tokens") == "4"
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


async def test_rate_state_survives_a_restart(tmp_path, autojump_clock) -> None:
    """The bucket is state from records: a restart does not refill it."""
    async with trio.open_nursery() as nursery:
        lp = await started(nursery, tmp_path)
        await configure(lp, tmp_path, '[tubes.api]\nmax-rate = "2/m"\n')
        c = Client(lp)
        await c.ask(b"use api\r\n")
        await c.ask(b"watch api\r\n")
        for i in range(3):
            await c.ask(b"put 0 0 600 1\r\n%d\r\n" % i)
        for jid in (1, 2):
            assert (await c.ask(b"reserve-with-timeout 0\r\n")).startswith(b"RESERVED %d" % jid)
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        lp = await started(nursery, tmp_path)
        assert lp.state.limits["api"].rate == 2
        c = Client(lp)
        await c.ask(b"watch api\r\n")
        assert await c.ask(b"reserve-with-timeout 0\r\n") == p.TIMED_OUT
        t0 = trio.current_time()
        assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 3 ")
        assert 29 < trio.current_time() - t0 <= 30.01
        nursery.cancel_scope.cancel()
