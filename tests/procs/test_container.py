"""The container image as a user builds and runs it (docs/OPERATIONS.md, Containers).

A Debian bookworm minbase made with mmdebstrap stands in for `debian:bookworm-slim`
(no registry is reachable here); the top-level Containerfile is built as it is, from
the checkout, by podman, the offline way the docs describe: wheels made on the host
into the git-ignored wheelhouse/. The image then runs with its own command line and a
named volume, its ports published on 127.0.0.1 only; a job is put and reserved through
the published port with greenstalk; SIGTERM stops the server cleanly (exit status 0,
not a SIGKILL); a new container on the same volume still has the job.

Caching: the base's tarball is kept in SMALLSTALK_IMAGE_CACHE (/var/tmp/smallstalk-image
by default) and the imported base and podman's layer cache stay in podman's storage, so
only the first run on a machine builds from nothing. Needs root, podman, runc and
mmdebstrap (`make test` installs them): without them the test fails, saying so, rather
than skip a feature that a release ships.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import greenstalk
import pytest

from tests.support.procs import REPO, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CACHE = Path(os.environ.get("SMALLSTALK_IMAGE_CACHE", "/var/tmp/smallstalk-image"))
BASE = "localhost/debian:bookworm-slim"
# This machine kind runs no systemd and lets no container raise its rlimits to the
# host's: runc with cgroupfs, and limits a container may set.
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000"]
# debian:bookworm-slim as near as mmdebstrap makes it: a minbase without manuals,
# translations and docs (but each package's copyright), and without the usrmerge
# package and the perl it pulls in (the official image has usr-is-merged instead).
SLIM = ["--variant=minbase", "--include=usr-is-merged",
        *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("man", "locale", "doc", "info")),
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        '--customize-hook=chroot "$1" apt-get purge -y -qq usrmerge libfile-find-rule-perl '
        'libnumber-compare-perl libtext-glob-perl perl perl-modules-5.36']


def run(*cmd: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    return run(*PODMAN, *args, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def base() -> str:
    """`debian:bookworm-slim`, made here: imported from the cached tarball, which
    mmdebstrap makes from Debian's mirror the first time."""
    missing = [c for c in ("podman", "runc", "mmdebstrap") if shutil.which(c) is None]
    if missing or os.geteuid() != 0:
        pytest.fail(f"the container test needs root and {', '.join(missing) or 'nothing else'}: "
                    "run `make test` as root (it installs podman, runc and mmdebstrap)")
    if podman("image", "exists", BASE, check=False).returncode == 0:
        return BASE
    tarball = CACHE / "bookworm-slim.tar"
    if not tarball.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        part = CACHE / f"bookworm-slim.{os.getpid()}.tar"
        run("mmdebstrap", "--quiet", "--format=tar", *SLIM, "bookworm", str(part),
            timeout=1200)
        part.rename(tarball)  # whole or not at all: a killed run leaves no half tarball
    podman("import", str(tarball), BASE)
    return BASE


@pytest.fixture(scope="module")
def image(base: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image built from the Containerfile in the checkout, as a user builds it offline."""
    wheelhouse = REPO / "wheelhouse"
    run(sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheelhouse),
        f"{REPO}[console,ha]", "setuptools>=77", timeout=600)
    # The build makes smallstalk's own wheel from the sources; one built here (its
    # bytes differ with each build) would only defeat podman's cache of the COPY.
    for wheel in wheelhouse.glob("smallstalk-*.whl"):
        wheel.unlink()
    iid = tmp_path_factory.mktemp("image") / "iid"
    podman("build", "--format", "docker", "--pull=never", *LIMITS, "--iidfile", str(iid),
           "-t", "localhost/smallstalk:test", "-f", str(REPO / "Containerfile"), str(REPO),
           timeout=1500)
    return iid.read_text().strip()


@pytest.fixture
def volume(request: pytest.FixtureRequest):
    name = f"smallstalk-test-{os.getpid()}-{request.node.name}"[:60]
    podman("volume", "create", name)
    try:
        yield name
    finally:
        podman("volume", "rm", "-f", name, check=False)


@pytest.fixture
def containers():
    """Names of the containers a test starts; each is removed at the end."""
    names: list[str] = []
    try:
        yield names
    finally:
        for name in names:
            podman("rm", "-f", "-t", "0", name, check=False)


def start(image: str, volume: str, names: list[str], port: int, http: int) -> tuple[str, float]:
    """`podman run` with the image's own command; the name, and seconds to the first reply."""
    name = f"smallstalk-test-{os.getpid()}-{len(names)}"
    names.append(name)
    started = time.monotonic()
    podman("run", "-d", "--name", name, *LIMITS, "-p", f"127.0.0.1:{port}:11300",
           "-p", f"127.0.0.1:{http}:11380", "-v", f"{volume}:/var/lib/smallstalk", image)
    deadline = started + 120
    while True:
        try:
            with greenstalk.Client(("127.0.0.1", port)) as c:
                c.stats()
            return name, time.monotonic() - started
        except (OSError, greenstalk.Error) as e:
            if time.monotonic() > deadline:
                logs = podman("logs", name, check=False)
                raise AssertionError(f"no reply on {port} within 120 s ({e}):\n"
                                     f"{logs.stdout[-3000:]}{logs.stderr[-3000:]}") from e
            time.sleep(0.05)


def health(http: int) -> tuple[int, bytes]:
    """GET /health on the published console port (it binds just after the client port)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=30) as r:
                return r.status, r.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def stop(name: str) -> tuple[dict, float]:
    """`podman stop` (SIGTERM, a SIGKILL only after 60 s); the container's state."""
    started = time.monotonic()
    podman("stop", "-t", "60", name, timeout=120)
    took = time.monotonic() - started
    state = json.loads(podman("inspect", name).stdout)[0]["State"]
    return state, took


def test_image_is_a_slim_non_root_runtime(image: str) -> None:
    inspected = json.loads(podman("image", "inspect", image).stdout)[0]
    config = inspected["Config"]
    assert config["User"] == "smallstalk"
    assert "/var/lib/smallstalk" in config["Volumes"]
    assert config["StopSignal"] == "SIGTERM"
    assert "http://127.0.0.1:11380/health" in " ".join(inspected["Healthcheck"]["Test"])
    assert config["Cmd"][config["Cmd"].index("--data-dir") + 1] == "/var/lib/smallstalk"
    inside = podman("run", "--rm", *LIMITS, "--entrypoint", "/bin/sh", image, "-c",
                    "id -u; for c in gcc cc pip pip3; do command -v $c; done; "
                    "cd /opt/smallstalk/lib/python3*/site-packages && ls -d hypercorn pyspark",
                    check=False).stdout
    # Not root; no compiler, no pip; the console extra, not the analytics one.
    assert inside.splitlines() == ["10001", "hypercorn"], inside


def test_a_job_survives_sigterm_and_a_new_container(image: str, volume: str,
                                                    containers: list[str]) -> None:
    port, http = free_port(), free_port()
    name, first_reply = start(image, volume, containers, port, http)
    status, body = health(http)
    assert (status, json.loads(body)["role"]) == (200, "primary"), body
    check = podman("healthcheck", "run", name, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    with greenstalk.Client(("127.0.0.1", port), use="mail", watch="mail") as c:
        jid = c.put(b"send welcome mail", ttr=600)
        job = c.reserve(timeout=5)
        assert (job.id, job.body) == (jid, "send welcome mail")

        state, took = stop(name)
    assert (state["ExitCode"], state["OOMKilled"]) == (0, False), state
    assert took < 30, f"stopping took {took:.1f} s: SIGTERM was not acted on"
    logs = podman("logs", name)
    assert "shutting down" in logs.stderr + logs.stdout

    podman("rm", name)  # the data is in the volume, not in the container
    name2, second_reply = start(image, volume, containers, port, http)
    with greenstalk.Client(("127.0.0.1", port), watch="mail") as c:
        job = c.reserve(timeout=5)  # the reservation ended with the old server's connections
        assert (job.id, job.body) == (jid, "send welcome mail")
        c.delete(job)
    state, _ = stop(name2)
    assert state["ExitCode"] == 0, state
    print(f"\nrun to first reply: {first_reply:.2f} s fresh volume, {second_reply:.2f} s "
          f"restart; SIGTERM to exit: {took:.2f} s")
