"""Load generator for beanstalkd-protocol servers: raw sockets, epoll, a few processes.

One worker process drives many connections from a single epoll loop (no thread
per connection, no asyncio overhead); `run()` forks a handful of such workers
(default: one per core, at most one per connection), lines them up on a
barrier once every connection is open, starts them together and merges what
they measured. Every run is bounded in time (`duration`) and optionally in
operations (`max_ops`); a worker that does not report in time is killed.

Workloads (one "op" is what the rate counts):

  put       request/response: put, wait INSERTED                     op = put
  put-unique  as put, but smallstalk's `put-unique` with a new key each  op = put
  rd        request/response: reserve-with-timeout 0, delete <id>    op = job consumed
  cycle     request/response: put, reserve-with-timeout 0, delete    op = job cycled
  put-pipe  `depth` puts in one send, wait for all replies           op = put
  rd-pipe   `depth` reserves in one send, then their deletes in one  op = job consumed
  rd-batch  smallstalk's `reserve-batch depth 0`, then the deletes in one send  op = job consumed
  load      like put-pipe, but stops after `total` jobs (pre-loading) or at `duration`

In the request/response workloads every command's round-trip time is recorded
(nanoseconds); in the pipelined ones, each batch's.

Open loop (`rate`, request/response workloads only): each connection sends at
most `rate` commands a second, each no earlier than its slot (one every
1/rate s; a connection behind its slots sends at once and makes up at most
one interval).
Pacing uses a timerfd in the same epoll set (`Pacer`): epoll's own timeout
has millisecond resolution, which at tens of thousands of commands a second
paces at a fraction of the rate asked for, and a spin would take the CPU the
server needs on a small machine. The rate achieved comes back in the result
(`cmds_per_sec`), next to the one offered. The reserve workloads stop
a connection when the server answers TIMED_OUT (the queue ran dry): the rate
is then over the time until exhaustion.
"""

from __future__ import annotations

import ctypes
import heapq
import multiprocessing as mp
import os
import random
import select
import socket
import time
from array import array

WORKLOADS = ("put", "rd", "cycle", "put-pipe", "rd-pipe", "load", "put-unique", "rd-batch")
SMALLSTALK_ONLY = ("put-unique", "rd-batch")  # beanstalkd does not serve these
PIPELINED = ("put-pipe", "rd-pipe", "load", "rd-batch")
# Commands that make one op (what CPU per command divides by).
COMMANDS_PER_OP = {"put": 1, "rd": 2, "cycle": 3, "put-pipe": 1, "rd-pipe": 2, "load": 1,
                   "put-unique": 1, "rd-batch": 1}  # rd-batch: a delete, 1/depth of a reserve

RESERVE = b"reserve-with-timeout 0\r\n"


def put_command(body_size: int = 100, pri: int = 1024, ttr: int = 60) -> bytes:
    return b"put %d 0 %d %d\r\n" % (pri, ttr, body_size) + b"x" * body_size + b"\r\n"


def put_unique_command(key: bytes, body_size: int = 100, pri: int = 1024, ttr: int = 60) -> bytes:
    return (b"put-unique %s %d 0 %d %d\r\n" % (key, pri, ttr, body_size) + b"x" * body_size
            + b"\r\n")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Pacer:
    """A CLOCK_MONOTONIC timerfd armed at the earliest paced send (absolute ns).

    Through libc with ctypes: `os.timerfd_create` arrived in Python 3.13."""

    CLOCK_MONOTONIC = 1
    TFD_NONBLOCK = os.O_NONBLOCK
    TFD_CLOEXEC = os.O_CLOEXEC
    TFD_TIMER_ABSTIME = 1

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int,
                                  ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        self.fd = libc.timerfd_create(self.CLOCK_MONOTONIC,
                                      self.TFD_NONBLOCK | self.TFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self._spec = _Itimerspec()
        self.armed = 0  # the absolute time it fires next (0: disarmed)

    def arm(self, at_ns: int) -> None:
        """Fire at monotonic time `at_ns` (time.monotonic_ns's clock)."""
        at_ns = max(at_ns, 1)
        self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = divmod(at_ns, 1_000_000_000)
        if self._settime(self.fd, self.TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) < 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime")
        self.armed = at_ns

    def fired(self) -> None:
        self.armed = 0
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)


class Conn:
    __slots__ = ("sock", "fd", "buf", "state", "t0", "out", "ids", "outstanding",
                 "remaining", "dry", "done", "keys", "slot", "next")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.fd = sock.fileno()
        self.buf = b""
        self.state = 0
        self.t0 = 0
        self.out = b""  # bytes a short send left behind
        self.ids: list[bytes] = []
        self.outstanding = 0
        self.remaining = 0
        self.dry = False
        self.done = False
        self.keys = 0  # put-unique: keys used so far
        self.slot = 0  # paced: when this connection last sent (or may send next)
        self.next = b""  # paced: the command waiting for its slot


def _connect(port: int, host: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((host, port), timeout=min(2.0, timeout))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    return s


def _reply(buf: bytes, pos: int):
    """One reply from buf[pos:]: (line, end) or None if incomplete. Bodies skipped."""
    i = buf.find(b"\r\n", pos)
    if i < 0:
        return None
    line = buf[pos:i]
    if line[:14] == b"RESERVED_BATCH":  # its RESERVED replies follow, each on its own
        return line, i + 2
    if line[:8] == b"RESERVED" or line[:5] == b"FOUND" or line[:2] == b"OK":
        end = i + 2 + int(line.rsplit(b" ", 1)[1]) + 2
        if len(buf) < end:
            return None
        return line, end
    return line, i + 2


def worker(port: int, host: str, workload: str, nconns: int, depth: int, total: int,
           max_ops: int, body_size: int, pipe, rate: float = 0.0) -> None:
    """Body of one load process; talks to the parent over `pipe`."""
    try:
        conns = [Conn(_connect(port, host, 10.0)) for _ in range(nconns)]
    except OSError as e:
        pipe.send(("error", f"connect: {e}"))
        return
    pipe.send(("ready", nconns))
    msg = pipe.recv()
    if msg[0] != "go":
        return
    deadline = msg[1]
    result = _drive(conns, workload, depth, total, max_ops, body_size, deadline, rate)
    for c in conns:
        try:
            c.sock.close()
        except OSError:
            pass
    pipe.send(("result", result))


def _drive(conns, workload, depth, total, max_ops, body_size, deadline, rate=0.0):
    put = put_command(body_size)
    put_batch = put * depth
    reserve_batch = RESERVE * depth
    batch_cmd = b"reserve-batch %d 0\r\n" % depth
    ep = select.epoll()
    by_fd = {}
    for c in conns:
        by_fd[c.fd] = c
        ep.register(c.fd, select.EPOLLIN)
    lat = array("q")
    rec = lat.append
    clock = time.monotonic_ns
    ops = errors = timeouts = 0
    live = len(conns)
    cpu0 = time.process_time()
    t_start = clock()
    pid = os.getpid()

    def next_put(c) -> bytes:
        """The connection's next put: the same bytes, or a put-unique with a new key."""
        if workload != "put-unique":
            return put
        c.keys += 1
        return put_unique_command(b"k%d-%d-%d" % (pid, c.fd, c.keys), body_size)
    pacer = Pacer() if rate else None
    interval = int(1e9 / rate) if rate else 0
    slots: list = []  # paced: (slot, fd) of commands waiting for their time
    late = array("q")  # paced: how late each timed send left, ns
    if pacer is not None:
        ep.register(pacer.fd, select.EPOLLIN)
        for c in conns:  # phases spread over one interval
            c.slot = t_start - interval + random.randrange(interval or 1)

    def issue(c, data, now):
        """Send a request/response command now, or at its slot when paced."""
        if pacer is None:
            c.t0 = now
            send(c, data)
            return
        slot = c.slot + interval
        if slot <= now:
            # Behind: send now; a lag of up to one interval is made up later,
            # a longer one is dropped (no burst: at most `rate` a second).
            c.slot = slot if now - slot < interval else now
            c.t0 = now
            send(c, data)
            return
        c.slot = slot
        c.next = data
        heapq.heappush(slots, (slot, c.fd))
        if not pacer.armed or slot < pacer.armed:
            pacer.arm(slot)

    def paced_sends():
        pacer.fired()
        now = clock()
        while slots and slots[0][0] <= now:
            slot, fd = heapq.heappop(slots)
            c = by_fd[fd]
            if c.done:
                continue
            late.append(now - slot)
            c.t0 = now
            send(c, c.next)
            c.next = b""
        if slots:
            pacer.arm(slots[0][0])

    def send(c, data):
        if c.out:
            c.out += data
            return
        try:
            n = c.sock.send(data)
        except BlockingIOError:
            n = 0
        if n < len(data):
            c.out = data[n:]
            ep.modify(c.fd, select.EPOLLIN | select.EPOLLOUT)

    # Kick every connection off.
    per_conn_total = []
    if workload == "load":
        base, extra = divmod(total, len(conns))
        per_conn_total = [base + (1 if i < extra else 0) for i in range(len(conns))]
    for i, c in enumerate(conns):
        c.t0 = clock()
        if workload in ("put", "cycle", "put-unique"):
            c.keys = 0
            issue(c, next_put(c), c.t0)
        elif workload == "rd":
            c.state = 1
            issue(c, RESERVE, c.t0)
        elif workload == "put-pipe":
            c.outstanding = depth
            send(c, put_batch)
        elif workload == "rd-pipe":
            c.outstanding = depth
            send(c, reserve_batch)
        elif workload == "rd-batch":
            c.outstanding = 1  # RESERVED_BATCH says how many follow, or TIMED_OUT
            send(c, batch_cmd)
        elif workload == "load":
            c.remaining = per_conn_total[i]
            n = min(depth, c.remaining)
            if n == 0:
                c.done = True
                live -= 1
                continue
            c.remaining -= n
            c.outstanding = n
            send(c, put * n)
        else:
            raise ValueError(f"unknown workload {workload}")

    limit = max_ops if max_ops else 1 << 62
    while live > 0 and ops < limit:
        now = clock()
        if now >= deadline:
            break
        events = ep.poll(min((deadline - now) / 1e9, 1.0))
        for fd, ev in events:
            if pacer is not None and fd == pacer.fd:
                paced_sends()
                continue
            c = by_fd[fd]
            if c.done:
                continue
            if ev & select.EPOLLOUT and c.out:
                try:
                    n = c.sock.send(c.out)
                except BlockingIOError:
                    n = 0
                c.out = c.out[n:]
                if not c.out:
                    ep.modify(fd, select.EPOLLIN)
            if not ev & (select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP):
                continue
            try:
                data = c.sock.recv(262144)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                errors += 1
                c.done = True
                live -= 1
                ep.unregister(fd)
                continue
            now = clock()
            buf = c.buf + data if c.buf else data

            if workload == "put" or workload == "put-unique":
                if buf[-2:] != b"\r\n":
                    c.buf = buf
                    continue
                c.buf = b""
                rec(now - c.t0)
                if buf[:8] == b"INSERTED":
                    ops += 1
                else:
                    errors += 1
                issue(c, next_put(c), now)
                continue

            if workload in ("put-pipe", "load"):
                cut = buf.rfind(b"\n") + 1
                c.buf = buf[cut:]
                if cut == 0:
                    continue
                whole = buf[:cut]
                n = whole.count(b"\n")
                ok = whole.count(b"INSERTED")
                ops += ok
                errors += n - ok
                c.outstanding -= n
                if c.outstanding > 0:
                    continue
                rec(now - c.t0)
                c.t0 = now
                if workload == "load":
                    n = min(depth, c.remaining)
                    if n == 0:
                        c.done = True
                        live -= 1
                        continue
                    c.remaining -= n
                    c.outstanding = n
                    send(c, put if n == 1 else put * n)
                else:
                    c.outstanding = depth
                    send(c, put_batch)
                continue

            # Replies that may carry bodies: parse them one by one.
            pos = 0
            while True:
                r = _reply(buf, pos)
                if r is None:
                    break
                line, pos = r
                if workload == "rd-pipe" or workload == "rd-batch":
                    if c.state == 0 and line[:15] == b"RESERVED_BATCH ":
                        c.outstanding = int(line[15:])
                        continue
                    c.outstanding -= 1
                    if c.state == 0:  # reserving
                        if line[:8] == b"RESERVED":
                            c.ids.append(line.split(b" ", 2)[1])
                        elif line == b"TIMED_OUT":
                            c.dry = True
                        else:
                            errors += 1
                            c.dry = True
                        if c.outstanding == 0:
                            rec(now - c.t0)
                            c.t0 = now
                            if c.ids:
                                c.state = 1
                                c.outstanding = len(c.ids)
                                send(c, b"".join(b"delete %s\r\n" % i for i in c.ids))
                                c.ids = []
                            else:
                                c.done = True
                                live -= 1
                    else:  # deleting
                        if line == b"DELETED":
                            ops += 1
                        else:
                            errors += 1
                        if c.outstanding == 0:
                            rec(now - c.t0)
                            c.t0 = now
                            if c.dry:
                                c.done = True
                                live -= 1
                            elif workload == "rd-batch":
                                c.state = 0
                                c.outstanding = 1
                                send(c, batch_cmd)
                            else:
                                c.state = 0
                                c.outstanding = depth
                                send(c, reserve_batch)
                    continue
                # request/response: exactly one command outstanding
                rec(now - c.t0)
                st = c.state
                if st == 0:  # put answered (cycle)
                    if line[:8] != b"INSERTED":
                        errors += 1
                    c.state = 1
                    issue(c, RESERVE, now)
                elif st == 1:  # reserve answered
                    if line[:8] == b"RESERVED":
                        c.state = 2
                        issue(c, b"delete %s\r\n" % line.split(b" ", 2)[1], now)
                    elif workload == "rd":
                        if line != b"TIMED_OUT":
                            errors += 1
                        c.done = True
                        live -= 1
                        break
                    else:  # cycle: somebody else took "our" job; put another
                        timeouts += 1
                        c.state = 0
                        issue(c, put, now)
                else:  # delete answered
                    if line == b"DELETED":
                        ops += 1
                    else:
                        errors += 1
                    if workload == "rd":
                        c.state = 1
                        issue(c, RESERVE, now)
                    else:
                        c.state = 0
                        issue(c, put, now)
            c.buf = buf[pos:] if pos < len(buf) else b""

    t_end = clock()
    cpu1 = time.process_time()
    ep.close()
    if pacer is not None:
        pacer.close()
    return {
        "late": late.tobytes(),
        "ops": ops,
        "errors": errors,
        "timeouts": timeouts,
        "t_start": t_start,
        "t_end": t_end,
        "cpu": cpu1 - cpu0,
        "lat": lat.tobytes(),
    }


def percentile(sorted_values, q: float):
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[k]


def run(port: int, workload: str, conns: int, *, duration: float = 5.0, procs: int | None = None,
        depth: int = 100, total: int = 0, max_ops: int = 0, body_size: int = 100,
        host: str = "127.0.0.1", probe=None, keep_latencies: bool = False,
        rate: float = 0.0) -> dict:
    """Drive one server with `conns` connections spread over a few processes.

    `rate` > 0: open loop, each connection sends at most `rate` commands a second
    (request/response workloads only).

    `probe()` (optional) is called just before the start signal and right after
    the last worker reported; its two return values come back as
    result["probe"] = (before, after), e.g. the server's CPU ticks.
    For `load`, `total` jobs are put and `duration` is only a safety bound.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload}")
    if rate and workload in PIPELINED:
        raise ValueError(f"open loop (rate) is for request/response workloads, not {workload}")
    procs = procs or os.cpu_count() or 2
    procs = max(1, min(procs, conns))
    shares = [conns // procs + (1 if i < conns % procs else 0) for i in range(procs)]
    ctx = mp.get_context("fork")
    per_proc_ops = -(-max_ops // procs) if max_ops else 0
    totals = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
    workers = []
    try:
        for i, n in enumerate(shares):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker, daemon=True,
                            args=(port, host, workload, n, depth, totals[i], per_proc_ops,
                                  body_size, child, rate))
            p.start()
            child.close()
            workers.append((p, parent))
        for _p, pipe in workers:
            if not pipe.poll(30):
                raise RuntimeError("load worker did not connect within 30 s")
            msg = pipe.recv()
            if msg[0] != "ready":
                raise RuntimeError(f"load worker failed: {msg[1]}")
        before = probe() if probe else None
        t_go = time.monotonic_ns()
        deadline = t_go + int(duration * 1e9)
        for _, pipe in workers:
            pipe.send(("go", deadline))
        results = []
        grace = duration + 30.0
        for _p, pipe in workers:
            if not pipe.poll(max(1.0, grace - (time.monotonic_ns() - t_go) / 1e9)):
                raise RuntimeError("load worker did not report in time")
            msg = pipe.recv()
            results.append(msg[1])
        after = probe() if probe else None
        t_done = time.monotonic_ns()
    finally:
        for p, _ in workers:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    lat = array("q")
    for r in results:
        lat.frombytes(r["lat"])
    lat = sorted(lat)
    late = array("q")
    for r in results:
        late.frombytes(r["late"])
    late = sorted(late)
    ops = sum(r["ops"] for r in results)
    t_end = max(r["t_end"] for r in results)
    elapsed = max(1e-9, (t_end - t_go) / 1e9)
    out = {
        "workload": workload,
        "conns": conns,
        "procs": procs,
        "depth": depth if workload in PIPELINED else 1,
        "ops": ops,
        "errors": sum(r["errors"] for r in results),
        "timeouts": sum(r["timeouts"] for r in results),
        "elapsed": elapsed,
        "wall": (t_done - t_go) / 1e9,
        "ops_per_sec": ops / elapsed,
        "client_cpu": sum(r["cpu"] for r in results),
        "lat_count": len(lat),
        "lat_p50_us": _us(percentile(lat, 0.50)),
        "lat_p99_us": _us(percentile(lat, 0.99)),
        "lat_p999_us": _us(percentile(lat, 0.999)),
        "lat_mean_us": _us(sum(lat) / len(lat)) if lat else None,
    }
    out["client_cpu_pct"] = 100.0 * out["client_cpu"] / out["wall"] if out["wall"] else None
    out["cmds_per_sec"] = ops * COMMANDS_PER_OP[workload] / elapsed
    if rate:
        out["rate_per_conn"] = rate
        out["offered_cmds_per_sec"] = rate * conns
        out["achieved_share"] = round(out["cmds_per_sec"] / (rate * conns), 3)
        # How late the timer let paced sends go (a send behind its slot for want
        # of a reply is not counted: that is the server's lateness, not the pacer's).
        out["pacer_late_p50_us"] = _us(percentile(late, 0.50))
        out["pacer_late_p99_us"] = _us(percentile(late, 0.99))
    if probe:
        out["probe"] = (before, after)
    if keep_latencies:
        out["latencies_ns"] = lat  # sorted; for merging several runs
    return out


def latency_summary(sorted_ns) -> dict:
    return {
        "lat_count": len(sorted_ns),
        "lat_p50_us": _us(percentile(sorted_ns, 0.50)),
        "lat_p99_us": _us(percentile(sorted_ns, 0.99)),
        "lat_p999_us": _us(percentile(sorted_ns, 0.999)),
        "lat_mean_us": _us(sum(sorted_ns) / len(sorted_ns)) if sorted_ns else None,
    }


def _us(ns):
    return None if ns is None else round(ns / 1000.0, 1)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="drive a beanstalkd-protocol server")
    ap.add_argument("-p", "--port", type=int, default=11300)
    ap.add_argument("-w", "--workload", choices=WORKLOADS, default="put")
    ap.add_argument("-c", "--conns", type=int, default=10)
    ap.add_argument("-d", "--duration", type=float, default=5.0)
    ap.add_argument("--procs", type=int, default=None)
    ap.add_argument("--depth", type=int, default=100)
    ap.add_argument("--total", type=int, default=0)
    ap.add_argument("--max-ops", type=int, default=0)
    ap.add_argument("-r", "--rate", type=float, default=0.0,
                    help="open loop: at most this many commands a second per connection")
    a = ap.parse_args()
    print(json.dumps(run(a.port, a.workload, a.conns, duration=a.duration, procs=a.procs,
                         depth=a.depth, total=a.total, max_ops=a.max_ops, rate=a.rate),
                     indent=1))
