"""SASL on the KV port (docs/kv-protocol.md "Authentication"): SCRAM-SHA512 / SHA256 / SHA1 servers per RFC 5802
against the user store's stored credentials (engine/security/users.py ``UserStore.scram_credential``), and PLAIN
-- only over TLS, as Couchbase Server offers it.

SCRAM on the wire (kv_engine ``cb::sasl::server``): SASL_AUTH carries the mechanism as the key and the
client-first message (``n,,n=<user>,r=<client nonce>``); the answer is AUTH_CONTINUE with the server-first
message (``r=<nonce>,s=<salt>,i=<iterations>``); SASL_STEP carries the client-final message
(``c=biws,r=<nonce>,p=<proof>``) and is answered SUCCESS with ``v=<server signature>`` or AUTH_ERROR. An unknown
user gets a made-up salt derived from its name and fails at the proof, like a wrong password: the exchange does
not say which users exist. Channel binding is not supported (``p=`` gs2 header: AUTH_ERROR).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from engine.exceptions import AuthenticationFailed
from engine.security.users import SCRAM_MECHANISMS, ScramCredential, User

PLAIN: Final = "PLAIN"
_HASHES: Final = {"SCRAM-SHA512": "sha512", "SCRAM-SHA256": "sha256", "SCRAM-SHA1": "sha1"}
#: iterations announced for an unknown user (the store's own count, so both look alike)
_FAKE_ITERATIONS: Final = 15000


class UserDirectory(Protocol):
    """What the port needs of the user store (engine/security/users.py ``UserStore``)."""

    def scram_credential(self, name: str, mechanism: str) -> ScramCredential | None: ...

    def authenticate(self, name: str, password: str) -> User: ...

    def get(self, name: str) -> User | None: ...


def mechanisms(tls: bool) -> list[str]:
    """SASL_LIST_MECHS: the SCRAM family, plus PLAIN on a TLS connection."""
    return [*SCRAM_MECHANISMS, PLAIN] if tls else list(SCRAM_MECHANISMS)


def _fail(why: str) -> AuthenticationFailed:
    # one message for every failure: the reason goes to no client (docs/security.md)
    del why
    return AuthenticationFailed("authentication failed")


def _attrs(message: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in message.split(","):
        if len(part) < 2 or part[1] != "=":
            raise _fail("malformed attribute")
        out.setdefault(part[0], part[2:])
    return out


def _saslname(raw: str) -> str:
    # RFC 5802 5.1: "=2C" is ",", "=3D" is "="; any other "=" is malformed
    out = raw.replace("=2C", ",").replace("=3D", "=")
    if "=" in raw.replace("=2C", "").replace("=3D", ""):
        raise _fail("bad saslname")
    return out


@dataclass
class ScramServer:
    """One SCRAM exchange (the session keeps it between SASL_AUTH and SASL_STEP)."""

    mechanism: str
    users: UserDirectory
    #: random bytes for the server nonce (injected; ``secrets.token_bytes`` by default)
    random_bytes: Callable[[int], bytes] = secrets.token_bytes
    #: a per-process secret the made-up salts of unknown users derive from
    fake_secret: bytes = b""
    _user: str = ""
    _cred: ScramCredential | None = None
    _known: bool = False
    _first_bare: str = ""
    _server_first: str = ""
    _nonce: str = ""

    def first(self, client_first: bytes) -> bytes:
        """The client-first message -> the server-first message."""
        h = _HASHES.get(self.mechanism)
        if h is None:
            raise _fail("unknown mechanism")
        try:
            msg = client_first.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail("not utf-8") from None
        if not (msg.startswith("n,") or msg.startswith("y,")):
            raise _fail("channel binding or a malformed gs2 header")
        parts = msg.split(",", 2)
        if len(parts) != 3 or parts[1]:  # no authzid
            raise _fail("gs2 header with authzid")
        bare = parts[2]
        a = _attrs(bare)
        if "n" not in a or "r" not in a or not a["r"] or "m" in a:
            raise _fail("client-first without user or nonce")
        self._user = _saslname(a["n"])
        cred = self.users.scram_credential(self._user, self.mechanism)
        self._known = cred is not None
        if cred is None:
            salt = hmac.new(self.fake_secret or b"dcpgw", self._user.encode(), "sha256").digest()[:16]
            size = hashlib.new(h).digest_size
            cred = ScramCredential(self.mechanism, salt, _FAKE_ITERATIONS, self.random_bytes(size),
                                   self.random_bytes(size))
        self._cred = cred
        self._nonce = a["r"] + base64.b64encode(self.random_bytes(18)).decode("ascii")
        self._first_bare = bare
        self._server_first = f"r={self._nonce},s={base64.b64encode(cred.salt).decode('ascii')},i={cred.iterations}"
        return self._server_first.encode()

    def final(self, client_final: bytes) -> tuple[User, bytes]:
        """The client-final message -> (the user, the server-final message); AuthenticationFailed otherwise."""
        cred = self._cred
        if cred is None:
            raise _fail("SASL_STEP before SASL_AUTH")
        self._cred = None  # one attempt per exchange
        h = _HASHES[self.mechanism]
        try:
            msg = client_final.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail("not utf-8") from None
        idx = msg.rfind(",p=")
        if idx < 0:
            raise _fail("no proof")
        without_proof = msg[:idx]
        a = _attrs(without_proof)
        if a.get("r") != self._nonce or a.get("c") not in ("biws", "eSws"):
            raise _fail("nonce or channel binding mismatch")
        try:
            proof = base64.b64decode(msg[idx + 3:], validate=True)
        except (binascii.Error, ValueError):
            raise _fail("bad proof encoding") from None
        auth_message = f"{self._first_bare},{self._server_first},{without_proof}".encode()
        signature = hmac.new(cred.stored_key, auth_message, h).digest()
        if len(proof) != len(signature):
            raise _fail("bad proof length")
        client_key = bytes(x ^ y for x, y in zip(proof, signature, strict=True))
        ok = hmac.compare_digest(hashlib.new(h, client_key).digest(), cred.stored_key)
        if not ok or not self._known:
            raise _fail("wrong proof")
        user = self.users.get(self._user)
        if user is None:  # deleted meanwhile
            raise _fail("unknown user")
        server_sig = hmac.new(cred.server_key, auth_message, h).digest()
        return user, b"v=" + base64.b64encode(server_sig)

    def __repr__(self) -> str:
        # no salt, nonce, key or secret (docs/security.md: secrets never in repr)
        return f"ScramServer(mechanism={self.mechanism!r}, user={self._user!r})"


def parse_plain(value: bytes) -> tuple[str, str]:
    """PLAIN (RFC 4616): ``[authzid] NUL user NUL password`` -> (user, password)."""
    parts = value.split(b"\x00")
    if len(parts) != 3 or (parts[0] and parts[0] != parts[1]):
        raise _fail("malformed PLAIN message")
    try:
        return parts[1].decode("utf-8"), parts[2].decode("utf-8")
    except UnicodeDecodeError:
        raise _fail("not utf-8") from None
