"""A minimal memcached binary-protocol client for the KV benchmark (bench/kv.py): HELLO, SASL SCRAM (RFC 5802, as
kv_engine's ``cbsasl``), SELECT_BUCKET, GET_CLUSTER_CONFIG, and a pipeline of SETs closed by a NOOP, two batches in flight -- the
fastest a client can push documents through a KV port (docs/kv-protocol.md). Blocking sockets; one connection.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import socket
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Self

HEADER = struct.Struct(">BBHBBHIIQ")
REQ, RES = 0x80, 0x81
OP_SET, OP_SETQ, OP_NOOP, OP_HELLO = 0x01, 0x11, 0x0A, 0x1F
OP_SASL_LIST, OP_SASL_AUTH, OP_SASL_STEP = 0x20, 0x21, 0x22
OP_SELECT_BUCKET, OP_GET_CLUSTER_CONFIG = 0x89, 0xB5
STATUS_AUTH_CONTINUE = 0x21
#: HELLO features asked for: XERROR (0x07), SELECT_BUCKET (0x08), JSON (0x0b)
HELLO_FEATURES = (0x07, 0x08, 0x0B)
_HASHES = {"SCRAM-SHA512": "sha512", "SCRAM-SHA256": "sha256", "SCRAM-SHA1": "sha1"}


class KvError(Exception):
    """A response with a non-success status (``status`` is the memcached status)."""

    def __init__(self, opcode: int, status: int, body: bytes) -> None:
        super().__init__(f"opcode 0x{opcode:02x}: status 0x{status:02x} {body[:200]!r}")
        self.opcode = opcode
        self.status = status


@dataclass(frozen=True)
class Response:
    opcode: int
    status: int
    opaque: int
    cas: int
    extras: bytes
    key: bytes
    value: bytes


def packet(opcode: int, key: bytes = b"", value: bytes = b"", extras: bytes = b"", *, vbucket: int = 0,
           opaque: int = 0, cas: int = 0, datatype: int = 0) -> bytes:
    return HEADER.pack(REQ, opcode, len(key), len(extras), datatype, vbucket,
                       len(key) + len(extras) + len(value), opaque, cas) + extras + key + value


def vbucket_of(key: bytes, num_vbuckets: int) -> int:
    """Couchbase's key -> vbucket mapping (CRC32, as the SDKs hash)."""
    return ((zlib.crc32(key) >> 16) & 0x7FFF) % num_vbuckets


class KvConnection:
    """One authenticated connection to a KV port."""

    def __init__(self, host: str, port: int, *, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self._opaque = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ framing
    def _read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def read(self) -> Response:
        magic, opcode, keylen, extlen, _dt, status, bodylen, opaque, cas = HEADER.unpack(self._read_exact(24))
        body = self._read_exact(bodylen)
        framing = 0
        if magic == 0x18:  # alt response: framing extras length in the key length's high byte
            framing, keylen = keylen >> 8, keylen & 0xFF
        extras = body[framing:framing + extlen]
        key = body[framing + extlen:framing + extlen + keylen]
        return Response(opcode, status, opaque, cas, extras, key, body[framing + extlen + keylen:])

    def call(self, opcode: int, key: bytes = b"", value: bytes = b"", extras: bytes = b"", *,
             ok: Iterable[int] = (0,)) -> Response:
        self._opaque += 1
        self.sock.sendall(packet(opcode, key, value, extras, opaque=self._opaque))
        while True:
            r = self.read()
            if r.opaque == self._opaque:
                break
        if r.status not in tuple(ok):
            raise KvError(opcode, r.status, r.value)
        return r

    # ------------------------------------------------------------------ bootstrap
    def hello(self, features: Sequence[int] = HELLO_FEATURES) -> list[int]:
        r = self.call(OP_HELLO, b"bench.kv", b"".join(struct.pack(">H", f) for f in features))
        return [struct.unpack_from(">H", r.value, i)[0] for i in range(0, len(r.value), 2)]

    def authenticate(self, user: str, password: str, mechanism: str | None = None) -> str:
        """SASL: the strongest SCRAM mechanism the server lists (or ``mechanism``); returns the one used."""
        mechs = self.call(OP_SASL_LIST).value.decode().split()
        mech = mechanism or next((m for m in _HASHES if m in mechs), None)
        if mech is None or mech not in _HASHES:
            raise KvError(OP_SASL_LIST, 0, f"no SCRAM mechanism offered: {mechs}".encode())
        h = _HASHES[mech]
        nonce = base64.b64encode(os.urandom(18)).decode()
        bare = f"n={user.replace('=', '=3D').replace(',', '=2C')},r={nonce}"
        first = self.call(OP_SASL_AUTH, mech.encode(), f"n,,{bare}".encode(), ok=(0, STATUS_AUTH_CONTINUE))
        server_first = first.value.decode()
        attrs = dict(a.split("=", 1) for a in server_first.split(","))
        if not attrs["r"].startswith(nonce):
            raise KvError(OP_SASL_AUTH, 0, b"server nonce does not extend the client's")
        salted = hashlib.pbkdf2_hmac(h, password.encode(), base64.b64decode(attrs["s"]), int(attrs["i"]))
        client_key = hmac.new(salted, b"Client Key", h).digest()
        stored_key = hashlib.new(h, client_key).digest()
        final_bare = f"c=biws,r={attrs['r']}"
        auth_message = f"{bare},{server_first},{final_bare}".encode()
        signature = hmac.new(stored_key, auth_message, h).digest()
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        final = f"{final_bare},p={base64.b64encode(proof).decode()}"
        r = self.call(OP_SASL_STEP, mech.encode(), final.encode())
        server_key = hmac.new(salted, b"Server Key", h).digest()
        expected = base64.b64encode(hmac.new(server_key, auth_message, h).digest()).decode()
        if r.value and dict(a.split("=", 1) for a in r.value.decode().split(",")).get("v") != expected:
            raise KvError(OP_SASL_STEP, 0, b"server signature mismatch")
        return mech

    def select_bucket(self, name: str) -> None:
        self.call(OP_SELECT_BUCKET, name.encode())

    def cluster_config(self) -> dict:
        return dict(json.loads(self.call(OP_GET_CLUSTER_CONFIG).value))

    # ------------------------------------------------------------------ the ingest pipeline
    def send_batches(self, batches: Sequence[bytes]) -> int:
        """Send pipelines made by :func:`set_batches` with two batches in flight; returns how many SETs failed
        (each batch ends with a NOOP; every answer before it with a status other than success is a failure)."""
        failed = 0
        in_flight = 0
        for data in batches:
            self.sock.sendall(data)
            in_flight += 1
            while in_flight > 1:
                failed += self._drain_to_noop()
                in_flight -= 1
        while in_flight:
            failed += self._drain_to_noop()
            in_flight -= 1
        return failed

    def _drain_to_noop(self) -> int:
        failed = 0
        while True:
            r = self.read()
            if r.opcode == OP_NOOP:
                return failed
            failed += r.status != 0


def set_batches(keys: Sequence[bytes], value: bytes, *, num_vbuckets: int, batch: int = 512, flags: int = 0,
                datatype: int = 0x01, opcode: int = OP_SET) -> list[bytes]:
    """The ingest pipeline: a SET per key with its vbucket (``opcode`` OP_SETQ: quiet SETs, answered only on
    failure, for servers that have them), a NOOP closing every ``batch``."""
    extras = struct.pack(">II", flags, 0)
    out: list[bytes] = []
    for i in range(0, len(keys), batch):
        parts = [packet(opcode, k, value, extras, vbucket=vbucket_of(k, num_vbuckets), datatype=datatype)
                 for k in keys[i:i + batch]]
        parts.append(packet(OP_NOOP, opaque=0xFFFF0000 + len(out)))
        out.append(b"".join(parts))
    return out


__all__ = ["KvConnection", "KvError", "Response", "packet", "set_batches", "vbucket_of"]
