"""The analytics pipeline on a real Spark standalone cluster, submitted as docs/ANALYTICS.md says.

A master and one two-core worker run on 127.0.0.1 (tests/support/sparkcluster.py):
one executor JVM beside the driver, in its own working directory. Two one-core
workers proved no more and made the cluster run 2.7x slower on two cores
(104 s against 38 s: two executor JVMs and their Python workers).
The nodes' Python has only what the docs tell a user to install there
(cbor2, attrs, pyarrow): smallstalk reaches the executors only through the
`--py-files smallstalk.zip` of the documented command, so an import the
executors lack, a path only the driver can read (the data directories are
given relative to the driver's working directory, and the executors run in
their own) or a missing file breaks this test, not a user's cluster run.
The input is test_analytics's scripted workload (tests/support/analytics_script.py:
five data directories, one of them a snapshot with the segments it covers),
and every output table, the summary and the printed table must equal, row
for row, those of its one in-process local run, made once per session. The
one-line errors: a master that cannot be reached, and executors that cannot
import smallstalk (the zip not passed), over a generated input.

SMALLSTALK_SPARK_RECORDS sets the generated input's size (records over two
servers).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

import pyarrow as pa  # noqa: E402
import pyarrow.dataset as ds  # noqa: E402

from ..support.analytics_script import SERVERS  # noqa: E402
from ..support.procs import REPO, free_port  # noqa: E402
from ..support.sparkcluster import (  # noqa: E402
    SparkCluster,
    node_python,
    run_logged,
    spark_env,
    start_cluster,
)

RECORDS = int(os.environ.get("SMALLSTALK_SPARK_RECORDS", "20000"))
TABLES = ("jobs", "attempts", "tube_minute", "tube_hour", "tube_summary", "servers")
# What docs/ANALYTICS.md tells a user to install on every node.
NODE_PACKAGES = ["cbor2", "attrs", "pyarrow"]
pytestmark = [
    pytest.mark.skipif(shutil.which("java") is None, reason="Spark needs Java"),
    pytest.mark.skipif(shutil.which("zip") is None, reason="zip is not installed "
                       "(make system-packages)"),
    # JVMs start slowly on a loaded machine: a master, a worker, an executor, two drivers.
    pytest.mark.timeout(1200),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("spark-cluster")


@pytest.fixture(scope="module")
def cluster(tmp) -> Iterator[SparkCluster]:
    c = start_cluster(tmp, workers=1, cores=2)  # its JVMs start while the inputs are made
    try:
        yield c
    finally:
        c.stop()  # by PID, also when a test failed


@pytest.fixture(scope="module")
def setup(tmp) -> dict[str, Any]:
    """The input (two servers, relative to `tmp`), the zip and the nodes' Python."""
    subprocess.run([sys.executable, "-m", "smallstalk.analytics.gen", str(tmp / "data"),
                    "--records", str(RECORDS), "--servers", "2", "--hours", "2"],
                   check=True, capture_output=True, cwd=REPO)
    # docs: zip -r smallstalk.zip smallstalk   # from a checkout
    subprocess.run(["zip", "-qr", str(tmp / "smallstalk.zip"), "smallstalk"],
                   check=True, cwd=REPO)
    python = node_python(tmp / "node-env", NODE_PACKAGES)
    check = subprocess.run([str(python), "-c", "import smallstalk"], capture_output=True, cwd=tmp)
    assert check.returncode != 0  # the nodes' Python has only what the docs name
    # docs: run the pip package's spark-submit with its environment active
    env = spark_env(tmp)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.pop("PYSPARK_PYTHON", None)
    env.pop("VIRTUAL_ENV", None)
    return dict(servers=["data/server-1", "data/server-2"], python=python, env=env)


def table(out: Path, name: str) -> list[dict[str, Any]]:
    part = ds.partitioning(pa.schema([("tube", pa.string()), ("day", pa.string())]),
                           flavor="hive")
    return ds.dataset(out / name, format="parquet", partitioning=part).to_table().to_pylist()


def canonical(rows: list[dict[str, Any]]) -> list[str]:
    """Rows as sortable strings: the same rows in any file or partition order compare equal."""
    return sorted(repr(sorted(row.items())) for row in rows)


@pytest.fixture(scope="module")
def cluster_run(tmp, setup, cluster, analytics_workload) -> dict[str, Any]:
    """The scripted workload of test_analytics, analyzed on the cluster: its
    in-process run (`analytics_run`, made once per session) is the local run
    to compare with, so no second local run is needed."""
    here = analytics_workload["tmp"]
    shutil.copy(tmp / "smallstalk.zip", here / "smallstalk.zip")
    cluster.wait_ready()
    started = time.monotonic()
    # The command of docs/ANALYTICS.md, "On a standalone cluster", as a user types it.
    cmd = ["spark-submit", "--master", cluster.url,
           "--conf", f"spark.pyspark.python={setup['python']}",
           "--py-files", "smallstalk.zip",
           str(REPO / "smallstalk" / "analytics" / "submit.py"),
           *SERVERS, "--out", "out-cluster", "--report", "cluster.html"]
    rc, out, err = run_logged(cmd, env=setup["env"], cwd=here, log=tmp / "cluster.err",
                              timeout=900)
    assert rc == 0, f"{err[-6000:]}\n{cluster.log()}"
    return dict(out=here / "out-cluster", html=(here / "cluster.html").read_text(), stdout=out,
                stderr=err, seconds=time.monotonic() - started)


def test_cluster_run_equals_local_run_row_for_row(cluster, analytics_run, cluster_run,
                                                  tmp) -> None:
    local_run = analytics_run
    # The executor did the work: the worker ran an executor of the application, and it
    # finished tasks (an executor's log is in its worker's --work-dir).
    assert cluster.state()["completedapps"], "no application ran on the cluster"
    logs = [x.read_text(errors="replace") for x in (tmp / "worker-1").glob("app-*/*/stderr")]
    assert any("Finished task" in log for log in logs), "worker-1 ran no task"
    for name in TABLES:
        got = table(cluster_run["out"], name)
        want = table(local_run["out"], name)
        assert want, name
        assert len(got) == len(want), name
        assert canonical(got) == canonical(want), name
    jobs = table(cluster_run["out"], "jobs")
    assert {j["server"] for j in jobs} == set(SERVERS)
    summary = json.loads((cluster_run["out"] / "summary.json").read_text())
    assert summary == local_run["summary"]
    # The printed table (spark-submit merges the driver's stderr, the progress, into stdout).
    progress = re.compile(r"^\[\d\d:\d\d\] ")
    printed = [x for x in cluster_run["stdout"].splitlines() if not progress.match(x)]
    assert printed == local_run["stdout"].splitlines()
    page = cluster_run["html"]
    assert page.count("<svg") >= 4 and "Tube emails" in page
    print(f"cluster {cluster_run['seconds']:.0f}s over the scripted workload "
          f"({', '.join(SERVERS)})")


def test_executors_that_lack_smallstalk_get_one_line(tmp, setup, cluster) -> None:
    """`smallstalk analyze --master` without --py-files: the executors cannot import it."""
    cluster.wait_ready()
    env = dict(setup["env"], PYSPARK_PYTHON=str(setup["python"]))
    rc, out, err = run_logged(
        [sys.executable, "-m", "smallstalk", "analyze", *setup["servers"], "--out",
         "out-nozip", "--master", cluster.url], env=env, cwd=tmp, log=tmp / "nozip.err",
        timeout=600)
    assert rc == 1, err
    ours = [line for line in err.splitlines() if line.startswith("smallstalk analyze:")]
    assert ours == [
        f"smallstalk analyze: failed: the Spark executors' Python ({setup['python']}) cannot "
        "import smallstalk: pass the package with --py-files smallstalk.zip "
        "(zip -r smallstalk.zip smallstalk, in a checkout)"], err
    assert err.rstrip().endswith(ours[0])
    assert "Traceback" not in err and "\tat " not in err, err


def test_unreachable_master_under_spark_submit_gets_one_line(tmp, setup) -> None:
    """The master spark-submit was given is read from its JVM and checked before a context
    starts (tests/unit/test_analytics_reader.py checks `smallstalk analyze --master`)."""
    port = free_port()  # nothing listens there
    url = f"spark://127.0.0.1:{port}"
    rc, out, err = run_logged(
        ["spark-submit", "--master", url, "--conf", f"spark.pyspark.python={setup['python']}",
         "--py-files", "smallstalk.zip", str(REPO / "smallstalk" / "analytics" / "submit.py"),
         *setup["servers"], "--out", "out-unreachable"],
        env=setup["env"], cwd=tmp, log=tmp / "unreachable.err", timeout=300)
    assert rc == 2, f"{out}\n{err}"
    # spark-submit merges the driver's stderr into its stdout
    assert out.rstrip().splitlines()[-1] == (
        f"smallstalk analyze: cannot reach the Spark master {url} (127.0.0.1:{port}: "
        "Connection refused): start it, or give the spark://HOST:PORT it logs "
        "(\"Starting Spark master at ...\")"), f"{out}\n{err}"
    assert "Traceback" not in out + err and "\tat " not in out + err, f"{out}\n{err}"
