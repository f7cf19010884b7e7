"""The server's statistics: `stats` (beanstalkd's keys in its order), smallstalk's
own keys (`ext-stats`, `ext-stats-tube`), and all of them for the console and
`/metrics`. Read inside a loop turn (dispatch's handlers, console/views.py);
nothing here changes state.
"""

from __future__ import annotations

import os
import resource
from typing import Protocol

from smallstalk import __version__
from smallstalk.core.state import NS, State
from smallstalk.core.stats import tube_key_stats, tube_stats_ext
from smallstalk.server import holdback
from smallstalk.server.search import Searches
from smallstalk.server.session import OUT_BOUND, Session
from smallstalk.storage.journal import Journal

# The protocol version clients see (some parse it as a semver, e.g. fivebeans).
VERSION = "1.12"


class Observed(Protocol):
    """What the statistics read of the mutation loop (loop.MutationLoop)."""

    state: State
    journal: Journal | None
    sessions: dict[int, Session]
    counters: dict[str, int]
    tube_counters: dict[str, dict[str, int]]
    feeds: dict[int, object]
    follower: object | None
    bodies: object | None
    role: str
    draining: bool
    instance_id: str
    max_job_size: int
    total_connections: int
    refused: int
    now: int
    started_at: int
    searches: Searches

    @property
    def min_replica_acks(self) -> int: ...


def tube_stats_extended(lp: Observed, name: str) -> list[tuple[str, object]]:
    """smallstalk's own keys of a tube (`ext-stats-tube`; `stats-tube` too
    under --extended-stats); the tube exists."""
    counters = lp.tube_counters.get(name, {})
    st = lp.state
    t = st.tubes[name]
    lim = st.limits.get(name)
    held = ""
    if lim is not None and lim.full(t.reserved_n):
        held = f"at its concurrency limit (max-reserved {lim.max_reserved})"
    elif lim is not None and lim.rate and lp.now < lim.token_at():
        held = "out of rate tokens"
    return tube_stats_ext(t) + [
        ("puts-refused", counters.get("puts-refused", 0)),
        ("fanout-tubes", len(st.fanout.get(name, ()))),
        ("puts-deduplicated", counters.get("puts-deduplicated", 0)),
    ] + tube_key_stats(st.keys, name) + [
        ("max-reserved", lim.max_reserved if lim is not None else 0),
        ("max-rate", lim.rate if lim is not None else 0),
        ("max-rate-period", lim.period // NS if lim is not None else 0),
        ("rate-tokens", _tokens(lim, lp.now)),
        ("held-back", held),
    ] + [(key, counters.get(key, 0)) for key in HOLD_COUNTERS]


# What the tube policies that hold jobs back did, per tube (holdback.py, schedules.py).
HOLD_COUNTERS = ("jobs-exhausted", "jobs-dead-lettered", "jobs-backed-off",
                 "schedule-firings", "schedule-skips")


def _tokens(lim, now: int) -> int:
    """Whole tokens in a rate-limited tube's bucket now (0 without a rate)."""
    if lim is None or not lim.rate:
        return 0
    return max(0, min(lim.rate, (now - lim.token_at()) // lim.interval + 1))


def job_stats_extended(lp: Observed, jid: int) -> list[tuple[str, object]]:
    """smallstalk's own keys of a job (`stats-job` under --extended-stats, the
    console): why a policy holds it back, "" when none does."""
    return [("held-back", holdback.reason_text(lp.state, jid, lp.now))]




STATS_COUNTERS = (
    "cmd-put", "cmd-peek", "cmd-peek-ready", "cmd-peek-delayed", "cmd-peek-buried",
    "cmd-reserve", "cmd-reserve-with-timeout", "cmd-delete", "cmd-release", "cmd-use",
    "cmd-watch", "cmd-ignore", "cmd-bury", "cmd-kick", "cmd-touch", "cmd-stats",
    "cmd-stats-job", "cmd-stats-tube", "cmd-list-tubes", "cmd-list-tube-used",
    "cmd-list-tubes-watched", "cmd-pause-tube",
)


def server_stats(lp: Observed) -> list[tuple[str, object]]:
    """Every server statistic: beanstalkd's keys in its order, then smallstalk's own
    (the console and /metrics read them all)."""
    return beanstalkd_stats(lp) + extended_stats(lp)


def beanstalkd_stats(lp: Observed) -> list[tuple[str, object]]:
    """`stats`: exactly beanstalkd 1.12's keys, in its order."""
    st = lp.state
    ru = resource.getrusage(resource.RUSAGE_SELF)
    uname = os.uname()
    sessions = lp.sessions.values()
    info = _storage_info(lp.journal)
    out: list[tuple[str, object]] = [
        ("current-jobs-urgent", st.urgent_n), ("current-jobs-ready", st.ready_n),
        ("current-jobs-reserved", st.reserved_n), ("current-jobs-delayed", st.delayed_n),
        ("current-jobs-buried", st.buried_n),
    ]
    out += [(name, lp.counters.get(name, 0)) for name in STATS_COUNTERS]
    out += [
        ("job-timeouts", st.job_timeouts), ("total-jobs", st.total_jobs),
        ("max-job-size", lp.max_job_size), ("current-tubes", len(st.tubes)),
        ("current-connections", len(lp.sessions)),
        ("current-producers", sum(1 for x in sessions if x.producer)),
        ("current-workers", sum(1 for x in sessions if x.worker)),
        ("current-waiting", st.waiting_n), ("total-connections", lp.total_connections),
        ("pid", os.getpid()), ("version", VERSION),
        ("rusage-utime", _tv(ru.ru_utime)), ("rusage-stime", _tv(ru.ru_stime)),
        ("uptime", (lp.now - lp.started_at) // NS),
        ("binlog-oldest-index", info["oldest"]), ("binlog-current-index", info["current"]),
        ("binlog-records-migrated", info["migrated"]),
        ("binlog-records-written", info["written"]), ("binlog-max-size", info["max_size"]),
        ("draining", lp.draining), ("id", lp.instance_id.encode()),
        ("hostname", uname.nodename.encode()), ("os", uname.version.encode()),
        ("platform", uname.machine.encode()),
    ]
    return out


def extended_stats(lp: Observed) -> list[tuple[str, object]]:
    """smallstalk's own server keys (`ext-stats`; `stats` too under --extended-stats)."""
    st = lp.state
    epoch, history = st.epoch
    out: list[tuple[str, object]] = []
    out += [("smallstalk-version", __version__),
            ("role", lp.role.encode()), ("last-seq", st.last_seq), ("epoch", epoch),
            ("history", history or "-")]  # quoted: an all-digit id must stay a string
    bodies = lp.bodies  # read-behind (bodies.py)
    out += [("max-memory", bodies.max_memory if bodies is not None else 0),
            ("bytes-in-memory", st.body_bytes - st.spilled_bytes),
            ("bytes-on-disk", st.spilled_bytes),
            ("body-reads", bodies.reads if bodies is not None else 0),
            ("current-connections-throttled",
             sum(1 for x in lp.sessions.values() if x.held or x.owed > OUT_BOUND)),
            ("unsent-bytes", lp.unsent),
            ("connections-refused", lp.refused),
            ("searches-running", len(lp.searches.running)),
            ("search-slices", lp.searches.slices)]
    if lp.role == "replica" and lp.follower is not None:
        out += lp.follower.stats(st)
    else:
        acked = max((f.acked for f in lp.feeds.values()), default=0)
        out += [("replicas", len(lp.feeds)), ("replica-acked-seq", acked),
                ("min-replica-acks", lp.min_replica_acks)]
    return out


def _storage_info(j: Journal | None) -> dict:
    """The binlog keys of `stats`: what the AOF holds."""
    if j is None:  # beanstalkd shows its default file size even without -b
        return {"oldest": 0, "current": 0, "migrated": 0, "written": 0,
                "max_size": 10 << 20}
    try:
        closed = j.closed_segments()
    except OSError:  # the disk is failing: stats still answers, from memory
        closed = []
    oldest = int(closed[0].stem) if closed else j.segment.first_seq
    return {
        "oldest": oldest, "current": j.segment.first_seq,
        # beanstalkd's count of records copied by its compaction; ours folds
        # into snapshots and copies none.
        "migrated": 0, "written": j.records_written,
        "max_size": j.segment_bytes,
    }


def _tv(seconds: float) -> bytes:
    whole = int(seconds)
    return b"%d.%06d" % (whole, int(round((seconds - whole) * 1e6)) % 1000000)
