"""Helpers of the read-behind tests: random bodies, the bytes a state holds in memory, open files."""

from __future__ import annotations

import os
import random

from smallstalk.core.state import State


def rand_bodies(n: int, lo: int = 500, hi: int = 3000, seed: int = 1) -> list[bytes]:
    rnd = random.Random(seed)
    return [rnd.randbytes(rnd.randint(lo, hi)) for _ in range(n)]


def in_memory(st: State) -> int:
    return st.body_bytes - st.spilled_bytes


def open_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out
