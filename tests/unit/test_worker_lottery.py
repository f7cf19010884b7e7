"""The worker library as pure functions: tube weights, the reduced lottery on a seeded RNG,
backoff, the task payload and task registration (the processes are in tests/procs/test_worker.py).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from smallstalk.worker import (
    App,
    BadPayload,
    TubeSelector,
    backoff_delay,
    decode_call,
    encode_call,
    parse_tubes,
    pick_tube,
    time_limit,
)
from smallstalk.worker.batch import needs_touch

WEIGHTS = parse_tubes("high,default,low")


def test_parse_tubes() -> None:
    assert WEIGHTS == {"high": 3.0, "default": 2.0, "low": 1.0}
    assert parse_tubes("a:6, b:0.5") == {"a": 6.0, "b": 0.5}
    assert parse_tubes(["x"]) == {"x": 1.0}
    for bad in ("", "a,a", "a:0", "a:-1", "a:x"):
        with pytest.raises(ValueError):
            parse_tubes(bad)


def test_pick_tube_is_deterministic_for_a_seed() -> None:
    first = [pick_tube(WEIGHTS, (), random.Random(7)) for _ in range(3)]
    assert len(set(first)) == 1  # same seed, same first draw
    a, b = random.Random(42), random.Random(42)
    seq = [pick_tube(WEIGHTS, (), a) for _ in range(200)]
    assert seq == [pick_tube(WEIGHTS, (), b) for _ in range(200)]
    assert set(seq) == set(WEIGHTS)


def test_pick_tube_follows_the_weights_and_skips_the_excluded() -> None:
    rng = random.Random(1)
    counts = Counter(pick_tube(WEIGHTS, (), rng) for _ in range(6000))
    for tube, weight in WEIGHTS.items():
        assert abs(counts[tube] / 6000 - weight / 6) < 0.03, counts
    counts = Counter(pick_tube(WEIGHTS, {"high"}, rng) for _ in range(3000))
    assert set(counts) == {"default", "low"}
    assert abs(counts["low"] / 3000 - 1 / 3) < 0.04
    assert pick_tube(WEIGHTS, {"high", "default", "low"}, rng) is None
    assert pick_tube({}, (), rng) is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_selector_forgets_empty_tubes_after_recheck() -> None:
    clock = FakeClock()
    sel = TubeSelector(WEIGHTS, random.Random(3), recheck=1.0, clock=clock)
    sel.saw_empty("high")
    assert all(sel.choose() != "high" for _ in range(200))
    clock.now = 0.99
    assert "high" in sel.empty()
    clock.now = 1.0
    assert sel.empty() == set()
    sel.saw_empty("high")
    sel.saw_empty("default")
    sel.saw_empty("low")
    assert sel.choose() is None  # everything empty: the worker blocks on all tubes
    sel.woke()
    assert sel.choose() is not None


def simulate(ready: dict[str, int], rounds: int, seed: int = 5,
             arrivals: Callable[[int], dict[str, int]] | None = None) -> dict[str, Any]:
    """The worker's reserve loop against counters instead of a server: 10 ms
    per poll and per job; when every tube is empty it blocks (one round = 1 s)
    until a job arrives anywhere, as `reserve` without timeout does."""
    clock = FakeClock()
    sel = TubeSelector(WEIGHTS, random.Random(seed), recheck=1.0, clock=clock)
    polls: Counter[str] = Counter()
    served: list[str] = []
    blocked_rounds = 0
    blocked = False
    for n in range(rounds):
        for tube, more in (arrivals(n) if arrivals else {}).items():
            ready[tube] += more
        if blocked:
            busy = [t for t in WEIGHTS if ready[t]]
            if not busy:
                blocked_rounds += 1
                clock.now += 1.0
                continue
            ready[busy[0]] -= 1  # the blocking reserve returns the first job anywhere
            served.append(busy[0])
            blocked = False
            sel.woke()
            continue
        tube = sel.choose()
        clock.now += 0.01
        if tube is None:
            blocked = True
            continue
        polls[tube] += 1
        if ready[tube]:
            ready[tube] -= 1
            served.append(tube)
            sel.saw_work(tube)
            clock.now += 0.01
        else:
            sel.saw_empty(tube)
    return {"polls": polls, "served": Counter(served), "blocked_rounds": blocked_rounds,
            "elapsed": clock.now}


def test_lottery_prefers_busy_high_tubes_without_starving_low_ones() -> None:
    result = simulate({"high": 10_000, "default": 10_000, "low": 10_000}, 3000)
    served = result["served"]
    assert served["high"] > served["default"] > served["low"] > 0.1 * 3000
    assert abs(served["high"] / 3000 - 0.5) < 0.05  # weight 3 of 6


def test_lottery_does_not_hammer_empty_tubes() -> None:
    result = simulate({"high": 0, "default": 10_000, "low": 10_000}, 3000)
    # The empty tube is polled about once per recheck interval, not at every reserve.
    assert result["polls"]["high"] <= result["elapsed"] / 1.0 + 2
    assert result["served"]["low"] > 0.25 * 3000  # 1 of default+low's 3


def test_lottery_blocks_when_everything_is_empty_and_wakes_for_work() -> None:
    # Nothing at all: one poll per tube, then a single blocking reserve.
    result = simulate({"high": 0, "default": 0, "low": 0}, 100)
    assert result["polls"] == {"high": 1, "default": 1, "low": 1}
    assert result["blocked_rounds"] == 100 - 4
    # A burst in "high" while blocked: the blocking reserve takes the first
    # job, then the lottery draws from every tube again at once.
    result = simulate({"high": 0, "default": 0, "low": 0}, 200,
                      arrivals=lambda n: {"high": 20} if n == 100 else {})
    assert result["served"]["high"] == 20
    assert result["polls"]["high"] >= 20


def test_backoff_and_time_limit() -> None:
    assert [backoff_delay(1.0, n, 3600) for n in (1, 2, 3, 4)] == [1, 2, 4, 8]
    assert backoff_delay(5, 30, 3600) == 3600
    assert backoff_delay(0, 3, 3600) == 0
    assert backoff_delay(0.25, 1, 10) == 1  # whole seconds, rounded up
    assert time_limit(60) == 59 and time_limit(1) == 0.5


def test_payload_round_trip_and_rejects() -> None:
    body = encode_call("m.f", (1, "two", b"3"), {"k": [4.5]})
    assert decode_call(body) == ("m.f", [1, "two", b"3"], {"k": [4.5]})
    for bad in (b"\xff\xfe", b"plain text", encode_call("f", (), {})[:-1],
                bytes.fromhex("a1617601")):  # CBOR {"v": 1} without the rest
        with pytest.raises(BadPayload):
            decode_call(bad)


def test_a_publish_s_own_ttr_travels_in_the_payload() -> None:
    """options(ttr=...) puts the job's TTR in its body, for the worker's time
    limit; the task's own TTR adds nothing (the body stays what it was)."""
    from smallstalk.worker.codec import decode_job

    app = App("127.0.0.1:1")

    @app.task(ttr=60)
    def f(x: int) -> None: ...

    plain = f.encode((1,), {})
    assert plain == encode_call(f.name, (1,), {}) and decode_job(plain)[3] is None
    own = f.options(ttr=3).encode((1,), {})
    assert decode_job(own) == (f.name, [1], {}, 3) and decode_call(own) == (f.name, [1], {})
    assert f.options(ttr=60).encode((1,), {}) == plain
    for ttr in (0, -1, "3", 1.5):
        with pytest.raises(BadPayload, match="ttr"):
            decode_job(encode_call("f", (), {}, ttr=ttr))


def test_task_registration() -> None:
    app = App("127.0.0.1:1")

    @app.task
    def plain(x: int) -> int:
        """Doubles."""
        return 2 * x

    @app.task(name="custom", tube="high", priority=5, ttr=9, retries=0)
    async def fancy() -> None:
        pass

    assert plain(21) == 42 and plain.__doc__ == "Doubles." and plain.__name__ == "plain"
    assert plain.name == f"{__name__}.test_task_registration.<locals>.plain"
    assert (fancy.name, fancy.tube, fancy.priority, fancy.ttr, fancy.is_async) == (
        "custom", "high", 5, 9, True)
    assert app.tubes() == ["default", "high"]
    later = fancy.options(delay=30, tube="low")
    assert (later.delay, later.tube, fancy.delay, fancy.tube) == (30, "low", 0, "high")
    with pytest.raises(ValueError):
        app.task(name="custom")(lambda: None)
    with pytest.raises(ValueError):
        app.task(ttr=0)(lambda: None)


def test_a_batch_job_is_touched_once_its_wait_ate_half_its_time_limit() -> None:
    # ttr 60: limit 59 s, touched past 29.5 s of waiting; ttr 2: limit 1 s, past 0.5 s.
    assert not needs_touch(100.0, 129.5, 60) and needs_touch(100.0, 129.6, 60)
    assert not needs_touch(0.0, 0.5, 2) and needs_touch(0.0, 0.51, 2)
    assert not needs_touch(5.0, 5.0, 1)  # the first job of a reply starts at once
