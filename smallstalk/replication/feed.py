"""The primary's side of replication: deciding a feed, streaming it, promotion.

A replica connects to the primary's client port and sends
`replicate <epoch> <history|-> <after seq>`. The primary answers one line and
then streams frames (the AOF frame: length, CRC32, CBOR payload) forever:

- `REPLICATING <epoch> <history>`: records after <after seq> follow, first
  from the segment files on disk, then live as the loop commits them;
- `FULLRESYNC <epoch> <history> <snapshot seq>`: the replica's position is
  not in the primary's history (compacted away, or a history the primary left
  or never had): the newest snapshot's items follow, ending with its `end`
  item, then the records after it;
- `REFUSED <reason>`: the replica's history is newer than ours (we are an old
  primary that was replaced), or this server cannot feed.

Besides records, the stream carries heartbeats `["hb", committed seq, time ns]`
every second, so a replica can report its lag. The replica answers
`replica-ack <seq>` once it has that seq on its own disk.

Histories: every primary log starts with a `NewEpoch` record carrying a random
history id; a promoted replica logs the next epoch with a new id. The primary
continues a replica's log only if the replica's (epoch, history) is in the
primary's chain and the replica has no record past the point where the
primary's history left it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import cbor2
import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.server.dispatch import NOREPLY
from smallstalk.storage import aof, datadir

if TYPE_CHECKING:
    from collections.abc import Callable

    from smallstalk.server.loop import MutationLoop
    from smallstalk.server.session import Session

log = logging.getLogger("smallstalk.replication.feed")

LIVE_BACKLOG = 10_000  # committed turns a slow replica may fall behind before it is cut off
LIVE_BYTES = 64 << 20  # ...or bytes of records: a replica that stops reading costs at most this
HEARTBEAT = 1.0  # seconds


def new_history() -> str:
    return os.urandom(8).hex()


class Feed:
    """One replica's stream: what to send from disk, then the live queue."""

    def __init__(self, session_id: int, line: bytes, after: int, upto: int,
                 snapshot: Path | None, segments: list[Path]):
        self.session_id = session_id
        self.line = line
        self.after = after  # the replica has everything up to here
        self.upto = upto  # disk catch-up ends here; live pushes start after it
        self.snapshot = snapshot
        # Open now: the compactor may delete the files, but open files stay readable.
        self.snapshot_file = open(snapshot, "rb") if snapshot else None  # noqa: SIM115
        self.segment_files = [open(path, "rb") for path in segments]  # noqa: SIM115
        self.acked = after
        self._send, self.live = trio.open_memory_channel(LIVE_BACKLOG)
        self.live_bytes = 0  # of records queued in `live`
        self.cut_off = False

    def push(self, payloads: list[tuple[int, bytes]]) -> None:
        """Called by the loop after each commit (must not block)."""
        if self.cut_off:
            return
        size = sum(len(pl) for _seq, pl in payloads)
        try:
            if self.live_bytes + size > LIVE_BYTES:
                raise trio.WouldBlock
            self._send.send_nowait(payloads)
            self.live_bytes += size
        except trio.WouldBlock:
            # Too far behind to keep in memory: end the stream; the replica
            # reconnects and catches up from the files.
            self.cut_off = True
            self._send.close()

    def close(self) -> None:
        for f in [self.snapshot_file, *self.segment_files]:
            if f is not None:
                f.close()

    async def run(self, stream: trio.abc.Stream, committed: Callable[[], int]) -> None:
        """What the replica's connection does once `replicate` is answered."""
        await run_feed(stream, self, committed)


def start_feed(lp: MutationLoop, s: Session, cmd: p.Replicate):
    """Decide how to feed this replica (inside the loop, so the state holds still)."""
    if lp.journal is None:
        return p.refused(b"no data directory: nothing to replicate")
    if lp.role != "primary":
        return p.refused(b"not a primary")
    st = lp.state
    epoch, history = st.epoch
    chain = [(0, "", 1), *st.epochs]
    fork: float | None = None
    for i, (e, h, _first) in enumerate(chain):
        if (e, h) == (cmd.epoch, cmd.history):
            fork = chain[i + 1][2] if i + 1 < len(chain) else math.inf
    if fork is None and cmd.epoch > epoch:
        return p.refused(b"replica history %d/%s is newer than ours %d/%s" % (
            cmd.epoch, (cmd.history or "-").encode(), epoch, history.encode()))
    upto = lp.journal.committed_seq
    aof_dir, snap_dir = datadir.paths(lp.data_dir)
    segments = datadir.list_segments(aof_dir)
    continues = fork is not None and cmd.after < fork and cmd.after <= upto
    after = cmd.after
    snapshot = None
    if continues and not _covers(segments, after + 1, upto):
        continues = False  # compacted away: start from a snapshot
    if not continues:
        snaps = datadir.list_snapshots(snap_dir)
        if snaps:
            snap_seq, snapshot = snaps[-1]
        else:
            snap_seq = 0
        after = snap_seq
        if not _covers(segments, after + 1, upto):
            return p.refused(b"cannot find records after %d" % after)
        line = p.fullresync(epoch, history, snap_seq)
    else:
        line = p.replicating(epoch, history)
    needed = [path for i, (first, path) in enumerate(segments)
              if first <= upto and (i + 1 == len(segments) or segments[i + 1][0] > after + 1)]
    feed = Feed(s.id, line, after, upto, snapshot, needed)
    if not continues:
        feed.acked = 0  # it has nothing of ours until it acknowledges the snapshot
    lp.feeds[s.id] = feed
    s.feed = feed
    s.deliver(feed, False, False)  # the connection streams it from now on
    log.info("replica on connection %d: %s", s.id, line.strip().decode())
    return NOREPLY


def _covers(segments: list[tuple[int, Path]], first_needed: int, upto: int) -> bool:
    """Do the segment files hold every record from first_needed to upto?"""
    if first_needed > upto:
        return True
    return bool(segments) and segments[0][0] <= first_needed


async def run_feed(stream: trio.abc.Stream, feed: Feed, committed) -> None:
    """Stream a feed to the replica until either side goes away."""
    try:
        await stream.send_all(feed.line)
        if feed.snapshot_file is not None:
            # Its frames, `end` included, a chunk at a time: a snapshot of big
            # tubes may be far larger than the server's memory budget.
            f = feed.snapshot_file
            f.seek(aof.HEADER_SIZE)
            while chunk := await trio.to_thread.run_sync(f.read, 1 << 20):
                await stream.send_all(chunk)
        for f in feed.segment_files:
            data = await trio.to_thread.run_sync(f.read)
            out = bytearray()
            for entry in aof.read_frames(data):
                if isinstance(entry, aof.FrameScan):
                    break
                offset, payload = entry
                seq = cbor2.loads(payload)[1]
                if seq > feed.upto:
                    break
                if seq > feed.after:
                    out += aof.frame(payload)
                if len(out) > 1 << 20:
                    await stream.send_all(bytes(out))
                    out.clear()
            if out:
                await stream.send_all(bytes(out))
        feed.close()
        while True:
            with trio.move_on_after(HEARTBEAT):
                try:
                    payloads = await feed.live.receive()
                    feed.live_bytes -= sum(len(pl) for _seq, pl in payloads)
                except trio.EndOfChannel:
                    log.warning("replica on connection %d fell too far behind; cut off",
                                feed.session_id)
                    return
                await stream.send_all(b"".join(aof.frame(pl) for _seq, pl in payloads))
                continue
            await stream.send_all(aof.frame(cbor2.dumps(["hb", committed(), time.time_ns()])))
    finally:
        feed.close()


def promote(lp: MutationLoop, epoch: int | None = None, lease_until: float = math.inf) -> int:
    """Turn this replica into a primary (inside the loop). Returns the new epoch.

    `epoch`: the one the HA store gave us (ha.py); by default the next after
    ours. `lease_until`: with HA, the trio time after which no change may be
    acknowledged unless the lease is renewed (MutationLoop.hold_lease).
    """
    if lp.follower is not None:
        lp.follower.stop()
    lp.become_primary()
    lp.hold_lease(lease_until)
    epoch = lp.state.epoch[0] + 1 if epoch is None else epoch
    # The new history starts right after the last record we share with the old
    # primary: a returning old primary's next record is where it left us
    # (feed's fork point, ha.py's `divergence`).
    lp.log(r.NewEpoch, epoch, new_history())
    # The old primary's connections are gone: their reservations become ready.
    lp.log(r.Restart)
    # A connection's `use` on the replica was its view only (dispatch.use): make
    # it the tube its puts go to now, or they would land in `default` (and a
    # keyed put would miss its key, which lives in the tube it names).
    for s in lp.sessions.values():
        if s.view_use is not None:
            if s.view_use != lp.state.use_of(s.id):
                lp.log(r.Use, s.id, s.view_use)
            s.view_use = None
    lp.sync_limits()  # this server's configuration from now on
    log.info("promoted to primary, epoch %d", epoch)
    return epoch


def demote(lp: MutationLoop, reason: str, follower=None) -> None:
    """Stop taking changes (inside the loop): HA stepped down, or follows `follower` now."""
    if lp.follower is not None and lp.follower is not follower:
        lp.follower.stop()
    lp.become_replica(follower)
    lp.fence(reason)


class Hooks:
    """The server's way into replication (`MutationLoop.replication`): cli.py
    installs it, so server/ never imports this package."""

    def start_feed(self, lp: MutationLoop, s: Session, cmd: p.Replicate) -> object:
        return start_feed(lp, s, cmd)

    def promote(self, lp: MutationLoop) -> int:
        return promote(lp)


class HAHooks(Hooks):
    """Under --ha-etcd the store decides who leads: a manual `promote` would make
    a second primary, so it is refused (`smallstalk ha switchover` moves the lock)."""

    def promote(self, lp: MutationLoop) -> int:
        from smallstalk.server.loop import ReadOnly

        raise ReadOnly("ha: the leader lock decides; use smallstalk ha switchover")
