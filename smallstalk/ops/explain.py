"""`smallstalk explain HOST:PORT ID`: why a job is (or is not) handed out now.

Asks a running server with the protocol command `explain-job` and prints its
answer: the job's state, then each reason that holds, one per line.
"""

from __future__ import annotations

import sys
from typing import IO

from smallstalk.client import BeanstalkError, Client, CommandError, NotFound, UnknownCommand
from smallstalk.usage import EXIT_USAGE, line

USAGE = """\
usage: smallstalk explain HOST:PORT ID

Print why job ID is (or is not) being handed out now: its state (ready,
delayed, reserved, buried) and every reason that holds, in plain words with
the numbers (delayed until, paused tube, jobs ahead, watchers, limits,
back-off, burial reason, reserver and TTR left, body on disk).
HOST:PORT may be unix:PATH. Exits 0, or 1 when there is no such job.
"""

PROG = "smallstalk explain"


def main(argv: list[str], stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    if argv and argv[0] in ("-h", "--help"):
        out.write(USAGE)
        return 0
    if len(argv) != 2:
        err.write(line(PROG, "takes two arguments, HOST:PORT and a job ID") + "\n")
        return EXIT_USAGE
    server, jid = argv
    host, _, port = server.rpartition(":")
    if not server.startswith("unix:") and not (host and port.isdigit()):
        err.write(line(PROG, f"not HOST:PORT or unix:PATH: {server!r}") + "\n")
        return EXIT_USAGE
    if not jid.isdigit() or not 0 < int(jid) < 1 << 64:
        err.write(line(PROG, f"not a job id: {jid!r}") + "\n")
        return EXIT_USAGE
    try:
        with Client(server, connect_timeout=30, read_timeout=30) as client:
            ex = client.explain(int(jid))
    except NotFound:
        err.write(f"{PROG}: {server} has no job {jid}\n")
        return 1
    except UnknownCommand as e:
        err.write(f"{PROG}: {server} answered {e.reply_line()} (not smallstalk, or older)\n")
        return 1
    except CommandError as e:
        err.write(f"{PROG}: {server} answered {e.reply_line()}\n")
        return 1
    except (BeanstalkError, ValueError) as e:
        err.write(f"{PROG}: {e}\n")
        return 1
    out.write(f"job {ex.id} in tube {ex.tube}: {ex.state} (priority {ex.pri})\n")
    for reason in ex.reasons:
        out.write(f"  - {reason}\n")
    if not ex.reasons:
        out.write("  nothing holds it back: the next reserve on its tube takes it\n")
    return 0
