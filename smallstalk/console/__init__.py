"""The operator console: `/metrics` and the web pages, served beside the broker (`--http`).

A layer above server/ (see docs/ARCHITECTURE.md and docs/CONSOLE.md). Its
libraries are the optional extra `smallstalk[console]`: nothing here is
imported unless `--http` is given, so the broker runs without them.
"""

from __future__ import annotations

import importlib.util

EXTRA_MODULES = ("hypercorn", "starlette", "jinja2", "prometheus_client", "multipart")


def missing_extra() -> str | None:
    """The first module of the console extra that is not installed, or None."""
    for name in EXTRA_MODULES:
        if importlib.util.find_spec(name) is None:
            return name
    return None
