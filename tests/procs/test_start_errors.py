"""An operator's mistake at start-up: one line, a non-zero exit status, never a traceback.

Real server processes; exit statuses are beanstalkd's where it has one for
the same mistake (111: cannot listen, 32: cannot become -u USER).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.support.procs import free_port, smallstalk_cmd, start_smallstalk, wait_for_log


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(smallstalk_cmd() + list(args), capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, status: int, *words: str) -> str:
    """The run ended with `status` and one error line that holds `words`; returns it."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == status, out
    errors = [line for line in proc.stderr.splitlines() if line.startswith("smallstalk")]
    assert len(errors) == 1, out
    for word in words:
        assert word in errors[0], out
    return errors[0]


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("flags", [["-p", "99999"], ["--port=65536"], ["-p", "-1"]])
def test_a_port_out_of_range_is_refused_not_wrapped(flags: list[str]) -> None:
    proc = run("serve", *flags)
    one_line_error(proc, 5, "smallstalk serve -h")


@pytest.mark.parametrize("late", [False, True], ids=["flags", "config-file"])
def test_a_port_in_use_is_one_line_and_nothing_is_written(tmp_path: Path, servers,
                                                          late: bool) -> None:
    """The first server holds the port; the second must not touch its own data directory.

    With --config the address is only known after reading the file, so the
    socket is bound late (not by launch.py): both paths are covered.
    """
    first = start_smallstalk(tmp_path, data_dir=tmp_path / "first")
    servers.append(first)
    second = tmp_path / "second"
    second.mkdir()
    if late:
        conf = tmp_path / "s.toml"
        conf.write_text(f'[server]\nport = {first.port}\ndata-dir = "second"\n')
        proc = run("serve", "--config", str(conf))
    else:
        proc = run("serve", "-p", str(first.port), "-b", str(second))
    line = one_line_error(proc, 111, f"127.0.0.1:{first.port} already in use",
                          "another smallstalk or beanstalkd? use -p")
    assert line == (f"smallstalk: 127.0.0.1:{first.port} already in use: "
                    "another smallstalk or beanstalkd? use -p")
    assert files_under(second) == []


def test_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_text("not a directory")
    proc = run("serve", "-p", str(free_port()), "-b", str(path))
    one_line_error(proc, 1, str(path), "not a directory")
    proc = run("serve", "-p", str(free_port()), "--data-dir", str(path / "below"))
    one_line_error(proc, 1, str(path / "below"), "Not a directory")


def test_a_data_dir_link_to_nowhere_and_a_file_where_a_folder_belongs(tmp_path: Path) -> None:
    link = tmp_path / "data"
    link.symlink_to(tmp_path / "gone" / "data")
    proc = run("serve", "-p", str(free_port()), "-b", str(link))
    one_line_error(proc, 1, str(link), "which does not exist", "create that directory")
    assert not (tmp_path / "gone").exists()
    data = tmp_path / "d2"
    data.mkdir()
    (data / "aof").write_text("not the segments' folder")
    proc = run("serve", "-p", str(free_port()), "-b", str(data))
    one_line_error(proc, 1, str(data / "aof"), "move it out of the way")
    assert (data / "aof").read_text() == "not the segments' folder"


@pytest.mark.skipif(os.geteuid() != 0, reason="-u needs root to become another user")
def test_a_data_dir_the_user_cannot_write() -> None:
    """-u nobody happens before the data directory is read: root's directory is refused."""
    top = Path(tempfile.mkdtemp(prefix="smallstalk-u-"))  # pytest's tmp_path is root's only
    top.chmod(0o755)
    owned = top / "root-owned"
    owned.mkdir(mode=0o755)
    try:
        _refused_as_nobody(owned)
    finally:
        shutil.rmtree(top)


def _refused_as_nobody(owned: Path) -> None:
    proc = run("serve", "-p", str(free_port()), "-u", "nobody", "-b", str(owned))
    one_line_error(proc, 1, str(owned), "not writable by user nobody")
    proc = run("serve", "-p", str(free_port()), "-u", "nobody", "-b", str(owned / "new"))
    one_line_error(proc, 1, str(owned / "new"), "Permission denied", "chown")
    assert files_under(owned) == []


def test_an_unknown_user(tmp_path: Path) -> None:
    proc = run("serve", "-p", str(free_port()), "-u", "no-such-user-here", "-b",
               str(tmp_path / "d"))
    one_line_error(proc, 32, "-u no-such-user-here: no such user")
    assert not (tmp_path / "d").exists()


def test_an_address_not_on_this_host() -> None:
    proc = run("serve", "-l", "192.0.2.1", "-p", str(free_port()))  # TEST-NET-1: not ours
    one_line_error(proc, 111, "192.0.2.1", "use -l")


@pytest.mark.parametrize("addr", ["a..b", "\u00e4..b"])
def test_an_address_that_is_not_a_name(addr: str) -> None:
    """An empty label: getaddrinfo's refusal (ASCII) or the idna codec's (not ASCII)."""
    proc = run("serve", "-l", addr, "-p", str(free_port()))
    one_line_error(proc, 111, addr, "use -l")


def test_port_0_logs_the_port_it_got(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(smallstalk_cmd() + ["serve", "-p", "0", "-b", str(tmp_path / "d")],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_log(log_path, "listening on 127.0.0.1:", proc)
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", log_path.read_text())[1])
        assert port != 0
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"put 0 0 60 2\r\nhi\r\n")
            assert s.recv(100) == b"INSERTED 1\r\n"
    finally:
        proc.kill()
        proc.wait()


def test_damage_at_start_is_one_line_naming_the_file(tmp_path: Path, servers) -> None:
    data = tmp_path / "data"
    server = start_smallstalk(tmp_path, "--segment-records", "5", "--no-compact", data_dir=data)
    servers.append(server)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        for _ in range(20):
            s.sendall(b"put 0 0 60 3\r\nabc\r\n")
            assert s.recv(100).startswith(b"INSERTED")
    server.stop()
    closed = sorted((data / "aof").glob("*.aof"))[1]  # not the last: no torn tail
    damaged = bytearray(closed.read_bytes())
    damaged[40] ^= 0xFF
    closed.write_bytes(damaged)
    proc = run("serve", "-p", str(free_port()), "-b", str(data))
    one_line_error(proc, 1, closed.name)
