"""Running under systemd: the shipped units pass `systemd-analyze verify`, and the server
takes a socket from socket activation and reports READY=1 / STOPPING=1 to NOTIFY_SOCKET.

systemd is not init on test machines; its tools are. `systemd-socket-activate`
listens, and on the first connection execs the server with LISTEN_FDS=1 and
the listening socket as fd 3, as systemd does with smallstalk.socket.
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

import pytest

from tests.support.procs import REPO, free_port, wait_for_log

UNITS = REPO / "contrib" / "systemd"
INSTALLED = "/opt/smallstalk/bin/smallstalk"

pytestmark = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None or shutil.which("systemd-socket-activate") is None,
    reason="systemd's tools are not installed (apt-get install systemd)")


def test_the_units_verify(tmp_path: Path) -> None:
    """ExecStart must name a program that exists: this interpreter stands in for the script."""
    for unit in ("smallstalk.service", "smallstalk.socket"):
        text = (UNITS / unit).read_text()
        (tmp_path / unit).write_text(text.replace(INSTALLED, f"{sys.executable} -m smallstalk"))
    proc = subprocess.run(["systemd-analyze", "verify", "smallstalk.service", "smallstalk.socket"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Warnings about the host's own units may appear; none about ours.
    assert "smallstalk." not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_the_service_is_hardened_and_notifies() -> None:
    service = (UNITS / "smallstalk.service").read_text()
    for line in ("Type=notify", "DynamicUser=yes", "StateDirectory=smallstalk",
                 "ProtectSystem=strict", "NoNewPrivileges=yes", "LimitNOFILE=",
                 f"ExecStart={INSTALLED} serve --data-dir /var/lib/smallstalk"):
        assert line in service
    assert "ListenStream=127.0.0.1:11300" in (UNITS / "smallstalk.socket").read_text()


def test_a_wrong_exec_start_fails_verify(tmp_path: Path) -> None:
    """The check above can fail: a unit naming a program that is not there does not verify."""
    text = (UNITS / "smallstalk.service").read_text()
    (tmp_path / "smallstalk.service").write_text(text.replace(INSTALLED, "/nonexistent/smallstalk"))
    shutil.copy(UNITS / "smallstalk.socket", tmp_path)
    proc = subprocess.run(["systemd-analyze", "verify", "smallstalk.service"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "/nonexistent/smallstalk" in proc.stdout + proc.stderr


def _notify_socket(tmp_path: Path, abstract: bool) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"smallstalk-test-{os.getpid()}-{time.monotonic_ns()}"
        sock.bind("\0" + name)
        return sock, "@" + name
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    return sock, str(path)


def _receive(sock: socket.socket, want: str, timeout: float = 60) -> list[str]:
    """The notes received until one holds `want`."""
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while not any(want in note for note in got):
        left = deadline - time.monotonic()
        assert left > 0, f"no {want} within {timeout}s; got {got}"
        sock.settimeout(left)
        got.append(sock.recv(4096).decode())
    return got


def _command(conn: socket.socket, line: bytes, want: bytes) -> None:
    conn.sendall(line)
    reply = b""
    while len(reply) < len(want):
        chunk = conn.recv(4096)
        assert chunk, f"connection closed after {reply!r}"
        reply += chunk
    assert reply == want


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_socket_activation_and_readiness(tmp_path: Path, abstract: bool) -> None:
    port = free_port()
    notes, where = _notify_socket(tmp_path, abstract)
    # Another port in -p: the socket passed in wins (as with beanstalkd).
    cmd = ["systemd-socket-activate", "-l", f"127.0.0.1:{port}",
           "-E", f"PYTHONPATH={REPO}", "-E", f"NOTIFY_SOCKET={where}",
           sys.executable, "-m", "smallstalk", "serve", "-p", str(free_port()),
           "-b", str(tmp_path / "data")]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:  # systemd-socket-activate opens the port first; the server starts later
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=60)
                break
            except ConnectionRefusedError:
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.02)
        with notes, conn:
            # The first connection starts the server; it is served once recovery is done.
            _command(conn, b"put 0 0 60 5\r\nhello\r\n", b"INSERTED 1\r\n")
            assert _receive(notes, "READY=1")
            _command(conn, b"reserve-with-timeout 0\r\n", b"RESERVED 1 5\r\nhello\r\n")
            proc.send_signal(signal.SIGTERM)  # systemd-socket-activate exec'd the server
            _receive(notes, "STOPPING=1")
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        text = log_path.read_text()
        assert "Traceback" not in text
        assert f"listening on 127.0.0.1:{port}" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sockets_meant_for_another_process_are_ignored(tmp_path: Path) -> None:
    """LISTEN_PID names another process (an inherited environment): bind -p as usual."""
    port = free_port()
    env = {**os.environ, "LISTEN_FDS": "1", "LISTEN_PID": "1"}
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "smallstalk", "serve", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for_log(log_path, f"listening on 127.0.0.1:{port}", proc)
    finally:
        proc.kill()
        proc.wait()


def test_a_passed_fd_that_is_not_a_socket_is_one_line(tmp_path: Path) -> None:
    """As if a unit passed a file as fd 3: refused in one line, beanstalkd's status 111."""
    script = f'LISTEN_FDS=1 LISTEN_PID=$$ exec "{sys.executable}" -m smallstalk serve 3<"$0"'
    proc = subprocess.run(["sh", "-c", script, str(UNITS / "smallstalk.socket")],
                          capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 111, proc.stderr
    assert proc.stderr == "smallstalk: systemd passed fd 3, which is not a socket " \
                          "(Socket operation on non-socket)\n"
