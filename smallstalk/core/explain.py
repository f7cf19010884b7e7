"""Why a job is (or is not) being handed out now: `explain-job`'s answer.

Pure: reads the state the mutation loop owns and the time it is given; what
only the server knows (a connection's address) comes in as `peer_of`. The
answer is the job's state and every reason that holds now, each one line of
plain words with its numbers, in the order an operator checks them: the
job's own state (delayed, backing off, buried, reserved), then its tube
(paused, limits), then the queue in front of it and the workers that could
take it, then where its body lives.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from smallstalk.core.model import (
    BURIED,
    DELAYED,
    M32,
    NS,
    READY,
    RESERVED,
    STATE_NAMES,
    Job,
    secs,
)
from smallstalk.core.readyheap import entry_has_gen, entry_id, entry_pri

# Jobs ahead of one are counted best-first and this many at most, so an
# explain on a tube of a million jobs costs the loop a bounded turn.
AHEAD_MAX = 10_000


def iso(ns: int) -> str:
    """UTC, to the millisecond when there is a fraction (rate tokens come apart)."""
    import datetime as dt  # here: the server's start does not need it (start-up time)

    t = dt.datetime.fromtimestamp(ns // NS, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    ms = ns % NS // 1_000_000
    return f"{t}.{ms:03d}Z" if ms else f"{t}Z"


def _in(ns: int, now: int) -> str:
    """`until T (in S s)`: an instant and how far it is from now."""
    return f"{iso(ns)} (in {max(ns - now, 0) / NS:g} s)"


def ahead_of(st, j: Job, cap: int = AHEAD_MAX) -> int:
    """Ready jobs of j's tube handed out before j (lower priority number, or
    the same and older), counted up to `cap`."""
    t = j.tube
    heap = t.ready
    mine = (j.pri, j.id)
    jobs = st.jobs
    n = 0
    frontier = [(heap[0], 0)] if heap else []
    size = len(heap)
    while frontier and n < cap:
        key, i = heapq.heappop(frontier)
        pri, jid = entry_pri(key), entry_id(key)
        if (pri, jid) >= mine:
            continue  # nothing under it in the heap comes before j either
        o = jobs.get(jid)
        if o is not None and o.state == READY and entry_has_gen(key, o.gen):
            n += 1
        for child in (2 * i + 1, 2 * i + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))
    return n


def explain(st, jid: int, now: int,
            peer_of: Callable[[int], str | None] = lambda cid: None
            ) -> list[tuple[str, object]] | None:
    """`explain-job`'s pairs: id, tube, state, then `reason` lines (as
    `reasons`, a list); None when there is no such job."""
    j = st.jobs.get(jid)
    if j is None:
        return None
    t = j.tube
    name = t.name
    reasons: list[str] = []
    held = st.held_back(jid, now)
    hold = st.holds.get(jid)
    if j.state == RESERVED:
        cid = j.reserver
        peer = peer_of(cid)
        left = secs(max(j.deadline - now, 0))  # as stats-job's time-left counts
        reasons.append(f"reserved by connection {cid}" + (f" ({peer})" if peer else "")
                       + f" with {left} s of TTR left (until {iso(j.deadline)})")
    elif j.state == DELAYED:
        if held is not None and held[0] == "backoff":
            reasons.append(f"backing off until {_in(j.deadline, now)}"
                           f" after {j.timeouts} timeouts and {j.releases} releases")
        else:
            reasons.append(f"delayed until {_in(j.deadline, now)}")
    elif j.state == BURIED:
        if hold:
            reasons.append(f"buried: {hold}")
        else:
            reasons.append(f"buried (buried {j.buries} times); `kick-job {jid}` makes it ready")
    if j.state in (READY, DELAYED) and t.paused(now):
        reasons.append(f"tube {name} paused until {_in(t.unpause_at, now)}")
    lim = st.limits.get(name)
    if j.state == READY and lim is not None:
        if lim.full(t.reserved_n):
            reasons.append(f"tube {name} at its concurrency limit: {t.reserved_n} reserved "
                           f"(max-reserved {lim.max_reserved})")
        if lim.rate and now < lim.token_at():
            reasons.append(f"tube {name} at its rate limit ({lim.rate} per "
                           f"{lim.period / NS:g} s): next token at {_in(lim.token_at(), now)}")
    if j.state == READY and hold:
        reasons.append(str(hold))
    if j.state in (READY, DELAYED):
        watchers = [c for c in st.conns.values() if name in c.watch]
        if j.state == READY:
            ahead = ahead_of(st, j)
            more = "+" if ahead >= AHEAD_MAX else ""
            if ahead:
                reasons.append(f"{ahead}{more} jobs ahead of it in tube {name} (higher "
                               f"priority or older); {len(watchers)} connections watch the tube")
        if not watchers:
            watched = sorted({w for c in st.conns.values() for w in c.watch})
            reasons.append(f"no connection watches tube {name}; the tubes watched are: "
                           + (", ".join(watched) if watched else "none"))
        elif j.state == READY and not any(c.waiting for c in watchers):
            held_n = sum(len(c.reserved) for c in watchers)
            reasons.append(f"every watcher busy: none of the {len(watchers)} connections "
                           f"watching tube {name} is waiting in a reserve "
                           f"({held_n} jobs reserved among them)")
    if isinstance(j.body, int):
        reasons.append(f"body on disk only (read-behind): {j.body & M32} bytes are read "
                       "back from the log when it is handed out")
    return [("id", jid), ("tube", name), ("state", STATE_NAMES[j.state]),
            ("pri", j.pri), ("reasons", reasons)]


def render(pairs: list[tuple[str, object]]) -> bytes:
    """The YAML body: scalars as `key: value`, the reasons as a list of quoted lines."""
    out = ["---"]
    for key, value in pairs:
        if isinstance(value, list):
            out.append(f"{key}:" + ("" if value else " []"))
            out += [f"- {_quote(v)}" for v in value]
        elif isinstance(value, int):
            out.append(f"{key}: {value}")
        else:
            out.append(f"{key}: {value}" if key == "state" else f"{key}: {_quote(value)}")
    return ("\n".join(out) + "\n").encode()


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
