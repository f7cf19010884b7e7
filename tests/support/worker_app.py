"""Tasks for the worker process tests (`python -m smallstalk worker tests.support.worker_app:app`).

Tasks report what they do by putting "<event>:<tag>" into the tube "results"
on the server they run against, so a test waits for a reserve instead of
sleeping and hoping.
"""

from __future__ import annotations

import os
import signal
import threading

import trio

from smallstalk.client import AsyncClient
from smallstalk.worker import App, atouch, current_job, touch

app = App()  # the servers come from $SMALLSTALK_SERVERS
RESULTS = "results"


def report(event: str, tag: str) -> None:
    app.client().put(f"{event}:{tag}", tube=RESULTS)


async def areport(event: str, tag: str) -> None:
    await app.async_client().put(f"{event}:{tag}", tube=RESULTS)


@app.task(tube="default")
def echo(tag: str) -> None:
    report("done", tag)


@app.task(tube="high")
def echo_high(tag: str) -> None:
    report("done", tag)


@app.task(tube="low")
def echo_low(tag: str) -> None:
    report("done", tag)


@app.task(tube="default", ttr=60, retries=0)
def hang(tag: str) -> None:
    """Runs until the process dies."""
    report("started", tag)
    threading.Event().wait()


@app.task(tube="default", ttr=60)
async def slow(tag: str, seconds: float) -> None:
    await areport("started", tag)
    await trio.sleep(seconds)
    await areport("done", tag)


@app.task(tube="default", ttr=60, retries=0)
async def sleepy(tag: str, seconds: float) -> None:
    """`slow` without a retry: a test publishes it with a TTR of its own."""
    await areport("started", tag)
    await trio.sleep(seconds)
    await areport("done", tag)


@app.task(tube="default", retries=2, backoff=1.0)
def always_fails(tag: str) -> None:
    report("attempt", tag)
    raise ValueError(f"boom {tag}")


@app.task(tube="default", ttr=30)
async def gate(tag: str) -> None:
    """Starts, then waits for a job in the tube gate-<tag>: proves jobs run side by side."""
    await areport("started", tag)
    async with AsyncClient(app.servers) as client:
        job = await client.reserve(20, tubes=[f"gate-{tag}"])
        await client.delete(job)
    await areport("done", tag)


@app.task(tube="default", ttr=2, retries=0)
async def long_async(tag: str, seconds: float) -> None:
    """Runs longer than its TTR, touching."""
    end = trio.current_time() + seconds
    while trio.current_time() < end:
        await trio.sleep(0.25)
        await atouch()
    await areport("done" if current_job().touches else "done-untouched", tag)


@app.task(tube="default", ttr=2, retries=0)
def long_sync(tag: str, seconds: float) -> None:
    """The same from a thread."""
    done = threading.Event()
    for _ in range(int(seconds / 0.25)):
        done.wait(0.25)
        touch()
    report("done", tag)


@app.task(tube="default", ttr=4, retries=0)
async def too_slow(tag: str) -> None:
    await areport("started", tag)
    # The worker freezes itself: a test that sent SIGSTOP after seeing "started"
    # raced the task's own time limit (TTR less a second) on a loaded machine.
    # A TTR of 4 leaves 3 s for the report (its client's first connect) too:
    # past the limit the task fails, and with retries=0 the job is buried.
    os.kill(os.getpid(), signal.SIGSTOP)
    await trio.sleep_forever()
