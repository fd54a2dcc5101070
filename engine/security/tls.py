"""TLS contexts for the HTTP API and the KV port (docs/security.md "TLS").

:func:`server_context` loads a certificate chain and its key (PEM) and, when a client CA is given, requires and
verifies client certificates (``CERT_REQUIRED``), as Couchbase Server does with client-certificate authentication
set to "mandatory". :func:`client_context` is the client side the CLI uses to talk to an ``https://`` gateway.
A missing, unreadable or invalid file is a :class:`~engine.exceptions.TlsConfigError` naming the file (never its
content).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from engine.exceptions import TlsConfigError

__all__ = ["client_context", "server_context"]


def _readable(path: Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise TlsConfigError(f"TLS {what} file {p} does not exist or is not a file")
    try:
        with p.open("rb") as f:
            f.read(1)
    except OSError as e:
        raise TlsConfigError(f"TLS {what} file {p} is not readable: {e.strerror}") from None
    return p


def server_context(cert: Path, key: Path, client_ca: Path | None = None) -> ssl.SSLContext:
    """A server-side context serving ``cert`` (PEM chain) with ``key`` (PEM, unencrypted); TLS 1.2 at least.

    With ``client_ca`` every client must present a certificate signed by that CA (``CERT_REQUIRED``)."""
    cert_p = _readable(cert, "certificate")
    key_p = _readable(key, "key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_p, key_p)
    except ssl.SSLError as e:
        raise TlsConfigError(f"TLS certificate {cert_p} / key {key_p} cannot be loaded "
                             f"(not PEM, or the key does not match the certificate): {e.reason or e}") from None
    except OSError as e:
        raise TlsConfigError(f"TLS certificate {cert_p} / key {key_p} cannot be loaded: {e.strerror}") from None
    if client_ca is not None:
        ca_p = _readable(client_ca, "client CA")
        try:
            ctx.load_verify_locations(cafile=ca_p)
        except (ssl.SSLError, OSError) as e:
            raise TlsConfigError(f"TLS client CA {ca_p} cannot be loaded (not a PEM certificate): {e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def client_context(cafile: Path | None = None, cert: Path | None = None,
                   key: Path | None = None) -> ssl.SSLContext:
    """A client-side context verifying the server against ``cafile`` (the system's CAs when None), presenting
    ``cert``/``key`` when the server requires a client certificate."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if cafile is not None:
        ca_p = _readable(cafile, "CA")
        try:
            ctx.load_verify_locations(cafile=ca_p)
        except (ssl.SSLError, OSError) as e:
            raise TlsConfigError(f"TLS CA {ca_p} cannot be loaded (not a PEM certificate): {e}") from None
    if cert is not None:
        cert_p = _readable(cert, "client certificate")
        key_p = _readable(key, "client key") if key is not None else None
        try:
            ctx.load_cert_chain(cert_p, key_p)
        except (ssl.SSLError, OSError) as e:
            raise TlsConfigError(f"TLS client certificate {cert_p} cannot be loaded: {e}") from None
    return ctx
