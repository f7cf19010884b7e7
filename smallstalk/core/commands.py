"""The beanstalkd commands as small classes, and each as a client writes it (`render`).

The parser (parser.py) makes them from bytes; `render` is its inverse. See
docs/ARCHITECTURE.md for where they go from there.
"""

from __future__ import annotations

from typing import Any

from smallstalk.core import model
from smallstalk.core.frozen import command


class _Everyday:
    """The base of the commands a worker or producer sends all day (`Put`,
    `PutUnique`, `Reserve`, `Delete`, `Release`, `Bury`, `Touch`): plain slotted classes,
    compared, hashed and shown by their `FIELDS` as the `@command` ones are.

    Not attrs classes, because the compiled build (commands.pxd) makes these
    seven extension types, which attrs cannot build: a line parsed then makes
    its command without running Python code, and dispatch reads its fields
    from the object itself (docs/PERFORMANCE-ROUNDS.md, The commands).
    """

    __slots__ = ()
    FIELDS: tuple[str, ...] = ()

    def values(self) -> tuple:
        """The fields' values, in `FIELDS` order."""
        return tuple([getattr(self, f) for f in self.FIELDS])

    def __eq__(self, other: Any) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.values() == other.values()

    def __ne__(self, other: Any) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.values()))

    def __repr__(self) -> str:
        fields = ", ".join([f"{f}={getattr(self, f)!r}" for f in self.FIELDS])
        return f"{type(self).__qualname__}({fields})"


class Put(_Everyday):
    __slots__ = FIELDS = ("pri", "delay", "ttr", "body", "max_age")

    def __init__(self, pri: int, delay: int, ttr: int, body: bytes, max_age: int = 0) -> None:
        self.pri = pri
        self.delay = delay  # seconds
        self.ttr = ttr  # seconds, at least 1
        self.body = body
        # smallstalk's `put-expiring <pri> <delay> <ttr> <max-age> <bytes>`: seconds
        # until the job expires (0 = a plain put: only the tube's max-age applies).
        self.max_age = max_age


class PutRest(Put):
    """A put whose line came before its body was all in (`PutHeard`): the
    put, answered with the job id taken at its line and not counted again."""

    __slots__ = ()


@command
class PutHeard:
    """A put line whose body has not all arrived yet. beanstalkd counts the
    put at its line and, unless the body is too big, makes the job there
    (taking its id: a put from another connection meanwhile gets the next
    one) and the connection a producer; a client that hangs up mid-body has
    used an id. The parser then makes a `PutRest`, an uncounted
    `ErrorReply(EXPECTED_CRLF)`, or (`job` false) `ErrorReply(JOB_TOO_BIG)`."""

    job: bool


class PutUnique(_Everyday):
    """smallstalk's `put-unique <key> <pri> <delay> <ttr> <bytes>`: a put with an
    idempotency key (1 to KEY_MAX bytes of tube-name characters). Everyday: a
    producer that retries sends one for every job."""

    __slots__ = FIELDS = ("key", "pri", "delay", "ttr", "body")

    def __init__(self, key: str, pri: int, delay: int, ttr: int, body: bytes) -> None:
        self.key = key
        self.pri = pri
        self.delay = delay
        self.ttr = ttr  # seconds, at least 1
        self.body = body


KEY_MAX = 200  # bytes of an idempotency key


class Reserve(_Everyday):
    __slots__ = FIELDS = ("timeout",)

    def __init__(self, timeout: int | None) -> None:
        self.timeout = timeout  # seconds; None blocks without limit


@command
class ReserveJob:
    id: int


class Delete(_Everyday):
    __slots__ = FIELDS = ("id",)

    def __init__(self, id: int) -> None:
        self.id = id


class Release(_Everyday):
    __slots__ = FIELDS = ("id", "pri", "delay")

    def __init__(self, id: int, pri: int, delay: int) -> None:
        self.id = id
        self.pri = pri
        self.delay = delay


class Bury(_Everyday):
    __slots__ = FIELDS = ("id", "pri")

    def __init__(self, id: int, pri: int) -> None:
        self.id = id
        self.pri = pri


class Touch(_Everyday):
    __slots__ = FIELDS = ("id",)

    def __init__(self, id: int) -> None:
        self.id = id


@command
class Use:
    tube: str


@command
class Watch:
    tube: str


@command
class Ignore:
    tube: str


@command
class Peek:
    id: int


@command
class PeekReady:
    pass


@command
class PeekDelayed:
    pass


@command
class PeekBuried:
    pass


@command
class Kick:
    bound: int


@command
class KickJob:
    id: int


@command
class StatsJob:
    id: int


@command
class StatsTube:
    tube: str


@command
class Stats:
    pass


@command
class ListTubes:
    pass


@command
class ListTubeUsed:
    pass


@command
class ListTubesWatched:
    pass


@command
class PauseTube:
    tube: str
    delay: int


@command
class Quit:
    pass


# smallstalk's own commands (beanstalkd answers them UNKNOWN_COMMAND).


@command
class Replicate:
    """`replicate <epoch> <history|-> <after seq>`: become a replication feed."""

    epoch: int
    history: str
    after: int


@command
class ReplicaAck:
    """`replica-ack <seq>`: a replica has everything up to seq on its disk."""

    seq: int


@command
class PromoteReplica:
    """`promote`: a replica stops following and accepts writes."""


@command
class DeleteTube:
    """`delete-tube <parent+child>`: stop copying puts into a fanout tube."""

    tube: str


@command
class ConfigDump:
    """`config`: the effective per-tube settings, as YAML."""


@command
class ReloadConfig:
    """`reload-config`: re-read the per-tube settings from the --config file."""


@command
class ListJobs:
    """`list-jobs <tube> <state> <after-id> <count>`: job ids in hand-out order."""

    tube: str
    state: str  # ready, delayed, buried or reserved
    after: int
    count: int


@command
class FlushTube:
    """`flush-tube <tube>`: delete every ready, delayed and buried job of a tube."""

    tube: str


LIST_JOBS_STATES = model.STATE_NAMES  # list-jobs takes any state
LIST_JOBS_MAX = 1000  # ids per list-jobs answer; page on with after-id


@command
class Auth:
    """`auth <token>`: authenticate this connection for the admin commands."""

    token: str


@command
class ExtStats:
    """`ext-stats`: smallstalk's own server statistics (YAML, like `stats`)."""


@command
class ExtStatsTube:
    """`ext-stats-tube <tube>`: smallstalk's own statistics of a tube."""

    tube: str


@command
class ExplainJob:
    """`explain-job <id>`: the job's state and every reason it is not handed out now."""

    id: int


RESERVE_BATCH_MAX = 1000  # jobs one reserve-batch may ask for


@command
class ReserveBatch:
    """`reserve-batch <n> <timeout>`: up to n ready jobs in one reply."""

    count: int
    timeout: int


@command
class MoveJob:
    """`move-job <id> <tube>`: a ready, delayed or buried job to another tube."""

    id: int
    tube: str


@command
class SearchJobs:
    """`search-jobs <tube> <state> <how> <after-id> <count> <bytes>` and the
    pattern as a body: ids of the tube's jobs in the state whose body (or
    key) matches, ascending, after `after` (core/search.py)."""

    tube: str
    state: str  # ready, delayed, reserved or buried
    how: str  # substr, regex or key
    after: int
    count: int
    pattern: bytes = b""


@command
class BulkJobs:
    """`bulk-jobs <tube> <state> <how> <action> <target> <max> <bytes>` and the
    pattern as a body: count, kick, delete or move (to `target`) up to `max`
    jobs a search matches."""

    tube: str
    state: str
    how: str
    action: str  # count, kick, delete or move
    target: str  # the tube a move goes to ("" for the others)
    max: int
    pattern: bytes = b""


@command
class ErrorReply:
    """Malformed input: answer `reply` and go on with the next command.

    `counted_as` names the command whose counter beanstalkd still bumps
    (a put whose body is too big counts as a put).
    """

    reply: bytes
    counted_as: type | None = None


Command = (
    Put | Reserve | ReserveJob | Delete | Release | Bury | Touch | Use | Watch | Ignore | Peek
    | PeekReady | PeekDelayed | PeekBuried | Kick | KickJob | StatsJob | StatsTube | Stats
    | ListTubes | ListTubeUsed | ListTubesWatched | PauseTube | Quit | Replicate | ReplicaAck
    | PromoteReplica | DeleteTube | ConfigDump | ReloadConfig | Auth | ListJobs | FlushTube
    | ExtStats | ExtStatsTube | PutUnique | ExplainJob | ReserveBatch
    | MoveJob | SearchJobs | BulkJobs | PutRest | PutHeard
)
Event = Command | ErrorReply

# Argument-less commands are immutable, so one instance each will do.
PEEK_READY, PEEK_DELAYED, PEEK_BURIED = PeekReady(), PeekDelayed(), PeekBuried()
STATS, LIST_TUBES, LIST_TUBE_USED, LIST_TUBES_WATCHED = (
    Stats(), ListTubes(), ListTubeUsed(), ListTubesWatched())
QUIT, RESERVE, PROMOTE = Quit(), Reserve(None), PromoteReplica()
PUT_HEARD, TOO_BIG_PUT_HEARD = PutHeard(True), PutHeard(False)
CONFIG, RELOAD_CONFIG, EXT_STATS = ConfigDump(), ReloadConfig(), ExtStats()


def render(cmd: Command) -> bytes:
    """A command as a client sends it (the inverse of parsing)."""
    t = type(cmd)
    if t is Put:
        if cmd.max_age:
            return b"put-expiring %d %d %d %d %d\r\n%s\r\n" % (
                cmd.pri, cmd.delay, cmd.ttr, cmd.max_age, len(cmd.body), cmd.body)
        return b"put %d %d %d %d\r\n%s\r\n" % (
            cmd.pri, cmd.delay, cmd.ttr, len(cmd.body), cmd.body)
    if t is PutUnique:
        return b"put-unique %s %d %d %d %d\r\n%s\r\n" % (
            cmd.key.encode(), cmd.pri, cmd.delay, cmd.ttr, len(cmd.body), cmd.body)
    if t is Reserve:
        if cmd.timeout is None:
            return b"reserve\r\n"
        return b"reserve-with-timeout %d\r\n" % cmd.timeout
    if t is Release:
        return b"release %d %d %d\r\n" % (cmd.id, cmd.pri, cmd.delay)
    if t is Bury:
        return b"bury %d %d\r\n" % (cmd.id, cmd.pri)
    if t is PauseTube:
        return b"pause-tube %s %d\r\n" % (cmd.tube.encode(), cmd.delay)
    if t is Kick:
        return b"kick %d\r\n" % cmd.bound
    if t is Replicate:
        return b"replicate %d %s %d\r\n" % (cmd.epoch, (cmd.history or "-").encode(), cmd.after)
    if t is ReplicaAck:
        return b"replica-ack %d\r\n" % cmd.seq
    if t is PromoteReplica:
        return b"promote\r\n"
    if t is ListJobs:
        return b"list-jobs %s %s %d %d\r\n" % (cmd.tube.encode(), cmd.state.encode(),
                                                cmd.after, cmd.count)
    if t is FlushTube:
        return b"flush-tube %s\r\n" % cmd.tube.encode()
    if t is DeleteTube:
        return b"delete-tube %s\r\n" % cmd.tube.encode()
    if t is ConfigDump:
        return b"config\r\n"
    if t is ReloadConfig:
        return b"reload-config\r\n"
    if t is Auth:
        return b"auth %s\r\n" % cmd.token.encode()
    if t is ExtStats:
        return b"ext-stats\r\n"
    if t is MoveJob:
        return b"move-job %d %s\r\n" % (cmd.id, cmd.tube.encode())
    if t is ReserveBatch:
        return b"reserve-batch %d %d\r\n" % (cmd.count, cmd.timeout)
    if t is ExtStatsTube:
        return b"ext-stats-tube %s\r\n" % cmd.tube.encode()
    if t is SearchJobs:
        return b"search-jobs %s %s %s %d %d %d\r\n%s\r\n" % (
            cmd.tube.encode(), cmd.state.encode(), cmd.how.encode(), cmd.after, cmd.count,
            len(cmd.pattern), cmd.pattern)
    if t is BulkJobs:
        return b"bulk-jobs %s %s %s %s %s %d %d\r\n%s\r\n" % (
            cmd.tube.encode(), cmd.state.encode(), cmd.how.encode(), cmd.action.encode(),
            (cmd.target or "-").encode(), cmd.max, len(cmd.pattern), cmd.pattern)
    name = _NAMES[t]
    if t in _ID_COMMANDS:
        return b"%s %d\r\n" % (name, cmd.id)
    if t in (Use, Watch, Ignore, StatsTube):
        return b"%s %s\r\n" % (name, cmd.tube.encode())
    return name + b"\r\n"


_NAMES = {
    ReserveJob: b"reserve-job", Delete: b"delete", Touch: b"touch", Peek: b"peek",
    KickJob: b"kick-job", StatsJob: b"stats-job", Use: b"use", Watch: b"watch",
    Ignore: b"ignore", StatsTube: b"stats-tube", PeekReady: b"peek-ready",
    PeekDelayed: b"peek-delayed", PeekBuried: b"peek-buried", Stats: b"stats",
    ListTubes: b"list-tubes", ListTubeUsed: b"list-tube-used",
    ListTubesWatched: b"list-tubes-watched", Quit: b"quit", ExplainJob: b"explain-job",
}
_ID_COMMANDS = (ReserveJob, Delete, Touch, Peek, KickJob, StatsJob, ExplainJob)
