"""A KV port on a background event loop (its own thread owns the bucket) and a raw-socket client that speaks
just enough of the protocol to test it: HELLO, an RFC 5802 SCRAM client, SELECT_BUCKET, any frame."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import shutil
import socket
import ssl
import struct
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from engine.bucket import Bucket
from engine.config import BucketConfig
from engine.kv.vbucket import vbucket_of
from engine.network.kv.cluster_config import SingleNodeConfig
from engine.network.kv.features import Feature
from engine.network.kv.frontend import KVServer
from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.protocol import HEADER_LEN, Frame, decode_frame, parse_header, request
from engine.security.roles import Role
from engine.security.users import USERS_FILE, UserStore

T = TypeVar("T")
PASSWORD = "kv-port-secret"
#: user name -> roles every test server has
USERS: dict[str, list[Role]] = {
    "app": [Role.DATA_READER, Role.DATA_WRITER],
    "reader": [Role.DATA_READER],
    "writer": [Role.DATA_WRITER],
    "dcp": [Role.DCP_READER],
    "xdcr": [Role.REPLICATION_TARGET],
    "admin": [Role.ADMIN],
}
ALL_FEATURES = [Feature.TCP_NODELAY, Feature.MUTATION_SEQNO, Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON,
                Feature.ALT_REQUEST_SUPPORT, Feature.SYNC_REPLICATION, Feature.DUPLEX,
                Feature.CLUSTERMAP_CHANGE_NOTIFICATION]


_TEMPLATE: list[Path] = []


def _users_template() -> Path:
    """A users file with :data:`USERS`, made once per test session (each user costs a slow scrypt hash)."""
    if not _TEMPLATE:
        d = Path(tempfile.mkdtemp(prefix="kv-users-"))
        store = UserStore.open(d)
        for name, roles in USERS.items():
            store.add(name, PASSWORD, roles)
        _TEMPLATE.append(d)
    return _TEMPLATE[0]


class KVNode:
    """A bucket + user store + KV port served by an event loop on a thread of its own."""

    def __init__(self, data_dir: Path, *, num_vbuckets: int = 16, ssl_context: ssl.SSLContext | None = None,
                 **bucket: Any) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        if not (data_dir / USERS_FILE).exists():
            shutil.copy2(_users_template() / USERS_FILE, data_dir / USERS_FILE)  # keeps mode 0600
        self.users = UserStore.open(data_dir)
        self.bucket = Bucket(BucketConfig(data_dir=data_dir, num_vbuckets=num_vbuckets, **bucket))
        self.loop = asyncio.new_event_loop()
        self.server: KVServer | None = None
        ready = threading.Event()
        port = [0]

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            provider = SingleNodeConfig(lambda: self.bucket, "default", lambda: port[0],
                                        tls=ssl_context is not None)
            self.server = KVServer(provider, self.users, port=0, ssl_context=ssl_context)
            port[0] = self.loop.run_until_complete(self.server.start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True, name="kv-node")
        self.thread.start()
        if not ready.wait(10):
            raise RuntimeError("the KV node did not start")
        self.port = port[0]

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop's thread (the bucket's owner) and return its result."""
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(run)
        return fut.result(10)

    def close(self) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.call(lambda: self.bucket.close(clean=True))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class RawClient:
    """A blocking memcached-binary-protocol client over one socket."""

    def __init__(self, port: int, *, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None,
                 timeout: float = 10.0, nvb: int = 16) -> None:
        self.nvb = nvb
        s = socket.create_connection((host, port), timeout=timeout)
        self.sock: socket.socket = tls.wrap_socket(s, server_hostname=host) if tls is not None else s
        self.opaque = 0
        self.features: list[int] = []

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed by the server")
            buf += chunk
        return buf

    def recv(self) -> Frame:
        header = self._exact(HEADER_LEN)
        h = parse_header(header)
        return decode_frame(header + self._exact(h[6]))

    def closed_by_server(self) -> bool:
        """True when the server closed the connection (EOF) within the socket timeout."""
        try:
            return self.sock.recv(1) == b""
        except (ConnectionError, OSError):
            return True

    def call(self, opcode: int, **kw: Any) -> Frame:
        self.opaque += 1
        self.send(request(opcode, opaque=self.opaque, **kw))
        f = self.recv()
        assert f.opaque == self.opaque, (f, self.opaque)
        return f

    def doc(self, opcode: int, key: bytes, **kw: Any) -> Frame:
        """A document request with the key's vbucket (as an SDK computes it from the map)."""
        return self.call(opcode, key=key, vbucket=vbucket_of(key, self.nvb), **kw)

    def hello(self, features: list[int] | None = None) -> list[int]:
        want = ALL_FEATURES if features is None else features
        f = self.call(Op.HELLO, key=b'{"a":"raw-test"}', value=b"".join(struct.pack(">H", x) for x in want))
        assert f.status == 0, f
        self.features = [x for (x,) in struct.iter_unpack(">H", f.value)]
        return self.features

    def scram(self, user: str, password: str, mechanism: str = "SCRAM-SHA512") -> Frame:
        """A whole SCRAM exchange; the last answer (SUCCESS after SASL_STEP, or the error)."""
        h = {"SCRAM-SHA512": "sha512", "SCRAM-SHA256": "sha256", "SCRAM-SHA1": "sha1"}[mechanism]
        cnonce = base64.b64encode(os.urandom(18)).decode()
        first_bare = f"n={user.replace('=', '=3D').replace(',', '=2C')},r={cnonce}"
        f = self.call(Op.SASL_AUTH, key=mechanism.encode(), value=f"n,,{first_bare}".encode())
        if f.status != 0x21:
            return f
        server_first = f.value.decode()
        a = dict(p.split("=", 1) for p in server_first.split(","))
        salted = hashlib.pbkdf2_hmac(h, password.encode(), base64.b64decode(a["s"]), int(a["i"]))
        client_key = hmac.new(salted, b"Client Key", h).digest()
        stored = hashlib.new(h, client_key).digest()
        without_proof = f"c=biws,r={a['r']}"
        auth_message = f"{first_bare},{server_first},{without_proof}".encode()
        sig = hmac.new(stored, auth_message, h).digest()
        proof = bytes(x ^ y for x, y in zip(client_key, sig, strict=True))
        f = self.call(Op.SASL_STEP, key=mechanism.encode(),
                      value=f"{without_proof},p={base64.b64encode(proof).decode()}".encode())
        if f.status == 0:
            server_key = hmac.new(salted, b"Server Key", h).digest()
            expect = base64.b64encode(hmac.new(server_key, auth_message, h).digest()).decode()
            assert f.value.decode() == f"v={expect}", "server signature"
        return f

    def login(self, user: str = "app", password: str = PASSWORD, bucket: str = "default",
              features: list[int] | None = None) -> RawClient:
        self.hello(features)
        f = self.scram(user, password)
        assert f.status == 0, f
        if bucket:
            f = self.call(Op.SELECT_BUCKET, key=bucket.encode())
            assert f.status == 0, f
        return self
