"""What each protocol command does: read the state, decide, and log the record.

One function per command, called by the mutation loop (and only by it) with
the loop, the connection's session and the parsed command. A handler either
returns the reply bytes, or `BLOCK` when a reserve has to wait for a job.
Every decision (the id a put gets, the job a reserve is granted, the jobs a
kick moves) is made here against the current state and written into the
record that `loop.log(...)` stages in the AOF and then applies. The
statistics commands read server/stats.py.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Protocol

from smallstalk.core import explain
from smallstalk.core import protocol as p
from smallstalk.core import records as r
from smallstalk.core.model import DEFAULT_TUBE, RESERVER, STATE_BY_NAME, Conn, Job
from smallstalk.core.protocol import DEADLINE_SOON, DELETED, NOT_FOUND, TIMED_OUT
from smallstalk.core.state import BURIED, DELAYED, NS, READY, RESERVED, State, body_len
from smallstalk.core.stats import job_key_stats, job_stats, tube_stats
from smallstalk.server import holdback
from smallstalk.server import stats as server_stats
from smallstalk.server.admin import AUTH_FAIL_DELAY, AdminPolicy, token_matches
from smallstalk.server.policy import Policies, TubePolicy, render
from smallstalk.server.search import Searches
from smallstalk.server.session import Session
from smallstalk.storage.bodies import BodyError

try:  # the compiled build's writer of INSERTED and RESERVED (core/jobreply.pyx)
    from smallstalk.core import jobreply
    FAST_REPLY = True
except ImportError:  # the pure build: replies.py's formatting, inlined below
    FAST_REPLY = False

# The everyday handlers' answers and records by names of this module's own
# (DELETED, NOT_FOUND... imported above): compiled, `p.DELETED` is a lookup in
# another module on every use, a global of this one is looked up once.
RESERVE_RECORD, DELETE_RECORD = r.Reserve, r.Delete

log = logging.getLogger("smallstalk.server.dispatch")

BLOCK = object()  # the reserve waits; the loop answers it later
CLOSE = object()  # quit: answer nothing more and close
NOREPLY = object()  # a command that is not answered (a replica's ack)


class Loop(server_stats.Observed, Protocol):
    """What the handlers read and call of the mutation loop (loop.MutationLoop):
    the state to decide on, and the loop's named ways to change things."""

    state: State
    policies: Policies
    admin: AdminPolicy
    replication: object | None  # roles.Replication, installed by cli.py
    read_only: str | None
    extended_stats: bool

    def count(self, name: str) -> None: ...

    def count_tube(self, tube: str, name: str) -> None: ...

    def take_job_id(self) -> int: ...

    def burn_job_id(self) -> None: ...

    def log(self, cls: type, *fields) -> r.Record: ...

    def log_job(self, apply: Callable[[int, int, int, int], None], cls: type, conn: int,
                job_id: int) -> None: ...

    def log_put(self, conn: int, tube: str, pri: int, delay: int, ttr: int,
                body: bytes) -> int: ...

    def log_put_unique(self, conn: int, tube: str, key: str, unique_for: int, keys_max: int,
                       pri: int, delay: int, ttr: int, body: bytes) -> int: ...

    def volatile(self, cls: type, *fields) -> None: ...

    def body_of(self, job) -> bytes: ...

    def answer_later(self, s: Session, reply: bytes, seconds: float) -> None: ...

    def replica_acked(self, s: Session, seq: int) -> None: ...

    def replicated(self, seq: int) -> bool: ...

    def reload_config(self) -> str | None: ...

    def peer_of(self, cid: int) -> str | None: ...

    searches: Searches


def put(lp: Loop, s: Session, cmd: p.Put):
    counters = lp.counters  # lp.count("cmd-put"), inlined: the commonest command
    counters["cmd-put"] = counters.get("cmd-put", 0) + 1
    s.producer = True
    if lp.draining:
        lp.burn_job_id()  # as in beanstalkd, the job was made before the check
        return p.DRAINING
    st = lp.state
    c: Conn = st.conns.get(s.id)  # st.use_of(s.id), inlined
    tube = c.use if c is not None else DEFAULT_TUBE
    pols = lp.policies
    named: dict = pols.tubes  # (typed: compiled, its `get` is a direct call)
    pol = named.get(tube, pols.default)  # pols.of(tube), inlined
    children = st.fanout.get(tube)
    if pol.plain and not children and not cmd.max_age:
        # The common case: a plain, format-1 Put record (its id taken there).
        job_id = lp.log_put(s.id, tube, cmd.pri, cmd.delay, cmd.ttr, cmd.body)
        if FAST_REPLY:
            return jobreply.inserted(job_id)
        return b"INSERTED %d\r\n" % job_id  # p.inserted(job_id), inlined
    return _put_with_policy(lp, s, cmd, tube, pol, children or [])


def put_heard(lp: Loop, s: Session, cmd: p.PutHeard):
    """A put's line, its body still to come: counted, and unless the body is
    too big the connection a producer and the job's id taken, where beanstalkd
    makes the job (commands.PutHeard). Nothing is answered until the body."""
    if lp.read_only:
        return NOREPLY  # its PutRest is refused READ_ONLY, uncounted, as a put is
    lp.count("cmd-put")
    if cmd.job:
        s.producer = True
        s.put_id = lp.take_job_id()
    return NOREPLY


def put_rest(lp: Loop, s: Session, cmd: p.PutRest):
    """The put `put_heard` began, now its body is in: `put`, with the id taken
    at its line (a plain put's Put record made by `log`, not `log_put`)."""
    job_id, s.put_id = s.put_id, 0
    if lp.draining:
        return p.DRAINING  # as in beanstalkd, after the job was made
    st = lp.state
    tube = st.use_of(s.id)
    pol = lp.policies.of(tube)
    children = st.fanout.get(tube)
    if pol.plain and not children and not cmd.max_age:
        lp.log(r.Put, s.id, job_id, tube, cmd.pri, cmd.delay, cmd.ttr, cmd.body)
        return p.inserted(job_id)
    return _put_with_policy(lp, s, cmd, tube, pol, children or [], job_id)


def _put_with_policy(lp: Loop, s: Session, cmd: p.Put | p.PutUnique, tube: str,
                     pol: TubePolicy, children: list[str], first_id: int = 0):
    """A put that limits, expiry, fanout or a key touch: one PutJobs (PutUnique
    with a key) record, a refusal, or the id of the job its key already made.
    `first_id`: the id a `put_heard` took for its first job."""
    st = lp.state
    key = cmd.key if type(cmd) is p.PutUnique else body_key(cmd.body) if pol.unique else ""
    if key:
        held = st.keys.find(tube, key, lp.now)
        if held is not None:
            if not lp.replicated(st.keys.put_seq(held)):
                # Its put is not on a replica yet: a failover now would lose the
                # job, so the repeat is not confirmed either (the client retries).
                return p.NOT_REPLICATED
            lp.count_tube(tube, "puts-deduplicated")
            return p.duplicate(held) if type(cmd) is p.PutUnique else p.inserted(held)
    size = len(cmd.body)
    if pol.max_job_size and size > pol.max_job_size:
        lp.count_tube(tube, "puts-refused")
        return p.JOB_TOO_BIG
    dropped: list[int] = []
    targets = [] if pol.fanout_only else [tube]
    if targets and not _make_room(st, tube, pol, size, dropped):
        lp.count_tube(tube, "puts-refused")
        return p.OUT_OF_MEMORY
    for child in children:
        cpol = lp.policies.of(child)
        if (cpol.max_job_size and size > cpol.max_job_size) or not _make_room(
                st, child, cpol, size, dropped):
            lp.count_tube(child, "puts-refused")  # this copy only; the put goes on
            continue
        targets.append(child)
    max_age = 0 if type(cmd) is p.PutUnique else cmd.max_age
    ages = [a for a in (max_age, pol.max_age) if a]
    expires = lp.now + min(ages) * NS if ages else 0
    if not targets:
        # A fanout-only tube nobody listens to: accepted, and kept nowhere.
        job_id = first_id or lp.take_job_id()
        return p.inserted(job_id)
    jobs = [(first_id or lp.take_job_id(), targets[0])]
    jobs += [(lp.take_job_id(), t) for t in targets[1:]]
    if key:
        lp.log(r.PutUnique, s.id, tube, key, pol.unique_for, pol.unique_keys_max, jobs,
               cmd.pri, cmd.delay, cmd.ttr, expires, dropped, cmd.body)
    else:
        lp.log(r.PutJobs, s.id, jobs, cmd.pri, cmd.delay, cmd.ttr, expires, dropped, cmd.body)
    return p.inserted(jobs[0][0])


# --- exactly-once enqueue (core/keys.py) ---------------------------------------------


def put_unique(lp: Loop, s: Session, cmd: p.PutUnique):
    """`put-unique <key> ...`: INSERTED <id> for a new job, DUPLICATE <id> when
    the key already made one (docs/PROTOCOL-EXTENSIONS.md)."""
    counters = lp.counters  # as in `put`: the count, the tube and its policy inlined
    counters["cmd-put"] = counters.get("cmd-put", 0) + 1
    s.producer = True
    if lp.draining:
        lp.burn_job_id()
        return p.DRAINING
    st = lp.state
    c: Conn = st.conns.get(s.id)
    tube = c.use if c is not None else DEFAULT_TUBE
    pols = lp.policies
    named: dict = pols.tubes
    pol = named.get(tube, pols.default)
    children = st.fanout.get(tube)
    keyed = pol.keyed_put
    if keyed is not None and not children and st.keys.find(tube, cmd.key, lp.now) is None:
        # The common case, without _put_with_policy's decisions: one job, no drops.
        job_id = lp.log_put_unique(s.id, tube, cmd.key, keyed[0], keyed[1],
                                   cmd.pri, cmd.delay, cmd.ttr, cmd.body)
        if FAST_REPLY:
            return jobreply.inserted(job_id)
        return b"INSERTED %d\r\n" % job_id
    return _put_with_policy(lp, s, cmd, tube, pol, children or [])


def body_key(body: bytes) -> str:
    """The key of a put into a `unique = "body"` tube: its body's digest. `#`
    is no key character, so it never equals a client's key."""
    return "#" + hashlib.blake2b(body, digest_size=16).hexdigest()


def _make_room(st: State, tube: str, pol: TubePolicy, size: int, dropped: list[int]) -> bool:
    """Whether a job of `size` bytes fits in `tube`, adding to `dropped` the
    oldest ready jobs that must go first (discard-old-when-full)."""
    if not (pol.max_jobs or pol.max_bytes):
        return True
    t = st.tubes.get(tube)
    jobs_n, bytes_n = (t.jobs_n, t.bytes_n) if t is not None else (0, 0)
    over_jobs = jobs_n + 1 - pol.max_jobs if pol.max_jobs else 0
    over_bytes = bytes_n + size - pol.max_bytes if pol.max_bytes else 0
    if over_jobs <= 0 and over_bytes <= 0:
        return True
    if not pol.discard_old_when_full or (pol.max_bytes and size > pol.max_bytes):
        return False
    victims = st.oldest_ready(tube, max(over_jobs, 0), max(over_bytes, 0))
    freed = sum(body_len(st.jobs[v].body) for v in victims)
    if len(victims) < over_jobs or freed < over_bytes:
        return False  # not enough ready jobs to drop: reserved/buried ones stay
    dropped.extend(victims)
    return True


def reserve(lp: Loop, s: Session, cmd: p.Reserve):
    name = "cmd-reserve" if cmd.timeout is None else "cmd-reserve-with-timeout"
    counters = lp.counters  # lp.count(name), inlined
    counters[name] = counters.get(name, 0) + 1
    s.worker = True
    st = lp.state
    now = lp.now
    # A job to take means a watched tube has one ready (has_ready), so no
    # DEADLINE_SOON: that check waits until there is none.
    job: Job = st.best_ready(s.id, now)
    if job is not None:
        return hand_out(lp, s.id, job)
    # has_ready first: deadline_soon looks at every job the connection holds
    # (a worker that pipelines reserves would pay it once per reserve).
    if not st.has_ready(s.id) and st.deadline_soon(s.id, now):
        return DEADLINE_SOON
    if cmd.timeout == 0 or s.halfclosed:
        return TIMED_OUT
    timeout = cmd.timeout
    st.start_wait(s.id, None if timeout is None or timeout < 0 else now + timeout * NS)
    return BLOCK


def reserve_batch(lp: Loop, s: Session, cmd: p.ReserveBatch):
    """Up to `count` ready jobs, one Reserve record each: `RESERVED_BATCH <n>`
    then n `RESERVED` replies; with none ready it waits as reserve-with-timeout
    does, and the loop's grant fills the batch (`batch_reply`)."""
    lp.count("cmd-reserve-batch")
    s.worker = True
    st = lp.state
    if not st.has_ready(s.id) and st.deadline_soon(s.id, lp.now):
        return p.DEADLINE_SOON
    job = st.best_ready(s.id, lp.now)
    if job is not None:
        return batch_reply(lp, s.id, job, cmd.count)
    if cmd.timeout == 0 or s.halfclosed:
        return p.TIMED_OUT
    s.batch = cmd.count
    st.start_wait(s.id, lp.now + cmd.timeout * NS)
    return BLOCK


def hand_out(lp: Loop, cid, job: Job) -> bytes:  # cid unannotated: dispatch.pxd
    """Reserve `job` for `cid` and answer RESERVED with its body: a reserve
    that finds a job, and the loop's grant to a waiting one. A body that
    cannot be read raises BodyError after the record (the TTR gives it back)."""
    lp.log_job(RESERVE_RECORD, cid, job.id)
    body = job.body
    if type(body) is not bytes:
        body = lp.body_of(job)
    if FAST_REPLY:
        return jobreply.reserved(job.id, body)
    return b"RESERVED %d %d\r\n%s\r\n" % (job.id, len(body), body)  # p.reserved's


def batch_reply(lp: Loop, cid: int, job, count: int) -> bytes:
    """Reserve `job` for `cid`, then the next best ready jobs up to `count`
    in all, and answer them in one reply: a job is reserved only if it is in it.

    Each job's body is read before its Reserve record is logged, so a body
    that cannot be read reserves nothing: it ends the batch short, or, for
    the first job, ends `cid`'s wait (if the loop's grant called) and answers
    INTERNAL_ERROR with no record. Plain `reserve` logs first and keeps that
    reservation (the TTR gives it back); a batch hands out no job it cannot
    carry. Never raises BodyError (the grant resets the batch afterwards)."""
    out = []
    while True:
        try:
            body = lp.body_of(job)
        except BodyError as e:
            if out:
                log.error("reserve-batch ends at %d jobs: job %d: %s", len(out), job.id, e)
                break
            log.error("answering reserve-batch INTERNAL_ERROR, job %d stays ready: %s",
                      job.id, e)
            lp.volatile(r.WaitStop, cid)
            return p.INTERNAL_ERROR
        lp.log_job(r.Reserve, cid, job.id)
        out.append((job.id, body))
        if len(out) >= count:
            break
        job = lp.state.best_ready(cid, lp.now)
        if job is None:
            break
    return p.reserved_batch(out)


def explain_job(lp: Loop, s: Session, cmd: p.ExplainJob):
    lp.count("cmd-explain-job")
    pairs = explain.explain(lp.state, cmd.id, lp.now, lp.peer_of)
    if pairs is None:
        return p.NOT_FOUND
    return p.ok_yaml(explain.render(pairs))


def reserve_job(lp: Loop, s: Session, cmd: p.ReserveJob):
    lp.count("cmd-reserve-job")
    job = lp.state.jobs.get(cmd.id)
    if job is None or job.state == RESERVED:
        return p.NOT_FOUND
    s.worker = True
    lp.log(r.Reserve, s.id, job.id)
    return p.reserved(job.id, lp.body_of(job))


def delete(lp: Loop, s: Session, cmd: p.Delete):
    counters = lp.counters  # lp.count("cmd-delete"), inlined
    counters["cmd-delete"] = counters.get("cmd-delete", 0) + 1
    st = lp.state
    job: Job = st.jobs.get(cmd.id)
    if job is None or (job.state == RESERVED and job.counts[RESERVER] != s.id):
        return NOT_FOUND
    lp.log_job(DELETE_RECORD, s.id, cmd.id)
    return DELETED


def _reserved_by(lp: Loop, s: Session, job_id: int):
    job = lp.state.jobs.get(job_id)
    if job is None or job.state != RESERVED or job.reserver != s.id:
        return None
    return job


def release(lp: Loop, s: Session, cmd: p.Release):
    lp.count("cmd-release")
    job = _reserved_by(lp, s, cmd.id)
    if job is None:
        return p.NOT_FOUND
    # Back-off or an attempt limit may decide where the job goes; the worker
    # is told RELEASED either way (its release was taken).
    if not holdback.release(lp, s.id, job, cmd.pri, cmd.delay):
        lp.log(r.Release, s.id, cmd.id, cmd.pri, cmd.delay)
    return p.RELEASED


def bury(lp: Loop, s: Session, cmd: p.Bury):
    lp.count("cmd-bury")
    if _reserved_by(lp, s, cmd.id) is None:
        return p.NOT_FOUND
    lp.log(r.Bury, s.id, cmd.id, cmd.pri)
    return p.BURIED


def touch(lp: Loop, s: Session, cmd: p.Touch):
    lp.count("cmd-touch")
    if _reserved_by(lp, s, cmd.id) is None:
        return p.NOT_FOUND
    lp.log(r.Touch, s.id, cmd.id)
    return p.TOUCHED


def _used(lp: Loop, s: Session) -> str:
    return s.view_use or lp.state.use_of(s.id)


def use(lp: Loop, s: Session, cmd: p.Use):
    lp.count("cmd-use")
    if lp.read_only:
        # A replica takes no records from clients: `use` only aims this
        # connection's peek-ready/-delayed/-buried.
        s.view_use = cmd.tube
    elif lp.state.use_of(s.id) != cmd.tube:
        lp.log(r.Use, s.id, cmd.tube)
    return p.using(cmd.tube)


def watch(lp: Loop, s: Session, cmd: p.Watch):
    lp.count("cmd-watch")
    if cmd.tube not in lp.state.watch_of(s.id):
        lp.log(r.Watch, s.id, cmd.tube)
    return p.watching(len(lp.state.watch_of(s.id)))


def ignore(lp: Loop, s: Session, cmd: p.Ignore):
    lp.count("cmd-ignore")
    watched = lp.state.watch_of(s.id)
    if cmd.tube in watched:
        if len(watched) < 2:
            return p.NOT_IGNORED
        lp.log(r.Ignore, s.id, cmd.tube)
    return p.watching(len(lp.state.watch_of(s.id)))


def _found(lp: Loop, job):
    return p.NOT_FOUND if job is None else p.found(job.id, lp.body_of(job))


def peek(lp: Loop, s: Session, cmd: p.Peek):
    lp.count("cmd-peek")
    return _found(lp, lp.state.jobs.get(cmd.id))


def peek_ready(lp: Loop, s: Session, cmd: p.PeekReady):
    lp.count("cmd-peek-ready")
    return _found(lp, lp.state.peek_ready(_used(lp, s)))


def peek_delayed(lp: Loop, s: Session, cmd: p.PeekDelayed):
    lp.count("cmd-peek-delayed")
    return _found(lp, lp.state.peek_delayed(_used(lp, s)))


def peek_buried(lp: Loop, s: Session, cmd: p.PeekBuried):
    lp.count("cmd-peek-buried")
    return _found(lp, lp.state.peek_buried(_used(lp, s)))


def kick(lp: Loop, s: Session, cmd: p.Kick):
    lp.count("cmd-kick")
    ids = lp.state.kickable(lp.state.use_of(s.id), cmd.bound)
    if ids:
        lp.log(r.Kick, s.id, ids)
    return p.kicked(len(ids))


def kick_job(lp: Loop, s: Session, cmd: p.KickJob):
    lp.count("cmd-kick-job")
    job = lp.state.jobs.get(cmd.id)
    if job is None or job.state not in (BURIED, DELAYED):
        return p.NOT_FOUND
    lp.log(r.Kick, s.id, (cmd.id,))
    return p.KICKED


def move_job(lp: Loop, s: Session, cmd: p.MoveJob):
    """A ready, delayed or buried job to another tube, as one Move record."""
    lp.count("cmd-move-job")
    job = lp.state.jobs.get(cmd.id)
    if job is None or job.state == RESERVED:
        return p.NOT_FOUND
    if job.tube.name == cmd.tube:
        return p.moved(cmd.tube)  # already there: nothing to log
    lp.log(r.Move, s.id, cmd.id, cmd.tube)
    return p.moved(cmd.tube)


def stats_job(lp: Loop, s: Session, cmd: p.StatsJob):
    lp.count("cmd-stats-job")
    job = lp.state.jobs.get(cmd.id)
    if job is None:
        return p.NOT_FOUND
    pairs = job_stats(job, lp.now)
    if lp.extended_stats:
        pairs += job_key_stats(lp.state.keys, job)
        pairs += server_stats.job_stats_extended(lp, job.id)
    return p.yaml_dict(pairs)


def stats_tube(lp: Loop, s: Session, cmd: p.StatsTube):
    lp.count("cmd-stats-tube")
    tube = lp.state.tubes.get(cmd.tube)
    if tube is None:
        return p.NOT_FOUND
    pairs = tube_stats(tube, lp.now)
    if lp.extended_stats:
        pairs += server_stats.tube_stats_extended(lp, cmd.tube)
    return p.yaml_dict(pairs)


def stats(lp: Loop, s: Session, cmd: p.Stats):
    lp.count("cmd-stats")
    pairs = server_stats.beanstalkd_stats(lp)
    if lp.extended_stats:
        pairs += server_stats.extended_stats(lp)
    return p.yaml_dict(pairs)


def ext_stats(lp: Loop, s: Session, cmd: p.ExtStats):
    return p.yaml_dict(server_stats.extended_stats(lp))


def ext_stats_tube(lp: Loop, s: Session, cmd: p.ExtStatsTube):
    if cmd.tube not in lp.state.tubes:
        return p.NOT_FOUND
    return p.yaml_dict(server_stats.tube_stats_extended(lp, cmd.tube))


def list_tubes(lp: Loop, s: Session, cmd: p.ListTubes):
    lp.count("cmd-list-tubes")
    return p.yaml_list(lp.state.tube_order)


def list_tube_used(lp: Loop, s: Session, cmd: p.ListTubeUsed):
    lp.count("cmd-list-tube-used")
    return p.using(_used(lp, s))


def list_tubes_watched(lp: Loop, s: Session, cmd: p.ListTubesWatched):
    lp.count("cmd-list-tubes-watched")
    return p.yaml_list(lp.state.watch_of(s.id))


def pause_tube(lp: Loop, s: Session, cmd: p.PauseTube):
    lp.count("cmd-pause-tube")
    if cmd.tube not in lp.state.tubes:
        return p.NOT_FOUND
    lp.log(r.PauseTube, s.id, cmd.tube, cmd.delay)
    return p.PAUSED


def quit_(lp: Loop, s: Session, cmd: p.Quit):
    return CLOSE


def replicate(lp: Loop, s: Session, cmd: p.Replicate):
    if lp.replication is None:  # a loop started without cli.py's hooks
        return p.refused(b"this server cannot feed replicas")
    return lp.replication.start_feed(lp, s, cmd)


def replica_ack(lp: Loop, s: Session, cmd: p.ReplicaAck):
    lp.replica_acked(s, cmd.seq)
    return NOREPLY


def promote(lp: Loop, s: Session, cmd: p.PromoteReplica):
    if lp.role != "replica" or lp.replication is None:
        return p.NOT_A_REPLICA
    return p.promoted(lp.replication.promote(lp))


def delete_tube(lp: Loop, s: Session, cmd: p.DeleteTube):
    lp.count("cmd-delete-tube")
    if not lp.state.is_fanout_tube(cmd.tube):
        return p.NOT_FOUND
    lp.log(r.DeleteTube, s.id, cmd.tube)
    return p.DELETED


def list_jobs(lp: Loop, s: Session, cmd: p.ListJobs):
    lp.count("cmd-list-jobs")
    ids = lp.state.list_jobs(cmd.tube, STATE_BY_NAME[cmd.state], cmd.after, cmd.count)
    return p.yaml_list(map(str, ids))


def search_jobs(lp: Loop, s: Session, cmd: p.SearchJobs | p.BulkJobs):
    """`search-jobs` and `bulk-jobs`: in slices over turns (server/search.py),
    answered when done; the session waits meanwhile."""
    lp.count("cmd-search-jobs" if type(cmd) is p.SearchJobs else "cmd-bulk-jobs")
    reply = lp.searches.start(lp, s, cmd)
    return NOREPLY if reply is None else reply


def flush_tube(lp: Loop, s: Session, cmd: p.FlushTube):
    lp.count("cmd-flush-tube")
    st = lp.state
    if cmd.tube not in st.tubes:
        return p.NOT_FOUND
    ids = [jid for state in (READY, DELAYED, BURIED)
           for jid in st.list_jobs(cmd.tube, state, 0, len(st.jobs))]
    if ids:
        lp.log(r.FlushTube, s.id, cmd.tube, sorted(ids))
    return p.flushed(len(ids))


def config(lp: Loop, s: Session, cmd: p.ConfigDump):
    lp.count("cmd-config")
    body = render(lp.policies.dump(list(lp.state.tube_order)))
    return p.ok_yaml(body)


def reload_config(lp: Loop, s: Session, cmd: p.ReloadConfig):
    lp.count("cmd-reload-config")
    err = lp.reload_config()
    if err is None:
        return p.RELOADED
    return p.not_reloaded(err)


def auth(lp: Loop, s: Session, cmd: p.Auth):
    token = lp.admin.token
    if token is not None and token_matches(cmd.token, token):
        s.admin = True
        return p.OK
    # Never the token itself in the log: it may be the real one mistyped.
    log.warning("auth failed: wrong admin token from %s (%s)%s", s.peer or "-", s.transport,
                "" if token is not None else ": this server has no --admin-token-file")
    lp.answer_later(s, p.UNAUTHORIZED, AUTH_FAIL_DELAY)
    return NOREPLY


def error(lp: Loop, s: Session, ev: p.ErrorReply):
    if ev.counted_as is p.Put:
        lp.count("cmd-put")
        if ev.reply is p.EXPECTED_CRLF:
            # beanstalkd made the job (taking an id) before it saw the bad trailer.
            s.producer = True
            lp.burn_job_id()
    elif ev.counted_as is p.PauseTube:
        lp.count("cmd-pause-tube")
    return ev.reply


HANDLERS = {
    p.Put: put, p.Reserve: reserve, p.ReserveJob: reserve_job, p.Delete: delete,
    p.Release: release, p.Bury: bury, p.Touch: touch, p.Use: use, p.Watch: watch,
    p.Ignore: ignore, p.Peek: peek, p.PeekReady: peek_ready, p.PeekDelayed: peek_delayed,
    p.PeekBuried: peek_buried, p.Kick: kick, p.KickJob: kick_job, p.StatsJob: stats_job,
    p.StatsTube: stats_tube, p.Stats: stats, p.ListTubes: list_tubes,
    p.ListTubeUsed: list_tube_used, p.ListTubesWatched: list_tubes_watched,
    p.PauseTube: pause_tube, p.Quit: quit_, p.ErrorReply: error, p.Replicate: replicate,
    p.ReplicaAck: replica_ack, p.PromoteReplica: promote, p.DeleteTube: delete_tube,
    p.ConfigDump: config, p.ReloadConfig: reload_config, p.ListJobs: list_jobs,
    p.FlushTube: flush_tube, p.Auth: auth, p.ExtStats: ext_stats,
    p.ExtStatsTube: ext_stats_tube, p.PutUnique: put_unique, p.ExplainJob: explain_job,
    p.ReserveBatch: reserve_batch, p.MoveJob: move_job, p.SearchJobs: search_jobs,
    p.BulkJobs: search_jobs, p.PutHeard: put_heard, p.PutRest: put_rest,
}

# Refused on a replica (READ_ONLY): they change the queue or need a record.
MUTATING = frozenset({
    p.Put, p.Reserve, p.ReserveJob, p.Delete, p.Release, p.Bury, p.Touch, p.Kick,
    p.KickJob, p.PauseTube, p.Watch, p.Ignore, p.DeleteTube, p.FlushTube, p.PutUnique,
    p.ReserveBatch, p.MoveJob, p.PutRest,
})

# The admin commands: with --admin-token-file they need `auth` first; without
# one, a unix socket or an --admin-allow address (server/admin.py). Any admin
# command added later goes here, and nowhere else.
ADMIN = frozenset({
    p.Replicate, p.PromoteReplica, p.ReloadConfig, p.ConfigDump, p.FlushTube,
    p.SearchJobs, p.BulkJobs,
})


def _admin_only(handler):
    def guarded(lp: Loop, s: Session, cmd):
        if s.admin:
            return handler(lp, s, cmd)
        if lp.admin.token is not None:
            return p.UNAUTHORIZED
        return p.not_admin_address(s.peer or s.transport)
    return guarded


for _cmd in ADMIN:
    HANDLERS[_cmd] = _admin_only(HANDLERS[_cmd])


def register(handlers: dict) -> None:
    """Handlers of another protocol's commands (server/memcache_dispatch.py), by
    command class; each checks its own admin rights and read-only state."""
    clash = set(handlers) & set(HANDLERS)
    if clash:
        raise ValueError(f"commands handled already: {sorted(c.__name__ for c in clash)}")
    HANDLERS.update(handlers)
