"""snapshots/README.md read as a specification: its tables, and a second
reader of data directories built from them alone (struct, zlib and cbor2),
which tests/unit/test_format.py checks against the code and
tests/unit/test_fixtures.py runs over every snapshots/v*/ fixture."""

from __future__ import annotations

import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import cbor2

from smallstalk.core import records

from .procs import REPO

SNAPSHOTS = REPO / "snapshots"
README = SNAPSHOTS / "README.md"
DATA_DIRS = ("log-only", "snapshot-and-segments", "compacted")
CURRENT = SNAPSHOTS / f"v{records.FORMAT_VERSION}"
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


def copy_data_dir(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / src.name
    shutil.copytree(src, dest)
    return dest
