"""The data of `stats-job` and `stats-tube`: a job's and a tube's counters as
(key, value) pairs in beanstalkd's order, for `protocol.yaml_dict` to render.
"""

from __future__ import annotations

from smallstalk.core.keys import KeyIndex
from smallstalk.core.model import DELAYED, NS, RESERVED, STATE_NAMES, Job, Tube, secs


def job_stats(j: Job, now: int) -> list[tuple[str, object]]:
    time_left = secs(j.deadline - now) if j.state in (RESERVED, DELAYED) else 0
    return [
        ("id", j.id), ("tube", j.tube.name.encode()), ("state", STATE_NAMES[j.state].encode()),
        ("pri", j.pri), ("age", secs(now - j.created)), ("delay", j.delay),
        ("ttr", j.ttr), ("time-left", time_left), ("file", 0), ("reserves", j.reserves),
        ("timeouts", j.timeouts), ("releases", j.releases), ("buries", j.buries),
        ("kicks", j.kicks),
    ]


def tube_stats(t: Tube, now: int) -> list[tuple[str, object]]:
    paused = t.paused(now)
    return [
        ("name", t.name.encode()), ("current-jobs-urgent", t.urgent_n),
        ("current-jobs-ready", t.ready_n), ("current-jobs-reserved", t.reserved_n),
        ("current-jobs-delayed", t.delayed_n), ("current-jobs-buried", len(t.buried)),
        ("total-jobs", t.total_jobs), ("current-using", t.using_n),
        ("current-watching", t.watching_n), ("current-waiting", len(t.waiting)),
        ("cmd-delete", t.cmd_delete), ("cmd-pause-tube", t.cmd_pause),
        ("pause", t.pause // NS if paused else 0),
        ("pause-time-left", secs(t.unpause_at - now) if paused else 0),
    ]


def tube_stats_ext(t: Tube) -> list[tuple[str, object]]:
    """smallstalk's own keys of a tube (not in `stats-tube`: beanstalkd clients
    compare that reply whole)."""
    return [
        ("jobs-expired", t.expired_n), ("jobs-discarded", t.discarded_n),
        ("current-bytes", t.bytes_n), ("bytes-in-memory", t.bytes_n - t.spilled_n),
        ("bytes-on-disk", t.spilled_n),
    ]


def tube_key_stats(keys: KeyIndex, tube: str) -> list[tuple[str, object]]:
    """A tube's idempotency keys (core/keys.py): live, retained, dropped past the bound."""
    k = keys.tubes.get(tube)
    if k is None:
        return [("keys-live", 0), ("keys-retained", 0), ("keys-dropped", 0)]
    return [("keys-live", len(k.live)), ("keys-retained", len(k.gone)),
            ("keys-dropped", k.dropped_n)]


def job_key_stats(keys: KeyIndex, j: Job) -> list[tuple[str, object]]:
    """`stats-job`'s extended keys: the idempotency key the job was put with ("" if none)."""
    held = keys.key_of(j.id)
    return [("key", held[1] if held else "")]
