"""`smallstalk aof ls|dump|verify`: the command group over a data directory's log (ops/ls.py,
ops/dump.py, ops/verify.py do the work). Read-only, safe beside a running server."""

from __future__ import annotations

import sys
from typing import IO

from smallstalk.ops import dump, ls, verify
from smallstalk.ops.command import EXIT_OK, EXIT_USAGE
from smallstalk.usage import line

AOF_HELP = """\
usage: smallstalk aof {ls,dump,verify} DATA_DIR [OPTIONS]

Inspect the append-only log of a data directory (read-only; safe while the
server runs):
  ls       snapshots and segments: sequence and time ranges, record counts, sizes
  dump     the records, one per line (--format text or jsonl), with filters
  verify   check checksums, sequence continuity and replay; exit 1 on damage

`smallstalk aof COMMAND -h` explains a command.
"""


def main(argv: list[str], stdout: IO[str] | None = None,
         stderr: IO[str] | None = None) -> int:
    commands = {"ls": ls.main, "dump": dump.main, "verify": verify.main}
    if not argv or argv[0] in ("-h", "--help", "help"):
        (stdout or sys.stdout).write(AOF_HELP)
        return EXIT_OK if argv else EXIT_USAGE
    if argv[0] not in commands:
        (stderr or sys.stderr).write(line("smallstalk aof", f"unknown command {argv[0]!r}") + "\n")
        return EXIT_USAGE
    return commands[argv[0]](argv[1:], stdout, stderr)
