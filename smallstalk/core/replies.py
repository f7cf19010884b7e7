"""Every reply the server sends, as bytes: named constants and the functions that render
the replies with arguments. No other module spells a reply (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Iterable

BAD_FORMAT = b"BAD_FORMAT\r\n"
UNKNOWN_COMMAND = b"UNKNOWN_COMMAND\r\n"
EXPECTED_CRLF = b"EXPECTED_CRLF\r\n"
JOB_TOO_BIG = b"JOB_TOO_BIG\r\n"
OUT_OF_MEMORY = b"OUT_OF_MEMORY\r\n"
INTERNAL_ERROR = b"INTERNAL_ERROR\r\n"
DRAINING = b"DRAINING\r\n"
NOT_FOUND = b"NOT_FOUND\r\n"
DELETED = b"DELETED\r\n"
RELEASED = b"RELEASED\r\n"
BURIED = b"BURIED\r\n"
KICKED = b"KICKED\r\n"
TOUCHED = b"TOUCHED\r\n"
PAUSED = b"PAUSED\r\n"
NOT_IGNORED = b"NOT_IGNORED\r\n"
TIMED_OUT = b"TIMED_OUT\r\n"
DEADLINE_SOON = b"DEADLINE_SOON\r\n"
# smallstalk's own replies
READ_ONLY = b"READ_ONLY\r\n"  # a replica refuses changes
NOT_REPLICATED = b"NOT_REPLICATED\r\n"  # --min-replica-acks: no replica confirmed in time
NOT_A_REPLICA = b"NOT_A_REPLICA\r\n"  # promote, sent to a server that is not a replica
RELOADED = b"RELOADED\r\n"
OK = b"OK\r\n"  # auth: the token is right
UNAUTHORIZED = b"UNAUTHORIZED\r\n"  # auth: a wrong token; an admin command without one

# The first word of replies that carry more, for the code that reads them
# (a replica reading its feed's answer, the operator commands).
RESERVED_WORD = b"RESERVED"
FOUND_WORD = b"FOUND"
OK_WORD = b"OK"
PROMOTED_WORD = b"PROMOTED"
REPLICATING_WORD = b"REPLICATING"
FULLRESYNC_WORD = b"FULLRESYNC"
UNAUTHORIZED_WORD = b"UNAUTHORIZED"


def inserted(job_id: int) -> bytes:
    return b"INSERTED %d\r\n" % job_id


def duplicate(job_id: int) -> bytes:
    """`put-unique`'s answer when its key already made job `job_id` (nothing changed)."""
    return b"DUPLICATE %d\r\n" % job_id


def buried_id(job_id: int) -> bytes:
    return b"BURIED %d\r\n" % job_id


def job_reply(word: bytes, job_id: int, body: bytes) -> bytes:
    """RESERVED or FOUND: a line and the body."""
    return b"%s %d %d\r\n%s\r\n" % (word, job_id, len(body), body)


def moved(tube: str) -> bytes:
    """`move-job`'s success: `MOVED <tube>`."""
    return b"MOVED %s\r\n" % tube.encode()


def reserved_batch(jobs: list[tuple[int, bytes]]) -> bytes:
    """`RESERVED_BATCH <n>` and n RESERVED replies (reserve-batch; n >= 1)."""
    return b"RESERVED_BATCH %d\r\n" % len(jobs) + b"".join(reserved(i, b) for i, b in jobs)


def reserved(job_id: int, body: bytes) -> bytes:
    return b"RESERVED %d %d\r\n%s\r\n" % (job_id, len(body), body)  # job_reply's, one call


def found(job_id: int, body: bytes) -> bytes:
    return job_reply(FOUND_WORD, job_id, body)


def kicked(count: int) -> bytes:
    return b"KICKED %d\r\n" % count


def using(tube: str) -> bytes:
    return b"USING %s\r\n" % tube.encode()


def watching(count: int) -> bytes:
    return b"WATCHING %d\r\n" % count


def ok_yaml(body: bytes) -> bytes:
    return b"%s %d\r\n%s\r\n" % (OK_WORD, len(body), body)


def yaml_list(names: Iterable[str]) -> bytes:
    return ok_yaml(b"---\n" + b"".join(b"- %s\n" % n.encode() for n in names))


def yaml_dict(pairs: Iterable[tuple[str, object]]) -> bytes:
    """beanstalkd's stats YAML: strings quoted, numbers and flags bare.

    Values that are already `bytes` are written as they are (for the few keys
    beanstalkd prints bare although they are words, like `state: ready`).
    """
    out = [b"---\n"]
    for key, value in pairs:
        if isinstance(value, bytes):
            text = value
        elif isinstance(value, str):
            text = b'"%s"' % value.encode()
        elif isinstance(value, bool):
            text = b"true" if value else b"false"
        else:
            text = str(value).encode()
        out.append(b"%s: %s\n" % (key.encode(), text))
    return ok_yaml(b"".join(out))


# smallstalk's own replies with arguments.


def flushed(count: int) -> bytes:
    return b"FLUSHED %d\r\n" % count


def promoted(epoch: int) -> bytes:
    return b"%s %d\r\n" % (PROMOTED_WORD, epoch)


def not_reloaded(why: str) -> bytes:
    """`reload-config` failed: the reason on one line."""
    return b"NOT_RELOADED %s\r\n" % " ".join(why.split()).encode("utf-8", "replace")


def not_admin_address(peer: str) -> bytes:
    """An admin command from a peer that --admin-allow does not name, on a
    server without a token: the first word stays UNAUTHORIZED, the rest says what to do."""
    return (b"%s admin commands from %s need a token: start the server with "
            b"--admin-token-file FILE and send auth first, or add the address to "
            b"--admin-allow\r\n" % (UNAUTHORIZED_WORD, peer.encode("ascii", "replace")))


def counted(n: int) -> bytes:
    """`bulk-jobs ... count`: how many jobs match (up to its max)."""
    return b"COUNTED %d\r\n" % n


def acted(n: int) -> bytes:
    """`bulk-jobs` kick, delete or move: how many jobs it changed."""
    return b"ACTED %d\r\n" % n


def bad_search(why: str) -> bytes:
    """A search-jobs or bulk-jobs that cannot run, and why, on one line."""
    return b"BAD_SEARCH %s\r\n" % " ".join(why.split()).encode("utf-8", "replace")


def refused(why: bytes) -> bytes:
    """A `replicate` this server will not serve, and why."""
    return b"REFUSED %s\r\n" % why


def replicating(epoch: int, history: str) -> bytes:
    """The feed goes on from the replica's position."""
    return b"%s %d %s\r\n" % (REPLICATING_WORD, epoch, history.encode())


def fullresync(epoch: int, history: str, snap_seq: int) -> bytes:
    """The feed starts with the snapshot at `snap_seq`."""
    return b"%s %d %s %d\r\n" % (FULLRESYNC_WORD, epoch, history.encode(), snap_seq)
