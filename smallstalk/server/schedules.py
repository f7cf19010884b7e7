"""Schedules: jobs put by the server on a cron expression (`[[schedules]]` tables).

A schedule is configuration (reloadable, like the tube policies); what it
did is state: each firing is one `Fire` record naming the schedule and the
firing time it stands for, so a firing happens exactly once across
restarts, replay and a replica's promotion (the state keeps every
schedule's last firing, and the next one is the cron expression's first
time after it). The timers (timers.py) call `fire_due` each turn and ask
`next_due` how long they may sleep. Cron expressions are parsed and
stepped by cronsim, in the schedule's time zone (zoneinfo).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from smallstalk.core import records as r
from smallstalk.core.state import DELAYED, NS, READY, RESERVED, State

if TYPE_CHECKING:  # datetime is imported on use: a server without schedules never needs it
    import datetime as dt

SCHEDULE_KEYS = ("name", "tube", "cron", "timezone", "body", "pri", "ttr", "delay",
                 "skip-if-pending", "catch-up")
CATCH_UP = ("none", "last")


class Loop(Protocol):
    """What the schedules read and call of the mutation loop (loop.MutationLoop)."""

    state: State
    policies: Any  # policy.Policies (policy.py imports this module)
    schedules_loaded: dict[str, int]
    serving_since: int
    max_job_size: int

    def take_job_id(self) -> int: ...

    def log(self, cls: type, *fields) -> r.Record: ...

    def count_tube(self, tube: str, name: str) -> None: ...


class ConfigError(Exception):
    """A `[[schedules]]` table that cannot be used (policy.ConfigError is this class)."""


class Schedule:
    """One `[[schedules]]` table, checked; it steps its cron expression with a
    one-entry cache (the timers ask for the same next firing every turn)."""

    __slots__ = ("name", "tube", "cron", "timezone", "body", "pri", "ttr", "delay",
                 "skip_if_pending", "catch_up", "_zone", "_cached")

    def __init__(self, name: str, tube: str, cron: str, timezone: str = "UTC",
                 body: bytes = b"", pri: int = 1024, ttr: int = 60, delay: int = 0,
                 skip_if_pending: bool = False, catch_up: str = "none") -> None:
        from zoneinfo import ZoneInfo

        self.name, self.tube, self.cron, self.timezone = name, tube, cron, timezone
        self.body, self.pri, self.ttr, self.delay = body, pri, ttr, delay
        self.skip_if_pending, self.catch_up = skip_if_pending, catch_up
        self._zone = ZoneInfo(timezone)
        self._cached: tuple[int, int] = (-1, 0)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self.as_toml_dict() == other.as_toml_dict()

    __hash__ = None  # type: ignore[assignment]

    def as_toml_dict(self) -> dict[str, Any]:
        return {"name": self.name, "tube": self.tube, "cron": self.cron,
                "timezone": self.timezone, "body": self.body.decode("utf-8", "replace"),
                "pri": self.pri, "ttr": self.ttr, "delay": self.delay,
                "skip-if-pending": self.skip_if_pending, "catch-up": self.catch_up}

    def _dt(self, ns: int) -> dt.datetime:
        import datetime as dt

        return dt.datetime.fromtimestamp(ns // 1000 / 1e6, self._zone)

    def next_after(self, ns: int) -> int:
        """The first firing strictly after `ns` (ns since the epoch)."""
        if self._cached[0] == ns:
            return self._cached[1]
        from cronsim import CronSim

        nxt = next(CronSim(self.cron, self._dt(ns)))
        out = int(nxt.timestamp()) * NS
        self._cached = (ns, out)
        return out

    def last_at_or_before(self, ns: int) -> int:
        """The latest firing at or before `ns`."""
        import datetime as dt

        from cronsim import CronSim

        prev = next(CronSim(self.cron, self._dt(ns) + dt.timedelta(microseconds=1),
                            reverse=True))
        return int(prev.timestamp()) * NS


def _check_cron(expr: object, tz: str, where: str) -> None:
    try:
        from cronsim import CronSim, CronSimError
    except ImportError:
        raise ConfigError(f"{where}: schedules need the cronsim package: "
                          "pip install 'smallstalk[schedules]'") from None
    # Five fields; six put seconds first (cronsim's form), for schedules below a minute.
    if not isinstance(expr, str) or len(expr.split()) not in (5, 6):
        raise ConfigError(f'{where}.cron: expected 5 fields like "*/5 * * * *" (or 6, '
                          f"seconds first), got {expr!r}")
    try:
        import datetime as dt
        from zoneinfo import ZoneInfo

        CronSim(expr, dt.datetime.now(ZoneInfo(tz)))
    except CronSimError as e:
        raise ConfigError(f"{where}.cron: {expr!r} is not a cron expression: {e}") from None


def _schedule(table: object, where: str, seen: set[str], tube_name: re.Pattern) -> Schedule:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table")
    for key in table:
        if key not in SCHEDULE_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(SCHEDULE_KEYS)})")
    name = table.get("name")
    if not isinstance(name, str) or not name or len(name) > 200:
        raise ConfigError(f"{where}.name: expected a name (text, at most 200 bytes)")
    if name in seen:
        raise ConfigError(f"{where}.name: {name!r} is named twice")
    seen.add(name)
    where = f"{where} ({name})"
    tube = table.get("tube")
    if not isinstance(tube, str) or not tube_name.match(tube):
        raise ConfigError(f"{where}.tube: expected a tube name, got {tube!r}")
    tz = table.get("timezone", "UTC")
    try:
        from zoneinfo import ZoneInfo

        ZoneInfo(tz)
    except Exception:
        raise ConfigError(f"{where}.timezone: unknown time zone {tz!r} "
                          "(an IANA name like \"Europe/Berlin\")") from None
    _check_cron(table.get("cron"), tz, where)
    body = table.get("body", "")
    if not isinstance(body, str):
        raise ConfigError(f"{where}.body: expected text")
    ints = {}
    for key, default, top in (("pri", 1024, 2**32 - 1), ("ttr", 60, 2**32 - 1),
                              ("delay", 0, 2**32 - 1)):
        v = table.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
            raise ConfigError(f"{where}.{key}: expected a whole number 0..{top}, got {v!r}")
        ints[key] = v
    skip = table.get("skip-if-pending", False)
    if not isinstance(skip, bool):
        raise ConfigError(f"{where}.skip-if-pending: expected true or false")
    catch_up = table.get("catch-up", "none")
    if catch_up not in CATCH_UP:
        raise ConfigError(f'{where}.catch-up: expected "none" or "last", got {catch_up!r}')
    return Schedule(name, tube, table["cron"], tz, body.encode(), ints["pri"],
                    max(ints["ttr"], 1), ints["delay"], skip, catch_up)


def schedules_from(tables: object, source: str, tube_name: re.Pattern) -> tuple[Schedule, ...]:
    """The `[[schedules]]` array of a configuration file, checked (policy.py
    calls it; a mistake raises ConfigError with its one line)."""
    if not isinstance(tables, list):
        raise ConfigError(f"{source}: `schedules` must be an array of tables ([[schedules]])")
    seen: set[str] = set()
    return tuple(_schedule(t, f"{source}: schedules[{i}]", seen, tube_name)
                 for i, t in enumerate(tables))


def _anchor(st: State, sched: Schedule, loaded_at: Mapping[str, int]) -> int:
    """The time after which the schedule's next firing comes: its last
    firing, or (never fired) when this server first loaded it."""
    last = st.schedules.get(sched.name)
    return last[0] if last is not None else loaded_at.get(sched.name, st.time)


def next_due(st: State, schedules: tuple[Schedule, ...], loaded_at: Mapping[str, int]) -> int:
    """The earliest next firing (ns) of any schedule; 0 when there is none."""
    due = 0
    for sched in schedules:
        t = sched.next_after(_anchor(st, sched, loaded_at))
        if not due or t < due:
            due = t
    return due


def firings(st: State, schedules: tuple[Schedule, ...], loaded_at: Mapping[str, int],
            now: int, serving_since: int) -> list[tuple]:
    """The Fire records' fields due at `now`, one per schedule at most:
    (schedule, at, make a job?, the schedule). Firings missed while the
    server was down, or took no changes (before `serving_since`: a replica
    before its promotion, a primary fenced until its lease was renewed), are
    caught up once (`catch-up = "last"`) or recorded as skipped ("none"); a
    firing while the last job is still pending is skipped with `skip-if-pending`."""
    out = []
    for sched in schedules:
        nxt = sched.next_after(_anchor(st, sched, loaded_at))
        if nxt > now:
            continue
        at = sched.last_at_or_before(now)
        make = True
        if at < serving_since and sched.catch_up == "none":
            make = False
        elif sched.skip_if_pending:
            last = st.schedules.get(sched.name)
            j = st.jobs.get(last[1]) if last is not None and last[1] else None
            if j is not None and j.state in (READY, DELAYED, RESERVED):
                make = False
        out.append((sched, at, make))
    return out


def fire_due(lp: Loop, now: int) -> None:
    """Log a Fire record for every schedule whose time came (timers.run)."""
    for sched, at, make in firings(lp.state, lp.policies.schedules, lp.schedules_loaded,
                                   now, lp.serving_since):
        if make and len(sched.body) > lp.max_job_size:
            make = False
        job_id = lp.take_job_id() if make else 0
        lp.log(r.Fire, sched.name, at, job_id, sched.tube, sched.pri, sched.delay, sched.ttr,
               sched.body if make else b"")
        if make:
            lp.count_tube(sched.tube, "schedule-firings")
        else:
            lp.count_tube(sched.tube, "schedule-skips")
