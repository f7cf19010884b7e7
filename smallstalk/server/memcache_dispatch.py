"""What each command of kestrel's memcache dialect does, in the mutation loop.

The handlers are dispatch.py's kind (called by the loop, and only by it, with
the loop, the session and the command; they return the reply, BLOCK, CLOSE or
NOREPLY) and registered with it (`dispatch.register`). They make no record
type of their own: a memcache command is the beanstalkd records that mean the
same thing, so replay, replicas, `job-history`, the console and the analytics
see it like any other change.

- `SET q` is `use q` (when the session used another tube) and a put: the
  beanstalkd `put` handler itself, so tube limits, expiry and fanout apply.
  Memcache's expiry becomes the job's max-age.
- `GET q` takes the head of tube q: a `Delete` record. `/open` reserves it
  instead (`Reserve`): the reservation is the open read, so it ends with the
  connection (`Disconnect` puts it back) or with `/close` (`Delete`) or
  `/abort` (`Release` at its priority: it is the next one out again).
  `/peek` reads it and logs nothing. A session's open read on q is simply
  the job of tube q it has reserved: the state holds it, nothing else.
- `GET q/t=<ms>` on an empty tube waits as a beanstalkd reserve does (the
  session watches q alone: `Watch` and `Ignore` records), with a deadline in
  milliseconds; when a job comes the loop calls the session's `granted`
  (McSession below), which takes it as the GET asked; when time runs out,
  `wait_ended` answers END.
- `DELETE q` and `FLUSH q` delete q's unreserved jobs (`FlushTube`, the
  record of beanstalkd's `flush-tube`); `DELETE` of a fanout tube also stops
  its copies (`DeleteTube`). `FLUSH_ALL` flushes every tube.

Admin commands (`DELETE`, `FLUSH`, `FLUSH_ALL`, `SHUTDOWN`, `RELOAD`) follow
server/admin.py's rules, as the beanstalkd port's do: with a token, `auth
<token>` first; without one, the unix socket or an `--admin-allow` peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from smallstalk import __version__
from smallstalk.core import memcache as m
from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.lines import U32_MAX
from smallstalk.core.model import Job, fanout_parent
from smallstalk.core.state import NS, State
from smallstalk.server import dispatch, holdback
from smallstalk.server.commit import Unavailable
from smallstalk.storage.bodies import BodyError

if TYPE_CHECKING:
    from smallstalk.server.session import Session

log = logging.getLogger("smallstalk.server.memcache")

# A job put over memcache: kestrel's items have no priority (this one is
# below beanstalkd's urgent threshold of 1024, so never "urgent"), and an
# open read holds its item until /close or the connection ends, so the TTR
# is the longest beanstalkd allows.
SET_PRI = 1024
SET_TTR = U32_MAX
MS = 1_000_000  # ns

TAKE, OPEN, PEEK = range(3)

READ_ONLY = m.server_error("read-only: this server is a replica")
UNAVAILABLE = m.server_error("the journal is failing; not done")


class McService:
    """What the memcache port's connections share: kestrel's server-wide
    counters, the age of the last item taken per queue, and how to shut down."""

    def __init__(self, shutdown: Callable[[], None] | None = None) -> None:
        self.shutdown = shutdown  # None: SHUTDOWN is refused (no process to end)
        self.counters = dict.fromkeys(("cmd_get", "cmd_set", "cmd_peek", "get_hits",
                                       "get_misses"), 0)
        self.ages: dict[str, int] = {}  # queue -> ms the last item taken had waited

    def count(self, name: str) -> None:
        self.counters[name] += 1

    def taken(self, job: Job, now: int) -> None:
        self.counters["get_hits"] += 1
        self.ages[job.tube.name] = max(now - job.created, 0) // MS

    def session(self) -> McSession:
        return McSession(self)


class McSession:
    """A memcache connection's side of its session (Session.dialect): its
    parser, and what a GET that waits wants once a job comes."""

    __slots__ = ("service", "key", "mode", "cas")

    def __init__(self, service: McService) -> None:
        self.service = service
        self.key = b""  # the waiting GET's key, as sent
        self.mode = TAKE
        self.cas = False  # the waiting GET was a `gets`

    def parser(self, max_job_size: int) -> m.Parser:
        return m.Parser(max_job_size)

    def waits_for(self, key: bytes, mode: int, cas: bool = False) -> None:
        """A GET waits (its key as sent, TAKE, OPEN or PEEK, and whether a `gets`)."""
        self.key, self.mode, self.cas = key, mode, cas

    def granted(self, lp: dispatch.Loop, s: Session, job: Job) -> bytes:
        """A job for the waiting GET (loop.MutationLoop.grant_waiters): take it as
        the GET asked. Its records, or a WaitStop, end the wait."""
        return _take(lp, s, self.key, job, self.mode, waiting=True, cas=self.cas)

    def wait_ended(self, reply: bytes) -> bytes:
        """The wait ran out (or the client half-closed): an empty answer."""
        self.service.count("get_misses")
        return m.END


def _take(lp: dispatch.Loop, s: Session, key: bytes, job: Job, mode: int,
          waiting: bool = False, cas: bool = False) -> bytes:
    try:
        body = lp.body_of(job)  # before a Delete: read-behind may drop the file
    except BodyError as e:
        log.error("answering SERVER_ERROR: %s", e)
        if waiting:
            lp.volatile(r.WaitStop, s.id)
        return m.server_error("cannot read the item back")
    if mode == OPEN:
        lp.log_job(r.Reserve, s.id, job.id)  # also ends a wait
    else:
        if mode == TAKE:
            lp.log_job(r.Delete, s.id, job.id)
        if waiting:
            lp.volatile(r.WaitStop, s.id)
    s.dialect.service.taken(job, lp.now)
    return m.value(key, body, job.id if cas else None)  # a `gets`: the id as its cas


def open_read(st: State, cid: int, queue: str) -> Job | None:
    """The job of `queue` that connection `cid` holds reserved: its open read."""
    c = st.conn(cid)
    if c is None:
        return None
    for jid in c.reserved:
        j = st.jobs[jid]
        if j.tube.name == queue:
            return j
    return None


def _head(st: State, queue: str, now: int) -> Job | None:
    t = st.tubes.get(queue)
    if t is None or not t.ready_n or t.paused(now):
        return None
    return st.peek_ready(queue)


def _watch_only(lp: dispatch.Loop, s: Session, queue: str) -> None:
    """Make `queue` the one tube the session waits on."""
    st = lp.state
    if queue not in st.watch_of(s.id):
        lp.log(r.Watch, s.id, queue)
    for name in list(st.watch_of(s.id)):
        if name != queue:
            lp.log(r.Ignore, s.id, name)


def max_age(expiry: int, now: int) -> int:
    """Memcache's expiry (relative seconds below 1,000,000, else a Unix time) as
    a max-age in seconds; 0: none. One already past expires within a second."""
    if expiry == 0:
        return 0
    if expiry < 0:
        return 1
    if expiry < m.EXPIRY_ABSOLUTE:
        return min(expiry, U32_MAX)
    left = -(-(expiry * NS - now) // NS)  # ceiling
    return min(max(left, 1), U32_MAX)


# --- the handlers ----------------------------------------------------------------------


def mc_set(lp: dispatch.Loop, s: Session, cmd: m.McSet):
    s.dialect.service.counters["cmd_set"] += 1  # McService.count, inlined: every SET
    if cmd.too_big:
        reply = m.NOT_STORED
    elif lp.read_only:
        reply = READ_ONLY
    else:
        try:
            if lp.state.use_of(s.id) != cmd.queue:
                lp.log(r.Use, s.id, cmd.queue)
            put = p.Put(SET_PRI, 0, SET_TTR, cmd.body, max_age(cmd.expiry, lp.now))
            reply = m.STORED if dispatch.put(lp, s, put).startswith(b"INSERTED") \
                else m.NOT_STORED
        except Unavailable:
            reply = UNAVAILABLE
    return dispatch.NOREPLY if cmd.noreply else reply


def mc_get(lp: dispatch.Loop, s: Session, cmd: m.McGet):
    svc = s.dialect.service
    svc.counters["cmd_peek" if cmd.peek else "cmd_get"] += 1  # svc.count, inlined: every GET
    if lp.read_only and not cmd.peek:
        return READ_ONLY
    st = lp.state
    try:
        held = open_read(st, s.id, cmd.queue)
        if cmd.abort:
            # An abort is a release: a tube's back-off and attempt limits apply.
            if held is not None and not holdback.release(lp, s.id, held, held.pri, 0):
                lp.log(r.Release, s.id, held.id, held.pri, 0)
            return m.END
        if cmd.close and held is not None:
            lp.log(r.Delete, s.id, held.id)
            held = None
        if cmd.close and not cmd.open:
            return m.END
        if held is not None and not cmd.peek:
            # kestrel: a plain GET over an open read, or a second open read
            # of one queue, is answered ERROR and the connection closed.
            s.closing = True
            return m.ERROR
        if "+" in cmd.queue and not lp.read_only and not st.is_fanout_tube(cmd.queue) and \
                fanout_parent(cmd.queue) is not None:
            # kestrel: a fanout queue gets its parent's items once a client
            # names it. A watch makes the tube, which registers it.
            lp.log(r.Watch, s.id, cmd.queue)
        mode = PEEK if cmd.peek else OPEN if cmd.open else TAKE
        key = cmd.key or cmd.queue.encode()
        job = _head(st, cmd.queue, lp.now)
        if job is not None:
            return _take(lp, s, key, job, mode, cas=cmd.cas)
        if not cmd.timeout_ms or s.halfclosed or lp.read_only:
            svc.count("get_misses")
            return m.END
        _watch_only(lp, s, cmd.queue)
        s.dialect.waits_for(key, mode, cmd.cas)
        lp.state.start_wait(s.id, lp.now + cmd.timeout_ms * MS)
        return dispatch.BLOCK
    except Unavailable:
        return UNAVAILABLE


def _not_admin(lp: dispatch.Loop, s: Session) -> bytes:
    if lp.admin.token is not None:
        return m.client_error("UNAUTHORIZED: send `auth <token>` first")
    return m.client_error(f"UNAUTHORIZED: {s.peer or s.transport} is not an admin address "
                          "(--admin-allow, the unix socket, or --admin-token-file and auth)")


def _admin(handler):
    def guarded(lp: dispatch.Loop, s: Session, cmd):
        if not s.admin:
            reply = _not_admin(lp, s)
        elif lp.read_only and handler is not mc_reload:
            reply = READ_ONLY
        else:
            try:
                reply = handler(lp, s, cmd)
            except Unavailable:
                reply = UNAVAILABLE
        return dispatch.NOREPLY if getattr(cmd, "noreply", False) else reply
    return guarded


def _flush(lp: dispatch.Loop, s: Session, queue: str) -> None:
    if queue in lp.state.tubes:
        dispatch.flush_tube(lp, s, p.FlushTube(queue))  # the handler itself, not its guard


def mc_delete(lp: dispatch.Loop, s: Session, cmd: m.McDelete):
    _flush(lp, s, cmd.queue)
    if lp.state.is_fanout_tube(cmd.queue):
        lp.log(r.DeleteTube, s.id, cmd.queue)
    return m.DELETED


def mc_flush(lp: dispatch.Loop, s: Session, cmd: m.McFlush):
    _flush(lp, s, cmd.queue)
    return m.END


def mc_flush_all(lp: dispatch.Loop, s: Session, cmd: m.McFlushAll):
    for name in list(lp.state.tube_order):
        _flush(lp, s, name)
    return m.FLUSHED_ALL


def mc_reload(lp: dispatch.Loop, s: Session, cmd: m.McReload):
    err = lp.reload_config()
    if err is None:
        return m.RELOADED
    return m.server_error("not reloaded: " + " ".join(err.split()))


def mc_shutdown(lp: dispatch.Loop, s: Session, cmd: m.McShutdown):
    svc = s.dialect.service
    if svc.shutdown is None:
        return m.server_error("this server cannot be shut down from here")
    log.info("shutting down: SHUTDOWN from %s on the memcache port", s.peer or s.transport)
    svc.shutdown()
    return dispatch.CLOSE  # kestrel answers nothing and hangs up


def mc_version(lp: dispatch.Loop, s: Session, cmd: m.McVersion):
    return b"VERSION %s\r\n" % __version__.encode()


def mc_quit(lp: dispatch.Loop, s: Session, cmd: m.McQuit):
    return dispatch.CLOSE


def mc_error(lp: dispatch.Loop, s: Session, ev: m.McError):
    if ev.fatal:
        s.closing = True  # after this answer (kestrel disconnects too)
    return ev.reply or dispatch.NOREPLY


def queue_stats(lp: dispatch.Loop, svc: McService, name: str) -> list[tuple[str, object]]:
    """kestrel's per-queue statistics, as far as a tube has them."""
    t = lp.state.tubes[name]
    items = t.ready_n + t.delayed_n + len(t.buried)
    out: list[tuple[str, object]] = [
        ("items", items), ("bytes", t.bytes_n), ("total_items", t.total_jobs),
        ("expired_items", t.expired_n), ("mem_bytes", t.bytes_n - t.spilled_n),
        ("age", svc.ages.get(name, 0) if items else 0), ("discarded", t.discarded_n),
        ("waiters", len(t.waiting)), ("open_transactions", t.reserved_n),
    ]
    children = lp.state.fanout.get(name)
    if children:
        out.append(("children", ",".join(children)))
    return out


def mc_stats(lp: dispatch.Loop, s: Session, cmd: m.McStats):
    svc = s.dialect.service
    st = lp.state
    pairs: list[tuple[str, object]] = [
        ("uptime", (lp.now - lp.started_at) // NS), ("time", lp.now // NS),
        ("version", __version__),
        ("curr_items", st.ready_n + st.delayed_n + st.buried_n),
        ("total_items", st.total_jobs), ("bytes", st.body_bytes),
        ("curr_connections", len(lp.sessions)),
        ("total_connections", lp.total_connections),
    ]
    pairs += list(svc.counters.items())
    for name in st.tube_order:
        pairs += [(f"queue_{name}_{k}", v) for k, v in queue_stats(lp, svc, name)]
    return m.stat_lines(pairs)


def mc_dump_stats(lp: dispatch.Loop, s: Session, cmd: m.McDumpStats):
    svc = s.dialect.service
    tubes = lp.state.tubes
    names = [n for n in (cmd.queues or lp.state.tube_order) if n in tubes]
    return m.dump_stats([(n, queue_stats(lp, svc, n)) for n in names])


HANDLERS = {
    m.McSet: mc_set, m.McGet: mc_get, m.McDelete: _admin(mc_delete),
    m.McFlush: _admin(mc_flush), m.McFlushAll: _admin(mc_flush_all),
    m.McReload: _admin(mc_reload), m.McShutdown: _admin(mc_shutdown),
    m.McStats: mc_stats, m.McDumpStats: mc_dump_stats, m.McVersion: mc_version,
    m.McQuit: mc_quit, m.McError: mc_error,
}
dispatch.register(HANDLERS)
