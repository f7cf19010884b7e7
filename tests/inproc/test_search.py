"""`search-jobs` and `bulk-jobs` through the real mutation loop: matches by
substring, regular expression and key in each state, paged by id; a search
runs in slices of bounded work, one per turn, while other sessions are
served; a closed connection frees its search; patterns are bounded; bulk
kick, delete and move log Kick, FlushTube and Move records that replay and a
replica rebuild; a connection that may not run admin commands is refused."""

from __future__ import annotations

import pytest
import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core import search as core_search
from smallstalk.ops.job_history import job_history
from smallstalk.server import search as server_search

from ..support.harness import Client, make_loop
from .test_holdback import assert_replica_agrees, records_of, settle, started
from .test_tube_policies import assert_replays


@pytest.fixture
async def lp(nursery):
    loop = make_loop()
    nursery.start_soon(loop.run)
    return loop


def search(tube: str, state: str, how: str, pattern: bytes, after: int = 0,
           count: int = 1000) -> bytes:
    return b"search-jobs %s %s %s %d %d %d\r\n%s\r\n" % (
        tube.encode(), state.encode(), how.encode(), after, count, len(pattern), pattern)


def bulk(tube: str, state: str, how: str, pattern: bytes, action: str, target: str = "-",
         bound: int = 1_000_000) -> bytes:
    return b"bulk-jobs %s %s %s %s %s %d %d\r\n%s\r\n" % (
        tube.encode(), state.encode(), how.encode(), action.encode(), target.encode(), bound,
        len(pattern), pattern)


async def until(cond) -> None:
    """Let the loop run turns until `cond()` holds (a bounded number of yields)."""
    for _ in range(1000):
        if cond():
            return
        await trio.sleep(0)
    raise AssertionError("the loop never got there")


def ids(reply: bytes) -> list[int]:
    head, _, body = reply.partition(b"\r\n")
    assert head.startswith(b"OK "), reply
    return [int(line[2:]) for line in body.split(b"\n") if line.startswith(b"- ")]


async def mixed(c: Client) -> None:
    """Tube t: jobs 1-4 ready, 5-6 delayed, 7 reserved, 8-9 buried; 10 in tube u."""
    await c.ask(b"use t\r\nwatch t\r\nignore default\r\n")
    for body in (b"apple pie", b"apple tart", b"banana", b"cherry apple"):
        await c.ask(b"put 5 0 60 %d\r\n%s\r\n" % (len(body), body))
    await c.ask(b"put 5 100 60 11\r\napple delay\r\nput 5 100 60 6\r\nfig 42\r\n")
    await c.ask(b"put-unique k7 0 0 60 9\r\napple res\r\n")
    assert (await c.ask(b"reserve-job 7\r\n")).startswith(b"RESERVED 7")
    for body in (b"buried apple", b"buried kiwi"):
        await c.ask(b"put 5 0 60 %d\r\n%s\r\n" % (len(body), body))
    for jid in (8, 9):
        await c.ask(b"reserve-job %d\r\n" % jid)
        assert await c.ask(b"bury %d 0\r\n" % jid) == p.BURIED
    await c.ask(b"use u\r\nput 0 0 60 5\r\napple\r\nuse t\r\n")


async def test_search_by_substring_regex_and_key_in_each_state(lp, autojump_clock) -> None:
    c = Client(lp)
    await mixed(c)
    assert ids(await c.ask(search("t", "ready", "substr", b"apple"))) == [1, 2, 4]
    assert ids(await c.ask(search("t", "delayed", "substr", b"apple"))) == [5]
    assert ids(await c.ask(search("t", "reserved", "substr", b"apple"))) == [7]
    assert ids(await c.ask(search("t", "buried", "substr", b"apple"))) == [8]
    assert ids(await c.ask(search("t", "ready", "substr", b""))) == [1, 2, 3, 4]
    assert ids(await c.ask(search("u", "ready", "substr", b"apple"))) == [10]
    assert ids(await c.ask(search("t", "ready", "regex", rb"^apple (pie|tart)$"))) == [1, 2]
    assert ids(await c.ask(search("t", "delayed", "regex", rb"\d+"))) == [6]
    assert ids(await c.ask(search("t", "buried", "regex", rb"(?i)KIWI"))) == [9]
    assert ids(await c.ask(search("t", "reserved", "key", b"k7"))) == [7]
    assert ids(await c.ask(search("t", "ready", "key", b"k7"))) == []  # not in that state
    assert ids(await c.ask(search("u", "reserved", "key", b"k7"))) == []  # nor that tube
    assert ids(await c.ask(search("nosuch", "ready", "substr", b"a"))) == []
    # A pattern may hold any bytes, CR LF included: it is a counted body.
    assert await c.ask(b"put 0 0 60 6\r\nx\r\ny\x00z\r\n") == b"INSERTED 11\r\n"
    assert ids(await c.ask(search("t", "ready", "substr", b"\r\ny\x00"))) == [11]
    lp.state.check()


async def test_paging_by_after_id(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"use t\r\n")
    for i in range(25):
        await c.ask(b"put 0 0 60 4\r\n%s\r\n" % (b"odd!" if i % 2 else b"even"))
    evens = list(range(1, 26, 2))
    seen, after = [], 0
    while True:
        page = ids(await c.ask(search("t", "ready", "substr", b"even", after, 5)))
        if not page:
            break
        assert len(page) <= 5
        seen += page
        after = page[-1]
    assert seen == evens


async def test_a_big_search_runs_in_bounded_slices_while_others_are_served(
        lp, autojump_clock) -> None:
    n = 3 * core_search.SLICE_PROBES + 500
    c = Client(lp)
    await c.ask(b"use t\r\n")
    for i in range(n):
        c.send(b"put 0 0 60 8\r\njob%05d\r\n" % i)
    await c.recv()
    slices: list[tuple[int, int, int]] = []
    turns: list[int] = []
    searches = lp.searches
    real_slice, real_turn = searches._slice, lp.turn

    def recording_slice(lp_, s):
        reply = real_slice(lp_, s)
        slices.append(searches.last)
        return reply

    def counting_turn(batch):
        before = len(slices)
        calls = real_turn(batch)
        turns.append(len(slices) - before)
        return calls

    searches._slice = recording_slice
    lp.turn = counting_turn
    searcher, other = Client(lp), Client(lp)
    searcher.send(search("t", "ready", "regex", rb"job0000[0-4]"))
    # Another session's command is answered while the search goes on.
    assert (await other.ask(b"stats-tube t\r\n")).startswith(b"OK ")
    assert searches.running
    during = await other.ask(b"ext-stats\r\n")
    assert b"\nsearches-running: 1\n" in during
    assert ids(await searcher.recv()) == [1, 2, 3, 4, 5]
    assert not searches.running
    after = await other.ask(b"ext-stats\r\n")
    assert b"\nsearches-running: 0\n" in after
    assert b"\nsearch-slices: %d\n" % len(slices) in after
    assert len(slices) > 3  # it took several turns
    assert max(turns) == 1  # one slice per turn
    for probed, examined, nbytes in slices:
        assert probed <= core_search.SLICE_PROBES
        assert examined <= probed and nbytes <= core_search.SLICE_BYTES
    assert sum(s[0] for s in slices) == n  # every id looked at once


async def test_big_bodies_end_a_slice_by_bytes(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"use t\r\n")
    body = b"x" * 60_000
    for _ in range(12):
        await c.ask(b"put 0 0 60 %d\r\n%s\r\n" % (len(body), body))
    seen = []
    real = lp.searches._slice

    def recording(lp_, s):
        reply = real(lp_, s)
        seen.append(lp.searches.last)
        return reply

    lp.searches._slice = recording
    assert ids(await c.ask(search("t", "ready", "substr", b"y"))) == []
    assert len(seen) >= 3
    assert all(nbytes < core_search.SLICE_BYTES + 60_000 for _, _, nbytes in seen)


async def test_a_closed_connection_frees_its_search_and_searches_are_bounded(
        lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"use t\r\n")
    for _ in range(4 * core_search.SLICE_PROBES):
        c.send(b"put 0 0 60 4\r\nbody\r\n")
    await c.recv()
    big = search("t", "ready", "regex", b"nothing")
    clients = [Client(lp) for _ in range(server_search.MAX_SEARCHES)]
    for k in clients:
        k.send(big)
    await until(lambda: len(lp.searches.running) == server_search.MAX_SEARCHES)
    extra = Client(lp)
    reply = await extra.ask(big)
    assert reply.startswith(b"BAD_SEARCH ") and b"try again" in reply
    clients[0].close()
    await until(lambda: clients[0].id not in lp.searches.running)
    assert len(lp.searches.running) == server_search.MAX_SEARCHES - 1
    assert ids(await extra.ask(search("t", "ready", "substr", b"body", 0, 3))) == [1, 2, 3]
    for k in clients[1:]:
        assert ids(await k.recv()) == []
    assert not lp.searches.running
    lp.state.check()


async def test_patterns_are_bounded(lp, autojump_clock) -> None:
    c = Client(lp)
    await c.ask(b"use t\r\n")
    await c.ask(b"put 0 0 60 3\r\nabc\r\n")
    long = b"a" * (core_search.PATTERN_MAX + 1)
    # Skipped unread: the command after it is answered as itself.
    reply = await c.ask(search("t", "ready", "substr", long) + b"list-tube-used\r\n")
    assert reply == p.bad_search(f"pattern longer than {core_search.PATTERN_MAX} bytes") \
        + b"USING t\r\n"
    reply = await c.ask(search("t", "ready", "regex", b"a" * (core_search.REGEX_MAX + 1)))
    assert reply.startswith(b"BAD_SEARCH regular expression longer than")
    assert (await c.ask(search("t", "ready", "regex", b"(a"))).startswith(
        b"BAD_SEARCH bad regular expression")
    assert (await c.ask(search("t", "ready", "key", b""))).startswith(b"BAD_SEARCH")
    # A malformed line with a readable byte count: the body is read, not run.
    assert await c.ask(b"search-jobs t ready nosuch 0 5 7\r\nput 0 0\r\n") == p.BAD_FORMAT
    assert await c.ask(b"search-jobs t ready substr 0 5 3\r\nabc!!") == p.EXPECTED_CRLF
    assert await c.ask(b"bulk-jobs t ready substr move - 5 1\r\na\r\n") == p.BAD_FORMAT
    assert await c.ask(b"bulk-jobs t ready substr kick u 5 1\r\na\r\n") == p.BAD_FORMAT
    assert (await c.ask(bulk("t", "reserved", "substr", b"a", "delete"))).startswith(
        b"BAD_SEARCH delete takes jobs that are")
    assert (await c.ask(bulk("t", "ready", "substr", b"a", "kick"))).startswith(b"BAD_SEARCH")
    assert (await c.ask(bulk("t", "ready", "substr", b"a", "move", "t"))).startswith(
        b"BAD_SEARCH")
    # A tube name of 200 bytes fits the longer line.
    name = "n" * 200
    assert await c.ask(bulk(name, "ready", "substr", b"a", "move", "m" * 200)) == p.acted(0)
    # What a backtracking engine never finishes, RE2 matches in linear time.
    body = b"a" * 60_000 + b"!"
    await c.ask(b"put 0 0 60 %d\r\n%s\r\n" % (len(body), body))
    assert ids(await c.ask(search("t", "ready", "regex", rb"(a+)+$"))) == []
    assert ids(await c.ask(search("t", "ready", "regex", rb"(a|aa)+!"))) == [2]


async def test_admin_only(lp, autojump_clock) -> None:
    c = Client(lp, peer="192.0.2.7", transport="tcp")
    reply = await c.ask(search("t", "ready", "substr", b"a"))
    assert reply.startswith(p.UNAUTHORIZED_WORD + b" admin commands from 192.0.2.7")
    reply = await c.ask(bulk("t", "ready", "substr", b"a", "delete"))
    assert reply.startswith(p.UNAUTHORIZED_WORD)
    assert await c.ask(b"list-tube-used\r\n") == b"USING default\r\n"


async def test_bulk_kick_delete_move_replay_and_replica(nursery, tmp_path,
                                                         autojump_clock) -> None:
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    await mixed(c)
    n = server_search.ACT_SLICE + 40  # more than one slice of moves
    for i in range(n):
        c.send(b"put 0 0 60 7\r\nmany%03d\r\n" % (i % 1000))
    await c.recv()
    assert await c.ask(bulk("t", "ready", "substr", b"apple", "count")) == p.counted(3)
    assert await c.ask(bulk("t", "ready", "substr", b"apple", "count", bound=2)) == p.counted(2)
    # Kick: the buried apple (8), not the kiwi.
    assert await c.ask(bulk("t", "buried", "regex", b"apple$", "kick")) == p.acted(1)
    assert lp.state.jobs[8].state == 0 and lp.state.jobs[9].state == 3
    # Delete at most 2 of the now 4 ready apples: the lowest ids.
    assert await c.ask(bulk("t", "ready", "substr", b"apple", "delete", bound=2)) == p.acted(2)
    assert 1 not in lp.state.jobs and 2 not in lp.state.jobs and 4 in lp.state.jobs
    # Move every "many" job, then the delayed apple, to tube v.
    assert await c.ask(bulk("t", "ready", "substr", b"many", "move", "v")) == p.acted(n)
    assert await c.ask(bulk("t", "delayed", "key", b"nokey", "move", "v")) == p.acted(0)
    assert await c.ask(bulk("t", "delayed", "substr", b"apple", "move", "v")) == p.acted(1)
    st = lp.state
    assert st.tubes["v"].ready_n == n and st.jobs[5].tube.name == "v"
    assert st.jobs[5].state == 1
    kicks = records_of(tmp_path, r.Kick)
    assert [k.ids for k in kicks] == [(8,)]
    flushes = records_of(tmp_path, r.FlushTube)
    assert [(f.tube, f.ids) for f in flushes] == [("t", (1, 2))]
    moves = records_of(tmp_path, r.Move)
    assert len(moves) == n + 1 and {m.tube for m in moves} == {"v"}
    steps = job_history(tmp_path, 1).steps
    assert steps[-1].text == f"deleted by conn {c.id}'s flush-tube or bulk-jobs delete in t " \
        "(with 1 other job)"
    st.check()
    await settle()
    assert_replays(lp, tmp_path)
    await assert_replica_agrees(lp, tmp_path, nursery)


async def test_search_runs_on_a_replica_and_bulk_actions_do_not(autojump_clock,
                                                                 nursery) -> None:
    lp = make_loop()
    nursery.start_soon(lp.run)
    c = Client(lp)
    await c.ask(b"use t\r\nput 0 0 60 1\r\na\r\n")
    lp.read_only = "replica"
    assert ids(await c.ask(search("t", "ready", "substr", b"a"))) == [1]
    assert await c.ask(bulk("t", "ready", "substr", b"a", "count")) == p.counted(1)
    assert await c.ask(bulk("t", "ready", "substr", b"a", "delete")) == p.READ_ONLY
    assert 1 in lp.state.jobs


async def test_bodies_on_disk_are_read_back_and_searched(nursery, tmp_path,
                                                         autojump_clock) -> None:
    from .test_readbehind import assert_replays as assert_replays_resolved
    from .test_readbehind import make_loop as make_readbehind_loop

    lp = make_readbehind_loop(tmp_path, max_memory=4096)
    nursery.start_soon(lp.run)
    c = Client(lp)
    await c.ask(b"use t\r\n")
    for i in range(40):
        body = (b"needle %d " % i if i % 10 == 3 else b"hay %d " % i) + b"x" * 1000
        assert (await c.ask(b"put 0 0 60 %d\r\n%s\r\n" % (len(body), body))).startswith(
            b"INSERTED")
    await settle()
    spilled = [j.id for j in lp.state.jobs.values() if isinstance(j.body, int)]
    assert len(spilled) > 30  # most bodies live on disk only
    assert ids(await c.ask(search("t", "ready", "substr", b"needle"))) == [4, 14, 24, 34]
    assert ids(await c.ask(search("t", "ready", "regex", rb"^needle \d3 "))) == [14, 24, 34]
    assert await c.ask(bulk("t", "ready", "substr", b"needle", "delete")) == p.acted(4)
    lp.state.check()
    assert_replays_resolved(lp, tmp_path)


async def test_a_failed_commit_in_the_middle_of_a_bulk_action_is_no_acknowledgement(
        nursery, tmp_path, autojump_clock, monkeypatch) -> None:
    """A slice's records lost to a disk error must not be counted in `ACTED n`: the
    action answers INTERNAL_ERROR, the state is what the disk holds, and running
    it again moves the rest."""
    lp = await started(nursery, tmp_path)
    c = Client(lp)
    n = server_search.ACT_SLICE + 50  # two slices of moves ...
    for _i in range(n):
        c.send(b"put 0 0 60 4\r\nmove\r\n")
    for _i in range(3 * 2048):  # ... then slices that match nothing
        c.send(b"put 0 0 60 4\r\nstay\r\n")
    await c.recv()
    writes = []
    real = lp.journal.segment.write

    def second_write_fails(*args):
        writes.append(1)
        if len(writes) == 2:  # the turn of the second slice's moves
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(lp.journal.segment, "write", second_write_fails)
    assert await c.ask(bulk("default", "ready", "substr", b"move", "move", "v")) \
        == p.INTERNAL_ERROR
    monkeypatch.undo()
    moved = [j for j in lp.state.jobs.values() if j.tube.name == "v"]
    assert len(moved) == server_search.ACT_SLICE  # the first slice's, on disk
    assert_replays(lp, tmp_path)
    await trio.sleep(2)  # past the refusal after a failed commit
    assert await c.ask(bulk("default", "ready", "substr", b"move", "move", "v")) \
        == p.acted(n - server_search.ACT_SLICE)
    assert_replays(lp, tmp_path)
