"""SASL client mechanisms for the target's KV port: SCRAM-SHA512 / SHA256 / SHA1 (RFC 5802, as kv_engine's
``cbsasl`` serves them) and PLAIN (only over TLS, as Couchbase clients do). docs/xdcr.md "Target client"."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable

from connectors.xdcr.errors import TargetAuthError

__all__ = ["PREFERENCE", "PlainClient", "ScramClient", "choose_mechanism"]

#: strongest first (what kv_engine and the SDKs prefer)
PREFERENCE = ("SCRAM-SHA512", "SCRAM-SHA256", "SCRAM-SHA1")
_HASH = {"SCRAM-SHA512": "sha512", "SCRAM-SHA256": "sha256", "SCRAM-SHA1": "sha1"}


def choose_mechanism(offered: list[str], tls: bool) -> str:
    """The strongest SCRAM mechanism the server offers; PLAIN only over TLS."""
    for m in PREFERENCE:
        if m in offered:
            return m
    if "PLAIN" in offered and tls:
        return "PLAIN"
    raise TargetAuthError(f"the target offers no usable SASL mechanism ({' '.join(offered) or 'none'}; PLAIN is "
                          "only used over TLS)")


class PlainClient:
    mechanism = "PLAIN"

    def __init__(self, user: str, password: str) -> None:
        self.user, self.password = user, password

    def first(self) -> bytes:
        return b"\0" + self.user.encode() + b"\0" + self.password.encode()

    def step(self, challenge: bytes) -> bytes:
        raise TargetAuthError("PLAIN has no second step")

    def verify(self, final: bytes) -> None:
        pass


def _saslname(user: str) -> str:
    return user.replace("=", "=3D").replace(",", "=2C")


class ScramClient:
    """One SCRAM exchange: :meth:`first` (client-first), :meth:`step` (server-first -> client-final),
    :meth:`verify` (server-final signature)."""

    def __init__(self, mechanism: str, user: str, password: str,
                 nonce: Callable[[], str] = lambda: secrets.token_urlsafe(18)) -> None:
        if mechanism not in _HASH:
            raise TargetAuthError(f"unknown SCRAM mechanism {mechanism}")
        self.mechanism = mechanism
        self._hash = _HASH[mechanism]
        self.user, self.password = user, password
        self._nonce = nonce()
        self._first_bare = f"n={_saslname(user)},r={self._nonce}"
        self._server_sig = b""

    def _h(self, data: bytes) -> bytes:
        return hashlib.new(self._hash, data).digest()

    def _hmac(self, key: bytes, data: bytes) -> bytes:
        return hmac.new(key, data, self._hash).digest()

    def first(self) -> bytes:
        return ("n,," + self._first_bare).encode()

    def step(self, challenge: bytes) -> bytes:
        try:
            attrs = dict(p.split("=", 1) for p in challenge.decode().split(","))
            nonce, salt, iterations = attrs["r"], base64.b64decode(attrs["s"]), int(attrs["i"])
        except (ValueError, KeyError, UnicodeDecodeError) as e:
            raise TargetAuthError(f"malformed SCRAM server-first message: {e}") from e
        if not nonce.startswith(self._nonce):
            raise TargetAuthError("the SCRAM server nonce does not extend the client's")
        salted = hashlib.pbkdf2_hmac(self._hash, self.password.encode(), salt, iterations)
        client_key = self._hmac(salted, b"Client Key")
        stored = self._h(client_key)
        without_proof = f"c=biws,r={nonce}"
        auth_message = f"{self._first_bare},{challenge.decode()},{without_proof}".encode()
        signature = self._hmac(stored, auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self._server_sig = self._hmac(self._hmac(salted, b"Server Key"), auth_message)
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()

    def verify(self, final: bytes) -> None:
        try:
            attrs = dict(p.split("=", 1) for p in final.decode().split(","))
        except (ValueError, UnicodeDecodeError) as e:
            raise TargetAuthError(f"malformed SCRAM server-final message: {e}") from e
        if "e" in attrs:
            raise TargetAuthError(f"the target refused the credentials: {attrs['e']}")
        if "v" not in attrs or not hmac.compare_digest(base64.b64decode(attrs["v"]), self._server_sig):
            raise TargetAuthError("the target's SCRAM server signature does not verify")
