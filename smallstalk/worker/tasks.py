"""Tasks and the App that holds them: a function that can also be published as a
job, and the servers (and TLS and token) its jobs go through."""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import os
import ssl
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import cbor2
import trio

from smallstalk.client import DEFAULT_PRIORITY, DEFAULT_TTR, AsyncClient, Client, JobRef
from smallstalk.client.addresses import Servers, resolve_servers
from smallstalk.client.security import security

from .codec import encode_call

DEFAULT_ERROR_TUBE = "{tube}.errors"


def _default_name(fn: Callable[..., Any]) -> str:
    module = fn.__module__
    if module == "__main__":
        # `python tasks.py` and `smallstalk worker tasks:app` should agree.
        main_mod = sys.modules.get("__main__")
        spec = getattr(main_mod, "__spec__", None)
        if spec is not None and spec.name:
            module = spec.name
        elif getattr(main_mod, "__file__", None):
            module = Path(main_mod.__file__).stem  # type: ignore[union-attr, arg-type]
    return f"{module}.{fn.__qualname__}"


class Task:
    """A function that can also be published as a job (`publish`) and run by a worker.

    Calling the task calls the function.
    """

    def __init__(self, app: App, fn: Callable[..., Any], *, name: str, tube: str,
                 priority: int, delay: int, ttr: int, retries: int, backoff: float,
                 max_backoff: float, unique: bool | Callable[..., str] = False) -> None:
        if ttr < 1 or retries < 0 or backoff < 0 or delay < 0 or max_backoff < 0:
            raise ValueError("ttr must be at least 1; retries, delay and backoff not negative")
        self.app = app
        self.fn = fn
        self.name = name
        self.tube = tube
        self.priority = priority
        self.delay = delay
        self.ttr = ttr
        self.declared_ttr = ttr  # the task's own; `options(ttr=...)` changes `ttr` only
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        # ndkale-style unique tasks: every publish carries an idempotency key,
        # derived from the arguments (True) or made by `unique(*args, **kwargs)`.
        self.unique = unique
        self.key: str | None = None  # one publish's own key (`options(key=...)`)
        self.is_async = inspect.iscoroutinefunction(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Task {self.name} tube={self.tube}>"

    def options(self, *, priority: int | None = None, delay: int | None = None,
                ttr: int | None = None, tube: str | None = None,
                key: str | None = None) -> Task:
        """This task with other defaults, for one publish: `t.options(delay=60).publish(x)`;
        `key` makes that publish exactly-once (`put-unique`, docs/CLIENT.md)."""
        other = copy.copy(self)
        for name, value in (("priority", priority), ("delay", delay), ("ttr", ttr),
                            ("tube", tube), ("key", key)):
            if value is not None:
                setattr(other, name, value)
        return other

    def key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """The idempotency key of a publish with these arguments (None: a plain put).

        `unique=True` derives it from the task's name and its arguments (a
        digest of their canonical CBOR), so publishing the same call twice
        makes one job while it exists (and for the tube's `unique-for` after).
        """
        if self.key is not None:
            return self.key
        if callable(self.unique):
            return self.unique(*args, **kwargs)
        if self.unique:
            call = cbor2.dumps([self.name, list(args), dict(kwargs)], canonical=True)
            return "task." + hashlib.blake2b(call, digest_size=16).hexdigest()
        return None

    def encode(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
        return encode_call(self.name, args, kwargs,
                           None if self.ttr == self.declared_ttr else self.ttr)

    def publish(self, *args: Any, **kwargs: Any) -> JobRef:
        """Put a job that runs this task with these arguments (CBOR-serializable);
        a unique task (or `options(key=...)`) puts it exactly once."""
        return self.app.client().put(self.encode(args, kwargs), self.priority, self.delay,
                                     self.ttr, tube=self.tube, key=self.key_for(args, kwargs))

    async def apublish(self, *args: Any, **kwargs: Any) -> JobRef:
        """`publish` for trio code."""
        client = self.app.async_client()
        return await client.put(self.encode(args, kwargs), self.priority, self.delay,
                                self.ttr, tube=self.tube, key=self.key_for(args, kwargs))


class App:
    """The tasks of an application and the servers they go through.

    `servers`: as for `Client` (None: $SMALLSTALK_SERVERS or 127.0.0.1:11300).
    `error_tube`: where a worker records why it buried a job ("{tube}" is the
    job's tube); None records in the log only. `tls`, `ssl_context`, `token`
    and `token_file`: as for `Client`, for the app's clients and its workers.
    """

    def __init__(self, servers: Servers = None, *,
                 error_tube: str | None = DEFAULT_ERROR_TUBE, connect_timeout: float = 5.0,
                 read_timeout: float = 10.0, tls: bool = False,
                 ssl_context: ssl.SSLContext | None = None, token: str | None = None,
                 token_file: str | os.PathLike[str] | None = None) -> None:
        self.servers = resolve_servers(servers)
        self.security = security(tls=tls, ssl_context=ssl_context, token=token,
                                 token_file=token_file)
        self.error_tube = error_tube
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.tasks: dict[str, Task] = {}
        self._client: Client | None = None
        self._client_lock = threading.Lock()
        self._async_client: trio.lowlevel.RunVar[AsyncClient | None] = trio.lowlevel.RunVar(
            f"smallstalk.worker.App.{id(self)}", default=None)

    def task(self, fn: Callable[..., Any] | None = None, *, name: str | None = None,
             tube: str = "default", priority: int = DEFAULT_PRIORITY, delay: int = 0,
             ttr: int = DEFAULT_TTR, retries: int = 3, backoff: float = 1.0,
             max_backoff: float = 3600.0, unique: bool | Callable[..., str] = False) -> Any:
        """Register a function as a task: `@app.task` or `@app.task(tube=..., ...)`.

        `ttr` is the time limit in seconds (and the job's TTR); `retries` how
        many times a failure is retried (so retries + 1 runs at most);
        `backoff` the delay before the first retry, doubled each time;
        `unique` publishes it exactly once per key: True derives the key from
        the arguments, a function `(*args, **kwargs) -> str` makes it.
        """

        def register(f: Callable[..., Any]) -> Task:
            t = Task(self, f, name=name or _default_name(f), tube=tube, priority=priority,
                     delay=delay, ttr=ttr, retries=retries, backoff=backoff,
                     max_backoff=max_backoff, unique=unique)
            if t.name in self.tasks:
                raise ValueError(f"a task named {t.name!r} is already registered")
            self.tasks[t.name] = t
            return t

        return register(fn) if fn is not None else register

    def tubes(self) -> list[str]:
        """The tubes of the registered tasks, in registration order."""
        return list(dict.fromkeys(t.tube for t in self.tasks.values()))

    def client(self) -> Client:
        """The app's shared synchronous client (made on first use)."""
        with self._client_lock:
            if self._client is None:
                self._client = Client(self.servers, connect_timeout=self.connect_timeout,
                                      read_timeout=self.read_timeout,
                                      ssl_context=self.security.ssl_context,
                                      token=self.security.token)
            return self._client

    def async_client(self) -> AsyncClient:
        """The app's trio client for the current trio run (made on first use)."""
        client = self._async_client.get()
        if client is None:
            client = AsyncClient(self.servers, connect_timeout=self.connect_timeout,
                                 read_timeout=self.read_timeout,
                                 ssl_context=self.security.ssl_context,
                                 token=self.security.token)
            self._async_client.set(client)
        return client

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def error_tube_for(self, tube: str) -> str | None:
        return None if self.error_tube is None else self.error_tube.format(tube=tube)

