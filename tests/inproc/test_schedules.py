"""Schedules (`[[schedules]]`) through the real mutation loop on trio's mock
clock: one Fire record per firing, skip-if-pending, exactly once across a
restart, catch-up after downtime (and after a while fenced), time zones, and one-line errors for a bad
table. The data directory replays, and a replica reaches, the same state.
"""

from __future__ import annotations

import datetime as dt
import math
import re

import pytest
import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.state import NS
from smallstalk.server.policy import ConfigError, policies_from

from ..support.harness import EPOCH, Client
from .test_holdback import assert_replica_agrees, configure, records_of, started
from .test_tube_policies import assert_replays, stat

# EPOCH is 2023-11-14 22:13:20 UTC: a minute's firing is 40 s after the start.
MINUTE = 60 * NS
FIRST = EPOCH + 40 * NS

TICKS = """
[[schedules]]
name = "ticks"
tube = "ticks"
cron = "* * * * *"
body = "tick"
ttr = 30
"""


async def test_one_job_per_firing(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, TICKS)
    await trio.sleep(40 + 2 * 60 + 1)
    fires = records_of(tmp_path, r.Fire)
    assert [(f.schedule, f.at, f.id) for f in fires] == [
        ("ticks", FIRST, 1), ("ticks", FIRST + MINUTE, 2), ("ticks", FIRST + 2 * MINUTE, 3)]
    # Each at its time, not polled for: the record's time is the firing's.
    assert [f.time for f in fires] == [f.at for f in fires]
    c = Client(lp)
    await c.ask(b"watch ticks\r\n")
    assert await c.ask(b"reserve-with-timeout 0\r\n") == p.reserved(1, b"tick")
    info = await c.ask(b"stats-job 1\r\n")
    assert stat(info, "tube") == "ticks" and stat(info, "ttr") == "30"
    assert stat(await c.ask(b"ext-stats-tube ticks\r\n"), "schedule-firings") == "3"
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


async def test_skip_if_pending(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, TICKS + "skip-if-pending = true\n")
    await trio.sleep(40 + 3 * 60 + 1)
    assert [f.id for f in records_of(tmp_path, r.Fire)] == [1, 0, 0, 0]
    c = Client(lp)
    await c.ask(b"watch ticks\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    await trio.sleep(60)  # reserved still counts as pending
    assert records_of(tmp_path, r.Fire)[-1].id == 0
    await c.ask(b"delete 1\r\n")
    await trio.sleep(60)
    assert records_of(tmp_path, r.Fire)[-1].id == 2
    assert stat(await c.ask(b"ext-stats-tube ticks\r\n"), "schedule-skips") == "4"
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


async def _run_for(tmp_path, seconds: float, config: str) -> None:
    async with trio.open_nursery() as nursery:
        lp = await started(nursery, tmp_path)
        await configure(lp, tmp_path, config)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()


async def test_exactly_once_across_a_restart(tmp_path, autojump_clock) -> None:
    await _run_for(tmp_path, 45, TICKS)  # fired at FIRST, stopped 5 s later
    await _run_for(tmp_path, 50, TICKS)  # restarted in the same minute: nothing again
    fires = records_of(tmp_path, r.Fire)
    assert [(f.at, f.id) for f in fires] == [(FIRST, 1)]
    await _run_for(tmp_path, 10, TICKS)  # past the next minute: its firing, once
    assert [(f.at, f.id) for f in records_of(tmp_path, r.Fire)] == [
        (FIRST, 1), (FIRST + MINUTE, 2)]


@pytest.mark.parametrize("catch_up, made", [("none", 0), ("last", 2)])
async def test_catch_up_after_downtime(tmp_path, autojump_clock, catch_up, made) -> None:
    config = TICKS + f'catch-up = "{catch_up}"\n'
    await _run_for(tmp_path, 45, config)
    await trio.sleep(5 * 60)  # down: five firings missed
    await _run_for(tmp_path, 10, config)
    fires = records_of(tmp_path, r.Fire)
    # The missed firings count once, as the latest of them: a job or a skip.
    assert [(f.at, f.id) for f in fires] == [(FIRST, 1), (FIRST + 5 * MINUTE, made)]
    await _run_for(tmp_path, 60, config)
    assert [f.id for f in records_of(tmp_path, r.Fire)][-1] > 1  # then on time again


@pytest.mark.parametrize("catch_up, made", [("none", 0), ("last", 2)])
async def test_catch_up_after_a_fenced_while(nursery, tmp_path, autojump_clock, catch_up,
                                             made) -> None:
    """Firings due while the server took no changes (HA: its lease lapsed, or
    it was a replica before its promotion) were missed by every member: when
    it takes changes again they count as after downtime, not as late."""
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, TICKS + f'catch-up = "{catch_up}"\n')
    await trio.sleep(45)
    await lp.call(lp.fence, "ha: the leader lease ran out")
    await trio.sleep(3 * 60)  # three firings missed
    await lp.call(lp.hold_lease, math.inf)
    await lp.call(lp.unfence)
    await trio.sleep(1)
    assert [(f.at, f.id) for f in records_of(tmp_path, r.Fire)] == [
        (FIRST, 1), (FIRST + 3 * MINUTE, made)]
    await trio.sleep(60)
    assert records_of(tmp_path, r.Fire)[-1].id > 1  # then on time again


def test_time_zones_and_errors() -> None:
    doc = {"schedules": [{"name": "nightly", "tube": "reports", "cron": "0 3 * * *",
                          "timezone": "America/New_York"}]}
    (sched,) = policies_from(doc).schedules
    nov = int(dt.datetime(2026, 11, 20, tzinfo=dt.UTC).timestamp()) * NS
    jul = int(dt.datetime(2026, 7, 20, tzinfo=dt.UTC).timestamp()) * NS
    assert dt.datetime.fromtimestamp(sched.next_after(nov) // NS, dt.UTC).hour == 8  # EST
    assert dt.datetime.fromtimestamp(sched.next_after(jul) // NS, dt.UTC).hour == 7  # EDT
    bad = [
        ({"cron": "61 * * * *"}, "is not a cron expression"),
        ({"cron": "* * * *"}, "expected 5 fields"),
        ({"timezone": "Mars/Olympus"}, "unknown time zone"),
        ({"catch-up": "all"}, 'expected "none" or "last"'),
        ({"tube": "no spaces"}, "expected a tube name"),
        ({"every": "5m"}, "unknown key 'every'"),
    ]
    for change, words in bad:
        table = {"name": "x", "tube": "t", "cron": "* * * * *", **change}
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            policies_from({"schedules": [table]}, "f.toml")
        assert "\n" not in str(e.value) and str(e.value).startswith("f.toml: schedules[0]")
    with pytest.raises(ConfigError, match="named twice"):
        policies_from({"schedules": [{"name": "x", "tube": "t", "cron": "* * * * *"}] * 2})


async def test_a_bad_expression_at_reload_keeps_the_old(nursery, tmp_path,
                                                         autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, TICKS)
    (tmp_path / "smallstalk.toml").write_text(TICKS.replace("* * * * *", "*/0 * * * *"))
    err = await lp.call(lp.reload_config)
    assert err is not None and "is not a cron expression" in err and "\n" not in err
    await trio.sleep(41)
    assert len(records_of(tmp_path, r.Fire)) == 1  # the old schedule still fires
