"""The on-disk format: snapshots/README.md against the code, and every snapshots/v*/ fixture.

Two readers look at the fixtures: smallstalk's own (`recovery.recover`), and a
second one in this file built from the README's tables with struct, zlib and
cbor2 only. Both must agree with expected.json, which the fixture script wrote
from what its session did. The document checks fail when the README's tables
and the code drift apart.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import attrs
import cbor2
import pytest

from smallstalk.core import records
from smallstalk.core import state as st
from smallstalk.core.model import NS, STATE_NAMES
from smallstalk.storage import aof, compactor, recovery, snapshot_codec

from ..support.procs import REPO

SNAPSHOTS = REPO / "snapshots"
README = SNAPSHOTS / "README.md"
DATA_DIRS = ("log-only", "snapshot-and-segments", "compacted")
VERSION_DIRS = sorted(
    (p for p in SNAPSHOTS.glob("v*") if p.is_dir() and p.name[1:].isdigit()),
    key=lambda p: int(p.name[1:]),
)

# --- reading the document ---------------------------------------------------------


def _cells(line: str) -> list[str]:
    parts = re.split(r"(?<!\\)\|", line.strip()[1:-1])
    return [p.strip().replace("\\|", "|") for p in parts]


def doc_tables() -> dict[tuple[str, ...], list[list[str]]]:
    """Every markdown table of the README, keyed by its header cells."""
    lines = README.read_text().splitlines()
    out: dict[tuple[str, ...], list[list[str]]] = {}
    i = 0
    while i < len(lines):
        if (lines[i].startswith("|") and i + 1 < len(lines)
                and re.fullmatch(r"\|[-:| ]+\|", lines[i + 1].strip())):
            head = tuple(_cells(lines[i]))
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            assert head not in out, f"two README tables with the header {head}"
            out[head] = rows
        else:
            i += 1
    return out


TABLES = doc_tables()
FIELD = re.compile(r"`(\w+)`: ([a-z\[\]|(),]+)(?: \((ns|s)\))?")


def doc_fields(cell: str) -> list[tuple[str, str, str | None]]:
    """`name`: type (unit), ... -> [(name, type, unit)]; the whole cell must parse."""
    out = []
    for part in cell.split(", "):
        m = FIELD.fullmatch(part)
        assert m, f"README field not understood: {part!r}"
        out.append((m[1], m[2], m[3]))
    return out


def table(*head: str) -> list[list[str]]:
    assert head in TABLES, f"README has no table with the header {head}"
    return TABLES[head]


CONSTANTS = {row[0].strip("`"): row[1] for row in table("constant", "value")}
RECORD_ROWS = table("code", "op", "class", "fields")
DOC_RECORDS = {  # code -> (op, class name, [(field, type, unit)])
    int(code): (op, cls.strip("`"), doc_fields(fields)) for code, op, cls, fields in RECORD_ROWS
}
COMPACT_ROWS = table("code", "form of", "fields")  # a record's compact forms
DOC_COMPACT = {int(code): doc_fields(cell) for code, _form, cell in COMPACT_ROWS}
DOC_VOLATILE = {
    row[0].strip("`"): doc_fields(row[1]) for row in table("class", "fields", "meaning")
}
DOC_ITEMS = {row[0].strip("`"): doc_fields(row[1]) for row in table("kind", "fields", "meaning")}
# (kind, field) -> the format version that added it (absent: there from format 1)
DOC_ADDED = {
    (row[1].strip("`"), name): int(row[0])
    for row in table("version", "kind", "fields added") for name, _typ, _unit in doc_fields(row[2])
}


def item_fields(kind: str, version: int) -> list[tuple[str, str, str | None]]:
    """The fields a snapshot item of `kind` has in format `version` (README tables)."""
    return [f for f in DOC_ITEMS[kind] if DOC_ADDED.get((kind, f[0]), 1) <= version]


def item_kinds(version: int) -> set[str]:
    return {kind for kind in DOC_ITEMS if item_fields(kind, version) or kind == "end"}
DOC_STATES = {int(n): name for n, name in table("state", "name")}


def doc_item_order() -> list[str]:
    """The item kinds in the order the README's **Order.** paragraph names them."""
    m = re.search(r"^\*\*Order\.\*\* (.*?)\n\n", README.read_text(), re.S | re.M)
    assert m, "README has no **Order.** paragraph"
    kinds: list[str] = []
    for word in re.findall(r"`(\w+)`", m[1]):
        if word in DOC_ITEMS and word not in kinds:
            kinds.append(word)
    return kinds


DOC_ITEM_ORDER = doc_item_order()


def check_item_order(kinds: list[str]) -> None:
    """Snapshot item kinds follow the README's order (kinds may repeat or be absent)."""
    assert kinds == sorted(kinds, key=DOC_ITEM_ORDER.index), kinds


def doc_magic(name: str) -> bytes:
    m = re.search(r"\(([0-9A-Fa-f ]+)\)", CONSTANTS[name])
    assert m, CONSTANTS[name]
    return bytes.fromhex(m[1])


def doc_struct(kind: str) -> struct.Struct:
    """The fixed part of a header/frame layout table as a struct (little-endian)."""
    codes = {"u32": "I", "u64": "Q"}
    fmt = "<"
    offset = 0
    for off, size, typ, _what in table("offset", "size", "type", kind):
        if size == "L":  # the payload: not part of the fixed header
            assert off == str(offset)
            break
        assert int(off) == offset, f"{kind}: offset {off} should be {offset}"
        if typ.startswith("bytes["):
            assert typ == f"bytes[{size}]"
            fmt += f"{size}s"
        else:
            fmt += codes[typ]
            assert struct.calcsize("<" + codes[typ]) == int(size)
        offset += int(size)
    return struct.Struct(fmt)


FILE_HEADER = doc_struct("header field")
FRAME_HEADER = doc_struct("frame field")

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


TYPE_CHECKS = {
    "uint": lambda v: isinstance(v, int) and v >= 0,
    "int": lambda v: isinstance(v, int),
    "text": lambda v: isinstance(v, str),
    "bytes": lambda v: isinstance(v, bytes),
    "uint[]": lambda v: isinstance(v, list) and all(isinstance(x, int) and x >= 0 for x in v),
    "bytes[]": lambda v: isinstance(v, list) and all(isinstance(x, bytes) for x in v),
    # a `jobs` item's rows; their fields are checked as `job` fields (doc_jobs)
    "row[]": lambda v: isinstance(v, list) and all(isinstance(x, list) for x in v),
    "text[]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "(uint,text)[]": lambda v: isinstance(v, list) and all(
        isinstance(x, list) and len(x) == 2 and TYPE_CHECKS["uint"](x[0])
        and isinstance(x[1], str) for x in v),
    "(uint,text,int)[]": lambda v: isinstance(v, list) and all(
        isinstance(x, list) and len(x) == 3 and TYPE_CHECKS["uint"](x[0])
        and isinstance(x[1], str) and isinstance(x[2], int) for x in v),
    "(text,uint)[]": lambda v: isinstance(v, list) and all(
        isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)
        and TYPE_CHECKS["uint"](x[1]) for x in v),
    "(uint,int,text,text)[]": lambda v: isinstance(v, list) and all(
        isinstance(x, list) and len(x) == 4 and TYPE_CHECKS["uint"](x[0])
        and isinstance(x[1], int) and isinstance(x[2], str) and isinstance(x[3], str)
        for x in v),
    "(text,uint,int)[]": lambda v: isinstance(v, list) and all(
        isinstance(x, list) and len(x) == 3 and isinstance(x[0], str)
        and TYPE_CHECKS["uint"](x[1]) and isinstance(x[2], int) for x in v),
}


def test_item_versions_table() -> None:
    """Fields a later format added are appended to their item; a new kind is added whole."""
    for (kind, _name), version in DOC_ADDED.items():
        assert kind in DOC_ITEMS and 2 <= version <= records.FORMAT_VERSION
    for kind, fields in DOC_ITEMS.items():
        added = [DOC_ADDED.get((kind, name), 1) for name, _t, _u in fields]
        assert added == sorted(added), f"{kind}: fields of later formats must come last"
    assert item_kinds(records.FORMAT_VERSION) == set(DOC_ITEMS)
    assert {"meta", "tube", "conn", "job", "end"} <= item_kinds(1)


def as_doc_item(item: list, version: int = records.FORMAT_VERSION) -> dict[str, Any]:
    """A snapshot item (CBOR array) of format `version` as a dict named by the README's tables."""
    kind = item[0]
    assert kind in item_kinds(version), f"snapshot item kind {kind!r} is not in the README " \
        f"for format {version}"
    fields = item_fields(kind, version)
    assert len(item) == 1 + len(fields), f"{kind}: {len(item) - 1} fields, README has {len(fields)}"
    out: dict[str, Any] = {"kind": kind}
    for (name, typ, _unit), value in zip(fields, item[1:], strict=True):
        assert TYPE_CHECKS[typ](value), f"{kind}.{name} = {value!r} is not {typ}"
        out[name] = value
    return out


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


# --- a second reader, from the document only -------------------------------------------


def walk_frames(path: Path, magic: bytes, version: int) -> tuple[int, list[tuple[int, bytes]]]:
    """Check a file's header and every frame's CRC; return (header seq, [(offset, payload)])."""
    data = path.read_bytes()
    got_magic, got_version, seq, crc = FILE_HEADER.unpack_from(data)
    assert got_magic == magic, path
    assert got_version == version, path
    assert crc == zlib.crc32(data[:FILE_HEADER.size - 4]), f"{path}: header CRC"
    frames = []
    pos = FILE_HEADER.size
    while pos < len(data):
        length, crc = FRAME_HEADER.unpack_from(data, pos)
        payload = data[pos + FRAME_HEADER.size:pos + FRAME_HEADER.size + length]
        assert len(payload) == length, f"{path}: frame at {pos} runs past the end"
        assert zlib.crc32(payload) == crc, f"{path}: CRC mismatch at {pos}"
        frames.append((pos, payload))
        pos += FRAME_HEADER.size + length
    assert pos == len(data)
    return seq, frames


def read_segment_doc(path: Path, version: int = 1) -> tuple[int, list[dict[str, Any]]]:
    """A segment's records as dicts named by the README's record table."""
    first, frames = walk_frames(path, doc_magic("SEGMENT_MAGIC"), version)
    assert path.name == f"{first:020d}.aof"
    out = []
    for _offset, payload in frames:
        item = cbor2.loads(payload)
        assert isinstance(item, list), path
        compact = item[0] in DOC_COMPACT
        op, _cls, fields = (DOC_RECORDS[records.PutUnique.CODE][0], None,
                            DOC_COMPACT[item[0]]) if compact else DOC_RECORDS[item[0]]
        assert len(item) == 1 + len(fields), (path, item)
        rec: dict[str, Any] = {"op": op}
        for (name, typ, _unit), value in zip(fields, item[1:], strict=True):
            assert TYPE_CHECKS[typ](value), f"{op}.{name} = {value!r} is not {typ}"
            rec[name] = value
        out.append(put_unique_of_compact(rec) if compact else rec)
    seqs = [r["seq"] for r in out]
    assert seqs == list(range(first, first + len(out))), f"{path}: seqs {seqs} from {first}"
    return first, out


def put_unique_of_compact(rec: dict[str, Any]) -> dict[str, Any]:
    """The README's compact PutUnique (26) as the record it stands for: `jobs` is
    `[[id, tube]]`, `expires` 0, `dropped` empty, in the record table's order."""
    full = {**rec, "jobs": [[rec["id"], rec["tube"]]], "expires": 0, "dropped": []}
    names = [name for name, _typ, _unit in DOC_RECORDS[records.PutUnique.CODE][2]]
    return {"op": rec["op"], **{name: full[name] for name in names}}


def byte_string_head(n: int) -> int:
    """The README's head(n): bytes before a byte string's contents."""
    return 1 if n < 24 else 2 if n < 256 else 3 if n < 65536 else 5 if n < 1 << 32 else 9


def doc_jobs(data: bytes, offset: int, payload: bytes, item: dict[str, Any],
             version: int) -> list[dict[str, Any]]:
    """A `jobs` item's jobs as `job` item dicts; each body is checked to be
    where the README's "Where a body is" puts it in the file."""
    rows, bodies = item["rows"], item["bodies"]
    assert 1 <= len(rows) == len(bodies) <= 128
    names = [f for f in item_fields("job", version) if f[0] != "body"]
    end = offset + FRAME_HEADER.size + len(payload)
    starts = [0] * len(bodies)
    for k in range(len(bodies) - 1, -1, -1):
        starts[k] = end - len(bodies[k])
        end = starts[k] - byte_string_head(len(bodies[k]))
    out = []
    for row, body, start in zip(rows, bodies, starts, strict=True):
        assert data[start:start + len(body)] == body, (offset, row)
        assert len(row) == len(names)
        fields = dict(zip([n for n, _t, _u in names], row, strict=True))
        job = as_doc_item(["job", *[fields.get(n, body) for n, _t, _u in
                                    item_fields("job", version)]], version)
        out.append(job)
    return out


def read_snapshot_doc(path: Path, version: int) -> tuple[int, list[dict[str, Any]]]:
    last_seq, frames = walk_frames(path, doc_magic("SNAPSHOT_MAGIC"), version)
    assert path.name == f"{last_seq:020d}.snap"
    data = path.read_bytes()
    raw = [(offset, payload, as_doc_item(cbor2.loads(payload), version))
           for offset, payload in frames]
    assert raw[-1][2] == {"kind": "end", "count": len(raw) - 1}
    kinds = {i["kind"] for _o, _p, i in raw}
    # Format 3 writes jobs only in `jobs` items; earlier formats had no such item.
    assert ("job" not in kinds) if version >= 3 else ("jobs" not in kinds), kinds
    items = []
    for offset, payload, item in raw:
        if item["kind"] == "jobs":
            items.extend(doc_jobs(data, offset, payload, item, version))
        else:
            items.append(item)
    assert [i["kind"] for i in items].count("end") == 1
    check_item_order([i["kind"] for i in items])
    assert items[0]["kind"] == "meta" and items[0]["last_seq"] == last_seq
    return last_seq, items[:-1]


# --- fixtures ---------------------------------------------------------------------------


def copy_data_dir(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / src.name
    shutil.copytree(src, dest)
    return dest


class Fixture:
    """One snapshots/v<N>/ directory, read by the document's reader."""

    def __init__(self, vdir: Path):
        self.dir = vdir
        self.version = int(vdir.name[1:])
        self.exp = json.loads((vdir / "expected.json").read_text())
        assert self.exp["format_version"] == self.version
        self.records: dict[int, dict[str, Any]] = {}
        for name in DATA_DIRS:
            for seg in sorted((vdir / name / "aof").glob("*.aof")):
                for rec in read_segment_doc(seg, self.version)[1]:
                    assert self.records.setdefault(rec["seq"], rec) == rec, "copies differ"
        self.conn_ids = self._conn_ids()

    def _conn_ids(self) -> dict[str, int]:
        """Client label -> conn id, checked consistent with the expected records."""
        ids: dict[str, int] = {}
        run: set[int] = set()
        for want in self.exp["records"]:
            got = self.records[want["seq"]]
            if want["op"] == "restart":
                run = set()
            if "client" in want:
                conn = got["conn"]
                if want["client"] not in ids:
                    assert conn not in run, f"two clients share conn {conn}"
                    ids[want["client"]] = conn
                    run.add(conn)
                assert ids[want["client"]] == conn, want
        return ids

    def at(self, rel: dict[str, int] | None) -> int:
        assert rel is not None
        return self.records[rel["seq"]]["time"] + rel["plus_seconds"] * NS

    def absolute(self, obj: Any) -> Any:
        """`obj` with every relative time ({seq, plus_seconds}) made absolute (ns)."""
        if isinstance(obj, dict):
            if set(obj) == {"seq", "plus_seconds"}:
                return self.at(obj)
            return {k: self.absolute(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.absolute(v) for v in obj]
        return obj

    def expires(self, job: dict[str, Any]) -> int:
        """A job's expiry time (ns, 0 = never); fixtures before format 2 have none."""
        rel = job.get("expires")
        return 0 if rel is None else self.at(rel)

    def later_fields(self, kind: str) -> dict[str, int]:
        """Fields of `kind` that formats after the fixture's added, with the value
        a reader gives them when it reads this fixture's files (0)."""
        return {name: 0 for (k, name), v in DOC_ADDED.items() if k == kind and v > self.version}

    def conn(self, label: str | None) -> int:
        return 0 if label is None else self.conn_ids[label]


@functools.cache
def load(vdir: Path) -> Fixture:
    return Fixture(vdir)


PARAMS = [pytest.param(v, id=v.name) for v in VERSION_DIRS]
DIR_PARAMS = [pytest.param(v, d, id=f"{v.name}-{d}") for v in VERSION_DIRS for d in DATA_DIRS]
CURRENT = SNAPSHOTS / f"v{records.FORMAT_VERSION}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_current_format_version_has_fixtures() -> None:
    assert CURRENT in VERSION_DIRS, (
        "no snapshots/v<FORMAT_VERSION>/: run `make fixtures` for the new format version")


@pytest.mark.parametrize("vdir", PARAMS)
def test_fixture_files_are_untouched(vdir: Path) -> None:
    fx = load(vdir)
    files = {str(p.relative_to(fx.dir)): sha256(p) for p in fx.dir.rglob("*") if p.is_file()}
    files.pop("expected.json")
    assert files == fx.exp["files"]
    for name in DATA_DIRS:
        snaps = sorted(p.name for p in (fx.dir / name / "snapshots").glob("*"))
        listing = {"snapshot": snaps[-1] if snaps else None,
                   "segments": sorted(p.name for p in (fx.dir / name / "aof").glob("*"))}
        assert listing == fx.exp["data_dirs"][name]


@pytest.mark.parametrize("vdir", PARAMS)
def test_segments_hold_the_expected_records(vdir: Path) -> None:
    """Every frame of every segment, read with the README's tables only."""
    fx = load(vdir)
    expected = fx.exp["records"]
    assert sorted(fx.records) == [r["seq"] for r in expected] == list(range(1, len(expected) + 1))
    for want in expected:
        got = dict(fx.records[want["seq"]])
        got.pop("time")
        if "client" in want:
            assert got.pop("conn") == fx.conn_ids[want["client"]]
        exp = fx.absolute({k: v for k, v in want.items() if k != "client"})
        if "body" in exp:
            exp["body"] = exp["body"].encode()
        assert got == exp
        for field, pattern in fx.exp.get("chosen", {}).items():  # values the server picked
            op, name = field.split(".")
            if want["op"] == op:
                assert re.fullmatch(pattern, want[name]), (want, pattern)
    times = [fx.records[s]["time"] for s in sorted(fx.records)]
    assert times == sorted(times)
    # A state's epochs are the NewEpoch records up to its last seq.
    for key in ("state", "snapshot_state"):
        state = fx.exp[key]
        assert state["epochs"] == [
            {"epoch": r["epoch"], "history": r["history"], "first_seq": r["seq"]}
            for r in expected if r["op"] == "new-epoch" and r["seq"] <= state["last_seq"]], key


@pytest.mark.skipif(not CURRENT.is_dir(), reason="no fixtures for the current version")
def test_current_fixtures_cover_every_record_type() -> None:
    """A record type the session never logs has no golden bytes: extend make_fixtures."""
    ops = {r["op"] for r in load(CURRENT).records.values()}
    assert ops == {op for op, _cls, _fields in DOC_RECORDS.values()}


def check_items(fx: Fixture, items: list[dict[str, Any]], exp: dict[str, Any]) -> None:
    """Snapshot items (README names) against an expected state."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for item in items:
        by_kind.setdefault(item["kind"], []).append(item)
    (meta,) = by_kind["meta"]
    assert meta["time"] == fx.at(exp["time"])
    assert (meta["last_seq"], meta["next_job_id"], meta["total_jobs"], meta["job_timeouts"]) == (
        exp["last_seq"], exp["next_job_id"], exp["total_jobs"], exp["job_timeouts"])
    assert meta["next_conn_id"] > max(
        (r["conn"] for s, r in fx.records.items() if "conn" in r and s <= exp["last_seq"]),
        default=0)
    assert [{k: v for k, v in e.items() if k != "kind"} for e in by_kind.get("epoch", [])] == (
        exp["epochs"])
    tubes = [{k: v for k, v in t.items() if k != "kind"} for t in by_kind.get("tube", [])]
    want_tubes = [
        {**fx.later_fields("tube"), **{k: v for k, v in t.items() if k != "unpause_at"},
         "unpause_at": 0 if t["unpause_at"] is None else fx.at(t["unpause_at"])}
        for t in exp["tubes"]]
    # Items of the fixture's own format have its fields; items of a later one, more.
    assert tubes == [{k: w[k] for k in got} for got, w in zip(tubes, want_tubes, strict=False)]
    assert len(tubes) == len(want_tubes)
    assert [f["tube"] for f in by_kind.get("fanout", [])] == exp.get("fanout", [])
    assert [(c["id"], c["use"], c["watch"]) for c in by_kind.get("conn", [])] == [
        (fx.conn(c["client"]), c["use"], c["watch"]) for c in exp["conns"]]
    jobs = by_kind.get("job", [])
    non_buried = [j["id"] for j in jobs if DOC_STATES[j["state"]] != "buried"]
    assert non_buried == sorted(non_buried)
    buried = [j["id"] for j in jobs if DOC_STATES[j["state"]] == "buried"]
    assert jobs[len(non_buried):] == [j for j in jobs if j["id"] in buried], "buried last"
    tube_order = [t["name"] for t in exp["tubes"]]
    assert buried == [jid for name in tube_order for jid in exp["buried"].get(name, [])]
    got = {j["id"]: j for j in jobs}
    assert sorted(got) == [j["id"] for j in exp["jobs"]]
    for want in exp["jobs"]:
        j = got[want["id"]]
        assert DOC_STATES[j["state"]] == want["state"]
        for key in ("tube", "pri", "delay", "ttr", "reserves", "timeouts", "releases",
                    "buries", "kicks"):
            assert j[key] == want[key], (want["id"], key)
        assert j["body"] == want["body"].encode()
        assert j["created"] == fx.at(want["created"])
        if want["deadline"] is not None:
            assert j["deadline"] == fx.at(want["deadline"])
        assert j["reserver"] == fx.conn(want["reserved_by"])
        if "expires" in j:  # format 2 on
            assert j["expires"] == fx.expires(want), want["id"]
    if fx.version >= 5:
        assert keys_of_items(by_kind.get("keys", [])) == expected_keys(fx, exp)
    if fx.version >= 6:
        assert [{k: v for k, v in x.items() if k != "kind"} for x in by_kind.get("limit", [])] \
            == expected_limits(fx, exp)
        assert [{k: v for k, v in x.items() if k != "kind"}
                for x in by_kind.get("schedule", [])] == exp["schedules"]
        assert [{k: v for k, v in x.items() if k != "kind"} for x in by_kind.get("hold", [])] \
            == exp["holds"]


def expected_limits(fx: Fixture, exp: dict[str, Any]) -> list[dict[str, Any]]:
    """Format 6: expected.json's limits, the bucket's tat made absolute."""
    return [{**x, "tat": fx.at(x["tat"]) if x["tat"] else 0} for x in exp.get("limits", [])]


def keys_of_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`keys` items, a tube's several items merged, as expected.json writes keys."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        k = out.setdefault(item["tube"], {"tube": item["tube"], "live": [], "gone": []})
        k.update(window=item["window"], keys_max=item["keys_max"], dropped_n=item["dropped_n"])
        k["live"] += [list(x) for x in item["live"]]
        k["gone"] += [list(x) for x in item["gone"]]
    return list(out.values())


def expected_keys(fx: Fixture, exp: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"tube": k["tube"], "live": k["live"],
             "gone": [[key, jid, fx.at(until)] for key, jid, until in k["gone"]],
             "window": k["window"] * 10**9, "keys_max": k["keys_max"],
             "dropped_n": k["dropped_n"]} for k in exp.get("keys", [])]


@pytest.mark.parametrize("vdir", PARAMS)
def test_snapshots_hold_the_expected_state(vdir: Path) -> None:
    fx = load(vdir)
    snaps = sorted(fx.dir.glob("*/snapshots/*.snap"))
    assert snaps
    for path in snaps:
        last_seq, items = read_snapshot_doc(path, fx.version)
        assert last_seq == fx.exp["snapshot_state"]["last_seq"]
        check_items(fx, items, fx.exp["snapshot_state"])


def check_state(fx: Fixture, state: st.State, exp: dict[str, Any]) -> None:
    """smallstalk's State against an expected state."""
    state.check()
    assert (state.last_seq, state.next_job_id, state.total_jobs, state.job_timeouts) == (
        exp["last_seq"], exp["next_job_id"], exp["total_jobs"], exp["job_timeouts"])
    assert state.time == fx.at(exp["time"])
    assert state.epochs == [(e["epoch"], e["history"], e["first_seq"]) for e in exp["epochs"]]
    assert state.tube_order == [t["name"] for t in exp["tubes"]]
    for want in exp["tubes"]:
        t = state.tubes[want["name"]]
        assert (t.total_jobs, t.cmd_delete, t.cmd_pause, t.pause) == (
            want["total_jobs"], want["cmd_delete"], want["cmd_pause"], want["pause"])
        assert t.unpause_at == (0 if want["unpause_at"] is None else fx.at(want["unpause_at"]))
        assert list(t.buried) == exp["buried"].get(want["name"], [])
        assert (t.expired_n, t.discarded_n) == (want.get("expired_n", 0),
                                                want.get("discarded_n", 0)), want["name"]
    assert [c for cs in state.fanout.values() for c in cs] == exp.get("fanout", [])
    assert sorted(state.conns) == [fx.conn(c["client"]) for c in exp["conns"]]
    for want in exp["conns"]:
        c = state.conns[fx.conn(want["client"])]
        assert (c.use, c.watch, sorted(c.reserved)) == (want["use"], want["watch"],
                                                         want["reserved"])
        assert c.logged and not c.waiting
    assert sorted(state.jobs) == [j["id"] for j in exp["jobs"]]
    for want in exp["jobs"]:
        j = state.jobs[want["id"]]
        got = {"id": j.id, "tube": j.tube.name, "state": STATE_NAMES[j.state],
               "pri": j.pri, "delay": j.delay, "ttr": j.ttr, "body": j.body,
               "reserves": j.reserves, "timeouts": j.timeouts, "releases": j.releases,
               "buries": j.buries, "kicks": j.kicks}
        assert got == {k: want[k] for k in got} | {"body": want["body"].encode()}
        assert j.created == fx.at(want["created"])
        if want["deadline"] is not None:
            assert j.deadline == fx.at(want["deadline"])
        assert j.reserver == fx.conn(want["reserved_by"])
        assert state.expires.get(j.id, 0) == fx.expires(want), want["id"]
    assert state.waiting_n == 0 and not state.waiters
    got_keys = [{"tube": tube, "live": [[key, jid] for key, jid in k.live.items()],
                 "gone": [[key, jid, until] for key, (jid, until) in k.gone.items()],
                 "window": k.window, "keys_max": k.keys_max, "dropped_n": k.dropped_n}
                for tube, k in state.keys.tubes.items()]
    assert got_keys == expected_keys(fx, exp)
    if fx.version >= 6:
        assert [{"tube": t, "max_reserved": x.max_reserved, "rate": x.rate,
                 "period": x.period, "tat": x.tat}
                for t, x in sorted(state.limits.items())] == expected_limits(fx, exp)
        assert [{"name": n, "at": at, "job": jid}
                for n, (at, jid) in sorted(state.schedules.items())] == exp["schedules"]
        assert [{"id": i, "reason": why} for i, why in sorted(state.holds.items())] \
            == exp["holds"]


@pytest.mark.parametrize(("vdir", "name"), DIR_PARAMS)
def test_recover_rebuilds_the_expected_state(vdir: Path, name: str, tmp_path: Path) -> None:
    fx = load(vdir)
    data = copy_data_dir(fx.dir / name, tmp_path)
    before = {p: sha256(p) for p in data.rglob("*") if p.is_file()}
    result = recovery.recover(data, repair=False)
    assert result.warnings == []
    check_state(fx, result.state, fx.exp["state"])
    snap = fx.exp["data_dirs"][name]["snapshot"]
    assert (result.snapshot.name if result.snapshot else None) == snap
    assert result.records_replayed == fx.exp["state"]["last_seq"] - (
        fx.exp["snapshot_state"]["last_seq"] if snap else 0)
    assert {p: sha256(p) for p in data.rglob("*") if p.is_file()} == before  # wrote nothing
    # The loaded state dumps to the same items the README describes.
    check_items(fx, [as_doc_item(i) for i in snapshot_codec.dump(result.state)], fx.exp["state"])


# --- the current version: the code still writes exactly these bytes --------------------


@pytest.mark.skipif(not CURRENT.is_dir(), reason="no fixtures for the current version")
def test_records_reencode_to_the_same_bytes() -> None:
    """A record encoding that changes without a FORMAT_VERSION bump fails here."""
    for seg in sorted((CURRENT / "log-only" / "aof").glob("*.aof")):
        _seq, frames = walk_frames(seg, aof.SEGMENT_MAGIC, records.FORMAT_VERSION)
        for _offset, payload in frames:
            assert records.encode(records.decode(payload)) == payload


def meaningful(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items without what the README says readers ignore (a ready/buried job's deadline)."""
    out = []
    for item in items:
        if item["kind"] == "job" and DOC_STATES[item["state"]] in ("ready", "buried"):
            item = {**item, "deadline": None}
        out.append(item)
    return out


@pytest.mark.skipif(not CURRENT.is_dir(), reason="no fixtures for the current version")
def test_compactor_writes_the_same_snapshot(tmp_path: Path) -> None:
    """Folding the closed segments again gives the fixture snapshot's items and header."""
    data = copy_data_dir(CURRENT / "log-only", tmp_path)
    closed = sorted((data / "aof").glob("*.aof"))[:-1]
    snap = compactor.fold(data, closed)
    want = CURRENT / "snapshot-and-segments" / "snapshots" / snap.name
    assert want.exists(), snap.name
    got_seq, got = read_snapshot_doc(snap, records.FORMAT_VERSION)
    want_seq, expected = read_snapshot_doc(want, records.FORMAT_VERSION)
    assert got_seq == want_seq
    assert meaningful(got) == meaningful(expected)


# --- the recovery rules of the README, on damaged copies --------------------------------


def segments(data: Path) -> list[Path]:
    return sorted((data / "aof").glob("*.aof"))


@pytest.mark.parametrize("vdir", PARAMS)
def test_torn_tail_of_the_last_segment_is_cut(vdir: Path, tmp_path: Path) -> None:
    fx = load(vdir)
    data = copy_data_dir(fx.dir / "log-only", tmp_path)
    last = segments(data)[-1]
    good = last.read_bytes()
    tail = struct.pack("<II", 40, 0) + b"half a record"
    last.write_bytes(good + tail)
    result = recovery.recover(data, repair=False)
    assert len(result.warnings) == 1 and f"offset {len(good)}" in result.warnings[0]
    check_state(fx, result.state, fx.exp["state"])
    assert last.read_bytes() == good + tail  # repair=False wrote nothing
    result = recovery.recover(data, repair=True)
    assert last.read_bytes() == good
    assert last.with_name(last.name + ".broken").read_bytes() == tail
    check_state(fx, recovery.recover(data, repair=False).state, fx.exp["state"])


@pytest.mark.parametrize("vdir", PARAMS)
def test_damage_before_the_last_segment_is_an_error(vdir: Path, tmp_path: Path) -> None:
    fx = load(vdir)
    data = copy_data_dir(fx.dir / "log-only", tmp_path)
    seg = segments(data)[1]
    first, frames = walk_frames(seg, aof.SEGMENT_MAGIC, fx.version)
    offset, payload = frames[2]
    raw = bytearray(seg.read_bytes())
    raw[offset + FRAME_HEADER.size + len(payload) - 1] ^= 0xFF
    seg.write_bytes(bytes(raw))
    with pytest.raises(aof.CorruptionError) as info:
        recovery.recover(data, repair=False)
    e = info.value
    assert (e.path, e.offset, e.seq) == (seg, offset, first + 1)
    assert f"{seg}: " in str(e) and f"offset {offset}" in str(e) and f"seq {first + 1}" in str(e)


@pytest.mark.parametrize("vdir", PARAMS)
def test_bad_frame_followed_by_a_good_one_is_an_error(vdir: Path, tmp_path: Path) -> None:
    fx = load(vdir)
    data = copy_data_dir(fx.dir / "log-only", tmp_path)
    last = segments(data)[-1]
    good = last.read_bytes()
    _first, frames = walk_frames(last, aof.SEGMENT_MAGIC, fx.version)
    offset, payload = frames[-1]
    bad = struct.pack("<II", 5, 0) + b"xxxxx"
    # A record that continues the log after the damage: acknowledged data
    # would be lost by cutting there, so it is an error.
    rec = records.decode(payload)
    later = attrs.evolve(rec, seq=rec.seq + 2)
    last.write_bytes(good + bad + aof.frame(records.encode(later)))
    with pytest.raises(aof.CorruptionError) as info:
        recovery.recover(data, repair=False)
    assert (info.value.path, info.value.offset) == (last, len(good))
    # A stale copy of an earlier frame does not continue the log: a torn tail.
    last.write_bytes(good + bad + good[offset:])
    result = recovery.recover(data, repair=False)
    assert result.warnings and "torn write" in result.warnings[0]


@pytest.mark.parametrize("vdir", PARAMS)
def test_missing_segment_is_a_sequence_gap(vdir: Path, tmp_path: Path) -> None:
    fx = load(vdir)
    data = copy_data_dir(fx.dir / "log-only", tmp_path)
    segs = segments(data)
    segs[1].unlink()
    with pytest.raises(aof.CorruptionError, match="sequence gap") as info:
        recovery.recover(data, repair=False)
    assert (info.value.path, info.value.offset) == (segs[2], FILE_HEADER.size)
    assert info.value.seq == int(segs[1].stem) - 1


@pytest.mark.parametrize("vdir", PARAMS)
def test_incomplete_snapshot_is_an_error(vdir: Path, tmp_path: Path) -> None:
    fx = load(vdir)
    data = copy_data_dir(fx.dir / "compacted", tmp_path)
    (snap,) = (data / "snapshots").glob("*.snap")
    _seq, frames = walk_frames(snap, aof.SNAPSHOT_MAGIC, fx.version)
    snap.write_bytes(snap.read_bytes()[:frames[-1][0]])  # without its end frame
    with pytest.raises(aof.CorruptionError, match="no end frame") as info:
        recovery.recover(data, repair=False)
    assert info.value.path == snap


@pytest.mark.parametrize("vdir", PARAMS)
def test_headerless_last_segment_is_ignored(vdir: Path, tmp_path: Path) -> None:
    fx = load(vdir)
    data = copy_data_dir(fx.dir / "compacted", tmp_path)
    stray = data / "aof" / f"{fx.exp['state']['last_seq'] + 1:020d}.aof"
    stray.write_bytes(aof.SEGMENT_MAGIC[:5])
    (data / "snapshots" / "00000000000000000099.snap.123.tmp").write_bytes(b"junk")
    result = recovery.recover(data, repair=False)
    assert len(result.warnings) == 1 and stray.exists()
    check_state(fx, result.state, fx.exp["state"])
