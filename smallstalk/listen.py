"""The listening sockets, before the server loads: bind them, or take systemd's.

Standard library only, so launch.py can bind within milliseconds of start
(see its docstring) and cli.py can use the same code without importing
launch. Also here: systemd's readiness notes (sd_notify), a datagram to
$NOTIFY_SOCKET, and the quick -l/-p scan of serve's flags.
"""

from __future__ import annotations

import errno
import os
import socket

# systemd passes activated sockets from this descriptor on (sd_listen_fds(3)).
SD_LISTEN_FDS_START = 3


class ListenError(Exception):
    """The address cannot be listened on: an operator's mistake, told in one line."""


def listen_address(argv: list[str]) -> tuple[str, int] | None:
    """Just -l/-p (and --listen/--port) from serve's flags, as config.parse_serve reads them.

    A few lines instead of importing config (attrs and the protocol classes
    cost ~60 ms); tests/unit/test_launch.py checks the two agree.
    """
    addr, port = "127.0.0.1", 11300
    args = list(argv)
    try:
        while args:
            arg = args.pop(0)
            if arg.startswith("--"):
                name, eq, value = arg.partition("=")
                if name in ("--help", "--version", "--config", "--no-plaintext"):
                    # --config may name another address: the full parser decides,
                    # and the server binds after reading the file (--no-plaintext:
                    # no plaintext port to bind).
                    return None
                if name in ("--no-compact", "--extended-stats"):  # switches: no value
                    continue
                if not eq:
                    value = args.pop(0)
                if name == "--listen":
                    addr = value
                elif name == "--port":
                    port = int(value)
                continue
            if not arg.startswith("-") or arg == "-":
                return None
            flags = arg[1:]
            while flags:
                ch, flags = flags[0], flags[1:]
                if ch in "lpzbfsu":
                    value, flags = (flags, "") if flags else (args.pop(0), "")
                    if ch == "l":
                        addr = value
                    elif ch == "p":
                        port = int(value)
                elif ch in "vh":
                    return None
    except (IndexError, ValueError):
        return None  # the full parser reports it
    if not 0 <= port <= 65535:
        return None
    return addr, port


def bind(addr: str, port: int, flags: tuple[str, str] = ("-l", "-p")) -> list[socket.socket]:
    """Listening sockets on addr:port (every address it resolves to), or unix:PATH.

    Raises ListenError with the one line to print, naming `flags` (the address's
    and the port's) as the way to change them.
    """
    where = addr if addr.startswith("unix:") else f"{addr}:{port}"
    socks: list[socket.socket] = []
    try:
        if addr.startswith("unix:"):
            path = addr[len("unix:"):]
            if os.path.exists(path):
                os.unlink(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(path)
        else:
            # An ASCII name goes as bytes: getaddrinfo encodes a str with the idna
            # codec, an import (~2 ms) at every start for "127.0.0.1".
            host = addr.encode() if addr.isascii() else addr
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            # /etc/hosts may list an address twice: bind each once.
            infos = list({(i[0], i[4][:2]): i for i in infos}.values())
            for family, kind, proto, _, sockaddr in infos:
                sock = socket.socket(family, kind, proto)
                socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                # -p 0: every address gets the port the first one got.
                sock.bind((sockaddr[0], port, *sockaddr[2:]))
                port = sock.getsockname()[1]
        for sock in socks:
            sock.listen(1024)
        return socks
    except OSError as e:
        for sock in socks:
            sock.close()
        raise ListenError(_why(where, e, flags)) from None
    except UnicodeError:  # the idna codec refuses a non-ASCII name (an empty label ...)
        for sock in socks:
            sock.close()
        raise ListenError(f"cannot listen on {where}: not a host name or address; "
                          f"use {flags[0]}") from None


def _why(where: str, e: OSError, flags: tuple[str, str]) -> str:
    addr_flag, port_flag = flags
    if isinstance(e, socket.gaierror):
        return (f"cannot listen on {where}: cannot resolve the address ({e.strerror}); "
                f"use {addr_flag}")
    if e.errno == errno.EADDRINUSE:
        return f"{where} already in use: another smallstalk or beanstalkd? use {port_flag}"
    if e.errno == errno.EACCES and not where.startswith("unix:"):
        return (f"cannot listen on {where}: permission denied (ports below 1024 need root "
                "or CAP_NET_BIND_SERVICE)")
    if e.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: no such address on this host; use {addr_flag}"
    return f"cannot listen on {where}: {e.strerror or e}"


def describe(sock: socket.socket) -> str:
    """HOST:PORT (the port actually bound, also for -p 0), [V6]:PORT, or unix:PATH."""
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return f"unix:{name}"
    host, port = name[0], name[1]
    return f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}"


def activated() -> bool:
    """Did systemd (or systemd-socket-activate) pass this process its sockets?"""
    return os.environ.get("LISTEN_PID") == str(os.getpid()) and \
        os.environ.get("LISTEN_FDS", "0").isdigit() and int(os.environ["LISTEN_FDS"]) > 0


def systemd_sockets() -> list[socket.socket]:
    """The listening sockets systemd passed (fd 3 on), as sd_listen_fds(3) reads them.

    The variables are removed so that a child process does not take them too.
    """
    if not activated():
        return []
    count = int(os.environ["LISTEN_FDS"])
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        try:
            sock = socket.socket(fileno=fd)
        except OSError as e:
            raise ListenError(f"systemd passed fd {fd}, which is not a socket ({e.strerror})")\
                from None
        if sock.type != socket.SOCK_STREAM:
            raise ListenError(f"systemd passed fd {fd}, which is not a stream socket: "
                              "the .socket unit needs ListenStream=")
        os.set_inheritable(fd, False)
        socks.append(sock)
    return socks


def notify(state: str) -> bool:
    """Send sd_notify(3) STATE (e.g. "READY=1") to $NOTIFY_SOCKET; False if there is none.

    An address starting with "@" is in the abstract namespace.
    """
    where = os.environ.get("NOTIFY_SOCKET")
    if not where or where[0] not in "/@":
        return False
    if where[0] == "@":
        where = "\0" + where[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(where)
            sock.sendall(state.encode())
    except OSError:
        return False  # the service manager went away: nothing to tell
    return True
