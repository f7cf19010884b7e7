"""The operator console: `/metrics` and the web pages, served beside the broker (`--http`).

A layer above server/ (see docs/ARCHITECTURE.md and docs/CONSOLE.md). Its
libraries are the optional extra `smallstalk[console]`: nothing here is
imported unless `--http` is given, so the broker runs without them.
"""

from __future__ import annotations

import importlib.util
import socket

EXTRA_MODULES = ("hypercorn", "starlette", "jinja2", "prometheus_client", "multipart")


def missing_extra() -> str | None:
    """The first module of the console extra that is not installed, or None."""
    for name in EXTRA_MODULES:
        if importlib.util.find_spec(name) is None:
            return name
    return None


def preflight(http: tuple[str, int]) -> tuple[str, bool] | None:
    """Why `--http ADDR:PORT` cannot work, in one line, and whether it is the
    address (it cannot be listened on), or None.

    Checked before the server starts (the port is bound for real later,
    inside the broker's trio loop), so a typo does not end in a traceback.
    """
    missing = missing_extra()
    if missing:
        return (f"--http needs the console extra ({missing} is missing): "
                "pip install 'smallstalk[console]'", False)
    host, port = http
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        return f"--http {host}:{port}: cannot listen there ({e.strerror or e})", True
    return None
