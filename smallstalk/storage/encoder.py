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

try:  # the compiled build's writer of these records (fixedcbor.pyx)
    from smallstalk.storage import fixedcbor
    FIXED = True
except ImportError:  # the pure build: cbor2 alone
    FIXED = False

PUT, PUT_UNIQUE_ONE = r.Put.CODE, r.PUT_UNIQUE_ONE  # (compiled, a module's attribute is a lookup)
RESERVE, DELETE = r.Reserve, r.Delete
RESERVE_CODE, DELETE_CODE = r.Reserve.CODE, r.Delete.CODE


class LiveEncoder:
    """Encodes the live path's everyday records (a put, a reserve or delete,
    a keyed put) without making them: the same bytes as `encode` of the
    record. It keeps one cbor2 encoder and its buffer: `cbor2.dumps` makes
    both on every call, a third of what encoding a small record costs. In
    the compiled build `fixedcbor` writes what it can, for a sixth of
    cbor2's cost, and cbor2 the rest. Not shared between threads: each owner (the
    loop, the group commit) has its own."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._enc = cbor2.CBOREncoder(self._buf)

    def put(self, seq: int, time: int, conn: int, id: int, tube: str, pri: int, delay: int,
            ttr: int, body: bytes) -> bytes:
        """`records.encode(Put(...))`."""
        if FIXED:
            out = fixedcbor.put(PUT, seq, time, conn, id, tube, pri, delay, ttr, body)
            if out is not None:
                return out
        buf = self._buf
        buf.seek(0)
        buf.truncate()  # before, not after: a failed encode leaves bytes behind
        self._enc.encode([PUT, seq, time, conn, id, tube, pri, delay, ttr, body])
        return buf.getvalue()

    def job(self, cls: type, seq: int, time: int, conn: int, id: int) -> bytes:
        """`records.encode(cls(seq, time, conn, id))` of a Reserve or a Delete."""
        if FIXED:  # the code by identity: compiled, a class attribute is a lookup
            code = RESERVE_CODE if cls is RESERVE else DELETE_CODE if cls is DELETE else cls.CODE
            out = fixedcbor.job(code, seq, time, conn, id)
            if out is not None:
                return out
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
        if FIXED:
            out = fixedcbor.put_unique(PUT_UNIQUE_ONE, seq, time, conn, tube, key,
                                       unique_for, keys_max, id, pri, delay, ttr, body)
            if out is not None:
                return out
        buf = self._buf
        buf.seek(0)
        buf.truncate()
        self._enc.encode([PUT_UNIQUE_ONE, seq, time, conn, tube, key, unique_for, keys_max,
                          id, pri, delay, ttr, body])
        return buf.getvalue()
