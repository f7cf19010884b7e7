"""Fixtures shared by process tests: for the replay tools' tests (test_aof_tools,
test_replay_tool, test_job_history, test_history_reader) the scenario's data
directory, made once per session, and the same history folded away by the
compactor; for the HA tests (test_failover, test_policies) a one-member etcd
(`store`) and three-member clusters on it with a short lease (`cluster_factory`);
for the analytics tests (test_analytics, test_analytics_cluster) the scripted
workload and its one in-process `smallstalk analyze` run
(tests/support/analytics_script.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from smallstalk.storage import aof

from ..support.analytics_script import (  # noqa: F401 (session fixtures, used by name)
    analytics_run,
    analytics_spark,
    analytics_workload,
)
from ..support.hacluster import start_cluster, start_etcd
from ..support.procs import start_smallstalk
from ..support.toollogs import run_scenario, wait_until

HA_TTL = 2  # --ha-ttl of `cluster_factory`'s members: a failover in seconds


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tools")
    data = tmp / "data"
    run_scenario(tmp, data)
    return data


@pytest.fixture(scope="session")
def folded_dir(log_dir: Path, tmp_path_factory) -> Path:
    """The same history after a server compacted it: seqs 1..30 only in a snapshot."""
    tmp = tmp_path_factory.mktemp("folded")
    data = tmp / "data"
    shutil.copytree(log_dir, data)
    srv = start_smallstalk(tmp, "--compact-interval", "0.1", data_dir=data)  # 31: restart
    try:
        wait_until(lambda: aof.list_snapshots(data / "snapshots")
                   and len(aof.list_segments(data / "aof")) == 1, "the compaction", 20)
        srv.stop()
    finally:
        srv.kill()
    return data


@pytest.fixture
def store(tmp_path):
    s = start_etcd(tmp_path)
    yield s
    s.stop()


@pytest.fixture
def cluster_factory(tmp_path, store):
    """`make(*flags)`: three members n1..n3 on `store`, each with `flags`; all stopped after."""
    made = []

    def make(*flags: str):
        c = start_cluster(tmp_path, store, *flags, ttl=HA_TTL)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()
