"""The replica's side: follow a primary's record feed into our own AOF and state.

`serve --replica-of HOST:PORT` runs a `Follower`: it connects to the primary,
asks for the records after its own last sequence number and history (see
replication.py), writes them to its own AOF with the primary's sequence numbers
and applies them through its own mutation loop, so its data directory is a
valid smallstalk data directory at all times. It acknowledges each batch once
it is on disk. A record already applied is skipped, a gap breaks the
connection; after any break it reconnects with back-off and resumes from
what it has. Clients may read (peek, stats, list) but not change anything.
"""

from __future__ import annotations

import logging
import struct
import zlib

import cbor2
import trio

from . import aof, snapshot
from . import protocol as p
from . import records as r
from .recovery import paths
from .state import NS, State

log = logging.getLogger("smallstalk.replica")


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
            out = []
            pos = 0
            buf = self.buf
            while len(buf) - pos >= 8:
                length, crc = struct.unpack_from("<II", buf, pos)
                if len(buf) - pos - 8 < length:
                    break
                payload = bytes(buf[pos + 8:pos + 8 + length])
                if zlib.crc32(payload) != crc:
                    raise FeedError("checksum mismatch in the feed")
                out.append(payload)
                pos += 8 + length
            if pos:
                del buf[:pos]
            if out:
                return out
            await self._more()


class Follower:
    def __init__(self, lp, host: str, port: int):
        self.lp = lp
        self.host, self.port = host, port
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
        stream = await trio.open_tcp_stream(self.host, self.port)
        async with stream:
            epoch, history = lp.state.epoch
            await stream.send_all(p.render(p.Replicate(epoch, history, lp.state.last_seq)))
            reader = FrameReader(stream)
            line = await reader.line()
            words = line.split()
            if not words or words[0] not in (b"REPLICATING", b"FULLRESYNC"):
                raise FeedError(line.decode(errors="replace"))
            leftover: list[bytes] = []  # record frames that came with the snapshot's end
            if words[0] == b"FULLRESYNC":
                items: list = []
                while not leftover and not (items and items[-1][0] == "end"):
                    payloads = await reader.frames()
                    for i, payload in enumerate(payloads):
                        items.append(cbor2.loads(payload))
                        if items[-1][0] == "end":
                            leftover = payloads[i + 1:] or [b""]
                            break
                await lp.call(install_snapshot, lp, items[:-1], int(words[3]))
                leftover = [pl for pl in leftover if pl]
                log.info("full resync from snapshot at seq %d", int(words[3]))
            self.connected = True
            self.last_error = None
            log.info("following %s:%d from seq %d", self.host, self.port, lp.state.last_seq)
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


def install_snapshot(lp, items: list, snap_seq: int) -> None:
    """Replace our state and files with the primary's snapshot (inside the loop)."""
    from . import records

    state = State.load(items)
    if state.last_seq != snap_seq:
        raise FeedError(f"snapshot says seq {snap_seq}, its items {state.last_seq}")
    _aof_dir, snap_dir = paths(lp.data_dir)
    written = snapshot.write(snap_dir, snap_seq, items)
    for _seq, path in aof.list_snapshots(snap_dir):
        if path != written:
            path.unlink(missing_ok=True)
    lp.journal.reset(snap_seq + 1)
    lp.state = state
    for sid in lp.sessions:
        lp.volatile(records.Connect, sid)
