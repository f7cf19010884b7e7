"""The one usage line (smallstalk/usage.py): the parser that exits with it, the parser
that raises it, and every `smallstalk` command printing exactly it, in-process."""

from __future__ import annotations

import pytest

from smallstalk import cli, usage


def test_the_line() -> None:
    assert usage.line("smallstalk x", "bad") == "smallstalk x: bad (see `smallstalk x -h`)"
    assert usage.line("smallstalk x y", "bad", "smallstalk x -h") == (
        "smallstalk x y: bad (see `smallstalk x -h`)")
    e = usage.UsageError("no such thing")
    assert e.line() == "smallstalk: no such thing (see `smallstalk -h`)"
    assert e.line("smallstalk aof", "smallstalk help") == (
        "smallstalk aof: no such thing (see `smallstalk help`)")
    named = usage.UsageError("bad --op", "smallstalk aof dump")
    assert named.line("ignored") == "smallstalk aof dump: bad --op (see `smallstalk aof dump -h`)"


def test_the_parser_exits_with_the_line(capsys) -> None:
    p = usage.Parser(prog="smallstalk thing")
    p.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as done:
        p.parse_args(["--n", "x"])
    assert done.value.code == usage.EXIT_USAGE
    assert capsys.readouterr().err == (
        "smallstalk thing: argument --n: invalid int value: 'x' (see `smallstalk thing -h`)\n")


def test_the_parser_raises_the_line_when_asked() -> None:
    p = usage.Parser(prog="smallstalk thing sub", raises=True, see="smallstalk thing -h")
    p.add_argument("file")
    with pytest.raises(usage.UsageError) as refused:
        p.parse_args([])
    assert refused.value.line() == ("smallstalk thing sub: the following arguments are "
                                    "required: file (see `smallstalk thing -h`)")


@pytest.mark.parametrize("command", ["serve", "promote", *cli.TOOL_COMMANDS])
def test_every_command_prints_the_one_line(command: str, capsys) -> None:
    try:
        status = cli.main([command, "--no-such-option"])
    except SystemExit as e:  # the commands whose parser exits (worker, backup, analyze)
        status = e.code
    assert status == (5 if command == "serve" else usage.EXIT_USAGE)
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("smallstalk"), err
    assert err.endswith(f" (see `smallstalk {command} -h`)\n"), err


def test_an_unknown_command_points_at_help(capsys) -> None:
    assert cli.main(["no-such-command"]) == usage.EXIT_USAGE
    assert capsys.readouterr().err == (
        "smallstalk: unknown command: no-such-command (see `smallstalk help`)\n")
