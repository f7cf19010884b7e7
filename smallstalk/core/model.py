"""What the state is made of: jobs, tubes and connections, and the constants
they share. The rules that keep them consistent are core/state.py's.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from smallstalk.core.readyheap import M32, M64, ReadyHeap  # noqa: F401 (M64 re-exported)

# The compiled build's class decorators (tools/compile.py): Cython reads
# `import cython` when it compiles this module. Run, that import would load
# Cython wherever it is installed (~19 ms of every start), so the pure build
# keeps these stand-ins, which change nothing, and never runs it.
cython = SimpleNamespace(no_gc=lambda cls: cls, cclass=lambda cls: cls)
if not cython:  # never true: the import is for the compiler's eyes
    import cython

READY, DELAYED, RESERVED, BURIED = range(4)
# The states by name, in that order (`STATE_NAMES[job.state]`), and back: the one
# table of them (stats-job, list-jobs, the console, the tools, analytics).
STATE_NAMES = ("ready", "delayed", "reserved", "buried")
STATE_BY_NAME = {name: i for i, name in enumerate(STATE_NAMES)}
NS = 1_000_000_000  # nanoseconds per second: record times are ns since the epoch
SAFETY_MARGIN = NS  # the last second of a TTR (DEADLINE_SOON)
DEFAULT_TUBE = "default"
URGENT_THRESHOLD = 1024  # a ready job with a lower priority counts as urgent


def fanout_parent(tube: str) -> str | None:
    """`orders` for `orders+audit`: the tube whose puts a fanout tube copies."""
    parent, plus, child = tube.partition("+")
    return parent if plus and parent and child else None


class StateError(Exception):
    """A record that cannot apply to this state: the log and the state disagree."""


# A job's seldom-set numbers, in one tuple (see Job): its five statistics,
# its delay and, while reserved, its reserver.
ZERO_COUNTS = (0, 0, 0, 0, 0, 0, 0)
RESERVER = 6  # where `counts` holds the reserver (hot paths read it without the property)


def _counter(i: int) -> property:
    def get(self) -> int:
        return self.counts[i]

    def set_(self, value: int) -> None:
        c = list(self.counts)
        c[i] = value
        self.counts = tuple(c)

    return property(get, set_)


@cython.no_gc
@cython.cclass
class Job:
    """One job. Kept small: a server may hold millions (docs/PERFORMANCE.md, Memory).

    The five statistics, the delay and the reserver live in one tuple
    (`counts`), shared by every job whose values there are all zero (a new
    job put without a delay), and are read and written through properties:
    ten slots make a 112-byte object, twelve a 128-byte one.

    Nothing a job refers to refers back to a job (a tube keeps ids, not jobs:
    its buried FIFO is a dict of ids), so a job is never in a reference
    cycle, and the compiled build leaves jobs out of the cyclic collector
    (`no_gc`): its passes never walk the millions of them, and each is 16
    bytes smaller. Keep it so: a job kept by something it refers to would
    never be freed there.
    """

    __slots__ = ("id", "tube", "pri", "ttr", "body", "state", "created", "deadline", "gen",
                 "counts")

    def __init__(self, id, tube, pri, delay, ttr, body, created):
        self.id = id
        self.tube = tube
        self.pri = pri
        self.ttr = ttr
        self.body = body
        self.created = created
        self.state = READY
        self.deadline = 0
        self.gen = 0
        self.counts = counts_for(delay)

    reserves = _counter(0)
    timeouts = _counter(1)
    releases = _counter(2)
    buries = _counter(3)
    kicks = _counter(4)
    delay = _counter(5)
    reserver = _counter(RESERVER)  # the connection holding it, while RESERVED (else 0)


def counts_for(delay: int) -> tuple:
    """A new job's `counts`: the shared zeros unless it has a delay."""
    return ZERO_COUNTS if not delay else (0, 0, 0, 0, 0, delay, 0)


# Where a million jobs are made (State.apply_put, storage/snapshot_codec.load),
# Job.__init__ is inlined: object.__new__ and the attribute stores, no __init__ call.
# tests/unit/test_put_fastpath.py checks that those places set every slot.
new_bare_job = Job.__new__


SHARED_INTS = 4096  # distinct values a state shares (Moves.ints); past that, copies


def share(ints: dict[int, int], v: int) -> int:
    """The state's one copy of `v` (a priority or TTR): a million jobs with
    pri 1024 then hold one int object, not a million 32-byte ones.

    Ensures: the result == v; at most SHARED_INTS values are kept.
    """
    if v <= 256:
        return v  # CPython's own small ints
    q = ints.get(v)
    if q is not None:
        return q
    if len(ints) < SHARED_INTS:
        ints[v] = v
    return v


def body_len(body: bytes | int) -> int:
    return body & M32 if isinstance(body, int) else len(body)


class Tube:
    __slots__ = (
        "name", "ready", "delayed", "buried", "ready_n", "urgent_n", "reserved_n",
        "delayed_n", "jobs_n", "total_jobs", "cmd_delete", "cmd_pause", "pause",
        "unpause_at", "using_n", "watching_n", "waiting", "bytes_n", "spilled_n",
        "expired_n", "discarded_n", "arrivals",
    )

    def __init__(self, name: str):
        self.name = name
        self.ready = ReadyHeap()  # (pri, id, gen) entries (core/readyheap.py)
        self.delayed: list = []  # heap of (deadline, id, gen)
        self.buried: dict[int, None] = {}  # ids, FIFO (no jobs: see Job)
        self.ready_n = self.urgent_n = self.reserved_n = self.delayed_n = self.jobs_n = 0
        self.total_jobs = self.cmd_delete = self.cmd_pause = 0
        self.pause = 0  # ns of the last pause-tube
        self.unpause_at = 0  # ns
        self.using_n = self.watching_n = 0
        self.waiting: list[int] = []  # conn ids, oldest first (volatile)
        self.bytes_n = 0  # body bytes of its jobs
        self.spilled_n = 0  # ...of which on disk (read-behind)
        self.expired_n = self.discarded_n = 0
        # Job ids in the order they arrived, cleaned lazily: the oldest ready
        # jobs are the ones discard-old-when-full drops. Kept only once asked
        # for (`oldest_ready`): 10 bytes a job that most tubes never need.
        self.arrivals: deque[int] | None = None

    def paused(self, now: int) -> bool:
        return self.unpause_at > now


class Limit:
    """A tube's concurrency and rate limits (from Limits records) and its
    token bucket, kept as GCRA's one number: `tat`, the time (ns) the bucket
    is next full-minus-one. A reserve at `now` may take a token while
    `now >= tat - tolerance`; taking one moves `tat` on by `interval`."""

    __slots__ = ("max_reserved", "rate", "period", "interval", "tolerance", "tat")

    def __init__(self, max_reserved: int, rate: int, period: int, tat: int = 0):
        self.max_reserved = max_reserved
        self.rate = rate
        self.period = period
        self.interval = period // rate if rate else 0
        self.tolerance = period - self.interval if rate else 0
        self.tat = tat

    def token_at(self) -> int:
        """When the next token is there (ns); any time up to now: one is."""
        return self.tat - self.tolerance

    def full(self, reserved_n: int) -> bool:
        return bool(self.max_reserved) and reserved_n >= self.max_reserved


class Conn:
    __slots__ = ("id", "use", "watch", "reserved", "logged", "waiting", "wait_deadline")

    def __init__(self, id: int):
        self.id = id
        self.use = DEFAULT_TUBE
        self.watch = [DEFAULT_TUBE]  # beanstalkd order, swap-removal
        self.reserved: set[int] = set()
        self.logged = False  # mentioned by a logged record: part of the durable state
        self.waiting = False
        self.wait_deadline: int | None = None


def secs(ns: int) -> int:
    """Nanoseconds to whole seconds, truncating toward zero as C does."""
    return ns // NS if ns >= 0 else -(-ns // NS)


def swap_remove(items: list, item) -> None:
    i = items.index(item)
    items[i] = items[-1]
    items.pop()
