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
    if not argv or argv[0].startswith("-") and argv[0] != "--help":
        socks = _bind_early(argv)
    elif argv[0] == "serve":
        socks = _bind_early(argv[1:])
    # Importing makes only long-lived objects: a collection during it frees nothing,
    # and frozen, they are not walked again by the full collections of a serving loop.
    gc.disable()
    try:
        from smallstalk.cli import main as cli_main
    finally:
        gc.freeze()
        gc.enable()

    return cli_main(argv, listen_sockets=socks)
