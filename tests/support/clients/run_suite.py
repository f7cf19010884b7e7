#!/usr/bin/env python3
"""Run a public beanstalkd client library's own test suite against a server.

    run_suite.py SUITE [--server beanstalkd|smallstalk] [--json OUT] [--timeout SEC]
    run_suite.py --list

The suite is downloaded at run time from its package registry (PyPI or npm,
with the registry's ordinary client) into a cache directory, by default
build/client-suites/ in this repository (ignored by git), and reused on later
runs. No third-party code is kept in the repository.

The server is beanstalkd (default, or $SERVER) or smallstalk, always on
127.0.0.1. Suites whose own fixtures start a server get a "binary" to start:
beanstalkd itself, or tests/support/clients/smallstalk-as-beanstalkd, which runs
`python -m smallstalk` with beanstalkd's flags. For the other suites this
script starts the server, and stops only the PID it started.

Every test ends up as one outcome by name: passed, failed, error, skipped or
timeout. The script prints one line per test and a summary, writes the same
as JSON with --json, and exits 0 (all passed), 1 (some did not), 2 (a
prerequisite is missing: a tool, python2.7, a fixed port is busy and the
runner is not root), 3 (the
registry could not be reached) or 4 (anything else went wrong).

Everything is bounded in time: downloads, each suite run, each test process.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DEFAULT_CACHE = REPO / "build" / "client-suites"
SMALLSTALK_AS_BEANSTALKD = HERE / "smallstalk-as-beanstalkd"
HOST = "127.0.0.1"

EXIT_PASSED, EXIT_FAILED, EXIT_PREREQ, EXIT_FETCH, EXIT_ERROR = 0, 1, 2, 3, 4

INSTALL_TIMEOUT = 300  # seconds, per registry client call


class SuiteError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class TestResult:
    name: str
    outcome: str  # passed | failed | error | skipped | timeout
    detail: str = ""


@dataclass
class Report:
    suite: str
    server: str
    package: str
    ran: bool = False
    error: str | None = None
    exit_code: int = EXIT_ERROR
    duration: float = 0.0
    tests: list[TestResult] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    server_log: str = ""
    output_tail: str = ""


# --------------------------------------------------------------------------
# processes


def log(msg: str) -> None:
    print(f"[run_suite] {msg}", file=sys.stderr, flush=True)


def run(
    cmd: list[str],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float,
    stdout_path: Path | None = None,
) -> tuple[int | None, str]:
    """Run cmd in its own process group; on timeout kill that group (only
    processes this call started). Returns (returncode or None on timeout, output)."""
    out = open(stdout_path, "w+b") if stdout_path else tempfile.TemporaryFile()
    with out:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        rc: int | None
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _reap_group(proc)
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
    return rc, text


def _reap_group(proc: subprocess.Popen) -> None:
    """Stop whatever is left in the process group that `proc` leads: `proc`
    itself on a timeout, and servers a suite's fixture started but did not stop
    (the group id is proc's own pid; nothing outside it is touched)."""
    pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                proc.poll()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) != 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


CLONE_NEWNET = 0x40000000  # unshare(2)


def own_ports(*ports: int) -> None:
    """Make the hard-coded `ports` on 127.0.0.1 ours for the rest of this run.

    As root, the runner (downloads done) moves into a network namespace of
    its own, with only `lo`: a server already on the port on this host (the
    `make run` server, Debian's beanstalkd.socket) neither breaks the suite
    nor receives its jobs, and this run's servers bind nothing on the host.
    Without root the ports must be free.
    """
    if os.geteuid() == 0 and _own_network():
        return
    require_ports(*ports)


def _own_network() -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        return False  # not allowed here (a container without CAP_SYS_ADMIN)
    ip = require_cmd("ip")
    proc = subprocess.run([ip, "link", "set", "lo", "up"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SuiteError(EXIT_ERROR, f"network namespace: `ip link set lo up`: {proc.stderr}")
    return True


def require_ports(*ports: int) -> None:
    busy = [p for p in ports if not port_is_free(p)]
    if busy:
        raise SuiteError(
            EXIT_PREREQ,
            f"the suite hard-codes {HOST}:{','.join(map(str, busy))}, which is in use by "
            "another process; stop it and retry",
        )


def require_cmd(name: str) -> str:
    path = shutil.which(name)
    if not path:
        raise SuiteError(EXIT_PREREQ, f"`{name}` is not installed")
    return path


# --------------------------------------------------------------------------
# servers


def beanstalkd_binary() -> str:
    path = os.environ.get("BEANSTALKD_BIN") or shutil.which("beanstalkd")
    if not path:
        raise SuiteError(EXIT_PREREQ, "beanstalkd is not installed (apt-get install beanstalkd)")
    return path


def server_binary(server: str) -> str:
    """An executable that takes beanstalkd's flags, for suites that start their own."""
    if server == "beanstalkd":
        return beanstalkd_binary()
    return str(SMALLSTALK_AS_BEANSTALKD)


def smallstalk_python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return os.environ.get("SMALLSTALK_PYTHON") or (str(venv) if venv.exists() else sys.executable)


class RunningServer:
    """A server this script started on 127.0.0.1:port; stop() signals only its PID."""

    def __init__(self, server: str, port: int, workdir: Path):
        self.server = server
        self.port = port
        self.log_path = workdir / f"{server}-{port}.log"
        if server == "beanstalkd":
            cmd = [beanstalkd_binary(), "-l", HOST, "-p", str(port)]
            cwd = None
        else:
            cmd = [smallstalk_python(), "-m", "smallstalk", "serve", "-l", HOST, "-p", str(port)]
            cwd = REPO
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            self._wait_listening(timeout=20.0)
        except SuiteError:
            self.stop()
            raise

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SuiteError(
                    EXIT_ERROR,
                    f"{self.server} exited with {self.proc.returncode} before listening:\n"
                    + self.log(),
                )
            try:
                with socket.create_connection((HOST, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.02)
        raise SuiteError(EXIT_ERROR, f"{self.server} did not listen on {self.port} in {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@contextlib.contextmanager
def started_server(server: str, port: int, workdir: Path, report: Report):
    srv = RunningServer(server, port, workdir)
    try:
        yield srv
    finally:
        srv.stop()
        report.server_log = tail(srv.log(), 4000)


def tail(text: str, n: int) -> str:
    return text if len(text) <= n else "..." + text[-n:]


# --------------------------------------------------------------------------
# fetching from registries (into the cache, under a lock, once)


@contextlib.contextmanager
def locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached(cache: Path, key: str, build: Callable[[Path], None]) -> Path:
    """cache/key, built by build(tmpdir) once; a 'complete' marker makes it reusable."""
    dest = cache / key
    with locked(cache / f"{key}.lock"):
        if (dest / ".complete").exists():
            return dest
        if dest.exists():
            shutil.rmtree(dest)
        tmp = cache / f"{key}.partial"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        build(tmp)
        (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        tmp.rename(dest)
    return dest


def fetch(cmd: list[str], what: str, cwd: Path | None = None) -> str:
    log(f"fetching {what}: {' '.join(cmd)}")
    rc, out = run(cmd, cwd=cwd, timeout=INSTALL_TIMEOUT)
    if rc != 0:
        raise SuiteError(
            EXIT_FETCH, f"could not fetch {what} (exit {rc}): {' '.join(cmd)}\n{tail(out, 3000)}"
        )
    return out


def unpack(archive: Path, into: Path) -> Path:
    """Unpack an sdist/tarball; returns its single top-level directory."""
    into.mkdir(parents=True, exist_ok=True)
    if archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as z:
            z.extractall(into)
    else:
        with tarfile.open(archive) as t:
            if hasattr(tarfile, "data_filter"):
                t.extractall(into, filter="data")
            else:  # Python < 3.11.4: no extraction filters
                t.extractall(into)  # noqa: S202
    (top,) = [p for p in into.iterdir() if p.is_dir()]
    return top


def pip_sdist(python: str, spec: str, dest: Path) -> Path:
    """Download one sdist from PyPI with pip (no dependencies, no wheels)."""
    dl = dest / "dl"
    name = spec.split("==")[0]
    fetch(
        [python, "-m", "pip", "download", "--no-deps", "--no-binary", name, "-d", str(dl), spec],
        f"{spec} sdist from PyPI",
    )
    (archive,) = list(dl.iterdir())
    return archive


def npm_install(dest: Path, specs: list[str]) -> None:
    """npm install exact package versions into dest/node_modules; the suite's
    test directory comes inside its published tarball."""
    npm = require_cmd("npm")
    (dest / "package.json").write_text('{"name": "client-suite", "private": true}\n')
    fetch(
        [npm, "install", "--no-audit", "--no-fund", "--ignore-scripts", "--no-package-lock",
         "--loglevel=error", *specs],
        " ".join(specs) + " from npm",
        cwd=dest,
    )


def find_python2() -> str:
    """A Python 2.7 interpreter, needed by the Python 2 era suites (beanstalkc,
    pybeanstalk). Debian 12 has none; $PYTHON2 or a pyenv install works."""
    candidates = [os.environ.get("PYTHON2", "")]
    candidates += [shutil.which(n) or "" for n in ("python2.7", "python2")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/2.7*/bin/python2.7")))
    for c in filter(None, candidates):
        try:
            out = subprocess.run(
                [c, "-c", "import sys; print(sys.version_info[:2] == (2, 7))"],
                capture_output=True, text=True, timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.stdout.strip() == "True":
            return c
    raise SuiteError(EXIT_PREREQ, "no Python 2.7 interpreter (set PYTHON2=/path/to/python2.7)")


def py2_libs(cache: Path, python2: str) -> Path:
    def build(tmp: Path) -> None:
        fetch(
            [python2, "-m", "pip", "install", "--disable-pip-version-check", "--no-warn-script-location",
             "--target", str(tmp / "lib"), "nose==1.3.7", "PyYAML==5.4.1"],
            "nose and PyYAML for Python 2.7 from PyPI",
        )

    return cached(cache, "py2-nose-1.3.7-pyyaml-5.4.1", build) / "lib"


# --------------------------------------------------------------------------
# result parsing


def parse_junit(path: Path, name_of: Callable[[ET.Element], str]) -> list[TestResult]:
    if not path.exists():
        return []
    results: list[TestResult] = []
    seen: dict[str, int] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = name_of(tc)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name} [{seen[name]}]"
        outcome, detail = "passed", ""
        for child in tc:
            tag = child.tag
            if tag in ("failure", "error"):
                outcome = "failed" if tag == "failure" else "error"
                detail = ((child.get("message") or "") + "\n" + (child.text or "")).strip()
                break
            if tag == "skipped":
                outcome, detail = "skipped", child.get("message") or ""
        results.append(TestResult(name, outcome, detail))
    return results


TAP_LINE = re.compile(r"^(not ok|ok) (\d+) (.*?)(?: # (SKIP|TODO)\b.*)?$")


def parse_tap(text: str) -> list[TestResult]:
    """mocha's TAP reporter: `ok N title`, `not ok N title` then indented error lines."""
    results: list[TestResult] = []
    current: TestResult | None = None
    for line in text.splitlines():
        m = TAP_LINE.match(line)
        if m:
            status, _, title, directive = m.groups()
            if directive == "SKIP":
                outcome = "skipped"
            else:
                outcome = "passed" if status == "ok" else "failed"
            current = TestResult(title.strip(), outcome)
            results.append(current)
        elif current is not None and current.outcome == "failed" and line.startswith("  "):
            current.detail += line.strip() + "\n"
        elif line.startswith("# ") or line.startswith("1.."):
            current = None
    for r in results:
        r.detail = r.detail.strip()
    return results


# --------------------------------------------------------------------------
# suites


@dataclass
class Suite:
    name: str
    package: str  # what is fetched, and from where
    needs: str  # what must be installed on the machine
    runner: Callable[[Suite, str, Path, Path, Report, float], None]
    timeout: float  # default bound for one run
    notes: str = ""


# "localhost" first as 127.0.0.1, as the suites assume: Node 17-19 try ::1
# first and do not fall back, and our servers listen on 127.0.0.1 only.
NODE_ENV = {"NODE_OPTIONS": "--dns-result-order=ipv4first"}


def env_with(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # The beanstalkd stand-in runs the interpreter this script's own servers run
    # (a checkout without .venv, such as a git worktree, has no other).
    env.setdefault("SMALLSTALK_PYTHON", smallstalk_python())
    for var in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "NODE_OPTIONS"):
        if var not in extra:
            env.pop(var, None)
    return env


# pystalk 0.5.1 is the newest pystalk sdist on PyPI that ships its tests
# (0.6.x and later leave tests/ out). Its conftest starts $BEANSTALKD_PATH
# with -b DIR -l 127.0.0.1 -p PORT, sleeps 0.25 s, then connects.
def run_pystalk(suite: Suite, server: str, cache: Path, work: Path, report: Report, timeout: float):
    def build(tmp: Path) -> None:
        archive = pip_sdist(sys.executable, "pystalk==0.5.1", tmp)
        src = unpack(archive, tmp / "src")
        src.rename(tmp / "pystalk")
        subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=120)
        fetch(
            [str(tmp / "venv" / "bin" / "python"), "-m", "pip", "install", "-q",
             "--disable-pip-version-check", str(archive), "pytest>=7,<8"],
            "pystalk 0.5.1 and pytest 7 from PyPI",
        )

    home = cached(cache, "pystalk-0.5.1", build)
    junit = work / "junit.xml"
    rc, out = run(
        [str(home / "venv" / "bin" / "python"), "-m", "pytest", "-c", os.devnull, "--rootdir", ".",
         "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning", "-q",
         f"--junitxml={junit}", "tests/"],
        cwd=home / "pystalk",
        env=env_with(BEANSTALKD_PATH=server_binary(server)),
        timeout=timeout,
    )
    report.output_tail = tail(out, 6000)
    report.tests = parse_junit(junit, lambda tc: f"{tc.get('classname')}::{tc.get('name')}")
    finish_run(report, rc, timeout)


# fivebeans 1.5.0 (npm): mocha suite with 127.0.0.1:11300 hard-coded.
# Dev dependencies as package.json pins them (mocha ~3.0.2, must ~0.13.2);
# nyc/eslint/coveralls are only for coverage and lint and are left out.
def run_fivebeans(suite: Suite, server: str, cache: Path, work: Path, report: Report, timeout: float):
    require_cmd("node")
    home = cached(
        cache,
        "fivebeans-1.5.0",
        lambda tmp: npm_install(tmp, ["fivebeans@1.5.0", "mocha@3.0.2", "must@0.13.4"]),
    )
    own_ports(11300)
    pkg = home / "node_modules" / "fivebeans"
    with started_server(server, 11300, work, report):
        rc, out = run(
            [str(home / "node_modules" / ".bin" / "mocha"), "-t", "8000", "-R", "tap", "test/"],
            cwd=pkg,
            env=env_with(**NODE_ENV),
            timeout=timeout,
        )
    report.output_tail = tail(out, 6000)
    report.tests = parse_tap(out)
    finish_run(report, rc, timeout)


# nodestalker 0.1.22 (npm): one node process per tests/test_*.js, in sorted
# order (as its `npm test` does), against a real server when BEANSTALKD=1
# and BEANSTALK_PORT=PORT; a file passes when node exits 0 (its asserts run
# in callbacks and in an exit handler), as upstream's `npm test` counts it.
# Files share the server, as upstream. test_reserve_jobs_multichunk_timeout
# only makes sense against the mock server and waits forever on a real one.
def run_nodestalker(suite: Suite, server: str, cache: Path, work: Path, report: Report, timeout: float):
    node = require_cmd("node")
    home = cached(cache, "nodestalker-0.1.22", lambda tmp: npm_install(tmp, ["nodestalker@0.1.22"]))
    pkg = home / "node_modules" / "nodestalker"
    port = free_port()
    per_file = 3.0
    deadline = time.monotonic() + timeout
    outputs = []
    with started_server(server, port, work, report):
        for f in sorted((pkg / "tests").glob("test_*.js")):
            name = f.name
            left = deadline - time.monotonic()
            if left <= 0:
                report.tests.append(TestResult(name, "timeout", "suite time budget exhausted"))
                continue
            t = min(per_file, left)
            rc, out = run(
                [node, f"tests/{name}"],
                cwd=pkg,
                env=env_with(BEANSTALKD="1", BEANSTALK_PORT=str(port), **NODE_ENV),
                timeout=t,
            )
            outputs.append(f"== {name} (exit {rc})\n{out}")
            if rc is None:
                report.tests.append(TestResult(name, "timeout", f"no exit within {t:.0f}s\n{tail(out, 1500)}"))
            elif rc == 0:
                report.tests.append(TestResult(name, "passed"))
            else:
                report.tests.append(TestResult(name, "failed", f"exit {rc}\n{tail(out, 1500)}"))
    report.output_tail = tail("\n".join(outputs), 6000)
    finish_run(report, 0, timeout)


# qbean 1.0.0 (npm): nodeunit tests against localhost:11300. Run one nodeunit
# process per test (nodeunit -t NAME), in file order: on Node >= 14 the
# fourth test throws "write after end" out of the event loop, which kills a
# whole-file run and every test after it, whatever the server.
def run_qbean(suite: Suite, server: str, cache: Path, work: Path, report: Report, timeout: float):
    node = require_cmd("node")
    home = cached(
        cache, "qbean-1.0.0", lambda tmp: npm_install(tmp, ["qbean@1.0.0", "nodeunit@0.11.3"])
    )
    own_ports(11300)
    pkg = home / "node_modules" / "qbean"
    rc, out = run(
        [node, "-e", "for (const k of Object.keys(require('./test/test-qbean.js')))"
                     " if (k !== 'setUp' && k !== 'tearDown') console.log(k)"],
        cwd=pkg, env=env_with(**NODE_ENV), timeout=30,
    )
    if rc != 0:
        raise SuiteError(EXIT_ERROR, f"could not list qbean's tests:\n{out}")
    names = [n for n in out.splitlines() if n.strip()]
    nodeunit = str(home / "node_modules" / ".bin" / "nodeunit")
    deadline = time.monotonic() + timeout
    outputs = []
    with started_server(server, 11300, work, report):
        for name in names:
            left = deadline - time.monotonic()
            if left <= 0:
                report.tests.append(TestResult(name, "timeout", "suite time budget exhausted"))
                continue
            t = min(6.0, left)
            rc, out = run(
                [nodeunit, "--reporter", "minimal", "-t", name, "test/test-qbean.js"],
                cwd=pkg, env=env_with(NODE_DISABLE_COLORS="1", **NODE_ENV), timeout=t,
            )
            out = re.sub(r"\x1b\[[0-9;]*m", "", out)
            outputs.append(f"== {name} (exit {rc})\n{out}")
            if rc is None:
                report.tests.append(TestResult(name, "timeout", f"no exit within {t:.0f}s\n{tail(out, 1500)}"))
            elif rc == 0 and "OK:" in out:
                report.tests.append(TestResult(name, "passed"))
            else:
                report.tests.append(TestResult(name, "failed", f"exit {rc}\n{tail(out, 1500)}"))
    report.output_tail = tail("\n".join(outputs), 6000)
    finish_run(report, 0, timeout)


# beanstalkc 0.4.0 (PyPI sdist, Python 2 only): nose doctests of README.mkd,
# TUTORIAL.mkd and test/no-yaml.mkd, as its .nose.cfg runs them. The fixtures
# start $BEANSTALKD -l 127.0.0.1 -p 14711 and sleep 0.5 s.
def run_beanstalkc(suite: Suite, server: str, cache: Path, work: Path, report: Report, timeout: float):
    python2 = find_python2()
    lib = py2_libs(cache, python2)

    def build(tmp: Path) -> None:
        archive = pip_sdist(python2, "beanstalkc==0.4.0", tmp)
        unpack(archive, tmp / "src").rename(tmp / "beanstalkc")

    home = cached(cache, "beanstalkc-0.4.0", build) / "beanstalkc"
    own_ports(14711)
    junit = work / "nosetests.xml"
    rc, out = run(
        [python2, "-m", "nose", "-c", ".nose.cfg", "--with-xunit", f"--xunit-file={junit}",
         "README.mkd", "TUTORIAL.mkd", "test/no-yaml.mkd"],
        cwd=home,
        env=env_with(BEANSTALKD=server_binary(server), PYTHONPATH=str(lib)),
        timeout=timeout,
    )
    report.output_tail = tail(out, 6000)
    report.tests = parse_junit(junit, lambda tc: tc.get("name") or "")
    finish_run(report, rc, timeout)


# pybeanstalk 1.0rc1 (PyPI sdist, Python 2 only): nose tests. tests/tests.cfg
# names the binary to start (BPATH + BEANSTALKD); we write our own copy of it.
# test_ServerConn starts the server on 11301, sleeps 0.1 s and connects.
# test_MultiServerConn (11302-11303) takes about 90 s and is the separate
# suite "pybeanstalk-multi". test_Proto/test_errors never touch a server.
def run_pybeanstalk(suite: Suite, server: str, cache: Path, work: Path, report: Report, timeout: float):
    python2 = find_python2()
    lib = py2_libs(cache, python2)

    def build(tmp: Path) -> None:
        archive = pip_sdist(python2, "pybeanstalk==1.0rc1", tmp)
        unpack(archive, tmp / "src").rename(tmp / "pybeanstalk")

    home = cached(cache, "pybeanstalk-1.0rc1", build) / "pybeanstalk"
    module = "test_MultiServerConn" if suite.name == "pybeanstalk-multi" else "test_ServerConn"
    own_ports(*((11302, 11303) if module == "test_MultiServerConn" else (11301,)))
    tests = work / "tests"
    shutil.copytree(home / "tests", tests)
    binary = Path(server_binary(server))
    cfg = (home / "tests" / "tests.cfg").read_text()
    cfg = re.sub(r"(?m)^BPATH = .*$", f"BPATH = {binary.parent}/", cfg)
    cfg = re.sub(r"(?m)^BEANSTALKD = .*$", f"BEANSTALKD = {binary.name}", cfg)
    (tests / "tests.cfg").write_text(cfg)
    junit = work / "nosetests.xml"
    rc, out = run(
        [python2, "-m", "nose", "-v", "--with-xunit", f"--xunit-file={junit}", module],
        cwd=tests,
        env=env_with(PYTHONPATH=f"{lib}:{home}"),
        timeout=timeout,
    )
    report.output_tail = tail(out, 6000)
    report.tests = parse_junit(junit, lambda tc: f"{tc.get('classname')}.{tc.get('name')}")
    finish_run(report, rc, timeout)


def finish_run(report: Report, rc: int | None, timeout: float) -> None:
    report.ran = True
    if rc is None:
        report.error = f"the suite did not finish within {timeout:.0f}s and was stopped"


SUITES: dict[str, Suite] = {
    s.name: s
    for s in [
        Suite("pystalk", "pystalk==0.5.1 sdist (PyPI)", "python3 (the repo venv)", run_pystalk, 45,
              "beanstalkd's CI runs pystalk's suite (from git)"),
        Suite("fivebeans", "fivebeans@1.5.0 + mocha@3.0.2 + must@0.13.4 (npm)", "nodejs, npm",
              run_fivebeans, 60),
        Suite("nodestalker", "nodestalker@0.1.22 (npm)", "nodejs, npm", run_nodestalker, 45),
        Suite("qbean", "qbean@1.0.0 + nodeunit@0.11.3 (npm)", "nodejs, npm", run_qbean, 45),
        Suite("beanstalkc", "beanstalkc==0.4.0 sdist + nose/PyYAML (PyPI)", "python2.7",
              run_beanstalkc, 45),
        Suite("pybeanstalk", "pybeanstalk==1.0rc1 sdist + nose/PyYAML (PyPI)", "python2.7",
              run_pybeanstalk, 45),
        Suite("pybeanstalk-multi", "pybeanstalk==1.0rc1 sdist + nose/PyYAML (PyPI)", "python2.7",
              run_pybeanstalk, 240, "slow: about 90 s per run"),
    ]
}


def run_suite(name: str, server: str, cache: Path, timeout: float | None = None) -> Report:
    suite = SUITES[name]
    timeout = timeout or suite.timeout
    report = Report(suite=name, server=server, package=suite.package)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"suite-{name}-{server}-") as tmp:
        try:
            if server not in ("beanstalkd", "smallstalk"):
                raise SuiteError(EXIT_ERROR, f"unknown server {server!r}")
            if server == "beanstalkd":
                beanstalkd_binary()
            suite.runner(suite, server, cache, Path(tmp), report, timeout)
        except SuiteError as e:
            report.error = str(e)
            report.exit_code = e.code
        except Exception as e:  # noqa: BLE001 - report, don't crash the caller
            report.error = f"{type(e).__name__}: {e}"
            report.exit_code = EXIT_ERROR
    report.duration = round(time.monotonic() - started, 2)
    counts: dict[str, int] = {}
    for t in report.tests:
        counts[t.outcome] = counts.get(t.outcome, 0) + 1
    report.counts = counts
    if report.ran:
        all_passed = report.tests and all(t.outcome in ("passed", "skipped") for t in report.tests)
        report.exit_code = EXIT_PASSED if all_passed and not report.error else EXIT_FAILED
        if not report.tests and not report.error:
            report.error = "the suite reported no tests"
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("suite", nargs="?", choices=sorted(SUITES))
    ap.add_argument("--server", default=os.environ.get("SERVER", "beanstalkd"),
                    choices=["beanstalkd", "smallstalk"])
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("CLIENT_SUITES_CACHE", DEFAULT_CACHE)))
    ap.add_argument("--timeout", type=float, help="bound for the whole suite run (seconds)")
    ap.add_argument("--json", type=Path, help="write the report here as JSON")
    ap.add_argument("--list", action="store_true", help="list the suites")
    ap.add_argument("-v", "--verbose", action="store_true", help="print failure details")
    args = ap.parse_args(argv)
    if args.list or not args.suite:
        for s in SUITES.values():
            print(f"{s.name:18} {s.package}; needs {s.needs}" + (f"; {s.notes}" if s.notes else ""))
        return 0
    report = run_suite(args.suite, args.server, args.cache.resolve(), args.timeout)
    for t in report.tests:
        print(f"{t.outcome.upper():8} {t.name}")
        if args.verbose and t.detail and t.outcome not in ("passed", "skipped"):
            print("         " + t.detail.replace("\n", "\n         "))
    if report.error:
        print(f"ERROR    {report.error}")
    summary = " ".join(f"{k}={v}" for k, v in sorted(report.counts.items())) or "no tests"
    print(f"suite={report.suite} server={report.server} {summary} "
          f"total={len(report.tests)} duration={report.duration}s")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
