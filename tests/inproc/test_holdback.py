"""Tube policies that hold jobs back, through the real mutation loop on trio's
mock clock: attempt limits (bury with a reason, dead-letter), back-off after a
timeout and a release, concurrency (max-reserved) and rate (max-rate) limits,
each also across a reload. Every scenario checks that the data directory
replays, and a replica fed the primary's records reaches, the same state.
"""

from __future__ import annotations

from pathlib import Path

import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.state import NS
from smallstalk.server.loop import MutationLoop
from smallstalk.storage import aof, snapshot_codec

from ..support.harness import EPOCH, Client, make_loop
from .test_bigtubes import assert_replays, stat


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
        records += [e[1] for e in aof.iter_segment(path) if not isinstance(e, aof.FrameScan)]
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
        out += [e[1] for e in aof.iter_segment(path)
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
    ext = await c.ask(b"ext-stats-tube work\r\n")
    assert stat(ext, "jobs-exhausted") == "1"
    (req,) = records_of(tmp_path, r.Requeue)
    assert req.cause == r.REQUEUE_TIMEOUT and req.moves[0][2:] == (
        "", "exhausted: TTR ran out 2 times (max-timeouts 2)")
    assert len(records_of(tmp_path, r.Timeout)) == 1  # the first timeout: no policy needed
    # A kick gives it another go, and takes the reason away.
    await c.ask(b"kick-job 1\r\n")
    assert stat(await c.ask(b"stats-job 1\r\n"), "held-back") == '""'
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
