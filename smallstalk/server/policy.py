"""Per-tube policy: limits, expiry, fanout and memory budgets, and where they come from.

A `TubePolicy` is configuration, not queue state: the mutation loop consults
it when it decides (refuse a put, drop the oldest jobs, expire a job, copy a
put into fanout tubes) and writes the decision into a record, so a replay
never needs the policy that was in force. That is what lets an operator
change policies with a reload without touching the log.

The TOML file (`--config`) has a `[server]` table (read by config.py) and
`[tubes.default]` plus `[tubes."<name>"]` tables: every named tube inherits
the default's settings and overrides what it names. Keys use beanstalkd's
dashed spelling: see `TUBE_KEYS` and docs/CONFIG.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from smallstalk.server import schedules as _schedules

DEFAULT = "default"
TOP_LEVEL = ("server", "tubes", "schedules", "ha")  # [server] and [ha] are config.py's


# A configuration file that cannot be used; the message names file and key.
# Defined with the schedules' parser, which raises it too (schedules.py).
ConfigError = _schedules.ConfigError


@attrs.frozen
class TubePolicy:
    max_jobs: int = 0  # jobs in the tube, any state; 0 = unlimited
    max_bytes: int = 0  # body bytes in the tube; 0 = unlimited
    max_job_size: int = 0  # bytes; 0 = the server's -z
    discard_old_when_full: bool = False  # drop the oldest ready jobs instead of refusing
    max_age: int = 0  # seconds a job may live before it expires; 0 = never
    expire_to: str = ""  # tube that expired jobs move to; "" = delete them
    fanout_only: bool = False  # a parent that only feeds its `parent+child` tubes
    max_memory: int = 0  # body bytes this tube keeps in memory; 0 = server budget only
    unique: str = ""  # "body": every put is deduplicated by its body's digest
    unique_for: int = 3600  # seconds a key outlives its job (core/keys.py)
    unique_keys_max: int = 100_000  # keys of gone jobs a tube retains at most
    # Attempt limits and back-off (server/holdback.py decides, Requeue records carry it).
    max_reserves: int = 0  # a job reserved this often is not made ready again; 0 = no limit
    max_timeouts: int = 0  # ...nor one whose TTR ran out this often
    on_exhausted: str = ""  # "bury" (the default with a limit) or "dead-letter"
    dead_letter: str = ""  # the tube an exhausted job moves to
    timeout_backoff: tuple[int, int] = (0, 0)  # (base, cap) seconds; (0, 0) = ready at once
    release_backoff: tuple[int, int] = (0, 0)  # the same for a release without a delay
    # Concurrency and rate (Limits records carry them into the state).
    max_reserved: int = 0  # jobs of the tube reserved at once; 0 = no limit
    max_rate: tuple[int, int] = (0, 0)  # (reserves, per seconds); (0, 0) = no limit
    # No limit, expiry or fanout-only: a put needs no decision (the hot path).
    plain: bool = attrs.field(init=False, eq=False, repr=False)
    # (unique_for, unique_keys_max) where a put-unique needs no decision (no
    # limit, expiry or fanout-only, whatever `unique`), else None: its hot
    # path reads one attribute of this class, where each read is a generic lookup.
    keyed_put: tuple[int, int] | None = attrs.field(init=False, eq=False, repr=False)
    # An attempt limit or a back-off: a reservation's end needs a decision.
    holds_back: bool = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        unlimited = not (self.max_jobs or self.max_bytes or self.max_job_size or self.max_age
                         or self.fanout_only)
        object.__setattr__(self, "keyed_put", (self.unique_for, self.unique_keys_max)
                           if unlimited else None)
        object.__setattr__(self, "plain", unlimited and not self.unique)
        object.__setattr__(self, "holds_back", bool(
            self.max_reserves or self.max_timeouts or self.timeout_backoff[0]
            or self.release_backoff[0]))

    def as_toml_dict(self) -> dict[str, Any]:
        return {key: _shown(kind, getattr(self, attr))
                for key, (attr, kind) in TUBE_KEYS.items()}

    def exhausted_to(self) -> str | None:
        """Where a job that reached an attempt limit goes: "" buried, a tube
        name (dead-letter), None when the tube has no attempt limit."""
        if not (self.max_reserves or self.max_timeouts):
            return None
        return self.dead_letter if self.on_exhausted == "dead-letter" else ""


def _shown(kind: str, value: Any) -> Any:
    """A setting as the TOML file would spell it (config dump, `config`)."""
    if kind == "backoff":
        return f"{value[0]}s..{value[1]}s" if value[0] else ""
    if kind == "rate":
        return f"{value[0]}/{_PER_NAME[value[1]]}" if value[0] else ""
    return value


# TOML key -> (attribute, kind)
TUBE_KEYS: dict[str, tuple[str, str]] = {
    "max-jobs": ("max_jobs", "count"),
    "max-bytes": ("max_bytes", "size"),
    "max-job-size": ("max_job_size", "size"),
    "discard-old-when-full": ("discard_old_when_full", "bool"),
    "max-age": ("max_age", "duration"),
    "expire-to": ("expire_to", "tube"),
    "fanout-only": ("fanout_only", "bool"),
    "max-memory": ("max_memory", "size"),
    "unique": ("unique", "unique"),
    "unique-for": ("unique_for", "duration"),
    "unique-keys-max": ("unique_keys_max", "count"),
    "max-reserves": ("max_reserves", "count"),
    "max-timeouts": ("max_timeouts", "count"),
    "on-exhausted": ("on_exhausted", "exhausted"),
    "dead-letter": ("dead_letter", "tube"),
    "timeout-backoff": ("timeout_backoff", "backoff"),
    "release-backoff": ("release_backoff", "backoff"),
    "max-reserved": ("max_reserved", "count"),
    "max-rate": ("max_rate", "rate"),
}
UNIQUE_MODES = ("", "body")
_PER = {"s": 1, "m": 60, "h": 3600}
_PER_NAME = {v: k for k, v in _PER.items()}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*([smh])\s*$")
_BACKOFF = re.compile(r"^\s*([^.]+?)\s*\.\.\s*([^.]+?)\s*$")


@attrs.frozen
class Policies:
    """The effective policy of every tube: `of(name)`."""

    default: TubePolicy = TubePolicy()
    # A dict, whatever mapping it is given: every put reads it (dispatch.put).
    tubes: dict[str, TubePolicy] = attrs.field(factory=dict, converter=dict)
    schedules: tuple = ()  # schedules.Schedule, in file order
    # Does any tube have its own `max-memory` (read-behind per tube)? Asked on
    # every put (may its body go to disk?): worked out once, and a field, not
    # a method, because a compiled put reads it for less than a call costs.
    memory_budgets: bool = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "memory_budgets", bool(self.default.max_memory) or any(
            t.max_memory for t in self.tubes.values()))

    def of(self, tube: str) -> TubePolicy:
        return self.tubes.get(tube, self.default)

    def dump(self, names: list[str]) -> list[tuple[str, TubePolicy]]:
        """(tube, effective policy) for `default`, every configured tube and `names`."""
        seen = [DEFAULT, *sorted(self.tubes)]
        seen += [n for n in names if n not in seen]
        return [(n, self.of(n)) for n in seen]


_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.I)
_DURATION = re.compile(r"^\s*(\d+)\s*([smhd]?)\s*$", re.I)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
TUBE_NAME = re.compile(r"^[A-Za-z0-9+/;.$_()][A-Za-z0-9+/;.$_()-]{0,199}$")


def _quantity(value: object, where: str, pattern: re.Pattern, units: dict[str, int],
              what: str, example: str) -> int:
    """A non-negative int, or a string of digits and one of `units`' suffixes."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected {what}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: must not be negative")
        return value
    m = pattern.match(value) if isinstance(value, str) else None
    if not m:
        raise ConfigError(f"{where}: expected {what} like {example}, got {value!r}")
    return int(m.group(1)) * units[m.group(2).lower()]


def parse_size(value: object, where: str) -> int:
    """An int of bytes, or a string like "64MB" / "64MiB" / "512k" (powers of 1024)."""
    return _quantity(value, where, _SIZE, _UNITS, "a size", '65536 or "64MB"')


def parse_duration(value: object, where: str) -> int:
    """Seconds: an int, or a string like "90s", "15m", "2h", "7d"."""
    return _quantity(value, where, _DURATION, _SECONDS, "seconds or a duration", '"15m"')


def _value(kind: str, value: object, where: str) -> object:
    if kind == "size":
        return parse_size(value, where)
    if kind == "duration":
        return parse_duration(value, where)
    if kind == "count":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}: expected a whole number >= 0, got {value!r}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if kind == "unique":
        if value not in UNIQUE_MODES:
            raise ConfigError(f'{where}: expected "body" (or "" for none), got {value!r}')
        return value
    if kind == "exhausted":
        if value not in ("bury", "dead-letter"):
            raise ConfigError(f'{where}: expected "bury" or "dead-letter" ("bury" undoes a '
                              f'"dead-letter" of tubes.default), got {value!r}')
        return value
    if value in ("", 0) and not isinstance(value, bool) and kind in ("backoff", "rate"):
        return (0, 0)  # off, over the default's (docs/CONFIG.md)
    if kind == "backoff":
        m = _BACKOFF.match(value) if isinstance(value, str) else None
        if not m:
            raise ConfigError(f'{where}: expected a base and a cap like "5s..10m" (or "" for '
                              f"none), got {value!r}")
        base = parse_duration(m.group(1), where)
        cap = parse_duration(m.group(2), where)
        if not 0 < base <= cap:
            raise ConfigError(f"{where}: the base must be at least 1s and at most the cap")
        return (base, cap)
    if kind == "rate":
        m = _RATE.match(value) if isinstance(value, str) else None
        if not m or int(m.group(1)) < 1:
            raise ConfigError(f'{where}: expected reserves per period like "100/s" (or /m, /h; '
                              f'"" for no limit), got {value!r}')
        return (int(m.group(1)), _PER[m.group(2)])
    if not isinstance(value, str) or (value and not TUBE_NAME.match(value)):
        raise ConfigError(f"{where}: expected a tube name, got {value!r}")
    return value


def _policy(base: TubePolicy, table: object, where: str) -> TubePolicy:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table")
    changes = {}
    for key, value in table.items():
        if key not in TUBE_KEYS:
            known = ", ".join(TUBE_KEYS)
            raise ConfigError(f"{where}: unknown key {key!r} (known: {known})")
        attr, kind = TUBE_KEYS[key]
        changes[attr] = _value(kind, value, f"{where}.{key}")
    return attrs.evolve(base, **changes)


def policies_from(doc: Mapping[str, Any], source: str = "config") -> Policies:
    """Policies from a parsed TOML document (its `tubes` table).

    Any top-level table other than `server` and `tubes` is an error: a
    misspelt `[tube.orders]` must not load as "no settings" on a reload.
    """
    for key in doc:
        if key not in TOP_LEVEL:
            raise ConfigError(f"{source}: unknown table {key!r} (known: {', '.join(TOP_LEVEL)})")
    tubes = doc.get("tubes", {})
    if not isinstance(tubes, dict):
        raise ConfigError(f"{source}: `tubes` must be a table")
    default = _policy(TubePolicy(), tubes.get(DEFAULT, {}), f"{source}: tubes.{DEFAULT}")
    for key in ("max-reserved", "max-rate"):
        if key in tubes.get(DEFAULT, {}):
            raise ConfigError(f"{source}: tubes.{DEFAULT}.{key}: a limit for every tube at "
                              f"once is not supported: set it in each [tubes.NAME]")
    named = {}
    for name, table in tubes.items():
        if name == DEFAULT:
            continue
        if not TUBE_NAME.match(name):
            raise ConfigError(f"{source}: tubes.{name!r}: not a valid tube name")
        named[name] = _policy(default, table, f"{source}: tubes.{name}")
    def settled(pol: TubePolicy) -> TubePolicy:
        # `dead-letter = "tube"` alone means on-exhausted = "dead-letter".
        if pol.dead_letter and not pol.on_exhausted:
            return attrs.evolve(pol, on_exhausted="dead-letter")
        return pol

    default = settled(default)
    named = {name: settled(pol) for name, pol in named.items()}
    for name, pol in [(DEFAULT, default), *named.items()]:
        if pol.expire_to == name:
            raise ConfigError(f"{source}: tubes.{name}.expire-to: a tube cannot expire into itself")
        if pol.dead_letter == name:
            raise ConfigError(f"{source}: tubes.{name}.dead-letter: a tube cannot dead-letter "
                              "into itself")
        if pol.on_exhausted == "dead-letter" and not pol.dead_letter:
            raise ConfigError(f'{source}: tubes.{name}.on-exhausted: "dead-letter" needs '
                              '`dead-letter = "<tube>"`')
    return Policies(default, named,
                    _schedules.schedules_from(doc.get("schedules", []), source, TUBE_NAME))


def read_toml(path: Path) -> dict[str, Any]:
    import tomllib  # only with a --config file: not on every server's start-up path

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def load_policies(path: Path) -> Policies:
    return policies_from(read_toml(path), str(path))


# The attempt, back-off, concurrency and rate settings: listed only when set.
_SHOWN_WHEN_SET = ("max-reserves", "max-timeouts", "on-exhausted", "dead-letter",
                   "timeout-backoff", "release-backoff", "max-reserved", "max-rate")


def render(rows: list[tuple[str, TubePolicy]]) -> bytes:
    """The effective settings as YAML (the `config` command and `config dump`)."""
    out = ["---"]
    for name, pol in rows:
        out.append(f"{name}:")
        for key, value in pol.as_toml_dict().items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif not value and key in _SHOWN_WHEN_SET:
                continue
            elif isinstance(value, str):
                text = f'"{value}"'
            else:
                text = str(value)
            out.append(f"  {key}: {text}")
    return ("\n".join(out) + "\n").encode()
