"""Read-behind: bodies past a memory budget live on disk.

Unit tests of the body store and the snapshot reader/writer; the real mutation
loop in-process (spill after commit, peek/reserve byte for byte, per-tube
budgets, fanout copies sharing a reference, read errors, compaction remap,
recovery under a budget, a replica, replay equality). The real-process tests
(RSS bound, SIGKILL crash round) are in tests/procs/test_readbehind.py; tube
policies (limits, expiry, fanout) in tests/inproc/test_tube_policies.py.
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import trio

from smallstalk.core import protocol as p
from smallstalk.core.state import State
from smallstalk.server.loop import MutationLoop
from smallstalk.server.policy import Policies, TubePolicy
from smallstalk.storage import aof, compactor, logread, snapshot, snapshot_codec
from smallstalk.storage.bodies import BodyStore, resolve_items
from smallstalk.storage.journal import FSYNC_NEVER, Journal
from smallstalk.storage.recovery import recover

from ..support.harness import Client, mock_wall_clock
from ..support.readbehind import in_memory, open_fds, rand_bodies


def make_loop(data_dir: Path, max_memory: int, policies: Policies | None = None,
              **journal_kw) -> MutationLoop:
    store = BodyStore(max_memory)
    state = recover(data_dir, bodies=store).state
    journal = Journal(data_dir, state.last_seq + 1, fsync=journal_kw.pop("fsync", FSYNC_NEVER),
                      **journal_kw)
    lp = MutationLoop(state, journal, data_dir, clock=mock_wall_clock)
    if policies is not None:
        lp.policies = policies
    lp.use_bodies(store)
    return lp


def put_cmd(body: bytes, pri: int = 0) -> bytes:
    return p.render(p.Put(pri, 0, 600, body))


async def put_many(c: Client, bodies: list[bytes]) -> dict[int, bytes]:
    out = {}
    for b in bodies:
        reply = await c.ask(put_cmd(b))
        assert reply.startswith(b"INSERTED "), reply
        out[int(reply.split()[1])] = b
    return out


def stat(reply: bytes, key: str) -> str:
    for line in reply.decode().splitlines():
        if line.startswith(key + ": "):
            return line.split(": ", 1)[1]
    raise KeyError(key)


def resolved_dump(lp: MutationLoop) -> list:
    return [x for x in resolve_items(snapshot_codec.dump(lp.state), lp.bodies) if x[0] != "conn"]


def assert_replays(lp: MutationLoop, data_dir: Path) -> None:
    """The data directory rebuilds the live state, bodies read back byte for byte."""
    lp.state.check()
    rebuilt = recover(data_dir, repair=False).state
    rebuilt.check()
    assert [x for x in snapshot_codec.dump(rebuilt) if x[0] != "conn"] == resolved_dump(lp)


# --- the loop ----------------------------------------------------------------------------


async def test_spill_after_commit_and_bodies_come_back(nursery, tmp_path, autojump_clock) -> None:
    lp = make_loop(tmp_path, 10_000)
    nursery.start_soon(lp.run)
    c = Client(lp)
    jobs = await put_many(c, rand_bodies(80))
    st = lp.state
    assert in_memory(st) <= 10_000
    assert st.spilled_bytes > 100_000
    st.check()
    reply = await c.ask(b"ext-stats\r\n")
    assert stat(reply, "max-memory") == "10000"
    assert int(stat(reply, "bytes-on-disk")) == st.spilled_bytes
    assert int(stat(reply, "bytes-in-memory")) == in_memory(st)
    tube = await c.ask(b"ext-stats-tube default\r\n")
    assert int(stat(tube, "bytes-on-disk")) == st.spilled_bytes
    for jid, body in jobs.items():
        assert await c.ask(b"peek %d\r\n" % jid) == p.found(jid, body)
    assert await c.ask(b"peek-ready\r\n") == p.found(1, jobs[1])
    for _ in jobs:
        reply = await c.ask(b"reserve\r\n")
        jid = int(reply.split()[1])
        assert reply == p.reserved(jid, jobs[jid])
        assert await c.ask(b"delete %d\r\n" % jid) == b"DELETED\r\n"
    assert int(stat(await c.ask(b"ext-stats\r\n"), "body-reads")) >= len(jobs)
    assert st.spilled_bytes == st.body_bytes == 0
    assert not lp.bodies.files, "no job refers to a file: every fd is closed"


async def test_newest_bodies_spill_first(nursery, tmp_path, autojump_clock) -> None:
    lp = make_loop(tmp_path, 5000)
    nursery.start_soon(lp.run)
    c = Client(lp)
    # One turn with many puts: the oldest stay in memory, the newest go to disk.
    bodies = [bytes([i]) * 1000 for i in range(20)]
    reply = await c.ask(b"".join(put_cmd(b) for b in bodies))
    assert reply.count(b"INSERTED") == 20
    kept = [jid for jid, j in lp.state.jobs.items() if isinstance(j.body, bytes)]
    assert kept == [1, 2, 3, 4, 5]


async def test_waiting_reserve_and_release_bury_kick_keep_bytes(nursery, tmp_path,
                                                                 autojump_clock) -> None:
    lp = make_loop(tmp_path, 1)
    nursery.start_soon(lp.run)
    worker, producer = Client(lp), Client(lp)
    worker.send(b"reserve\r\n")
    await trio.sleep(1)
    body = os.urandom(3000)
    assert await producer.ask(put_cmd(body)) == b"INSERTED 1\r\n"
    assert await worker.recv() == p.reserved(1, body)
    assert isinstance(lp.state.jobs[1].body, int)
    assert await worker.ask(b"release 1 5 0\r\n") == b"RELEASED\r\n"
    assert await worker.ask(b"reserve\r\n") == p.reserved(1, body)
    assert await worker.ask(b"bury 1 5\r\n") == b"BURIED\r\n"
    assert await worker.ask(b"peek-buried\r\n") == p.found(1, body)
    assert await worker.ask(b"kick 1\r\n") == b"KICKED 1\r\n"
    assert await worker.ask(b"reserve-job 1\r\n") == p.reserved(1, body)
    assert_replays(lp, tmp_path)


async def test_per_tube_budget(nursery, tmp_path, autojump_clock) -> None:
    pol = Policies(TubePolicy(), {"big": TubePolicy(max_memory=4000)})
    lp = make_loop(tmp_path, 0, pol)
    nursery.start_soon(lp.run)
    c = Client(lp)
    small = await put_many(c, rand_bodies(20, seed=2))
    await c.ask(b"use big\r\n")
    big = await put_many(c, rand_bodies(20, seed=3))
    st = lp.state
    assert st.tubes["default"].spilled_n == 0, "no server budget: default keeps its bodies"
    t = st.tubes["big"]
    assert t.bytes_n - t.spilled_n <= 4000 < t.bytes_n
    tube = await c.ask(b"ext-stats-tube big\r\n")
    assert int(stat(tube, "bytes-on-disk")) == t.spilled_n
    for jid, body in {**small, **big}.items():
        assert await c.ask(b"peek %d\r\n" % jid) == p.found(jid, body)
    assert_replays(lp, tmp_path)


async def test_fanout_copies_share_one_reference(nursery, tmp_path, autojump_clock) -> None:
    lp = make_loop(tmp_path, 1)
    nursery.start_soon(lp.run)
    c = Client(lp)
    await c.ask(b"watch feed+a\r\nwatch feed+b\r\nuse feed\r\n")
    body = os.urandom(2000)
    assert await c.ask(put_cmd(body)) == b"INSERTED 1\r\n"
    jobs = lp.state.jobs
    assert sorted(jobs) == [1, 2, 3]
    refs = {jobs[j].body for j in jobs}
    assert len(refs) == 1 and isinstance(next(iter(refs)), int)
    (f,) = lp.bodies.files.values()
    assert f.refs == 3
    for jid in (1, 2, 3):
        assert await c.ask(b"peek %d\r\n" % jid) == p.found(jid, body)
    assert await c.ask(b"delete 1\r\ndelete 2\r\n") == b"DELETED\r\nDELETED\r\n"
    assert f.refs == 1 and lp.bodies.files
    assert await c.ask(b"peek 3\r\n") == p.found(3, body)
    assert_replays(lp, tmp_path)
    assert await c.ask(b"delete 3\r\n") == b"DELETED\r\n"
    assert not lp.bodies.files


async def test_a_body_that_cannot_be_read_is_an_internal_error(nursery, tmp_path,
                                                               autojump_clock) -> None:
    lp = make_loop(tmp_path, 1)
    nursery.start_soon(lp.run)
    c = Client(lp)
    jobs = await put_many(c, rand_bodies(3))
    seg = lp.journal.segment
    os.truncate(seg.path, seg.size - 100)  # the last body's tail is gone
    assert await c.ask(b"peek 3\r\n") == p.INTERNAL_ERROR
    assert await c.ask(b"peek 1\r\n") == p.found(1, jobs[1])
    # A reserve that gets it: the reservation stands (the TTR gives it back),
    # the client hears INTERNAL_ERROR, and the server goes on.
    assert await c.ask(b"reserve-job 3\r\n") == p.INTERNAL_ERROR
    assert lp.state.jobs[3].state == 2
    assert await c.ask(b"reserve\r\n") == p.reserved(1, jobs[1])


async def test_compaction_moves_references_to_the_new_snapshot(nursery, tmp_path, autojump_clock,
                                                               monkeypatch) -> None:
    monkeypatch.setattr(compactor, "REMAP_CHUNK", 7)  # several loop turns
    lp = make_loop(tmp_path, 8000, segment_records=10)
    nursery.start_soon(lp.run)
    c = Client(lp)
    jobs = await put_many(c, rand_bodies(60))
    for jid in list(jobs)[::3]:  # some gone before the fold
        assert await c.ask(b"delete %d\r\n" % jid) == b"DELETED\r\n"
        del jobs[jid]
    closed = lp.journal.closed_segments()
    assert len(closed) >= 5
    store = lp.bodies
    assert store.keys_of(closed), "spilled bodies point into closed segments"
    snap = compactor.fold(tmp_path, closed, max_memory=5000)
    assert snapshot.index_path(snap).exists()
    compactor.remove_folded(tmp_path, snap)
    assert not any(p.exists() for p in closed)
    # Deleted, but the store's fds keep them readable until the remap.
    for jid, body in jobs.items():
        assert await c.ask(b"peek %d\r\n" % jid) == p.found(jid, body)
    moved = await compactor.remap(lp, snap, closed)
    assert moved > 0
    assert not snapshot.index_path(snap).exists()
    assert not store.keys_of(closed), "no reference into a folded segment is left"
    paths = {f.path for f in store.files.values()}
    assert paths <= {str(snap), str(lp.journal.segment.path)}
    fds = open_fds()
    assert not any(str(p) in x for p in closed for x in fds), "their fds are closed"
    for jid, body in jobs.items():
        assert await c.ask(b"peek %d\r\n" % jid) == p.found(jid, body)
    # A second fold: the references into the first snapshot move on again.
    jobs.update(await put_many(c, rand_bodies(30, seed=5)))
    closed = lp.journal.closed_segments()
    snap2 = compactor.fold(tmp_path, closed, max_memory=5000)
    compactor.remove_folded(tmp_path, snap2)
    await compactor.remap(lp, snap2, closed)
    assert not snap.exists()
    assert {f.path for f in store.files.values()} <= {str(snap2), str(lp.journal.segment.path)}
    for jid, body in jobs.items():
        assert await c.ask(b"peek %d\r\n" % jid) == p.found(jid, body)
    assert_replays(lp, tmp_path)


def test_compactor_child_with_a_budget_writes_every_body(tmp_path: Path) -> None:
    """The fold under a tiny budget reads bodies back from the old files: the
    snapshot it writes holds every body byte for byte."""
    st = State()
    journal_bodies = rand_bodies(40, 100, 4000, seed=9)

    async def main():
        lp = make_loop(tmp_path, 1, segment_records=7)
        async with trio.open_nursery() as n:
            n.start_soon(lp.run)
            c = Client(lp)
            await put_many(c, journal_bodies[:20])
            closed = lp.journal.closed_segments()
            snap = compactor.fold(tmp_path, closed, max_memory=1000)
            compactor.remove_folded(tmp_path, snap)
            await put_many(c, journal_bodies[20:])
            closed = lp.journal.closed_segments()
            compactor.main(["--max-memory", "1000", str(tmp_path), *map(str, closed)])
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    snaps = aof.list_snapshots(tmp_path / "snapshots")
    st = snapshot.load(snaps[-1][1])
    got = {j.id: j.body for j in st.jobs.values()}
    want = dict(enumerate(journal_bodies, 1))
    assert {k: got[k] for k in got} == {k: want[k] for k in got}
    assert len(got) >= 20


async def test_recovery_under_a_budget(nursery, tmp_path, autojump_clock) -> None:
    lp = make_loop(tmp_path, 0, segment_records=10)
    nursery.start_soon(lp.run)
    c = Client(lp)
    jobs = await put_many(c, rand_bodies(40))
    closed = lp.journal.closed_segments()
    snap = compactor.fold(tmp_path, closed)
    compactor.remove_folded(tmp_path, snap)
    jobs.update(await put_many(c, rand_bodies(40, seed=7)))
    assert lp.state.spilled_bytes == 0
    # Snapshot and segments after it, rebuilt under a budget.
    store = BodyStore(12_000)
    st = recover(tmp_path, repair=False, bodies=store).state
    st.check()
    assert st.on_body_dropped == store.drop
    assert in_memory(st) <= 12_000
    assert st.spilled_bytes > 0
    assert any(f.path == str(snap) for f in store.files.values())
    assert any(f.path.endswith(".aof") for f in store.files.values())
    for jid, body in jobs.items():
        j = st.jobs[jid]
        assert (store.read(j.body) if isinstance(j.body, int) else j.body) == body
    store.close()


async def test_restart_under_a_budget_serves_every_body(tmp_path, autojump_clock) -> None:
    bodies = rand_bodies(50)

    async def run(fn):
        lp = make_loop(tmp_path, 6000, segment_records=13)
        async with trio.open_nursery() as n:
            n.start_soon(lp.run)
            out = await fn(lp, Client(lp))
            n.cancel_scope.cancel()
        lp.journal.close()
        lp.bodies.close()
        return out

    async def first(lp, c):
        jobs = await put_many(c, bodies)
        closed = lp.journal.closed_segments()
        snap = compactor.fold(tmp_path, closed[:2], max_memory=3000)
        compactor.remove_folded(tmp_path, snap)
        await compactor.remap(lp, snap, closed[:2])
        return jobs

    async def second(lp, c):
        assert in_memory(lp.state) <= 6000
        got = {}
        for _ in range(len(bodies)):
            reply = await c.ask(b"reserve-with-timeout 0\r\n")
            jid = int(reply.split()[1])
            got[jid] = reply.split(b"\r\n", 1)[1][:-2]
            assert await c.ask(b"delete %d\r\n" % jid) == b"DELETED\r\n"
        return got

    jobs = await run(first)
    assert await run(second) == jobs


async def test_a_failed_commit_rebuilds_under_the_budget(nursery, tmp_path, autojump_clock,
                                                         monkeypatch) -> None:
    lp = make_loop(tmp_path, 3000)
    nursery.start_soon(lp.run)
    c = Client(lp)
    jobs = await put_many(c, rand_bodies(10))
    old_store = lp.bodies

    def broken_write():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lp.journal.segment, "write", broken_write)
    assert await c.ask(put_cmd(b"lost")) == p.INTERNAL_ERROR
    monkeypatch.undo()
    assert lp.bodies is not old_store and not old_store.files
    assert lp.state.on_body_dropped == lp.bodies.drop
    assert in_memory(lp.state) <= 3000 and lp.state.spilled_bytes
    await trio.sleep(2)  # past the refusal period
    for jid, body in jobs.items():
        assert await c.ask(b"peek %d\r\n" % jid) == p.found(jid, body)
    jobs.update(await put_many(c, rand_bodies(5, seed=4)))
    for jid, body in jobs.items():
        assert await c.ask(b"peek %d\r\n" % jid) == p.found(jid, body)
    assert_replays(lp, tmp_path)


async def test_replica_spills_what_it_applies(nursery, tmp_path, autojump_clock) -> None:
    from smallstalk.replication.follower import install_snapshot

    primary = make_loop(tmp_path / "p", 0, segment_records=10)
    nursery.start_soon(primary.run)
    c = Client(primary)
    jobs = await put_many(c, rand_bodies(30))
    replica = make_loop(tmp_path / "r", 9000)
    replica.read_only = "replica"
    replica.role = "replica"
    nursery.start_soon(replica.run)
    records = []
    for _first, path in aof.list_segments(tmp_path / "p" / "aof"):
        records += [e[1] for e in logread.iter_segment(path) if not isinstance(e, aof.FrameScan)]
    await replica.call(replica.apply_replicated, records)
    st = replica.state
    assert in_memory(st) <= 9000 and st.spilled_bytes
    rc = Client(replica)
    for jid, body in jobs.items():
        assert await rc.ask(b"peek %d\r\n" % jid) == p.found(jid, body)
    assert_replays(replica, tmp_path / "r")
    # A full resync: the primary's snapshot installed under the budget.
    closed = primary.journal.closed_segments()
    snap = compactor.fold(tmp_path / "p", closed)
    tmp = tmp_path / "r" / "resync.snap.tmp"
    tmp.write_bytes(snap.read_bytes())
    old_store = replica.bodies
    await replica.call(install_snapshot, replica, tmp, int(snap.stem))
    assert not tmp.exists() and not old_store.files
    st = replica.state
    assert st.on_body_dropped == replica.bodies.drop and in_memory(st) <= 9000 and st.spilled_bytes
    (f,) = replica.bodies.files.values()
    assert f.path == str(tmp_path / "r" / "snapshots" / snap.name)
    for jid in st.jobs:
        assert await rc.ask(b"peek %d\r\n" % jid) == p.found(jid, jobs[jid])


async def test_replay_equals_live_with_compactions(nursery, tmp_path, autojump_clock) -> None:
    """Random work under a budget, folds in between: the directory replays to the
    live state, every spilled body resolved."""
    rnd = random.Random(42)
    lp = make_loop(tmp_path, 20_000, segment_records=25)
    nursery.start_soon(lp.run)
    clients = [Client(lp) for _ in range(3)]
    await clients[1].ask(b"use other\r\nwatch other\r\n")
    digest = {}
    for step in range(400):
        c = rnd.choice(clients)
        op = rnd.random()
        if op < 0.5:
            body = rnd.randbytes(rnd.randint(0, 4000))
            reply = await c.ask(put_cmd(body, rnd.randint(0, 3)))
            digest[int(reply.split()[1])] = hashlib.sha256(body).digest()
        elif op < 0.8:
            reply = await c.ask(b"reserve-with-timeout 0\r\n")
            if reply.startswith(b"RESERVED"):
                jid = int(reply.split()[1])
                body = reply.split(b"\r\n", 1)[1][:-2]
                assert hashlib.sha256(body).digest() == digest[jid]
                nxt = rnd.choice([b"delete %d\r\n", b"release %d 1 0\r\n", b"bury %d 2\r\n"])
                await c.ask(nxt % jid)
        elif op < 0.85:
            await c.ask(b"kick 3\r\n")
        if step % 100 == 99:
            closed = lp.journal.closed_segments()
            if closed:
                snap = compactor.fold(tmp_path, closed, max_memory=4000)
                compactor.remove_folded(tmp_path, snap)
                await compactor.remap(lp, snap, closed)
            assert_replays(lp, tmp_path)
    assert lp.state.spilled_bytes
    assert_replays(lp, tmp_path)
