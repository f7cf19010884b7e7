"""INSERTED and RESERVED as the server sends them: replies.py's formatting
(the reference) and, in the compiled build, jobreply.pyx's writer, which
server/dispatch.py calls instead; both give the same bytes for every id and
body length, the edges of each digit count and of the 64-bit range too."""

from __future__ import annotations

import pytest

from smallstalk.core import replies
from smallstalk.core.state import BUILD
from smallstalk.server import dispatch

try:
    from smallstalk.core import jobreply
except ImportError:  # the pure build has no twin (test_build checks which build runs)
    jobreply = None

WRITERS = [replies] + ([jobreply] if jobreply is not None else [])
IDS = [1, 9, 10, 99, 100, 12345, 10**9, 2**32 - 1, 2**32, 10**19 - 1, 10**19, 2**64 - 1]
BODIES = [b"", b"x", b"\r\n", b"a\r\nb" * 3, bytes(range(256)) * 40, b"z" * 99_999]


def test_the_compiled_build_and_only_it_writes_these_in_c() -> None:
    assert (jobreply is not None) is (BUILD == "compiled") is dispatch.FAST_REPLY


@pytest.mark.parametrize("w", WRITERS, ids=lambda w: w.__name__.rsplit(".", 1)[-1])
def test_inserted_and_reserved_bytes(w) -> None:
    for i in IDS:
        assert w.inserted(i) == f"INSERTED {i}\r\n".encode()
        for body in BODIES:
            assert w.reserved(i, body) == f"RESERVED {i} {len(body)}\r\n".encode() + body + b"\r\n"


def test_the_writer_refuses_what_it_cannot_write() -> None:
    if jobreply is None:
        assert not dispatch.FAST_REPLY
        return
    with pytest.raises(OverflowError):
        jobreply.inserted(2**64)
    with pytest.raises(OverflowError):
        jobreply.inserted(-1)
    with pytest.raises(TypeError):
        jobreply.reserved(1, None)
    with pytest.raises(TypeError):
        jobreply.reserved(1, bytearray(b"x"))
