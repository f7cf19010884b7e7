"""Every snapshots/v*/ fixture, read two ways.

Two readers look at the fixtures: smallstalk's own (`recovery.recover`), and a
second one built from the README's tables with struct, zlib and cbor2 only
(tests/support/formatdoc.py). Both must agree with expected.json, which the
fixture script wrote from what its session did; the current version's records
and snapshot must still encode to the same bytes, and damaged copies must be
read as the README's recovery rules say."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import attrs
import pytest

from smallstalk.core import records
from smallstalk.core import state as st
from smallstalk.core.model import NS, STATE_NAMES
from smallstalk.storage import aof, compactor, recovery, snapshot_codec

from ..support.formatdoc import (
    CURRENT,
    DATA_DIRS,
    DOC_ADDED,
    DOC_RECORDS,
    DOC_STATES,
    FILE_HEADER,
    FRAME_HEADER,
    VERSION_DIRS,
    as_doc_item,
    copy_data_dir,
    read_segment_doc,
    read_snapshot_doc,
    walk_frames,
)

# --- fixtures ---------------------------------------------------------------------------


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
