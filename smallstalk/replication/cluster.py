"""The HA cluster as read from the store, and the pure decision each member makes on it.

Everything lives under `/smallstalk/<cluster>/` in etcd:

- `leader`: the lock, `{"name", "epoch"}`, attached to its holder's lease;
- `epoch`: `{"epoch", "leader"}`, the epoch counter, moved in the same
  transaction that takes the lock (so two primaries never share an epoch),
  naming the last member that took it;
- `members/<name>`: each member's position under its own lease (role, epoch,
  history, durable seq, lag, addresses, its epoch chain);
- `known/<name>`: every member that ever joined (no lease): the synchronous
  rule counts them;
- `pause`, `switchover`: the operator's requests (`smallstalk ha ...`);
- `failovers/<epoch>`: who took the lock when, for the console and `ha status`.

`decide(cluster, me)` is a function of those facts and the member's own:
Patroni's `run_cycle` shape, each outcome a named action with the reason the
member logs. ha.py performs it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import attrs

from smallstalk.replication.etcd import KV


def prefix(cluster: str) -> str:
    return f"/smallstalk/{cluster}/"


@attrs.frozen
class Member:
    name: str
    role: str  # primary, replica, fenced, starting
    epoch: int
    history: str
    seq: int  # durable
    lag: int  # records behind the primary (replicas), 0 otherwise
    advertise: str  # HOST:PORT of its beanstalkd port
    http: str  # HOST:PORT of its console, "" without one
    chain: tuple  # ((epoch, history, first seq), ...): its histories
    revision: int = 0  # the store's revision of this report

    def position(self) -> tuple[int, int]:
        return (self.epoch, self.seq)

    def to_json(self) -> bytes:
        return json.dumps({"name": self.name, "role": self.role, "epoch": self.epoch,
                           "history": self.history, "seq": self.seq, "lag": self.lag,
                           "advertise": self.advertise, "http": self.http,
                           "chain": [list(c) for c in self.chain]}).encode()


def member_from(kv: KV) -> Member | None:
    try:
        d = kv.json()
        return Member(str(d["name"]), str(d["role"]), int(d["epoch"]), str(d["history"]),
                      int(d["seq"]), int(d["lag"]), str(d["advertise"]), str(d.get("http", "")),
                      tuple(tuple(c) for c in d.get("chain", ())), kv.mod_revision)
    except (ValueError, KeyError, TypeError):
        return None  # a foreign or damaged key is no member


@attrs.frozen
class Leader:
    name: str
    epoch: int
    lease: int


@attrs.frozen
class Cluster:
    revision: int  # of the read
    leader: Leader | None = None
    members: dict[str, Member] = attrs.Factory(dict)
    known: frozenset[str] = frozenset()
    paused: bool = False
    switchover: dict | None = None  # {"from", "to" (None: any)}
    epoch: int = 0  # the counter
    epoch_revision: int = 0  # the counter's mod revision (0: no counter yet)
    last_leader: str | None = None  # who moved the counter last
    failovers: tuple = ()  # ({"name", "epoch", "time", "from"}, ...), oldest first


def read_cluster(name: str, revision: int, kvs: Iterable[KV]) -> Cluster:
    """The cluster from one range read of `prefix(name)`."""
    pre = prefix(name)
    leader = None
    members: dict[str, Member] = {}
    known: set[str] = set()
    paused = False
    switchover = None
    epoch = epoch_rev = 0
    last_leader = None
    failovers = []
    for kv in kvs:
        key = kv.key[len(pre):]
        try:
            if key == "leader":
                d = kv.json()
                leader = Leader(str(d["name"]), int(d["epoch"]), kv.lease)
            elif key == "epoch":
                d = kv.json()
                epoch, epoch_rev, last_leader = int(d["epoch"]), kv.mod_revision, d.get("leader")
            elif key.startswith("members/"):
                m = member_from(kv)
                if m is not None:
                    members[m.name] = m
            elif key.startswith("known/"):
                known.add(key[len("known/"):])
            elif key == "pause":
                paused = True
            elif key == "switchover":
                switchover = kv.json()
            elif key.startswith("failovers/"):
                failovers.append(kv.json())
        except (ValueError, KeyError, TypeError):
            continue  # not ours: ignored, never a crash of the cycle
    failovers.sort(key=lambda f: f.get("epoch", 0))
    return Cluster(revision, leader, members, frozenset(known), paused, switchover, epoch,
                   epoch_rev, last_leader, tuple(failovers))


@attrs.frozen
class Me:
    """What a member knows of itself for one decision."""

    name: str
    lease: int  # its lease id now (0: none)
    role: str  # primary (takes writes), replica, fenced (a primary that stopped)
    epoch: int
    seq: int  # durable
    following: str | None = None  # the leader it follows now
    free_seen: int = 0  # the store revision at which it first saw the lock free
    max_lag: int = 0
    min_replica_acks: int = 0

    def position(self) -> tuple[int, int]:
        return (self.epoch, self.seq)


@attrs.frozen
class Decision:
    action: str  # renew, hand_over, acquire, wait, follow, step_down
    reason: str
    target: str | None = None  # follow: the leader; hand_over: the member taking over


def ahead(other: tuple[int, int], mine: tuple[int, int], max_lag: int) -> bool:
    """Is `other` further than `max_lag` records ahead of `mine`? A later epoch always is."""
    if other[0] != mine[0]:
        return other[0] > mine[0]
    return other[1] > mine[1] + max_lag


def decide(c: Cluster, me: Me) -> Decision:
    """What `me` does about cluster `c` (one cycle): see docs/HA.md."""
    lead = c.leader
    if lead is not None and lead.name == me.name and lead.lease == me.lease:
        if me.role not in ("primary", "fenced"):
            # Won in an earlier cycle whose promotion did not finish: finish it.
            return Decision("acquire", f"I hold the lock (epoch {lead.epoch}) but do not lead yet")
        so = c.switchover
        if so is not None and so.get("from") in (None, me.name):
            target = so.get("to") or best_successor(c, me)
            if target is None or target == me.name:
                return Decision("renew", "switchover asked, but no other member can take over")
            return Decision("hand_over", f"switchover: handing the lock to {target}", target)
        if me.role == "fenced":
            return Decision("renew", f"I hold the lock again (epoch {lead.epoch}): "
                                     "taking writes once the lease is renewed")
        return Decision("renew", f"no action: I am the leader with the lock (epoch {lead.epoch})")
    if lead is not None:
        if lead.name == me.name:
            # Our name with another lease: a run of ours that died; its lease ends soon.
            if me.role == "primary":
                return Decision("step_down", "the lock is under a lease that is not mine")
            return Decision("wait", "the lock is held by my previous run's lease until it expires")
        if me.role in ("primary", "fenced"):
            return Decision("step_down", f"{lead.name} holds the lock (epoch {lead.epoch})")
        if lead.name not in c.members:
            return Decision("wait", f"{lead.name} holds the lock but has not reported its position")
        if me.following == lead.name:
            return Decision("follow", f"no action: following the leader {lead.name}", lead.name)
        return Decision("follow", f"following the new leader {lead.name} (epoch {lead.epoch})"
                        + (f", was {me.following}" if me.following else ""), lead.name)
    # The lock is free.
    if me.role == "primary":
        return Decision("step_down", "the lock is free: my lease was lost")
    if c.paused:
        return Decision("wait", "paused: no automatic failover (smallstalk ha resume)")
    so = c.switchover
    if so is not None and so.get("to") not in (None, me.name) and so["to"] in c.members:
        return Decision("wait", f"switchover to {so['to']} in progress")
    return _race(c, me)


def _race(c: Cluster, me: Me) -> Decision:
    """The lock is free: may `me` take it? (is_healthiest_node)"""
    others = [m for m in c.members.values() if m.name != me.name]
    for m in others:
        if m.revision <= me.free_seen:
            return Decision("wait", f"waiting for {m.name} to report its position "
                                    "since the lock became free")
    for m in others:
        if ahead(m.position(), me.position(), me.max_lag):
            return Decision("wait", f"not the healthiest: {m.name} is at epoch {m.epoch} "
                                    f"seq {m.seq}, I am at epoch {me.epoch} seq {me.seq}")
    if me.min_replica_acks:
        # Every acknowledged change is on the old leader and on min_replica_acks
        # of the others: unless the old leader reports, enough of the others
        # must, so that one of them surely holds it (the healthiest of them does).
        old = c.last_leader
        if old not in c.members:
            replicas = c.known - {old}
            present = len([n for n in replicas if n in c.members or n == me.name])
            need = len(replicas) - me.min_replica_acks + 1
            if present < need:
                return Decision("wait", f"synchronous mode: {present} of the {len(replicas)} "
                                        f"replicas report, {need} needed to be sure to hold "
                                        "every acknowledged change")
    return Decision("acquire", f"the lock is free and I am the healthiest "
                               f"(epoch {me.epoch} seq {me.seq})")


def best_successor(c: Cluster, me: Me) -> str | None:
    """The member a switchover without --to hands over to: the most advanced replica."""
    cands = [m for m in c.members.values() if m.name != me.name and m.role == "replica"]
    if not cands:
        return None
    return max(cands, key=lambda m: (m.position(), -m.lag, m.name)).name


def divergence(chain: Iterable, epoch: int, history: str, last_seq: int) -> int | None:
    """The first seq of ours the leader's history does not have, or None.

    `chain` is the leader's ((epoch, history, first seq), ...). Our records
    past the point where its history left ours are not in it.
    """
    chain = [(0, "", 1), *[tuple(c) for c in chain]]
    for i, (e, h, _first) in enumerate(chain):
        if (e, h) == (epoch, history):
            if i + 1 == len(chain):
                return None  # the leader's own epoch: it continues us
            fork = chain[i + 1][2]
            return fork if last_seq >= fork else None
    # A history the leader never had: everything of ours past its first epoch's start.
    return chain[1][2] if len(chain) > 1 and last_seq >= chain[1][2] else None
