"""How the operator tools write: times, durations, sizes, escaped bodies, tables,
progress on a terminal, JSON lines, and where output goes (`Out`).

Output is for people first: aligned tables, human times and sizes, times in
local time (`--utc` for UTC). `--format jsonl` gives every field, one JSON
object per line, for other tools. On a terminal, long reads show progress on
stderr. How a tool runs (its parser, errors, exit codes) is ops/command.py's.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import attrs

from smallstalk.core.model import NS
from smallstalk.usage import UsageError

DUR_WIDTH = 7  # durations are at most this wide below 100 days: columns stay put
PREVIEW = 24  # body bytes shown in a preview


@attrs.define
class Clock:
    """How times are shown: local time with its offset, or UTC with `Z`."""

    utc: bool = False
    # The last second formatted (records come dense in time): (secs, text, zone).
    _last: tuple[int, str, str] = attrs.field(default=(-1, "", ""), eq=False, repr=False)

    def fmt(self, ns: int | None) -> str:
        if ns is None:
            return "-"
        secs, rest = divmod(ns, NS)
        last_secs, text, zone = self._last
        if secs != last_secs:
            if self.utc:
                dt = datetime.fromtimestamp(secs, UTC)
                zone = "Z"
            else:
                dt = datetime.fromtimestamp(secs).astimezone()
                off = dt.strftime("%z")
                zone = f"{off[:3]}:{off[3:]}"
            text = f"{dt:%Y-%m-%d %H:%M:%S}"
            self._last = (secs, text, zone)
        return f"{text}.{rest // 1_000_000:03d}{zone}"

    @property
    def width(self) -> int:
        return 24 if self.utc else 29

    @property
    def label(self) -> str:
        if self.utc:
            return "times in UTC"
        return f"times in local time (UTC{datetime.now().astimezone().strftime('%z')})"

    def parse(self, text: str) -> int:
        """An ISO date/time to ns since the epoch; without a zone it is local (UTC with --utc)."""
        try:
            dt = datetime.fromisoformat(text.strip())
        except ValueError:
            raise UsageError(f"not an ISO date/time: {text!r} (e.g. 2025-06-01T14:02:00)") from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC) if self.utc else dt.astimezone()
        delta = dt - datetime(1970, 1, 1, tzinfo=UTC)
        return (delta.days * 86400 + delta.seconds) * NS + delta.microseconds * 1000


def fmt_dur(ns: int | None) -> str:
    """A duration in at most 7 characters: 0s, <1ms, 850ms, 1.25s, 12.3s, 3m05s, 2h07m, 3d04h."""
    if ns is None:
        return "?"
    if ns < 0:
        return "-" + fmt_dur(-ns)
    if ns == 0:
        return "0s"
    if ns < 1_000_000:
        return "<1ms"
    if ns < NS:
        return f"{ns // 1_000_000}ms"
    if ns < 10 * NS:
        return f"{ns // 10_000_000 / 100:.2f}s"
    if ns < 60 * NS:
        return f"{ns // 100_000_000 / 10:.1f}s"
    s = ns // NS
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_size(n: float | None) -> str:
    """Bytes for people: `512 B`, `1.5 KiB`, ... `2.0 TiB`; None (not known) is `-`."""
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError  # not reached


def escape(data: bytes) -> str:
    """Bytes as printable ASCII: `\\"`, `\\\\`, `\\r`, `\\n`, `\\t`, else `\\xNN`."""
    if data.isascii():
        text = data.decode("ascii")
        if text.isprintable() and '"' not in text and "\\" not in text:
            return text  # the common case, fast
    out = []
    for b in data:
        if b == 0x22 or b == 0x5C:
            out.append("\\" + chr(b))
        elif 0x20 <= b < 0x7F:
            out.append(chr(b))
        elif b == 0x0A:
            out.append("\\n")
        elif b == 0x0D:
            out.append("\\r")
        elif b == 0x09:
            out.append("\\t")
        else:
            out.append(f"\\x{b:02x}")
    return "".join(out)


def preview(body: bytes) -> str:
    """`7 B "email-1"`: the length and the first bytes, escaped."""
    more = "..." if len(body) > PREVIEW else ""
    return f'{fmt_size(len(body))} "{escape(body[:PREVIEW])}{more}"'


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


def table(headers: list[str], rows: Iterable[list[str]], right: str = "",
          min_widths: dict[int, int] | None = None, indent: str = "") -> list[str]:
    """Rows aligned under headers; `right` has 'r' at the index of right-aligned columns."""
    rows = [list(map(str, row)) for row in rows]
    widths = [len(h) for h in headers]
    for i, w in (min_widths or {}).items():
        widths[i] = max(widths[i], w)
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    out = []
    for row in [headers, *rows]:
        cells = []
        for i, cell in enumerate(row):
            if i < len(right) and right[i] == "r":
                cells.append(cell.rjust(widths[i]))
            else:
                cells.append(cell.ljust(widths[i]))
        out.append((indent + "  ".join(cells)).rstrip())
    return out


class ProgressLine:
    """Progress on stderr, only when it is a terminal; at most five updates a second."""

    def __init__(self, label: str, stream: IO[str] | None = None, enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self.label = label
        self.started = time.monotonic()
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < 0.2:
            return
        self.last = now
        pct = f"{done * 100 // total}%" if total else "-"
        rate = done / max(now - self.started, 1e-9)
        self.stream.write(f"\r{self.label}: {fmt_size(done)} of {fmt_size(total)} ({pct}), "
                          f"{fmt_size(int(rate))}/s\x1b[K")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Out:
    """Where a command writes: stdout for results, stderr for notes and warnings."""

    def __init__(self, data_dir: Path, stdout: IO[str] | None = None, stderr: IO[str] | None = None):
        self.data_dir = data_dir
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr
        self.progress: ProgressLine | None = None

    def line(self, text: str = "") -> None:
        self.stdout.write(text + "\n")

    def rel(self, text: object) -> str:
        """Paths inside the data directory, shown relative to it."""
        return str(text).replace(f"{self.data_dir}{os.sep}", "")

    def note(self, text: str) -> None:
        self._err(f"note: {self.rel(text)}")

    def warn(self, text: str) -> None:
        self._err(f"warning: {self.rel(text)}")

    def _err(self, text: str) -> None:
        if self.progress is not None:
            self.progress.clear()
        self.stderr.write(text + "\n")
        self.stderr.flush()

    def start_progress(self, label: str) -> ProgressLine:
        self.progress = ProgressLine(label, self.stderr)
        return self.progress

    def end_progress(self) -> None:
        if self.progress is not None:
            self.progress.clear()
            self.progress = None


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON: {value!r}")


_ENCODER = json.JSONEncoder(default=_json_default, separators=(",", ":"))


def jsonl(obj: dict) -> str:
    return _ENCODER.encode(obj)


def expiry(expires: int, now: int) -> str:
    """An expiry time (ns, 0 = never) as the time it leaves from `now`: `+1h00m`, `never`."""
    return "never" if not expires else "+" + fmt_dur(expires - now)
