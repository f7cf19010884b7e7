"""`smallstalk search HOST:PORT TUBE PATTERN`: find a tube's jobs by body or
key, and count, kick, delete or move them, counting before acting.

Asks a running server with the admin commands `search-jobs` and `bulk-jobs`
(docs/PROTOCOL-EXTENSIONS.md). An action without `--yes` only counts the
matches and says how to act on them; with `--yes` it acts on at most
`--max` jobs (the count the operator saw).
"""

from __future__ import annotations

import argparse
import sys
from typing import IO

from smallstalk.client import BeanstalkError, Client, CommandError, UnknownCommand
from smallstalk.usage import EXIT_USAGE, Parser, UsageError

PROG = "smallstalk search"
DESCRIPTION = """\
Find the jobs of TUBE in a state whose body holds PATTERN (or matches it as
a regular expression, RE2 syntax, or whose idempotency key it is) and print
their ids, ascending; page on with --after. With --kick, --delete or
--move TUBE: count the matches and, with --yes, act on at most --max of
them. HOST:PORT may be unix:PATH. Needs admin rights (an address the server
trusts, or the token in SMALLSTALK_TOKEN). Exits 0, 1 on an error, 2 on bad usage.
"""


def _parser() -> Parser:
    p = Parser(prog=PROG, description=DESCRIPTION, raises=True,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("server", metavar="HOST:PORT")
    p.add_argument("tube", metavar="TUBE")
    p.add_argument("pattern", metavar="PATTERN")
    p.add_argument("--state", default="ready",
                   choices=("ready", "delayed", "reserved", "buried"))
    how = p.add_mutually_exclusive_group()
    how.add_argument("--regex", action="store_true", help="PATTERN is a regular expression")
    how.add_argument("--key", action="store_true", help="PATTERN is an idempotency key")
    p.add_argument("--after", type=int, default=0, help="ids after this one (paging)")
    p.add_argument("--count", type=int, default=100, help="ids to print (at most 1000)")
    act = p.add_mutually_exclusive_group()
    act.add_argument("--kick", action="store_true")
    act.add_argument("--delete", action="store_true")
    act.add_argument("--move", metavar="TO_TUBE")
    act.add_argument("--matches", action="store_true", help="print only how many match")
    p.add_argument("--yes", action="store_true", help="act (after counting)")
    p.add_argument("--max", type=int, help="act on at most this many (required with --yes)")
    return p


def main(argv: list[str], stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    parser = _parser()
    if argv and argv[0] in ("-h", "--help"):
        out.write(parser.format_help())
        return 0
    try:
        a = parser.parse_args(argv)
        action = "kick" if a.kick else "delete" if a.delete else "move" if a.move else ""
        if a.yes and (not action or a.max is None):
            parser.error("--yes acts: it needs --kick, --delete or --move, and --max N")
    except UsageError as e:
        err.write(e.line(PROG) + "\n")
        return EXIT_USAGE
    how = "regex" if a.regex else "key" if a.key else "substr"
    try:
        with Client(a.server, connect_timeout=30, read_timeout=30) as client:
            if not action and not a.matches:
                for jid in client.search_jobs(a.tube, a.pattern, state=a.state, how=how,
                                              after=a.after, count=a.count):
                    out.write(f"{jid}\n")
                return 0
            if not a.yes:
                n = client.bulk_jobs(a.tube, a.pattern, "count", state=a.state, how=how)
                out.write(f"{n} {a.state} jobs of tube {a.tube} match\n")
                if action and n:
                    out.write(f"to {action} them, run again with --yes --max {n}\n")
                return 0
            n = client.bulk_jobs(a.tube, a.pattern, action, state=a.state, how=how,
                                 to=a.move, max=a.max)
            verb = {"kick": "kicked", "delete": "deleted", "move": f"moved to {a.move}"}[action]
            out.write(f"{n} jobs {verb}\n")
            return 0
    except UnknownCommand as e:
        err.write(f"{PROG}: {a.server} answered {e.reply_line()} (not smallstalk, or older)\n")
    except CommandError as e:
        err.write(f"{PROG}: {a.server} answered {e.reply_line()}\n")
    except (BeanstalkError, ValueError) as e:
        err.write(f"{PROG}: {e}\n")
    return 1
