"""A tiny raw-socket beanstalk client with pipelining and bounded reads, for the durability tests."""

from __future__ import annotations

import socket
import ssl
import time

import attrs

from smallstalk.core import protocol as p

WITH_BODY = {b"RESERVED", b"FOUND", b"OK"}


@attrs.frozen
class Reply:
    status: bytes
    args: tuple[bytes, ...]
    body: bytes | None = None

    @property
    def line(self) -> bytes:
        return b" ".join((self.status, *self.args))

    @property
    def id(self) -> int:
        """The job id of INSERTED / RESERVED / FOUND replies."""
        return int(self.args[0])

    def yaml(self) -> dict[str, str]:
        """The body of an OK reply (stats, stats-job, ...) as a flat dict."""
        assert self.status == b"OK" and self.body is not None, self
        out: dict[str, str] = {}
        for raw in self.body.decode().splitlines()[1:]:
            key, _, value = raw.partition(": ")
            out[key] = value.strip('"')
        return out


def put_cmd(body: bytes, pri: int = 0, delay: int = 0, ttr: int = 60, max_age: int = 0) -> bytes:
    return p.render(p.Put(pri, delay, ttr, body, max_age))


class Client:
    """One connection. `send` pipelines raw commands; `read` takes replies in order.
    With `ssl_context`, the socket is wrapped by the standard `ssl` module."""

    def __init__(self, port: int, timeout: float = 10.0, source: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, host: str = "127.0.0.1"):
        # `source`: the local address to connect from (another 127.0.0.x peer).
        self.sock = socket.create_connection((host, port), timeout=timeout,
                                             source_address=(source, 0) if source else None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl_context is not None:
            self.sock = ssl_context.wrap_socket(self.sock, server_hostname="127.0.0.1")
        self.buf = bytearray()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("server closed the connection")
        self.buf += chunk

    def read(self) -> Reply:
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > 1 << 16:
                raise ValueError(f"reply line too long: {bytes(self.buf[:80])!r}")
            self._fill()
        status, *args = bytes(self.buf[:end]).split(b" ")
        del self.buf[:end + 2]
        if status not in WITH_BODY or not args:  # a bare OK answers `auth`
            return Reply(status, tuple(args))
        size = int(args[-1])
        while len(self.buf) < size + 2:
            self._fill()
        body = bytes(self.buf[:size])
        if self.buf[size:size + 2] != b"\r\n":
            raise ValueError("body not followed by CRLF")
        del self.buf[:size + 2]
        return Reply(status, tuple(args), body)

    def call(self, data: bytes) -> Reply:
        self.send(data)
        return self.read()

    def pipeline(self, cmds: list[bytes]) -> list[Reply]:
        """Send every command at once, then read one reply per command."""
        self.send(b"".join(cmds))
        return [self.read() for _ in cmds]

    # convenience wrappers
    def put(self, body: bytes, pri: int = 0, delay: int = 0, ttr: int = 60) -> Reply:
        return self.call(put_cmd(body, pri, delay, ttr))

    def stats(self) -> dict[str, str]:
        return self.call(b"stats\r\n").yaml()

    def ext_stats(self) -> dict[str, str]:
        """smallstalk's own server statistics (`ext-stats`)."""
        return self.call(b"ext-stats\r\n").yaml()

    def stats_job(self, job_id: int) -> dict[str, str] | None:
        r = self.call(b"stats-job %d\r\n" % job_id)
        return None if r.status == b"NOT_FOUND" else r.yaml()


def connect(port: int, timeout: float = 10.0, wait: float = 10.0) -> Client:
    """Connect, retrying refused connections until `wait` seconds have passed."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return Client(port, timeout)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def peek_ids(client: Client, ids: list[int], chunk: int = 500) -> dict[int, bytes]:
    """Bodies of the jobs among `ids` that exist (pipelined `peek`)."""
    found: dict[int, bytes] = {}
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        for jid, r in zip(part, client.pipeline([b"peek %d\r\n" % j for j in part]), strict=True):
            if r.status == b"FOUND":
                assert r.id == jid and r.body is not None, r
                found[jid] = r.body
            else:
                assert r.status == b"NOT_FOUND", (jid, r)
    return found


def stats_jobs(client: Client, ids: list[int], chunk: int = 500) -> dict[int, dict[str, str]]:
    """`stats-job` of every job among `ids` that exists (pipelined)."""
    out: dict[int, dict[str, str]] = {}
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        cmds = [b"stats-job %d\r\n" % j for j in part]
        for jid, r in zip(part, client.pipeline(cmds), strict=True):
            if r.status == b"OK":
                out[jid] = r.yaml()
            else:
                assert r.status == b"NOT_FOUND", (jid, r)
    return out
