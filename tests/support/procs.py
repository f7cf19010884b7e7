"""Start and stop real server processes (smallstalk and beanstalkd) for tests.

Every server listens on 127.0.0.1 on a free port; stop() kills only the PID we
started. Waiting is bounded: a server that does not accept within the timeout
fails the test with its stderr.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `cond` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def wait_for_log(path: Path, text: str, proc: subprocess.Popen, timeout: float = 60.0,
                 start: int = 0) -> None:
    """Wait for a server's log line (smallstalk logs `listening on` once it serves).

    Only the log from byte `start` on counts: a restarted server appends to
    the log of its earlier run, which has the same line already.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, "rb") as f:
            f.seek(start)
            if text.encode() in f.read():
                return
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before serving")
        time.sleep(0.02)
    raise RuntimeError(f"server did not log {text!r} within {timeout}s")


def listening(port: int) -> bool:
    """Is a socket in LISTEN state on 127.0.0.1:port? (No connection made.)"""
    want = f"0100007F:{port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == want and fields[3] == "0A":
            return True
    return False


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait for the listener without connecting: a probe connection would
    still be closing when the test's first command arrives, and would count
    in `stats` (current-connections, total-connections)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if listening(port):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening")
        time.sleep(0.02)
    raise RuntimeError(f"server did not listen on {port} within {timeout}s")


@attrs.define
class Server:
    proc: subprocess.Popen
    port: int
    data_dir: Path | None
    log_path: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: the crash tests' power cut."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""


def smallstalk_cmd() -> list[str]:
    return [sys.executable, "-m", "smallstalk"]


def start_smallstalk(
    tmp: Path, *args: str, data_dir: Path | None = None, port: int | None = None,
    host: str = "127.0.0.1", prefix: list[str] | tuple = (),
) -> Server:
    """`host`: another loopback address (127.0.0.2, ...) for a server of a cluster;
    `prefix`: a command that runs it (`ip netns exec NS` in the partition test)."""
    port = port or free_port()
    cmd = [*prefix, *smallstalk_cmd(), "serve", "-l", host, "-p", str(port)]
    if data_dir is not None:
        cmd += ["--data-dir", str(data_dir)]
    cmd += list(args)
    log_path = tmp / (f"smallstalk-{port}.log" if host == "127.0.0.1"
                      else f"smallstalk-{host}-{port}.log")
    log = open(log_path, "ab")
    log_start = log.tell()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    server = Server(proc, port, data_dir, log_path)
    try:
        # The port opens before recovery (launch.py binds first); the log line
        # says the server is ready. No probe connection: it would show in stats.
        wait_for_log(log_path, f"listening on {host}:{port}", proc, start=log_start)
    except RuntimeError as e:
        server.kill()
        raise RuntimeError(f"{e}\n{server.log()}") from None
    return server


def beanstalkd_path() -> str | None:
    return shutil.which("beanstalkd")


needs_beanstalkd = pytest.mark.skipif(
    beanstalkd_path() is None, reason="beanstalkd is not installed (make system-packages)")
# The servers a test runs against when it runs against both.
SERVER_KINDS = ["smallstalk", pytest.param("beanstalkd", marks=needs_beanstalkd)]


def start_beanstalkd(tmp: Path, *args: str, port: int | None = None) -> Server:
    path = beanstalkd_path()
    if path is None:
        raise RuntimeError("beanstalkd is not installed (apt-get install beanstalkd)")
    port = port or free_port()
    log_path = tmp / f"beanstalkd-{port}.log"
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [path, "-l", "127.0.0.1", "-p", str(port), *args], stdout=log, stderr=subprocess.STDOUT
    )
    server = Server(proc, port, None, log_path)
    wait_listening(port, proc)
    return server

def children(pid: int) -> list[int]:
    """Live child processes of `pid` (a server's compactor runs), from /proc."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                st = f.read()
        except OSError:
            continue
        fields = st[st.rfind(b")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != b"Z":
            out.append(int(entry.name))
    return out
