"""A Spark standalone cluster on 127.0.0.1 for process tests: a master and workers, by PID.

The pyspark package has Spark's jars and `bin/spark-class` but no
`sbin/start-master.sh`, so the daemons are started as docs/ANALYTICS.md
tells a user to: `spark-class org.apache.spark.deploy.master.Master` and
`...deploy.worker.Worker`. `spark-class` execs the JVM, so the PID we get
is the daemon's. Executors (JVMs the workers start) and their Python
workers are found under those PIDs and killed by PID too: `stop()` leaves
nothing behind, also when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import venv
from importlib import metadata
from pathlib import Path

import attrs

from .procs import children, free_port


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def spark_env(tmp: Path) -> dict[str, str]:
    """The environment of every Spark process here: loopback only, scratch under `tmp`."""
    conf = tmp / "spark-conf"  # empty: no spark-defaults.conf from elsewhere
    conf.mkdir(exist_ok=True)
    return dict(os.environ, SPARK_HOME=str(spark_home()), SPARK_CONF_DIR=str(conf),
                SPARK_LOCAL_IP="127.0.0.1", SPARK_LOCAL_DIRS=str(tmp / "spark-local"),
                # The master's REST submission server would take a fixed port (6066).
                SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false")


def descendants(pids: list[int]) -> list[int]:
    out: list[int] = []
    todo = list(pids)
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pids: list[int], grace: float = 20.0) -> None:
    """SIGTERM `pids` (their shutdown hooks stop executors), then SIGKILL whatever is left
    of them and of the processes they started."""
    family = pids + descendants(pids)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in family):
        time.sleep(0.1)
    for pid in family + descendants(family):
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
    except OSError:
        return False
    return st[st.rfind(b")") + 2:].split()[0] != b"Z"


@attrs.define
class SparkCluster:
    url: str
    ui_port: int
    procs: list[subprocess.Popen]  # the master first
    logs: list[Path]
    workers: int

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Until every worker has registered with the master (JVMs start slowly)."""
        deadline = time.monotonic() + timeout
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Spark daemon exited with {p.returncode}\n{self.log()}")
            try:
                if self.state().get("aliveworkers") == self.workers:
                    return
            except OSError:
                pass  # the master's UI is not up yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.workers} workers did not register within {timeout}s"
                                   f"\n{self.log()}")
            time.sleep(0.5)

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return json.load(r)

    def log(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in self.logs if p.exists())

    def stop(self) -> None:
        kill_tree([p.pid for p in reversed(self.procs)])
        for p in self.procs:
            p.wait(timeout=30)


def start_cluster(tmp: Path, workers: int = 2, cores: int = 1,
                  memory: str = "1g") -> SparkCluster:
    """Launch a master and `workers` workers on 127.0.0.1; `wait_ready` waits for them."""
    env = spark_env(tmp)
    spark_class = str(spark_home() / "bin" / "spark-class")
    port, ui_port = free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    cluster = SparkCluster(url, ui_port, [], [], workers)

    def launch(name: str, args: list[str]) -> None:
        log = tmp / f"{name}.log"
        with open(log, "wb") as out:
            cluster.procs.append(subprocess.Popen([spark_class, *args], stdout=out,
                                                  stderr=subprocess.STDOUT, env=env, cwd=tmp))
        cluster.logs.append(log)

    try:
        launch("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                          "--port", str(port), "--webui-port", str(ui_port)])
        for i in range(1, workers + 1):
            work = tmp / f"worker-{i}"
            work.mkdir()
            launch(f"worker-{i}", ["org.apache.spark.deploy.worker.Worker", "--host",
                                   "127.0.0.1", "--cores", str(cores), "--memory", memory,
                                   "--webui-port", str(free_port()), "--work-dir", str(work),
                                   url])
    except BaseException:
        cluster.stop()
        raise
    return cluster


def node_python(directory: Path, packages: list[str]) -> Path:
    """A Python that has only `packages` (and what they require), as a node where someone
    ran `pip install PACKAGES` has: a venv whose site-packages links this environment's copies.

    Not this interpreter's environment: here smallstalk is installed (editable),
    and a node's Python that had it would hide a package the docs forget to ship.
    """
    venv.create(directory, with_pip=False)
    site = directory / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    seen: set[str] = set()

    def add(name: str) -> None:
        key = name.lower().replace("_", "-")
        if key in seen:
            return
        seen.add(key)
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}:
            src = Path(str(dist.locate_file(top))).resolve()
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
        for req in dist.requires or ():
            if "extra ==" not in req:
                add(_requirement_name(req))

    for name in packages:
        add(name)
    return directory / "bin" / "python"


def _requirement_name(req: str) -> str:
    end = next((i for i, c in enumerate(req) if not (c.isalnum() or c in "-_.")), len(req))
    return req[:end]


def run_logged(cmd: list[str], *, env: dict[str, str], cwd: Path, log: Path,
               timeout: float) -> tuple[int, str, str]:
    """Run `cmd` (stdout and stderr kept apart); on timeout kill it and what it started."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree([proc.pid], grace=5)
            proc.communicate()
            raise AssertionError(f"{cmd[:3]} ran past {timeout}s:\n{log.read_text()[-4000:]}") \
                from None
        except BaseException:  # the test was interrupted: leave nothing running
            kill_tree([proc.pid], grace=5)
            raise
    return proc.returncode, out.decode(errors="replace"), log.read_text(errors="replace")
