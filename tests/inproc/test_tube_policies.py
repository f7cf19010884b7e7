"""Per-tube policy through the real mutation loop: limits, discard-old-when-full,
expiry (tube max-age and put-expiring's max-age) with dead-letter tubes, and
fanout tubes. In-process on trio's mock clock; every scenario that logs also
checks that the data directory replays to exactly the live state.
"""

from __future__ import annotations

import pytest
import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.server.policy import Policies, TubePolicy
from smallstalk.storage import snapshot_codec
from smallstalk.storage.recovery import recover

from ..support.harness import Client, make_loop


def policies(default: TubePolicy | None = None, **tubes: TubePolicy) -> Policies:
    return Policies(default or TubePolicy(), {k.replace("_", "-"): v for k, v in tubes.items()})


@pytest.fixture
async def lp(nursery, tmp_path):
    loop = make_loop(tmp_path)
    nursery.start_soon(loop.run)
    return loop


def stat(reply: bytes, key: str) -> str:
    for line in reply.decode().splitlines():
        if line.startswith(key + ": "):
            return line.split(": ", 1)[1]
    raise KeyError(key)


def assert_replays(lp, data_dir) -> None:
    """The data directory rebuilds exactly the live state."""
    lp.state.check()
    rebuilt = recover(data_dir, repair=False).state
    rebuilt.check()
    live = [x for x in snapshot_codec.dump(lp.state) if x[0] != "conn"]
    again = [x for x in snapshot_codec.dump(rebuilt) if x[0] != "conn"]
    assert again == live


async def test_max_jobs_refuses_with_out_of_memory(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(small=TubePolicy(max_jobs=2))
    c = Client(lp)
    await c.ask(b"use small\r\n")
    assert await c.ask(b"put 0 0 10 1\r\na\r\n") == b"INSERTED 1\r\n"
    assert await c.ask(b"put 0 0 10 1\r\nb\r\n") == b"INSERTED 2\r\n"
    assert await c.ask(b"put 0 0 10 1\r\nc\r\n") == p.OUT_OF_MEMORY
    # Any state counts: a reserved job still occupies its place.
    await c.ask(b"watch small\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    assert await c.ask(b"put 0 0 10 1\r\nc\r\n") == p.OUT_OF_MEMORY
    assert await c.ask(b"delete 1\r\n") == b"DELETED\r\n"
    assert await c.ask(b"put 0 0 10 1\r\nc\r\n") == b"INSERTED 3\r\n"
    st = await c.ask(b"ext-stats-tube small\r\n")
    assert stat(st, "puts-refused") == "2"
    assert stat(await c.ask(b"stats-tube small\r\n"), "current-jobs-ready") == "2"
    # Other tubes are not limited.
    await c.ask(b"use other\r\n")
    for _ in range(5):
        assert (await c.ask(b"put 0 0 10 1\r\nx\r\n")).startswith(b"INSERTED")
    assert_replays(lp, tmp_path)


async def test_max_bytes_and_max_job_size(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(TubePolicy(max_bytes=10, max_job_size=6))
    c = Client(lp)
    assert await c.ask(b"put 0 0 10 7\r\n1234567\r\n") == p.JOB_TOO_BIG
    assert await c.ask(b"put 0 0 10 6\r\n123456\r\n") == b"INSERTED 1\r\n"
    assert await c.ask(b"put 0 0 10 5\r\n12345\r\n") == p.OUT_OF_MEMORY
    assert await c.ask(b"put 0 0 10 4\r\n1234\r\n") == b"INSERTED 2\r\n"
    st = await c.ask(b"ext-stats-tube default\r\n")
    assert stat(st, "current-bytes") == "10"
    assert stat(st, "bytes-in-memory") == "10"
    assert stat(st, "bytes-on-disk") == "0"
    assert stat(st, "puts-refused") == "2"
    assert_replays(lp, tmp_path)


async def test_discard_old_when_full_drops_oldest_ready(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(q=TubePolicy(max_jobs=3, discard_old_when_full=True))
    c, w = Client(lp), Client(lp)
    await c.ask(b"use q\r\n")
    await w.ask(b"watch q\r\nignore default\r\n")
    for body in (b"1", b"2", b"3"):
        assert (await c.ask(b"put 0 0 10 1\r\n%s\r\n" % body)).startswith(b"INSERTED")
    # Job 1 is reserved: it is not ready, so job 2 is the oldest one to drop.
    assert await w.ask(b"reserve\r\n") == b"RESERVED 1 1\r\n1\r\n"
    assert await c.ask(b"put 0 0 10 1\r\n4\r\n") == b"INSERTED 4\r\n"
    assert await c.ask(b"peek 2\r\n") == p.NOT_FOUND
    assert (await c.ask(b"peek 3\r\n")).startswith(b"FOUND 3")
    st = await c.ask(b"ext-stats-tube q\r\n")
    assert stat(st, "jobs-discarded") == "1"
    assert stat(await c.ask(b"stats-tube q\r\n"), "current-jobs-ready") == "2"
    # Priority does not protect an old job: arrival order decides.
    assert await c.ask(b"put 0 0 10 1\r\n5\r\n") == b"INSERTED 5\r\n"
    assert await c.ask(b"peek 3\r\n") == p.NOT_FOUND
    recs = [rec for rec in _records(tmp_path) if isinstance(rec, r.PutJobs)]
    assert [rec.dropped for rec in recs][-2:] == [(2,), (3,)]
    assert_replays(lp, tmp_path)


async def test_discard_refuses_when_nothing_ready_to_drop(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(q=TubePolicy(max_jobs=1, discard_old_when_full=True))
    c = Client(lp)
    await c.ask(b"use q\r\nwatch q\r\n")
    await c.ask(b"put 0 0 10 1\r\n1\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1")
    assert await c.ask(b"put 0 0 10 1\r\n2\r\n") == p.OUT_OF_MEMORY


async def test_tube_max_age_deletes_expired_jobs(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(q=TubePolicy(max_age=60))
    c = Client(lp)
    await c.ask(b"use q\r\n")
    await c.ask(b"put 0 0 10 1\r\na\r\n")
    await trio.sleep(30)
    await c.ask(b"put 0 0 10 1\r\nb\r\n")
    await trio.sleep(30.5)
    assert await c.ask(b"peek 1\r\n") == p.NOT_FOUND
    assert (await c.ask(b"peek 2\r\n")).startswith(b"FOUND 2")
    await trio.sleep(30)
    assert await c.ask(b"peek 2\r\n") == p.NOT_FOUND
    assert stat(await c.ask(b"stats-tube default\r\n"), "current-jobs-ready") == "0"
    st = await c.ask(b"ext-stats-tube q\r\n")
    assert stat(st, "jobs-expired") == "2"
    assert_replays(lp, tmp_path)


async def test_put_max_age_argument_and_earlier_wins(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(q=TubePolicy(max_age=100))
    c = Client(lp)
    assert await c.ask(b"put-expiring 0 0 10 5 1\r\na\r\n") == b"INSERTED 1\r\n"
    await c.ask(b"use q\r\n")
    assert await c.ask(b"put-expiring 0 0 10 500 1\r\nb\r\n") == b"INSERTED 2\r\n"
    assert await c.ask(b"put-expiring 0 0 10 3 1\r\nc\r\n") == b"INSERTED 3\r\n"
    await trio.sleep(3.5)
    assert await c.ask(b"peek 3\r\n") == p.NOT_FOUND
    assert (await c.ask(b"peek 1\r\n")).startswith(b"FOUND 1")
    await trio.sleep(2)
    assert await c.ask(b"peek 1\r\n") == p.NOT_FOUND
    await trio.sleep(95)
    assert await c.ask(b"peek 2\r\n") == p.NOT_FOUND  # the tube's 100 s beat the put's 500
    assert await c.ask(b"put 0 0 10 1 x\r\n") == p.BAD_FORMAT  # the body is not read
    assert_replays(lp, tmp_path)


async def test_reserved_and_buried_jobs_do_not_expire(lp, tmp_path, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"put-expiring 0 0 100 10 1\r\na\r\nput-expiring 0 0 100 10 1\r\nb\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 2")
    assert await c.ask(b"bury 2 0\r\n") == b"BURIED\r\n"
    await trio.sleep(20)
    assert (await c.ask(b"peek 1\r\n")).startswith(b"FOUND 1")
    assert (await c.ask(b"peek 2\r\n")).startswith(b"FOUND 2")
    # Released after its expiry time: it expires at once.
    assert await c.ask(b"release 1 0 0\r\n") == b"RELEASED\r\n"
    await trio.sleep(0.01)
    assert await c.ask(b"peek 1\r\n") == p.NOT_FOUND
    # A delayed job expires too, without waiting for its delay.
    await c.ask(b"put-expiring 0 50 10 5 1\r\nd\r\n")
    await trio.sleep(6)
    assert await c.ask(b"peek 3\r\n") == p.NOT_FOUND
    assert_replays(lp, tmp_path)


async def test_expire_to_dead_letter_tube_keeps_id_and_stats(lp, tmp_path, autojump_clock) -> None:
    lp.policies = Policies(TubePolicy(), {"q": TubePolicy(max_age=10, expire_to="q.dead")})
    c = Client(lp)
    await c.ask(b"use q\r\nwatch q\r\n")
    await c.ask(b"put 7 0 100 5\r\nhello\r\n")
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1")
    assert await c.ask(b"release 1 7 0\r\n") == b"RELEASED\r\n"
    await trio.sleep(11)
    job = await c.ask(b"stats-job 1\r\n")
    assert stat(job, "tube") == "q.dead"
    assert stat(job, "state") == "ready"
    assert stat(job, "reserves") == "1"
    assert stat(job, "releases") == "1"
    assert stat(job, "pri") == "7"
    assert await c.ask(b"peek 1\r\n") == b"FOUND 1 5\r\nhello\r\n"
    assert stat(await c.ask(b"ext-stats-tube q\r\n"), "jobs-expired") == "1"
    # A worker on the dead-letter tube gets it.
    await c.ask(b"watch q.dead\r\n")
    assert await c.ask(b"reserve\r\n") == b"RESERVED 1 5\r\nhello\r\n"
    moves = [rec.moves for rec in _records(tmp_path) if isinstance(rec, r.Expire)]
    assert moves == [((1, "q.dead", 0),)]
    assert_replays(lp, tmp_path)


async def test_expiry_wakes_nobody_and_grants_nothing(lp, tmp_path, autojump_clock) -> None:
    """A waiting reserve is not handed a job that expired in the same instant."""
    w, c = Client(lp), Client(lp)
    w.send(b"reserve-with-timeout 20\r\n")
    await trio.sleep(1)
    await c.ask(b"put-expiring 0 30 10 10 1\r\nx\r\n")  # delayed past its own expiry
    assert await w.recv() == p.TIMED_OUT
    assert await c.ask(b"peek 1\r\n") == p.NOT_FOUND


async def test_fanout_copies_every_put(lp, tmp_path, autojump_clock) -> None:
    prod, audit, billing = Client(lp), Client(lp), Client(lp)
    await audit.ask(b"watch orders+audit\r\nignore default\r\n")
    await billing.ask(b"watch orders+billing\r\nignore default\r\n")
    await prod.ask(b"use orders\r\n")
    assert await prod.ask(b"put 3 0 10 2\r\nA1\r\n") == b"INSERTED 1\r\n"
    assert await audit.ask(b"reserve\r\n") == b"RESERVED 2 2\r\nA1\r\n"
    assert await billing.ask(b"reserve\r\n") == b"RESERVED 3 2\r\nA1\r\n"
    assert (await prod.ask(b"stats-job 1\r\n")).count(b"tube: orders\n") == 1
    assert stat(await prod.ask(b"ext-stats-tube orders\r\n"), "fanout-tubes") == "2"
    # A put into a child does not copy anywhere.
    await prod.ask(b"use orders+audit\r\n")
    assert await prod.ask(b"put 0 0 10 1\r\nz\r\n") == b"INSERTED 4\r\n"
    # The copies outlive the workers: with nobody watching, the tube still gets them.
    audit.close()
    await prod.ask(b"use orders\r\n")
    assert await prod.ask(b"put 0 0 10 2\r\nA2\r\n") == b"INSERTED 5\r\n"
    assert (await prod.ask(b"stats-job 6\r\n")).count(b"tube: orders+audit\n") == 1
    # delete-tube stops the copies.
    assert await prod.ask(b"delete-tube orders+audit\r\n") == b"DELETED\r\n"
    assert await prod.ask(b"delete-tube orders+audit\r\n") == p.NOT_FOUND
    assert await prod.ask(b"delete-tube orders\r\n") == p.NOT_FOUND
    assert await prod.ask(b"put 0 0 10 2\r\nA3\r\n") == b"INSERTED 8\r\n"  # 9 is billing's
    assert await prod.ask(b"peek 9\r\n") == b"FOUND 9 2\r\nA3\r\n"
    assert stat(await prod.ask(b"stats-job 9\r\n"), "tube") == "orders+billing"
    assert_replays(lp, tmp_path)


async def test_fanout_only_parent_keeps_no_jobs(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(events=TubePolicy(fanout_only=True))
    c = Client(lp)
    await c.ask(b"use events\r\n")
    assert await c.ask(b"put 0 0 10 1\r\nx\r\n") == b"INSERTED 1\r\n"  # nobody listens
    assert await c.ask(b"peek 1\r\n") == p.NOT_FOUND
    await c.ask(b"watch events+a\r\n")
    assert await c.ask(b"put 0 0 10 1\r\ny\r\n") == b"INSERTED 2\r\n"
    assert stat(await c.ask(b"stats-job 2\r\n"), "tube") == "events+a"
    assert stat(await c.ask(b"stats-tube events\r\n"), "current-jobs-ready") == "0"
    assert_replays(lp, tmp_path)


async def test_fanout_copy_into_full_child_is_skipped(lp, tmp_path, autojump_clock) -> None:
    lp.policies = Policies(TubePolicy(), {"p+small": TubePolicy(max_jobs=1)})
    c = Client(lp)
    await c.ask(b"watch p+small\r\nwatch p+big\r\nuse p\r\n")
    assert await c.ask(b"put 0 0 10 1\r\na\r\n") == b"INSERTED 1\r\n"  # copies 2 and 3
    assert await c.ask(b"put 0 0 10 1\r\nb\r\n") == b"INSERTED 4\r\n"  # p+small full: one copy
    assert stat(await c.ask(b"stats-tube p+small\r\n"), "current-jobs-ready") == "1"
    assert stat(await c.ask(b"ext-stats-tube p+small\r\n"), "puts-refused") == "1"
    assert stat(await c.ask(b"stats-tube p+big\r\n"), "current-jobs-ready") == "2"
    assert_replays(lp, tmp_path)


async def test_fanout_copies_share_expiry_and_move_together(lp, tmp_path, autojump_clock) -> None:
    lp.policies = Policies(TubePolicy(), {"p": TubePolicy(max_age=10, expire_to="late"),
                                          "p+c": TubePolicy(expire_to="late")})
    c = Client(lp)
    await c.ask(b"watch p+c\r\nuse p\r\n")
    assert await c.ask(b"put 0 0 10 1\r\na\r\n") == b"INSERTED 1\r\n"
    await trio.sleep(11)
    assert stat(await c.ask(b"stats-job 1\r\n"), "tube") == "late"
    assert stat(await c.ask(b"stats-job 2\r\n"), "tube") == "late"
    assert_replays(lp, tmp_path)


async def test_config_and_reload_commands(lp, tmp_path, autojump_clock) -> None:
    c = Client(lp)
    assert (await c.ask(b"reload-config\r\n")).startswith(b"NOT_RELOADED ")
    cfg = tmp_path / "smallstalk.toml"
    cfg.write_text('[tubes.default]\nmax-jobs = 5\n[tubes."q"]\nmax-age = "2m"\n')
    lp.config_path = cfg
    assert await c.ask(b"reload-config\r\n") == b"RELOADED\r\n"
    reply = await c.ask(b"config\r\n")
    head, _, body = reply.partition(b"\r\n")
    assert head == b"OK %d" % (len(body) - 2)
    text = body.decode()
    assert "default:\n  max-jobs: 5\n" in text
    assert "q:\n  max-jobs: 5\n" in text and "  max-age: 120\n" in text
    cfg.write_text("[tubes.default]\nmax-jobz = 5\n")
    bad = await c.ask(b"reload-config\r\n")
    assert bad.startswith(b"NOT_RELOADED ") and b"max-jobz" in bad and bad.endswith(b"\r\n")
    assert lp.policies.of("x").max_jobs == 5  # the old policies stay


async def test_replica_refuses_delete_tube(tmp_path, nursery, autojump_clock) -> None:
    loop = make_loop(tmp_path)
    loop.read_only = "replica"
    nursery.start_soon(loop.run)
    c = Client(loop)
    assert await c.ask(b"delete-tube a+b\r\n") == p.READ_ONLY


def _records(data_dir) -> list:
    from smallstalk.storage import aof, logread

    out = []
    for _first, path in aof.list_segments(data_dir / "aof"):
        for entry in logread.iter_segment(path):
            if isinstance(entry, aof.FrameScan):
                break
            out.append(entry[1])
    return out
