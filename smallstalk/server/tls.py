"""TLS: the contexts from the operator's PEM files, and the handshake of an accepted client.

The server's context is Python's secure default for a server
(`ssl.create_default_context(Purpose.CLIENT_AUTH)`: its protocols and ciphers,
unchanged); with a client CA it requires a client certificate signed by it
(mutual TLS). The replica's context is the default client context, which
checks the primary's certificate and host name. Files are read once, at
start, before recovery: a missing file or a key that does not fit its
certificate stops the server with one line (`TLSFileError`).

A TLS client is served by the connection's own task (connection.py): an
SSLStream has no fd for the poller. Its handshake runs before the connection
exists, bounded by a timeout, so a client that never finishes it holds
nothing but its socket for that long. Streams are `https_compatible`: the
server closes without waiting to send close_notify (a peer that does not read
could hold the close forever); the protocol frames its own commands, so a
truncated stream cannot pass for a complete one.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path
from typing import Protocol

import attrs
import trio

log = logging.getLogger("smallstalk.server.tls")

HANDSHAKE_TIMEOUT = 10.0  # seconds; --tls-handshake-timeout


class TLSFileError(Exception):
    """A certificate, key or CA file the server cannot use: one line for the operator."""


@attrs.frozen
class Contexts:
    """The TLS contexts the server was started with (None: that side is plaintext)."""

    server: ssl.SSLContext | None = None  # the TLS port's
    replica: ssl.SSLContext | None = None  # following a --replica-of primary


def _read(path: Path, flag: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TLSFileError(f"{flag} {path}: {e.strerror or e}: give the path of a readable "
                           "PEM file") from None
    return data.decode("ascii", errors="replace")


def _load_chain(ctx: ssl.SSLContext, cert: Path, key: Path, flags: tuple[str, str]) -> None:
    cert_flag, key_flag = flags
    cert_text, key_text = _read(cert, cert_flag), _read(key, key_flag)
    if "-----BEGIN CERTIFICATE-----" not in cert_text:
        raise TLSFileError(f"{cert_flag} {cert}: not a PEM certificate "
                           "(-----BEGIN CERTIFICATE-----)")
    if "PRIVATE KEY-----" not in key_text:
        raise TLSFileError(f"{key_flag} {key}: not a PEM private key "
                           "(-----BEGIN PRIVATE KEY-----)")
    if "ENCRYPTED" in key_text:
        raise TLSFileError(f"{key_flag} {key}: the key is encrypted with a passphrase; "
                           "smallstalk needs it unencrypted (openssl pkey -in KEY -out NEW)")
    try:
        # A callable password: an encrypted key fails here instead of prompting on a tty.
        ctx.load_cert_chain(os.fspath(cert), os.fspath(key), password=lambda: b"")
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise TLSFileError(f"{key_flag} {key} is not the key of {cert_flag} {cert}") \
                from None
        raise TLSFileError(f"{cert_flag} {cert} / {key_flag} {key}: cannot load: "
                           f"{e.reason or e}") from None


def _check_ca(ca: Path, flag: str) -> None:
    if "-----BEGIN CERTIFICATE-----" not in _read(ca, flag):
        raise TLSFileError(f"{flag} {ca}: no PEM certificate in it "
                           "(-----BEGIN CERTIFICATE-----)")


def _ssl_error(e: ssl.SSLError, flag: str, ca: Path) -> TLSFileError:
    return TLSFileError(f"{flag} {ca}: cannot load: {e.reason or e}")


class TLSSettings(Protocol):
    """What `contexts_for` reads of a server's settings (config.ServeConfig,
    a layer above this one)."""

    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    replica_tls_ca: Path | None
    replica_tls_cert: Path | None
    replica_tls_key: Path | None


def contexts_for(cfg: TLSSettings) -> Contexts:
    """The TLS contexts a server's settings (config.ServeConfig) ask for, from
    files read now; TLSFileError names a file the server cannot use. `serve`
    reads them before -u and recovery, `config dump --config` to check a file."""
    server = replica = None
    if cfg.tls_cert is not None and cfg.tls_key is not None:
        server = server_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
    if cfg.replica_tls_ca is not None or cfg.replica_tls_cert is not None:
        replica = replica_context(cfg.replica_tls_ca, cfg.replica_tls_cert, cfg.replica_tls_key)
    return Contexts(server, replica)


def server_context(cert: Path, key: Path, client_ca: Path | None = None) -> ssl.SSLContext:
    """The TLS port's context; with `client_ca`, clients must present a certificate it signed."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _load_chain(ctx, cert, key, ("--tls-cert", "--tls-key"))
    if client_ca is not None:
        _check_ca(client_ca, "--tls-client-ca")
        try:
            ctx.load_verify_locations(cafile=os.fspath(client_ca))
        except ssl.SSLError as e:
            raise _ssl_error(e, "--tls-client-ca", client_ca) from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def replica_context(ca: Path | None, cert: Path | None = None,
                    key: Path | None = None) -> ssl.SSLContext:
    """A replica's context for its primary: verifies it against `ca` (None: the system's
    CAs), and presents `cert` for a primary that requires client certificates."""
    if ca is None:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    else:
        _check_ca(ca, "--replica-tls-ca")
        try:  # only this CA: not the system's as well
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=os.fspath(ca))
        except ssl.SSLError as e:
            raise _ssl_error(e, "--replica-tls-ca", ca) from None
    if cert is not None and key is not None:
        _load_chain(ctx, cert, key, ("--replica-tls-cert", "--replica-tls-key"))
    return ctx


@attrs.frozen
class Listener:
    """A bound socket whose clients speak TLS; connection.py accepts on `socket`
    (counting its connections like the plaintext ones) and wraps each in `stream`."""

    socket: trio.socket.SocketType
    context: ssl.SSLContext

    def stream(self, sock: trio.socket.SocketType) -> trio.SSLStream:
        """An accepted client's stream; it has not shaken hands yet (`handshake`)."""
        return trio.SSLStream(trio.SocketStream(sock), self.context, server_side=True,
                              https_compatible=True)


def listener(sock: trio.socket.SocketType, ctx: ssl.SSLContext) -> Listener:
    """A TLS listener on a bound socket."""
    return Listener(sock, ctx)


def _peer(stream: trio.SSLStream) -> str:
    try:
        host, port = stream.transport_stream.socket.getpeername()[:2]
    except (AttributeError, OSError, ValueError):
        return "a client"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def handshake(stream: trio.SSLStream, timeout: float) -> bool:
    """Shake hands with an accepted client within `timeout` seconds; False (and the
    stream closed) when it fails, times out or the client goes away."""
    why = None
    with trio.move_on_after(timeout) as scope:
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as e:
            cause = e.__cause__
            why = str(getattr(cause, "reason", None) or cause or "the connection broke")
    if scope.cancelled_caught:
        why = f"not finished within {timeout:g}s"
    if why is None:
        return True
    # One line per refused client, with its address: mTLS refusals show up here.
    log.info("TLS handshake with %s failed: %s", _peer(stream), why)
    await trio.aclose_forcefully(stream)
    return False


async def connect(host: str, port: int, ctx: ssl.SSLContext,
                  timeout: float = HANDSHAKE_TIMEOUT) -> trio.SSLStream:
    """A client connection to host:port over TLS, the handshake done (the replica's).

    Raises ssl.SSLError (an OSError) with OpenSSL's reason when the handshake fails.
    """
    tcp = await trio.open_tcp_stream(host, port)
    # https_compatible like the server's side: the end of the stream reads as one.
    stream = trio.SSLStream(tcp, ctx, server_hostname=host, https_compatible=True)
    try:
        with trio.fail_after(timeout):
            await stream.do_handshake()
    except trio.TooSlowError:
        await trio.aclose_forcefully(stream)
        raise TimeoutError(f"TLS handshake not finished within {timeout:g}s") from None
    except trio.BrokenResourceError as e:
        await trio.aclose_forcefully(stream)
        cause = e.__cause__
        if isinstance(cause, OSError):
            raise cause from None
        raise OSError(f"TLS handshake failed: {cause or e}") from None
    return stream
