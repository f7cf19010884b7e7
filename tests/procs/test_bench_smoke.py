"""The benchmark harness (bench/run.py) runs end to end in its tiny mode, and
bench/wakeparts.py, which patches trio's internals to stamp them, still can.

Not a performance test: no number is judged, only that both servers and the
floor (bench/floor.py) were driven in every durability mode, the writing floor
beside the `--fsync never` rows, the open-loop section paced all three, and the
table, JSON and markdown came out well formed; and that the writing floor's log
holds each put it answered.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

from ..support.procs import REPO, free_port, needs_beanstalkd

SERVERS = ("smallstalk", "beanstalkd")

pytestmark = needs_beanstalkd


def test_bench_tiny_mode_produces_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # A copy of the package that says which build it is in its own words
    # (`--source`, as an A/B run or a compiled copy is measured): the run
    # must report the build it measured, not the checkout's.
    source = tmp_path / "source"
    shutil.copytree(REPO / "smallstalk", source / "smallstalk",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    state = source / "smallstalk" / "core" / "state.py"
    code = state.read_text()
    assert code.count("\nBUILD = ") == 1
    state.write_text(re.sub(r"\nBUILD = .*", '\nBUILD = "the copy under test"', code))
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--tiny", "--out", str(out),
         "--tmp", str(tmp_path), "--source", str(source)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    # The printed table names both servers, their ratio and every section.
    text = proc.stdout
    for needle in ("ops/s ss", "ops/s bs", "ratio", "ss/floor", "bs/floor", "no persistence",
                   "--fsync never", "--fsync always", "The floor", "Open loop", "Memory: RSS",
                   "Restart with", "import trio", "Targets", "ss/wfloor", "bs/wfloor"):
        assert needle in text, needle

    results = json.loads((out / "latest-tiny.json").read_text())
    stamped = [p for p in out.glob("*.json") if not p.name.startswith("latest")]
    assert len(stamped) == 1 and json.loads(stamped[0].read_text()) == results
    assert results["meta"]["preset"] == "tiny"
    assert results["meta"]["build"] == "the copy under test"  # as the table says
    assert "the copy under test" in text

    points = results["points"]
    assert {p["mode"] for p in points} == {"memory", "never", "always"}
    for p in points:
        if p["workload"] == "put-unique":
            continue  # smallstalk's alone, beside its plain put: checked below
        assert set(p["servers"]) == set(SERVERS)
        for kind, r in p["servers"].items():
            where = f"{p['mode']}/{p['workload']}/{p['conns']} {kind}"
            assert "error" not in r, f"{where}: {r['error']}"
            assert r["ops"] > 0 and r["ops_per_sec"] > 0, where
            assert r["server_cpu_us_per_op"] is not None, where
            assert r["lat_p50_us"] is not None and r["lat_p99_us"] >= r["lat_p50_us"], where
        assert set(p["ratio"]) >= {"ops_per_sec", "server_cpu_us_per_op"}
        # Each row is measured against the floor's puts at its connections.
        assert p["floor"] in results["floor"], p["floor"]
        assert all(v is not None and v > 0 for v in p["vs_floor"].values()), p["vs_floor"]
        # --fsync never rows also against the writing floor, and only those.
        assert ("vs_floor_log" in p) == (p["mode"] == "never"), p
        if p["mode"] == "never":
            assert p["floor"] in results["floor_log"], p["floor"]
            assert all(v is not None and v > 0 for v in p["vs_floor_log"].values()), p

    # reserve-batch: smallstalk's rd-batch beside beanstalkd's pipelined reserve+delete.
    (batch,) = [p for p in points if p["workload"] == "rd-batch"]
    assert batch["baseline"] == "rd-pipe"
    assert {k: r["workload"] for k, r in batch["servers"].items()} == {
        "smallstalk": "rd-batch", "beanstalkd": "rd-pipe"}
    assert "reserve-batch 100" in text

    # The floor answered every put it was sent, saturated.
    assert set(results["floor"]) == {"put/2", "put-pipe/1", "put-pipe/2"}
    assert set(results["floor_log"]) == {"put/2", "put-pipe/1"}  # the never points'
    for point, r in [*results["floor"].items(), *results["floor_log"].items()]:
        assert "error" not in r and r["ops"] > 0 and r["errors"] == 0, point
        assert r["server_cpu_us_per_op"] > 0, point

    # Open loop: the same offered load to all three, paced, and what each got.
    (row,) = results["open_loop"]
    assert (row["workload"], row["conns"]) == ("put", 2)
    assert row["offered_cmds_per_sec"] > 0
    for kind, r in [*row["servers"].items(), ("floor", row["floor_result"])]:
        assert "error" not in r, f"open loop {kind}: {r['error']}"
        assert abs(r["offered_cmds_per_sec"] - row["offered_cmds_per_sec"]) <= 1, kind
        # Paced: never more than offered (a little slack for the phases' start).
        assert 0 < r["cmds_per_sec"] <= 1.05 * r["offered_cmds_per_sec"], kind
        assert r["server_cpu_us_per_op"] > 0, kind
    assert all(v is not None for v in row["vs_floor"].values())

    for section, key in (("rss", "bytes_per_job"), ("startup", "ready_s")):
        servers = results[section]["servers"]
        assert set(servers) == set(SERVERS), section
        for kind, r in servers.items():
            assert "error" not in r, f"{section} {kind}: {r['error']}"
            assert isinstance(r[key], int | float), f"{section} {kind}"
        assert results[section]["ratio"] is not None
    # Hand-off: the server's side (to the kernel's receive stamp on the worker's socket)
    # is part of the whole; the idle put is measured for both servers and the floor.
    for mode, m in results["handoff"]["modes"].items():
        for kind, r in m["servers"].items():
            assert "error" not in r, f"hand-off {mode} {kind}: {r['error']}"
            assert 0 < r["server_p50_us"] <= r["p50_us"], (mode, kind, r)
    idle = results["handoff"]["idle_put"]["servers"]
    assert set(idle) == {*SERVERS, "floor"}
    assert all("error" not in r and 0 < r["p50_us"] <= r["p99_us"] for r in idle.values()), idle
    assert "One put after the hand-off's idle pause" in text and "srv p50 ss" in text
    assert results["spawn"]["import_trio"]["median_ms"] > 0
    assert results["targets"] and all("ratio" in t for t in results["targets"])
    # The keyed put is judged against smallstalk's plain put in its own rounds.
    keyed = next(r for r in results["points"] if r["workload"] == "put-unique")
    plain = keyed["plain_put"]
    assert set(keyed["servers"]) == {"smallstalk"}, keyed["servers"].keys()
    assert "error" not in plain and plain["ops"] > 0 and plain["workload"] == "put", plain
    judged = next(t for t in results["targets"] if t["target"].startswith("keyed put"))
    assert judged["beanstalkd"] == plain["server_cpu_us_per_op"], judged
    assert any(t["target"].startswith("spawn") and t["beyond_trio_ms"] is not None
               for t in results["targets"])

    md = (out / "latest-tiny.md").read_text()
    assert "| mode | workload | conns |" in md and "|---" in md and "ss/floor" in md

    # The goals judged across runs (here the same run twice): each goal the
    # run judged is a row with both runs' values, their median and the count.
    run_json = str(stamped[0])
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--across", run_json, run_json,
         "--markdown"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stamp = results["meta"]["timestamp"]
    assert f"| target | point | {stamp} | {stamp} | median | goal |" in proc.stdout
    rows = [line for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| target")]
    assert len(rows) == len(results["targets"])
    for t, line in zip(results["targets"], rows, strict=True):
        assert line.startswith(f"| {t['target']} | {t['point']} |"), (t, line)
        if t["met"] is not None:
            assert line.endswith("| yes | 2 of 2 |" if t["met"] else "| NO | 0 of 2 |"), line
    assert "different code" not in proc.stdout  # one tree


def test_the_writing_floor_logs_each_put_it_answers(tmp_path: Path) -> None:
    log = tmp_path / "records.log"
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "floor.py"), "-l", "127.0.0.1",
                             "-p", str(port), "--log", str(log)], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=10)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "floor never listened"
                time.sleep(0.05)
        bodies = [b"first", b"", b"x" * 300, b"a\r\nb"]
        with conn:
            conn.sendall(b"".join(b"put 0 0 60 %d\r\n%s\r\n" % (len(b), b) for b in bodies))
            want = b"".join(b"INSERTED %d\r\n" % i for i in range(1, len(bodies) + 1))
            got = b""
            while len(got) < len(want):
                chunk = conn.recv(4096)
                assert chunk, "the floor closed the connection"
                got += chunk
        assert got == want
        # Every answered put is in the log, framed, in order.
        data, pos, logged = log.read_bytes(), 0, []
        while pos < len(data):
            n, crc = struct.unpack_from("<II", data, pos)
            payload = data[pos + 8:pos + 8 + n]
            assert len(payload) == n and zlib.crc32(payload) == crc
            seq, stamp = struct.unpack_from("<QQ", payload)
            logged.append((seq, payload[16:]))
            assert stamp > 0
            pos += 8 + n
        assert logged == list(enumerate(bodies, 1))
    finally:
        proc.kill()
        proc.wait()


def test_wakeparts_stamps_every_part_of_a_hand_off() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "wakeparts.py"), "--samples", "30",
         "--port", str(free_port())],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = {line[:52].strip(): line[52:].split() for line in proc.stdout.splitlines()
            if line[:1] in ("t", "-", "(", "s") and len(line) > 52}
    assert "30 hand-offs" in proc.stdout
    parts = [r for name, r in rows.items() if name != "part"]
    assert len(parts) == 7, rows
    for p50, p90, p99 in parts:  # every stamp was taken: no part is negative or absurd
        assert 0 <= float(p50) <= float(p90) <= float(p99) < 1e6


def test_a_read_without_a_receive_stamp_has_no_server_side() -> None:
    # The kernel now and then gives a read no SO_TIMESTAMPNS stamp: that
    # sample's server side is unknown (None), not an error for the whole point.
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import measure
    finally:
        sys.path.pop(0)
    a, b = socket.socketpair()  # never asked to stamp
    with a, b:
        a.sendall(b"INSERTED 1\r\n")
        assert measure.recv_stamped(b) == (b"INSERTED 1\r\n", None)
    listener = socket.create_server(("127.0.0.1", free_port()))
    with listener, socket.create_connection(listener.getsockname()) as client:
        server, _ = listener.accept()
        with server, measure.stamped(client):
            # Linux turns receive stamps on for the whole system in a deferred
            # work item the first time a socket asks (net_enable_timestamp), so
            # a process's first reads may come unstamped: up to 50 tries.
            for _ in range(50):
                server.sendall(b"INSERTED 2\r\n")
                data, t_rx = measure.recv_stamped(client)
                assert data == b"INSERTED 2\r\n"
                if t_rx is not None:
                    break
                time.sleep(0.01)
            assert isinstance(t_rx, int) and t_rx > 0
