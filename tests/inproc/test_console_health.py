"""The console's `GET /health` (what the container image's healthcheck asks): 200 while
the mutation loop takes turns, 503 when it takes none. The real loop and the real HTTP
server on loopback, as in test_console_guard.py."""

from __future__ import annotations

import json

import pytest

from smallstalk.config import ServeConfig

from ..support.harness import make_loop
from .test_console_guard import ask, free_port, start

pytest.importorskip("hypercorn")


async def test_health_is_ok_while_the_loop_serves(nursery) -> None:
    _, port = await start(nursery)
    status, body, _ = await ask(port, "GET", "/health")
    assert status == 200 and json.loads(body)["role"] == "primary"


async def test_health_is_503_when_the_loop_takes_no_turn(nursery, monkeypatch) -> None:
    from smallstalk.console import app, ha

    monkeypatch.setattr(ha, "HEALTH_SECONDS", 0.5)
    lp = make_loop()  # never run: no call is ever answered
    port = free_port()
    await nursery.start(app.serve, lp, ServeConfig(http=("127.0.0.1", port)))
    status, body, _ = await ask(port, "GET", "/health")
    assert status == 503
    assert "did not answer" in body
