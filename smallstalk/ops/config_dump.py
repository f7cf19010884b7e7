"""`smallstalk config dump`: the effective per-tube settings, from a file or a server.

`--config FILE` reads and checks the file as `serve --config` would (its
`[server]` and `[ha]` tables, how its settings fit together, and that its
certificate and key files load) and prints the settings of `default` and of every tube
the file names, without a server. `--server HOST:PORT` asks a running server
with the protocol command `config`, which also lists the tubes that exist
there. Both print the same YAML (policy.render).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import IO

from smallstalk.client import BeanstalkError, Client, CommandError, Unauthorized, UnknownCommand
from smallstalk.client.security import token_for_tool
from smallstalk.config import check_file
from smallstalk.server import tls
from smallstalk.server.policy import render
from smallstalk.usage import EXIT_USAGE, Parser, UsageError, line

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

EXIT_OK, EXIT_ERROR = 0, 1
PROG, SEE = "smallstalk config dump", "smallstalk config -h"


def main(argv: list[str], stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    if not argv or argv[0] in ("-h", "--help", "help"):
        (out if argv else err).write(USAGE)
        return EXIT_OK if argv else EXIT_USAGE
    if argv[0] != "dump":
        err.write(line("smallstalk config", f"unknown subcommand: {argv[0]}") + "\n")
        return EXIT_USAGE
    p = Parser(prog=PROG, add_help=False, raises=True, see=SEE)
    p.add_argument("-h", "--help", action="store_true")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", type=Path)
    where.add_argument("--server")
    p.add_argument("--token-file", type=Path)
    try:
        args = p.parse_args(argv[1:])
    except UsageError as e:
        err.write(e.line() + "\n")
        return EXIT_USAGE
    if args.help:
        out.write(USAGE)
        return EXIT_OK
    if args.config is not None:
        try:
            cfg = check_file(args.config)
            tls.contexts_for(cfg)  # the certificate and key files load, as at a start
        except (UsageError, tls.TLSFileError) as e:
            err.write(f"smallstalk: {e}\n")
            return EXIT_ERROR
        out.write(render(cfg.policies.dump([])).decode())
        return EXIT_OK
    server = args.server or "127.0.0.1:11300"
    try:
        token = token_for_tool(args.token_file)
        text = ask_server(server, token)
    except UsageError as e:
        err.write(e.line(PROG, SEE) + "\n")
        return EXIT_USAGE
    except (BeanstalkError, ValueError) as e:
        err.write(f"smallstalk: {e}\n")
        return EXIT_ERROR
    out.write(text)
    return EXIT_OK


def ask_server(server: str, token: str | None = None) -> str:
    """The server's `config` answer (after `auth <token>` when a token is given).

    An address that is not one raises UsageError; a refused command, the
    server's error (its reply in the text); no server, ConnectionFailed.
    """
    host, _, port = server.rpartition(":")
    try:
        if not server.startswith("unix:") and not (host and port.isdigit()):
            raise ValueError("no port")
        client = Client(server, connect_timeout=30, read_timeout=30, token=token)
    except (TypeError, ValueError):
        raise UsageError(f"--server takes HOST:PORT or unix:PATH, not {server!r}") from None
    with client:
        try:
            return client.config()
        except UnknownCommand as e:
            raise ValueError(f"{server}: the server answered {e.reply_line()} (a server "
                             "without the config command: not smallstalk, or older)") from None
        except Unauthorized as e:
            what = "refused the admin token" if token is not None else "answered"
            raise ValueError(f"{server}: the server {what} {e.reply_line()}") from None
        except CommandError as e:
            raise ValueError(f"{server}: the server answered {e.reply_line()}") from None
