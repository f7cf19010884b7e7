"""server/unsent.py: when the unsent-reply total is worth a log line and a
trim, and that the trim gives freed memory back to the system."""

from __future__ import annotations

import logging
from pathlib import Path

from smallstalk.server import unsent
from smallstalk.server.session import UNSENT_BUDGET

MiB = 1 << 20


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_the_budget_is_logged_once_a_minute_and_a_big_total_back_at_zero_is_trimmed(
        caplog) -> None:
    u = unsent.Unsent()
    with caplog.at_level(logging.WARNING, logger="smallstalk.server.unsent"):
        u.changed(0, UNSENT_BUDGET + 1, now=100.0)
        u.changed(UNSENT_BUDGET + 1, 0, now=101.0)  # back to zero: trimmed
        assert u.peak == 0
        u.changed(0, UNSENT_BUDGET + 1, now=130.0)  # within the minute: no line
        u.changed(UNSENT_BUDGET + 1, 0, now=131.0)
        u.changed(0, UNSENT_BUDGET + 1, now=161.0)
    assert [r.getMessage().startswith("more than 64 MiB") for r in caplog.records] == [True, True]
    small = unsent.Unsent()
    small.changed(0, unsent.TRIM_FROM - 1, now=0.0)
    small.changed(unsent.TRIM_FROM - 1, 0, now=0.0)
    assert small.peak == unsent.TRIM_FROM - 1  # a slow client's few replies: no trim


def test_the_trim_returns_freed_replies_kept_apart_by_survivors() -> None:
    # Reply-sized objects with a small survivor between them: freeing them
    # leaves holes the C allocator keeps (its own trim reaches only the top).
    replies, survivors = [], []
    for i in range(20_000):
        replies.append(bytes(12_000 + i % 7))
        survivors.append(bytes(700))
    base = _rss()
    del replies
    kept = _rss()
    unsent.give_back_freed_memory()
    after = _rss()
    assert kept - after > 100 * MiB, (base, kept, after)
