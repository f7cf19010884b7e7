"""Test certificates from `trustme`, written to PEM files a server process reads.

`Certs` holds one CA, a server certificate for 127.0.0.1 and localhost, and a
client certificate it signed (for mutual TLS); `server_flags` are the serve
flags that use them, `client_context` an `ssl` context that trusts the CA.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs
import trustme


@attrs.frozen
class Certs:
    ca: trustme.CA
    ca_file: Path
    cert_file: Path  # the server's, for 127.0.0.1 and localhost
    key_file: Path
    client_cert_file: Path  # a client's, signed by the same CA
    client_key_file: Path

    def server_flags(self, tls_port: int, *, mutual: bool = False) -> list[str]:
        flags = ["--tls-port", str(tls_port), "--tls-cert", str(self.cert_file),
                 "--tls-key", str(self.key_file)]
        return flags + ["--tls-client-ca", str(self.ca_file)] if mutual else flags

    def replica_flags(self) -> list[str]:
        """A replica's: trust this CA, present the client certificate."""
        return ["--replica-tls-ca", str(self.ca_file), "--replica-tls-cert",
                str(self.client_cert_file), "--replica-tls-key", str(self.client_key_file)]

    def client_context(self, *, with_cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        self.ca.configure_trust(ctx)
        if with_cert:
            ctx.load_cert_chain(self.client_cert_file, self.client_key_file)
        return ctx


def write_pair(cert: trustme.LeafCert, where: Path, name: str) -> tuple[Path, Path]:
    """A leaf certificate (with its chain) and its key as PEM files `name`.pem/.key."""
    cert_file, key_file = where / f"{name}.pem", where / f"{name}.key"
    cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key_file))
    return cert_file, key_file


def make_certs(where: Path) -> Certs:
    where.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    ca_file = where / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert, key = write_pair(ca.issue_cert("127.0.0.1", "localhost"), where, "server")
    client_cert, client_key = write_pair(ca.issue_cert("client@example.org"), where, "client")
    return Certs(ca, ca_file, cert, key, client_cert, client_key)
