"""Semantics through the real mutation loop, in-process, on trio's mock clock.

Every test takes `autojump_clock`: pytest-trio only uses a clock the test itself asks for.
"""

from __future__ import annotations

import random

import pytest
import trio

import smallstalk
from smallstalk.core import protocol as p
from smallstalk.core import records
from smallstalk.core.model import DELAYED, READY
from smallstalk.server import timers
from smallstalk.server.admin import AUTH_FAIL_DELAY, AdminPolicy
from smallstalk.storage import aof
from smallstalk.storage.recovery import recover

from ..support.harness import Client, make_loop


@pytest.fixture
async def lp(nursery):
    loop = make_loop()
    nursery.start_soon(loop.run)
    return loop


async def test_put_reserve_delete(lp, autojump_clock) -> None:
    c = Client(lp)
    assert await c.ask(b"put 5 0 10 3\r\nabc\r\n") == b"INSERTED 1\r\n"
    assert await c.ask(b"reserve\r\n") == b"RESERVED 1 3\r\nabc\r\n"
    assert await c.ask(b"delete 1\r\n") == b"DELETED\r\n"
    assert await c.ask(b"delete 1\r\n") == p.NOT_FOUND


async def test_priority_then_fifo(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"put 10 0 10 1\r\na\r\nput 5 0 10 1\r\nb\r\nput 10 0 10 1\r\nc\r\nput 5 0 10 1\r\nd\r\n")
    got = [await c.ask(b"reserve\r\n") for _ in range(4)]
    assert [g.split(b"\r\n")[1] for g in got] == [b"b", b"d", b"a", b"c"]


async def test_pipelined_replies_come_in_order(lp, autojump_clock) -> None:
    c = Client(lp)
    data = b"".join(b"put 0 0 10 1\r\n%d\r\n" % (i % 10) for i in range(50)) + b"stats-tube default\r\n"
    reply = await c.ask(data)
    assert reply.startswith(b"".join(b"INSERTED %d\r\n" % i for i in range(1, 51)))
    assert b"current-jobs-ready: 50\n" in reply


async def test_blocking_reserve_woken_by_other_connections_put(lp, autojump_clock) -> None:
    worker, producer = Client(lp), Client(lp)
    worker.send(b"reserve\r\n")
    await trio.sleep(5)
    assert await producer.ask(b"put 0 0 10 2\r\nhi\r\n") == b"INSERTED 1\r\n"
    assert await worker.recv() == b"RESERVED 1 2\r\nhi\r\n"


async def test_ttr_expiry_releases_the_job(lp, autojump_clock) -> None:
    a, b = Client(lp), Client(lp)
    await a.ask(b"put 0 0 3 1\r\nx\r\n")
    assert await a.ask(b"reserve\r\n") == b"RESERVED 1 1\r\nx\r\n"
    start = trio.current_time()
    assert await b.ask(b"reserve\r\n") == b"RESERVED 1 1\r\nx\r\n"
    assert 3 <= trio.current_time() - start <= 3.1
    stats = await b.ask(b"stats-job 1\r\n")
    assert b"reserves: 2\n" in stats and b"timeouts: 1\n" in stats
    assert await a.ask(b"delete 1\r\n") == p.NOT_FOUND  # no longer a's


async def test_deadline_soon(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"put 0 0 2 1\r\nx\r\nput 0 0 2 1\r\ny\r\n")
    await c.ask(b"reserve\r\n")
    await c.ask(b"reserve\r\n")
    # Both reserved, nothing ready: the wait ends at the safety margin.
    start = trio.current_time()
    assert await c.ask(b"reserve\r\n") == p.DEADLINE_SOON
    assert 0.9 <= trio.current_time() - start <= 1.1
    # Inside the margin a reserve answers at once.
    assert await c.ask(b"reserve\r\n") == p.DEADLINE_SOON
    assert await c.ask(b"touch 1\r\n") == p.TOUCHED


async def test_reserve_with_timeout(lp, autojump_clock) -> None:
    c = Client(lp)
    start = trio.current_time()
    assert await c.ask(b"reserve-with-timeout 0\r\n") == p.TIMED_OUT
    assert trio.current_time() - start < 0.01
    assert await c.ask(b"reserve-with-timeout 7\r\n") == p.TIMED_OUT
    assert 7 <= trio.current_time() - start <= 7.1


async def test_delayed_job_becomes_ready(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"put 0 30 10 1\r\nd\r\n")
    assert await c.ask(b"peek-ready\r\n") == p.NOT_FOUND
    assert await c.ask(b"peek-delayed\r\n") == b"FOUND 1 1\r\nd\r\n"
    start = trio.current_time()
    assert await c.ask(b"reserve\r\n") == b"RESERVED 1 1\r\nd\r\n"
    assert 30 <= trio.current_time() - start <= 30.1


async def test_release_with_delay_and_new_priority(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"put 100 0 10 1\r\nx\r\n")
    await c.ask(b"reserve\r\n")
    assert await c.ask(b"release 1 7 5\r\n") == p.RELEASED
    stats = await c.ask(b"stats-job 1\r\n")
    assert b"state: delayed\n" in stats and b"pri: 7\n" in stats and b"releases: 1\n" in stats


async def test_bury_kick_buried_before_delayed(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"put 0 0 10 1\r\na\r\nput 0 100 10 1\r\nb\r\n")
    await c.ask(b"reserve\r\n")
    assert await c.ask(b"bury 1 3\r\n") == p.BURIED
    assert await c.ask(b"peek-buried\r\n") == b"FOUND 1 1\r\na\r\n"
    assert await c.ask(b"kick 10\r\n") == b"KICKED 1\r\n"  # only the buried one
    assert await c.ask(b"kick 10\r\n") == b"KICKED 1\r\n"  # then the delayed one
    assert await c.ask(b"kick 10\r\n") == b"KICKED 0\r\n"
    assert await c.ask(b"kick-job 1\r\n") == p.NOT_FOUND
    stats = await c.ask(b"stats-job 1\r\n")
    assert b"buries: 1\n" in stats and b"kicks: 1\n" in stats and b"pri: 3\n" in stats


async def test_pause_tube_delays_reserves(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"put 0 0 10 1\r\nx\r\n")
    assert await c.ask(b"pause-tube default 20\r\n") == p.PAUSED
    assert await c.ask(b"pause-tube nosuch 20\r\n") == p.NOT_FOUND
    start = trio.current_time()
    assert await c.ask(b"reserve\r\n") == b"RESERVED 1 1\r\nx\r\n"
    assert 20 <= trio.current_time() - start <= 20.1


async def test_disconnect_releases_reservation(lp, autojump_clock) -> None:
    a, b = Client(lp), Client(lp)
    await a.ask(b"put 0 0 3600 1\r\nx\r\n")
    await a.ask(b"reserve\r\n")
    b.send(b"reserve\r\n")
    await trio.sleep(1)
    closed_at = trio.current_time()
    a.close()
    assert await b.recv() == b"RESERVED 1 1\r\nx\r\n"
    # Released by the close itself, not by the hour's TTR running out (the
    # mock clock would jump there if nothing else gave the job back).
    assert trio.current_time() - closed_at < 1


async def test_watch_ignore_use_lists(lp, autojump_clock) -> None:
    c = Client(lp)
    assert await c.ask(b"watch a\r\nwatch b\r\nwatch a\r\n") == b"WATCHING 2\r\nWATCHING 3\r\nWATCHING 3\r\n"
    assert await c.ask(b"ignore default\r\n") == b"WATCHING 2\r\n"
    # beanstalkd's array removal moves the last entry into the hole.
    assert await c.ask(b"list-tubes-watched\r\n") == b"OK 12\r\n---\n- b\n- a\n\r\n"
    assert await c.ask(b"ignore a\r\nignore b\r\n") == b"WATCHING 1\r\nNOT_IGNORED\r\n"
    assert await c.ask(b"use q\r\nlist-tube-used\r\n") == b"USING q\r\nUSING q\r\n"
    tubes = await c.ask(b"list-tubes\r\n")
    assert tubes == b"OK 22\r\n---\n- default\n- b\n- q\n\r\n"


async def test_tube_goes_away_when_unreferenced(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"use t1\r\nput 0 0 10 1\r\nx\r\nuse default\r\n")
    assert b"- t1\n" in await c.ask(b"list-tubes\r\n")
    await c.ask(b"delete 1\r\n")
    assert await c.ask(b"stats-tube t1\r\n") == p.NOT_FOUND


async def test_half_close_while_waiting_times_out(lp, autojump_clock) -> None:
    c = Client(lp)
    c.send(b"reserve\r\n")
    await trio.sleep(1)
    lp.end_of_input(c.session)
    assert await c.recv() == p.TIMED_OUT


async def test_reserve_job_from_buried_then_release_is_ready(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"put 0 0 10 1\r\nx\r\nreserve\r\nbury 1 0\r\n")
    assert await c.ask(b"reserve-job 1\r\n") == b"RESERVED 1 1\r\nx\r\n"
    assert await c.ask(b"release 1 0 0\r\n") == p.RELEASED
    assert b"state: ready\n" in await c.ask(b"stats-job 1\r\n")


async def test_drain_mode_refuses_puts(lp, autojump_clock) -> None:
    c = Client(lp)
    lp.draining = True
    assert await c.ask(b"put 0 0 10 1\r\nx\r\n") == p.DRAINING


async def test_live_put_path_logs_what_a_put_record_encodes_to(tmp_path, nursery,
                                                               autojump_clock) -> None:
    """dispatch's everyday put stages its record without making it (loop.log_put):
    the bytes must be those of `records.encode(Put(...))` and replay must
    rebuild the same jobs."""
    loop = make_loop(tmp_path)
    nursery.start_soon(loop.run)
    c = Client(loop)
    await c.ask(b"use other\r\n")
    assert await c.ask(b"put 7 0 30 2\r\nhi\r\nput 1 5 0 0\r\n\r\n") == \
        b"INSERTED 1\r\nINSERTED 2\r\n"
    loop.journal.close()
    puts = []
    for _first, path in aof.list_segments(tmp_path / "aof"):
        for entry in aof.read_frames(path.read_bytes()):
            if isinstance(entry, aof.FrameScan):
                break
            rec = records.decode(entry[1])
            assert records.encode(rec) == entry[1]
            if isinstance(rec, records.Put):
                puts.append(rec)
    assert [(x.id, x.tube, x.pri, x.delay, x.ttr, x.body) for x in puts] == [
        (1, "other", 7, 0, 30, b"hi"), (2, "other", 1, 5, 1, b"")]  # ttr 0 means 1
    replayed = recover(tmp_path, repair=False).state
    for jid in (1, 2):
        live, again = loop.state.jobs[jid], replayed.jobs[jid]
        assert (live.pri, live.ttr, live.state, live.deadline, live.body, live.tube.name) == (
            again.pri, again.ttr, again.state, again.deadline, again.body, again.tube.name)


async def test_a_loop_without_replication_hooks_refuses_replicate_and_promote(
        lp, autojump_clock) -> None:
    # server/ never imports replication/: the hooks come from cli.py, and a loop
    # started without them says so, and goes on serving.
    c = Client(lp)
    assert await c.ask(p.render(p.Replicate(0, "", 0))) == \
        b"REFUSED this server cannot feed replicas\r\n"
    assert await c.ask(b"promote\r\n") == b"NOT_A_REPLICA\r\n"
    assert await c.ask(b"put 0 0 10 1\r\na\r\n") == b"INSERTED 1\r\n"


async def test_stats_names_the_package_version(lp, autojump_clock) -> None:
    c = Client(lp)
    reply = await c.ask(b"stats\r\n")
    assert b'\nversion: "1.12"\n' in reply  # the beanstalkd protocol clients see
    assert b"smallstalk-version" not in reply  # beanstalkd's keys only, by default
    ext = await c.ask(b"ext-stats\r\n")
    assert b'\nsmallstalk-version: "%s"\n' % smallstalk.__version__.encode() in ext
    lp.extended_stats = True  # --extended-stats: beanstalkd's keys, then ours
    both = await c.ask(b"stats\r\n")
    assert b"\nversion: " in both and both.index(b"\nplatform: ") < both.index(b"smallstalk-")


async def test_auth_is_answered_late_and_gates_admin_commands(lp, autojump_clock) -> None:
    lp.admin = AdminPolicy(token="s3cr3t")
    lp.extended_stats = False
    c = Client(lp)  # the harness's session is in-process ("local"): trusted anyway
    assert await c.ask(b"config\r\n") != p.UNAUTHORIZED
    s = lp.open_session(lambda *a: None, "10.0.0.9", "tcp")
    assert not s.admin
    start = trio.current_time()
    out: list[bytes] = []
    s.deliver = lambda blob, done, close: out.append(blob)
    lp.submit(s, [p.Auth("wrong"), p.ReloadConfig(), p.Auth("s3cr3t"), p.ReloadConfig()])
    while len(b"".join(out).split(b"\r\n")) < 5:
        await trio.sleep(0.01)
    assert trio.current_time() - start >= AUTH_FAIL_DELAY
    assert b"".join(out).startswith(b"UNAUTHORIZED\r\nUNAUTHORIZED\r\nOK\r\nNOT_RELOADED")


async def test_a_deferred_reply_is_counted_like_any_other(lp, autojump_clock) -> None:
    """A failed auth is answered later: that reply counts toward the bytes the
    session owes its socket (backpressure) as every other does, so once all
    is delivered the session owes nothing, however many auths failed."""
    lp.admin = AdminPolicy(token="s3cr3t")
    s = lp.open_session(lambda *a: None, "10.0.0.9", "tcp")
    out: list[bytes] = []
    s.deliver = lambda blob, done, close: out.append(blob)
    lp.submit(s, [p.Auth("wrong")] * 5 + [p.ListTubeUsed()])
    while b"USING" not in b"".join(out):
        await trio.sleep(0.01)
    assert b"".join(out) == p.UNAUTHORIZED * 5 + b"USING default\r\n"
    assert s.owed == 0


@pytest.mark.parametrize("seed", range(4))
async def test_a_poller_pass_never_leaves_the_loop_tasks_alarm_late(
        lp, autojump_clock, seed: int) -> None:
    """A poller's pass recomputes the loop task's alarm only when
    `timers.maybe_earlier` says its turn could have made an earlier timer:
    after each pass of random puts (some delayed), reserves (TTRs of 1 to 30
    s), deletes and releases, the alarm is never later than the next
    deadline computed in full, and the loop task sleeps through the run."""
    rng = random.Random(seed)
    got: list[bytes] = []
    s = lp.open_session(lambda blob, done, close: got.append(blob), None, "local")
    await trio.sleep(1)
    checked = 0
    for _ in range(200):
        cmds: list = []
        for _ in range(rng.randint(1, 3)):
            k = rng.random()
            ids = sorted(lp.state.jobs)
            if k < 0.35 or not ids:
                cmds.append(p.Put(0, rng.choice([0, 0, 1, 3, 7]), rng.choice([1, 2, 5, 30]), b"x"))
            elif k < 0.65:
                cmds.append(p.Reserve(0))
            elif k < 0.85:
                cmds.append(p.Delete(rng.choice(ids)))
            else:
                cmds.append(p.Release(rng.choice(ids), 0, rng.choice([0, 2])))
        lp.begin_batch()
        lp.submit(s, cmds)
        await lp.end_batch()
        wait = timers.seconds_to_next_deadline(lp)
        if wait is not None and lp._sleep is not None and not lp._turning:
            assert lp._sleep.deadline <= trio.current_time() + wait + 1e-6
            checked += 1
        await trio.sleep(rng.choice([0, 0, 0.4, 1.3]))
    assert checked > 50


async def test_a_poller_turn_that_makes_a_timer_moves_the_loop_tasks_alarm(
        lp, autojump_clock) -> None:
    """The poller runs the turn for what it read (end_batch) while the loop
    task sleeps without a timer: a delayed put made there must still become
    ready on time, and a reserve's TTR must still run out."""
    got: list[bytes] = []
    s = lp.open_session(lambda blob, done, close: got.append(blob), None, "local")

    async def poller_pass(*cmds) -> None:
        lp.begin_batch()
        lp.submit(s, list(cmds))
        await lp.end_batch()

    await trio.sleep(1)  # the loop task opened the session and sleeps, no timer due
    assert timers.seconds_to_next_deadline(lp) is None
    await poller_pass(p.Put(0, 5, 2, b"x"))
    assert got.pop() == b"INSERTED 1\r\n"
    assert 4.9 < timers.seconds_to_next_deadline(lp) <= 5
    t0 = trio.current_time()
    await trio.sleep(4.9)
    assert lp.state.jobs[1].state == DELAYED
    await trio.sleep(0.2)
    assert lp.state.jobs[1].state == READY
    await poller_pass(p.Reserve(0))
    assert got.pop().startswith(b"RESERVED 1 1\r\n")
    await trio.sleep(2.5)  # TTR 2 s: back to ready without another command
    assert lp.state.jobs[1].state == READY
    assert trio.current_time() - t0 < 8



async def _turn_taking_a_lease(lp, nursery, s, got: list[bytes], until: float | None,
                               *cmds) -> bytes:
    """One poller turn running `cmds` for `s`, then (until not None) a call
    that takes an HA lease until trio time `until`, as a promotion does."""
    lp.begin_batch()
    lp.submit(s, list(cmds))
    if until is not None:
        nursery.start_soon(lp.call, lp.hold_lease, until)
        await trio.testing.wait_all_tasks_blocked()
    await lp.end_batch()
    return got.pop()


LISTED = b"OK 14\r\n---\n- default\n\r\n"


async def test_a_lease_taken_within_a_turn_holds_that_turns_replies_to_it(
        lp, nursery, autojump_clock) -> None:
    """Each reply's "did it change anything" is kept only in turns that may
    hold or refuse replies (an HA lease, replica acks: GroupCommit.holds,
    fixed when the turn starts). A lease taken within a turn (a promotion runs
    inside one) counts that turn's replies as changes; while it holds they go
    out as they are. The turns after it judge each reply on its own."""
    got: list[bytes] = []
    s = lp.open_session(lambda blob, done, close: got.append(blob), None, "local")
    await trio.sleep(1)
    now = trio.current_time()
    assert await _turn_taking_a_lease(lp, nursery, s, got, now + 10, p.Put(0, 0, 5, b"x"),
                                      p.ListTubes()) == b"INSERTED 1\r\n" + LISTED
    assert await _turn_taking_a_lease(lp, nursery, s, got, None, p.Put(0, 0, 5, b"y"),
                                      p.ListTubes()) == b"INSERTED 2\r\n" + LISTED
    # Past the lease the turn starts fenced: the put refused, the listing answered.
    lp.hold_lease(trio.current_time())
    assert await _turn_taking_a_lease(lp, nursery, s, got, None, p.Put(0, 0, 5, b"z"),
                                      p.ListTubes()) == p.READ_ONLY + LISTED


async def test_a_lease_over_within_the_turn_that_took_it_refuses_all_its_replies(
        lp, nursery, autojump_clock) -> None:
    """The turn's replies were not judged one by one (no lease when it
    started): past the lease each counts as a change, so none is
    acknowledged, the listing included. The next turn is fenced."""
    got: list[bytes] = []
    s = lp.open_session(lambda blob, done, close: got.append(blob), None, "local")
    await trio.sleep(1)
    assert await _turn_taking_a_lease(lp, nursery, s, got, trio.current_time() - 1,
                                      p.Put(0, 0, 5, b"x"), p.ListTubes()) == p.INTERNAL_ERROR * 2
    assert await _turn_taking_a_lease(lp, nursery, s, got, None, p.Put(0, 0, 5, b"y"),
                                      p.ListTubes()) == p.READ_ONLY + LISTED


async def test_a_turn_drops_the_ttr_entries_of_ended_reservations(autojump_clock) -> None:
    # Each reserve pushes a TTR entry; its delete leaves it behind. Once those
    # outnumber the live ones (twice, and 64), the turn's timers rebuild the
    # heap from the live ones; below that, it is left alone.
    lp = make_loop()
    st = lp.state
    lp.now = now = lp.clock()
    seq = 0
    for jid in range(1, 201):
        st.apply_put(seq := seq + 1, now, 1, jid, "default", 0, 0, 60, b"x")

    def cycle(jids: range) -> None:
        nonlocal seq
        for jid in jids:
            conn = 1 + jid % 4
            st.apply_reserve(seq := seq + 1, now + jid, conn, jid)
            if jid % 20:  # every twentieth stays reserved
                st.apply_delete(seq := seq + 1, now + jid, conn, jid)

    cycle(range(1, 61))
    before = list(st.ttr_heap)
    assert len(before) == 60 and st.reserved_n == 3
    timers.run(lp)
    assert st.ttr_heap == before  # 60 <= 2 * 3 + 64
    cycle(range(61, 201))
    timers.run(lp)
    live = sorted(st.ttr_heap)
    assert [jid for _, jid, _ in live] == [20, 40, 60, 80, 100, 120, 140, 160, 180, 200]
    assert st.ttr_heap[0] == live[0] and len(st.ttr_heap) == st.reserved_n == 10
    assert st.next_deadline(now) == st.jobs[20].deadline + 1
