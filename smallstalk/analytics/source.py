"""The `smallstalk` Spark data source: AOF segments and snapshots as a DataFrame of records.

    spark.dataSource.register(SmallstalkDataSource)
    df = spark.read.format("smallstalk").load("/var/lib/smallstalk")      # one data directory
    df = spark.read.format("smallstalk").load(["/archive/a", "/archive/b"])  # several servers
    df = spark.read.format("smallstalk").load("s3://bucket/aof-archive/*")   # a glob, any pyarrow FS

Each DATA_DIR is one server's data directory (`aof/` and/or `snapshots/`, see
snapshots/README.md); the server is named after the directory's last path
component unless the `serverNames` option (comma-separated, parallel to the
paths) names it. Job ids are unique only within one server, so downstream
code keys jobs by (server, id).

Planning (on the driver side) lists the files only. Reading is parallel:
consecutive segments of one server are grouped into input partitions of about
`partitionBytes` bytes, and each task decodes its files with the project's
own readers (`logread.LogReader`, start-up's reader of the log's rules, a
file at a time, and `snapshot.read_items`), so there is one definition of the
format and of damage. Columns are
filled by field name from `records.FIELDS`, and rows leave the task as Arrow
record batches.

One row per logged record, plus one row per job item of the newest snapshot
(`op = "snapshot"`, `seq` = the snapshot's seq, `time` = its meta time, the
job's state and counters in the `snap` struct): those describe jobs already
alive before the oldest segment. Bodies are not loaded into the DataFrame
unless `bodies` is "true" (`body_size` is always there).

Options: `bodies` (false), `snapshots` (true: include the newest snapshot's
jobs), `damaged` ("fail": damage anywhere but a torn tail of a server's
last segment, or a bad snapshot, fails the read, as recovery would; "skip":
keep the records before it, skip the snapshot), `partitionBytes` (33554432),
`batchRows` (65536), `serverNames`.
Paths may be local paths or URIs that `pyarrow.fs.FileSystem.from_uri`
understands (s3://, gs://, hdfs://, file://); globs (`*`, `?`, `[...]`) are
allowed in the last path component of a URI and anywhere in a local path.
"""

from __future__ import annotations

import fnmatch
import glob
import io
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

try:
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
    from pyspark.sql.types import StructType
except ImportError:  # planning and reading need pyarrow only; the data source classes need Spark
    DataSource = DataSourceReader = StructType = object

    class InputPartition:  # what FilesPartition uses of Spark's
        def __init__(self, value: Any) -> None:
            self.value = value


from smallstalk.core import records
from smallstalk.core.model import STATE_NAMES
from smallstalk.storage import aof, datadir, logread, snapshot

NAME = "smallstalk"

SNAP_FIELDS = (
    ("state", pa.string()), ("created", pa.int64()), ("deadline", pa.int64()),
    ("reserver", pa.int64()), ("reserves", pa.int64()), ("timeouts", pa.int64()),
    ("releases", pa.int64()), ("buries", pa.int64()), ("kicks", pa.int64()),
)
SNAP_TYPE = pa.struct([pa.field(n, t) for n, t in SNAP_FIELDS])
JOBS_TYPE = pa.list_(pa.struct([pa.field("id", pa.int64()), pa.field("tube", pa.string())]))
MOVES_TYPE = pa.list_(pa.struct([pa.field("id", pa.int64()), pa.field("to", pa.string()),
                                 pa.field("expires", pa.int64())]))
OUTCOMES_TYPE = pa.list_(pa.struct([pa.field("id", pa.int64()), pa.field("until", pa.int64()),
                                    pa.field("to", pa.string()), pa.field("reason", pa.string())]))

# The declared schema: name, Arrow type, Spark DDL type, meaning.
COLUMNS: tuple[tuple[str, pa.DataType, str, str], ...] = (
    ("server", pa.string(), "STRING", "server name (data directory name or serverNames)"),
    ("seq", pa.int64(), "BIGINT", "record sequence number (snapshot rows: the snapshot's seq)"),
    ("time", pa.int64(), "BIGINT", "wall-clock time of the record, ns since the epoch"),
    ("op", pa.string(), "STRING", "put, reserve, delete, release, bury, touch, kick, use, watch, "
                                  "ignore, pause-tube, disconnect, promote, timeout, restart, "
                                  "new-epoch, put-jobs, expire, delete-tube, flush-tube, "
                                  "put-unique, requeue, limits, fire, move; snapshot"),
    ("conn", pa.int64(), "BIGINT", "connection id (null for promote/timeout/restart/expire/fire)"),
    ("id", pa.int64(), "BIGINT", "job id (put, reserve, delete, release, bury, touch, fire (0: "
                                 "skipped), move, snapshot)"),
    ("ids", pa.list_(pa.int64()), "ARRAY<BIGINT>", "job ids (kick, promote, timeout)"),
    ("jobs", JOBS_TYPE, "ARRAY<STRUCT<id: BIGINT, tube: STRING>>",
     "the jobs a put-jobs or put-unique made: the tube put into, then its fanout copies"),
    ("dropped", pa.list_(pa.int64()), "ARRAY<BIGINT>",
     "ready jobs a put-jobs or put-unique discarded to make room in a full tube"),
    ("moves", MOVES_TYPE, "ARRAY<STRUCT<id: BIGINT, to: STRING, expires: BIGINT>>",
     "expire: each job that expired, deleted (to = '') or moved to tube `to`, with its new "
     "expiry time (ns, 0 = never)"),
    ("cause", pa.int64(), "BIGINT", "requeue: why the jobs left their reservation (0 the TTR ran "
                                    "out, 1 `conn` released them, 2 `conn` closed)"),
    ("outcomes", OUTCOMES_TYPE,
     "ARRAY<STRUCT<id: BIGINT, until: BIGINT, to: STRING, reason: STRING>>",
     "requeue: each job and where its tube's policy sent it: ready (until = 0), delayed until "
     "`until` (ns, a back-off), or at an attempt limit (`reason` set) buried (to = '') or moved "
     "to the dead-letter tube `to`"),
    ("schedule", pa.string(), "STRING", "fire: the schedule's name"),
    ("at", pa.int64(), "BIGINT", "fire: the firing time it stands for, ns since the epoch"),
    ("tube", pa.string(), "STRING", "tube (put, use, watch, ignore, pause-tube, delete-tube, "
                                    "fire, move: where the job goes, snapshot)"),
    ("pri", pa.int64(), "BIGINT", "priority (put, put-jobs, release, bury, requeue, fire, "
                                   "snapshot)"),
    ("delay", pa.int64(), "BIGINT", "delay in seconds (put, put-jobs, release, pause-tube, "
                                    "fire, snapshot)"),
    ("ttr", pa.int64(), "BIGINT", "time to run in seconds (put, put-jobs, fire, snapshot)"),
    ("expires", pa.int64(), "BIGINT", "expiry time, ns since the epoch, 0 = never (put-jobs, "
                                      "snapshot of format 2)"),
    ("body_size", pa.int64(), "BIGINT", "body length in bytes (put, put-jobs, fire, snapshot)"),
    ("body", pa.binary(), "BINARY", "the body (only with option bodies=true)"),
    ("segment", pa.int64(), "BIGINT", "first seq of the segment file (snapshot rows: its seq)"),
    ("offset", pa.int64(), "BIGINT", "byte offset of the record's frame in its file "
                                     "(snapshot rows: the item's index)"),
    ("snap", SNAP_TYPE, "STRUCT<" + ", ".join(
        f"{n}: {'STRING' if t == pa.string() else 'BIGINT'}" for n, t in SNAP_FIELDS) + ">",
     "snapshot rows: state, created (ns), deadline (ns), reserver, counters"),
)
COLUMN_INDEX = {name: i for i, (name, *_rest) in enumerate(COLUMNS)}
BODY = COLUMN_INDEX["body"]


def schema_ddl(bodies: bool = False) -> str:
    return ", ".join(f"{n} {ddl}" for n, _a, ddl, _m in COLUMNS if bodies or n != "body")


def arrow_schema(bodies: bool = False) -> pa.Schema:
    return pa.schema([pa.field(n, t) for n, t, _d, _m in COLUMNS if bodies or n != "body"])


# --- files ------------------------------------------------------------------

GLOB_CHARS = set("*?[")


def _is_uri(path: str) -> bool:
    return "://" in path


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow file system for a local path or a URI, and the path inside it."""
    if _is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def server_name_of(path: str) -> str:
    """The default server name: the directory's last path component."""
    tail = path.rstrip("/").rsplit("/", 1)[-1]
    return tail.split("://", 1)[-1] or path


def expand(pattern: str) -> list[str]:
    """Directories a DATA_DIR argument names (globs expanded, sorted)."""
    if not GLOB_CHARS & set(pattern):
        return [pattern] if _is_uri(pattern) or os.path.isdir(pattern) else []
    if not _is_uri(pattern):
        return sorted(p for p in glob.glob(pattern) if os.path.isdir(p))
    parent, _, last = pattern.rstrip("/").rpartition("/")
    if GLOB_CHARS & set(parent):
        raise ValueError(f"{pattern}: in a URI only the last path component may hold a glob")
    fs, inner = filesystem(parent)
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return sorted(_join(parent, i.base_name) for i in infos
                  if i.type == pafs.FileType.Directory and fnmatch.fnmatchcase(i.base_name, last))


def resolve_servers(paths: Sequence[str], names: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(server name, data directory) for each path argument, globs expanded.

    `names`, if given, is parallel to `paths`; an argument with a name must name
    exactly one directory. Two directories may not end up with the same name.
    """
    if names and len(names) != len(paths):
        raise ValueError(f"{len(names)} server names for {len(paths)} data directories")
    out: list[tuple[str, str]] = []
    for i, pattern in enumerate(paths):
        dirs = expand(pattern)
        if not dirs:
            raise ValueError(f"{pattern}: no such data directory")
        if names and len(dirs) != 1:
            raise ValueError(f"{pattern}: names {len(dirs)} directories but one server name")
        for d in dirs:
            out.append((names[i] if names else server_name_of(d), d))
    seen: dict[str, str] = {}
    for name, d in out:
        if name in seen:
            raise ValueError(f"server name {name!r} used for both {seen[name]} and {d}; "
                             "give each directory a name (--server-name / serverNames)")
        seen[name] = d
    return out


def _list(fs: pafs.FileSystem, directory: str) -> list[pafs.FileInfo]:
    return [i for i in fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
            if i.type == pafs.FileType.File]


def list_files(path: str) -> tuple[list[tuple[int, str, int]], tuple[int, str, int] | None]:
    """A data directory's segments [(first seq, path, size)] and newest snapshot, if any."""
    fs, inner = filesystem(path)
    info = fs.get_file_info(inner)
    if info.type != pafs.FileType.Directory:
        raise FileNotFoundError(f"{path}: not a directory")
    prefix = path.rstrip("/") if _is_uri(path) else inner

    def numbered(sub: str, suffix: str) -> list[tuple[int, str, int]]:
        found = []
        for i in _list(fs, _join(inner, sub)):
            stem, dot, ext = i.base_name.partition(".")
            if dot and ext == suffix and stem.isdigit():
                found.append((int(stem), _join(_join(prefix, sub), i.base_name), i.size or 0))
        return sorted(found)

    # datadir's names, on any pyarrow file system
    segments = numbered(datadir.AOF, datadir.SEGMENT_SUFFIX[1:])
    snaps = numbered(datadir.SNAPSHOTS, datadir.SNAPSHOT_SUFFIX[1:])
    if not segments and not snaps and not any(
            fs.get_file_info(_join(inner, d)).type == pafs.FileType.Directory
            for d in (datadir.AOF, datadir.SNAPSHOTS)):
        raise FileNotFoundError(f"{path}: not a smallstalk data directory (no aof/ or snapshots/)")
    return segments, (snaps[-1] if snaps else None)


def read_bytes(path: str) -> bytes:
    fs, inner = filesystem(path)
    with fs.open_input_stream(inner) as f:
        return f.read()


# --- planning -----------------------------------------------------------------


class FilesPartition(InputPartition):
    """Consecutive segments of one server (or its snapshot): one Spark task."""

    def __init__(self, server: str, kind: str, files: list[tuple[int, str, bool]], size: int):
        super().__init__((server, kind, files))
        self.server = server
        self.kind = kind  # "segments" or "snapshot"
        self.files = files  # (first seq or snapshot seq, path, is the server's last segment)
        self.size = size


def plan(servers: Sequence[tuple[str, str]], snapshots: bool = True,
         partition_bytes: int = 32 << 20) -> list[FilesPartition]:
    """Group each server's files into input partitions of about `partition_bytes`."""
    parts: list[FilesPartition] = []
    for name, path in servers:
        segments, snap = list_files(path)
        group: list[tuple[int, str, bool]] = []
        size = 0
        for i, (first, seg_path, seg_size) in enumerate(segments):
            group.append((first, seg_path, i == len(segments) - 1))
            size += seg_size
            if size >= partition_bytes:
                parts.append(FilesPartition(name, "segments", group, size))
                group, size = [], 0
        if group:
            parts.append(FilesPartition(name, "segments", group, size))
        if snapshots and snap is not None:
            parts.append(FilesPartition(name, "snapshot", [(snap[0], snap[1], False)], snap[2]))
    # Biggest first: the long tasks start early.
    parts.sort(key=lambda p: -p.size)
    return parts


# --- decoding -------------------------------------------------------------------


def _fillers(bodies: bool) -> dict[type, Any]:
    """Per record class, a function that writes a record's fields into the column lists.

    Generated from `records.FIELDS` (fields are matched to columns by name, so
    the format has one definition), as straight-line code: this is the hot loop.
    """
    out = {}
    for cls, fields in records.FIELDS.items():
        op = records.OP_NAMES.get(cls, cls.__name__.lower())
        lines = ["def fill(rec, c, n, segment, offset):"]
        for name in fields:
            if name == "body":
                lines.append(f"    c[{COLUMN_INDEX['body_size']}][n] = len(rec.body)")
                if bodies:
                    lines.append(f"    c[{BODY}][n] = rec.body")
            elif name in COLUMN_INDEX and name.isidentifier():
                lines.append(f"    c[{COLUMN_INDEX[name]}][n] = rec.{name}")
            # else: a field the schema does not show (e.g. new-epoch's history)
        lines += [f"    c[{COLUMN_INDEX['op']}][n] = {op!r}",
                  f"    c[{COLUMN_INDEX['segment']}][n] = segment",
                  f"    c[{COLUMN_INDEX['offset']}][n] = offset"]
        namespace: dict[str, Any] = {}
        exec("\n".join(lines), namespace)  # noqa: S102 - code built from attrs field names
        out[cls] = namespace["fill"]
    return out


class Batcher:
    """Collects rows column by column and hands out Arrow record batches."""

    def __init__(self, server: str, bodies: bool, rows: int = 65536):
        self.server = server
        self.bodies = bodies
        self.rows = rows
        self.schema = arrow_schema(bodies)
        self.fill = _fillers(bodies)
        self._reset()

    def _reset(self) -> None:
        self.n = 0
        self.cols: list[list[Any]] = [[None] * self.rows for _ in COLUMNS]

    def add_record(self, rec: records.Record, segment: int, offset: int) -> bool:
        """Add one record; True when a batch is full."""
        self.fill[type(rec)](rec, self.cols, self.n, segment, offset)
        self.n += 1
        return self.n >= self.rows

    def add_snapshot_job(self, item: list, seq: int, time: int, offset: int) -> bool:
        (_, jid, tube, pri, delay, ttr, body, st, created, deadline, reserver,
         reserves, timeouts, releases, buries, kicks, *rest) = item  # format 2: + expires
        n = self.n
        c = self.cols
        state = STATE_NAMES[st]
        for name, v in (("seq", seq), ("time", time), ("op", "snapshot"), ("id", jid),
                        ("tube", tube), ("pri", pri), ("delay", delay), ("ttr", ttr),
                        ("expires", rest[0] if rest else 0),
                        ("body_size", len(body)), ("segment", seq), ("offset", offset),
                        ("conn", reserver if state == "reserved" else None)):
            c[COLUMN_INDEX[name]][n] = v
        if self.bodies:
            c[BODY][n] = body
        c[COLUMN_INDEX["snap"]][n] = {
            "state": state, "created": created,
            "deadline": deadline if state in ("delayed", "reserved") else None,
            "reserver": reserver if state == "reserved" else None,
            "reserves": reserves, "timeouts": timeouts, "releases": releases,
            "buries": buries, "kicks": kicks,
        }
        self.n = n + 1
        return self.n >= self.rows

    def batch(self) -> pa.RecordBatch:
        n = self.n
        arrays = []
        for (name, atype, _d, _m), col in zip(COLUMNS, self.cols, strict=True):
            if name == "body" and not self.bodies:
                continue
            if name == "server":
                arrays.append(pa.repeat(self.server, n).cast(atype))
            else:
                arrays.append(pa.array(col[:n] if n < self.rows else col, type=atype))
        self._reset()
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def read_segments(part: FilesPartition, bodies: bool = False, damaged: str = "fail",
                  rows: int = 65536) -> Iterator[pa.RecordBatch]:
    """Decode a partition's segments into record batches."""
    out = Batcher(part.server, bodies, rows)
    for first, path, is_last in part.files:
        # Each file on its own: seqs are not checked across files (a server's
        # lost segments are what the `servers` table's `missing` column counts).
        # Only the server's last segment may end torn (or still being written).
        reader = logread.LogReader([Path(path)], None, keep_going=damaged == "skip",
                                   files=[io.BytesIO(read_bytes(path))], torn_tail=is_last)
        for _path, _data, offsets, recs in reader.batches():
            for offset, rec in zip(offsets, recs, strict=True):
                if out.add_record(rec, first, offset):
                    yield out.batch()
    if out.n:
        yield out.batch()


def read_snapshot(part: FilesPartition, bodies: bool = False,
                  rows: int = 65536) -> Iterator[pa.RecordBatch]:
    """The job items of a snapshot as rows (op 'snapshot')."""
    (_seq, path, _last), = part.files
    if _is_uri(path):
        with tempfile.NamedTemporaryFile(suffix=".snap") as tmp:
            tmp.write(read_bytes(path))
            tmp.flush()
            last_seq, items = snapshot.read_items(Path(tmp.name))
    else:
        last_seq, items = snapshot.read_items(Path(path))
    meta = items[0]
    if meta[0] != "meta":
        raise aof.CorruptionError(Path(path), 0, last_seq, "first item is not meta")
    time = meta[2]
    out = Batcher(part.server, bodies, rows)
    for i, item in enumerate(items):
        if item[0] == "job" and out.add_snapshot_job(item, last_seq, time, i):
            yield out.batch()
    if out.n:
        yield out.batch()


# --- the Spark data source ------------------------------------------------------


def _truth(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _paths(options: dict[str, str]) -> list[str]:
    if "paths" in options:
        paths = json.loads(options["paths"])
        if paths:
            return list(paths)
    if options.get("path"):
        return [p for p in options["path"].split(",") if p]
    raise ValueError("smallstalk data source: give load() one or more data directories")


class SmallstalkReader(DataSourceReader):
    def __init__(self, options: dict[str, str]):
        names = [n for n in options.get("serverNames", "").split(",") if n]
        self.servers = resolve_servers(_paths(options), names)
        self.bodies = _truth(options.get("bodies"), False)
        self.snapshots = _truth(options.get("snapshots"), True)
        self.damaged = options.get("damaged", "fail")
        if self.damaged not in ("fail", "skip"):
            raise ValueError("option damaged takes fail or skip")
        self.partition_bytes = int(options.get("partitionBytes", 32 << 20))
        self.rows = int(options.get("batchRows", 65536))

    def partitions(self) -> Sequence[InputPartition]:
        parts = plan(self.servers, self.snapshots, self.partition_bytes)
        return parts or [FilesPartition("", "segments", [], 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, FilesPartition)
        if partition.kind == "snapshot":
            try:
                yield from read_snapshot(partition, self.bodies, self.rows)
            except aof.CorruptionError:
                if self.damaged != "skip":
                    raise  # (skip: the jobs it held become orphans)
        else:
            yield from read_segments(partition, self.bodies, self.damaged, self.rows)


class SmallstalkDataSource(DataSource):
    """`spark.read.format("smallstalk").load(DATA_DIR or [DATA_DIR, ...])`."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType | str:
        return schema_ddl(_truth(self.options.get("bodies"), False))

    def reader(self, schema: StructType) -> DataSourceReader:
        return SmallstalkReader(dict(self.options))
