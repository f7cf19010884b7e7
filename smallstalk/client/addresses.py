"""Server addresses: the forms a caller may write, and the one spelling the client keeps."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeAlias

DEFAULT_PORT = 11300
DEFAULT_SERVER = f"127.0.0.1:{DEFAULT_PORT}"
SERVERS_ENV = "SMALLSTALK_SERVERS"

Address: TypeAlias = str | tuple[str, int]
Servers: TypeAlias = Address | Sequence[Address] | None

FORMS = ('"host:port", "[v6]:port", "unix:/path", a comma-separated string of these, '
         'a (host, port) tuple, or a list of strings and (host, port) tuples')


def _is_pair(addr: object) -> bool:
    return (isinstance(addr, tuple) and len(addr) == 2 and isinstance(addr[0], str)
            and isinstance(addr[1], int) and not isinstance(addr[1], bool))


def normalize_address(addr: Address) -> str:
    """"host", "host:port", "[v6]:port", "unix:/path" or (host, port) to one spelling."""
    if _is_pair(addr):
        host, port = addr  # type: ignore[misc]
        host = host.strip().removeprefix("[").removesuffix("]")
        if not host:
            raise ValueError(f"no host in server address {addr!r}")
        if not 0 < port < 65536:
            raise ValueError(f"bad port in server address {addr!r}")
    elif isinstance(addr, str):
        addr = addr.strip()
        if addr.startswith("unix:"):
            return addr
        host, port = split_address(addr)
    else:
        raise TypeError(f"a server address is {FORMS}; not {addr!r}")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(addr: str) -> tuple[str, int]:
    """(host, port) of a "host[:port]" or "[v6][:port]" address."""
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif addr.count(":") == 1:
        host, _, port = addr.partition(":")
    else:
        host, port = addr, ""
    if not host:
        raise ValueError(f"no host in server address {addr!r}")
    try:
        number = int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"bad port in server address {addr!r}") from None
    if not 0 < number < 65536:
        raise ValueError(f"bad port in server address {addr!r}")
    return host, number


def resolve_servers(servers: Servers) -> list[str]:
    """Server list from an argument, else $SMALLSTALK_SERVERS, else 127.0.0.1:11300.

    A string may hold several addresses separated by commas; a (host, port)
    tuple is one address; a list may mix strings and tuples.
    """
    if servers is None:
        servers = os.environ.get(SERVERS_ENV) or DEFAULT_SERVER
    if isinstance(servers, str):
        items: list[Address] = [s for s in servers.split(",") if s.strip()]
    elif _is_pair(servers):
        items = [servers]  # type: ignore[list-item]
    elif isinstance(servers, list | tuple):
        if (len(servers) == 2 and isinstance(servers[0], str) and isinstance(servers[1], str)
                and servers[1].isdigit()):
            # ("host", "11300") is a pair with its port spelled as text, not two servers.
            raise TypeError(f"servers are {FORMS}; not {servers!r} (the port is an int)")
        items = list(servers)
    else:
        raise TypeError(f"servers are {FORMS}; not {servers!r}")
    out = [normalize_address(s) for s in items]
    if not out:
        raise ValueError("no servers given")
    if len(set(out)) != len(out):
        raise ValueError(f"a server is listed twice: {out}")
    return out
