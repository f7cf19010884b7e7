"""How an operator tool runs as a command: its argument parser, its errors and their
exit codes, and `run`, which turns each error into its one line and status.

Exit codes: 0 done; 1 damage, a missing job, or another error; 2 bad usage;
3 the history needed was folded away into a snapshot by the compactor.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

from smallstalk.ops.text import Out
from smallstalk.storage import datadir
from smallstalk.storage.aof import CorruptionError
from smallstalk.storage.history import HistoryFolded
from smallstalk.usage import EXIT_USAGE, Parser, UsageError

EXIT_OK, EXIT_ERROR, EXIT_FOLDED = 0, 1, 3

__all__ = ["EXIT_ERROR", "EXIT_FOLDED", "EXIT_OK", "EXIT_USAGE", "ToolError", "UsageError",
           "parser", "run", "seq_arg"]


class ToolError(Exception):
    """A plain failure to report (not damage, not folded history)."""


def parser(prog: str, description: str) -> Parser:
    """The parser of a tool over a data directory (`smallstalk PROG DATA_DIR ...`)."""
    p = Parser(prog=f"smallstalk {prog}", description=description, raises=True,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_dir", metavar="DATA_DIR", type=Path, help="the server's --data-dir")
    p.add_argument("--utc", action="store_true", help="show (and read) times in UTC")
    return p


def seq_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a sequence number: {text}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def run(argv: list[str], parse: Callable[[list[str]], argparse.Namespace],
        body: Callable[[argparse.Namespace, Out], int],
        stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    err = stderr if stderr is not None else sys.stderr
    try:
        args = parse(argv)
    except UsageError as e:
        err.write(f"{_usage_line(e)}\n")
        return EXIT_USAGE
    except SystemExit as e:  # --help
        return int(e.code or 0)
    data_dir = args.data_dir
    out = Out(data_dir, stdout, stderr)
    if not data_dir.is_dir():
        what = "not a directory" if data_dir.exists() else "no such directory"
        err.write(f"smallstalk: {data_dir}: {what}\n")
        return EXIT_ERROR
    if not datadir.is_data_dir(data_dir):
        err.write(f"smallstalk: {data_dir}: not a data directory (no aof/ or snapshots/): "
                  "give the server's --data-dir\n")
        return EXIT_ERROR
    try:
        return body(args, out)
    except UsageError as e:
        out.end_progress()
        err.write(f"{_usage_line(e)}\n")
        return EXIT_USAGE
    except HistoryFolded as e:
        out.end_progress()
        err.write(f"smallstalk: {out.rel(e)}\n")
        return EXIT_FOLDED
    except CorruptionError as e:
        out.end_progress()
        err.write(f"smallstalk: damage: {out.rel(e)}\n")
        return EXIT_ERROR
    except BrokenPipeError:
        # Output piped into `head` and friends: stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (ToolError, OSError) as e:
        out.end_progress()
        err.write(f"smallstalk: {out.rel(e)}\n")
        return EXIT_ERROR
    finally:
        out.end_progress()


def _usage_line(e: UsageError) -> str:
    """The parser's line (`PROG: MESSAGE (see `PROG -h`)`), or a mistake in a value
    found while the tool runs (an ISO time, a path), which names itself."""
    return e.line() if e.prog else f"smallstalk: {e}"
