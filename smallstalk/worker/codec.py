"""The task payload: a published call as one CBOR job body, and back (docs/CLIENT.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import cbor2

PAYLOAD_VERSION = 1


class BadPayload(ValueError):
    """A job body that is not a task call."""


class UnknownTask(LookupError):
    """A job names a task this worker's app does not have."""


class TimeLimitExceeded(Exception):
    """An async task ran into its time limit (its TTR less a second)."""


def encode_call(name: str, args: Sequence[Any], kwargs: Mapping[str, Any],
                ttr: int | None = None) -> bytes:
    """`ttr`: the job's TTR where it is not the task's own (`options(ttr=...)`),
    so that the worker's time limit follows the job's; absent otherwise."""
    call = {"v": PAYLOAD_VERSION, "task": name, "args": list(args), "kwargs": dict(kwargs)}
    if ttr is not None:
        call["ttr"] = ttr
    return cbor2.dumps(call)


def decode_call(body: bytes) -> tuple[str, list[Any], dict[str, Any]]:
    name, args, kwargs, _ttr = decode_job(body)
    return name, args, kwargs


def decode_job(body: bytes) -> tuple[str, list[Any], dict[str, Any], int | None]:
    """`decode_call`, and the job's own TTR if the publish gave one (None: the task's)."""
    try:
        data = cbor2.loads(body)
    except Exception as e:
        raise BadPayload(f"job body is not CBOR: {e}") from None
    if (not isinstance(data, dict) or data.get("v") != PAYLOAD_VERSION
            or not isinstance(data.get("task"), str) or not isinstance(data.get("args"), list)
            or not isinstance(data.get("kwargs"), dict)):
        raise BadPayload("job body is not a smallstalk task call")
    ttr = data.get("ttr")
    if ttr is not None and (type(ttr) is not int or ttr < 1):
        raise BadPayload(f"job body's ttr is not a number of seconds: {ttr!r}")
    return data["task"], data["args"], data["kwargs"], ttr

