"""`smallstalk worker module:app`: the worker's command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import ssl
import sys

import trio

from smallstalk.client.security import TOKEN_ENV, Security, security
from smallstalk.usage import Parser

from .logs import log_event, setup_logging
from .runner import Worker
from .tasks import App


def load_app(spec: str) -> App:
    """"module:attribute" (attribute defaults to `app`), importable from the current directory."""
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise ValueError(f"expected module:app, got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    module = importlib.import_module(module_name)
    app = getattr(module, attr or "app", None)
    if not isinstance(app, App):
        raise ValueError(f"{spec} is not a smallstalk.worker.App")
    return app


def _parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="smallstalk worker",
        description="Run the tasks of an App from beanstalkd/smallstalk tubes.")
    ap.add_argument("app", help="module:attribute of the App (attribute defaults to app)")
    ap.add_argument("--tubes", help="tubes by priority, first highest: high,default,low or "
                    "high:6,default:3,low:1 (default: the tubes of the app's tasks)")
    ap.add_argument("--servers", help="host:port,... (default: the app's servers)")
    ap.add_argument("-c", "--concurrency", type=int, default=1, help="jobs at a time (default 1)")
    ap.add_argument("--batch", type=int, default=1, metavar="N",
                    help="take up to N jobs per reserve (smallstalk's reserve-batch; they "
                    "run in order, their deletes pipelined; default 1: plain reserve)")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds running jobs get to finish after SIGTERM (default 30)")
    ap.add_argument("--recheck", type=float, default=1.0,
                    help="seconds an empty tube stays out of the lottery (default 1)")
    ap.add_argument("--tls", action="store_true",
                    help="speak TLS to the servers, checking them against the system's CAs")
    ap.add_argument("--tls-ca", metavar="FILE",
                    help="speak TLS, checking the servers against this CA (PEM)")
    ap.add_argument("--tls-cert", metavar="FILE",
                    help="this worker's certificate (PEM) for servers that ask for one")
    ap.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert (PEM)")
    ap.add_argument("--token-file", metavar="FILE",
                    help=f"send the admin token in FILE with `auth` (else ${TOKEN_ENV})")
    ap.add_argument("--log-format", choices=("json", "text"), default="json")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    return ap


async def _run_until_signalled(worker: Worker) -> None:
    async def signals(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            task_status.started()
            count = 0
            async for sig in received:
                count += 1
                log_event(logging.INFO, "worker.signal", signal=signal.Signals(sig).name)
                worker.stop(grace=None if count == 1 else 0)

    async with trio.open_nursery() as nursery:
        await nursery.start(signals)
        await worker.run()
        nursery.cancel_scope.cancel()


def _security(args: argparse.Namespace, app: App) -> Security | None:
    """The TLS and token settings the flags ask for; None keeps the app's."""
    token = os.environ.get(TOKEN_ENV) if args.token_file is None else None
    tls = args.tls or args.tls_ca or args.tls_cert
    if args.tls_key and not args.tls_cert:
        raise ValueError("--tls-key needs --tls-cert")
    if not (tls or args.token_file or token):
        return None
    context = app.security.ssl_context
    if tls:
        try:
            context = ssl.create_default_context(cafile=args.tls_ca)
            if args.tls_cert:
                context.load_cert_chain(args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot load the TLS files: {e}") from None
    if args.token_file or token:
        return security(ssl_context=context, token=token, token_file=args.token_file)
    return Security(context, app.security.token)


def main(argv: list[str] | None = None) -> int:
    """`smallstalk worker`: 0 after a graceful stop, 2 on bad arguments or app."""
    ap = _parser()
    try:
        args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        app = load_app(args.app)
        worker = Worker(app, args.tubes, servers=args.servers, concurrency=args.concurrency,
                        grace=args.grace, recheck=args.recheck, security=_security(args, app),
                        batch=args.batch)
    except (ImportError, ValueError) as e:
        print(f"smallstalk worker: {e}", file=sys.stderr)
        return 2
    setup_logging(args.log_format, logging.DEBUG if args.verbose else logging.INFO)
    trio.run(_run_until_signalled, worker)
    return 0
