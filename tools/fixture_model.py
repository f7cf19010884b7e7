"""The fixture session's model: what tools/make_fixtures.py's session did, in
the terms of snapshots/README.md.

The script mirrors every command its clients send into a `Model` (jobs,
tubes, connections, keys, limits, schedules, the records each command logs)
and writes expected.json from it, never from reading the files back through
smallstalk; before writing anything it checks the model against the live
server and against the records in the segments. The policies here are the
model's copy of the script's `CONFIG`, which the servers run with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The tube policies of make_fixtures.CONFIG that decide what a put logs.
POLICIES: dict[str, dict[str, Any]] = {
    "orders": {"max_jobs": 1, "discard_old_when_full": True},
    "reports": {"max_age": 1, "expire_to": "dead"},
}
# Format 5: a keyed put's window and bound (put-unique), per tube; the default's otherwise.
KEY_POLICIES: dict[str, tuple[int, int]] = {"keyed": (3600, 5)}
DEFAULT_KEY_POLICY = (3600, 100_000)


@dataclass
class MJob:
    id: int
    tube: str
    pri: int
    delay: int
    ttr: int
    body: str
    created: int  # seq of the Put
    state: str = "ready"
    deadline: tuple[int, int] | None = None  # (seq of the record, seconds after its time)
    reserver: str | None = None
    reserves: int = 0
    timeouts: int = 0
    releases: int = 0
    buries: int = 0
    kicks: int = 0
    expires: tuple[int, int] | None = None  # (seq of the record, seconds after its time)


@dataclass
class MTube:
    name: str
    total_jobs: int = 0
    cmd_delete: int = 0
    cmd_pause: int = 0
    pause: int = 0
    unpause: tuple[int, int] | None = None
    jobs: int = 0
    using: int = 0
    watching: int = 0
    buried: list[int] = field(default_factory=list)  # FIFO
    expired_n: int = 0
    discarded_n: int = 0


@dataclass
class MConn:
    label: str
    order: int  # connection order: conn ids ascend with it within a server run
    use: str = "default"
    watch: list[str] = field(default_factory=lambda: ["default"])
    reserved: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Chosen:
    """A value the server picks at random: the model knows its form, not its value.

    check_log reads the value from the segments, checks it against `pattern`
    and binds it to `name`; `resolve` then puts it into expected.json.
    """

    name: str
    pattern: str


HISTORY_PATTERN = "[0-9a-f]{16}"  # smallstalk.replication.feed.new_history: 8 random bytes, hex


def resolve(obj: Any, chosen: dict[str, str]) -> Any:
    """`obj` with every Chosen replaced by the value found for it."""
    if isinstance(obj, Chosen):
        return chosen[obj.name]
    if isinstance(obj, dict):
        return {k: resolve(v, chosen) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve(v, chosen) for v in obj]
    return obj


def fanout_parent(tube: str) -> str | None:
    """`orders` for `orders+audit` (README: the part before the first `+`)."""
    parent, plus, child = tube.partition("+")
    return parent if plus and parent and child else None


def swap_remove(items: list, item: Any) -> None:
    i = items.index(item)
    items[i] = items[-1]
    items.pop()


class Model:
    """The durable state the log should rebuild, and the records it should hold."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.jobs: dict[int, MJob] = {}
        self.tubes: dict[str, MTube] = {"default": MTube("default")}
        self.tube_order: list[str] = ["default"]
        self.conns: dict[str, MConn] = {}  # conns a logged record mentioned
        self.order: dict[str, int] = {}  # label -> connection order
        self.next_job_id = 1
        self.total_jobs = 0
        self.job_timeouts = 0
        self.epochs: list[tuple[int, Chosen, int]] = []  # (epoch, history, first seq)
        self.fanout: dict[str, list[str]] = {}  # parent -> registered fanout tubes
        self.live: dict[str, str] = {}  # Chosen name -> value the live server reported
        self.history: dict[int, dict[str, Any]] = {}  # seq -> expected state after it
        # Format 5: tube -> {"window", "keys_max", "live": {key: id}, "gone": [[key, id, rel]]}
        self.keys: dict[str, dict[str, Any]] = {}
        self.job_keys: dict[int, tuple[str, str]] = {}
        # Format 6: tube -> [max_reserved, rate, period s, tat (seq, plus seconds) or None];
        # schedule -> (at ns, last job); job -> why it is held back.
        self.limits: dict[str, list[Any]] = {}
        self.schedules: dict[str, tuple[int, int]] = {}
        self.holds: dict[int, str] = {}

    # helpers -----------------------------------------------------------------

    def _record(self, op: str, client: str | None = None, **fields: Any) -> int:
        if self.records:  # the previous record is fully applied: remember that state
            self.history[len(self.records)] = self.expected_state()
        seq = len(self.records) + 1
        rec: dict[str, Any] = {"seq": seq, "op": op}
        if client is not None:
            rec["client"] = client
            if client not in self.conns:
                self.conns[client] = MConn(client, self.order[client])
                self.tubes["default"].using += 1
                self.tubes["default"].watching += 1
        rec.update(fields)
        self.records.append(rec)
        return seq

    def view(self, label: str) -> MConn:
        """A connection as the server sees it (unlogged ones use/watch default)."""
        return self.conns.get(label) or MConn(label, self.order[label])

    def _tube(self, name: str) -> MTube:
        if name not in self.tubes:
            self.tubes[name] = MTube(name)
            self.tube_order.append(name)
            parent = fanout_parent(name)  # a new `parent+child` tube is registered
            if parent is not None and name not in self.fanout.get(parent, []):
                self.fanout.setdefault(parent, []).append(name)
        return self.tubes[name]

    def _maybe_drop(self, t: MTube) -> None:
        if t.jobs or t.using or t.watching or t.name == "default":
            return
        del self.tubes[t.name]
        swap_remove(self.tube_order, t.name)

    def _leave(self, j: MJob) -> None:
        if j.state == "buried":
            self.tubes[j.tube].buried.remove(j.id)
        elif j.state == "reserved":
            assert j.reserver is not None
            c = self.conns.get(j.reserver)
            if c is not None:
                c.reserved.discard(j.id)
            j.reserver = None

    def _enqueue(self, j: MJob, delay: int, seq: int) -> None:
        if delay:
            j.state, j.deadline = "delayed", (seq, delay)
        else:
            j.state = "ready"

    # records -------------------------------------------------------------------

    def new_epoch(self, epoch: int) -> None:
        history = Chosen(f"history of epoch {epoch}", HISTORY_PATTERN)
        seq = self._record("new-epoch", epoch=epoch, history=history)
        self.epochs.append((epoch, history, seq))

    def restart(self) -> None:
        self._record("restart")
        for c in sorted(self.conns.values(), key=lambda c: c.order):
            self._disconnect(c.label)

    def _new_job(self, jid: int, tube: str, pri: int, delay: int, ttr: int, body: str,
                 seq: int, expires: tuple[int, int] | None = None) -> MJob:
        """Job `jid`, made by record `seq`, counted in its tube and the totals."""
        t = self._tube(tube)
        j = self.jobs[jid] = MJob(jid, tube, pri, delay, ttr, body, created=seq,
                                  expires=expires)
        self.next_job_id = jid + 1
        self.total_jobs += 1
        t.jobs += 1
        t.total_jobs += 1
        return j

    def put(self, client: str, tube: str, pri: int, delay: int, ttr: int, body: str) -> int:
        jid = self.next_job_id
        seq = self._record("put", client, id=jid, tube=tube, pri=pri, delay=delay, ttr=ttr,
                           body=body)
        j = self._new_job(jid, tube, pri, delay, ttr, body, seq)
        self._enqueue(j, delay, seq)
        return jid

    def needs_put_jobs(self, tube: str, max_age: int) -> bool:
        """Whether the server logs PutJobs rather than Put (dispatch.put's test)."""
        return bool(self.fanout.get(tube) or max_age or POLICIES.get(tube))

    def put_jobs(self, client: str, tube: str, pri: int, delay: int, ttr: int, body: str,
                 max_age: int = 0) -> int:
        """A put with policies or fanout: one PutJobs record. Returns the first job id."""
        pol = POLICIES.get(tube, {})
        t = self.tubes.get(tube)
        dropped: list[int] = []
        if pol.get("max_jobs") and t is not None and t.jobs + 1 > pol["max_jobs"]:
            assert pol.get("discard_old_when_full"), "the session never fills a strict tube"
            ready = sorted(j.id for j in self.jobs.values()
                           if j.tube == tube and j.state == "ready")
            dropped = ready[:t.jobs + 1 - pol["max_jobs"]]
        targets = [tube, *self.fanout.get(tube, [])]
        jobs = [[self.next_job_id + i, name] for i, name in enumerate(targets)]
        ages = [a for a in (max_age, pol.get("max_age", 0)) if a]
        seq = len(self.records) + 1
        expires = (seq, min(ages)) if ages else None
        self._record("put-jobs", client, jobs=jobs, pri=pri, delay=delay, ttr=ttr,
                     expires={"seq": seq, "plus_seconds": expires[1]} if expires else 0,
                     dropped=dropped, body=body)
        for jid in dropped:
            j = self.jobs.pop(jid)
            t = self.tubes[j.tube]
            t.jobs -= 1
            t.discarded_n += 1
            self._maybe_drop(t)
        for jid, name in jobs:
            j = self._new_job(jid, name, pri, delay, ttr, body, seq, expires)
            self._enqueue(j, delay, seq)
        return jobs[0][0]

    def find_key(self, tube: str, key: str) -> int | None:
        """The job `key` made in `tube`, if a put with it now changes nothing (the
        session never lets a window pass)."""
        k = self.keys.get(tube)
        if k is None:
            return None
        if key in k["live"]:
            return k["live"][key]
        return next((jid for g, jid, _until in k["gone"] if g == key), None)

    def put_unique(self, client: str, tube: str, key: str, pri: int, ttr: int,
                   body: str) -> int:
        """A keyed put that makes a job: one PutUnique record (no policy but keys)."""
        window, keys_max = KEY_POLICIES.get(tube, DEFAULT_KEY_POLICY)
        jid = self.next_job_id
        seq = self._record("put-unique", client, tube=tube, key=key, unique_for=window,
                           keys_max=keys_max, jobs=[[jid, tube]], pri=pri, delay=0, ttr=ttr,
                           expires=0, dropped=[], body=body)
        self._new_job(jid, tube, pri, 0, ttr, body, seq)
        k = self.keys.setdefault(tube, {"live": {}, "gone": []})
        k["window"], k["keys_max"] = window, keys_max
        k["live"][key] = jid
        self.job_keys[jid] = (tube, key)
        return jid

    def _release_key(self, jid: int, seq: int) -> None:
        held = self.job_keys.pop(jid, None)
        if held is None:
            return
        k = self.keys[held[0]]
        del k["live"][held[1]]
        k["gone"].append([held[1], jid, {"seq": seq, "plus_seconds": k["window"]}])
        assert len(k["gone"]) <= k["keys_max"], "the session never passes the bound"

    def expire(self, moves: list[tuple[int, str]]) -> None:
        """Jobs whose expiry came: deleted (to "") or moved to a tube without max-age."""
        self._record("expire", moves=[[jid, to, 0] for jid, to in moves])
        for jid, to in moves:
            j = self.jobs[jid]
            assert j.state in ("ready", "delayed"), j
            old = self.tubes[j.tube]
            old.jobs -= 1
            old.expired_n += 1
            if not to:
                del self.jobs[jid]
                self._maybe_drop(old)
                continue
            new = self._tube(to)
            new.jobs += 1
            j.tube, j.state, j.deadline, j.expires = to, "ready", None, None
            self._maybe_drop(old)

    def move(self, client: str, jid: int, tube: str) -> None:
        """move-job: the job changes tube in its state (format 7)."""
        self._record("move", client, id=jid, tube=tube)
        j = self.jobs[jid]
        assert j.state != "reserved", j
        old = self.tubes[j.tube]
        new = self._tube(tube)
        old.jobs -= 1
        new.jobs += 1
        if j.state == "buried":
            old.buried.remove(jid)
            new.buried.append(jid)
        j.tube = tube
        self._maybe_drop(old)

    def delete_tube(self, client: str, tube: str) -> None:
        self._record("delete-tube", client, tube=tube)
        parent = fanout_parent(tube)
        assert parent is not None
        children = self.fanout[parent]
        children.remove(tube)
        if not children:
            del self.fanout[parent]

    def flush_tube(self, client: str, tube: str) -> int:
        ids = sorted(j.id for j in self.jobs.values() if j.tube == tube and j.state != "reserved")
        self._record("flush-tube", client, tube=tube, ids=ids)
        t = self.tubes[tube]
        for jid in ids:
            self._leave(self.jobs.pop(jid))
            t.jobs -= 1
        self._maybe_drop(t)
        return len(ids)

    def reserve(self, client: str, jid: int) -> None:
        seq = self._record("reserve", client, id=jid)
        j = self.jobs[jid]
        self._leave(j)
        j.state, j.reserver, j.deadline = "reserved", client, (seq, j.ttr)
        j.reserves += 1
        self.conns[client].reserved.add(jid)
        lim = self.limits.get(j.tube)
        if lim is not None and lim[1]:
            assert lim[3] is None, "the session reserves from a rate-limited tube once"
            lim[3] = (seq, lim[2] // lim[1])  # tat = this reserve's time + the interval

    def set_limits(self, tube: str, max_reserved: int, rate: int, period: int) -> None:
        self._record("limits", tube=tube, max_reserved=max_reserved, rate=rate,
                     period=period * 10**9)
        self.limits[tube] = [max_reserved, rate, period, None]

    def requeue_timeout(self, outcomes: list[tuple[int, str]]) -> None:
        """TTRs ran out and an attempt limit buried the jobs: [(id, reason)]."""
        self._record("requeue", conn=0, cause=0, pri=0,
                     outcomes=[[jid, 0, "", why] for jid, why in outcomes])
        for jid, why in outcomes:
            j = self.jobs[jid]
            self._leave(j)
            j.state = "buried"
            j.timeouts += 1
            j.buries += 1
            self.job_timeouts += 1
            self.tubes[j.tube].buried.append(jid)
            self.holds[jid] = why

    def fire(self, name: str, at: int, tube: str, pri: int, ttr: int, body: str) -> int:
        jid = self.next_job_id
        seq = self._record("fire", schedule=name, at=at, id=jid, tube=tube, pri=pri, delay=0,
                           ttr=ttr, body=body)
        self._new_job(jid, tube, pri, 0, ttr, body, seq)
        self.schedules[name] = (at, jid)
        return jid

    def delete(self, client: str, jid: int) -> None:
        seq = self._record("delete", client, id=jid)
        self._release_key(jid, seq)
        j = self.jobs.pop(jid)
        self._leave(j)
        t = self.tubes[j.tube]
        t.cmd_delete += 1
        t.jobs -= 1
        self._maybe_drop(t)

    def release(self, client: str, jid: int, pri: int, delay: int) -> None:
        seq = self._record("release", client, id=jid, pri=pri, delay=delay)
        j = self.jobs[jid]
        self._leave(j)
        j.pri, j.delay = pri, delay
        j.releases += 1
        self._enqueue(j, delay, seq)

    def bury(self, client: str, jid: int, pri: int) -> None:
        self._record("bury", client, id=jid, pri=pri)
        j = self.jobs[jid]
        self._leave(j)
        j.pri, j.state = pri, "buried"
        j.buries += 1
        self.tubes[j.tube].buried.append(jid)

    def touch(self, client: str, jid: int) -> None:
        seq = self._record("touch", client, id=jid)
        j = self.jobs[jid]
        j.deadline = (seq, j.ttr)

    def kick(self, client: str, ids: list[int]) -> None:
        self._record("kick", client, ids=ids)
        for jid in ids:
            j = self.jobs[jid]
            self._leave(j)
            j.kicks += 1
            j.state = "ready"

    def use(self, client: str, tube: str) -> None:
        self._record("use", client, tube=tube)
        c = self.conns[client]
        self._tube(tube).using += 1
        old = self.tubes[c.use]
        old.using -= 1
        c.use = tube
        self._maybe_drop(old)

    def watch(self, client: str, tube: str) -> None:
        self._record("watch", client, tube=tube)
        c = self.conns[client]
        c.watch.append(tube)
        self._tube(tube).watching += 1

    def ignore(self, client: str, tube: str) -> None:
        self._record("ignore", client, tube=tube)
        c = self.conns[client]
        swap_remove(c.watch, tube)
        t = self.tubes[tube]
        t.watching -= 1
        self._maybe_drop(t)

    def pause_tube(self, client: str, tube: str, delay: int) -> None:
        seq = self._record("pause-tube", client, tube=tube, delay=delay)
        t = self.tubes[tube]
        t.pause, t.unpause = delay * 10**9 or 1, (seq, delay)  # ns, at least 1
        t.cmd_pause += 1

    def disconnect(self, client: str) -> None:
        self._record("disconnect", client)
        self._disconnect(client)

    def _disconnect(self, client: str) -> None:
        c = self.conns.pop(client)
        for jid in sorted(c.reserved):
            j = self.jobs[jid]
            j.state, j.reserver = "ready", None
        t = self.tubes[c.use]
        t.using -= 1
        self._maybe_drop(t)
        for name in c.watch:
            t = self.tubes[name]
            t.watching -= 1
            self._maybe_drop(t)

    def promote(self, ids: list[int]) -> None:
        self._record("promote", ids=ids)
        for jid in ids:
            self.jobs[jid].state = "ready"

    def timeout(self, ids: list[int]) -> None:
        self._record("timeout", ids=ids)
        for jid in ids:
            j = self.jobs[jid]
            self._leave(j)
            j.state = "ready"
            j.timeouts += 1
            self.job_timeouts += 1

    # expected.json ---------------------------------------------------------------

    def expected_state(self) -> dict[str, Any]:
        def rel(t: tuple[int, int] | None) -> dict[str, int] | None:
            return None if t is None else {"seq": t[0], "plus_seconds": t[1]}

        last_seq = len(self.records)
        return {
            "last_seq": last_seq,
            "time": {"seq": last_seq, "plus_seconds": 0},
            "next_job_id": self.next_job_id,
            "total_jobs": self.total_jobs,
            "job_timeouts": self.job_timeouts,
            "epochs": [{"epoch": e, "history": h, "first_seq": s} for e, h, s in self.epochs],
            "tubes": [
                {"name": t.name, "total_jobs": t.total_jobs, "cmd_delete": t.cmd_delete,
                 "cmd_pause": t.cmd_pause, "pause": t.pause, "unpause_at": rel(t.unpause),
                 "expired_n": t.expired_n, "discarded_n": t.discarded_n}
                for t in (self.tubes[n] for n in self.tube_order)
            ],
            "fanout": [child for children in self.fanout.values() for child in children],
            "buried": {n: list(self.tubes[n].buried) for n in self.tube_order
                       if self.tubes[n].buried},
            "conns": [
                {"client": c.label, "use": c.use, "watch": list(c.watch),
                 "reserved": sorted(c.reserved)}
                for c in sorted(self.conns.values(), key=lambda c: c.order)
            ],
            "jobs": [
                {"id": j.id, "tube": j.tube, "state": j.state, "pri": j.pri, "delay": j.delay,
                 "ttr": j.ttr, "body": j.body, "reserves": j.reserves, "timeouts": j.timeouts,
                 "releases": j.releases, "buries": j.buries, "kicks": j.kicks,
                 "created": {"seq": j.created, "plus_seconds": 0},
                 "deadline": rel(j.deadline) if j.state in ("delayed", "reserved") else None,
                 "reserved_by": j.reserver, "expires": rel(j.expires)}
                for j in sorted(self.jobs.values(), key=lambda j: j.id)
            ],
            "keys": [
                {"tube": tube, "window": k["window"], "keys_max": k["keys_max"],
                 "dropped_n": 0, "live": [[key, jid] for key, jid in k["live"].items()],
                 "gone": [list(g) for g in k["gone"]]}
                for tube, k in self.keys.items()
            ],
            "limits": [
                {"tube": tube, "max_reserved": lim[0], "rate": lim[1],
                 "period": lim[2] * 10**9, "tat": rel(lim[3]) if lim[3] else 0}
                for tube, lim in sorted(self.limits.items())
            ],
            "schedules": [{"name": n, "at": at, "job": jid}
                          for n, (at, jid) in sorted(self.schedules.items())],
            "holds": [{"id": jid, "reason": why} for jid, why in sorted(self.holds.items())
                      if jid in self.jobs],
        }


