"""The console's HTTP side: the Starlette app, its routes, and serving it on trio.

`serve(lp, cfg)` is one more task in the broker's nursery (cli.py starts it
for `--http`): hypercorn's trio worker runs the ASGI app in the broker's own
trio loop. Pages read the live state only through views.py (inside loop
turns, paged); the replay tools run as child processes (replay_procs.py).
Writes are protocol commands on an in-process session of their own
(server/local.py), like a client's, and pass the checks in `Guard` first
(docs/CONSOLE.md, Security).
"""

from __future__ import annotations

import logging
import math
import ssl
import time
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from smallstalk import __version__ as VERSION
from smallstalk.client.errors import CommandError
from smallstalk.client.replies import ReplyReader, interpret
from smallstalk.config import ServeConfig
from smallstalk.console import ha, replay_procs, views
from smallstalk.console.guard import Guard
from smallstalk.console.metrics import Exporter
from smallstalk.core import protocol as p
from smallstalk.core.model import STATE_BY_NAME, STATE_NAMES
from smallstalk.core.protocol import valid_tube_name
from smallstalk.core.search import ACTION_STATES
from smallstalk.ops.text import fmt_size
from smallstalk.server.local import LocalSession
from smallstalk.server.loop import MutationLoop

log = logging.getLogger("smallstalk.console")

HERE = Path(__file__).parent
SAMPLE_SECONDS = 5.0
SAMPLES = int(3600 / SAMPLE_SECONDS)  # an hour of rates, in memory
TUBES_PER_PAGE = 100
JOBS_PER_PAGE = 50
BODY_SHOWN = 64 * 1024
# How long a search or a bulk action may take (it runs in slices between
# everyone else's commands: a million jobs take seconds, docs/PERFORMANCE.md).
SEARCH_WAIT = 300.0
TUBE_SORTS = ("name", "current-jobs-ready", "current-jobs-reserved", "current-jobs-delayed",
              "current-jobs-buried", "current-waiting", "next-ready-age", "puts-per-second",
              "total-jobs")


class Console:
    """Everything the routes share: the loop, the configuration, samples, the guard."""

    def __init__(self, lp: MutationLoop, cfg: ServeConfig):
        self.lp = lp
        self.cfg = cfg
        self.data_dir = cfg.data_dir
        self.started = time.time()
        self.samples: deque[dict[str, Any]] = deque(maxlen=SAMPLES + 1)
        self.exporter = Exporter()
        self.guard = Guard(cfg)
        self.tools = trio.CapacityLimiter(replay_procs.CONCURRENT)
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=jinja2.select_autoescape(("html",)), undefined=jinja2.StrictUndefined)
        self.env.filters["size"] = fmt_size
        self.env.filters["ago"] = fmt_seconds

    async def sample_rates(self) -> None:
        """A sample of the command counters every SAMPLE_SECONDS, an hour kept."""
        while True:
            self.samples.append(await self.lp.call(views.counters, self.lp))
            await trio.sleep(SAMPLE_SECONDS)

    def rates(self) -> list[dict[str, float]]:
        """Per interval between samples: put, reserve and delete per second."""
        out = []
        s = list(self.samples)
        for a, b in zip(s, s[1:], strict=False):
            dt = max(b["t"] - a["t"], 1e-9)
            out.append({"t": b["t"], **{k: (b[k] - a[k]) / dt
                                        for k in ("put", "reserve", "delete")}})
        return out

    def tube_put_rates(self) -> dict[str, float]:
        if len(self.samples) < 2:
            return {}
        a, b = self.samples[-2], self.samples[-1]
        dt = max(b["t"] - a["t"], 1e-9)
        return {name: (n - a["tubes"].get(name, n)) / dt for name, n in b["tubes"].items()}

    def latest_report(self) -> Path | None:
        """The newest HTML report in DATA_DIR/reports/ (`smallstalk analyze --report`)."""
        if self.data_dir is None:
            return None
        try:
            reports = sorted(Path(self.data_dir, "reports").glob("*.html"),
                             key=lambda f: f.stat().st_mtime)
        except OSError:
            return None
        return reports[-1] if reports else None

    def page(self, request: Request, template: str, **ctx: Any) -> HTMLResponse:
        token = self.guard.csrf_token(request)
        html = self.env.get_template(template).render(
            request=request, csrf=token, version=VERSION, report=self.latest_report(),
            msg=request.query_params.get("msg", ""), admin=self.guard.describe(request),
            quote=quote, **ctx)
        resp = HTMLResponse(html)
        self.guard.set_csrf_cookie(request, resp, token)
        return resp

    # --- writes: protocol commands on a session of their own ----------------------

    async def command(self, commands: list[p.Command], wait: float = 30) -> list[str]:
        """Run protocol commands as a client would, on an in-process session of
        their own; each reply's line."""
        return [b" ".join((reply.word, *reply.args)).decode("ascii", "replace")
                for reply in await self._ask(commands, wait)]

    async def _ask(self, commands: list[p.Command], wait: float) -> list:
        session = LocalSession(self.lp)
        try:
            with trio.fail_after(wait):
                data = await session.ask(commands)
        finally:
            session.close()
        reader = ReplyReader()
        reader.feed(data)
        replies = []
        while (reply := reader.next_reply()) is not None:
            replies.append(reply)
        return replies

    async def search(self, tube: str, state: str, how: str, pattern: bytes,
                     after: int) -> dict[str, Any]:
        """A page of `search-jobs` and how many match in all (`bulk-jobs ... count`),
        or the error that answered them."""
        cmds = [p.SearchJobs(tube, state, how, after, JOBS_PER_PAGE, pattern),
                p.BulkJobs(tube, state, how, "count", "", p.U32_MAX, pattern)]
        try:
            ids, count = (interpret(cmd, reply) for cmd, reply in
                          zip(cmds, await self._ask(cmds, SEARCH_WAIT), strict=True))
        except CommandError as e:
            return {"error": e.reply_line(), "ids": [], "count": 0}
        return {"error": "", "ids": ids, "count": count}


def fmt_seconds(s: float | int | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 172800:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _int(text: str | None, default: int = 0) -> int:
    try:
        return max(int(text or default), 0)
    except ValueError:
        return default


def _redirect(path: str, msg: str) -> RedirectResponse:
    sep = "&" if "?" in path else "?"
    return RedirectResponse(f"{path}{sep}{urlencode({'msg': msg})}", status_code=303)


def routes(c: Console) -> list:
    lp = c.lp

    async def overview(request: Request) -> Response:
        stats = await lp.call(views.server, lp)
        disk = views.disk_use(c.data_dir)
        rates = c.rates()
        return c.page(request, "overview.html", stats=stats, disk=disk, rss=views.rss_bytes(),
                      chart=rate_chart(rates), rates=rates[-1] if rates else None,
                      fsync=c.cfg.fsync if c.data_dir else "none (in memory)",
                      uptime=time.time() - c.started, http=c.cfg.http)

    async def tubes(request: Request) -> Response:
        q = request.query_params
        needle = q.get("q", "")
        sort = q.get("sort", "name")
        sort = sort if sort in TUBE_SORTS else "name"
        desc = q.get("desc", "0") == "1"
        names = await lp.call(views.tube_names, lp)
        names = [n for n in names if needle in n]
        rows: list[dict[str, Any]] = []
        for i in range(0, len(names), views.TUBE_CHUNK):
            rows += await lp.call(views.tube_rows, lp, names[i:i + views.TUBE_CHUNK])
        put_rates = c.tube_put_rates()
        for row in rows:
            row["puts-per-second"] = put_rates.get(row["name"], 0.0)

        def key(row: dict[str, Any]) -> tuple:
            v = row.get(sort)
            return (v is None, v if v is not None else 0, row["name"])

        rows.sort(key=key, reverse=desc)
        page = _int(q.get("page"))
        shown = rows[page * TUBES_PER_PAGE:(page + 1) * TUBES_PER_PAGE]
        return c.page(request, "tubes.html", rows=shown, total=len(rows), page=page,
                      pages=max(math.ceil(len(rows) / TUBES_PER_PAGE), 1), q=needle,
                      sort=sort, desc=desc, sorts=TUBE_SORTS)

    async def tube(request: Request) -> Response:
        name = request.path_params["name"]
        q = request.query_params
        state = q.get("state", "ready")
        state = state if state in STATE_BY_NAME else "ready"
        after = _int(q.get("after"))
        rows = await lp.call(views.tube_rows, lp, [name])
        if not rows:
            return c.page(request, "missing.html", what=f"tube {name}",
                          why="it does not exist (a tube exists while it holds jobs or a "
                              "client uses or watches it)")
        how = q.get("how", "")
        found = None
        if how in p.HOWS:  # the search form: its matches instead of the listing
            pattern = q.get("q", "").encode("utf-8")[:p.PATTERN_MAX + 1]
            found = await c.search(name, state, how, pattern, after)
            jobs = await lp.call(views.job_rows, lp, found["ids"])
            more = len(found["ids"]) == JOBS_PER_PAGE
        else:
            jobs = await lp.call(views.tube_jobs, lp, name, state, after, JOBS_PER_PAGE)
            more = len(jobs) == JOBS_PER_PAGE
        return c.page(request, "tube.html", t=rows[0], name=name, state=state, jobs=jobs,
                      after=after, states=list(STATE_NAMES), how=how, q=q.get("q", ""),
                      found=found, hows=p.HOWS, actions=BULK_STATES,
                      next_after=(found["ids"][-1] if found else jobs[-1]["id"])
                      if more else None)

    async def job(request: Request) -> Response:
        jid = _int(request.path_params["id"])
        shown = request.query_params.get("view", "text")
        info = await lp.call(views.job, lp, jid, BODY_SHOWN)
        history = await replay_procs.job_history(c.tools, c.data_dir, jid) if c.data_dir else None
        body = info["body"] if info else b""
        return c.page(request, "job.html", jid=jid, info=info, view=shown,
                      text=body.decode("utf-8", "replace"), hex=replay_procs.hexdump(body),
                      task=replay_procs.decode_task(body), history=history)

    async def travel(request: Request) -> Response:
        q = request.query_params
        if c.data_dir is None:
            return c.page(request, "missing.html", what="time travel",
                          why="the server keeps no history without a data directory")
        seq = q.get("seq", "").strip()
        at = q.get("at", "").strip()
        filters = {k: q.get(k, "").strip() for k in ("op", "tube", "job", "conn")}
        result = None
        bad = replay_procs.check_travel(seq, filters)
        if bad:
            result = {"error": bad, "state": None}
        elif seq or at:
            result = await replay_procs.travel(c.tools, c.data_dir, seq, at, filters)
        return c.page(request, "travel.html", seq=seq, at=at, filters=filters, result=result,
                      ops=replay_procs.OPS)

    async def replication(request: Request) -> Response:
        stats = await lp.call(views.server, lp)
        return c.page(request, "replication.html", stats=stats)

    async def metrics(request: Request) -> Response:
        body = await c.exporter.render(lp, c.data_dir)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def report(request: Request) -> Response:
        path = c.latest_report()
        if path is None:
            return c.page(request, "missing.html", what="report",
                          why="no HTML report in DATA_DIR/reports/ yet (smallstalk analyze "
                              "... --report DATA_DIR/reports/NAME.html)")
        return FileResponse(path, media_type="text/html")

    # --- writes -------------------------------------------------------------------

    async def action(request: Request) -> Response:
        form = await request.form()
        back = request.headers.get("referer", "/")
        refused = c.guard.refuse_write(request, form)
        if refused:
            return HTMLResponse(c.env.get_template("refused.html").render(
                why=refused, version=VERSION, report=None, msg="",
                admin=c.guard.describe(request), request=request, csrf="", quote=quote),
                status_code=403)
        what = request.path_params["what"]
        target = request.path_params["target"]
        commands, path = _action_commands(what, target, form)
        if commands is None:
            return HTMLResponse("unknown action", status_code=404)
        answer = " / ".join(await c.command(commands, SEARCH_WAIT if what == "bulk" else 30))
        log.info("console %s %s from %s: %s", what, target,
                 request.client.host if request.client else "?", answer)
        return _redirect(path or back.split("?")[0], f"{what} {target}: {answer}")

    async def login(request: Request) -> Response:
        if request.method == "POST":
            form = await request.form()
            resp = _redirect("/", "logged in")
            if not c.guard.login(request, form, resp):
                return HTMLResponse("wrong token or CSRF token", status_code=403)
            return resp
        return c.page(request, "login.html")

    return [
        Route("/", overview), Route("/tubes", tubes), Route("/tube/{name:path}", tube),
        Route("/job/{id:int}", job), Route("/travel", travel),
        Route("/replication", replication), Route("/metrics", metrics),
        Route("/report", report), Route("/login", login, methods=["GET", "POST"]),
        Route("/do/{what:str}/{target:path}", action, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        *ha.routes(c),  # /primary, /replica, /health for load balancers; /cluster
    ]


def _action_commands(what: str, target: str, form) -> tuple[list[p.Command] | None, str | None]:
    """The protocol commands a console action sends, and the page to go back to."""
    if what in ("kick", "pause", "flush"):
        if not valid_tube_name(target.encode()):
            return None, None
        page = f"/tube/{quote(target)}"
        if what == "kick":
            return [p.Use(target), p.Kick(min(_int(form.get("count"), 1), p.U32_MAX))], page
        if what == "pause":
            return [p.PauseTube(target, min(_int(form.get("seconds"), 60), p.U32_MAX))], page
        return [p.FlushTube(target)], page
    if what == "bulk":
        return _bulk_command(target, form)
    if what in ("kick-job", "delete-job") and target.isdigit() and int(target) <= p.U64_MAX:
        jid = int(target)
        return [p.KickJob(jid) if what == "kick-job" else p.Delete(jid)], f"/job/{target}"
    return None, None


# The bulk actions of the search form, and the states each takes (the server's table).
BULK_STATES = {action: takes for action, takes in ACTION_STATES.items() if action != "count"}


def _bulk_command(tube: str, form) -> tuple[list[p.Command] | None, str | None]:
    """The search form's bulk action: `bulk-jobs` on at most `max` jobs, the
    count the page showed (count, then confirm)."""
    state, how, action = form.get("state"), form.get("how"), form.get("action")
    to = form.get("to", "") if action == "move" else ""
    if (not valid_tube_name(tube.encode()) or state not in STATE_NAMES or how not in p.HOWS
            or action not in BULK_STATES or (action == "move" and not valid_tube_name(
                str(to).encode()))):
        return None, None
    pattern = str(form.get("q", "")).encode("utf-8")
    bound = min(_int(form.get("max")), p.U32_MAX)
    back = f"/tube/{quote(tube)}?{urlencode({'state': state, 'how': how, 'q': form.get('q', '')})}"
    return [p.BulkJobs(tube, state, how, action, str(to), bound, pattern)], back


def rate_chart(rates: list[dict[str, float]], width: int = 720, height: int = 160) -> dict:
    """SVG polylines of put/reserve/delete per second over the sampled hour."""
    if len(rates) < 2:
        return {"lines": {}, "max": 0, "width": width, "height": height, "span": 0}
    top = max(max(r[k] for k in ("put", "reserve", "delete")) for r in rates) or 1.0
    t0, t1 = rates[0]["t"], rates[-1]["t"]
    span = max(t1 - t0, 1e-9)
    lines = {}
    for k in ("put", "reserve", "delete"):
        lines[k] = " ".join(f"{(r['t'] - t0) / span * width:.1f},"
                            f"{height - r[k] / top * (height - 10):.1f}" for r in rates)
    return {"lines": lines, "max": top, "width": width, "height": height, "span": span}


def build(lp: MutationLoop, cfg: ServeConfig) -> tuple[Starlette, Console]:
    c = Console(lp, cfg)
    return Starlette(routes=routes(c)), c


async def serve(lp: MutationLoop, cfg: ServeConfig, *,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The console: hypercorn on `cfg.http`, and the rate sampler."""
    app, c = build(lp, cfg)
    hc = HypercornConfig()
    host, port = cfg.http
    hc.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("smallstalk.console.http")
    hc.graceful_timeout = 1.0
    scheme = "http"
    if cfg.tls_cert is not None:  # the client port's certificate, and its mutual TLS
        hc.certfile, hc.keyfile, scheme = str(cfg.tls_cert), str(cfg.tls_key), "https"
        if cfg.tls_client_ca is not None:
            hc.ca_certs, hc.verify_mode = str(cfg.tls_client_ca), ssl.CERT_REQUIRED
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.sample_rates)
        await nursery.start(_serve_app, app, hc)
        log.info("console on %s://%s/ (metrics at /metrics)", scheme, hc.bind[0])
        task_status.started()


async def _serve_app(app, hc, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    await hypercorn_serve(app, hc, task_status=task_status)
