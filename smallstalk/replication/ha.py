"""One HA member: the loop that keeps this server's role in step with the etcd leader lock.

`serve --ha-etcd URL --ha-cluster NAME --ha-name NODE` runs a `HAMember` beside
the mutation loop. Patroni's shape: every cycle reads the cluster from the
store (cluster.py), decides one named action with a reason (logged when it
changes), and performs it:

- renew: the leader keeps its lease (every third of --ha-ttl) and takes writes;
- acquire: the lock is free and this member is the healthiest: one etcd
  transaction takes the lock (create revision 0) and moves the epoch counter,
  then the loop is promoted with that epoch (feed.promote);
- follow: another member leads: follow it through the replication follower,
  re-pointing when the leader changes; records of ours past the point where
  its history left ours are first copied aside (`DATA_DIR/diverged/`);
- step_down: we led and no longer hold the lock: stop taking writes at once;
- hand_over: a planned switchover: stop taking writes, wait for the target to
  have everything, release the lock to it;
- wait: nothing to do yet, and why.

Fencing does not wait for a cycle: the loop itself refuses changes and holds
back acknowledgements once `lease_until` passes (MutationLoop.hold_lease),
which is the last moment the lease is surely still ours by our monotonic
clock: the renewal's send time plus the TTL, less a margin for clock rate.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import trio

from smallstalk.core import records
from smallstalk.replication import cluster as cl
from smallstalk.replication import etcd
from smallstalk.replication.feed import HAHooks, demote, promote
from smallstalk.replication.follower import Follower
from smallstalk.storage import aof, datadir
from smallstalk.storage.history import HistoryFolded, iter_records

if TYPE_CHECKING:
    import ssl

    from smallstalk.server.loop import MutationLoop

log = logging.getLogger("smallstalk.replication.ha")
# httpx logs every request at INFO: a line per store call, several a second.
logging.getLogger("httpx").setLevel(logging.WARNING)

# The part of a lease not counted on: clocks of store and member may run at
# different rates, and a reply checked just before the deadline still has to
# leave the process.
CLOCK_MARGIN = 0.1
HAND_OVER_TTLS = 3  # a switchover whose target does not catch up in this many TTLs is dropped


@attrs.define
class HAConfig:
    etcd: list[str]
    cluster: str = "smallstalk"
    name: str = ""
    advertise: str = ""  # HOST:PORT clients and replicas reach our beanstalkd port at
    http: str = ""  # HOST:PORT of our console ("" without --http)
    ttl: int = 10
    max_lag: int = 0


class HAMember:
    """This server's member of the HA cluster (one per process)."""

    def __init__(self, lp: MutationLoop, cfg: HAConfig, min_replica_acks: int = 0,
                 ssl_context: ssl.SSLContext | None = None, token: str | None = None,
                 store: etcd.Etcd | None = None):
        self.lp = lp
        self.cfg = cfg
        self.min_replica_acks = min_replica_acks
        self.ssl_context, self.token = ssl_context, token
        # Short: a store member that hangs must leave time to ask the next one
        # (and to retry) before the lease runs out.
        self.store = store or etcd.Etcd(cfg.etcd, timeout=max(0.25, min(1.0, cfg.ttl / 8)))
        self.pre = cl.prefix(cfg.cluster)
        self.loop_wait = max(cfg.ttl / 10, 0.1)
        self.lease = 0
        self.renewed_at = -math.inf  # trio time of the last renewal's send
        self.follower: Follower | None = None
        self.following: str | None = None
        self.free_seen = 0
        self.reason = ""
        self.published = b""
        self.published_at = -math.inf
        self.hand_over_until: float | None = None
        self.cluster: cl.Cluster | None = None  # the last view read (console, /primary)
        self.store_error: str | None = None
        self._until = -math.inf  # trio time until which our lease is surely ours
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()

    def hooks(self) -> HAHooks:
        """The loop's way into replication under HA (`promote` is refused)."""
        return HAHooks()

    # --- facts ----------------------------------------------------------------------

    def durable_seq(self) -> int:
        j = self.lp.journal
        return j.committed_seq if j is not None else self.lp.state.last_seq

    def role(self) -> str:
        """primary, fenced (a primary that stopped taking writes), replica (following,
        connected), syncing (following, not connected yet), or starting."""
        lp = self.lp
        if lp.role == "primary":
            return "fenced" if lp.read_only else "primary"
        if self.follower is None:
            return "starting"
        return "replica" if self.follower.connected else "syncing"

    def me(self) -> cl.Me:
        return cl.Me(self.cfg.name, self.lease, self.role(), self.lp.state.epoch[0],
                     self.durable_seq(), self.following, self.free_seen, self.cfg.max_lag,
                     self.min_replica_acks)

    def holds_lock(self) -> bool:
        c = self.cluster
        return (c is not None and c.leader is not None and c.leader.name == self.cfg.name
                and c.leader.lease == self.lease and self.lp.role == "primary"
                and not self.lp.read_only)

    def lag(self) -> int:
        f = self.follower
        return max(f.primary_seq - self.lp.state.last_seq, 0) if f is not None else 0

    # --- the loop -----------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._watchdog)
            try:
                await self.store.put(self.pre + "known/" + self.cfg.name, b"1")
            except etcd.StoreUnavailable as e:
                log.warning("ha: the store is unreachable: %s", e)
            while True:
                await self.run_cycle()
                self._wake = trio.Event()
                with trio.move_on_after(self.loop_wait):
                    await self._wake.wait()

    async def run_cycle(self) -> None:
        try:
            await self._keep_lease()
            rev, kvs = await self.store.get_prefix(self.pre)
        except etcd.StoreUnavailable as e:
            self._store_lost(str(e))
            return
        if self.store_error is not None:
            log.info("ha: the store answers again")
            self.store_error = None
        c = self.cluster = cl.read_cluster(self.cfg.cluster, rev, kvs)
        if c.leader is None:
            if not self.free_seen:
                self.free_seen = rev
                self.published = b""  # report our position now: the race reads it
        else:
            self.free_seen = 0
        try:
            await self._publish()
            d = cl.decide(c, self.me())
            self._say(d)
            await self._act(d, c)
        except etcd.StoreUnavailable as e:
            self._store_lost(str(e))

    def _say(self, d: cl.Decision) -> None:
        if d.reason != self.reason:
            log.info("ha: %s", d.reason)
            self.reason = d.reason

    def _store_lost(self, why: str) -> None:
        if self.store_error is None:
            left = self.lp.lease_until - trio.current_time()
            log.warning("ha: the store is unreachable (%s)%s", why,
                        f"; fencing in {left:.1f}s unless it answers"
                        if self.lp.role == "primary" and not self.lp.read_only
                        and math.isfinite(left) else "")
        self.store_error = why

    async def _watchdog(self) -> None:
        """Fence the moment the lease runs out, without waiting for a cycle. (A loop
        turn that starts past it fences too: after a pause, whichever runs first.)"""
        lp = self.lp
        told = -math.inf  # the lease end already reported
        while True:
            until = lp.lease_until
            if lp.role == "primary" and trio.current_time() >= until and until != told:
                told = until
                if not lp.read_only:
                    await lp.call(lp.fence, "ha: the lease was not renewed in time")
                log.warning("ha: fenced: the lease was not renewed in time (%s); "
                            "writes get READ_ONLY until it is", lp.read_only)
                continue
            wake = until if math.isfinite(until) else trio.current_time() + self.loop_wait
            await trio.sleep_until(min(wake, trio.current_time() + self.loop_wait))

    # --- the lease and our report ---------------------------------------------------

    async def _keep_lease(self) -> None:
        now = trio.current_time()
        if self.lease and now - self.renewed_at < self.cfg.ttl / 3:
            return
        renewed = False
        if self.lease:
            ttl = await self.store.keepalive(self.lease)
            renewed = ttl > 0
            if not renewed:
                log.warning("ha: my lease %x expired in the store", self.lease)
                self.lease = 0
                self.published = b""
        if not self.lease:
            self.lease = await self.store.grant(self.cfg.ttl)
            ttl = self.cfg.ttl
            self.published = b""
        self.renewed_at = now
        until = now + ttl * (1 - CLOCK_MARGIN)
        lp = self.lp
        if renewed and lp.role == "primary":
            # Only the lease the lock hangs on extends what we may acknowledge: a
            # new one holds no lock (it went with the old lease).
            await lp.call(lp.hold_lease, until)
        self._until = until

    async def _publish(self) -> None:
        lp = self.lp
        st = lp.state
        epoch, history = st.epoch
        m = cl.Member(self.cfg.name, self.role(), epoch, history, self.durable_seq(),
                      self.lag(), self.cfg.advertise, self.cfg.http,
                      tuple(tuple(e) for e in st.epochs))
        data = m.to_json()
        now = trio.current_time()
        if data == self.published and now - self.published_at < self.cfg.ttl / 3:
            return
        await self.store.put(self.pre + "members/" + self.cfg.name, data, self.lease)
        self.published, self.published_at = data, now

    # --- actions ------------------------------------------------------------------

    async def _act(self, d: cl.Decision, c: cl.Cluster) -> None:
        if d.action == "renew":
            await self._renew(c)
        elif d.action == "acquire":
            await self._acquire(c)
        elif d.action == "follow":
            await self._follow(c, d.target)
        elif d.action == "step_down":
            await self._step_down(d.reason)
        elif d.action == "hand_over":
            await self._hand_over(c, d.target)

    async def _renew(self, c: cl.Cluster) -> None:
        lp = self.lp
        if self.hand_over_until is not None:
            self.hand_over_until = None
            if c.switchover is not None:
                await self.store.delete(self.pre + "switchover")
        if lp.read_only and trio.current_time() < lp.lease_until:
            await lp.call(lp.unfence)
            log.info("ha: the lease is renewed: taking writes again")

    async def _acquire(self, c: cl.Cluster) -> None:
        lead = c.leader
        if lead is not None and lead.name == self.cfg.name and lead.lease == self.lease:
            epoch = lead.epoch
        else:
            top = max([c.epoch, self.lp.state.epoch[0],
                       *(m.epoch for m in c.members.values())])
            epoch = top + 1
            leader_key, epoch_key = self.pre + "leader", self.pre + "epoch"
            value = json.dumps({"name": self.cfg.name, "epoch": epoch}).encode()
            ok, _rev = await self.store.txn(
                [etcd.created(leader_key, 0), etcd.modified(epoch_key, c.epoch_revision)],
                [etcd.put(leader_key, value, self.lease),
                 etcd.put(epoch_key, json.dumps({"epoch": epoch,
                                                 "leader": self.cfg.name}).encode())])
            if not ok:
                log.info("ha: another member took the lock first")
                return
        taken = time.time()  # before any change of ours is acknowledged in this epoch
        if trio.current_time() >= self._until:
            log.warning("ha: took the lock, but my lease may have run out meanwhile: waiting")
            return
        await self._stop_following()
        lp = self.lp
        await lp.call(promote, lp, epoch, self._until)
        self.published = b""
        await self._publish()  # role primary: load balancers' checks and `ha status` see it
        log.info("ha: I am the primary now (epoch %d, from seq %d)", epoch, self.durable_seq())
        record = {"name": self.cfg.name, "epoch": epoch, "time": taken,
                  "from": c.last_leader, "seq": self.durable_seq()}
        await self.store.put(self.pre + f"failovers/{epoch:012d}", json.dumps(record).encode())
        so = c.switchover
        if so is not None and so.get("to") in (None, self.cfg.name):
            await self.store.delete(self.pre + "switchover")

    async def _step_down(self, why: str) -> None:
        lp = self.lp
        await lp.call(demote, lp, f"ha: not the leader ({why})")
        self.hand_over_until = None
        log.warning("ha: stepped down: %s; writes get READ_ONLY", why)

    async def _hand_over(self, c: cl.Cluster, target: str) -> None:
        lp = self.lp
        now = trio.current_time()
        if self.hand_over_until is None:
            self.hand_over_until = now + HAND_OVER_TTLS * self.cfg.ttl
            await lp.call(lp.fence, f"ha: switchover to {target}")
            log.info("ha: switchover: writes stopped; waiting for %s to catch up", target)
        if now > self.hand_over_until:
            log.warning("ha: switchover to %s dropped: it did not catch up in time", target)
            await self.store.delete(self.pre + "switchover")
            self.hand_over_until = None
            await lp.call(lp.unfence)
            return
        m = c.members.get(target)
        mine = self.durable_seq()
        if m is None or m.position() < (lp.state.epoch[0], mine):
            return  # next cycle
        leader_key = self.pre + "leader"
        value = json.dumps({"name": self.cfg.name, "epoch": c.leader.epoch}).encode()
        ok, _ = await self.store.txn(
            [etcd.value_is(leader_key, value)],
            [etcd.delete(leader_key),
             etcd.put(self.pre + "switchover",
                      json.dumps({"from": self.cfg.name, "to": target}).encode())])
        if ok:
            await self._step_down(f"switchover to {target}, which has everything to seq {mine}")

    async def _follow(self, c: cl.Cluster, target: str) -> None:
        if self.following == target and self.follower is not None:
            return
        m = c.members[target]
        host, _, port = m.advertise.rpartition(":")
        if not host or not port.isdigit():
            log.warning("ha: %s advertises no HOST:PORT (%r)", target, m.advertise)
            return
        await self._stop_following()
        lp = self.lp
        epoch, history = lp.state.epoch
        fork = cl.divergence(m.chain, epoch, history, lp.state.last_seq)
        if fork is not None:
            await set_aside(lp, fork)
        follower = Follower(lp, host, int(port), ssl_context=self.ssl_context, token=self.token)
        await lp.call(demote, lp, "replica", follower)
        self.follower, self.following = follower, target
        self._nursery.start_soon(follower.run)

    async def _stop_following(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        self.follower, self.following = None, None

    async def aclose(self) -> None:
        await self.store.aclose()


async def set_aside(lp: MutationLoop, fork: int) -> Path | None:
    """Copy our records from `fork` on into DATA_DIR/diverged/ before the new primary's
    history replaces them; one log line names the file and counts them."""
    if lp.data_dir is None:
        return None
    data_dir = Path(lp.data_dir)
    last = lp.state.last_seq
    epoch, history = lp.state.epoch
    out_dir = datadir.diverged_dir(data_dir)
    path = out_dir / f"epoch-{epoch}-{history}-seq-{fork}-{last}.aof"

    def copy() -> tuple[int, str]:
        # Durable in DATA_DIR before the follower's resync may delete our segments.
        aof.make_dirs(out_dir)
        n, note = 0, ""
        with open(path, "wb") as f:
            f.write(aof.header(aof.SEGMENT_MAGIC, fork))
            try:
                history_start = iter_records(data_dir, fork)
                first = next(history_start, None)
            except HistoryFolded as e:
                # Compacted already: the snapshot that holds their result goes too.
                if e.snapshot is not None:
                    copied = out_dir / e.snapshot.name
                    shutil.copy(e.snapshot, copied)
                    with open(copied, "rb") as c:
                        os.fsync(c.fileno())
                    note = f" (up to seq {e.snapshot_seq} folded into {e.snapshot.name}, " \
                           "copied beside it)"
                start = e.first_kept or last + 1
                history_start = iter_records(data_dir, start) if start <= last else iter(())
                first = next(history_start, None)
            if first is not None:
                for _seg, _off, rec in itertools.chain([first], history_start):
                    f.write(aof.frame(records.encode(rec)))
                    n += 1
            f.flush()
            os.fsync(f.fileno())
        aof.fsync_dir(out_dir)
        return n, note

    n, note = await trio.to_thread.run_sync(copy)
    log.warning("ha: set aside %d records of ours (seq %d to %d, epoch %d) that the new "
                "primary's history does not have%s: %s", n, fork, last, epoch, note, path)
    return path
