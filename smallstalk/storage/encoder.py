# cython: annotation_typing=False
# (For the compiled build, tools/compile.py: a wrong body is cbor2's error to
# raise, as in the pure module, not an argument check's.)
"""The live path's record encoder: the everyday records (a put, a reserve or
delete, a keyed put) encoded straight from their fields, into one reused
buffer, with the same bytes as `records.encode` of the record."""

from __future__ import annotations

import io

import cbor2

from smallstalk.core import records as r


class LiveEncoder:
    """Encodes the live path's everyday records (a put, a reserve or delete,
    a keyed put) without making them: the same bytes as `encode` of the
    record. It keeps one cbor2 encoder and its buffer: `cbor2.dumps` makes
    both on every call, a third of what encoding a small record costs. Not
    shared between threads: each owner (the loop, the group commit) has its
    own."""

    def __init__(self) -> None:
        self._buf = buf = io.BytesIO()
        self._enc = cbor2.CBOREncoder(buf)

    def put(self, seq: int, time: int, conn: int, id: int, tube: str, pri: int, delay: int,
            ttr: int, body: bytes) -> bytes:
        """`records.encode(Put(...))`."""
        buf = self._buf
        buf.seek(0)
        buf.truncate()  # before, not after: a failed encode leaves bytes behind
        self._enc.encode([r.Put.CODE, seq, time, conn, id, tube, pri, delay, ttr, body])
        return buf.getvalue()

    def job(self, cls: type, seq: int, time: int, conn: int, id: int) -> bytes:
        """`records.encode(cls(seq, time, conn, id))` of a Reserve or a Delete."""
        buf = self._buf
        buf.seek(0)
        buf.truncate()
        self._enc.encode([cls.CODE, seq, time, conn, id])
        return buf.getvalue()

    def put_unique(self, seq: int, time: int, conn: int, tube: str, key: str,
                   unique_for: int, keys_max: int, id: int, pri: int, delay: int, ttr: int,
                   body: bytes) -> bytes:
        """`records.encode(PutUnique(...))` of the everyday keyed put: one job, in the
        tube put into, nothing dropped, no expiry (the record's compact form)."""
        buf = self._buf
        buf.seek(0)
        buf.truncate()
        self._enc.encode([r.PUT_UNIQUE_ONE, seq, time, conn, tube, key, unique_for, keys_max,
                          id, pri, delay, ttr, body])
        return buf.getvalue()
