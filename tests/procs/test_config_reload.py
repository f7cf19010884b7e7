"""The configuration file with a running server: SIGHUP and reload-config, config dump from a
server, and the dump command as a process (parsing the file is in tests/unit/test_config.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from ..support.bsclient import Client, put_cmd
from ..support.configfile import parse_yaml, run_dump, write
from ..support.procs import REPO, Server, free_port, smallstalk_cmd, wait_for, wait_for_log


def test_config_dump_command_line(tmp_path: Path) -> None:
    """Through `python -m smallstalk`, as an operator types it."""
    path = write(tmp_path, '[tubes."emails"]\nmax-jobs = 7\n')
    done = subprocess.run([*smallstalk_cmd(), "config", "dump", "--config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert parse_yaml(done.stdout.encode())["emails"]["max-jobs"] == "7"
    done = subprocess.run([*smallstalk_cmd(), "help"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert "config dump" in done.stdout


def start_with_config(tmp_path: Path, path: Path, port: int, *args: str) -> Server:
    """`smallstalk serve --config FILE` with no -l/-p: the file names the port."""
    log_path = tmp_path / f"smallstalk-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([*smallstalk_cmd(), "serve", "--config", str(path), *args],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    server = Server(proc, port, None, log_path)
    try:
        wait_for_log(log_path, f"listening on 127.0.0.1:{port}", proc)
    except RuntimeError as e:
        server.kill()
        raise RuntimeError(f"{e}\n{server.log()}") from None
    return server


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its socket inodes in /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if m := re.fullmatch(r"socket:\[(\d+)\]", target):
            inodes.add(m.group(1))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def config_of(port: int) -> dict[str, dict[str, str]]:
    with Client(port) as c:
        r = c.call(b"config\r\n")
    assert r.status == b"OK", r
    return parse_yaml(r.body)


SERVED = """\
[server]
listen = "127.0.0.1"
port = {port}
data-dir = "data"
max-job-size = 100

[tubes.default]
max-jobs = 5
"""


@pytest.fixture
def configured(tmp_path: Path, servers: list[Server]) -> tuple[Server, Path]:
    port = free_port()
    path = write(tmp_path, SERVED.format(port=port))
    srv = start_with_config(tmp_path, path, port)
    servers.append(srv)
    return srv, path


def test_the_file_configures_the_server(tmp_path: Path, configured) -> None:
    srv, _ = configured
    # Only the file's port: launch.py's early socket on the default port is gone.
    assert listening_ports(srv.pid) == {srv.port}
    assert (tmp_path / "data").is_dir()  # data-dir, relative to the file
    with Client(srv.port) as c:
        assert c.call(put_cmd(b"x" * 101)).status == b"JOB_TOO_BIG"
        assert c.call(put_cmd(b"x" * 100)).status == b"INSERTED"
        assert c.call(b"use emails\r\n").status == b"USING"
        r = c.call(b"config\r\n")
    assert r.status == b"OK"
    tubes = parse_yaml(r.body)
    assert list(tubes) == ["default", "emails"]  # configured tubes, then existing ones
    assert tubes["default"]["max-jobs"] == "5" and tubes["emails"]["max-jobs"] == "5"


def test_sighup_reloads_the_tube_tables(configured) -> None:
    srv, path = configured
    assert config_of(srv.port)["default"]["max-jobs"] == "5"
    path.write_text(SERVED.format(port=srv.port).replace("max-jobs = 5", "max-jobs = 7")
                    + '\n[tubes."orders"]\nmax-age = "1h"\nexpire-to = "orders-dead"\n')
    os.kill(srv.pid, signal.SIGHUP)
    wait_for(lambda: "orders" in config_of(srv.port), timeout=30, what="the reload")
    tubes = config_of(srv.port)
    assert tubes["default"]["max-jobs"] == "7"
    assert tubes["orders"] == {**tubes["default"], "max-age": "3600",
                               "expire-to": "orders-dead"}
    assert "[server] settings changed" not in srv.log()


def test_sighup_with_a_bad_file_keeps_the_old_policies(configured) -> None:
    srv, path = configured
    good = path.read_text()
    start = srv.log_path.stat().st_size
    path.write_text(good + '\n[tubes."orders"]\nmax-jobs = "many"\n')
    os.kill(srv.pid, signal.SIGHUP)
    wait_for_log(srv.log_path, "the old tube policies stay", srv.proc, timeout=30, start=start)
    assert "tubes.orders.max-jobs" in srv.log()[start:]
    assert list(config_of(srv.port)) == ["default"]
    assert config_of(srv.port)["default"]["max-jobs"] == "5"
    with Client(srv.port) as c:  # and it goes on serving
        jid = c.call(put_cmd(b"still here")).id
        r = c.call(b"reserve-with-timeout 0\r\n")
        assert r.status == b"RESERVED" and r.id == jid and r.body == b"still here"
        assert c.call(b"delete %d\r\n" % jid).status == b"DELETED"
    # A fixed file loads on the next SIGHUP.
    path.write_text(good.replace("max-jobs = 5", "max-jobs = 9"))
    os.kill(srv.pid, signal.SIGHUP)
    wait_for(lambda: config_of(srv.port)["default"]["max-jobs"] == "9", timeout=30,
             what="the reload of the fixed file")


def test_sighup_warns_that_server_settings_need_a_restart(configured) -> None:
    srv, path = configured
    start = srv.log_path.stat().st_size
    path.write_text(SERVED.format(port=srv.port).replace("max-job-size = 100",
                                                         "max-job-size = 200"))
    os.kill(srv.pid, signal.SIGHUP)
    wait_for_log(srv.log_path, "take effect only on a restart", srv.proc, timeout=30,
                 start=start)
    assert "(max-job-size)" in srv.log()[start:]
    with Client(srv.port) as c:  # still the size it started with
        assert c.call(put_cmd(b"x" * 150)).status == b"JOB_TOO_BIG"


def test_sighup_says_which_changed_settings_a_flag_overrides(tmp_path: Path,
                                                            servers: list[Server]) -> None:
    """A key a flag sets is not "pending a restart": the file's value is not used."""
    port = free_port()
    path = write(tmp_path, SERVED.format(port=port))
    srv = start_with_config(tmp_path, path, port, "-z", "300")
    servers.append(srv)
    start = srv.log_path.stat().st_size
    path.write_text(SERVED.format(port=port).replace("max-job-size = 100", "max-job-size = 200")
                    .replace('data-dir = "data"', 'data-dir = "data2"'))
    os.kill(srv.pid, signal.SIGHUP)
    wait_for_log(srv.log_path, "the file's values are not used", srv.proc, timeout=30,
                 start=start)
    log = srv.log()[start:]
    assert "(data-dir): they take effect only on a restart" in log
    assert "(max-job-size): a command-line flag sets them" in log
    with Client(srv.port) as c:  # the flag's size, still
        assert c.call(put_cmd(b"x" * 250)).status == b"INSERTED"


def test_reload_config_command(configured) -> None:
    srv, path = configured
    good = path.read_text()
    with Client(srv.port) as c:
        path.write_text(good + '\n[tubes."audit"]\nfanout-only = true\n')
        assert c.call(b"reload-config\r\n").status == b"RELOADED"
        assert config_of(srv.port)["audit"]["fanout-only"] == "true"
        path.write_text("[tubes.default\n")
        r = c.call(b"reload-config\r\n")
        assert r.status == b"NOT_RELOADED" and b"not valid TOML" in r.line, r
        assert "audit" in config_of(srv.port)


def test_config_dump_from_a_server(configured) -> None:
    srv, _ = configured
    with Client(srv.port) as c:
        assert c.call(b"use emails\r\n").status == b"USING"
        done = subprocess.run(
            [*smallstalk_cmd(), "config", "dump", "--server", f"127.0.0.1:{srv.port}"],
            capture_output=True, timeout=60, cwd=REPO)
        assert done.returncode == 0, done.stderr
        r = c.call(b"config\r\n")
    assert done.stdout == r.body
    assert list(parse_yaml(done.stdout)) == ["default", "emails"]


def test_config_dump_from_no_server() -> None:
    code, out, err = run_dump("--server", f"127.0.0.1:{free_port()}")
    assert code == 1 and out == "" and "refused" in err


def test_a_server_without_a_file_refuses_reload(servers: list[Server], tmp_path: Path) -> None:
    from ..support.procs import start_smallstalk

    srv = start_smallstalk(tmp_path)
    servers.append(srv)
    with Client(srv.port) as c:
        r = c.call(b"reload-config\r\n")
    assert r.status == b"NOT_RELOADED" and b"--config" in r.line, r
    start = srv.log_path.stat().st_size
    os.kill(srv.pid, signal.SIGHUP)  # logged, not fatal
    wait_for_log(srv.log_path, "the old tube policies stay", srv.proc, timeout=30, start=start)
    assert "no configuration file" in srv.log()[start:]
    assert srv.proc.poll() is None
