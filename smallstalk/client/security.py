"""TLS and the admin token: the connection settings `Client`, `AsyncClient` and
the worker share (docs/CLIENT.md, "TLS and the admin token")."""

from __future__ import annotations

import os
import ssl

import attrs

from smallstalk.core import protocol as p

TOKEN_ENV = "SMALLSTALK_TOKEN"


@attrs.frozen
class Security:
    """How every connection of one client opens: over TLS with `ssl_context`
    (None: plaintext), then `auth <token>` first when a token is set."""

    ssl_context: ssl.SSLContext | None = None
    token: str | None = attrs.field(default=None, repr=False)


def check_token(token: str) -> str:
    """A token is one word of printable ASCII that fits in a command line."""
    if not isinstance(token, str):
        raise TypeError(f"a token is a str, not {type(token).__name__}")
    longest = p.LINE_MAX - len(p.render(p.Auth("")))
    if not token or len(token) > longest or not all("!" <= c <= "~" for c in token):
        raise ValueError(f"a token is 1 to {longest} printable ASCII characters without "
                         "spaces")
    return token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in a file (surrounding whitespace and the final newline ignored)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the token file {os.fspath(path)}: {e}") from None
    return check_token(text)


def token_for_tool(token_file: str | os.PathLike[str] | None) -> str | None:
    """The token an operator command sends (`smallstalk promote`, `config dump`):
    from `--token-file`, else from $SMALLSTALK_TOKEN, else none. Never from an
    argument: `ps` shows those to every user of the machine."""
    if token_file is not None:
        return read_token_file(token_file)
    env = os.environ.get(TOKEN_ENV)
    return check_token(env.strip()) if env and env.strip() else None


def security(*, tls: bool = False, ssl_context: ssl.SSLContext | None = None,
             token: str | None = None,
             token_file: str | os.PathLike[str] | None = None) -> Security:
    """The settings from a client's arguments: `ssl_context` wins over `tls=True`
    (the system's CAs); `token` and `token_file` exclude each other."""
    if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
        raise TypeError(f"ssl_context is an ssl.SSLContext, not {type(ssl_context).__name__}")
    if ssl_context is None and tls:
        ssl_context = ssl.create_default_context()
    if token is not None and token_file is not None:
        raise ValueError("give token= or token_file=, not both")
    if token_file is not None:
        token = read_token_file(token_file)
    elif token is not None:
        token = check_token(token)
    return Security(ssl_context, token)
