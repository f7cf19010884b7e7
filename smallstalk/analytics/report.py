"""What `smallstalk analyze` shows: a text table per tube, and a self-contained HTML page.

Pure Python over the small aggregates the pipeline returns (one row per tube,
one per server) and the per-window series of each tube; no Spark here. The
HTML page has no scripts and loads nothing: charts are inline SVG drawn
below (stacked backlog by state, wait-time percentiles, throughput in/out).
"""

from __future__ import annotations

import datetime as dt
import html
import math
from collections.abc import Sequence
from typing import Any

from smallstalk.core.model import NS

Row = dict[str, Any]


# --- formatting ---------------------------------------------------------------------


def duration(ms: float | None) -> str:
    """A human duration: 40µs, 0.4ms, 12ms, 1.52s, 3m05s, 2h10m, 3d04h."""
    if ms is None or (isinstance(ms, float) and math.isnan(ms)):
        return "-"
    if ms == 0:
        return "0ms"
    if ms < 0.1:
        return f"{ms * 1000:.0f}µs"
    if ms < 10:
        return f"{ms:.1f}ms"
    if ms < 1000:
        return f"{ms:.0f}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.2f}s" if s < 10 else f"{s:.1f}s"
    m, s = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{s:02d}s" if s else f"{m}m"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h{m:02d}m" if m else f"{h}h"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h" if h else f"{d}d"


def count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def when(ns: int | None) -> str:
    if ns is None:
        return "-"
    t = dt.datetime.fromtimestamp(ns / NS, dt.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Columns aligned; the first `left` columns left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


TUBE_HEADERS = ("tube", "jobs", "done", "open", "reserves", "res>1", "timeouts", "releases",
                "buries", "expired", "discarded", "wait p50", "p95", "p99", "run p50", "p95",
                "p99", "peak ready")


def tube_rows(tubes: Sequence[Row]) -> list[list[str]]:
    rows = []
    for t in tubes:
        rows.append([
            str(t["tube"]), count(t["jobs"]), count(t["deleted"]), count(t["open"]),
            count(t["reserves"]), count(t["reserved_more_than_once"]), count(t["timeouts"]),
            count(t["releases"]), count(t["buries"]), count(t.get("expired")),
            count(t.get("discarded")), duration(t.get("wait_p50_ms")), duration(t.get("wait_p95_ms")),
            duration(t.get("wait_p99_ms")),
            duration(t.get("run_p50_ms")), duration(t.get("run_p95_ms")),
            duration(t.get("run_p99_ms")), count(t.get("max_ready")),
        ])
    return rows


SERVER_HEADERS = ("server", "records", "segments", "seq", "from", "to", "snapshot jobs",
                  "restarts", "missing")


def server_rows(servers: Sequence[Row]) -> list[list[str]]:
    return [[str(s["server"]), count(s["records"]), count(s["segments"]),
             f"{s['first_seq']}..{s['last_seq']}" if s["first_seq"] is not None else "-",
             when(s["first_ns"]), when(s["last_ns"]), count(s["snapshot_jobs"]),
             count(s["restarts"]), count(s["missing"])] for s in servers]


def text_summary(result: Row) -> str:
    """The summary `smallstalk analyze` prints."""
    parts = ["Servers", table(SERVER_HEADERS, server_rows(result["servers"])), "",
             "Tubes (all servers; wait = ready to reserve, run = reserve to delete; "
             "res>1 = jobs reserved more than once)",
             table(TUBE_HEADERS, tube_rows(result["tubes"]))]
    if result.get("orphan_jobs"):
        parts.append(f"\n{result['orphan_jobs']:,} jobs have neither their put nor a snapshot "
                     "entry in the data (left out of the tube figures)")
    for s in result["servers"]:
        if s.get("missing"):
            parts.append(f"warning: {s['server']}: {s['missing']:,} sequence numbers missing "
                         "between the first and the last record (segments not in the data)")
    return "\n".join(parts)


# --- SVG charts ----------------------------------------------------------------------------

W, H = 760, 210
PAD_L, PAD_R, PAD_T, PAD_B = 64, 12, 14, 30
STATE_COLORS = {"ready": "#e4572e", "delayed": "#f3a712", "reserved": "#29335c",
                "buried": "#8d6a9f"}
LINE_COLORS = ("#2e86ab", "#f18f01", "#c73e1d")


def downsample(points: list[Row], limit: int = 1200) -> list[Row]:
    """At most `limit` points; each kept point takes the max of its group (peaks survive)."""
    if len(points) <= limit:
        return points
    step = math.ceil(len(points) / limit)
    out = []
    for i in range(0, len(points), step):
        group = points[i:i + step]
        merged = dict(group[0])
        for k in merged:
            if k != "window_ns":
                vals = [p[k] for p in group if p.get(k) is not None]
                merged[k] = max(vals) if vals else None
        out.append(merged)
    return out


def _nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    ticks = []
    x = start
    while x <= hi + step * 1e-9:
        ticks.append(x)
        x += step
    return ticks


def _time_ticks(t0: int, t1: int) -> list[tuple[int, str]]:
    span = max(t1 - t0, 1)
    choices = [60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 7 * 86400]
    step = next((c for c in choices if span / NS / c <= 8), 30 * 86400) * NS
    first = t0 - t0 % step + (step if t0 % step else 0)
    fmt = "%H:%M" if step < 86400 * NS else "%m-%d"
    out = []
    for t in range(first, t1 + 1, step):
        label = dt.datetime.fromtimestamp(t / NS, dt.UTC).strftime(fmt)
        if step < 86400 * NS and t % (86400 * NS) == 0:
            label = dt.datetime.fromtimestamp(t / NS, dt.UTC).strftime("%m-%d")
        out.append((t, label))
    return out


# Log-axis ticks for durations (ms) at round units: 10µs ... 1ms, 10ms, 100ms, 1s, 10s,
# 1m, 10m, 1h, 10h, 1d, 10d.
LOG_MS_TICKS = (0.01, 0.1, 1, 10, 100, 1000, 10_000, 60_000, 600_000, 3_600_000, 36_000_000,
                86_400_000, 864_000_000)


class Chart:
    """One SVG plot: time on x, a linear or log10 y axis."""

    def __init__(self, title: str, t0: int, t1: int, lo: float, hi: float, log: bool = False,
                 unit: str = ""):
        self.title, self.t0, self.t1, self.log, self.unit = title, t0, max(t1, t0 + 1), log, unit
        if log:
            lo = max(lo, 1e-3)
            self.lo, self.hi = math.log10(lo), math.log10(max(hi, lo * 10))
        else:
            self.lo, self.hi = lo, hi if hi > lo else lo + 1
        self.parts: list[str] = []

    def x(self, t: int) -> float:
        return PAD_L + (t - self.t0) / (self.t1 - self.t0) * (W - PAD_L - PAD_R)

    def y(self, v: float) -> float:
        if self.log:
            v = math.log10(max(v, 10 ** self.lo))
        return H - PAD_B - (v - self.lo) / (self.hi - self.lo) * (H - PAD_T - PAD_B)

    def axes(self) -> None:
        p = self.parts
        if self.log and self.unit == "ms":
            ticks = [v for v in LOG_MS_TICKS if self.lo <= math.log10(v) <= self.hi + 1e-9]
        elif self.log:
            ticks = [10.0 ** k for k in range(math.floor(self.lo), math.ceil(self.hi) + 1)
                     if self.lo <= k <= self.hi]
        else:
            ticks = _nice_ticks(self.lo, self.hi)
        for v in ticks:
            y = self.y(v)
            label = duration(v) if self.unit == "ms" else (f"{v:,.0f}" if v >= 1 or v == 0
                                                           else f"{v:g}")
            if self.log and v == ticks[0]:
                label = "≤" + label  # zeros and anything smaller sit on the bottom line
            p.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}" '
                     'class="grid"/>')
            p.append(f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" class="yl">{html.escape(label)}</text>')
        for t, label in _time_ticks(self.t0, self.t1):
            x = self.x(t)
            p.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T}" y2="{H - PAD_B}" class="grid"/>')
            p.append(f'<text x="{x:.1f}" y="{H - PAD_B + 16}" class="xl">{label}</text>')
        p.append(f'<rect x="{PAD_L}" y="{PAD_T}" width="{W - PAD_L - PAD_R}" '
                 f'height="{H - PAD_T - PAD_B}" class="frame"/>')

    def line(self, pts: list[tuple[int, float | None]], color: str, name: str) -> None:
        runs: list[list[str]] = [[]]
        for t, v in pts:
            if v is None:
                if runs[-1]:
                    runs.append([])
                continue
            runs[-1].append(f"{self.x(t):.1f},{self.y(v):.1f}")
        for run in runs:
            if len(run) == 1:
                x, y = run[0].split(",")
                self.parts.append(f'<circle cx="{x}" cy="{y}" r="2" fill="{color}">'
                                  f'<title>{html.escape(name)}</title></circle>')
            elif run:
                self.parts.append(f'<polyline points="{" ".join(run)}" fill="none" '
                                  f'stroke="{color}" stroke-width="1.6">'
                                  f'<title>{html.escape(name)}</title></polyline>')

    def stack(self, pts: list[Row], keys: Sequence[str], colors: dict[str, str]) -> None:
        base = [0.0] * len(pts)
        for k in keys:
            top = [b + (p.get(k) or 0) for b, p in zip(base, pts, strict=True)]
            upper = [f"{self.x(p['window_ns']):.1f},{self.y(v):.1f}" for p, v in zip(pts, top, strict=True)]
            lower = [f"{self.x(p['window_ns']):.1f},{self.y(v):.1f}"
                     for p, v in zip(reversed(pts), reversed(base), strict=True)]
            peak = max((p.get(k) or 0) for p in pts) if pts else 0
            self.parts.append(f'<polygon points="{" ".join(upper + lower)}" fill="{colors[k]}" '
                              f'fill-opacity="0.85"><title>{k} (peak {peak:,})</title></polygon>')
            base = top

    def svg(self, legend: Sequence[tuple[str, str]]) -> str:
        items = "".join(f'<span class="key"><i style="background:{c}"></i>{html.escape(n)}</span>'
                        for n, c in legend)
        body = "".join(self.parts)
        return (f'<figure><figcaption>{html.escape(self.title)} {items}</figcaption>'
                f'<svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img">{body}</svg>'
                '</figure>')


def _span(points: list[Row]) -> tuple[int, int]:
    return points[0]["window_ns"], points[-1]["window_ns"]


def backlog_chart(points: list[Row], width: str) -> str:
    t0, t1 = _span(points)
    hi = max(sum((p.get(s) or 0) for s in STATE_COLORS) for p in points)
    c = Chart(f"Backlog at the end of each {width} (jobs alive, by state)", t0, t1, 0, hi)
    c.axes()
    c.stack(points, list(STATE_COLORS), STATE_COLORS)
    return c.svg(list(STATE_COLORS.items()))


def wait_chart(points: list[Row], width: str, prefix: str = "wait",
               title: str = "Queue wait, ready to reserve") -> str:
    keys = [f"{prefix}_p50_ms", f"{prefix}_p95_ms", f"{prefix}_p99_ms"]
    vals = [p[k] for p in points for k in keys if p.get(k) is not None]
    t0, t1 = _span(points)
    if not vals:
        return f"<p class='none'>{html.escape(title)}: no reservations</p>"
    positive = [v for v in vals if v > 0]
    hi = max(vals)
    # Waits span microseconds to hours: a log axis from the smallest positive value
    # (at least 10µs; zeros sit on the bottom line) once the spread is wide.
    lo = max(min(positive), 0.01) if positive else 0.01
    log = hi / lo > 50
    c = Chart(f"{title}, per {width} (percentiles)", t0, t1,
              10 ** math.floor(math.log10(lo)) if log else 0, hi, log=log, unit="ms")
    c.axes()
    legend = []
    for k, color, name in zip(keys, LINE_COLORS, ("p50", "p95", "p99"), strict=True):
        c.line([(p["window_ns"], p.get(k)) for p in points], color, name)
        legend.append((name, color))
    return c.svg(legend)


WINDOW_NS = {"minute": 60 * NS, "hour": 3600 * NS}


def complete_windows(points: list[Row], width: str, end_ns: int | None) -> list[Row]:
    """The points without a last window that the data ends inside (a partial
    window's counts look like a collapse of throughput)."""
    size = WINDOW_NS.get(width)
    if not points or size is None or end_ns is None:
        return points
    if points[-1]["window_ns"] + size > end_ns + 1:
        return points[:-1]
    return points


def throughput_chart(points: list[Row], width: str, end_ns: int | None = None) -> str:
    full = complete_windows(points, width, end_ns)
    note = ""
    if len(full) < len(points):
        note = f"; the last {width}, which the data ends inside, is left out"
        points = full
    if not points:
        return f"<p class='none'>Throughput per {width}: no complete {width} yet</p>"
    t0, t1 = _span(points)
    hi = max(max(p["puts"], p["deletes"], p["reserves"]) for p in points)
    c = Chart(f"Throughput per {width}{note}", t0, t1, 0, hi)
    c.axes()
    legend = []
    for k, color in zip(("puts", "reserves", "deletes"), LINE_COLORS, strict=True):
        c.line([(p["window_ns"], p[k]) for p in points], color, k)
        legend.append((k, color))
    return c.svg(legend)


CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1340px;color:#1d1d1f;padding:0 16px}
.wide{overflow-x:auto;max-width:100%}.wide table{font-size:13px}
.wide th{white-space:normal;vertical-align:bottom}.wide th,.wide td{padding:3px 5px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:32px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#666;margin-bottom:16px}
table{border-collapse:collapse;font-variant-numeric:tabular-nums;margin:8px 0 16px}
th,td{padding:3px 8px;text-align:right;border-bottom:1px solid #eee;white-space:nowrap}
th:first-child,td:first-child{text-align:left}th{background:#f6f6f6;font-weight:600}
figure{margin:8px 0 14px}figcaption{font-weight:600;margin-bottom:2px}
.key{font-weight:400;margin-left:12px;color:#444}.key i{display:inline-block;width:10px;
height:10px;margin-right:4px;border-radius:2px}
svg .grid{stroke:#e6e6e6;stroke-width:1}svg .frame{fill:none;stroke:#bbb}
svg text{font:11px system-ui,sans-serif;fill:#555}svg .yl{text-anchor:end}
svg .xl{text-anchor:middle}.facts{display:flex;gap:28px;flex-wrap:wrap;margin:6px 0}
.facts div b{display:block;font-size:18px}.none{color:#888}
"""


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_report(result: Row, series: dict[str, list[Row]], width: str,
                title: str = "smallstalk job analytics", meta: str = "") -> str:
    """A self-contained HTML page: tables, and per tube backlog/wait/throughput charts."""
    tubes = result["tubes"]
    end_ns = max((s["last_ns"] for s in result["servers"] if s.get("last_ns")), default=None)
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1><div class='meta'>{html.escape(meta)}</div>",
             "<h2>Tubes</h2>",
             "<p>All servers together. <b>wait</b>: from the moment a job was ready (put, "
             "release, promote, kick, timeout, disconnect) to its reserve; <b>run</b>: reserve "
             "to delete; <b>res&gt;1</b>: jobs reserved more than once (duplicate work); "
             "<b>peak ready</b>: most jobs waiting at the end of any minute.</p>",
             "<div class='wide'>", _html_table(TUBE_HEADERS, tube_rows(tubes)), "</div>",
             "<h2>Servers</h2>", _html_table(SERVER_HEADERS, server_rows(result["servers"]))]
    if result.get("orphan_jobs"):
        parts.append(f"<p>{result['orphan_jobs']:,} jobs have neither their put nor a snapshot "
                     "entry in the data and are left out of the tube figures.</p>")
    for t in tubes:
        name = str(t["tube"])
        pts = downsample(series.get(name, []))
        parts.append(f"<h2>Tube {html.escape(name)}</h2><div class='facts'>")
        facts = [("jobs", count(t["jobs"])), ("done", count(t["deleted"])),
                 ("still open", count(t["open"])), ("timeouts", count(t["timeouts"])),
                 ("expired", count(t.get("expired"))), ("discarded", count(t.get("discarded"))),
                 ("timeout rate", pct(t.get("timeouts_rate"))),
                 ("release rate", pct(t.get("releases_rate"))),
                 ("bury rate", pct(t.get("buries_rate"))),
                 ("reserved >1", count(t["reserved_more_than_once"])),
                 ("wait p99", duration(t.get("wait_p99_ms"))),
                 ("run p99", duration(t.get("run_p99_ms"))),
                 ("peak ready", f"{count(t.get('max_ready'))} at {t.get('max_ready_at') or '-'}")]
        parts.extend(f"<div>{html.escape(k)}<b>{html.escape(v)}</b></div>" for k, v in facts)
        parts.append("</div>")
        if not pts:
            parts.append("<p class='none'>no events</p>")
            continue
        parts.append(backlog_chart(pts, width))
        parts.append(wait_chart(pts, width))
        parts.append(wait_chart(pts, width, "run", "Run time, reserve to delete"))
        parts.append(throughput_chart(pts, width, end_ns))
    parts.append("</body></html>")
    return "\n".join(parts)
