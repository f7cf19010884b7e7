"""list-jobs and flush-tube through the real loop (in-process), and their replay."""

from __future__ import annotations

import pytest
import trio

from smallstalk.core import protocol as p
from smallstalk.storage.recovery import recover

from ..support.harness import Client, make_loop


def ids(reply: bytes) -> list[int]:
    head, _, body = reply.partition(b"\r\n")
    assert head.startswith(b"OK ")
    assert int(head[3:]) == len(body) - 2
    return [int(line[2:]) for line in body.split(b"\n") if line.startswith(b"- ")]


async def test_list_jobs_in_hand_out_order_and_paged(nursery, autojump_clock) -> None:
    lp = make_loop()
    nursery.start_soon(lp.run)
    c = Client(lp)
    await c.ask(b"use t\r\n")
    pris = [5, 1, 5, 0, 3, 1, 9, 0]
    for pri in pris:
        await c.ask(b"put %d 0 60 1\r\nx\r\n" % pri)
    order = [i for _, i in sorted((pri, i) for i, pri in enumerate(pris, 1))]
    assert ids(await c.ask(b"list-jobs t ready 0 100\r\n")) == order
    got, after = [], 0
    while True:  # pages of three, each after the last id seen
        page = ids(await c.ask(b"list-jobs t ready %d 3\r\n" % after))
        if not page:
            break
        got += page
        after = page[-1]
    assert got == order
    # The list is the order reserves take: watch t, reserve twice.
    await c.ask(b"watch t\r\nignore default\r\n")
    first = [int((await c.ask(b"reserve\r\n")).split()[1]) for _ in range(2)]
    assert first == order[:2]
    assert ids(await c.ask(b"list-jobs t reserved 0 10\r\n")) == sorted(first)
    assert ids(await c.ask(b"list-jobs t ready 0 100\r\n")) == order[2:]
    await c.ask(b"bury %d 0\r\nbury %d 0\r\n" % (first[1], first[0]))
    assert ids(await c.ask(b"list-jobs t buried 0 10\r\n")) == [first[1], first[0]]
    assert ids(await c.ask(b"list-jobs t buried %d 10\r\n" % first[1])) == [first[0]]
    await c.ask(b"put 0 30 60 1\r\nd\r\nput 0 10 60 1\r\ne\r\n")
    assert ids(await c.ask(b"list-jobs t delayed 0 10\r\n")) == [10, 9]
    assert ids(await c.ask(b"list-jobs nosuch ready 0 10\r\n")) == []


@pytest.mark.parametrize("line", [
    b"list-jobs t ready 0", b"list-jobs t waiting 0 10", b"list-jobs -t ready 0 1",
    b"list-jobs t ready x 1", b"list-jobs t ready 0 99999999999",
    b"flush-tube -bad",
])
async def test_malformed_lines_are_bad_format(line: bytes, nursery, autojump_clock) -> None:
    lp = make_loop()
    nursery.start_soon(lp.run)
    assert await Client(lp).ask(line + b"\r\n") == p.BAD_FORMAT


async def test_count_is_capped(nursery, autojump_clock) -> None:
    lp = make_loop()
    nursery.start_soon(lp.run)
    c = Client(lp)
    await c.ask(b"".join(b"put 0 0 60 1\r\nx\r\n" for _ in range(p.LIST_JOBS_MAX + 5)))
    assert len(ids(await c.ask(b"list-jobs default ready 0 5000\r\n"))) == p.LIST_JOBS_MAX


async def test_flush_tube_deletes_all_but_reserved_and_replays(tmp_path, nursery,
                                                              autojump_clock) -> None:
    lp = make_loop(tmp_path)
    nursery.start_soon(lp.run)
    c, other = Client(lp), Client(lp)
    await c.ask(b"use t\r\nwatch t\r\n")
    await c.ask(b"".join(b"put 0 0 60 1\r\nx\r\n" for _ in range(4)))
    await c.ask(b"put 0 100 60 1\r\nd\r\n")
    await c.ask(b"reserve\r\n")  # job 1 stays with its worker
    await c.ask(b"reserve\r\n")
    await c.ask(b"bury 2 0\r\n")
    await other.ask(b"put 0 0 60 4\r\nkeep\r\n")  # default: untouched
    assert await other.ask(b"flush-tube t\r\n") == b"FLUSHED 4\r\n"
    stats = await c.ask(b"stats-tube t\r\n")
    assert b"current-jobs-ready: 0\n" in stats and b"current-jobs-reserved: 1\n" in stats
    assert b"current-jobs-buried: 0\n" in stats and b"current-jobs-delayed: 0\n" in stats
    assert await c.ask(b"delete 1\r\n") == p.DELETED
    assert await other.ask(b"flush-tube nosuch\r\n") == p.NOT_FOUND
    assert await other.ask(b"flush-tube default\r\n") == b"FLUSHED 1\r\n"
    await trio.sleep(0.1)
    lp.journal.close()
    again = recover(tmp_path).state
    assert sorted(again.jobs) == sorted(lp.state.jobs) == []


async def test_flush_tube_is_refused_on_a_replica(nursery, autojump_clock) -> None:
    lp = make_loop()
    lp.read_only = "replica"
    nursery.start_soon(lp.run)
    assert await Client(lp).ask(b"flush-tube default\r\n") == p.READ_ONLY
