"""explain-job and reserve-batch over real sockets against a real server
process: the raw bytes, the client library's `explain` and `reserve_many`,
and the `smallstalk explain` command line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from smallstalk.client import AsyncClient, Client, NotFound, TimedOut

from ..support.bsclient import Client as Raw
from ..support.procs import REPO, smallstalk_cmd, start_smallstalk


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triage")
    srv = start_smallstalk(tmp, data_dir=tmp / "data")
    yield srv
    srv.stop()


def test_explain_over_a_socket(server) -> None:
    with Raw(server.port, source="127.0.0.3") as worker, Raw(server.port) as other:
        worker.call(b"use explain-sock\r\n")
        worker.call(b"watch explain-sock\r\n")
        jid = worker.put(b"hello", ttr=100).id
        assert worker.call(b"reserve-job %d\r\n" % jid).status == b"RESERVED"
        reply = other.call(b"explain-job %d\r\n" % jid)
        assert reply.status == b"OK" and len(reply.body) == int(reply.args[0])
        text = reply.body.decode()
        assert "state: reserved\n" in text and "tube: \"explain-sock\"\n" in text
        # The reserver's own address, as the server saw it connect.
        m = re.search(r"reserved by connection \d+ \(127\.0\.0\.3\) with (\d+) s of TTR left",
                      text)
        assert m is not None and 80 <= int(m.group(1)) <= 100, text
        assert other.call(b"explain-job 999999\r\n").status == b"NOT_FOUND"
        assert other.call(b"explain-job -1\r\n").status == b"BAD_FORMAT"


def test_client_explain_and_the_cli(server) -> None:
    addr = f"127.0.0.1:{server.port}"
    with Client(addr) as c:
        c.use("explain-cli")
        job = c.put(b"x", delay=500)
        ex = c.explain(job)
        assert ex.state == "delayed" and ex.tube == "explain-cli"
        assert len(ex.reasons) >= 1 and ex.reasons[0].startswith("delayed until ")
        with pytest.raises(NotFound):
            c.explain(987654)
        out = subprocess.run([*smallstalk_cmd(), "explain", addr, str(job.id)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == f"job {job.id} in tube explain-cli: delayed (priority {ex.pri})"
        assert lines[1].startswith("  - delayed until ")
        assert any("no connection watches tube explain-cli" in ln for ln in lines), lines
    out = subprocess.run([*smallstalk_cmd(), "explain", addr, "987654"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr == f"smallstalk explain: {addr} has no job 987654\n"
    out = subprocess.run([*smallstalk_cmd(), "explain", addr], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("smallstalk explain: takes two arguments")


def test_reserve_batch_over_a_socket(server) -> None:
    with Raw(server.port) as c:
        c.call(b"use batch-raw\r\n")
        c.call(b"watch batch-raw\r\n")
        c.call(b"ignore default\r\n")
        ids = [c.put(b"job-%d" % i).id for i in range(3)]
        c.send(b"reserve-batch 5 0\r\n")
        head = c.read()
        assert head.line == b"RESERVED_BATCH 3"
        got = [c.read() for _ in range(3)]
        assert [(r.status, r.id, r.body) for r in got] == [
            (b"RESERVED", i, b"job-%d" % n) for n, i in enumerate(ids)]
        assert c.call(b"reserve-batch 5 0\r\n").line == b"TIMED_OUT"
        for i in ids:
            assert c.call(b"delete %d\r\n" % i).status == b"DELETED"


def test_client_reserve_many(server) -> None:
    addr = f"127.0.0.1:{server.port}"
    with Client(addr) as c, Client(addr) as producer:
        producer.use("batch-client")
        puts = [producer.put(b"b%d" % i, ttr=30) for i in range(5)]
        jobs = c.reserve_many(3, timeout=0, tubes=["batch-client"])
        assert [(j.id, j.body) for j in jobs] == [(p.id, b"b%d" % n) for n, p in
                                                   enumerate(puts[:3])]
        rest = c.reserve_many(10, timeout=0)
        assert [j.id for j in rest] == [p.id for p in puts[3:]]
        # delete_many: one write; the jobs answered NOT_FOUND come back.
        c.delete(rest[0])
        assert c.delete_many([*jobs, rest[0], rest[1]]) == [rest[0]]
        for j in [*jobs, rest[1]]:
            with pytest.raises(NotFound):
                producer.stats_job(j)
        with pytest.raises(TimedOut):
            c.reserve_many(2, timeout=0)
        with pytest.raises(ValueError):
            c.reserve_many(0)
        # A wait: the batch is answered once a job arrives.
        producer.put(b"late", delay=1)
        (late,) = c.reserve_many(4, timeout=30)
        assert late.body == b"late"


def test_move_job_over_a_socket(server) -> None:
    addr = f"127.0.0.1:{server.port}"
    with Raw(server.port) as raw, Client(addr) as c:
        raw.call(b"use move-src\r\n")
        jid = raw.put(b"m", pri=5).id
        assert raw.call(b"move-job %d move-dst\r\n" % jid).line == b"MOVED move-dst"
        assert raw.stats_job(jid)["tube"] == "move-dst"
        c.move_job(jid, "move-back")
        assert c.stats_job(jid).tube == "move-back"
        c.watch("move-back")
        job = c.reserve(timeout=0)
        assert job.id == jid
        with Client(addr) as other, pytest.raises(NotFound):  # reserved: not moved
            other.move_job(jid, "elsewhere")
        c.delete(job)


def test_the_bench_load_generator_consumes_with_reserve_batch(tmp_path) -> None:
    """bench/loadgen.py's rd-batch workload reads the batch frame without error
    and consumes exactly the jobs there are (on a server of its own)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import loadgen
    finally:
        sys.path.remove(str(REPO / "bench"))
    srv = start_smallstalk(tmp_path)
    try:
        pre = loadgen.run(srv.port, "load", 2, total=2000, duration=30.0, procs=1)
        assert pre["ops"] == 2000
        res = loadgen.run(srv.port, "rd-batch", 2, duration=30.0, depth=10, procs=1)
        assert (res["ops"], res["errors"]) == (2000, 0)
        with Raw(srv.port) as c:
            assert c.stats()["current-jobs-ready"] == "0"
            assert c.stats()["current-jobs-reserved"] == "0"
    finally:
        srv.stop()


async def test_the_trio_client_explains_reserves_many_and_moves(server) -> None:
    async with AsyncClient(f"127.0.0.1:{server.port}") as c:
        await c.use("trio-batch")
        ids = [(await c.put(b"t%d" % i)).id for i in range(3)]
        await c.move_job(ids[2], "trio-other")
        ex = await c.explain(ids[2])
        assert (ex.tube, ex.state) == ("trio-other", "ready")
        jobs = await c.reserve_many(5, timeout=0, tubes=["trio-batch"])
        assert [j.id for j in jobs] == ids[:2]
        assert (await c.explain(ids[0])).reasons[0].startswith("reserved by connection ")
        for j in jobs:
            await c.delete(j)
        await c.delete(ids[2])
