"""smallstalk.client without a server: replies read and interpreted, addresses, argument checks.
"""

from __future__ import annotations

import pytest

from smallstalk.client import (
    BadFormat,
    Buried,
    Client,
    Draining,
    InternalError,
    JobRef,
    JobStats,
    JobTooBig,
    NotFound,
    OutOfMemory,
    ProtocolError,
    Reply,
    ReplyReader,
    UnknownCommand,
    interpret,
    normalize_address,
    resolve_servers,
)
from smallstalk.core import protocol as p


def test_reply_reader_byte_at_a_time() -> None:
    stream = (b"INSERTED 7\r\nRESERVED 7 5\r\nhe\r\no\r\nOK 12\r\n---\n- a\n- b\n\r\n"
              b"TIMED_OUT\r\nFOUND 1 0\r\n\r\nUSING foo\r\n")
    reader = ReplyReader()
    replies = []
    for i in range(len(stream)):
        reader.feed(stream[i:i + 1])
        while (r := reader.next_reply()) is not None:
            replies.append(r)
    assert replies == [
        Reply(b"INSERTED", (b"7",)), Reply(b"RESERVED", (b"7", b"5"), b"he\r\no"),
        Reply(b"OK", (b"12",), b"---\n- a\n- b\n"), Reply(b"TIMED_OUT", ()),
        Reply(b"FOUND", (b"1", b"0"), b""), Reply(b"USING", (b"foo",)),
    ]
    assert reader.buffered() == 0


@pytest.mark.parametrize("data", [
    b"X" * 2000,                      # no line end within the limit
    b"RESERVED 1 3\r\nabcXY",         # body not followed by CRLF
    b"RESERVED 1\r\n",                # size missing
    b"OK x\r\n",                      # size not a number
    b"OK 2000000000\r\n",             # larger than any job
])
def test_reply_reader_rejects(data: bytes) -> None:
    reader = ReplyReader()
    reader.feed(data)
    with pytest.raises(ProtocolError):
        while reader.next_reply() is not None:
            pass


@pytest.mark.parametrize(("word", "exc"), [
    (b"OUT_OF_MEMORY", OutOfMemory), (b"INTERNAL_ERROR", InternalError),
    (b"BAD_FORMAT", BadFormat), (b"UNKNOWN_COMMAND", UnknownCommand),
    (b"NOT_FOUND", NotFound), (b"DRAINING", Draining), (b"JOB_TOO_BIG", JobTooBig),
])
def test_interpret_error_replies(word: bytes, exc: type) -> None:
    with pytest.raises(exc) as info:
        interpret(p.Delete(1), Reply(word, ()), "h:1")
    assert info.value.server == "h:1"


def test_interpret_results_and_buried() -> None:
    assert interpret(p.Put(0, 0, 1, b"x"), Reply(b"INSERTED", (b"9",)), "s:1") == JobRef(9, "s:1")
    assert interpret(p.Kick(5), Reply(b"KICKED", (b"3",))) == 3
    assert interpret(p.KickJob(5), Reply(b"KICKED", ())) is None
    with pytest.raises(Buried) as info:
        interpret(p.Put(0, 0, 1, b"x"), Reply(b"BURIED", (b"12",)))
    assert info.value.job_id == 12
    with pytest.raises(Buried) as info:
        interpret(p.Release(4, 0, 0), Reply(b"BURIED", ()))
    assert info.value.job_id == 4
    with pytest.raises(ProtocolError):
        interpret(p.Delete(1), Reply(b"INSERTED", (b"1",)))
    stats = interpret(p.StatsJob(1), Reply(b"OK", (b"0",), b"---\nid: 1\nstate: ready\nnew: x\n"))
    assert stats == JobStats(id=1, state="ready", extra={"new": "x"})


def test_addresses(monkeypatch) -> None:
    assert normalize_address("localhost") == "localhost:11300"
    assert normalize_address("[::1]:5") == "[::1]:5"
    assert normalize_address("unix:/tmp/s") == "unix:/tmp/s"
    monkeypatch.setenv("SMALLSTALK_SERVERS", "a:1, b")
    assert resolve_servers(None) == ["a:1", "b:11300"]
    monkeypatch.delenv("SMALLSTALK_SERVERS")
    assert resolve_servers(None) == ["127.0.0.1:11300"]
    with pytest.raises(ValueError):
        resolve_servers(["a:1", "a:1"])


def test_arguments_are_checked_before_sending() -> None:
    c = Client("127.0.0.1:1")  # never connects: every call fails before I/O
    with pytest.raises(ValueError):
        c.use("bad tube\r\nput 0 0 1 1")  # no command injection through tube names
    with pytest.raises(ValueError):
        c.put(b"x", priority=-1)
    with pytest.raises(TypeError):
        c.put(1234)  # type: ignore[arg-type]
