"""The replica's side: follow a primary's record feed into our own AOF and state.

`serve --replica-of HOST:PORT` runs a `Follower`: it connects to the primary
(over TLS with --replica-tls-*, server/tls.py), asks for the records after
its own last sequence number and history (see feed.py), writes them to its
own AOF with the primary's sequence numbers and applies them through its own
mutation loop, so its data directory is a valid smallstalk data directory at
all times. It acknowledges each batch once
it is on disk. A record already applied is skipped, a gap breaks the
connection; after any break it reconnects with back-off and resumes from
what it has. Clients may read (peek, stats, list) but not change anything.

A full resync streams the primary's snapshot into `DATA_DIR/resync.snap.tmp`
as it arrives (never all of it in memory), then installs it in one loop turn;
with read-behind the installed state refers to bodies in that file.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

import cbor2
import trio

from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.state import NS, State
from smallstalk.server import tls
from smallstalk.storage import aof, datadir, snapshot
from smallstalk.storage.aof import CorruptionError

log = logging.getLogger("smallstalk.replication.follower")


class FeedError(Exception):
    pass


class FrameReader:
    """Lines and frames from a stream, with a bounded buffer."""

    def __init__(self, stream: trio.abc.Stream):
        self.stream = stream
        self.buf = bytearray()

    async def _more(self) -> None:
        data = await self.stream.receive_some(1 << 20)
        if not data:
            raise FeedError("the primary closed the connection")
        self.buf += data

    async def line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[:end + 2]
                return line
            if len(self.buf) > 4096:
                raise FeedError("no handshake line from the primary")
            await self._more()

    async def frames(self) -> list[bytes]:
        """Every complete frame buffered (waiting for at least one)."""
        while True:
            offsets: list[int] = []
            out: list[bytes] = []
            pos, why = aof.decode_frames(self.buf, 0, offsets, out)
            if why is not None:
                raise FeedError(f"{why} in the feed")
            if pos:
                del self.buf[:pos]
            if out:
                return list(map(bytes, out))
            await self._more()


class Follower:
    def __init__(self, lp, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                 token: str | None = None):
        self.lp = lp
        self.host, self.port = host, port
        self.ssl_context = ssl_context  # None: plaintext; else the primary's TLS port
        self.token = token  # sent with `auth` first (docs/SECURITY.md)
        self.connected = False
        self.primary_seq = 0
        self.primary_time = 0
        self.last_error: str | None = None
        self.scope = trio.CancelScope()

    def stop(self) -> None:
        self.scope.cancel()

    def stats(self, st: State) -> list[tuple[str, object]]:
        lag = max(self.primary_seq - st.last_seq, 0)
        seconds = max(self.primary_time - st.time, 0) / NS if lag else 0.0
        return [
            ("replica-of", f"{self.host}:{self.port}".encode()),
            ("replication-connected", self.connected),
            ("replication-lag-records", lag),
            ("replication-lag-seconds", b"%.3f" % seconds),
        ]

    async def run(self) -> None:
        backoff = 0.05
        with self.scope:
            while True:
                try:
                    await self._follow()
                except (OSError, trio.BrokenResourceError, FeedError, ValueError,
                        r.DecodeError) as e:
                    if str(e) != self.last_error:
                        log.warning("replication from %s:%d: %s", self.host, self.port, e)
                    self.last_error = str(e)
                else:
                    backoff = 0.05
                self.connected = False
                await trio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _follow(self) -> None:
        lp = self.lp
        if self.ssl_context is None:
            stream = await trio.open_tcp_stream(self.host, self.port)
        else:  # the primary's certificate is checked against the CA and the host name
            stream = await tls.connect(self.host, self.port, self.ssl_context)
        async with stream:
            epoch, history = lp.state.epoch
            reader = FrameReader(stream)
            if self.token is not None:
                # Answered before `replicate` is sent: a feed owns its connection
                # from its first line on, so no reply may be pending behind it.
                await stream.send_all(p.render(p.Auth(self.token)))
                line = await reader.line()
                if line + b"\r\n" != p.OK:
                    raise FeedError(f"the primary refused our admin token: "
                                    f"{line.decode(errors='replace')}")
            await stream.send_all(p.render(p.Replicate(epoch, history, lp.state.last_seq)))
            line = await reader.line()
            words = line.split()
            if not words or words[0] not in (p.REPLICATING_WORD, p.FULLRESYNC_WORD):
                raise FeedError(line.decode(errors="replace"))
            leftover: list[bytes] = []  # record frames that came with the snapshot's end
            if words[0] == p.FULLRESYNC_WORD:
                snap_seq = int(words[3])
                tmp = datadir.resync_path(lp.data_dir)
                try:
                    leftover = await receive_snapshot(reader, tmp, snap_seq)
                    await lp.call(install_snapshot, lp, tmp, snap_seq)
                finally:
                    tmp.unlink(missing_ok=True)
                log.info("full resync from snapshot at seq %d", snap_seq)
                # On our disk now: the primary may answer the changes it covers, even
                # when no record follows it.
                await stream.send_all(p.render(p.ReplicaAck(snap_seq)))
            self.connected = True
            self.last_error = None
            log.info("following %s:%d%s from seq %d", self.host, self.port,
                     " over TLS" if self.ssl_context else "", lp.state.last_seq)
            while True:
                batch = []
                payloads, leftover = leftover or await reader.frames(), []
                for payload in payloads:
                    obj = cbor2.loads(payload)
                    if obj and obj[0] == "hb":
                        self.primary_seq = max(self.primary_seq, obj[1])
                        self.primary_time = max(self.primary_time, obj[2])
                        continue
                    rec = r.from_list(obj)
                    batch.append(rec)
                    self.primary_seq = max(self.primary_seq, rec.seq)
                    self.primary_time = max(self.primary_time, rec.time)
                if batch:
                    await lp.call(lp.apply_replicated, batch)  # returns once on disk
                    await stream.send_all(p.render(p.ReplicaAck(lp.state.last_seq)))


async def receive_snapshot(reader: FrameReader, path: Path, snap_seq: int) -> list[bytes]:
    """Write the snapshot items of a FULLRESYNC to `path` as they arrive, up to
    and with `end`, fsynced; return the record frames that came after it."""
    with open(path, "wb") as f:
        f.write(aof.header(aof.SNAPSHOT_MAGIC, snap_seq))
        while True:
            payloads = await reader.frames()
            for i, payload in enumerate(payloads):
                f.write(aof.frame(payload))
                if payload[1:5] == b"\x63end" and cbor2.loads(payload)[0] == "end":
                    f.flush()
                    await trio.to_thread.run_sync(os.fsync, f.fileno())
                    return payloads[i + 1:]


def install_snapshot(lp, path: Path, snap_seq: int) -> None:
    """Replace our state and files with the primary's snapshot at `path` (inside the loop).

    The file is checked by loading it (bodies past the budget stay in it);
    only then does it become our snapshot and our segments go.
    """
    store = lp.bodies.fresh() if lp.bodies is not None else None
    try:
        state = snapshot.load(path, store)
    except CorruptionError as e:
        if store is not None:
            store.close()
        raise FeedError(f"the primary's snapshot does not load: {e}") from None
    if state.last_seq != snap_seq:
        if store is not None:
            store.close()
        raise FeedError(f"snapshot says seq {snap_seq}, its items {state.last_seq}")
    snap_dir = datadir.snap_dir(lp.data_dir)
    aof.make_dirs(snap_dir)  # durable in DATA_DIR before journal.reset deletes our segments
    written = snap_dir / datadir.snapshot_name(snap_seq)
    os.rename(path, written)
    aof.fsync_dir(snap_dir)
    aof.fsync_dir(path.parent)  # the old name gone too: a later resync truncates that path
    if store is not None:
        store.renamed(path, written)
    for _seq, old in datadir.list_snapshots(snap_dir):
        if old != written:
            old.unlink(missing_ok=True)
    aof.fsync_dir(snap_dir)  # a newer snapshot of ours must not come back over this one
    lp.journal.reset(snap_seq + 1)
    lp.replace_state(state, store)
