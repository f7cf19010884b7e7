"""Differential test: raw protocol bytes to beanstalkd and smallstalk must get byte-identical replies."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import attrs
import pytest

from ..support.compat_cases import CASES, Case, Step
from ..support.procs import Server, needs_beanstalkd, start_beanstalkd, start_smallstalk

# COMPAT_SELF_TEST=1 points the "candidate" side at a second beanstalkd, which
# proves the harness itself is deterministic.
SELF_TEST = os.environ.get("COMPAT_SELF_TEST", "") not in ("", "0")
CANDIDATE = "beanstalkd#2" if SELF_TEST else "smallstalk"

READ_TIMEOUT = 4.0  # seconds per recv; the slowest expected reply comes after ~1 s
MAX_LINE = 4096  # a reply line longer than this is recorded as garbage, not read forever
MODES = ("whole", "bytewise")
BYTEWISE_EDGE = 1024  # bytewise sends big steps' first/last bytes singly, the middle in chunks
BYTEWISE_CHUNK = 997
FRESH_AHEAD = 2  # fresh server pairs started in the background ahead of use
# Sent on every open connection after the last step. Its reply names the
# connection, so a stray extra reply still in flight cannot pass unnoticed.
END_PROBE = b"use end-probe-%d\r\n"
CLOSED = b"<closed as expected>"

BODY_HEADER = re.compile(rb"(?:OK|RESERVED \d+|FOUND \d+) (\d+)\r\n")
YAML_LINE = re.compile(rb"([a-z][a-z-]*): (.*)")
# Stats values that legitimately differ between two servers (or two runs):
# only their formatting is compared. "id" is volatile in `stats` only.
VOLATILE_INT = {
    b"pid", b"uptime", b"age", b"time-left", b"pause-time-left",
    b"binlog-oldest-index", b"binlog-current-index", b"binlog-records-migrated",
    b"binlog-records-written", b"binlog-max-size",
}
VOLATILE_USEC = {b"rusage-utime", b"rusage-stime"}
VOLATILE_STR = {b"version", b"hostname"}


class Unreadable(Exception):
    """The reply could not be read; the message is recorded in the transcript."""


@attrs.define
class Wire:
    """One client connection with an exact, bounded reply reader."""

    sock: socket.socket
    buf: bytearray = attrs.field(factory=bytearray)
    dead: bool = False

    @classmethod
    def open(cls, port: int) -> Wire:
        sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock)

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes, mode: str) -> bool:
        """Send data; return False instead of raising if the peer is gone or stuck."""
        try:
            if mode == "whole":
                self.sock.sendall(data)
            else:
                for part in bytewise_parts(data):
                    self.sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            return False
        return True

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            raise Unreadable(f"<no reply within {READ_TIMEOUT}s>") from None
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise Unreadable("<connection closed>")
        self.buf += chunk

    def _take(self, n: int) -> bytes:
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def read_line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                return self._take(end + 2)
            if len(self.buf) > MAX_LINE:
                raise Unreadable(f"<no CRLF in {len(self.buf)} bytes>")
            self._fill()

    def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        return self._take(n)

    def read_reply(self) -> bytes:
        """One complete reply: a line, plus its body for OK/RESERVED/FOUND."""
        line = self.read_line()
        m = BODY_HEADER.fullmatch(line)
        if not m:
            return line
        body = self.read_exact(int(m.group(1)) + 2)
        if not body.endswith(b"\r\n"):
            raise Unreadable(f"<body not followed by CRLF: {line + body!r}>")
        return line + body

    def read_close(self) -> bytes:
        """After the expected replies the server must close: report what happened."""
        if self.buf:
            return b"<unexpected bytes before close: %r>" % self._take(len(self.buf))
        try:
            self._fill()
        except Unreadable as e:
            return CLOSED if str(e) == "<connection closed>" else str(e).encode()
        return b"<unexpected bytes instead of close: %r>" % self._take(len(self.buf))


def bytewise_parts(data: bytes) -> Iterator[bytes]:
    """Single bytes, except the middle of big steps (65 KiB bodies), sent in chunks."""
    if len(data) <= 2 * BYTEWISE_EDGE + BYTEWISE_CHUNK:
        yield from (data[i : i + 1] for i in range(len(data)))
        return
    head, mid, tail = BYTEWISE_EDGE, len(data) - BYTEWISE_EDGE, len(data)
    yield from (data[i : i + 1] for i in range(head))
    yield from (data[i : min(i + BYTEWISE_CHUNK, mid)] for i in range(head, mid, BYTEWISE_CHUNK))
    yield from (data[i : i + 1] for i in range(mid, tail))


@attrs.frozen
class Run:
    """How one case is run: the names and ids substituted into its bytes."""

    tube: bytes
    id_base: int  # job ids of this case are id_base+1, id_base+2, ...
    shared: bool  # long-lived servers: each connection first moves to {T}
    mode: str


PLACEHOLDER = re.compile(rb"\{(T|U|\d+)\}")


def expand(data: bytes, run: Run) -> bytes:
    def sub(m: re.Match[bytes]) -> bytes:
        key = m.group(1)
        if key == b"T":
            return run.tube
        if key == b"U":
            return run.tube + b"u"
        return b"%d" % (run.id_base + int(key))

    return PLACEHOLDER.sub(sub, data)


Entry = tuple[str, bytes, bytes]  # (label, bytes sent in that step, one reply)


def run_case(port: int, case: Case, run: Run) -> list[Entry]:
    """Play a case against one server and return its transcript."""
    wires: dict[int, Wire] = {}
    out: list[Entry] = []

    def exchange(label: str, w: Wire, send: bytes, replies: int, step: Step | None) -> None:
        if w.dead:
            out.append((label, send, b"<connection already closed or stuck>"))
            return
        if send:
            # A failed send (peer already closed) is not recorded: whether it
            # fails depends on timing; the reads below show the closed state.
            w.send(send, run.mode)
        if step is not None and step.shut_wr:
            w.sock.shutdown(socket.SHUT_WR)
        for i in range(replies):
            try:
                out.append((f"{label} reply {i + 1}/{replies}", send, w.read_reply()))
            except Unreadable as e:
                out.append((f"{label} reply {i + 1}/{replies}", send, str(e).encode()))
                w.dead = True
                return
        if step is not None and step.closed:
            out.append((f"{label} close", send, w.read_close()))
            w.dead = True

    def wire(n: int) -> Wire:
        if n not in wires:
            wires[n] = w = Wire.open(port)
            if run.shared:
                pre = expand(b"use {T}\r\nwatch {T}\r\nignore default\r\n", run)
                exchange(f"conn {n} preamble", w, pre, 3, None)
        return wires[n]

    try:
        for i, step in enumerate(case.steps):
            send = expand(step.send, run)
            exchange(f"step {i} conn {step.conn}", wire(step.conn), send, step.replies, step)
        for n, w in sorted(wires.items()):
            if not w.dead:  # catches stray extra replies still in flight
                exchange(f"end probe conn {n}", w, END_PROBE % n, 1, None)
    finally:
        for w in wires.values():
            w.close()
    return out


def normalise(reply: bytes) -> bytes:
    """Blank out volatile stats values, keeping every line's exact shape."""
    m = re.fullmatch(rb"OK \d+\r\n(---\n(?:.*\n)*)\r\n", reply, re.S)
    if not m:
        return reply
    lines = m.group(1).split(b"\n")[1:-1]
    pairs = [YAML_LINE.fullmatch(line) for line in lines]
    if not lines or not all(pairs):
        return reply
    is_server_stats = any(p.group(1) == b"pid" for p in pairs if p)
    # Every key is compared, in order: smallstalk's own keys are served by
    # ext-stats and ext-stats-tube, never appended here (clients compare whole replies).
    body = [b"---"]
    for p in pairs:
        assert p is not None
        key, value = p.group(1), p.group(2)
        body.append(key + b": " + shape(key, value, is_server_stats))
    text = b"\n".join(body) + b"\n"
    return b"OK %d\r\n%s\r\n" % (len(text), text)


def shape(key: bytes, value: bytes, is_server_stats: bool) -> bytes:
    quoted = len(value) >= 2 and value.startswith(b'"') and value.endswith(b'"')
    if key in VOLATILE_INT and re.fullmatch(rb"-?\d+", value):
        return b"<int>"
    if key in VOLATILE_USEC and re.fullmatch(rb"\d+\.\d{6}", value):
        return b"<seconds.micros>"
    if key in VOLATILE_STR or (key == b"id" and is_server_stats):
        if quoted:
            return b'"<string>"'
        if re.fullmatch(rb"[!-~]+", value):
            return b"<bare-string>"
    return value


@attrs.define
class ServerPair:
    reference: Server
    candidate: Server

    def stop(self) -> None:
        self.reference.stop()
        self.candidate.stop()


def start_pair(tmp: Path) -> ServerPair:
    ref = start_beanstalkd(tmp)
    try:
        cand = start_beanstalkd(tmp) if SELF_TEST else start_smallstalk(tmp)
    except BaseException:
        ref.stop()
        raise
    return ServerPair(ref, cand)


class FreshPool:
    """Hands out newly started server pairs, starting the next ones in the background."""

    def __init__(self, tmp: Path, total: int) -> None:
        self.tmp = tmp
        self.unstarted = total  # no more pairs than fresh runs in the module
        self.ex = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fresh")
        self.ahead: deque[Future[ServerPair]] = deque()
        self.lock = threading.Lock()

    def take(self) -> ServerPair:
        with self.lock:
            while self.unstarted > 0 and (not self.ahead or len(self.ahead) <= FRESH_AHEAD):
                self.ahead.append(self.ex.submit(start_pair, self.tmp))
                self.unstarted -= 1
            if not self.ahead:
                self.ahead.append(self.ex.submit(start_pair, self.tmp))
            fut = self.ahead.popleft()
        return fut.result()

    def release(self, pair: ServerPair) -> None:
        self.ex.submit(pair.stop)

    def close(self) -> None:
        for fut in self.ahead:
            if not fut.cancel():
                try:
                    fut.result().stop()
                except Exception:
                    pass
        self.ex.shutdown(wait=True)


@attrs.define
class Shared:
    """The module's long-lived pair plus one control connection to each."""

    pair: ServerPair
    ctl_ref: Wire
    ctl_cand: Wire


def next_id_probe(ctl: Wire) -> int:
    """Create and delete one job; return its id (the next case starts above it)."""
    ctl.sock.sendall(b"put 0 0 60 0\r\n\r\n")
    line = ctl.read_line()
    m = re.fullmatch(rb"INSERTED (\d+)\r\n", line)
    if not m:
        raise AssertionError(f"id probe: put got {line!r}")
    ctl.sock.sendall(b"delete %s\r\n" % m.group(1))
    line = ctl.read_line()
    if line != b"DELETED\r\n":
        raise AssertionError(f"id probe: delete got {line!r}")
    return int(m.group(1))


def sync_job_ids(shared: Shared) -> int:
    """Bring both servers' next job id to the same value (after any earlier
    divergence) by burning ids on the one behind; return the common base."""
    ref, cand = next_id_probe(shared.ctl_ref), next_id_probe(shared.ctl_cand)
    for _ in range(5000):
        if ref == cand:
            return ref
        if ref < cand:
            ref = next_id_probe(shared.ctl_ref)
        else:
            cand = next_id_probe(shared.ctl_cand)
    raise AssertionError(f"job ids cannot be synchronised: beanstalkd {ref}, {CANDIDATE} {cand}")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    pair = start_pair(tmp_path_factory.mktemp("compat-shared"))
    try:
        wires = [Wire.open(s.port) for s in (pair.reference, pair.candidate)]
        for w in wires:
            w.sock.sendall(b"use compat-ctl\r\n")
            assert w.read_line() == b"USING compat-ctl\r\n", "control connection"
        yield Shared(pair, *wires)
        for w in wires:
            w.close()
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def fresh_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FreshPool]:
    pool = FreshPool(tmp_path_factory.mktemp("compat-fresh"), sum(c.fresh for c in CASES) * len(MODES))
    try:
        yield pool
    finally:
        pool.close()


def run_both(pair: ServerPair, case: Case, run: Run) -> tuple[list[Entry], list[Entry]]:
    with ThreadPoolExecutor(max_workers=2) as ex:
        ref: Future[list[Entry]] = ex.submit(run_case, pair.reference.port, case, run)
        cand: Future[list[Entry]] = ex.submit(run_case, pair.candidate.port, case, run)
        return ref.result(), cand.result()


def clip(data: bytes, limit: int = 400) -> str:
    text = repr(data)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(data)} bytes)"


def describe_divergence(case: Case, run: Run, ref: list[Entry], cand: list[Entry]) -> str:
    lines = [f"case {case.name!r} ({run.mode} send) diverges from beanstalkd:"]
    shown = 0
    for i in range(max(len(ref), len(cand))):
        r = ref[i] if i < len(ref) else ("<missing>", b"", b"<no entry>")
        c = cand[i] if i < len(cand) else ("<missing>", b"", b"<no entry>")
        if r[0] == c[0] and normalise(r[2]) == normalise(c[2]):
            continue
        lines += [
            f"  at {r[0]}" + ("" if r[0] == c[0] else f" / {CANDIDATE}: {c[0]}"),
            f"    sent:       {clip(r[1])}",
            f"    beanstalkd: {clip(r[2])}",
            f"    {CANDIDATE + ':':11} {clip(c[2])}",
        ]
        shown += 1
        if shown == 5:
            lines.append("  (further differences omitted)")
            break
    return "\n".join(lines)


def case_params() -> list[object]:
    return [
        pytest.param(case, mode, index, id=f"{case.name}-{mode}")
        for index, case in enumerate(CASES)
        for mode in MODES
    ]


@pytest.mark.parametrize(("case", "mode", "index"), case_params())
def test_compat_bytes(
    case: Case, mode: str, index: int, request: pytest.FixtureRequest
) -> None:
    tube = b"c%03d%s" % (index, mode[0].encode())
    if case.fresh:
        pool: FreshPool = request.getfixturevalue("fresh_pool")
        pair = pool.take()
        try:
            run = Run(tube, 0, False, mode)
            ref, cand = run_both(pair, case, run)
        finally:
            pool.release(pair)
    else:
        sh: Shared = request.getfixturevalue("shared")
        run = Run(tube, sync_job_ids(sh), True, mode)
        ref, cand = run_both(sh.pair, case, run)
    broken = [e for e in ref if e[2].startswith(b"<") and e[2] != CLOSED]
    assert not broken, f"case table bug: beanstalkd itself gave {broken[0]!r}"
    normal_ref = [(label, normalise(reply)) for label, _, reply in ref]
    normal_cand = [(label, normalise(reply)) for label, _, reply in cand]
    if normal_ref != normal_cand:
        pytest.fail(describe_divergence(case, run, ref, cand), pytrace=False)


# Every command smallstalk adds, in a form smallstalk accepts: beanstalkd must
# answer each UNKNOWN_COMMAND, so no extension changes a reply beanstalkd gives
# (docs/PROTOCOL-EXTENSIONS.md lists them).
SMALLSTALK_ONLY = (
    b"replicate 1 - 0\r\n", b"replica-ack 1\r\n", b"promote\r\n", b"delete-tube a+b\r\n",
    b"config\r\n", b"reload-config\r\n", b"auth s3cr3t\r\n", b"ext-stats\r\n",
    b"ext-stats-tube default\r\n", b"list-jobs default ready 0 10\r\n",
    b"flush-tube default\r\n", b"put-expiring 0 0 60 5 1\r\n", b"explain-job 1\r\n",
    b"move-job 1 other\r\n", b"search-jobs default ready substr 0 10 1\r\n",
    b"bulk-jobs default ready substr count - 10 1\r\n",
)
# ...except reserve-batch: beanstalkd reads any line that starts with `reserve`
# as a reserve, and answers BAD_FORMAT (the name is the one its maintainers sketched).
BAD_FORMAT_IN_BEANSTALKD = (b"reserve-batch 2 0\r\n",)


@needs_beanstalkd
def test_smallstalk_only_commands_are_unknown_to_beanstalkd(tmp_path: Path) -> None:
    ref = start_beanstalkd(tmp_path)
    try:
        w = Wire.open(ref.port)
        try:
            for line in SMALLSTALK_ONLY:
                w.sock.sendall(line)
                assert w.read_reply() == b"UNKNOWN_COMMAND\r\n", line
            for line in BAD_FORMAT_IN_BEANSTALKD:
                w.sock.sendall(line)
                assert w.read_reply() == b"BAD_FORMAT\r\n", line
        finally:
            w.close()
    finally:
        ref.stop()


def _stat(w: Wire, name: bytes) -> int:
    w.sock.sendall(b"stats\r\n")
    m = re.search(rb"\n%s: (\d+)\n" % name, w.read_reply())
    assert m, f"no {name!r} in stats"
    return int(m.group(1))


def _until(w: Wire, name: bytes, value: int) -> bytes:
    """Poll `stats` on a connection of its own until `name` reads `value`
    (the server has read what was sent before); what it came to if not."""
    deadline = time.monotonic() + 5.0
    while True:
        got = _stat(w, name)
        if got == value or time.monotonic() > deadline:
            return b"%s: %d" % (name, got)


def split_put_transcript(port: int) -> list[bytes]:
    """Puts whose bodies arrive after their lines, while another connection
    puts: the ids, counts and producers a server gives around them. The
    control connection only waits (`_until`); its `stats` are not compared."""
    a, b, ctl = Wire.open(port), Wire.open(port), Wire.open(port)
    out: list[bytes] = []

    def ask(w: Wire, data: bytes) -> None:
        w.sock.sendall(data)
        out.append(w.read_reply())

    try:
        ask(b, b"put 0 0 60 1\r\nx\r\n")
        a.sock.sendall(b"put 0 0 60 5\r\nhel")  # its line, part of its body
        out.append(_until(ctl, b"cmd-put", 2))
        out.append(b"producers: %d" % _stat(ctl, b"current-producers"))
        ask(b, b"put 0 0 60 1\r\ny\r\n")
        ask(a, b"lo\r\n")
        a.sock.sendall(b"put 0 0 60 70000\r\n" + b"z" * 100)  # too big, half sent
        out.append(_until(ctl, b"cmd-put", 4))
        ask(b, b"put 0 0 60 1\r\nz\r\n")
        ask(a, b"z" * 69900 + b"\r\n")
        gone = Wire.open(port)
        gone.sock.sendall(b"put 0 0 60 5\r\nhe")  # and hangs up mid-body
        out.append(_until(ctl, b"cmd-put", 6))
        gone.close()
        out.append(_until(ctl, b"current-connections", 3))
        ask(b, b"put 0 0 60 1\r\nw\r\n")
        a.sock.sendall(b"put 0 0 60 5\r\nhel")
        out.append(_until(ctl, b"cmd-put", 8))
        ask(a, b"loXX")  # a bad trailer: the job made at its line is not kept
        ask(b, b"put 0 0 60 1\r\nv\r\n")
        for name in (b"cmd-put", b"current-producers", b"total-jobs", b"current-jobs-ready"):
            out.append(b"%s: %d" % (name, _stat(ctl, name)))
        ask(b, b"reserve-with-timeout 0\r\n")  # the lowest id first: the split put's
    finally:
        for w in (a, b, ctl):
            w.close()
    return out


@needs_beanstalkd
def test_a_put_split_across_reads_is_counted_and_numbered_at_its_line(tmp_path: Path) -> None:
    """beanstalkd counts a put and makes its job (its id) at the put's line:
    a put from another connection while the body is on its way gets the next
    id, and a client that hangs up mid-body has used one."""
    pair = start_pair(tmp_path)
    try:
        ref = split_put_transcript(pair.reference.port)
        cand = split_put_transcript(pair.candidate.port)
    finally:
        pair.stop()
    assert ref[:6] == [b"INSERTED 1\r\n", b"cmd-put: 2", b"producers: 2", b"INSERTED 3\r\n",
                       b"INSERTED 2\r\n", b"cmd-put: 4"], "case table bug: beanstalkd differs"
    assert cand == ref
