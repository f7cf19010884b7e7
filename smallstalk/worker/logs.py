"""The worker's structured logs: JSON lines (or text for people), an event and its fields."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

log = logging.getLogger("smallstalk.worker")


def log_event(level: int, event: str, **fields: Any) -> None:
    log.log(level, event, extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                               "logger": record.name, "event": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        parts = [time.strftime("%H:%M:%S", time.localtime(record.created)),
                 record.levelname.lower(), record.getMessage()]
        parts += [f"{k}={v!r}" if isinstance(v, str) and " " in v else f"{k}={v}"
                  for k, v in fields.items() if k != "traceback"]
        text = " ".join(parts)
        if fields.get("traceback"):
            text += "\n" + str(fields["traceback"]).rstrip()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(fmt: str = "json", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("smallstalk")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False

