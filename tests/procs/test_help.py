"""Every subcommand: `-h` prints its help and exits 0; a usage error is one line and
a pointer to `-h`, with a non-zero exit status and no traceback."""

from __future__ import annotations

import subprocess

import pytest

from smallstalk.cli import TOOL_COMMANDS
from tests.support.procs import smallstalk_cmd

COMMANDS = ["serve", "promote", *TOOL_COMMANDS]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(smallstalk_cmd() + list(args), capture_output=True, text=True,
                          timeout=120)


def test_the_table_has_every_command() -> None:
    assert {"aof", "replay", "job-history", "analyze", "worker", "config"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_exits_0(command: str, flag: str) -> None:
    proc = run(command, flag)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert f"smallstalk {command}" in proc.stdout
    assert proc.stdout.lower().startswith("usage")
    assert len(proc.stdout.splitlines()) >= 3  # more than a usage line


def test_serve_help_shows_the_long_forms() -> None:
    text = run("serve", "-h").stdout
    for option in ("--listen", "--port", "--max-job-size", "--data-dir", "--segment-bytes",
                   "--version", "--help"):
        assert option in text


@pytest.mark.parametrize("command", COMMANDS)
def test_a_usage_error_is_one_line(command: str) -> None:
    proc = run(command, "--no-such-option")
    assert proc.returncode in (2, 5), proc.stderr  # 5: beanstalkd's status for serve
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"smallstalk {command} -h" in lines[0]


def test_an_unknown_command() -> None:
    proc = run("no-such-command")
    assert proc.returncode == 2
    assert proc.stderr == "smallstalk: unknown command: no-such-command (see `smallstalk help`)\n"
