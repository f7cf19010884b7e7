"""The argument parser for `smallstalk` subcommands built on argparse: a usage error
is one line and a pointer to `-h` (argparse's own prints the whole usage first)."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error prints `PROG: MESSAGE (see `PROG -h`)` and exits 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} -h`)\n")
