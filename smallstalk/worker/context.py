"""The job a task runs for: `current_job()`, and `touch()`/`atouch()` for another TTR."""

from __future__ import annotations

import contextvars

import attrs
import trio

from smallstalk.client import AsyncClient, Job

from .tasks import Task


def time_limit(ttr: int) -> float:
    """How long an async task may run between touches: its TTR less a second
    (half the TTR when that is shorter), so the worker gives up before the server does."""
    return ttr - min(1.0, ttr / 2)


running_job: contextvars.ContextVar[JobContext] = contextvars.ContextVar("smallstalk_job")


@attrs.define(eq=False)
class JobContext:
    """The job a task is running for (`current_job()` inside a task)."""

    job: Job
    task: Task
    tube: str | None
    client: AsyncClient = attrs.field(repr=False)
    ttr: int  # the job's TTR (its publish's, else the task's): the time limit's base
    scope: trio.CancelScope | None = attrs.field(default=None, repr=False)
    touches: int = 0

    async def atouch(self) -> None:
        await self.client.touch(self.job)
        self.touches += 1
        if self.scope is not None:
            self.scope.deadline = trio.current_time() + time_limit(self.ttr)


def current_job() -> JobContext:
    try:
        return running_job.get()
    except LookupError:
        raise RuntimeError("not in a task run by a smallstalk worker") from None


def touch() -> None:
    """From a sync task: ask for another TTR. Outside a worker this does nothing."""
    ctx = running_job.get(None)
    if ctx is None:
        return
    if trio.lowlevel.in_trio_task():
        raise RuntimeError("in an async task, use `await atouch()`")
    trio.from_thread.run(ctx.atouch)


async def atouch() -> None:
    """From an async task: ask for another TTR. Outside a worker this does nothing."""
    ctx = running_job.get(None)
    if ctx is not None:
        await ctx.atouch()

