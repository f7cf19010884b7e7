"""Who may change the queue from the console: CSRF tokens, the admin token, addresses.

Reads are open to whoever reaches the HTTP address (loopback by default).
Every write is a POST that must carry the CSRF token of its browser (a
random value in a SameSite=Strict cookie, repeated in the form: double
submit), and then:

- with an admin token configured (`--admin-token-file`), a login session: the token typed into
  /login gives a session cookie, an HMAC of the token under a key made at
  start (sessions end with the process);
- without one, the request must come from an admin-allowed address
  (`cfg.admin_allow`, loopback only by default).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from starlette.requests import Request
from starlette.responses import Response

from smallstalk.server import admin

CSRF_COOKIE = "smallstalk_csrf"
SESSION_COOKIE = "smallstalk_admin"


class Guard:
    def __init__(self, cfg) -> None:
        self.key = secrets.token_bytes(32)
        token_file = getattr(cfg, "admin_token_file", None)
        self.token = admin.read_token(token_file) if token_file else None
        self.allowed = admin.parse_allow(getattr(cfg, "admin_allow", None) or admin.LOOPBACK)

    # --- CSRF ---------------------------------------------------------------------

    def csrf_token(self, request: Request) -> str:
        token = request.cookies.get(CSRF_COOKIE, "")
        return token if len(token) == 43 else secrets.token_urlsafe(32)

    def set_csrf_cookie(self, request: Request, resp: Response, token: str) -> None:
        if request.cookies.get(CSRF_COOKIE) != token:
            resp.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")

    def _csrf_ok(self, request: Request, form) -> bool:
        cookie = request.cookies.get(CSRF_COOKIE, "")
        sent = form.get("csrf", "")
        return bool(cookie) and isinstance(sent, str) and hmac.compare_digest(cookie, sent)

    # --- the admin token, addresses -------------------------------------------------

    def _session_value(self) -> str:
        assert self.token is not None
        return hmac.new(self.key, self.token.encode(), hashlib.sha256).hexdigest()

    def logged_in(self, request: Request) -> bool:
        if self.token is None:
            return False
        return hmac.compare_digest(request.cookies.get(SESSION_COOKIE, ""), self._session_value())

    def address_allowed(self, request: Request) -> bool:
        return admin.peer_allowed(request.client.host if request.client else None,
                                  self.allowed)

    def refuse_write(self, request: Request, form) -> str | None:
        """Why this POST may not change anything, or None."""
        if not self._csrf_ok(request, form):
            return "the form's CSRF token is missing or wrong: reload the page and try again"
        if self.token is not None:
            if not self.logged_in(request):
                return "changes need the admin token: log in first"
            return None
        if not self.address_allowed(request):
            return "changes are allowed only from the admin-allowed addresses (loopback)"
        return None

    def login(self, request: Request, form, resp: Response) -> bool:
        if self.token is None or not self._csrf_ok(request, form):
            return False
        sent = form.get("token", "")
        if not isinstance(sent, str) or not admin.token_matches(sent, self.token):
            return False
        resp.set_cookie(SESSION_COOKIE, self._session_value(), httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
        return True

    def describe(self, request: Request) -> str:
        """For the page footer: may this browser change things?"""
        if self.token is not None:
            return "logged in" if self.logged_in(request) else "read-only (log in to change)"
        return "changes allowed (admin address)" if self.address_allowed(request) \
            else "read-only (not an admin address)"
