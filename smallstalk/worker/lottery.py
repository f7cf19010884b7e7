"""Tube choice, the reduced lottery: weighted random draws among the tubes not
seen empty lately (theory in the package docstring)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence


def parse_tubes(spec: str | Sequence[str]) -> dict[str, float]:
    """"high,default,low" or "high:6,default:3,low:1" to weights.

    Without explicit weights the first of n tubes weighs n, the last 1.
    """
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    items = [s for s in items if s]
    if not items:
        raise ValueError("no tubes given")
    out: dict[str, float] = {}
    for k, item in enumerate(items):
        name, sep, weight = item.partition(":")
        if name in out:
            raise ValueError(f"tube {name!r} is listed twice")
        try:
            value = float(weight) if sep else float(len(items) - k)
        except ValueError:
            raise ValueError(f"bad weight in {item!r}") from None
        if not value > 0 or math.isinf(value):
            raise ValueError(f"the weight of {name!r} must be a positive number")
        out[name] = value
    return out


def pick_tube(weights: Mapping[str, float], exclude: Iterable[str],
              rng: random.Random) -> str | None:
    """A weighted random tube among those not in `exclude`; None if none is left."""
    skip = set(exclude)
    names = [t for t, w in weights.items() if w > 0 and t not in skip]
    if not names:
        return None
    return rng.choices(names, weights=[weights[t] for t in names])[0]


class TubeSelector:
    """The reduced lottery's memory: which tubes were seen empty, and when."""

    def __init__(self, weights: Mapping[str, float], rng: random.Random | None = None,
                 recheck: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.weights = dict(weights)
        self.rng = rng or random.Random()
        self.recheck = recheck
        self.clock = clock
        self._empty_until: dict[str, float] = {}

    def empty(self) -> set[str]:
        now = self.clock()
        return {t for t, until in self._empty_until.items() if until > now}

    def choose(self) -> str | None:
        """The tube to poll next; None means every tube was just seen empty: block."""
        return pick_tube(self.weights, self.empty(), self.rng)

    def saw_empty(self, tube: str) -> None:
        self._empty_until[tube] = self.clock() + self.recheck

    def saw_work(self, tube: str) -> None:
        self._empty_until.pop(tube, None)

    def woke(self) -> None:
        """A blocking reserve returned a job: draw from every tube again."""
        self._empty_until.clear()

