#!/usr/bin/env python3
"""The floor: a stateless server with exactly smallstalk's I/O shape, answering puts.

    python bench/floor.py -l 127.0.0.1 -p 11400

What smallstalk's own work per command is measured against (bench/run.py's
"smallstalk / floor" column). Its shape is the server's (server/poller.py,
server/connection.py): trio, one task waiting on one epoll set of its own,
each socket registered once (level-triggered); on each wake-up it reads every
readable socket once (`os.read`), answers the puts of what it read with
`INSERTED n`, and writes each socket's replies with one `os.write` after the
pass. No state, no records, no loop turn: what remains is trio, the kernel and
the least parsing a put needs. It also answers `stats` (how bench/run.py sees
that a server is up) and `UNKNOWN_COMMAND` to anything else.

With `--log FILE` it is the writing floor, what `--fsync never` is measured
against beside it: before a wake-up's replies it appends a record for each put
(a frame as storage/aof.py writes one: length and CRC-32, then the put's seq,
the wake-up's time and its body) with one `os.write` for the wake-up, and never
fsyncs. No rotation, no preallocation, no compaction: the least a log costs.

Run it only where bench/run.py does: loopback, a port of its own, stopped
by its PID.
"""

from __future__ import annotations

import argparse
import os
import select
import struct
import sys
import time
import zlib

import trio

RECV_SIZE = 65536  # as server/connection.py reads
STATS = b"---\npid: %d\nfloor: true\n" % os.getpid()
FRAME = struct.Struct("<II")  # payload length, CRC-32 of the payload
RECORD = struct.Struct("<QQ")  # seq, time (ns): the payload's head, the body after it


class Conn:
    __slots__ = ("sock", "fd", "buf", "out", "unsent")

    def __init__(self, sock) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.buf = b""
        self.out: list[bytes] = []
        self.unsent = b""


class Floor:
    """Every connection in one epoll set; one pass per wake-up (see above)."""

    def __init__(self, log_fd: int | None = None) -> None:
        self.ep = select.epoll()
        self.conns: dict[int, Conn] = {}
        self.next_id = 1
        self.log_fd = log_fd
        self.records: list[bytes] = []  # this wake-up's frames, written before its replies
        self.now = 0

    def add(self, sock) -> None:
        c = Conn(sock)
        self.conns[c.fd] = c
        self.ep.register(c.fd, select.EPOLLIN)

    def drop(self, c: Conn) -> None:
        if self.conns.pop(c.fd, None) is not None:
            try:
                self.ep.unregister(c.fd)
            except (OSError, ValueError):
                pass
            c.sock.close()

    def answer(self, c: Conn, data: bytes) -> None:
        """Append the replies to every complete command in `c.buf + data`."""
        buf = c.buf + data if c.buf else data
        pos = 0
        n = len(buf)
        out = c.out
        while pos < n:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            line = buf[pos:eol]
            if line[:4] == b"put ":
                end = eol + 2 + int(line.rsplit(b" ", 1)[1]) + 2
                if end > n:
                    break
                if self.log_fd is not None:
                    payload = RECORD.pack(self.next_id, self.now) + buf[eol + 2:end - 2]
                    self.records.append(FRAME.pack(len(payload), zlib.crc32(payload)))
                    self.records.append(payload)
                out.append(b"INSERTED %d\r\n" % self.next_id)
                self.next_id += 1
                pos = end
                continue
            pos = eol + 2
            if line == b"stats":
                out.append(b"OK %d\r\n%s\r\n" % (len(STATS), STATS))
            else:
                out.append(b"UNKNOWN_COMMAND\r\n")
        c.buf = buf[pos:] if pos < n else b""

    def write(self, c: Conn) -> None:
        blob = c.unsent + b"".join(c.out) if c.unsent else b"".join(c.out)
        c.out.clear()
        try:
            k = os.write(c.fd, blob)
        except BlockingIOError:
            k = 0
        except OSError:
            self.drop(c)
            return
        c.unsent = blob[k:]
        if c.unsent:  # the socket is full: epoll says when it has room
            self.ep.modify(c.fd, select.EPOLLIN | select.EPOLLOUT)

    async def run(self) -> None:
        ep, conns = self.ep, self.conns
        wait_readable, epfd = trio.lowlevel.wait_readable, ep.fileno()  # as the poller's
        while True:
            await wait_readable(epfd)
            if self.log_fd is not None:
                self.now = time.time_ns()
            touched = []
            for fd, events in ep.poll(0):
                c = conns.get(fd)
                if c is None:
                    continue
                if events & select.EPOLLOUT and c.unsent:
                    touched.append(c)
                    if not events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                        continue
                try:
                    data = os.read(fd, RECV_SIZE)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.drop(c)
                    continue
                self.answer(c, data)
                if c.out:
                    touched.append(c)
            if self.records:
                os.write(self.log_fd, b"".join(self.records))
                self.records.clear()
            for c in touched:
                if c.fd in conns:
                    was_waiting = bool(c.unsent)
                    self.write(c)
                    if was_waiting and not c.unsent:
                        ep.modify(c.fd, select.EPOLLIN)


async def serve(host: str, port: int, log: str | None = None) -> None:
    log_fd = None if log is None else os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    floor = Floor(log_fd)
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=1024)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(floor.run)
        for ln in listeners:
            nursery.start_soon(accept, ln, floor)


async def accept(listener, floor: Floor) -> None:
    while True:
        sock, _addr = await listener.socket.accept()
        sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
        floor.add(sock)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-l", "--listen", default="127.0.0.1")
    ap.add_argument("-p", "--port", type=int, default=11400)
    ap.add_argument("--log", metavar="FILE",
                    help="append each put's record to FILE, one write a wake-up (never fsynced)")
    a = ap.parse_args(argv)
    try:
        trio.run(serve, a.listen, a.port, a.log)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
