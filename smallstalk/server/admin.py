"""Who may run the admin commands: the token check and the admin-allowed addresses.

The commands themselves are `dispatch.ADMIN`; the threat model is in
docs/SECURITY.md. With a token (`--admin-token-file`) every connection must
send `auth <token>` first; without one, the unix socket and the peers that
`--admin-allow` names (loopback by default) may run them. The console's login
(console/guard.py) compares with the same `token_matches`.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable

import attrs

LOOPBACK = ("127.0.0.0/8", "::1/128")
# A wrong token is answered after this long (seconds), from a timer: guessing
# costs a connection that long per try, and the loop is never held up.
AUTH_FAIL_DELAY = 0.1

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_allow(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """`--admin-allow` networks; ValueError names the one that is not a CIDR."""
    out = []
    for text in cidrs:
        try:
            out.append(ipaddress.ip_network(text.strip(), strict=False))
        except ValueError:
            raise ValueError(f"not an address or CIDR: {text!r}") from None
    return tuple(out)


def read_token(path: str | os.PathLike[str]) -> str:
    """The token in a file (surrounding whitespace ignored); ValueError says what is wrong."""
    try:
        with open(path, encoding="ascii") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read the admin token file {os.fspath(path)}: "
                         f"{e.strerror or e} (make one: `openssl rand -hex 32 > FILE`, "
                         "readable by the server's user only)") from None
    except UnicodeDecodeError:
        raise ValueError(f"the admin token file {os.fspath(path)} must hold one word of "
                         "printable ASCII (e.g. the output of `openssl rand -hex 32`)") from None
    if not token or not all("!" <= c <= "~" for c in token):
        raise ValueError(f"the admin token file {os.fspath(path)} must hold one word of "
                         "printable ASCII (e.g. the output of `openssl rand -hex 32`)")
    return token


def token_matches(sent: str, token: str) -> bool:
    """Constant-time comparison (as bytes: compare_digest refuses non-ASCII str)."""
    return hmac.compare_digest(sent.encode("utf-8", "replace"), token.encode("ascii"))


def peer_allowed(peer: str | None, nets: Iterable[Network]) -> bool:
    if peer is None:
        return False
    try:
        ip = ipaddress.ip_address(peer)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a dual-stack listener's IPv4 peer
    return any(ip in net for net in nets)


@attrs.frozen
class AdminPolicy:
    """The server's admin settings, as the loop consults them per session."""

    token: str | None = attrs.field(default=None, repr=False)
    allow: tuple[Network, ...] = parse_allow(LOOPBACK)

    def trusts(self, peer: str | None, transport: str) -> bool:
        """Whether a new connection may run admin commands before any `auth`.

        `local` is an in-process session (the console's own, tests' harness):
        the console guards its writes itself (console/guard.py).
        """
        if transport == "local":
            return True
        if self.token is not None:
            return False
        return transport == "unix" or peer_allowed(peer, self.allow)
