"""Entry point: open the listening socket first, then load the server.

Client libraries' test set-ups start a server binary and connect about 0.1 s
later. Importing trio and the server takes longer than that, so `serve`
parses its flags and binds its socket with the standard library before
anything heavy is imported; a client that connects early waits in the
kernel's accept queue instead of being refused.
"""

from __future__ import annotations

import gc
import socket
import sys

from smallstalk.listen import ListenError, activated, bind, listen_address

__all__ = ["listen_address", "main"]


def _bind_early(argv: list[str]) -> list[socket.socket] | None:
    where = listen_address(argv)
    if where is None or activated():  # systemd's sockets are open already
        return None
    try:
        return bind(*where)
    except ListenError:
        return None  # cli.py binds again and reports it


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    socks = None
    serving = False
    if not argv or argv[0].startswith("-") and argv[0] != "--help":
        socks = _bind_early(argv)
        serving = True
    elif argv[0] == "serve":
        socks = _bind_early(argv[1:])
        serving = True
    # Importing makes only long-lived objects: a collection during it frees nothing,
    # and frozen, they are not walked again by the full collections of a serving loop.
    gc.disable()
    try:
        from smallstalk.cli import main as cli_main
    finally:
        gc.freeze()
        gc.enable()

    code = cli_main(argv, listen_sockets=socks)
    if serving:
        _exit_without_teardown(code)
    return code


def _exit_without_teardown(code: int) -> None:
    """End a server that has stopped: its journal is closed and its lock
    released, so what is left is the interpreter's teardown, a collection and
    a free of every job it held, which takes longer the more jobs there are,
    and which the kernel does at once by dropping the process. Logs and the
    standard streams are flushed first; with a thread the normal exit
    would wait for still running, it waits for it as before."""
    import logging
    import os
    import threading

    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed, or a pipe nobody reads: nothing left to say there
    os._exit(code)
