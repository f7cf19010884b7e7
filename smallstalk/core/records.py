"""Mutation records: every state change as a frozen attrs class, and its CBOR form.

A record carries every decision its effect depends on (the job id a put was
given, the job a reserve was granted, the jobs a kick moved) and the wall-clock
time it happened, in integer nanoseconds since the epoch. Applying the same
records in the same order therefore always rebuilds the same state.

On disk (and on the replication stream) a record is the CBOR array
`[code, seq, time, field...]` with the fields in declaration order; see
snapshots/README.md. Codes are never reused: a new record type takes a new
code, a changed field list takes a new code and the old decoder stays.

Records marked `LOGGED = False` describe connection-scoped, volatile changes
(a connection opening, a reserve starting to wait): they go through `apply`
like the rest but never reach the AOF, because a restart forgets them anyway.
"""

from __future__ import annotations

import operator
from typing import ClassVar

import attrs
import cbor2

from smallstalk.core.frozen import frozen


def _tuple(xs) -> tuple:
    """The converter of id lists: `tuple` itself would cost ~2 ms at import (attrs
    reads a converter's signature, and a builtin's is parsed with tokenize)."""
    return tuple(xs)


# 2: PutJobs, Expire, DeleteTube; snapshot items for big tubes. 3: `jobs` items. 4: FlushTube.
# 5: PutUnique, `keys` snapshot items. 6: Requeue, Limits, Fire; `limit`, `schedule`, `hold`
# 7: Move. 8: PutUnique's compact form (code 26).
FORMAT_VERSION = 8


@frozen
class Put:
    CODE: ClassVar[int] = 1
    seq: int
    time: int
    conn: int
    id: int
    tube: str
    pri: int
    delay: int  # seconds
    ttr: int  # seconds
    body: bytes


@frozen
class Reserve:
    """Job `id` granted to `conn` (reserve, reserve-with-timeout, reserve-job; one
    per job of a reserve-batch)."""

    CODE: ClassVar[int] = 2
    seq: int
    time: int
    conn: int
    id: int


@frozen
class Delete:
    CODE: ClassVar[int] = 3
    seq: int
    time: int
    conn: int
    id: int


@frozen
class Release:
    CODE: ClassVar[int] = 4
    seq: int
    time: int
    conn: int
    id: int
    pri: int
    delay: int


@frozen
class Bury:
    CODE: ClassVar[int] = 5
    seq: int
    time: int
    conn: int
    id: int
    pri: int


@frozen
class Touch:
    CODE: ClassVar[int] = 6
    seq: int
    time: int
    conn: int
    id: int


@frozen
class Kick:
    """Buried or delayed jobs moved to ready (kick N and kick-job)."""

    CODE: ClassVar[int] = 7
    seq: int
    time: int
    conn: int
    ids: tuple[int, ...] = attrs.field(converter=_tuple)


@frozen
class Use:
    CODE: ClassVar[int] = 8
    seq: int
    time: int
    conn: int
    tube: str


@frozen
class Watch:
    CODE: ClassVar[int] = 9
    seq: int
    time: int
    conn: int
    tube: str


@frozen
class Ignore:
    CODE: ClassVar[int] = 10
    seq: int
    time: int
    conn: int
    tube: str


@frozen
class PauseTube:
    CODE: ClassVar[int] = 11
    seq: int
    time: int
    conn: int
    tube: str
    delay: int  # seconds, at least 1


@frozen
class Disconnect:
    """A connection closed: its reservations become ready, its tubes unreferenced."""

    CODE: ClassVar[int] = 12
    seq: int
    time: int
    conn: int


@frozen
class Promote:
    """Delayed jobs whose delay ran out become ready."""

    CODE: ClassVar[int] = 13
    seq: int
    time: int
    ids: tuple[int, ...] = attrs.field(converter=_tuple)


@frozen
class Timeout:
    """Reserved jobs whose TTR ran out go back to ready."""

    CODE: ClassVar[int] = 14
    seq: int
    time: int
    ids: tuple[int, ...] = attrs.field(converter=_tuple)


@frozen
class Restart:
    """The server started on this data: every connection before it is gone."""

    CODE: ClassVar[int] = 15
    seq: int
    time: int


@frozen
class NewEpoch:
    """From this record on, this server leads history `history` (number `epoch`).

    A primary logs epoch 1 with a random history id when its log has none (so a
    fresh log starts NewEpoch, Restart); a promoted replica logs Restart, then
    the next epoch with a new id. A replica uses the chain to tell whether a
    primary's log continues its own.
    """

    CODE: ClassVar[int] = 16
    seq: int
    time: int
    epoch: int
    history: str


@frozen
class PutJobs:
    """A put with smallstalk's extras, as one atomic record (format 2).

    `jobs` are the (id, tube) pairs made from the one body: the tube put into
    (absent when it is fanout-only) and a copy per fanout tube `tube+child`.
    `dropped` are ready jobs discarded first to make room (discard-old-when-
    full). `expires` is the absolute expiry time (ns, 0 = never). The body is
    the last field, so its bytes end where the frame ends (read-behind reads
    it back by offset).
    """

    CODE: ClassVar[int] = 17
    seq: int
    time: int
    conn: int
    jobs: tuple[tuple[int, str], ...] = attrs.field(
        converter=lambda xs: tuple((int(i), str(t)) for i, t in xs))
    pri: int
    delay: int
    ttr: int
    expires: int
    dropped: tuple[int, ...] = attrs.field(converter=_tuple)
    body: bytes


@frozen
class Expire:
    """Ready or delayed jobs past their expiry time: deleted, or moved.

    Each move is `(id, to, expires)`: `to` is the dead-letter tube ("" deletes
    the job) and `expires` its new expiry time there (0 = never). One record
    for the whole batch, so a move is never half done.
    """

    CODE: ClassVar[int] = 18
    seq: int
    time: int
    moves: tuple[tuple[int, str, int], ...] = attrs.field(
        converter=lambda xs: tuple((int(i), str(t), int(e)) for i, t, e in xs))


@frozen
class DeleteTube:
    """`delete-tube parent+child`: the fanout tube gets no more copies."""

    CODE: ClassVar[int] = 19
    seq: int
    time: int
    conn: int
    tube: str


@frozen
class FlushTube:
    """`flush-tube tube`: exactly these jobs (ready, delayed, buried) are deleted."""

    CODE: ClassVar[int] = 20
    seq: int
    time: int
    conn: int
    tube: str
    ids: tuple[int, ...] = attrs.field(converter=_tuple)


def _job_pairs(xs) -> tuple[tuple[int, str], ...]:
    """PutUnique's `jobs` as tuples; the one pair the server makes passes as it is."""
    if type(xs) is tuple and len(xs) == 1 and type(xs[0]) is tuple:
        return xs
    return tuple((int(i), str(t)) for i, t in xs)


@frozen
class PutUnique:
    """A put with an idempotency key (format 5): PutJobs's fields, and the key.

    `key` is indexed in `tube` (the tube put into) and names the first job
    of `jobs`. `unique_for` (s) and `keys_max` are the tube's policy when the
    put was made: how long the key outlives its job, and how many such keys
    the tube keeps (core/keys.py). The body stays the last field.
    """

    CODE: ClassVar[int] = 21
    seq: int
    time: int
    conn: int
    tube: str
    key: str
    unique_for: int  # seconds
    keys_max: int
    jobs: tuple[tuple[int, str], ...] = attrs.field(converter=_job_pairs)
    pri: int
    delay: int
    ttr: int
    expires: int
    dropped: tuple[int, ...] = attrs.field(converter=_tuple)
    body: bytes


@frozen
class Requeue:
    """Reserved jobs going back as their tube's policy decided (format 6).

    `cause` says why they leave their reservation: 0 their TTR ran out (a
    Timeout that counts a timeout), 1 `conn` released them with priority
    `pri` (a Release that counts a release), 2 `conn` closed (logged just
    before its Disconnect). Each outcome is `(id, until, to, reason)`: with no
    `reason` the job is ready again (`until` 0) or delayed until `until`
    (ns, back-off); with a `reason` (an attempt limit reached) it is buried
    (`to` "") or moved, ready, to the dead-letter tube `to`, keeping its id
    and statistics. One record per decision, so a move is never half done.
    """

    CODE: ClassVar[int] = 22
    seq: int
    time: int
    conn: int
    cause: int
    pri: int
    outcomes: tuple[tuple[int, int, str, str], ...] = attrs.field(
        converter=lambda xs: tuple((int(i), int(u), str(t), str(w)) for i, u, t, w in xs))


REQUEUE_TIMEOUT, REQUEUE_RELEASE, REQUEUE_DISCONNECT = 0, 1, 2


@frozen
class Limits:
    """From here on `tube` holds at most `max_reserved` jobs reserved (0: no
    limit) and hands out at most `rate` reserves per `period` ns (0: no
    limit), a token bucket of `rate` tokens kept by the state from the
    records' times (format 6). Logged when the configuration sets them."""

    CODE: ClassVar[int] = 23
    seq: int
    time: int
    tube: str
    max_reserved: int
    rate: int
    period: int


@frozen
class Fire:
    """Schedule `schedule`'s firing due at `at` (ns) happened (format 6):
    it made job `id` in `tube`, or nothing when `id` is 0 (skipped: the last
    job still pending, or a firing missed while the server was down). The
    body is the last field, as in a put."""

    CODE: ClassVar[int] = 24
    seq: int
    time: int
    schedule: str
    at: int
    id: int
    tube: str
    pri: int
    delay: int
    ttr: int
    body: bytes


@frozen
class Move:
    """`move-job id tube` (format 7): the ready, delayed or buried job `id`
    goes to `tube` in the same state, keeping its id, priority, statistics,
    delay deadline, expiry, idempotency key and hold."""

    CODE: ClassVar[int] = 25
    seq: int
    time: int
    conn: int
    id: int
    tube: str


# --- volatile: applied, never logged --------------------------------------


@frozen
class Connect:
    LOGGED: ClassVar[bool] = False
    seq: int
    time: int
    conn: int


@frozen
class WaitStart:
    """`conn` waits for a job; `deadline` (ns) is None for a plain reserve."""

    LOGGED: ClassVar[bool] = False
    seq: int
    time: int
    conn: int
    deadline: int | None


@frozen
class WaitStop:
    LOGGED: ClassVar[bool] = False
    seq: int
    time: int
    conn: int


LOGGED_TYPES = (
    Put, Reserve, Delete, Release, Bury, Touch, Kick, Use, Watch, Ignore, PauseTube,
    Disconnect, Promote, Timeout, Restart, NewEpoch, PutJobs, Expire, DeleteTube, FlushTube,
    PutUnique,
    Requeue, Limits, Fire, Move,
)
Record = (
    Put | Reserve | Delete | Release | Bury | Touch | Kick | Use | Watch | Ignore | PauseTube
    | Disconnect | Promote | Timeout | Restart | NewEpoch | PutJobs | Expire | DeleteTube
    | FlushTube | PutUnique | Requeue | Limits | Fire | Move | Connect | WaitStart | WaitStop
)

for _cls in LOGGED_TYPES:
    _cls.LOGGED = True  # type: ignore[attr-defined]

BY_CODE: dict[int, type] = {cls.CODE: cls for cls in LOGGED_TYPES}
FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in attrs.fields(cls)) for cls in LOGGED_TYPES
}
OP_NAMES: dict[type, str] = {
    Put: "put", Reserve: "reserve", Delete: "delete", Release: "release", Bury: "bury",
    Touch: "touch", Kick: "kick", Use: "use", Watch: "watch", Ignore: "ignore",
    PauseTube: "pause-tube", Disconnect: "disconnect", Promote: "promote",
    Timeout: "timeout", Restart: "restart", NewEpoch: "new-epoch", PutJobs: "put-jobs",
    Expire: "expire", DeleteTube: "delete-tube", FlushTube: "flush-tube",
    PutUnique: "put-unique",
    Requeue: "requeue", Limits: "limits", Fire: "fire", Move: "move",
}
# The records that make jobs from a body (their body is the last field).
PUT_TYPES = (Put, PutJobs, PutUnique)


class DecodeError(ValueError):
    pass


_GETTERS = {cls: operator.attrgetter(*FIELDS[cls]) for cls in LOGGED_TYPES}


def to_list(rec: Record) -> list:
    """The CBOR array form, without encoding."""
    cls = type(rec)
    return [cls.CODE, *_GETTERS[cls](rec)]


# The everyday PutUnique (one job, in the tube put into, no expiry, nothing
# dropped) is logged in a compact form of its own: its fields without the
# arrays, which cost cbor2 more than all its scalars (docs/PERFORMANCE.md,
# "Exactly-once enqueue (keys)"). It decodes to the same PutUnique.
PUT_UNIQUE_ONE = 26
PUT_UNIQUE_ONE_FIELDS = ("seq", "time", "conn", "tube", "key", "unique_for", "keys_max", "id",
                         "pri", "delay", "ttr", "body")


def put_unique_one(seq: int, time: int, conn: int, tube: str, key: str, unique_for: int,
                   keys_max: int, id: int, pri: int, delay: int, ttr: int,
                   body: bytes) -> PutUnique:
    """The PutUnique that the compact form's fields stand for."""
    return PutUnique(seq, time, conn, tube, key, unique_for, keys_max, ((id, tube),), pri,
                     delay, ttr, 0, (), body)


def encode(rec: Record) -> bytes:
    if type(rec) is PutUnique and not rec.expires and not rec.dropped and len(rec.jobs) == 1 \
            and rec.jobs[0][1] == rec.tube:
        return cbor2.dumps([PUT_UNIQUE_ONE, rec.seq, rec.time, rec.conn, rec.tube, rec.key,
                            rec.unique_for, rec.keys_max, rec.jobs[0][0], rec.pri, rec.delay,
                            rec.ttr, rec.body])
    return cbor2.dumps(to_list(rec))


def from_list(items: list) -> Record:
    try:
        code = items[0]
        if code == PUT_UNIQUE_ONE and type(code) is int:
            return put_unique_one(*items[1:])
        cls = BY_CODE[code]
        return cls(*items[1:])
    except (KeyError, TypeError, IndexError) as e:
        raise DecodeError(f"not a record: {items!r:.200}") from e


def decode_list(payload: bytes) -> list:
    """A record's CBOR array, checked to be a non-empty array, not yet a record."""
    try:
        items = cbor2.loads(payload)
    except Exception as e:  # cbor2 raises several types for garbage
        raise DecodeError(f"bad CBOR: {e}") from e
    if not isinstance(items, list) or not items:
        raise DecodeError("record is not a non-empty array")
    return items


def decode(payload: bytes) -> Record:
    return from_list(decode_list(payload))


# `decode_list` without its checks, for a loop that checks the result itself
# and calls `decode_list` for the error when it is not a non-empty list.
loads_unchecked = cbor2.loads


# A format-1 Put as `decode_list` gives it:
# [1, seq, time, conn, id, tube, pri, delay, ttr, body].
PUT_LIST_LEN = 1 + len(FIELDS[Put])


def is_put_list(items: list) -> bool:
    """Whether `from_list(items)` would be a Put (a bulk replay applies those
    from the list: most of a log is puts, and building each record costs)."""
    code = items[0]
    # Only a plain int: other values equal to 1 take the generic path, which
    # decides for them exactly as before.
    return type(code) is int and code == Put.CODE and len(items) == PUT_LIST_LEN


def as_dict(rec: Record) -> dict:
    """Every field by name, for tools (op first)."""
    out: dict = {"op": OP_NAMES.get(type(rec), type(rec).__name__.lower())}
    for f in attrs.fields(type(rec)):
        out[f.name] = getattr(rec, f.name)
    return out
