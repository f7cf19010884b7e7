"""`smallstalk config dump`: the effective per-tube settings, from a file or a server.

`--config FILE` reads and checks the file as `serve --config` would (its
`[server]` table too) and prints the settings of `default` and of every tube
the file names, without a server. `--server HOST:PORT` asks a running server
with the protocol command `config`, which also lists the tubes that exist
there. Both print the same YAML (policy.render).
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import IO

from smallstalk.client.security import token_for_tool
from smallstalk.config import read_file
from smallstalk.core import protocol
from smallstalk.server.policy import ConfigError, render

USAGE = """\
usage: smallstalk config dump [--config FILE | --server HOST:PORT [--token-file FILE]]

Print the effective per-tube settings (limits, max-age, expire-to, fanout,
memory budget) of the tube `default` and every configured tube, as YAML.

  --config FILE       read a configuration file (checking all of it, as
                      `smallstalk serve --config FILE` would); no server needed
  --server HOST:PORT  ask a running server (`config` command); it also lists
                      every tube that exists there. HOST:PORT may be unix:PATH.
                      The default is --server 127.0.0.1:11300.
  --token-file FILE   the admin token to send first (`auth`), for a server
                      started with --admin-token-file; without it, the token
                      in $SMALLSTALK_TOKEN if set (docs/SECURITY.md)
"""

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors exit 2 with our text
        raise _Usage(message)


class _Usage(Exception):
    pass


def main(argv: list[str], stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    if not argv or argv[0] in ("-h", "--help", "help"):
        (out if argv else err).write(USAGE)
        return EXIT_OK if argv else EXIT_USAGE
    if argv[0] != "dump":
        err.write(f"smallstalk config: unknown subcommand: {argv[0]} "
                  "(see `smallstalk config -h`)\n")
        return EXIT_USAGE
    p = _Parser(prog="smallstalk config dump", add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", type=Path)
    where.add_argument("--server")
    p.add_argument("--token-file", type=Path)
    try:
        args = p.parse_args(argv[1:])
    except _Usage as e:
        err.write(f"smallstalk config dump: {e} (see `smallstalk config -h`)\n")
        return EXIT_USAGE
    if args.help:
        out.write(USAGE)
        return EXIT_OK
    if args.config is not None:
        try:
            _settings, policies = read_file(args.config)
        except ConfigError as e:
            err.write(f"smallstalk: {e}\n")
            return EXIT_ERROR
        out.write(render(policies.dump([])).decode())
        return EXIT_OK
    server = args.server or "127.0.0.1:11300"
    try:
        token = token_for_tool(args.token_file)
        body = ask_server(server, protocol.render(protocol.CONFIG), token)
    except _Usage as e:
        err.write(f"smallstalk config dump: {e} (see `smallstalk config -h`)\n")
        return EXIT_USAGE
    except OSError as e:
        err.write(f"smallstalk: {server}: {e.strerror or e}\n")
        return EXIT_ERROR
    except ValueError as e:
        err.write(f"smallstalk: {server}: {e}\n")
        return EXIT_ERROR
    out.write(body.decode(errors="replace"))
    return EXIT_OK


def _line(sock: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
    """The next reply line (without CRLF) and what came after it."""
    while b"\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ValueError("connection closed before a reply")
        buf += chunk
    line, _, rest = buf.partition(b"\r\n")
    return line, rest


def _connect(server: str) -> socket.socket:
    if server.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        try:
            sock.connect(server[len("unix:"):])
        except OSError:
            sock.close()
            raise
        return sock
    host, _, port = server.rpartition(":")
    if not host or not port.isdigit():
        raise _Usage(f"--server takes HOST:PORT or unix:PATH, not {server!r}")
    return socket.create_connection((host.strip("[]"), int(port)), timeout=30)


def ask_server(server: str, command: bytes, token: str | None = None) -> bytes:
    """Send a command answered `OK <bytes>\\r\\n<data>\\r\\n` (after `auth <token>`
    when a token is given); the data.

    Any other reply raises ValueError with the reply's text.
    """
    with _connect(server) as sock:
        if token is not None:
            command = protocol.render(protocol.Auth(token)) + command
        sock.sendall(command)
        buf = b""
        line, rest = _line(sock, buf)
        if token is not None:
            if line + b"\r\n" != protocol.OK:
                raise ValueError(f"the server refused the admin token: "
                                 f"{line.decode(errors='replace')}")
            line, rest = _line(sock, rest)
        word, _, size = line.partition(b" ")
        if word != protocol.OK_WORD or not size.isdigit():
            text = line.decode(errors="replace")
            if line + b"\r\n" == protocol.UNKNOWN_COMMAND:
                text += " (a server without the config command: not smallstalk, or older)"
            raise ValueError(f"the server answered {text}")
        want = int(size) + 2
        while len(rest) < want:
            chunk = sock.recv(65536)
            if not chunk:
                raise ValueError("connection closed in the middle of the reply")
            rest += chunk
        return rest[: want - 2]
