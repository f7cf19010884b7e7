"""The compiled build's small C twins against their pure references.

INSERTED and RESERVED as the server sends them: replies.py's formatting and
jobreply.pyx's writer, which server/dispatch.py calls instead, give the same
bytes for every id and body length (the edges of each digit count and of
the 64-bit range too). A keyed put's key: keyscan.pyx's scan ends where
parser.py's regex match does."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from smallstalk.core import parser, replies
from smallstalk.core.state import BUILD
from smallstalk.server import dispatch

try:
    from smallstalk.core import jobreply, keyscan
except ImportError:  # the pure build has no twins (test_build checks which build runs)
    jobreply = keyscan = None

WRITERS = [replies] + ([jobreply] if jobreply is not None else [])
IDS = [1, 9, 10, 99, 100, 12345, 10**9, 2**32 - 1, 2**32, 10**19 - 1, 10**19, 2**64 - 1]
BODIES = [b"", b"x", b"\r\n", b"a\r\nb" * 3, bytes(range(256)) * 40, b"z" * 99_999]


def test_the_compiled_build_and_only_it_writes_these_in_c() -> None:
    assert (jobreply is not None) is (BUILD == "compiled") is dispatch.FAST_REPLY
    assert (keyscan is not None) is (BUILD == "compiled") is parser._KEY_SCAN


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


def _regex_end(data: bytes) -> int:
    m = parser._PUT_UNIQUE_KEY.match(data)
    return m.end() if m is not None else 11


@given(st.binary(max_size=260) | st.text(
    "-+/;.$_()azAZ09 \r\n\x00\x80", max_size=260).map(lambda t: t.encode("latin-1")))
@example(b"k" * 199)
@example(b"k" * 200 + b" 0")
@example(b"k" * 201 + b" 0")
@example(b"\xff" + b"k")
def test_the_key_scan_ends_where_the_regex_does(tail: bytes) -> None:
    data = b"put-unique " + tail
    if keyscan is None:
        assert not parser._KEY_SCAN
        return
    assert keyscan.key_end(data, 11) == _regex_end(data)
