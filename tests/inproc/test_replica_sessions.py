"""Session ids on replicas: a range of each process's own (server/loop.py, REPLICA_SESSIONS).

A replica's local clients must never take an id that its primary's records
use, nor one a promoted member will use: with automatic failover every member
starts as a replica and any may be promoted, so each process draws its own
range, and a promoted replica's connections go on in it.
"""

from __future__ import annotations

from smallstalk.core.state import State
from smallstalk.server.loop import REPLICA_RANGE, REPLICA_SESSIONS, MutationLoop


def _ids(lp: MutationLoop, n: int) -> list[int]:
    return [lp.open_session(lambda *a: None).id for _ in range(n)]


def test_each_replica_process_takes_a_range_of_its_own() -> None:
    loops = [MutationLoop(State()) for _ in range(3)]
    ranges = []
    for lp in loops:
        lp.become_replica(None)
        ids = _ids(lp, 3)
        assert ids[0] >= REPLICA_SESSIONS and ids == [ids[0], ids[0] + 1, ids[0] + 2]
        ranges.append(ids[0] // REPLICA_RANGE)
    assert len(set(ranges)) == 3  # (a clash is a 1 in 16 million chance)


def test_a_promoted_replica_goes_on_in_its_range_past_the_logged_ids() -> None:
    a, b = MutationLoop(State()), MutationLoop(State())
    for lp in (a, b):
        lp.become_replica(None)
    a_local = _ids(a, 2)
    b_local = _ids(b, 2)
    a.become_primary()
    promoted = _ids(a, 2)
    # After everything a had handed out, and apart from b's local clients.
    assert promoted[0] > max(a_local)
    assert not set(promoted) & set(b_local)


def test_a_primary_that_never_was_a_replica_counts_from_its_log() -> None:
    lp = MutationLoop(State())
    assert _ids(lp, 2) == [1, 2]
