"""The cluster in compose.yaml, brought up with podman-compose as a user runs it.

etcd, three smallstalk members and HAProxy come up from the top-level compose.yaml
(the smallstalk image built from the Containerfile by test_container's fixtures, the
etcd/HAProxy image built by podman-compose from contrib/compose/); a greenstalk
producer puts through HAProxy's published port (127.0.0.1 only; its replica port
serves a replica, which refuses the put with READ_ONLY); the primary's
container is killed (`podman kill`, SIGKILL); the producer reconnects and carries on,
and every put that was acknowledged, before or after the kill, is on the new primary.

This machine kind needs podman's runc runtime and cgroupfs: a containers.conf of the
test's own (CONTAINERS_CONF) says so, for podman-compose's podman commands only. The
project name is the test's own; teardown removes that project's containers, volumes
and network, nothing else. SMALLSTALK_COMPOSE_PUTS bounds the producer (default 300
after the kill).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from pathlib import Path

import greenstalk
import pytest

from tests.procs.test_container import LIMITS, base, image, podman, run  # noqa: F401
from tests.support.procs import REPO, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PUTS_AFTER_KILL = int(os.environ.get("SMALLSTALK_COMPOSE_PUTS", "300"))
HA_TTL = "4"  # seconds; shorter than the shipped 10 s, long enough for 2 busy cores
CONF = """\
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
"""


class Cluster:
    """One podman-compose project: its command line and the names it started."""

    def __init__(self, project: str, env: dict[str, str], port: int, replica_port: int) -> None:
        self.project = project
        self.env = env
        self.port = port
        self.replica_port = replica_port

    def compose(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        cmd = ["podman-compose", "-f", str(REPO / "compose.yaml"), "-p", self.project,
               "--podman-build-args", " ".join([*LIMITS, "--pull=never"]), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=self.env, cwd=REPO)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        return proc

    def containers(self) -> dict[str, str]:
        """Service name -> container name, for this project's running containers."""
        out = podman("ps", "--filter", f"label=io.podman.compose.project={self.project}",
                     "--format", "json").stdout
        return {c["Labels"]["com.docker.compose.service"]: c["Names"][0]
                for c in json.loads(out or "[]")}

    def leader(self, via: str, timeout: float = 60) -> str:
        """The member holding the lock, as `smallstalk ha status` in container `via` says."""
        deadline = time.monotonic() + timeout
        while True:
            proc = podman("exec", via, "smallstalk", "ha", "status", "--etcd",
                          "http://etcd:2379", check=False, timeout=60)
            found = re.search(r"^leader: (n\d)\b", proc.stdout, re.M)
            if found:
                return found.group(1)
            if time.monotonic() > deadline:
                raise AssertionError(f"`smallstalk ha status` in {via} names no leader "
                                     f"(exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
            time.sleep(0.5)

    def logs(self) -> str:
        out = []
        for service, name in sorted(self.containers().items()):
            proc = podman("logs", "--tail", "30", name, check=False)
            out.append(f"--- {service}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return "\n".join(out)

    def remove(self) -> None:
        """This project's containers, volumes and network, by its label; nothing else."""
        label = f"label=io.podman.compose.project={self.project}"
        names = podman("ps", "-a", "-q", "--filter", label, check=False).stdout.split()
        if names:
            podman("rm", "-f", "-t", "0", *names, check=False)
        for kind in ("volume", "network"):
            found = podman(kind, "ls", "-q", "--filter", label, check=False).stdout.split()
            if found:
                podman(kind, "rm", "-f", *found, check=False)


@pytest.fixture
def cluster(image: str, tmp_path: Path):  # noqa: F811 (test_container's fixture)
    if shutil.which("podman-compose") is None:
        pytest.fail("the compose test needs podman-compose: run `make test` as root "
                    "(it installs it), or `apt-get install podman-compose`")
    conf = tmp_path / "containers.conf"
    conf.write_text(CONF)
    token = tmp_path / "admin.token"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o644)  # the members run as uid 10001; the file is bind-mounted as it is
    port, replica_port = free_port(), free_port()
    env = {**os.environ, "CONTAINERS_CONF": str(conf), "SMALLSTALK_IMAGE": image,
           "SMALLSTALK_ADMIN_TOKEN_FILE": str(token), "SMALLSTALK_PORT": str(port),
           "SMALLSTALK_REPLICA_PORT": str(replica_port), "SMALLSTALK_HA_TTL": HA_TTL}
    c = Cluster(f"smallstalk-compose-{os.getpid()}", env, port, replica_port)
    try:
        yield c
    finally:
        try:
            c.compose("down", "-v", timeout=300)
        except (AssertionError, subprocess.TimeoutExpired):
            pass  # whatever down left, remove() takes by the project's label
        c.remove()


def put_through(port: int, timeout: float) -> float:
    """Seconds until a put through HAProxy is acknowledged (a primary is behind it)."""
    started = time.monotonic()
    while True:
        try:
            with greenstalk.Client(("127.0.0.1", port), use="probe") as c:
                c.put(b"probe")
            return time.monotonic() - started
        except (OSError, greenstalk.Error) as e:
            if time.monotonic() - started > timeout:
                raise AssertionError(f"no put acknowledged through HAProxy in {timeout} s: "
                                     f"{e!r}") from e
            time.sleep(0.2)


class Producer(threading.Thread):
    """Puts numbered jobs through HAProxy; on any failure it reconnects and goes on
    with the next number. An unanswered put is not counted (nor sent again)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.acked: list[tuple[float, str]] = []
        self.failures = 0
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        client = None
        while not self.stop.is_set():
            try:
                if client is None:
                    client = greenstalk.Client(("127.0.0.1", self.port), use="orders")
                body = f"order-{n}"
                n += 1
                client.put(body)
                self.acked.append((time.monotonic(), body))
            except (OSError, greenstalk.Error):
                self.failures += 1
                if client is not None:
                    client.close()
                client = None
                time.sleep(0.05)
        if client is not None:
            client.close()

    def acked_after(self, moment: float) -> list[float]:
        return [t for t, _ in list(self.acked) if t > moment]


def replica_has_probe(port: int) -> bool:
    """Through HAProxy's replica port: the probe job has reached a replica, and the
    replica refuses a put (it is not the primary)."""
    try:
        with greenstalk.Client(("127.0.0.1", port), use="probe") as c:
            if c.stats_tube("probe")["current-jobs-ready"] < 1:
                return False
            try:
                c.put(b"not here")
            except greenstalk.UnknownResponseError as e:
                return e.status == b"READ_ONLY"
            raise AssertionError("a put through the replica port was acknowledged")
    except (OSError, greenstalk.NotFoundError):
        return False


def wait(cond, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n"
                                 f"{cluster.logs()}")
        time.sleep(0.1)


def test_compose_cluster_fails_over_under_a_producer(cluster: Cluster) -> None:
    started = time.monotonic()
    cluster.compose("up", "-d")  # builds the etcd/HAProxy image the first time
    up = time.monotonic() - started
    first_put = put_through(cluster.port, timeout=240)
    names = cluster.containers()
    assert set(names) == {"etcd", "n1", "n2", "n3", "haproxy"}, names
    old = cluster.leader(names["n1"])
    wait(lambda: replica_has_probe(cluster.replica_port), 60,
         "the probe job on a replica, through HAProxy's replica port", cluster)

    producer = Producer(cluster.port)
    producer.start()
    try:
        wait(lambda: len(producer.acked) >= 50, 120, "50 puts before the kill", cluster)
        killed = time.monotonic()
        podman("kill", names[old])
        # Counted from here: the old primary may still answer while `podman kill` runs.
        dead = time.monotonic()
        survivor = names[next(n for n in ("n1", "n2", "n3") if n != old)]
        wait(lambda: len(producer.acked_after(dead)) >= PUTS_AFTER_KILL, 180,
             f"{PUTS_AFTER_KILL} puts acknowledged after the kill", cluster)
    finally:
        producer.stop.set()
        producer.join(30)
    # The outage the producer saw: the longest wait between two acknowledgements.
    times = [t for t, _ in producer.acked]
    gap, resumed = max((b - a, b) for a, b in zip(times, times[1:], strict=False))
    new = cluster.leader(survivor)
    assert new != old, f"{old} was killed and still holds the lock"

    # Through HAProxy, so from the new primary: every acknowledged put is there.
    found = set()
    with greenstalk.Client(("127.0.0.1", cluster.port), watch="orders") as c:
        while True:
            try:
                job = c.reserve(timeout=0)
            except greenstalk.TimedOutError:
                break
            found.add(job.body)
            c.delete(job)
    acked = [body for _, body in producer.acked]
    lost = [body for body in acked if body not in found]
    assert not lost, f"{len(lost)} of {len(acked)} acknowledged puts lost: {lost[:10]}"
    print(f"\ncompose up {up:.1f} s, first put through HAProxy {first_put:.1f} s later; "
          f"{old} killed, {new} took over; the producer's longest wait {gap:.2f} s, "
          f"ending {resumed - killed:.2f} s after the kill; "
          f"{len(acked)} puts acknowledged, 0 lost, "
          f"{producer.failures} failed attempts")
