"""explain-job and reserve-batch over real sockets against a real server
process: the raw bytes, the client library's `explain` and `reserve_many`,
and the `smallstalk explain` command line."""

from __future__ import annotations

import re
import subprocess

import pytest

from smallstalk.client import Client, NotFound

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
