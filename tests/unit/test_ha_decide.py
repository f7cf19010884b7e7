"""The HA member's decisions (replication/cluster.py): a table of cluster views -> action.

Pure: no store, no server. Each row is one situation a member can find
itself in; the action it takes, and the words of its reason, are the contract
ha.py performs and docs/HA.md explains.
"""

from __future__ import annotations

import json

import pytest

from smallstalk.replication import cluster as cl
from smallstalk.replication.etcd import KV

REV = 100  # the read's revision; members reported after FREE saw the lock free
FREE = 90


def member(name, seq, epoch=3, role="replica", rev=REV, lag=0):
    return cl.Member(name, role, epoch, "h", seq, lag, f"127.0.0.1:{1000 + seq}", "",
                     ((1, "a", 1), (epoch, "h", 5)), rev)


def view(leader=None, members=(), known=None, paused=False, switchover=None, epoch=3,
         last_leader="n1"):
    ms = {m.name: m for m in members}
    return cl.Cluster(REV, leader, ms, frozenset(known if known is not None else ms),
                      paused, switchover, epoch, 7, last_leader)


def me(role="replica", seq=50, epoch=3, following=None, lease=11, free_seen=FREE, max_lag=0,
       acks=0):
    return cl.Me("n2", lease, role, epoch, seq, following, free_seen, max_lag, acks)


LEADER_ME = cl.Leader("n2", 3, 11)
LEADER_N1 = cl.Leader("n1", 3, 99)

CASES = [
    # (what, cluster, me, action, words in the reason)
    ("leader keeps its lock", view(LEADER_ME, [member("n2", 50)]), me("primary"),
     "renew", "I am the leader with the lock"),
    ("a fenced leader whose lease is back keeps the lock", view(LEADER_ME, [member("n2", 50)]),
     me("fenced"), "renew", "I hold the lock again"),
    ("won the lock, promotion unfinished", view(LEADER_ME, [member("n2", 50)]), me(),
     "acquire", "do not lead yet"),
    ("another holds the lock: follow it", view(LEADER_N1, [member("n1", 60)]), me(),
     "follow", "following the new leader n1"),
    ("already following it", view(LEADER_N1, [member("n1", 60)]), me(following="n1"),
     "follow", "no action"),
    ("re-point to a new leader", view(LEADER_N1, [member("n1", 60)]), me(following="n3"),
     "follow", "was n3"),
    ("leader not reported yet", view(LEADER_N1, []), me(), "wait", "has not reported"),
    ("a primary sees another's lock", view(LEADER_N1, [member("n1", 60)]), me("primary"),
     "step_down", "n1 holds the lock"),
    ("a fenced primary back from a pause", view(LEADER_N1, [member("n1", 60)]), me("fenced"),
     "step_down", "n1 holds the lock"),
    ("a primary whose lock is gone", view(None, [member("n1", 60)]), me("primary"),
     "step_down", "my lease was lost"),
    ("our name, an older lease", view(cl.Leader("n2", 3, 5), []), me(),
     "wait", "previous run"),
    ("free lock, healthiest", view(None, [member("n3", 49), member("n2", 50)]), me(),
     "acquire", "I am the healthiest"),
    ("free lock, equal seqs: the txn decides", view(None, [member("n3", 50)]), me(),
     "acquire", "healthiest"),
    ("free lock, another is ahead", view(None, [member("n3", 51)]), me(),
     "wait", "n3 is at epoch 3 seq 51"),
    ("free lock, ahead within max-lag", view(None, [member("n3", 52)]), me(max_lag=2),
     "acquire", "healthiest"),
    ("free lock, a later epoch is ahead", view(None, [member("n3", 10, epoch=4)]), me(),
     "wait", "not the healthiest"),
    ("free lock, an older history is not", view(None, [member("n3", 90, epoch=2)]), me(),
     "acquire", "healthiest"),
    ("free lock, a report from before it was free",
     view(None, [member("n3", 10, rev=FREE)]), me(), "wait", "report its position"),
    ("paused", view(None, [member("n3", 10)], paused=True), me(), "wait", "paused"),
    ("a switchover to another member",
     view(None, [member("n3", 10)], switchover={"from": "n1", "to": "n3"}), me(),
     "wait", "switchover to n3"),
    ("a switchover to us", view(None, [member("n3", 10)],
                                switchover={"from": "n1", "to": "n2"}), me(),
     "acquire", "healthiest"),
    ("leader asked to switch over", view(LEADER_ME, [member("n3", 50)],
                                        switchover={"from": "n2", "to": "n3"}),
     me("primary"), "hand_over", "handing the lock to n3"),
    ("switchover without a target picks the best replica",
     view(LEADER_ME, [member("n3", 40), member("n4", 50)], switchover={"from": "n2"}),
     me("primary"), "hand_over", "to n4"),
    ("switchover with nobody to take over", view(LEADER_ME, [], switchover={"from": "n2"}),
     me("primary"), "renew", "no other member"),
    # Synchronous mode: known n1 (the old leader), n2, n3, n4; one ack needed.
    ("sync: all replicas report", view(None, [member("n3", 50), member("n4", 49)],
                                       known={"n1", "n2", "n3", "n4"}), me(acks=1),
     "acquire", "healthiest"),
    ("sync: one replica missing", view(None, [member("n3", 50)],
                                      known={"n1", "n2", "n3", "n4"}), me(acks=1),
     "wait", "synchronous mode: 2 of the 3 replicas"),
    ("sync: two acks needed, one missing is fine",
     view(None, [member("n3", 50)], known={"n1", "n2", "n3", "n4"}), me(acks=2),
     "acquire", "healthiest"),
    ("sync: the old leader reports, so it holds everything",
     view(None, [member("n1", 50, role="fenced")], known={"n1", "n2", "n3", "n4"}),
     me(acks=1), "acquire", "healthiest"),
]


@pytest.mark.parametrize("what,cluster,me_,action,words", CASES, ids=[c[0] for c in CASES])
def test_decision(what, cluster, me_, action, words):
    d = cl.decide(cluster, me_)
    assert d.action == action, d
    assert words in d.reason, d


def test_a_switchover_target_that_is_gone_does_not_block_the_race():
    c = view(None, [member("n3", 10)], switchover={"from": "n1", "to": "n9"})
    assert cl.decide(c, me()).action == "acquire"


@pytest.mark.parametrize("chain,epoch,history,last,fork", [
    # Our epoch is the leader's own: it continues us.
    ([(1, "a", 1), (3, "h", 5)], 3, "h", 80, None),
    # We were in epoch 1; the leader's epoch 3 began at seq 5: ours from 5 on diverged.
    ([(1, "a", 1), (3, "h", 5)], 1, "a", 9, 5),
    # ...but if we stopped before 5 we are a plain laggard.
    ([(1, "a", 1), (3, "h", 5)], 1, "a", 4, None),
    # An empty member starts at the beginning of every history.
    ([(1, "a", 1)], 0, "", 0, None),
    # A history the leader never had: all of ours.
    ([(1, "a", 1), (3, "h", 5)], 2, "zz", 7, 1),
])
def test_divergence(chain, epoch, history, last, fork):
    assert cl.divergence(chain, epoch, history, last) == fork


def kv(key, value, lease=0, rev=5):
    return KV(key, json.dumps(value).encode() if not isinstance(value, bytes) else value,
              rev, rev, lease)


def test_read_cluster_from_the_store_keys():
    pre = cl.prefix("c")
    c = cl.read_cluster("c", 42, [
        kv(pre + "leader", {"name": "n1", "epoch": 4}, lease=77),
        kv(pre + "epoch", {"epoch": 4, "leader": "n1"}, rev=9),
        kv(pre + "members/n1", member("n1", 3).to_json()),
        kv(pre + "members/bad", b"not json"),
        kv(pre + "known/n1", b"1"), kv(pre + "known/n2", b"1"),
        kv(pre + "pause", b"1"),
        kv(pre + "failovers/000000000004", {"name": "n1", "epoch": 4, "time": 1.0}),
        kv(pre + "leader-typo", b"x"),
    ])
    assert c.leader == cl.Leader("n1", 4, 77)
    assert (c.epoch, c.epoch_revision, c.last_leader) == (4, 9, "n1")
    assert set(c.members) == {"n1"} and c.members["n1"].seq == 3
    assert c.known == {"n1", "n2"} and c.paused
    assert [f["epoch"] for f in c.failovers] == [4]
