"""The console's HA routes: health checks for load balancers, and the cluster page.

- `GET /primary`: 200 only on the member that holds the leader lock and takes
  writes (without --ha-etcd: a primary that takes writes), 503 elsewhere;
- `GET /replica`: 200 on a replica following its primary, connected;
  `?lag=N` also needs it to be at most N records behind;
- `GET /health`: 200 while the server serves: its mutation loop takes a turn
  within HEALTH_SECONDS (a container's healthcheck asks this too), else 503.
HEAD and OPTIONS answer the same codes (HAProxy's `option httpchk` sends
OPTIONS by default). The body is a small JSON document of the member's
position, as Patroni's REST API answers. `/cluster` shows the members, who
leads, their lag and the last failovers, as the store has them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from smallstalk.console.app import Console
    from smallstalk.server.loop import MutationLoop

CHECK_METHODS = ["GET", "HEAD", "OPTIONS"]
HEALTH_SECONDS = 3.0  # a loop that takes no turn for this long is not serving


def takes_writes(lp: MutationLoop) -> bool:
    """Primary, not fenced, within its lease, and (under HA) holding the lock."""
    if lp.role != "primary" or lp.read_only or trio.current_time() >= lp.lease_until:
        return False
    return lp.ha is None or lp.ha.holds_lock()


def position(lp: MutationLoop) -> dict[str, Any]:
    epoch, history = lp.state.epoch
    f = lp.follower
    out: dict[str, Any] = {
        "role": ("primary" if takes_writes(lp) else
                 "fenced" if lp.role == "primary" else "replica"),
        "epoch": epoch, "history": history, "last_seq": lp.state.last_seq,
    }
    if f is not None:
        out["connected"] = bool(f.connected)
        out["lag"] = max(f.primary_seq - lp.state.last_seq, 0)
    if lp.ha is not None:
        out["name"] = lp.ha.cfg.name
        out["cluster"] = lp.ha.cfg.cluster
    return out


def _nothing() -> None:
    """A loop turn that does nothing: /health's proof that the loop runs."""


def _answer(request: Request, ok: bool, lp: MutationLoop) -> Response:
    code = 200 if ok else 503
    if request.method != "GET":
        return Response(status_code=code)
    return JSONResponse(position(lp), status_code=code)


def routes(c: Console) -> list[Route]:
    lp = c.lp

    async def primary(request: Request) -> Response:
        return _answer(request, takes_writes(lp), lp)

    async def replica(request: Request) -> Response:
        f = lp.follower
        ok = lp.role == "replica" and f is not None and bool(f.connected)
        bound = request.query_params.get("lag")
        if ok and bound is not None:
            if not bound.isdigit():
                return Response("lag takes a number of records\n", status_code=400)
            ok = f.primary_seq - lp.state.last_seq <= int(bound)
        return _answer(request, ok, lp)

    async def health(request: Request) -> Response:
        with trio.move_on_after(HEALTH_SECONDS):
            await lp.call(_nothing)
            return _answer(request, True, lp)
        if request.method != "GET":
            return Response(status_code=503)
        return PlainTextResponse("the server's loop did not answer\n", status_code=503)

    async def cluster(request: Request) -> Response:
        ha = lp.ha
        view = ha.cluster if ha is not None else None
        now = time.time()
        failovers = [dict(f, ago=now - f.get("time", now)) for f in
                     (view.failovers if view is not None else ())][-10:][::-1]
        return c.page(request, "cluster.html", ha=ha, view=view, failovers=failovers,
                      me=position(lp), store_error=ha.store_error if ha else None)

    return [Route("/primary", primary, methods=CHECK_METHODS),
            Route("/replica", replica, methods=CHECK_METHODS),
            Route("/health", health, methods=CHECK_METHODS),
            Route("/cluster", cluster)]
