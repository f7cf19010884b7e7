"""The exceptions of the client library: one class per error reply (see docs/CLIENT.md)."""

from __future__ import annotations

from smallstalk.core import protocol as p


def word_of(reply: bytes) -> bytes:
    """A reply's first word, from the protocol module's rendering of it."""
    return reply.split(b" ", 1)[0].rstrip(b"\r\n")


class BeanstalkError(Exception):
    """Base of everything this module raises about the server or the connection."""


class ConnectionFailed(BeanstalkError, ConnectionError):
    """Could not connect, or the connection broke; the next call reconnects."""

    def __init__(self, server: str, reason: str) -> None:
        super().__init__(f"{server}: {reason}")
        self.server = server


class NotConnected(ConnectionFailed):
    """Could not connect at all: nothing was sent (a put is safe to try elsewhere)."""


class ReadTimeout(ConnectionFailed, TimeoutError):
    """No reply within the read timeout; the connection was dropped."""


class ProtocolError(BeanstalkError):
    """The server sent something that is not a beanstalkd reply to the command."""


class CommandError(BeanstalkError):
    """The server answered a command with an error reply (`reply` is its first word)."""

    reply = b""

    def __init__(self, server: str = "", detail: str = "", said: str = "") -> None:
        text = self.reply.decode()
        super().__init__(f"{text} from {server}{': ' + detail if detail else ''}"
                         if server else text)
        self.server = server
        self.said = said  # the rest of the reply line, as the server wrote it

    def reply_line(self) -> str:
        """The error reply as the server sent it (without CRLF)."""
        return f"{self.reply.decode()} {self.said}" if self.said else self.reply.decode()


class OutOfMemory(CommandError):
    reply = word_of(p.OUT_OF_MEMORY)


class InternalError(CommandError):
    reply = word_of(p.INTERNAL_ERROR)


class BadFormat(CommandError):
    reply = word_of(p.BAD_FORMAT)


class UnknownCommand(CommandError):
    reply = word_of(p.UNKNOWN_COMMAND)


class ExpectedCRLF(CommandError):
    reply = word_of(p.EXPECTED_CRLF)


class JobTooBig(CommandError):
    reply = word_of(p.JOB_TOO_BIG)


class Draining(CommandError):
    reply = word_of(p.DRAINING)


class NotFound(CommandError):
    reply = word_of(p.NOT_FOUND)


class NotIgnored(CommandError):
    reply = word_of(p.NOT_IGNORED)


class TimedOut(CommandError):
    """`reserve` with a timeout found no job in time."""

    reply = word_of(p.TIMED_OUT)


class DeadlineSoon(CommandError):
    """`reserve` while a job this connection holds is in the last second of its TTR."""

    reply = word_of(p.DEADLINE_SOON)


class Buried(CommandError):
    """The server buried the job instead (out of memory): after `put` or `release`."""

    reply = word_of(p.BURIED)

    def __init__(self, server: str = "", detail: str = "", job_id: int | None = None) -> None:
        super().__init__(server, detail, str(job_id) if job_id is not None else "")
        self.job_id = job_id


class Unauthorized(CommandError):
    """The server refused the token sent with `auth` (smallstalk's admin tokens)."""

    reply = word_of(p.UNAUTHORIZED)

    def __init__(self, server: str = "", detail: str = "the server refused the token",
                 said: str = "") -> None:
        super().__init__(server, detail, said)


class NotAReplica(CommandError):
    """`promote` sent to a server that is not a replica."""

    reply = word_of(p.NOT_A_REPLICA)


class NotReloaded(CommandError):
    """`reload-config` failed (the reason is the text); the old settings stay in force."""

    reply = word_of(p.not_reloaded("x"))


class ReadOnly(CommandError):
    """A replica refuses changes (a failover may be under way), or an HA member
    that does not hold the leader lock: with several addresses of one cluster,
    the client tries the next (the primary takes them)."""

    reply = word_of(p.READ_ONLY)


class NotReplicated(CommandError):
    """--min-replica-acks: stored on the primary, but no replica confirmed it in time."""

    reply = word_of(p.NOT_REPLICATED)


class BadSearch(CommandError):
    """`search-jobs` or `bulk-jobs` cannot run (the text says why: a bad
    pattern, a state the action does not take, too many searches running)."""

    reply = word_of(p.bad_search("x"))


ERRORS: dict[bytes, type[CommandError]] = {
    cls.reply: cls
    for cls in (OutOfMemory, InternalError, BadFormat, UnknownCommand, ExpectedCRLF, JobTooBig,
                Draining, NotFound, NotIgnored, TimedOut, DeadlineSoon, Buried, Unauthorized,
                NotAReplica, NotReloaded, ReadOnly, NotReplicated, BadSearch)
}

