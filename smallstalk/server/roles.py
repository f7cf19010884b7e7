"""The loop's settings and roles: what cli.py, replication and HA change of it.

`MutationLoop` (loop.py) inherits these methods; they live here so that the
loop's module keeps to its turns. Each runs inside a turn or before the first
one, as the loop's own methods do: the settings cli.py starts the loop with
(`configure`) and their reload, draining, a replica's and a primary's role, the
HA leader lease (`fence`, `unfence`, `hold_lease`: enforced in `turn` and where
the commit releases replies), and the one state swap (`replace_state`: the
read-back after a disk error, a replica's snapshot install).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.state import State
from smallstalk.server import holdback
from smallstalk.server.admin import AdminPolicy
from smallstalk.server.commit import Unavailable
from smallstalk.server.policy import ConfigError, Policies, load_policies
from smallstalk.server.session import Session

log = logging.getLogger("smallstalk.server.loop")


class Replication(Protocol):
    """What `replicate` and `promote` call: replication/feed.py's `Hooks`, which
    cli.py installs as `MutationLoop.replication` (server/ never imports it);
    `lp` is the loop."""

    def start_feed(self, lp: Roles, s: Session, cmd: p.Replicate) -> object: ...

    def promote(self, lp: Roles) -> int: ...



class Roles:
    """The settings, role, lease and state-swap methods of `MutationLoop`."""

    # Defined by MutationLoop (loop.py). Declared on this root because
    # dispatch and a connection see the loop as one: compiled, their everyday
    # calls are C calls.
    def log_put(self, conn, tube: str, pri, delay, ttr, body: bytes) -> int:
        raise NotImplementedError

    def log_put_unique(self, conn, tube: str, key: str, unique_for, keys_max, pri, delay,
                       ttr, body: bytes) -> int:
        raise NotImplementedError

    def log_job(self, cls: type, conn, job_id) -> None:
        raise NotImplementedError

    def body_of(self, job) -> bytes:
        raise NotImplementedError

    def submit(self, s: Session, events: list, size=0) -> None:
        raise NotImplementedError

    def reload_config(self) -> str | None:
        """Re-read the tube policies from `config_path`; an error message, or None.

        Runs inside a turn (through `call`, or from the admin command): the new
        policies apply from the next decision on; the old ones stay on error.
        """
        if self.config_path is None:
            return "no configuration file (start with --config FILE)"
        try:
            policies = load_policies(self.config_path)
        except ConfigError as e:
            log.error("configuration not reloaded: %s", e)
            return str(e)
        self.set_policies(policies)
        log.info("tube policies reloaded from %s", self.config_path)
        return None

    def set_policies(self, policies: Policies, sync: bool = True) -> None:
        """Decide by `policies` from now on; with `sync`, log the Limits
        records that carry their concurrency and rate limits into the state
        (a replica logs none: its primary's records carry them)."""
        self.policies = policies
        for sched in policies.schedules:
            self.schedules_loaded.setdefault(sched.name, self.now)
        if sync:
            self.sync_limits()

    def sync_limits(self) -> None:
        """The Limits records that make the state's limits the configuration's."""
        try:
            holdback.sync_limits(self)
        except Unavailable:
            log.error("tube limits not logged (the disk is failing): they apply once it works")

    def configure(self, *, policies: Policies, config_path: Path | None, admin: AdminPolicy,
                  extended_stats: bool, replication: Replication | None,
                  ha: object | None = None) -> None:
        """The settings cli.py starts the loop with (before its first turn):
        the policies' Limits records are logged after the Restart record.
        `ha`: the HA member (replication/ha.py) under --ha-etcd."""
        self.set_policies(policies, sync=False)
        self.config_path = config_path
        self.admin = admin
        self.extended_stats = extended_stats
        self.replication = replication
        self.ha = ha

    def start_draining(self) -> None:
        """From now on refuse new jobs (SIGUSR1, as beanstalkd)."""
        self.draining = True

    def count_refused(self) -> None:
        """A connection was turned away past --max-connections."""
        self.refused += 1

    # --- role and state, as replication and the commit change them ----------------

    def become_replica(self, follower: object) -> None:
        """Follow a primary through `follower`: clients may not change state."""
        self.role, self.follower = "replica", follower
        self.read_only = "replica"

    def become_primary(self) -> None:
        """Take changes from clients (a promotion); the follower is stopped already."""
        self.role, self.follower = "primary", None
        self.read_only = None
        self.serving_since = self.now
        # New connections go on in this process's range, past every id in the log.
        self._next_conn = max(self._next_conn, self.state.next_conn_id, self._replica_next)

    # HA (replication/ha.py): the leader lease, enforced here (see `turn`, and
    # where the commit releases replies).

    def fence(self, reason: str) -> None:
        """Take no change from clients (READ_ONLY), and acknowledge none still waiting."""
        self.read_only = reason
        self.lease_until = min(self.lease_until, trio.current_time())

    def unfence(self) -> None:
        """Take changes again (a primary whose lease is renewed)."""
        self.read_only = None
        self.serving_since = self.now

    def hold_lease(self, until: float) -> None:
        """HA: changes may be acknowledged until trio time `until`, and none after it."""
        self.lease_until = until

    def replace_state(self, state: State, bodies=None) -> None:
        """Serve `state` from now on: a read-back after a disk error, a
        replica's install of its primary's snapshot. `bodies` is the body
        store the new state's spilled bodies live in (the old one is closed);
        the connections, and the waits of blocked reserves, carry over."""
        old = self.bodies
        self.state = state
        if bodies is not None:
            self.use_bodies(bodies)
        if old is not None and old is not bodies:
            old.close()  # the references of the state we dropped
        for s in self.sessions.values():
            self.volatile(r.Connect, s.id)
            if s.blocked and not s.deferred:
                self.volatile(r.WaitStart, s.id, s.wait_deadline)

    def reload_from_disk(self) -> bool:
        """After a disk error: back to exactly what the data directory holds
        (what was acknowledged). False if it cannot be read: nothing changes."""
        from smallstalk.storage.recovery import (
            recover,  # late: recovery is only needed on this path
        )

        fresh = self.bodies.fresh() if self.bodies is not None else None
        try:
            state = recover(self.data_dir, repair=False, bodies=fresh).state
        except OSError as e:
            log.error("could not read the state back after a disk error: %s", e)
            if fresh is not None:
                fresh.close()
            return False
        self.replace_state(state, fresh)
        return True
