"""The console's write guard, in-process: the real loop and the real HTTP server on
loopback (hypercorn on trio), spoken to with the standard library's HTTP client."""

from __future__ import annotations

import http.client
import re
import urllib.parse

import pytest
import trio

from smallstalk.config import ServeConfig

from ..support.harness import Client, make_loop

pytest.importorskip("hypercorn")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, method: str, path: str, form: dict | None = None,
            cookies: dict | None = None) -> tuple[int, str, dict]:
    """(status, body, cookies set) of one request (run in a thread)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {}
    body = None
    if form is not None:
        body = urllib.parse.urlencode(form)
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    if cookies:
        headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    text = resp.read().decode()
    set_cookies = {}
    for name, value in resp.getheaders():
        if name.lower() == "set-cookie":
            k, _, rest = value.partition("=")
            set_cookies[k] = rest.split(";")[0]
    conn.close()
    return resp.status, text, set_cookies


class _Config(ServeConfig):
    """ServeConfig plus the security options the guard reads (`admin_token_file`,
    `admin_allow`), which config.py does not parse yet."""


async def start(nursery, **security):
    from smallstalk.console import app

    lp = make_loop()
    nursery.start_soon(lp.run)
    port = free_port()
    cfg = _Config(http=("127.0.0.1", port))
    for key, value in security.items():
        setattr(cfg, key, value)
    await nursery.start(app.serve, lp, cfg)
    return lp, port


async def ask(*args, **kw):
    return await trio.to_thread.run_sync(lambda: request(*args, **kw))


async def buried_job(lp) -> None:
    c = Client(lp)
    await c.ask(b"put 0 0 60 1\r\nx\r\nreserve\r\nbury 1 0\r\n")


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


async def test_admin_token_needs_a_login(nursery, tmp_path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    lp, port = await start(nursery, admin_token_file=tmp_path / "token")
    await buried_job(lp)
    status, page, cookies = await ask(port, "GET", "/tube/default?state=buried")
    assert status == 200 and "read-only (log in to change)" in page
    token = csrf_of(page)
    status, page, _ = await ask(port, "POST", "/do/kick/default",
                                form={"csrf": token, "count": "1"}, cookies=cookies)
    assert status == 403 and "log in first" in page
    status, _, got = await ask(port, "POST", "/login", form={"csrf": token, "token": "wrong"},
                               cookies=cookies)
    assert status == 403 and "smallstalk_admin" not in got
    status, _, got = await ask(port, "POST", "/login", form={"csrf": token, "token": "s3cret"},
                               cookies=cookies)
    assert status == 303
    cookies.update(got)
    status, _, _ = await ask(port, "POST", "/do/kick/default",
                             form={"csrf": token, "count": "1"}, cookies=cookies)
    assert status == 303
    assert lp.state.buried_n == 0 and lp.state.ready_n == 1


async def test_without_a_token_only_admin_addresses_may_write(nursery) -> None:
    lp, port = await start(nursery, admin_allow=["127.0.0.2/32"])
    await buried_job(lp)
    status, page, cookies = await ask(port, "GET", "/tube/default")
    assert "read-only (not an admin address)" in page
    status, page, _ = await ask(port, "POST", "/do/flush/default",
                                form={"csrf": csrf_of(page)}, cookies=cookies)
    assert status == 403 and "admin-allowed addresses" in page
    assert lp.state.buried_n == 1


async def test_flush_from_loopback_is_a_clients_command(nursery) -> None:
    lp, port = await start(nursery)
    await buried_job(lp)
    status, page, cookies = await ask(port, "GET", "/tube/default")
    seq = lp.state.last_seq
    status, page, _ = await ask(port, "POST", "/do/flush/default",
                                form={"csrf": csrf_of(page)}, cookies=cookies)
    assert status == 303
    assert lp.state.buried_n == 0 and not lp.state.jobs
    # FlushTube, then the Disconnect of the console's session, which the record named.
    assert lp.state.last_seq == seq + 2
