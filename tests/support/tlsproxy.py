"""A TLS-terminating TCP proxy in a thread: the standard `ssl` module's server side
in front of a real server process, for the clients' TLS tests until the server
speaks TLS itself. Certificates come from `trustme`."""

from __future__ import annotations

import selectors
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import trustme


@attrs.define
class TLSProxy:
    port: int
    ca: trustme.CA
    handshakes: int = 0  # completed TLS handshakes
    refused: int = 0  # handshakes that failed
    backends: list[socket.socket] = attrs.Factory(list)  # live connections to the server

    def drop_all(self) -> None:
        """Close every connection from the server's side, as a restart would."""
        for s in list(self.backends):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this proxy's CA."""
        ctx = ssl.create_default_context()
        self.ca.configure_trust(ctx)
        return ctx


def _pump(tls: ssl.SSLSocket, plain: socket.socket) -> None:
    """Copy bytes both ways until either side closes."""
    sel = selectors.DefaultSelector()
    sel.register(tls, selectors.EVENT_READ, plain)
    sel.register(plain, selectors.EVENT_READ, tls)
    try:
        while True:
            ready = [(tls, plain)] if tls.pending() else [
                (key.fileobj, key.data) for key, _ in sel.select(timeout=60)]
            if not ready:
                return
            for src, dst in ready:
                try:
                    data = src.recv(65536)
                except (ssl.SSLWantReadError, TimeoutError):
                    continue
                if not data:
                    return
                dst.sendall(data)
    except OSError:
        return
    finally:
        sel.close()
        for s in (tls, plain):
            s.close()


def _serve_one(proxy: TLSProxy, conn: socket.socket, ctx: ssl.SSLContext,
               backend: int) -> None:
    conn.settimeout(10)
    try:
        tls = ctx.wrap_socket(conn, server_side=True)
    except (ssl.SSLError, OSError):
        proxy.refused += 1
        conn.close()
        return
    proxy.handshakes += 1
    try:
        plain = socket.create_connection(("127.0.0.1", backend), timeout=10)
    except OSError:
        tls.close()
        return
    proxy.backends.append(plain)
    try:
        _pump(tls, plain)
    finally:
        proxy.backends.remove(plain)


@contextmanager
def tls_proxy(backend: int, *, require_client_cert: bool = False) -> Iterator[TLSProxy]:
    """Listen with TLS on 127.0.0.1 (a certificate for 127.0.0.1 and localhost
    from a fresh CA) and forward each connection to 127.0.0.1:`backend`."""
    ca = trustme.CA()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(ctx)
    if require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ca.configure_trust(ctx)
    listener = socket.create_server(("127.0.0.1", 0))
    proxy = TLSProxy(listener.getsockname()[1], ca)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the proxy is done
            threading.Thread(target=_serve_one, args=(proxy, conn, ctx, backend),
                             daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        try:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        except OSError:
            pass
        listener.close()
        thread.join(timeout=5)
