"""Entry point: open the listening socket first, then load the server.

Client libraries' test set-ups start a server binary and connect about 0.1 s
later. Importing trio and the server takes longer than that, so `serve`
parses its flags and binds its socket with the standard library before
anything heavy is imported; a client that connects early waits in the
kernel's accept queue instead of being refused.
"""

from __future__ import annotations

import os
import socket
import sys


def listen_address(argv: list[str]) -> tuple[str, int] | None:
    """Just -l/-p (and --listen/--port) from serve's flags, as config.parse_serve reads them.

    A few lines instead of importing config (attrs and the protocol classes
    cost ~60 ms); tests/test_launch.py checks the two agree.
    """
    addr, port = "127.0.0.1", 11300
    args = list(argv)
    try:
        while args:
            arg = args.pop(0)
            if arg.startswith("--"):
                name, eq, value = arg.partition("=")
                if name in ("--help", "--version", "--config"):
                    # --config may name another address: the full parser decides,
                    # and the server binds after reading the file.
                    return None
                if name == "--no-compact":
                    continue
                if not eq:
                    value = args.pop(0)
                if name == "--listen":
                    addr = value
                elif name == "--port":
                    port = int(value)
                continue
            if not arg.startswith("-") or arg == "-":
                return None
            flags = arg[1:]
            while flags:
                ch, flags = flags[0], flags[1:]
                if ch in "lpzbfsu":
                    value, flags = (flags, "") if flags else (args.pop(0), "")
                    if ch == "l":
                        addr = value
                    elif ch == "p":
                        port = int(value)
                elif ch in "vh":
                    return None
    except (IndexError, ValueError):
        return None  # the full parser reports it
    return addr, port


def _bind_early(argv: list[str]) -> socket.socket | None:
    where = listen_address(argv)
    if where is None:
        return None
    addr, port = where
    try:
        if addr.startswith("unix:"):
            path = addr[len("unix:"):]
            if os.path.exists(path):
                os.unlink(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
        else:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(
                addr or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
        sock.listen(1024)
        return sock
    except OSError:
        return None  # the server's own listener code reports it properly


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sock = None
    if not argv or argv[0].startswith("-") and argv[0] != "--help":
        sock = _bind_early(argv)
    elif argv[0] == "serve":
        sock = _bind_early(argv[1:])
    from smallstalk.cli import main as cli_main

    return cli_main(argv, listen_socket=sock)
