"""The on-disk format's document against the code: snapshots/README.md's
constants, layouts, record, item and state tables must say what the code
does (tests/support/formatdoc.py reads the document). These checks fail when
the README's tables and the code drift apart; tests/unit/test_fixtures.py
reads the fixtures by the same tables."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import attrs
import pytest

from smallstalk.core import records
from smallstalk.core import state as st
from smallstalk.core.model import NS, STATE_NAMES
from smallstalk.storage import aof, recovery, snapshot_codec

from ..support.formatdoc import (
    COMPACT_ROWS,
    CONSTANTS,
    CURRENT,
    DOC_ADDED,
    DOC_ITEM_ORDER,
    DOC_ITEMS,
    DOC_RECORDS,
    DOC_STATES,
    DOC_VOLATILE,
    FILE_HEADER,
    FRAME_HEADER,
    README,
    SNAPSHOTS,
    as_doc_item,
    check_item_order,
    copy_data_dir,
    doc_fields,
    doc_magic,
    item_kinds,
    read_segment_doc,
)

# --- the document against the code ----------------------------------------------------

ANNOTATIONS = {  # attrs annotation -> README types it may be documented as
    "int": {"uint", "int"},
    "str": {"text"},
    "bytes": {"bytes"},
    "tuple[int, ...]": {"uint[]"},
    "int | None": {"uint|null", "int|null"},
    "tuple[tuple[int, str], ...]": {"(uint,text)[]"},
    "tuple[tuple[int, str, int], ...]": {"(uint,text,int)[]"},
    "tuple[tuple[int, int, str, str], ...]": {"(uint,int,text,text)[]"},
}
UNITS = {"time": "ns", "deadline": "ns", "delay": "s", "ttr": "s", "expires": "ns",
         "unique_for": "s", "period": "ns", "at": "ns"}


def check_fields(cls: type, documented: list[tuple[str, str, str | None]]) -> None:
    actual = attrs.fields(cls)
    assert [f.name for f in actual] == [name for name, _, _ in documented], cls.__name__
    for f, (name, typ, unit) in zip(actual, documented, strict=True):
        assert typ in ANNOTATIONS[str(f.type)], f"{cls.__name__}.{name}: {typ} vs {f.type}"
        assert unit == UNITS.get(name), f"{cls.__name__}.{name}: unit {unit}"


def test_constants_match_the_code() -> None:
    assert int(CONSTANTS["FORMAT_VERSION"]) == records.FORMAT_VERSION
    assert doc_magic("SEGMENT_MAGIC") == aof.SEGMENT_MAGIC
    assert doc_magic("SNAPSHOT_MAGIC") == aof.SNAPSHOT_MAGIC
    for name in ("SEGMENT_MAGIC", "SNAPSHOT_MAGIC"):
        shown = re.search(r"`(.*?)`", CONSTANTS[name])[1].replace("\\0", "\0").encode()
        assert shown == doc_magic(name)
    assert int(CONSTANTS["HEADER_SIZE"]) == aof.HEADER_SIZE == FILE_HEADER.size
    assert int(CONSTANTS["FRAME_HEADER_SIZE"]) == aof.FRAME.size == FRAME_HEADER.size
    assert int(CONSTANTS["MAX_FRAME"]) == aof.MAX_FRAME
    assert int(CONSTANTS["PREALLOCATE"].split()[0]) == aof.PREALLOCATE
    assert zlib.crc32(b"123456789") == int(CONSTANTS["CRC_CHECK"], 16)


def test_header_and_frame_layouts_match_the_code() -> None:
    head = aof.header(aof.SEGMENT_MAGIC, 12345)
    assert FILE_HEADER.unpack(head) == (
        aof.SEGMENT_MAGIC, records.FORMAT_VERSION, 12345, zlib.crc32(head[:20]))
    payload = b"\x82\x01\x02"
    framed = aof.frame(payload)
    assert FRAME_HEADER.unpack_from(framed) == (len(payload), zlib.crc32(payload))
    assert framed[FRAME_HEADER.size:] == payload


def test_record_table_matches_the_code() -> None:
    assert sorted(DOC_RECORDS) == sorted(records.BY_CODE)
    for code, (op, name, fields) in DOC_RECORDS.items():
        cls = records.BY_CODE[code]
        assert cls.__name__ == name and cls.CODE == code and cls.LOGGED is True
        assert records.OP_NAMES[cls] == op
        assert records.FIELDS[cls] == tuple(f for f, _, _ in fields)
        check_fields(cls, fields)


def test_compact_forms_match_the_code() -> None:
    """Each compact form: its code is no record type's, its documented fields are
    the code's, it decodes to the named record, and `encode` writes that record
    in it (and a record that does not fit it in the record's own code)."""
    assert [int(row[0]) for row in COMPACT_ROWS] == [records.PUT_UNIQUE_ONE]
    code, name, cell = COMPACT_ROWS[0]
    fields = doc_fields(cell)
    assert int(code) not in records.BY_CODE and name.strip("`") == "PutUnique"
    assert tuple(f for f, _, _ in fields) == records.PUT_UNIQUE_ONE_FIELDS
    doc = {f: (typ, unit) for f, typ, unit in DOC_RECORDS[records.PutUnique.CODE][2]}
    doc["id"] = ("uint", None)
    assert all(doc[f] == (typ, unit) for f, typ, unit in fields)
    now = 1_795_939_912 * NS
    values = dict(seq=7, time=now, conn=3, tube="orders", key="k-1", unique_for=3600,
                  keys_max=100, id=42, pri=1024, delay=0, ttr=60, body=b"payload")
    rec = records.from_list([int(code), *(values[f] for f, _, _ in fields)])
    assert rec == records.PutUnique(7, now, 3, "orders", "k-1", 3600, 100, ((42, "orders"),),
                                    1024, 0, 60, 0, (), b"payload")
    payload = records.encode(rec)
    assert records.decode_list(payload)[0] == int(code) and records.decode(payload) == rec
    assert payload.endswith(b"payload")  # the body stays last: its bytes end the frame
    for other in (attrs.evolve(rec, expires=now + 1), attrs.evolve(rec, dropped=(1,)),
                  attrs.evolve(rec, jobs=((42, "orders"), (43, "orders+audit"))),
                  attrs.evolve(rec, jobs=((42, "elsewhere"),))):
        payload = records.encode(other)
        assert records.decode_list(payload)[0] == records.PutUnique.CODE
        assert records.decode(payload) == other
    for bad in ([int(code), *list(values.values())[:-1]], [float(code), *values.values()]):
        with pytest.raises(records.DecodeError):
            records.from_list(bad)


def test_volatile_table_matches_the_code() -> None:
    volatile = {
        name: obj for name, obj in vars(records).items()
        if attrs.has(obj) and getattr(obj, "LOGGED", None) is False
    }
    assert sorted(volatile) == sorted(DOC_VOLATILE)
    for name, cls in volatile.items():
        assert not hasattr(cls, "CODE") and cls not in records.FIELDS
        check_fields(cls, DOC_VOLATILE[name])


def test_job_state_table_matches_the_code() -> None:
    assert DOC_STATES == {st.READY: "ready", st.DELAYED: "delayed", st.RESERVED: "reserved",
                          st.BURIED: "buried"}
    assert list(STATE_NAMES) == [DOC_STATES[i] for i in range(4)]


def test_item_versions_table() -> None:
    """Fields a later format added are appended to their item; a new kind is added whole."""
    for (kind, _name), version in DOC_ADDED.items():
        assert kind in DOC_ITEMS and 2 <= version <= records.FORMAT_VERSION
    for kind, fields in DOC_ITEMS.items():
        added = [DOC_ADDED.get((kind, name), 1) for name, _t, _u in fields]
        assert added == sorted(added), f"{kind}: fields of later formats must come last"
    assert item_kinds(records.FORMAT_VERSION) == set(DOC_ITEMS)
    assert {"meta", "tube", "conn", "job", "end"} <= item_kinds(1)


def test_snapshot_item_table_matches_state_dump(tmp_path: Path) -> None:
    """State.dump of the current fixture's state has exactly the README's items."""
    data = copy_data_dir(CURRENT / "log-only", tmp_path)
    items = list(snapshot_codec.dump(recovery.recover(data, repair=False).state))
    kinds = [as_doc_item(item)["kind"] for item in items]
    # dump() has a `job` item per job; the snapshot writer makes `jobs` items of them
    assert set(kinds) | {"end", "jobs"} == set(DOC_ITEMS)
    assert kinds[0] == "meta"
    assert sorted(DOC_ITEM_ORDER) == sorted(DOC_ITEMS) and DOC_ITEM_ORDER[-1] == "end"
    check_item_order(kinds)


def test_worked_example_is_the_fixture() -> None:
    text = README.read_text()
    m = re.search(r"`(v\d+/[^`]+\.aof)`, byte for byte:\s*```hex\n(.*?)```", text, re.S)
    assert m, "README worked example not found"
    hexdump = "".join(line.split("#")[0] for line in m[2].splitlines())
    data = bytes.fromhex(hexdump)
    assert data == (SNAPSHOTS / m[1]).read_bytes()
    first, recs = read_segment_doc(SNAPSHOTS / m[1])
    assert recs[0]["op"] == "put" and recs[0]["seq"] == first


