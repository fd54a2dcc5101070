"""Server and client TLS contexts (engine/security/tls.py, docs/security.md "TLS") with trustme certificates:
a handshake over a real socket, client certificates required with a client CA, typed errors for bad files."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

import pytest
import trustme

from engine.exceptions import InvalidArgument, TlsConfigError
from engine.security import client_context, server_context


@pytest.fixture()
def pki(tmp_path: Path) -> dict[str, Path]:
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("client@example.com")
    out = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "server.pem", "key": tmp_path / "server.key",
           "client_cert": tmp_path / "client.pem", "client_key": tmp_path / "client.key"}
    ca.cert_pem.write_to_path(str(out["ca"]))
    server.cert_chain_pems[0].write_to_path(str(out["cert"]))
    server.private_key_pem.write_to_path(str(out["key"]))
    client.cert_chain_pems[0].write_to_path(str(out["client_cert"]))
    client.private_key_pem.write_to_path(str(out["client_key"]))
    return out


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> bytes:
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            conn, _ = lsock.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as s:
                s.sendall(s.recv(5))
        except (OSError, ssl.SSLError) as e:
            errors.append(e)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                client_ctx.wrap_socket(raw, server_hostname="localhost") as c:
            c.sendall(b"hello")
            return c.recv(5)
    finally:
        t.join(10)
        lsock.close()


def test_https_handshake(pki: dict[str, Path]) -> None:
    ctx = server_context(pki["cert"], pki["key"], None)
    assert ctx.verify_mode == ssl.CERT_NONE
    assert _handshake(ctx, client_context(pki["ca"])) == b"hello"


def test_client_ca_requires_a_client_certificate(pki: dict[str, Path]) -> None:
    ctx = server_context(pki["cert"], pki["key"], pki["ca"])
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    ok = client_context(pki["ca"], pki["client_cert"], pki["client_key"])
    assert _handshake(ctx, ok) == b"hello"
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        # TLS 1.3: the refusal arrives at the first read after the handshake
        _handshake(ctx, client_context(pki["ca"]))


def test_untrusted_server_is_refused(pki: dict[str, Path]) -> None:
    other = trustme.CA()
    ctx = server_context(pki["cert"], pki["key"], None)
    cafile = pki["ca"].with_name("other.pem")
    other.cert_pem.write_to_path(str(cafile))
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(ctx, client_context(cafile))


def test_bad_files_are_typed_errors(pki: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(TlsConfigError, match=r"certificate file .*missing.pem does not exist"):
        server_context(missing, pki["key"], None)
    with pytest.raises(TlsConfigError, match=r"key file .*missing.pem does not exist"):
        server_context(pki["cert"], missing, None)
    with pytest.raises(TlsConfigError, match="cannot be loaded"):
        server_context(garbage, pki["key"], None)
    with pytest.raises(TlsConfigError, match="cannot be loaded"):
        server_context(pki["cert"], pki["client_key"], None)  # key of another certificate
    with pytest.raises(TlsConfigError, match="client CA"):
        server_context(pki["cert"], pki["key"], garbage)
    with pytest.raises(TlsConfigError, match="client CA file"):
        server_context(pki["cert"], pki["key"], missing)
    with pytest.raises(TlsConfigError):
        client_context(garbage)
    assert issubclass(TlsConfigError, InvalidArgument)
    try:
        server_context(pki["cert"], pki["client_key"], None)
    except TlsConfigError as e:
        assert "PRIVATE KEY" not in str(e)  # never the key's content
