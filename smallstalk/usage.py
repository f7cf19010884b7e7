"""The one usage error of every `smallstalk` command: one line that names the command,
says what is wrong and points at its `-h` (argparse's own prints the whole usage
first). `Parser` is argparse with that line; `UsageError` is the same mistake found
by hand; `line` is the one place the text is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import argparse

EXIT_USAGE = 2


def line(prog: str, message: str, see: str | None = None) -> str:
    """`PROG: MESSAGE (see `PROG -h`)`; `see` names the help when it is elsewhere
    (`smallstalk config -h` for `smallstalk config dump`, `smallstalk help`)."""
    return f"{prog}: {message} (see `{see or prog + ' -h'}`)"


class UsageError(Exception):
    """An operator's usage mistake. With `prog` (argparse's, or a command's own) it is
    shown as `line(prog, message, see)`; without, the caller that catches it
    names the command."""

    def __init__(self, message: str, prog: str | None = None, see: str | None = None):
        super().__init__(message)
        self.prog = prog
        self.see = see

    def line(self, prog: str | None = None, see: str | None = None) -> str:
        """The one line, naming `self.prog` if it has one, else `prog`."""
        return line(self.prog or prog or "smallstalk", str(self), self.see or see)


def __getattr__(name: str) -> Any:
    # `Parser` is made on first use: argparse (and gettext) cost ~2 ms that
    # `smallstalk serve`, which parses its flags by hand, does not pay.
    if name == "Parser":
        globals()["Parser"] = cls = _parser_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _parser_class() -> type[argparse.ArgumentParser]:
    import argparse

    class Parser(argparse.ArgumentParser):
        """argparse, but a usage error is `line(prog, message, see)`: printed with exit
        status 2 (a command-line entry point), or raised as UsageError with
        `raises=True` (a caller that reports errors itself, or an in-process test)."""

        def __init__(self, *args, raises: bool = False, see: str | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.raises = raises
            self.see = see

        def error(self, message: str) -> NoReturn:  # type: ignore[override]
            if self.raises:
                raise UsageError(message, self.prog, self.see)
            self.exit(EXIT_USAGE, line(self.prog, message, self.see) + "\n")

    return Parser
