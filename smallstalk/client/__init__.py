"""Clients for the beanstalkd protocol: `Client` (plain sockets) and `AsyncClient` (trio).

Both speak to smallstalk and to beanstalkd alike, have the same method names,
return typed results (`JobRef`, `Job`, `JobStats`, `TubeStats`, `ServerStats`)
and raise one exception class per error reply (`NotFound`, `TimedOut`, ...).

Theory of operation. The protocol lives in one place, without I/O:

- commands are `smallstalk.core.protocol`'s command classes, rendered by
  `protocol.render` (the server's own definition of the protocol);
- `ReplyReader` is a sans-I/O reply parser over a bytes buffer, and
  `interpret(command, reply)` turns one reply into a result or an exception;
- `_Core` holds what a client knows (its servers, the tube it uses, the tubes
  it watches, which servers are down) and implements every method as a
  generator that yields `_Exchange`s (commands for one server) and receives
  the replies. It is where multi-server behaviour lives.

The two clients are thin drivers that run those generators over a socket or a
trio stream: they connect, pipeline the commands in one write, feed the
reader, and throw connection errors back into the generator.

Several servers (kestrel style: the servers do not know each other). Puts
go round-robin from a random start, skipping servers that refuse or drain;
reserves poll every server with `reserve-with-timeout 0` from a rotating start
and, when none has work, block on one server for `poll_interval` seconds at a
time (beanstalkd cannot wait on two servers at once, and a waiting reserve
blocks its connection). Every job carries the address of the server it lives
on, and commands on a job go to that server; a bare integer id is only
accepted when the client has a single server.

The modules: errors (exceptions), replies (the reply parser and the typed
results), addresses, security (TLS and the admin token), core (the shared
sans-I/O core), sync (`Client`) and async_ (`AsyncClient`).
"""

from smallstalk.client.addresses import (
    DEFAULT_PORT,
    DEFAULT_SERVER,
    SERVERS_ENV,
    normalize_address,
    resolve_servers,
)
from smallstalk.client.async_ import AsyncClient
from smallstalk.client.core import DEFAULT_PRIORITY, DEFAULT_TTR, JobLike
from smallstalk.client.errors import (
    BadFormat,
    BadSearch,
    BeanstalkError,
    Buried,
    CommandError,
    ConnectionFailed,
    DeadlineSoon,
    Draining,
    ExpectedCRLF,
    InternalError,
    JobTooBig,
    NotAReplica,
    NotConnected,
    NotFound,
    NotIgnored,
    NotReloaded,
    NotReplicated,
    OutOfMemory,
    ProtocolError,
    ReadOnly,
    ReadTimeout,
    TimedOut,
    Unauthorized,
    UnknownCommand,
)
from smallstalk.client.replies import (
    REPLY_LINE_MAX,
    Explanation,
    Job,
    JobRef,
    JobStats,
    Reply,
    ReplyReader,
    ServerStats,
    TubeStats,
    interpret,
)
from smallstalk.client.security import TOKEN_ENV, Security
from smallstalk.client.sync import Client

__all__ = [
    "DEFAULT_PORT", "DEFAULT_PRIORITY", "DEFAULT_SERVER", "DEFAULT_TTR", "REPLY_LINE_MAX",
    "SERVERS_ENV", "TOKEN_ENV", "AsyncClient", "BadFormat", "BadSearch", "BeanstalkError", "Buried", "Client",
    "CommandError", "ConnectionFailed", "DeadlineSoon", "Draining", "ExpectedCRLF", "Explanation",
    "InternalError", "Job", "JobLike", "JobRef", "JobStats", "JobTooBig", "NotAReplica",
    "NotConnected", "NotFound", "NotIgnored", "NotReloaded", "NotReplicated", "ReadOnly",
    "OutOfMemory", "ProtocolError", "ReadTimeout", "Reply", "ReplyReader",
    "Security", "ServerStats", "TimedOut", "TubeStats", "Unauthorized", "UnknownCommand",
    "interpret", "normalize_address", "resolve_servers",
]
