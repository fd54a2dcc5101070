"""The KV port's listener: memcached binary protocol connections on the embedder's event loop
(docs/kv-protocol.md).

Every engine call runs on the loop's thread, inline (the engine is synchronous and each call is short); a sync
write waits in a coroutine (``WriteHooks.completed``) so other connections keep being served; PLAIN's password
check (scrypt, slow on purpose) runs on a worker thread. Requests of one connection are answered in order (no
UNORDERED_EXECUTION), as kv_engine does without that feature.

Per request: the opcode must be known (UNKNOWN_COMMAND, connection kept), the connection authenticated unless
the opcode is allowed before (EACCESS), a bucket selected for document opcodes (NO_BUCKET), and one of the roles
engine/network/kv/access.py lists for the opcode held (EACCESS). A header that cannot be framed (bad magic, a
body above the protocol maximum, lengths that do not add up) closes the connection: the stream cannot be
resynchronised (kv_engine closes it too). A truncated packet is one the peer never finished: nothing of it is
executed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
from collections.abc import Callable
from typing import Final

import orjson

from engine.bucket import Bucket
from engine.exceptions import (
    AccessDenied,
    AuthenticationFailed,
    DocumentLocked,
    EngineError,
    NotLocked,
    NotMyVBucket,
    Status,
    SyncWriteAmbiguous,
    SyncWriteInProgress,
    SyncWriteReCommitInProgress,
)
from engine.kv.durability import Level, SyncWrite
from engine.kv.vbucket import MutationResult
from engine.network.kv import access
from engine.network.kv.cluster_config import ClusterConfigProvider
from engine.network.kv.documents import DURABLE, DocumentOps, WriteHooks
from engine.network.kv.error_map import error_map_response_body
from engine.network.kv.features import encode_features, negotiate, parse_hello
from engine.network.kv.opcodes import CLUSTERMAP_CHANGE_NOTIFICATION, SERVER_REQ_MAGIC, KVStatus
from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.sasl import PLAIN, ScramServer, UserDirectory, mechanisms, parse_plain
from engine.network.kv.session import Session
from engine.network.protocol import (
    HEADER,
    HEADER_LEN,
    TOKEN_EXTRAS,
    U64,
    Frame,
    ProtocolError,
    frame_from,
    parse_header,
    response,
)
from engine.network.with_meta import answer as with_meta_answer

log = logging.getLogger(__name__)

_KNOWN: Final = frozenset(int(o) for o in Op)
#: bytes read from a connection at a time (every whole frame in them is answered before the next read)
READ_CHUNK: Final = 256 * 1024
_JSON: Final = 0x01


class StandaloneHooks:
    """Write hooks for a KV server on its own (tests, an embedder without a publisher): no backpressure; a sync
    write makes progress by flushing (persist levels) and by the bucket's durability timeouts."""

    def admit_write(self) -> None:
        return None

    def wrote(self, res: MutationResult, nbytes: int) -> None:
        return None

    async def completed(self, bucket: Bucket, sw: SyncWrite) -> MutationResult:
        while not sw.done:
            if bucket.closed:
                raise SyncWriteAmbiguous(f"sync write of {sw.key!r}: the bucket closed before it completed")
            if sw.level is not Level.MAJORITY and bucket.dirty_vbuckets:
                bucket.flush_all()
            bucket.process_durability_timeouts()
            if not sw.done:
                await asyncio.sleep(0.001)
        return sw.result()


class _Conn:
    def __init__(self, session: Session, writer: asyncio.StreamWriter) -> None:
        self.session = session
        self.writer = writer


class KVServer:
    """One node's KV port."""

    def __init__(
        self, provider: ClusterConfigProvider, users: UserDirectory, *, host: str = "127.0.0.1", port: int = 11210,
        ssl_context: ssl.SSLContext | None = None, hooks: WriteHooks | None = None,
        random_bytes: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        self.provider = provider
        self.users = users
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self.hooks: WriteHooks = hooks if hooks is not None else StandaloneHooks()
        self.documents = DocumentOps(provider, self.hooks)
        # the XDCR target's writes with meta (engine/network/with_meta.py, docs/xdcr.md "Target side"); the role
        # each needs is engine/network/kv/access.py's (replication_target)
        for op in (Op.SET_WITH_META, Op.ADD_WITH_META, Op.DEL_WITH_META):
            self.documents.register(op, self._with_meta)
        self.random_bytes = random_bytes
        self._fake_secret = random_bytes(32)
        self._server: asyncio.Server | None = None
        self.conns: set[_Conn] = set()
        #: connections closed because of an unframeable header (kv_engine counts these too)
        self.bad_frames = 0

    @property
    def tls(self) -> bool:
        return self.ssl_context is not None

    async def start(self) -> int:
        """Listen; returns the port (the chosen one for port 0)."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port, ssl=self.ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.conns):
            with contextlib.suppress(Exception):
                c.writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self._server = None

    def notify_config_change(self) -> None:
        """Push the bucket's new config to the connections that asked for it (HELLO DUPLEX +
        CLUSTERMAP_CHANGE_NOTIFICATION): a server request, kv_engine ``ClustermapChangeNotification`` (extras:
        the revision, u32; key: the bucket name; value: the config)."""
        for c in list(self.conns):
            s = c.session
            if not s.duplex_notifications or s.bucket is None:
                continue
            value = orjson.dumps(self.provider.config(s.host, bucket=True))
            key = s.bucket.encode()
            extras = (self.provider.rev & 0xFFFFFFFF).to_bytes(4, "big")
            body = extras + key + value
            c.writer.write(HEADER.pack(SERVER_REQ_MAGIC, CLUSTERMAP_CHANGE_NOTIFICATION, len(key), len(extras),
                                       _JSON if s.json else 0, 0, len(body), 0, 0) + body)

    async def _with_meta(self, s: Session, f: Frame) -> bytes:
        self.hooks.admit_write()
        out = with_meta_answer(self.provider.bucket_for(f.vbucket), f)
        if out[6:8] == b"\x00\x00" and out[4] == TOKEN_EXTRAS.size:  # SUCCESS with the mutation token
            vbuuid, seqno = TOKEN_EXTRAS.unpack_from(out, HEADER_LEN)
            cas = U64.unpack_from(out, 16)[0]
            self.hooks.wrote(MutationResult(f.vbucket, vbuuid, seqno, cas), len(f.value))
        return out

    # ------------------------------------------------------------------ connections
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("sockname")
        peer = writer.get_extra_info("peername")
        session = Session(host=str(sock[0]) if sock else self.host, tls=self.tls,
                          peer=f"{peer[0]}:{peer[1]}" if peer else "")
        conn = _Conn(session, writer)
        self.conns.add(conn)
        buf = bytearray()
        try:
            while True:
                data = await reader.read(READ_CHUNK)
                if not data:
                    break  # hang-up: a truncated packet left in the buffer is never executed
                buf += data
                out: list[bytes] = []
                pos = 0
                closing = False
                # every whole frame received so far, answered in order, the answers written together
                while len(buf) - pos >= HEADER_LEN:
                    try:
                        h = parse_header(bytes(buf[pos:pos + HEADER_LEN]))
                    except ProtocolError as e:
                        self.bad_frames += 1
                        log.info("kv %s: closing the connection: %s", session.peer, e)
                        closing = True
                        break
                    end = pos + HEADER_LEN + h[6]
                    if len(buf) < end:
                        break
                    f = frame_from(h, bytes(buf[pos + HEADER_LEN:end]))
                    pos = end
                    if not f.is_request:
                        continue  # a client's answer to a server request (DUPLEX)
                    res = await self._dispatch(session, f)
                    if res:
                        out.append(res)
                del buf[:pos]
                if out:
                    writer.write(b"".join(out))
                    await writer.drain()
                if closing:
                    break
        except (ConnectionError, ssl.SSLError, asyncio.CancelledError):
            pass  # hang-up, or shutting down
        finally:
            self.conns.discard(conn)
            with contextlib.suppress(Exception):
                writer.close()

    async def _dispatch(self, s: Session, f: Frame) -> bytes:
        try:
            return await self._execute(s, f)
        except NotMyVBucket as e:
            if s.bucket is None:
                return self._error(s, f, e)
            cfg = orjson.dumps(self.provider.config(s.host, bucket=True))
            return response(f.opcode, Status.NOT_MY_VBUCKET, value=cfg, datatype=_JSON if s.json else 0,
                            opaque=f.opaque)
        except EngineError as e:
            return self._error(s, f, e)
        except Exception as e:  # a bug must not take the port down: EINTERNAL, as memcached answers
            log.exception("kv opcode 0x%02x failed", f.opcode)
            return self._status(s, f, KVStatus.EINTERNAL, f"internal error: {type(e).__name__}")

    def _status(self, s: Session, f: Frame, status: int, message: str) -> bytes:
        if s.xerror and message:
            return response(f.opcode, status, value=orjson.dumps({"error": {"context": message}}),
                            datatype=_JSON if s.json else 0, opaque=f.opaque)
        return response(f.opcode, status, opaque=f.opaque)

    def _error(self, s: Session, f: Frame, e: EngineError) -> bytes:
        status = int(e.status)
        if not s.xerror:
            # kv_engine remaps the statuses a client without XERROR does not know
            if isinstance(e, DocumentLocked):
                status = KVStatus.TMPFAIL if f.opcode in (Op.GET_LOCKED, Op.UNLOCK_KEY) else KVStatus.KEY_EEXISTS
            elif isinstance(e, NotLocked | SyncWriteInProgress | SyncWriteReCommitInProgress):
                status = KVStatus.TMPFAIL
        return self._status(s, f, status, str(e))

    async def _execute(self, s: Session, f: Frame) -> bytes:
        op = f.opcode
        handler = self.documents.handler(op)
        if handler is not None and s.bucket is not None and s.user is not None:
            # the document path of an authenticated connection with a bucket: one role check, then the op
            if not s.may(op, self.users):
                raise AccessDenied(f"the user's roles do not allow opcode 0x{op:02x}")
            if f.framing and op not in DURABLE:
                raise ProtocolError(f"opcode 0x{op:02x} takes no framing extras")
            return await handler(s, f)
        if op not in _KNOWN and not self.documents.handles(op):
            return self._status(s, f, KVStatus.UNKNOWN_COMMAND, f"unknown opcode 0x{op:02x}")
        if op not in access.BEFORE_AUTH:
            if s.user is None:
                raise AccessDenied("authenticate first (SASL_AUTH)")
            if not s.may(op, self.users):
                raise AccessDenied(f"the user's roles do not allow opcode 0x{op:02x}")
        if op == Op.NOOP:
            return response(op, opaque=f.opaque)
        if op == Op.HELLO:
            return self._hello(s, f)
        if op == Op.GET_ERROR_MAP:
            return response(op, value=error_map_response_body(f.value), datatype=_JSON if s.json else 0,
                            opaque=f.opaque)
        if op == Op.SASL_LIST_MECHS:
            return response(op, value=" ".join(mechanisms(s.tls)).encode(), opaque=f.opaque)
        if op in (Op.SASL_AUTH, Op.SASL_STEP):
            return await self._sasl(s, f)
        if op == Op.SELECT_BUCKET:
            return self._select_bucket(s, f)
        if op == Op.GET_CLUSTER_CONFIG:
            cfg = self.provider.config(s.host, bucket=s.bucket is not None)
            return response(op, value=orjson.dumps(cfg), datatype=_JSON if s.json else 0, opaque=f.opaque)
        if op in access.NEEDS_BUCKET and s.bucket is None:
            return self._status(s, f, KVStatus.NO_BUCKET, "select a bucket first (SELECT_BUCKET)")
        if self.documents.handles(op):
            return await self.documents.execute(s, f)
        return self._status(s, f, KVStatus.NOT_SUPPORTED, f"opcode 0x{op:02x} is not supported by this port")

    # ------------------------------------------------------------------ handshake
    def _hello(self, s: Session, f: Frame) -> bytes:
        if f.extras:
            raise ProtocolError("HELLO takes no extras")
        enabled = negotiate(parse_hello(f.value))
        s.set_features(enabled)
        s.agent = f.key.decode("utf-8", "replace")[:250]
        return response(f.opcode, value=encode_features(enabled), opaque=f.opaque)

    def _select_bucket(self, s: Session, f: Frame) -> bytes:
        if f.key.decode("utf-8", "replace") != self.provider.bucket_name:
            # kv_engine answers EACCESS for a bucket that does not exist (it does not say which exist)
            s.bucket = None
            raise AccessDenied("no such bucket, or no access to it")
        s.bucket = self.provider.bucket_name
        return response(f.opcode, opaque=f.opaque)

    async def _sasl(self, s: Session, f: Frame) -> bytes:
        mech = f.key.decode("utf-8", "replace")
        try:
            if f.opcode == Op.SASL_AUTH:
                s.user = None  # a new authentication replaces the connection's identity
                s.bucket = None
                if mech == PLAIN and s.tls:
                    name, password = parse_plain(f.value)
                    loop = asyncio.get_running_loop()
                    user = await loop.run_in_executor(None, self.users.authenticate, name, password)
                    s.authenticated(user)
                    return response(f.opcode, opaque=f.opaque)
                if mech not in mechanisms(s.tls):
                    raise AuthenticationFailed(f"mechanism {mech[:40]!r} is not offered")
                s.scram = ScramServer(mech, self.users, self.random_bytes, self._fake_secret)
                first = s.scram.first(f.value)
                return response(f.opcode, KVStatus.AUTH_CONTINUE, value=first, opaque=f.opaque)
            scram = s.scram
            if scram is None or scram.mechanism != mech:
                raise AuthenticationFailed("SASL_STEP without a SASL_AUTH of that mechanism")
            user, final = scram.final(f.value)
            s.authenticated(user)
            return response(f.opcode, value=final, opaque=f.opaque)
        except AuthenticationFailed:
            s.scram = None
            log.info("kv %s: authentication failed", s.peer)
            return self._status(s, f, KVStatus.AUTH_ERROR, "authentication failed")

