"""One blocking connection to a target node's KV port: the bootstrap (HELLO, SASL, SELECT_BUCKET) and
pipelined requests (docs/xdcr.md "Target client").

Each bootstrap step is switched by what the server answers, so the same client talks to a Couchbase KV port
(HELLO, SCRAM, SELECT_BUCKET required) and to a bare node process (no HELLO, no SASL: ``UNKNOWN_COMMAND``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from connectors.xdcr.errors import KvError, TargetAuthError, TargetUnreachable
from connectors.xdcr.mcbp import (
    HEADER,
    HEADER_LEN,
    SERVER_REQ_MAGIC,
    Feature,
    Op,
    Response,
    Status,
    encode_request,
    response_from,
)
from connectors.xdcr.sasl import PlainClient, ScramClient, choose_mechanism

__all__ = ["Credentials", "KvConnection"]

#: features asked in HELLO (the answer says which the server has)
WANTED_FEATURES = (Feature.TCPNODELAY, Feature.MUTATION_SEQNO, Feature.XERROR, Feature.SELECT_BUCKET)
#: statuses meaning "this server does not have that command" (bootstrap steps are then skipped)
_ABSENT = {Status.UNKNOWN_COMMAND, Status.NOT_SUPPORTED}


@dataclass(frozen=True)
class Credentials:
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    bucket: str | None = None


class KvConnection:
    """A connected, bootstrapped KV connection (raises :class:`TargetUnreachable` /
    :class:`TargetAuthError`)."""

    def __init__(self, host: str, port: int, creds: Credentials, *, tls: ssl.SSLContext | None = None,
                 timeout: float = 30.0, agent: str = "dcpgw-xdcr") -> None:
        self.host, self.port = host, port
        self.tls = tls is not None
        self._opaque = itertools.count(1)
        try:
            raw = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise TargetUnreachable(f"cannot connect to {host}:{port}: {e}") from e
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock: socket.socket = tls.wrap_socket(raw, server_hostname=host) if tls is not None else raw
        except (OSError, ssl.SSLError) as e:
            raw.close()
            raise TargetUnreachable(f"TLS to {host}:{port} failed: {e}") from e
        self._rfile = self.sock.makefile("rb")
        self.features: set[int] = set()
        self.mechanisms: list[str] = []
        self.authenticated_as: str | None = None
        self.bucket_selected: str | None = None
        try:
            self._bootstrap(creds, agent)
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------------------- bootstrap
    def _bootstrap(self, creds: Credentials, agent: str) -> None:
        hello = b"".join(int(f).to_bytes(2, "big") for f in WANTED_FEATURES)
        r = self.call(Op.HELLO, key=json.dumps({"a": agent}).encode(), value=hello)
        if r.ok:
            self.features = {int.from_bytes(r.value[i:i + 2], "big") for i in range(0, len(r.value) - 1, 2)}
        elif r.status not in _ABSENT:
            raise KvError(f"HELLO refused by {self.host}:{self.port}: {r.status_name()}", r.status)
        if creds.user is not None:
            r = self.call(Op.SASL_LIST_MECHS)
            if r.ok:
                self.mechanisms = r.value.decode().split()
                self._authenticate(creds.user, creds.password or "")
            elif r.status not in _ABSENT:
                raise TargetAuthError(f"{self.host}:{self.port} refused SASL_LIST_MECHS: {r.status_name()}")
        if creds.bucket:
            r = self.call(Op.SELECT_BUCKET, key=creds.bucket.encode())
            if r.ok:
                self.bucket_selected = creds.bucket
            elif r.status in (Status.KEY_ENOENT, Status.EACCESS, Status.NO_BUCKET):
                raise TargetAuthError(f"{self.host}:{self.port}: bucket {creds.bucket!r} "
                                      f"{'not found' if r.status != Status.EACCESS else 'not accessible'} "
                                      f"for this user ({r.status_name()})")
            elif r.status not in _ABSENT:
                raise KvError(f"SELECT_BUCKET refused: {r.status_name()}", r.status)

    def _authenticate(self, user: str, password: str) -> None:
        mech = choose_mechanism(self.mechanisms, self.tls)
        client: ScramClient | PlainClient = (PlainClient(user, password) if mech == "PLAIN"
                                             else ScramClient(mech, user, password))
        r = self.call(Op.SASL_AUTH, key=mech.encode(), value=client.first())
        while r.status == Status.AUTH_CONTINUE:
            r = self.call(Op.SASL_STEP, key=mech.encode(), value=client.step(r.value))
        if r.status == Status.AUTH_ERROR:
            raise TargetAuthError(f"{self.host}:{self.port} refused the credentials of user {user!r} "
                                  f"({mech}: AUTH_ERROR)")
        if not r.ok:
            raise TargetAuthError(f"{self.host}:{self.port}: SASL {mech} failed: {r.status_name()}")
        if r.value and mech != "PLAIN":
            client.verify(r.value)
        self.authenticated_as = user

    # ------------------------------------------------------------------------------------------ requests
    def cluster_config(self) -> dict[str, Any] | None:
        """GET_CLUSTER_CONFIG's JSON (None: the server has no cluster config, e.g. a bare node process)."""
        r = self.call(Op.GET_CLUSTER_CONFIG)
        if r.status in _ABSENT or r.status in (Status.KEY_ENOENT, Status.NO_BUCKET):
            return None
        if not r.ok:
            raise KvError(f"GET_CLUSTER_CONFIG: {r.status_name()}", r.status)
        try:
            out = json.loads(r.value.replace(b"$HOST", self.host.encode()))
        except ValueError as e:
            raise KvError(f"GET_CLUSTER_CONFIG answered non-JSON: {e}", r.status) from e
        return out if isinstance(out, dict) else None

    def call(self, op: int, **kw: Any) -> Response:
        return self.pipeline([(op, kw)])[0]

    def pipeline(self, requests: Sequence[tuple[int, dict[str, Any]]]) -> list[Response]:
        """Send every request, then read their answers (matched by opaque, in order)."""
        first = next(self._opaque)
        for _ in range(len(requests) - 1):
            next(self._opaque)
        data = b"".join(encode_request(op, opaque=(first + i) & 0xFFFFFFFF, **kw)
                        for i, (op, kw) in enumerate(requests))
        try:
            self.sock.sendall(data)
            out: list[Response] = []
            while len(out) < len(requests):
                r = self._read()
                if r.magic == SERVER_REQ_MAGIC:
                    continue  # a clustermap-change notification: the config is refreshed on NOT_MY_VBUCKET
                if r.opaque != (first + len(out)) & 0xFFFFFFFF:
                    raise TargetUnreachable(f"{self.host}:{self.port}: answer out of order (opaque {r.opaque})")
                out.append(r)
            return out
        except (OSError, ValueError) as e:
            self.close()
            raise TargetUnreachable(f"connection to {self.host}:{self.port} lost: {e}") from e

    def _read(self) -> Response:
        header = self._rfile.read(HEADER_LEN)
        if len(header) < HEADER_LEN:
            raise ConnectionError("closed by the server")
        body_len = HEADER.unpack(header)[6]
        body = self._rfile.read(body_len) if body_len else b""
        if len(body) < body_len:
            raise ConnectionError("closed by the server mid-answer")
        return response_from(header, body)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._rfile.close()
        with contextlib.suppress(OSError):
            self.sock.close()
