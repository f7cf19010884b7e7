"""`move-job <id> <tube>` through the real mutation loop: a ready, delayed or
buried job changes tube in one Move record, keeping its id, priority,
statistics, delay, hold and idempotency key; a reserved job does not move;
replay, a replica, `aof dump` and `job-history` show the move."""

from __future__ import annotations

import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.ops.dump import details
from smallstalk.ops.job_history import job_history

from ..support.harness import Client
from .test_holdback import assert_replica_agrees, configure, records_of, settle, started
from .test_tube_policies import assert_replays, stat


async def test_moves_ready_delayed_and_buried_jobs(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    await c.ask(b"use src\r\nwatch src\r\n")
    await c.ask(b"put 7 0 60 1\r\na\r\n")  # 1: ready
    await c.ask(b"put 8 100 60 1\r\nb\r\n")  # 2: delayed
    await c.ask(b"put 9 0 60 1\r\nc\r\n")  # 3: reserved, released, reserved, buried
    await c.ask(b"reserve-job 3\r\n")
    await c.ask(b"release 3 9 0\r\n")
    await c.ask(b"reserve-job 3\r\n")
    assert await c.ask(b"bury 3 9\r\n") == p.BURIED
    await c.ask(b"put 0 0 60 1\r\nd\r\n")  # 4: stays reserved
    await c.ask(b"reserve-job 4\r\n")
    for jid in (1, 2, 3):
        assert await c.ask(b"move-job %d dst\r\n" % jid) == b"MOVED dst\r\n"
    assert await c.ask(b"move-job 4 dst\r\n") == p.NOT_FOUND  # reserved: not moved
    assert await c.ask(b"move-job 99 dst\r\n") == p.NOT_FOUND
    assert await c.ask(b"move-job 1 dst\r\n") == b"MOVED dst\r\n"  # already there: no record
    assert await c.ask(b"move-job 1 a b\r\n") == p.BAD_FORMAT
    assert await c.ask(b"move-job 1\r\n") == p.BAD_FORMAT
    st = lp.state
    assert [(st.jobs[i].tube.name, st.jobs[i].state) for i in (1, 2, 3, 4)] == [
        ("dst", 0), ("dst", 1), ("dst", 3), ("src", 2)]
    info = await c.ask(b"stats-job 3\r\n")
    assert (stat(info, "tube"), stat(info, "pri"), stat(info, "reserves"),
            stat(info, "releases"), stat(info, "buries")) == ("dst", "9", "2", "1", "1")
    assert stat(await c.ask(b"stats-job 2\r\n"), "time-left") == "100"  # the delay runs on
    tube = await c.ask(b"stats-tube dst\r\n")
    assert (stat(tube, "current-jobs-ready"), stat(tube, "current-jobs-delayed"),
            stat(tube, "current-jobs-buried")) == ("1", "1", "1")
    moves = records_of(tmp_path, r.Move)
    assert [(m.id, m.tube) for m in moves] == [(1, "dst"), (2, "dst"), (3, "dst")]
    assert details(moves[0]) == "moved to tube dst"
    steps = [(s.event, s.state, s.text) for s in job_history(tmp_path, 3).steps]
    assert steps[-2] == ("move", "buried", f"moved by conn {c.id} from src to dst (move-job or bulk-jobs)")
    # The delayed job becomes ready in its new tube when its delay runs out.
    await trio.sleep(101)
    assert st.jobs[2].state == 0 and st.jobs[2].tube.name == "dst"
    st.check()
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


async def test_the_key_stays_with_the_put(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    await c.ask(b"use src\r\n")
    assert await c.ask(b"put-unique k1 0 0 60 1\r\na\r\n") == b"INSERTED 1\r\n"
    assert await c.ask(b"move-job 1 dst\r\n") == b"MOVED dst\r\n"
    # A repeat put of the key into the tube it was put into is still the same job.
    assert await c.ask(b"put-unique k1 0 0 60 1\r\na\r\n") == b"DUPLICATE 1\r\n"
    assert lp.state.keys.key_of(1) == ("src", "k1")
    await c.ask(b"delete 1\r\n")
    assert await c.ask(b"put-unique k1 0 0 60 1\r\na\r\n") == b"DUPLICATE 1\r\n"  # retained
    assert_replays(lp, tmp_path)


async def test_a_backed_off_job_keeps_its_hold(nursery, tmp_path, autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    await configure(lp, tmp_path, '[tubes.work]\nrelease-backoff = "5s..60s"\n')
    c = Client(lp)
    await c.ask(b"use work\r\nwatch work\r\n")
    await c.ask(b"put 0 0 60 1\r\na\r\n")
    await c.ask(b"reserve\r\n")
    assert await c.ask(b"release 1 0 0\r\n") == p.RELEASED
    assert await c.ask(b"move-job 1 other\r\n") == b"MOVED other\r\n"
    reply = await c.ask(b"explain-job 1\r\n")
    assert b"backing off until" in reply and b'tube: "other"' in reply
    await settle()
    lp.state.check()
    assert_replays(lp, tmp_path)
