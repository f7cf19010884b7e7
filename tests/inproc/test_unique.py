"""Exactly-once enqueue through the real mutation loop: `put-unique` keys,
`unique = "body"` tubes, the window after a job is gone (record time, on the
mock clock), the per-tube bound, and keys across expiry moves and flushes.
Every scenario checks that the data directory replays to exactly the live
state, keys included, and that a snapshot of it loads back the same.
"""

from __future__ import annotations

import pytest
import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.server.policy import Policies, TubePolicy
from smallstalk.storage import snapshot_codec

from ..support.harness import Client, make_loop
from .test_tube_policies import assert_replays, stat


@pytest.fixture
async def lp(nursery, tmp_path):
    loop = make_loop(tmp_path)
    nursery.start_soon(loop.run)
    return loop


def policies(**tubes: TubePolicy) -> Policies:
    return Policies(TubePolicy(), dict(tubes))


def assert_snapshot_round_trip(lp) -> None:
    items = list(snapshot_codec.dump(lp.state))
    again = snapshot_codec.load(items)
    again.check()
    assert list(snapshot_codec.dump(again)) == items


def records_of(tmp_path, kind):
    from smallstalk.storage.history import iter_records

    return [rec for _path, _offset, rec in iter_records(tmp_path) if type(rec) is kind]


async def test_put_unique_new_then_duplicate(lp, tmp_path, autojump_clock) -> None:
    c = Client(lp)
    assert await c.ask(b"put-unique order-1 5 0 60 3\r\nabc\r\n") == b"INSERTED 1\r\n"
    # The same key: nothing changes, the same id, told apart from a new job.
    assert await c.ask(b"put-unique order-1 5 0 60 3\r\nabc\r\n") == b"DUPLICATE 1\r\n"
    assert await c.ask(b"put-unique order-1 9 0 60 5\r\nother\r\n") == b"DUPLICATE 1\r\n"
    # Another connection, the same tube: the same answer.
    c2 = Client(lp)
    assert await c2.ask(b"put-unique order-1 5 0 60 3\r\nabc\r\n") == b"DUPLICATE 1\r\n"
    assert await c.ask(b"put-unique order-2 5 0 60 3\r\nabc\r\n") == b"INSERTED 2\r\n"
    # Plain put is untouched by keys.
    assert await c.ask(b"put 0 0 60 3\r\nabc\r\n") == b"INSERTED 3\r\n"
    assert stat(await c.ask(b"stats\r\n"), "total-jobs") == "3"
    assert stat(await c.ask(b"stats\r\n"), "cmd-put") == "6"
    # Keys are per tube.
    await c.ask(b"use other\r\n")
    assert await c.ask(b"put-unique order-1 5 0 60 3\r\nabc\r\n") == b"INSERTED 4\r\n"
    ext = await c.ask(b"ext-stats-tube default\r\n")
    assert (stat(ext, "keys-live"), stat(ext, "puts-deduplicated")) == ("2", "3")
    lp.extended_stats = True
    assert stat(await c.ask(b"stats-job 1\r\n"), "key") == '"order-1"'
    assert stat(await c.ask(b"stats-job 3\r\n"), "key") == '""'
    assert_replays(lp, tmp_path)
    assert_snapshot_round_trip(lp)


async def test_bad_keys_and_replica_refusal(lp, tmp_path, autojump_clock) -> None:
    c = Client(lp)
    assert await c.ask(b"put-unique bad#key 0 0 60 1\r\n") == p.BAD_FORMAT
    assert await c.ask(b"put-unique " + b"k" * 201 + b" 0 0 60 1\r\n") == p.BAD_FORMAT
    assert await c.ask(b"put-unique " + b"k" * 200 + b" 0 0 60 1\r\nx\r\n") == b"INSERTED 1\r\n"
    assert await c.ask(b"put-unique k 0 0 60 1\r\nxyz\r\n") == p.EXPECTED_CRLF + p.UNKNOWN_COMMAND
    lp.read_only = "replica"
    assert await c.ask(b"put-unique k 0 0 60 1\r\nx\r\n") == p.READ_ONLY


async def test_window_after_delete_is_record_time(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(default=TubePolicy(unique_for=60))
    c = Client(lp)
    assert await c.ask(b"put-unique a 0 0 60 1\r\nx\r\n") == b"INSERTED 1\r\n"
    assert (await c.ask(b"reserve\r\n")).startswith(b"RESERVED 1 ")
    assert await c.ask(b"delete 1\r\n") == b"DELETED\r\n"
    # Deleted less than unique-for ago: still a duplicate of job 1.
    await trio.sleep(59)
    assert await c.ask(b"put-unique a 0 0 60 1\r\nx\r\n") == b"DUPLICATE 1\r\n"
    ext = await c.ask(b"ext-stats-tube default\r\n")
    assert (stat(ext, "keys-live"), stat(ext, "keys-retained")) == ("0", "1")
    await trio.sleep(2)
    assert await c.ask(b"put-unique a 0 0 60 1\r\nx\r\n") == b"INSERTED 2\r\n"
    assert_replays(lp, tmp_path)
    assert_snapshot_round_trip(lp)
    # The replay decided as the primary did: the record carries the window.
    (first, second) = records_of(tmp_path, r.PutUnique)
    assert (first.key, first.unique_for, second.time - first.time >= 61 * 10**9) == (
        "a", 60, True)


async def test_bound_drops_the_oldest_retained_keys(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(default=TubePolicy(unique_keys_max=2))
    c = Client(lp)
    for k in b"abc":
        assert (await c.ask(b"put-unique %c 0 0 60 1\r\nx\r\n" % k)).startswith(b"INSERTED")
    for jid in (1, 2, 3):
        assert await c.ask(b"delete %d\r\n" % jid) == b"DELETED\r\n"
    ext = await c.ask(b"ext-stats-tube default\r\n")
    assert (stat(ext, "keys-retained"), stat(ext, "keys-dropped")) == ("2", "1")
    assert await c.ask(b"put-unique a 0 0 60 1\r\nx\r\n") == b"INSERTED 4\r\n"  # dropped
    assert await c.ask(b"put-unique b 0 0 60 1\r\nx\r\n") == b"DUPLICATE 2\r\n"
    assert await c.ask(b"put-unique c 0 0 60 1\r\nx\r\n") == b"DUPLICATE 3\r\n"
    assert_replays(lp, tmp_path)
    assert_snapshot_round_trip(lp)


async def test_unique_body_tube_serves_unchanged_clients(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(emails=TubePolicy(unique="body"))
    c = Client(lp)
    await c.ask(b"use emails\r\n")
    assert await c.ask(b"put 0 0 60 5\r\nhello\r\n") == b"INSERTED 1\r\n"
    assert await c.ask(b"put 0 0 60 5\r\nhello\r\n") == b"INSERTED 1\r\n"
    assert await c.ask(b"put 0 0 60 5\r\nworld\r\n") == b"INSERTED 2\r\n"
    # An explicit key wins over the body's digest.
    assert await c.ask(b"put-unique k 0 0 60 5\r\nhello\r\n") == b"INSERTED 3\r\n"
    await c.ask(b"use default\r\n")
    assert await c.ask(b"put 0 0 60 5\r\nhello\r\n") == b"INSERTED 4\r\n"
    assert await c.ask(b"put 0 0 60 5\r\nhello\r\n") == b"INSERTED 5\r\n"
    ext = await c.ask(b"ext-stats-tube emails\r\n")
    assert (stat(ext, "keys-live"), stat(ext, "puts-deduplicated")) == ("3", "1")
    assert_replays(lp, tmp_path)


async def test_keys_follow_expiry_moves_and_flushes(lp, tmp_path, autojump_clock) -> None:
    lp.policies = policies(jobs=TubePolicy(max_age=10, expire_to="dead", unique_for=100))
    c = Client(lp)
    await c.ask(b"use jobs\r\n")
    assert await c.ask(b"put-unique m 0 0 60 1\r\nx\r\n") == b"INSERTED 1\r\n"
    await trio.sleep(11)
    # Job 1 moved to the dead-letter tube: it still exists, so its key holds.
    assert stat(await c.ask(b"stats-job 1\r\n"), "tube") == "dead"
    assert await c.ask(b"put-unique m 0 0 60 1\r\nx\r\n") == b"DUPLICATE 1\r\n"
    await c.ask(b"use dead\r\n")
    c.session.admin = True  # flush-tube is an admin command
    assert await c.ask(b"flush-tube dead\r\n") == b"FLUSHED 1\r\n"
    await c.ask(b"use jobs\r\n")
    assert await c.ask(b"put-unique m 0 0 60 1\r\nx\r\n") == b"DUPLICATE 1\r\n"
    await trio.sleep(101)
    assert await c.ask(b"put-unique m 0 0 60 1\r\nx\r\n") == b"INSERTED 2\r\n"
    assert_replays(lp, tmp_path)
    assert_snapshot_round_trip(lp)


def test_the_tools_show_the_key(tmp_path) -> None:
    """`aof dump` and `job-history` on the format-5 fixture name each put's key."""
    import io
    import shutil
    from pathlib import Path

    from smallstalk.ops import aof, job_history

    data = tmp_path / "data"
    shutil.copytree(Path(__file__).parents[2] / "snapshots" / "v5" / "log-only", data)
    out = io.StringIO()
    assert aof.main(["dump", str(data), "--op", "put-unique"], stdout=out) == 0
    lines = out.getvalue().splitlines()
    assert any("key order-41 in keyed (kept 3600s after, at most 5)" in x for x in lines)
    assert any('jobs 27 keyed' in x and "key order-42" in x for x in lines)
    out = io.StringIO()
    assert job_history.main([str(data), "27", "--format", "jsonl"], stdout=out) == 0
    assert '"key":"order-42"' in out.getvalue()
