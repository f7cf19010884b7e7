"""Helper threads whose failure fails the test that started them.

A failed assert in a plain thread is only a warning under pytest (pyproject
also turns that warning into an error); `join()` here re-raises the thread's
exception in the test's own thread, and a thread still running after the
timeout is a failure too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Thread(threading.Thread):
    def __init__(self, target: Callable[..., Any], *args: Any, name: str | None = None) -> None:
        super().__init__(target=target, args=args, name=name, daemon=True)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as e:  # handed to join(), in the test's thread
            self.error = e

    def join(self, timeout: float | None = 30.0) -> None:
        super().join(timeout)
        if self.is_alive():
            raise AssertionError(f"thread {self.name} still running after {timeout} s")
        if self.error is not None:
            raise self.error


def start(target: Callable[..., Any], *args: Any) -> Thread:
    t = Thread(target, *args)
    t.start()
    return t
