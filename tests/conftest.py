"""Fixtures shared by the process-level tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .support.procs import Server


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """Servers a test starts; each is killed (by its PID) when the test ends."""
    started: list[Server] = []
    yield started
    for s in started:
        s.kill()
