"""Replay equals live: random command sequences, rebuilt from snapshot + AOF.

For random workloads from several connections (with time passing, so delays,
TTRs and expiries fire, tube limits that refuse or discard, a fanout tube, and
compactions at random points), the state rebuilt from the
data directory must encode exactly like the live state, and the state's
invariants must hold after every step.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import cbor2
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smallstalk.core import protocol as p
from smallstalk.server.policy import Policies, TubePolicy
from smallstalk.storage import compactor, snapshot_codec
from smallstalk.storage.recovery import recover

from ..support.harness import Client, make_loop

TUBES = ["default", "a", "b", "a+x"]
# a: small and drops its oldest; b: jobs expire into a; default: a byte limit.
POLICIES = Policies(TubePolicy(max_bytes=40), {
    "a": TubePolicy(max_jobs=3, discard_old_when_full=True),
    "b": TubePolicy(max_age=3, expire_to="a"),
})
ids = st.integers(1, 12)
commands = st.one_of(
    st.builds(lambda pri, d, ttr, body, age: p.render(p.Put(pri, d, ttr, body, age)),
              st.integers(0, 2000), st.sampled_from([0, 0, 1, 5]), st.integers(0, 4),
              st.binary(max_size=8), st.sampled_from([0, 0, 2, 6])),
    st.just(b"delete-tube a+x\r\n"),
    st.just(b"reserve-with-timeout 0\r\n"), st.just(b"reserve-with-timeout 2\r\n"),
    st.builds(lambda i: b"reserve-job %d\r\n" % i, ids),
    st.builds(lambda i: b"delete %d\r\n" % i, ids),
    st.builds(lambda i, pri, d: b"release %d %d %d\r\n" % (i, pri, d), ids,
              st.integers(0, 2000), st.sampled_from([0, 0, 3])),
    st.builds(lambda i: b"bury %d 1\r\n" % i, ids),
    st.builds(lambda i: b"touch %d\r\n" % i, ids),
    st.builds(lambda n: b"kick %d\r\n" % n, st.integers(0, 3)),
    st.builds(lambda i: b"kick-job %d\r\n" % i, ids),
    st.builds(lambda t: b"use %s\r\n" % t.encode(), st.sampled_from(TUBES)),
    st.builds(lambda t: b"watch %s\r\n" % t.encode(), st.sampled_from(TUBES)),
    st.builds(lambda t: b"ignore %s\r\n" % t.encode(), st.sampled_from(TUBES)),
    st.builds(lambda t: b"pause-tube %s 2\r\n" % t.encode(), st.sampled_from(TUBES)),
    st.builds(lambda t: b"flush-tube %s\r\n" % t.encode(), st.sampled_from(TUBES)),
)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("cmd"), st.integers(0, 2), commands),
        st.tuples(st.just("sleep"), st.sampled_from([0.5, 1.5, 4.0])),
        st.tuples(st.just("close"), st.integers(0, 2)),
        st.tuples(st.just("compact")),
    ),
    max_size=60,
)


async def run_steps(data_dir: Path, plan: list) -> None:
    lp = make_loop(data_dir, segment_records=7)
    lp.policies = POLICIES
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lp.run)
        clients = [Client(lp) for _ in range(3)]
        for step in plan:
            kind = step[0]
            if kind == "cmd":
                await clients[step[1]].ask(step[2])
            elif kind == "sleep":
                await trio.sleep(step[1])
            elif kind == "close":
                clients[step[1]].close()
                clients[step[1]] = Client(lp)
            else:
                closed = lp.journal.closed_segments()
                if closed:
                    snap = compactor.fold(data_dir, closed)
                    compactor.remove_folded(data_dir, snap)
            await trio.testing.wait_all_tasks_blocked()
            lp.state.check()
        await lp.journal.commit()
        rebuilt = recover(data_dir, repair=False).state
        rebuilt.check()
        live, again = list(snapshot_codec.dump(lp.state)), list(snapshot_codec.dump(rebuilt))
        diff = [(a, b) for a, b in zip(live, again, strict=False) if a != b]
        assert cbor2.dumps(again) == cbor2.dumps(live), diff
        nursery.cancel_scope.cancel()


@given(steps)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_replay_rebuilds_the_live_state(plan: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(run_steps, Path(tmp), plan, clock=trio.testing.MockClock(autojump_threshold=0))
