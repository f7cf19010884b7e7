"""The analytics package without Spark: the generator, the pyarrow reader, the report's formatting.

These need pyarrow only; tests/procs/test_analytics.py runs the Spark pipeline.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pyarrow")

from smallstalk.analytics import gen, report, source  # noqa: E402
from smallstalk.core import records as r  # noqa: E402
from smallstalk.core.model import NS  # noqa: E402
from smallstalk.storage import aof, compactor, logread, snapshot  # noqa: E402
from smallstalk.storage.recovery import recover  # noqa: E402


def test_generator_writes_valid_segments(tmp_path) -> None:
    dirs = gen.generate(tmp_path, 6000, servers=2, tubes=3, per_segment=700, span_s=3600)
    for d in dirs:
        rec = recover(d, repair=False)  # every record applies; no torn tails
        assert not rec.warnings and rec.state.last_seq == 3000
        assert len(aof.list_segments(d / "aof")) == 5
        ops = {type(x[1]) for _f, p in aof.list_segments(d / "aof")
               for x in logread.iter_segment(p) if not isinstance(x, aof.FrameScan)}
        assert {r.Put, r.Reserve, r.Delete, r.Release, r.Bury, r.Timeout, r.Restart} <= ops


def test_reader_decodes_segments_and_snapshots(tmp_path) -> None:
    dirs = gen.generate(tmp_path, 3000, servers=1, tubes=2, per_segment=500, span_s=1800)
    d = dirs[0]
    segments = [p for _f, p in aof.list_segments(d / "aof")]
    compactor.fold(d, segments[:3])
    parts = source.plan(source.resolve_servers([str(d)], ["web-1"]), partition_bytes=1)
    assert [p.kind for p in parts].count("snapshot") == 1
    assert sum(len(p.files) for p in parts if p.kind == "segments") == len(segments)
    rows = []
    for p in parts:
        batches = source.read_snapshot(p) if p.kind == "snapshot" else source.read_segments(p)
        rows += [x for b in batches for x in b.to_pylist()]
    logged = [x for x in rows if x["op"] != "snapshot"]
    assert sorted(x["seq"] for x in logged) == list(range(1, 3001))
    state = recover(d, repair=False).state
    snap_rows = {x["id"]: x for x in rows if x["op"] == "snapshot"}
    last_seq, items = snapshot.read_items(aof.list_snapshots(d / "snapshots")[-1][1])
    assert set(snap_rows) == {i[1] for i in items if i[0] == "job"}
    assert {x["seq"] for x in snap_rows.values()} == {last_seq}
    assert {x["server"] for x in rows} == {"web-1"}
    assert state.last_seq == 3000


def test_reader_damage_fails_or_skips(tmp_path) -> None:
    d = gen.generate(tmp_path, 1000, servers=1, tubes=1, per_segment=400, span_s=600)[0]
    first = aof.list_segments(d / "aof")[0][1]
    data = bytearray(first.read_bytes())
    data[aof.HEADER_SIZE + 100] ^= 0xFF  # a bad frame in a segment that is not the last
    first.write_bytes(bytes(data))
    (part,) = source.plan(source.resolve_servers([str(d)]), partition_bytes=1 << 30)
    with pytest.raises(aof.CorruptionError):
        list(source.read_segments(part))
    kept = sum(b.num_rows for b in source.read_segments(part, damaged="skip"))
    assert 600 <= kept < 1000  # the other segments, and the first one's good prefix


def test_server_names(tmp_path) -> None:
    for name in ("a", "b"):
        (tmp_path / "x" / name / "aof").mkdir(parents=True)
        (tmp_path / "y" / name / "aof").mkdir(parents=True)
    pairs = source.resolve_servers([str(tmp_path / "x" / "*")])
    assert [n for n, _p in pairs] == ["a", "b"]
    with pytest.raises(ValueError, match="server name 'a'"):
        source.resolve_servers([str(tmp_path / "x" / "a"), str(tmp_path / "y" / "a")])
    pairs = source.resolve_servers([str(tmp_path / "x" / "a"), str(tmp_path / "y" / "a")],
                                   ["x-a", "y-a"])
    assert [n for n, _p in pairs] == ["x-a", "y-a"]
    with pytest.raises(ValueError, match="no such data directory"):
        source.resolve_servers([str(tmp_path / "nothing-*")])
    with pytest.raises(FileNotFoundError, match="not a smallstalk data directory"):
        source.list_files(str(tmp_path))


def test_report_formatting() -> None:
    assert [report.duration(x) for x in (None, 0, 0.042, 0.42, 12.4, 1520, 65_000, 600_000,
                                         7_500_000, 36_000_000, 200_000_000)] == [
        "-", "0ms", "42µs", "0.4ms", "12ms", "1.52s", "1m05s", "10m", "2h05m", "10h", "2d07h"]
    pts = [dict(window_ns=i * 60 * NS, ready=i % 7, delayed=0, reserved=1, buried=0)
           for i in range(5000)]
    small = report.downsample(pts, 1000)
    assert len(small) == 1000 and max(p["ready"] for p in small) == 6
    svg = report.backlog_chart(small, "minute")
    assert svg.startswith("<figure>") and "<polygon" in svg


def test_main_rejects_bad_arguments(tmp_path, capsys) -> None:
    from smallstalk.analytics import main

    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no such data directory" in capsys.readouterr().err
    (tmp_path / "d" / "aof").mkdir(parents=True)
    assert main([str(tmp_path / "d"), "--out", str(tmp_path / "o"), "--server-name", "a",
                 "--server-name", "b"]) == 2
    assert "2 server names for 1 data directories" in capsys.readouterr().err


def test_master_url_errors_are_one_line_and_need_no_jvm(tmp_path, capsys) -> None:
    """A spark:// master nobody listens on, or a URL that is not one, is refused up front."""
    pytest.importorskip("pyspark")
    import socket

    from smallstalk.analytics import main

    (tmp_path / "d" / "aof").mkdir(parents=True)
    with socket.socket() as s:  # bound, not listening: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        url = f"spark://127.0.0.1:{port}"
        assert main([str(tmp_path / "d"), "--out", str(tmp_path / "o"), "--master", url]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (f"smallstalk analyze: cannot reach the Spark master {url} (127.0.0.1:"
                       f"{port}: Connection refused): start it, or give the spark://HOST:PORT "
                       "it logs (\"Starting Spark master at ...\")")
    assert main([str(tmp_path / "d"), "--out", str(tmp_path / "o"),
                 "--master", "spark://127.0.0.1"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "smallstalk analyze: spark://127.0.0.1: a standalone master URL is spark://HOST:PORT")
    assert main([str(tmp_path / "d"), "--out", str(tmp_path / "o"),
                 "--py-files", str(tmp_path / "smallstalk.zip")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"smallstalk analyze: --py-files: {tmp_path / 'smallstalk.zip'}: no such file")


def test_missing_module_on_the_executors_is_explained() -> None:
    from smallstalk.analytics.command import explain

    def failure(module: str) -> Exception:  # the shape of a failed task as PySpark raises it
        return RuntimeError("An error occurred while calling o97.collectToPython.\n"
                            "org.apache.spark.SparkException: Job aborted due to stage failure\n"
                            "  File \"<frozen importlib._bootstrap>\", line 1140\n"
                            f"ModuleNotFoundError: No module named '{module}'\n\tat org.apache")

    assert explain(failure("smallstalk.analytics"), "/opt/env/bin/python") == (
        "the Spark executors' Python (/opt/env/bin/python) cannot import smallstalk: pass the "
        "package with --py-files smallstalk.zip (zip -r smallstalk.zip smallstalk, in a checkout)")
    assert explain(failure("cbor2"), None) == (
        "the Spark executors cannot import cbor2: install cbor2, attrs and pyarrow in the "
        "executors' Python on every node (or ship an environment with --archives; docs/ANALYTICS.md)")
    assert explain(RuntimeError("java.io.IOException: disk full")) == \
        "java.io.IOException: disk full"
