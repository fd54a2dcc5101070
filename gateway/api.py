"""The gateway's HTTP API (aiohttp).

Documents: ``GET/PUT/DELETE /docs/{key}`` (the body is the document; CAS travels as the ETag, ``If-Match`` makes
a write conditional, ``If-None-Match: *`` makes a PUT an insert, ``?expiry=`` and ``?flags=`` set metadata;
``?durability=majority|majority_and_persist_to_active|persist_to_majority[&timeout_ms=N]`` makes it a sync write
answered once committed -- docs/durability.md),
``POST /docs/_bulk`` (a JSON array of ``{"key", "value", "op"?, "cas"?, "expiry"?, "flags"?}`` entries, used by
``dcpgw load``: all validated before the first write, then answered per item -- docs/gateway.md).
Streams: ``GET /streams``, ``GET /vbuckets/{vb}``, ``GET /vbuckets/{vb}/failover-log``.
Operations: ``GET /health`` (= ``GET /health/ready``: 200 or 503 with ``{"status", "reasons"}``),
``GET /health/live``, ``GET /metrics``, ``GET /stats``. Writes answer 503 with ``Retry-After`` while more than
``max_unacked_bytes`` of accepted writes wait for Kafka (docs/reliability.md "Stalled broker and health").
Cluster (``dcpgw up --nodes N``): ``GET /cluster``, ``GET /cluster/map``, ``POST /cluster/failover``
(``{"node": "n1", "graceful": false}``; answers the failover report), ``POST /cluster/rebalance``
(``{"add": ["n3"], "remove": ["n1"]}``; starts it, answers 202 with its progress) and ``GET /cluster/rebalance``
(progress of the running or last rebalance), ``POST /cluster/recover`` (``{"node": "n1", "mode": "delta"}``;
answers the recovery report). ``GET /openapi.json``: the OpenAPI document (gateway/openapi.py).

Authentication (Basic or bearer token) and the role each route needs: gateway/auth.py, docs/security.md;
``/auth/token`` and ``/users``: gateway/auth_api.py.

Every error is a JSON body ``{"error": <code>, "message": <text>}`` with a 4xx status (5xx only for server
faults), mapped from the engine's typed exceptions -- aiohttp's own errors included (:class:`JsonAppRunner`).
Inputs are bounded before any work (docs/gateway.md "Limits").
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from engine import Bucket, Datatype
from engine.cluster.local import Cluster, FailoverReport
from engine.exceptions import (
    DurabilityImpossible,
    DurabilityInvalidLevel,
    EngineError,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    NotMyVBucket,
    NotStored,
    SyncWriteAmbiguous,
    SyncWriteInProgress,
    TemporaryFailure,
    ValueTooLarge,
)
from engine.kv.conflict_resolution import ConflictCounters
from engine.kv.durability import Durability, Level, SyncWrite, parse_level
from gateway.auth import auth_middleware
from gateway.auth import install as install_auth
from gateway.exceptions import Backpressure
from gateway.source import cluster_summary

if TYPE_CHECKING:
    from gateway.service import GatewayService

log = logging.getLogger(__name__)

SERVICE: web.AppKey[GatewayService] = web.AppKey("service")
MAX_BODY = 64 * 1024 * 1024
#: body limit of the admin routes (``/cluster/...``): their bodies are a few node names (docs/gateway.md "Limits")
MAX_ADMIN_BODY = 64 * 1024
#: the largest cluster the gateway runs in process (nodes in the map after a rebalance; docs/gateway.md "Limits")
MAX_CLUSTER_NODES = 64
#: nodes one rebalance may add (each is a new engine with its own data directory)
MAX_NODES_PER_REBALANCE = 8
#: a node name: what ClusterManager accepts (engine/cluster/manager.py ``_check_new_node``)
NODE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

_STATUS_FOR: list[tuple[type[EngineError], int, str]] = [
    # synchronous replication (docs/durability.md "HTTP API"): a bad level is the client's fault; the
    # others are the server's state -- impossible / ambiguous are not client errors
    (DurabilityInvalidLevel, 400, "durability_invalid_level"),
    (DurabilityImpossible, 503, "durability_impossible"),
    (SyncWriteInProgress, 409, "sync_write_in_progress"),
    (SyncWriteAmbiguous, 504, "sync_write_ambiguous"),
    (KeyNotFound, 404, "not_found"),
    (KeyExists, 412, "cas_mismatch"),
    (NotStored, 404, "not_found"),
    (ValueTooLarge, 413, "value_too_large"),
    (InvalidArgument, 400, "invalid_argument"),
    (NotMyVBucket, 404, "not_my_vbucket"),
    (TemporaryFailure, 503, "temporary_failure"),
]


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def _json_error(status: int, code: str, message: str) -> web.Response:
    headers = {"Retry-After": "1"} if status == 503 else None
    return web.json_response({"error": code, "message": message}, status=status, headers=headers)


#: how long a document request waits for a vbucket on the move (docs/cluster.md "HTTP API during a rebalance")
VBUCKET_MOVE_WAIT_S = 2.0


async def _routed(
    svc: GatewayService, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Run ``handler``; in cluster mode a document request that met NOT_MY_VBUCKET (its vbucket is being
    taken over: dead on the old active before the map names the new one) is retried, as a smart client
    retries with the next map, for up to :data:`VBUCKET_MOVE_WAIT_S`, then answered 503 with Retry-After.
    Safe to repeat: NOT_MY_VBUCKET is raised by the routing, before the engine accepts anything."""
    if svc.cluster is None or not request.path.startswith("/docs/"):
        return await handler(request)
    deadline = asyncio.get_running_loop().time() + VBUCKET_MOVE_WAIT_S
    while True:
        try:
            return await handler(request)
        except NotMyVBucket as e:
            if asyncio.get_running_loop().time() >= deadline:
                raise ApiError(503, "vbucket_moving", f"{e}; the vbucket map is changing, retry") from None
            await asyncio.sleep(0.01)


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    svc = request.app[SERVICE]
    try:
        return await _routed(svc, request, handler)
    except ApiError as e:
        svc.metrics.http_errors.labels(str(e.status)).inc()
        resp = _json_error(e.status, e.code, e.message)
        if e.code == "request_entity_too_large":
            resp.force_close()  # the rest of the body is not read: close instead of draining it
        return resp
    except Backpressure as e:
        svc.metrics.http_errors.labels("503").inc()
        return _json_error(503, "backpressure", str(e))
    except EngineError as e:
        for cls, status, code in _STATUS_FOR:
            if isinstance(e, cls):
                if isinstance(e, KeyExists) and request.method == "PUT" and request.headers.get(
                        "If-None-Match") == "*":
                    status, code = 412, "exists"
                svc.metrics.http_errors.labels(str(status)).inc()
                return _json_error(status, code, str(e))
        svc.metrics.http_errors.labels("500").inc()
        return _json_error(500, "engine_error", str(e))
    except web.HTTPException as e:
        if e.status >= 400:
            svc.metrics.http_errors.labels(str(e.status)).inc()
            text = e.text or e.reason
            if text.startswith(f"{e.status}: "):  # aiohttp's default body repeats the status line
                text = text[len(f"{e.status}: "):]
            resp = _json_error(e.status, e.reason.lower().replace(" ", "_"), text)
            if "WWW-Authenticate" in e.headers:  # 401 (gateway/auth.py)
                resp.headers["WWW-Authenticate"] = e.headers["WWW-Authenticate"]
            return resp
        raise
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # a server fault: still a JSON body, logged with its traceback
        log.exception("%s %s failed", request.method, request.path)
        svc.metrics.http_errors.labels("500").inc()
        return _json_error(500, "internal_error", f"{type(e).__name__}: {e}")


class JsonRequestHandler(RequestHandler):
    """aiohttp's connection handler with JSON error bodies: a request aiohttp's HTTP parser refuses (bad request
    line, a header too large, a malformed chunk) never reaches the middleware; aiohttp answers it from
    :meth:`handle_error`, in text -- here ``{"error", "message"}`` like every other error (docs/gateway.md)."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            self.log_debug("Bad request from %s: %s", request.remote, exc)
        if request.writer.output_size > 0:  # part of a response was sent: the connection is broken
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        code = "internal_error" if status >= 500 else phrase.lower().replace(" ", "_")
        text = message or (str(exc) if exc is not None else phrase)
        resp = _json_error(status, code, text or phrase)
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JsonRequestHandler(self, loop=self._loop, **self._kwargs)


class JsonAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer aiohttp's own parser errors in JSON (:class:`JsonRequestHandler`)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # same state, only the connection-handler factory differs
        return server


async def _read_json(request: web.Request, limit: int, what: str, empty: Any = None) -> Any:
    """The request body parsed as JSON, ``limit`` bytes at most (413 ``request_entity_too_large`` beyond,
    without reading the rest). 400 ``invalid_json`` for bad JSON, invalid UTF-8 or nesting beyond the parser's
    recursion limit (the C parser raises RecursionError instead of overflowing the stack)."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "request_entity_too_large",
                       f"body of {request.content_length} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.read(65536)
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "request_entity_too_large", f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if empty is not None and not raw.strip():
        return empty
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "invalid_json", f"body must be a JSON {what}: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_json", f"body must be a JSON {what}: {e}") from None


def _svc(request: web.Request) -> GatewayService:
    return request.app[SERVICE]


def _int_param(request: web.Request, name: str, default: int = 0, lo: int = 0, hi: int = 2**32 - 1) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ApiError(400, "invalid_argument", f"query parameter {name!r} must be an integer, got {raw!r}") from None
    if not lo <= v <= hi:
        raise ApiError(400, "invalid_argument", f"query parameter {name!r} must be in [{lo}, {hi}], got {v}")
    return v


def _cas_header(request: web.Request) -> int:
    raw = request.headers.get("If-Match")
    if raw is None:
        return 0
    raw = raw.strip().strip('"')
    try:
        cas = int(raw)
    except ValueError:
        raise ApiError(400, "invalid_argument", f"If-Match must be a document CAS (an integer), got {raw!r}") from None
    if cas <= 0 or cas >= 2**64:
        raise ApiError(400, "invalid_argument", f"If-Match CAS out of range: {cas}")
    return cas


_DOCS_PATH = "/docs/"
_BUCKETS_PATH = "/buckets/"


def _key(request: web.Request) -> bytes:
    """The document key of ``/docs/{key}``: the *raw* path segment percent-decoded to bytes, which must be
    UTF-8 (docs/gateway.md, "Keys"). aiohttp's ``match_info`` cannot be used: it leaves an undecodable
    sequence such as ``%FF`` as the literal text ``%FF``, which would alias the key ``%FF`` (``/docs/%25FF``)."""
    raw = request.rel_url.raw_path
    if raw.startswith(_BUCKETS_PATH):  # /buckets/{bucket}/docs/{key} (issue 3's spelling of the same route)
        raw = raw[raw.index("/", len(_BUCKETS_PATH)):]
    if raw.startswith(_DOCS_PATH):
        key = urllib.parse.unquote_to_bytes(raw[len(_DOCS_PATH):])
    else:
        key = request.match_info["key"].encode()
    try:
        key.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, "invalid_argument", f"key is not UTF-8 after percent-decoding (byte "
                       f"0x{key[e.start]:02x} at offset {e.start}): keys are UTF-8 strings of 1..250 bytes") from None
    if not key or len(key) > 250:
        raise ApiError(400, "invalid_argument", f"key length {len(key)} out of range 1..250")
    return key


def _vb(request: web.Request) -> int:
    raw = request.match_info["vb"]
    try:
        vb = int(raw)
    except ValueError:
        raise ApiError(400, "invalid_argument", f"vbucket must be an integer, got {raw!r}") from None
    n = _svc(request).settings.num_vbuckets
    if not 0 <= vb < n:
        raise ApiError(404, "not_found", f"vbucket {vb} does not exist (0..{n - 1})")
    return vb


def _bucket(svc: GatewayService, key: bytes) -> Bucket:
    """The bucket that serves ``key``: the single bucket, or the key's active node per the vbucket map
    (NOT_MY_VBUCKET -> 404, node down -> 503, as a smart client routing by the map would see)."""
    c = svc.cluster
    if c is None:
        assert svc.bucket is not None
        return svc.bucket
    return c.active_bucket(c.vbucket_of(key))


def _mutation(res: Any) -> dict[str, Any]:
    # "token": the mutation token of the write, for at_plus queries of the search indexer (docs/search.md)
    return {"vbucket": res.vbucket, "vbuuid": res.vbuuid, "seqno": res.seqno, "cas": res.cas,
            "token": {"vbucket": res.vbucket, "vbuuid": res.vbuuid, "seqno": res.seqno}}


def _token_headers(res: Any) -> dict[str, str]:
    """The mutation token as headers (docs/search.md "Consistency")."""
    return {"X-DCP-Vbucket": str(res.vbucket), "X-DCP-Vbuuid": str(res.vbuuid), "X-DCP-Seqno": str(res.seqno)}


def _durability(request: web.Request) -> Durability | None:
    """``?durability=<level>[&timeout_ms=N]`` (docs/durability.md "HTTP API"): None for a plain write (no parameter or ``none``).
    A bad level: DURABILITY_INVALID_LEVEL (400); a timeout without a level or out of 0..65535: 400."""
    raw = request.query.get("durability")
    timeout = _int_param(request, "timeout_ms", 0, 0, 0xFFFF)
    if raw is None:
        if "timeout_ms" in request.query:
            raise ApiError(400, "invalid_argument", "timeout_ms needs a durability level (?durability=...)")
        return None
    level = parse_level(raw)
    if level is Level.NONE:
        return None
    return Durability(level, timeout)


async def _completed(svc: GatewayService, bucket: Bucket, sw: SyncWrite) -> Any:
    """Wait for a sync write without blocking the loop: the pump loop replicates (replica seqno-acks commit it),
    the flusher persists (persist levels), timeouts run here too. Returns the commit's result or raises
    SYNC_WRITE_AMBIGUOUS."""
    svc.wake()
    while not sw.done:
        if bucket.closed:  # the node went down (or the service stops): the outcome is unknown
            raise SyncWriteAmbiguous(f"sync write of {sw.key!r}: its node went down before it completed")
        bucket.process_durability_timeouts()
        if sw.done:
            break
        await asyncio.sleep(0.001)
        svc.wake()
    return sw.result()


# ---------------------------------------------------------------------- documents
#: the query parameters each document route reads: any other is a 400 (a misspelt ``expiri`` must not write a
#: document without its expiry), as ``_bulk`` refuses unknown entry fields
_DOC_PARAMS: Final = {"GET": frozenset(), "PUT": frozenset({"expiry", "flags", "durability", "timeout_ms"}),
                      "DELETE": frozenset({"durability", "timeout_ms"})}


def _check_params(request: web.Request) -> None:
    allowed = _DOC_PARAMS.get(request.method, frozenset())
    unknown = sorted(set(request.query) - allowed)
    if unknown:
        raise ApiError(400, "invalid_argument", f"unknown query parameter(s) {unknown} for {request.method} "
                       f"/docs/{{key}} (accepted: {sorted(allowed) or 'none'})")


async def get_doc(request: web.Request) -> web.Response:
    svc = _svc(request)
    _check_params(request)
    key = _key(request)
    b = _bucket(svc, key)
    g = b.get(key)
    ctype = "application/json" if g.datatype & Datatype.JSON else "application/octet-stream"
    return web.Response(
        body=g.value, content_type=ctype,
        headers={"ETag": f'"{g.cas}"', "X-DCP-CAS": str(g.cas), "X-DCP-Flags": str(g.flags),
                 "X-DCP-Expiry": str(g.expiry), "X-DCP-Vbucket": str(g.vbucket),
                 "X-DCP-Vbuuid": str(b.vbucket(g.vbucket).failover.vbuuid), "X-DCP-Seqno": str(g.seqno),
                 "X-DCP-Rev": str(g.rev_seqno)})


async def put_doc(request: web.Request) -> web.Response:
    svc = _svc(request)
    _check_params(request)
    key = _key(request)
    svc.admit_write()
    expiry = _int_param(request, "expiry")
    flags = _int_param(request, "flags")
    cas = _cas_header(request)
    body = await request.read()
    insert = request.headers.get("If-None-Match") == "*"
    if insert and cas:
        raise ApiError(400, "invalid_argument", "If-Match and If-None-Match: * cannot be combined")
    durability = _durability(request)
    bucket = _bucket(svc, key)
    if durability is not None:
        if svc.cluster is not None:
            svc.cluster.push_topologies()
        if insert:
            raise ApiError(400, "invalid_argument", "If-None-Match: * with durability is not supported")
        sw = bucket.set(key, body, cas=cas, flags=flags, expiry=expiry, durability=durability)
        res = await _completed(svc, bucket, sw)
    elif insert:
        res = bucket.add(key, body, flags=flags, expiry=expiry)
    elif cas:
        res = bucket.set(key, body, cas=cas, flags=flags, expiry=expiry)
    else:
        res = bucket.set(key, body, flags=flags, expiry=expiry)
    svc.note_write(res.vbucket, res.seqno, len(key) + len(body))
    svc.wake()
    return web.json_response(_mutation(res), status=201 if insert else 200,
                             headers={"ETag": f'"{res.cas}"', **_token_headers(res)})


async def delete_doc(request: web.Request) -> web.Response:
    svc = _svc(request)
    _check_params(request)
    key = _key(request)
    svc.admit_write()
    durability = _durability(request)
    bucket = _bucket(svc, key)
    if durability is not None:
        if svc.cluster is not None:
            svc.cluster.push_topologies()
        sw = bucket.delete(key, cas=_cas_header(request), durability=durability)
        res = await _completed(svc, bucket, sw)
    else:
        res = bucket.delete(key, cas=_cas_header(request))
    svc.note_write(res.vbucket, res.seqno, len(key))
    svc.wake()
    return web.json_response(_mutation(res), headers=_token_headers(res))


#: ``op`` of a ``_bulk`` entry (docs/gateway.md "POST /docs/_bulk")
BULK_OPS = ("upsert", "insert", "replace", "delete")
_BULK_FIELDS = frozenset({"key", "value", "encoding", "op", "expiry", "flags", "cas"})
_U32 = 2**32 - 1


@dataclass(frozen=True)
class _BulkItem:
    key: bytes
    value: bytes
    op: str
    expiry: int
    flags: int
    cas: int


def _bulk_int(d: dict[str, Any], field: str, i: int, hi: int) -> int:
    v = d.get(field, 0)
    if type(v) is not int or not 0 <= v <= hi:
        raise ApiError(400, "invalid_argument", f"entry {i}: {field} must be an integer in [0, {hi}], got {v!r}")
    return v


def _bulk_item(d: Any, i: int, max_value: int) -> _BulkItem:
    """One ``_bulk`` entry checked completely (everything the engine would refuse for its shape): 400 / 413 for
    the whole batch before anything is written."""
    if not isinstance(d, dict):
        raise ApiError(400, "invalid_argument", f'entry {i}: must be an object {{"key", "value", ...}}')
    unknown = sorted(set(d) - _BULK_FIELDS)
    if unknown:
        raise ApiError(400, "invalid_argument", f"entry {i}: unknown fields {unknown}")
    op = d.get("op", "upsert")
    if op not in BULK_OPS:
        raise ApiError(400, "invalid_argument", f"entry {i}: op must be one of {list(BULK_OPS)}, got {op!r}")
    k = d.get("key")
    try:
        kb = k.encode() if isinstance(k, str) else b""
    except UnicodeEncodeError:  # a lone surrogate (\ud800) has no UTF-8 form
        kb = b""
    if not 0 < len(kb) <= 250:
        raise ApiError(400, "invalid_argument", f"entry {i}: key must be a UTF-8 string of 1..250 bytes")
    expiry = _bulk_int(d, "expiry", i, _U32)
    flags = _bulk_int(d, "flags", i, _U32)
    cas = _bulk_int(d, "cas", i, 2**64 - 1)
    if op == "insert" and cas:
        raise ApiError(400, "invalid_argument", f"entry {i}: an insert cannot carry a cas")
    encoding = d.get("encoding")
    if encoding not in (None, "base64"):
        raise ApiError(400, "invalid_argument", f'entry {i}: encoding must be "base64" or absent, got {encoding!r}')
    if op == "delete":
        if "value" in d or encoding is not None or expiry or flags:
            raise ApiError(400, "invalid_argument", f"entry {i}: a delete takes only key and cas")
        return _BulkItem(kb, b"", op, 0, 0, cas)
    if "value" not in d:
        raise ApiError(400, "invalid_argument", f'entry {i}: needs "key" and "value"')
    v = d["value"]
    try:
        if encoding == "base64":
            if not isinstance(v, str):
                raise ApiError(400, "invalid_argument", f"entry {i}: base64 values must be strings")
            vb = base64.b64decode(v, validate=True)
        elif isinstance(v, str):
            vb = v.encode()
        else:
            vb = json.dumps(v, separators=(",", ":")).encode()
    except RecursionError:
        raise ApiError(400, "invalid_argument", f"entry {i}: value nested too deeply") from None
    except UnicodeEncodeError:
        raise ApiError(400, "invalid_argument", f"entry {i}: value is not valid Unicode (a lone surrogate)") from None
    except ValueError as e:
        raise ApiError(400, "invalid_argument", f"entry {i}: bad base64: {e}") from None
    if len(vb) > max_value:
        raise ApiError(413, "value_too_large",
                       f"entry {i}: value of {len(vb)} bytes exceeds the maximum of {max_value}")
    return _BulkItem(kb, vb, op, expiry, flags, cas)


def _max_value_size(svc: GatewayService) -> int:
    if svc.bucket is not None:
        return svc.bucket.config.max_value_size
    return svc.settings.engine_config().max_value_size


def _item_error(key: str, e: EngineError, op: str = "upsert") -> dict[str, Any]:
    for cls, status, code in _STATUS_FOR:
        if isinstance(e, cls):
            if isinstance(e, KeyExists) and op == "insert":
                code = "exists"
            return {"key": key, "status": status, "error": code, "message": str(e)}
    return {"key": key, "status": 500, "error": "engine_error", "message": str(e)}


def _bulk_submit(bucket: Bucket, it: _BulkItem, durability: Durability | None) -> Any:
    """Apply one validated entry: its MutationResult, or its pending SyncWrite with ``durability`` (insert /
    replace with durability are refused before the batch starts)."""
    if it.op == "delete":
        if durability is not None:
            return bucket.delete(it.key, cas=it.cas, durability=durability)
        return bucket.delete(it.key, cas=it.cas)
    if it.op == "insert":
        return bucket.add(it.key, it.value, flags=it.flags, expiry=it.expiry)
    if it.op == "replace":
        return bucket.replace(it.key, it.value, cas=it.cas, flags=it.flags, expiry=it.expiry)
    if durability is not None:
        return bucket.set(it.key, it.value, cas=it.cas, flags=it.flags, expiry=it.expiry, durability=durability)
    return bucket.set(it.key, it.value, cas=it.cas, flags=it.flags, expiry=it.expiry)


async def bulk(request: web.Request) -> web.Response:
    """``POST /docs/_bulk``: the whole batch is validated first, so a 4xx means nothing was written; then every
    entry is applied in order and answered in ``items`` (Elasticsearch ``_bulk`` style): an entry the engine
    refuses at run time (CAS mismatch, key exists / not found, node down, temporary failure) fails alone with
    its status and error code, the rest are written. docs/gateway.md "POST /docs/_bulk"."""
    svc = _svc(request)
    svc.admit_write()
    docs = await _read_json(request, MAX_BODY, "array of documents")
    if not isinstance(docs, list):
        raise ApiError(400, "invalid_argument", "body must be a JSON array of {\"key\", \"value\"} objects")
    durability = _durability(request)
    if durability is not None and any(isinstance(d, dict) and d.get("op") in ("insert", "replace") for d in docs):
        raise ApiError(400, "invalid_argument", "insert / replace with durability is not supported")
    max_value = _max_value_size(svc)
    prepared = [_bulk_item(d, i, max_value) for i, d in enumerate(docs)]
    if durability is not None and svc.cluster is not None:
        svc.cluster.push_topologies()
    items: list[dict[str, Any]] = []
    pending: list[tuple[int, Bucket, SyncWrite]] = []
    note = svc.note_write
    if svc.cluster is None and durability is None and all(
            it.op == "upsert" and not it.cas for it in prepared):
        # the ingest path (dcpgw load): plain upserts straight into the single bucket
        assert svc.bucket is not None
        bset = svc.bucket.set
        for it in prepared:
            try:
                res = bset(it.key, it.value, flags=it.flags, expiry=it.expiry)
            except EngineError as e:
                items.append(_item_error(it.key.decode(), e))
            else:
                note(res.vbucket, res.seqno, len(it.key) + len(it.value))
                items.append({"key": it.key.decode(), "status": 200, **_mutation(res)})
    else:
        for it in prepared:
            key = it.key.decode()
            try:
                bucket = _bucket(svc, it.key)
                res = _bulk_submit(bucket, it, durability)
            except EngineError as e:
                items.append(_item_error(key, e, it.op))
                continue
            if isinstance(res, SyncWrite):
                pending.append((len(items), bucket, res))
                items.append({"key": key, "status": 0})
            else:
                note(res.vbucket, res.seqno, len(it.key) + len(it.value))
                items.append({"key": key, "status": 201 if it.op == "insert" else 200, **_mutation(res)})
    svc.wake()
    for idx, bucket, sw in pending:
        key = items[idx]["key"]
        try:
            res = await _completed(svc, bucket, sw)
        except EngineError as e:
            items[idx] = _item_error(key, e)
        else:
            items[idx] = {"key": key, "status": 200, **_mutation(res)}
    failed = sum(1 for x in items if "error" in x)
    return web.json_response({"written": len(items) - failed, "failed": failed, "errors": failed > 0,
                              "items": items})


# ---------------------------------------------------------------------- streams & ops
async def streams(request: web.Request) -> web.Response:
    svc = _svc(request)
    assert svc.publisher is not None
    return web.json_response([svc.publisher.status(vb) for vb in range(svc.settings.num_vbuckets)])


async def vbucket_status(request: web.Request) -> web.Response:
    svc = _svc(request)
    assert svc.publisher is not None
    vb = _vb(request)
    body: dict[str, int | bool | str] = dict(svc.publisher.status(vb))
    body.update({f"engine_{k}": v for k, v in svc.publisher.source.vbucket_stats(vb).items() if k != "vbucket"})
    if svc.cluster is not None:
        body["active_node"] = svc.cluster.vbucket_map().active(vb) or ""
    return web.json_response(body)


async def vbuckets(request: web.Request) -> web.Response:
    """``GET /vbuckets``: every vbucket's high seqno, current vbuuid and failover log (the source positions of
    request_plus / at_plus search queries, docs/search.md "Consistency")."""
    svc = _svc(request)
    assert svc.publisher is not None
    src = svc.publisher.source
    out = []
    for vb in range(svc.settings.num_vbuckets):
        try:
            log_ = src.failover_log(vb)
            high = src.high_seqno(vb)
        except (NotMyVBucket, TemporaryFailure) as e:  # cluster: no active copy reachable right now
            out.append({"vbucket": vb, "available": False, "message": str(e)})
            continue
        out.append({"vbucket": vb, "high_seqno": high, "vbuuid": log_[0].vbuuid if log_ else 0,
                    "failover_log": [{"vbuuid": e.vbuuid, "seqno": e.seqno} for e in log_]})
    return web.json_response({"vbuckets": out})


async def failover_log(request: web.Request) -> web.Response:
    svc = _svc(request)
    assert svc.publisher is not None
    vb = _vb(request)
    return web.json_response({"vbucket": vb, "failover_log": [
        {"vbuuid": e.vbuuid, "seqno": e.seqno} for e in svc.publisher.source.failover_log(vb)]})


async def health(request: web.Request) -> web.Response:
    """``GET /health`` and ``GET /health/ready``: 200 ``{"status": "ok", "reasons": []}`` or 503
    ``{"status": "failing", "reasons": [...]}`` (docs/reliability.md "Stalled broker and health")."""
    svc = _svc(request)
    pub = svc.publisher
    status, body = svc.ready_view()
    body.update({"topic": svc.topic, "bootstrap_servers": svc.bootstrap_servers,
                 "streams": len(pub.streaming) if pub else 0})
    if svc.kv is not None:
        body["kv_port"] = svc.kv.port  # docs/kv-protocol.md
    if svc.kv_cluster is not None:  # one KV port per node (docs/kv-protocol.md "Several nodes")
        body["kv_port"] = svc.kv_cluster.first
        body["kv_ports"] = svc.kv_cluster.ports
    if svc.group is not None:  # dcpgw up --gateways K: the gateway processes publish (docs/scale-out.md)
        body["gateways"] = svc.group.status()
    if pub is not None and pub.error is not None:
        body["error"] = str(pub.error)
    if pub is not None and pub.failed_vbuckets:
        # oversize_policy=fail stopped these streams (docs/reliability.md "Large documents")
        body["failed_vbuckets"] = {str(vb): reason for vb, reason in sorted(pub.failed_vbuckets.items())}
    return web.json_response(body, status=status)


async def health_live(request: web.Request) -> web.Response:
    """``GET /health/live``: 200 while the process serves requests (restart it when this stops answering)."""
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    svc = _svc(request)
    assert svc.publisher is not None
    svc.metrics.collect_health(svc.publisher.oldest_unacked_age(), len(svc.readiness.stalled), svc.unacked.total)
    buckets = svc.buckets()
    svc.metrics.collect_conflicts(svc.settings.conflict_resolution, ConflictCounters.total(b.conflict_counters for b in buckets).as_dict())
    svc.metrics.collect_storage(sum(b.flush_failures for b in buckets),
                                sum(1 for b in buckets if b.flush_error is not None),
                                sum(b.storage.writer_starts for b in buckets))
    if svc.cluster is not None:
        rc = svc.cluster.recovery_counts
        svc.metrics.collect_recovery(rc.repaired, rc.superseded)
    return web.Response(body=svc.metrics.render(svc.publisher),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _in_bucket(handler: Any) -> Any:
    """``/buckets/{bucket}/...``: issue 3's spelling of a route (docs/gateway.md "Routes"): the gateway serves one
    bucket, any other name is 404 ``no_bucket``."""

    async def route(request: web.Request) -> web.StreamResponse:
        name, served = request.match_info["bucket"], _svc(request).settings.bucket
        if name != served:
            raise ApiError(404, "no_bucket", f"no bucket {name!r} (this gateway serves {served!r})")
        resp: web.StreamResponse = await handler(request)
        return resp

    return route


async def bucket_stats(request: web.Request) -> web.Response:
    """``GET /buckets/{bucket}/stats``: per vbucket ``high_seqno``, ``persisted_seqno``, ``published_seqno`` and
    ``vbuuid`` (issue 3), with the bucket's totals of ``GET /stats``."""
    svc = _svc(request)
    assert svc.publisher is not None
    pub = svc.publisher
    rows = []
    for vb in range(svc.settings.num_vbuckets):
        st = pub.status(vb)
        rows.append({"vbucket": vb, "high_seqno": st["engine_high_seqno"],
                     "persisted_seqno": st["engine_persisted_seqno"], "published_seqno": st["published_seqno"],
                     "acknowledged_seqno": st["acknowledged_seqno"], "vbuuid": st["vbuuid"]})
    return web.json_response({**_stats_body(svc), "bucket": svc.settings.bucket, "vbuckets": rows})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(_stats_body(_svc(request)))


def _stats_body(svc: GatewayService) -> dict[str, Any]:
    """``GET /stats``: the engine's and the publisher's totals."""
    assert svc.publisher is not None
    pub = svc.publisher
    if svc.bucket is not None:
        body: dict[str, Any] = dict(svc.bucket.stats())
    else:
        assert svc.cluster is not None
        body = {"bucket": svc.settings.bucket, "vbuckets": svc.cluster.num_vbuckets, "items": pub.source.items(),
                "checkpoint_memory": pub.source.checkpoint_memory(), "nodes": len(svc.cluster.nodes),
                "map_revision": svc.cluster.vbucket_map().revision, "restreams": pub.restreams,
                "held": pub.held, "conflict_resolution": svc.settings.conflict_resolution,
                **ConflictCounters.total(b.conflict_counters for b in svc.buckets()).as_dict()}
    body.update({
        "topic": svc.topic,
        "records_published": pub.records_sent,
        "records_acknowledged": pub.records_acked,
        "rollbacks": pub.rollbacks,
        "errors": pub.errors,
        "oversize_records": pub.oversize_records,
        "snapshots_merged": pub.snapshots_merged,
        "failed_vbuckets": sorted(pub.failed_vbuckets),
        "inflight": pub.inflight,
        "unacked_write_bytes": svc.unacked.total,
        "oldest_unacked_age_s": round(pub.oldest_unacked_age(), 3),
        "streams": len(pub.streaming),
        "lag": pub.lag()[0],
    })
    if svc.group is not None:  # dcpgw up --gateways K: the stream figures above are this process's, i.e. none
        body["gateways"] = svc.group.status()
    return body


# ---------------------------------------------------------------------- cluster
def _cluster(svc: GatewayService) -> Cluster:
    if svc.cluster is None:
        raise ApiError(404, "not_a_cluster", "the gateway runs a single bucket, not a cluster (dcpgw up --nodes N)")
    return svc.cluster


async def cluster_status(request: web.Request) -> web.Response:
    svc = _svc(request)
    c = _cluster(svc)
    assert svc.publisher is not None
    body = cluster_summary(c)
    vbmap = c.vbucket_map()
    following = svc.publisher.following()
    body["gateway"] = {
        # vbuckets whose stream reads from the node the map names active (all of them once re-streamed)
        "following_map": sum(1 for vb, n in following.items() if vbmap.active(vb) == n),
        "streaming": len(svc.publisher.streaming),
        "restreams": svc.publisher.restreams,
        "rollbacks": svc.publisher.rollbacks,
        "held": svc.publisher.held,
        "rollback_mitigation": svc.publisher.rollback_mitigation,
    }
    body["rebalance"] = None if svc.last_rebalance is None else svc.last_rebalance.progress().to_json()
    return web.json_response(body)


async def cluster_map(request: web.Request) -> web.Response:
    c = _cluster(_svc(request))
    return web.json_response(json.loads(c.vbucket_map().to_json()))


async def cluster_failover(request: web.Request) -> web.Response:
    svc = _svc(request)
    _cluster(svc)
    body = await _read_json(request, MAX_ADMIN_BODY, "object")
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_argument", 'body must be a JSON object {"node": ..., "graceful": ...}')
    unknown = sorted(set(body) - {"node", "graceful"})
    if unknown:
        raise ApiError(400, "invalid_argument", f"unknown fields {unknown}")
    node = body.get("node")
    graceful = body.get("graceful", False)
    if not isinstance(node, str) or not NODE_NAME.fullmatch(node):
        raise ApiError(400, "invalid_argument",
                       '"node" must be a node name (1..64 of letters, digits, "_", ".", "-")')
    if not isinstance(graceful, bool):
        raise ApiError(400, "invalid_argument", '"graceful" must be true or false')
    report = svc.failover(node, graceful)
    return web.json_response(failover_report_json(report))


async def cluster_recover(request: web.Request) -> web.Response:
    """``POST /cluster/recover`` {"node", "mode": "delta"|"full"}: the recovery report (docs/cluster.md "Delta recovery")."""
    svc = _svc(request)
    _cluster(svc)
    body = await _read_json(request, MAX_ADMIN_BODY, "object")
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_argument", 'body must be a JSON object {"node": ..., "mode": "delta"|"full"}')
    unknown = sorted(set(body) - {"node", "mode"})
    if unknown:
        raise ApiError(400, "invalid_argument", f"unknown fields {unknown}")
    node = body.get("node")
    mode = body.get("mode", "delta")
    if not isinstance(node, str) or not NODE_NAME.fullmatch(node):
        raise ApiError(400, "invalid_argument",
                       '"node" must be a node name (1..64 of letters, digits, "_", ".", "-")')
    if mode not in ("delta", "full"):
        raise ApiError(400, "invalid_argument", '"mode" must be "delta" or "full"')
    report = await svc.recover(node, mode)
    return web.json_response(report.to_json())


def _node_list(body: dict[str, Any], field: str, most: int) -> list[str]:
    value = body.get(field, [])
    if not isinstance(value, list) or not all(isinstance(n, str) and NODE_NAME.fullmatch(n) for n in value):
        raise ApiError(400, "invalid_argument", f'"{field}" must be a list of node names '
                                                f'(1..64 of letters, digits, "_", ".", "-")')
    if len(value) > most:
        raise ApiError(400, "invalid_argument", f'"{field}" names {len(value)} nodes: at most {most} per rebalance')
    return list(value)


async def cluster_rebalance(request: web.Request) -> web.Response:
    """Start a rebalance; 202 with its progress. Every input is bounded before any work (body size, node names,
    nodes added, cluster size: docs/gateway.md "Limits"); the new nodes' engines are opened off the event loop,
    then the pump loop runs the moves step by step (gateway/service.py ``rebalance``)."""
    svc = _svc(request)
    c = _cluster(svc)
    body = await _read_json(request, MAX_ADMIN_BODY, "object", empty={})
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_argument", 'body must be a JSON object {"add": [...], "remove": [...]}')
    unknown = sorted(set(body) - {"add", "remove"})
    if unknown:
        raise ApiError(400, "invalid_argument", f"unknown fields {unknown}")
    add = _node_list(body, "add", MAX_NODES_PER_REBALANCE)
    remove = _node_list(body, "remove", MAX_CLUSTER_NODES)
    current = c.vbucket_map().nodes
    final = len(set(current) - set(remove)) + len(set(add) - set(current))
    if final > MAX_CLUSTER_NODES:
        raise ApiError(400, "invalid_argument",
                       f"the cluster would have {final} nodes: at most {MAX_CLUSTER_NODES} (docs/gateway.md)")
    if c.rebalance_running is not None or svc.rebalance_preparing:
        raise ApiError(409, "rebalance_running", "a rebalance is already running (GET /cluster/rebalance)")
    reb = await svc.rebalance(add, remove)
    return web.json_response(reb.progress().to_json(), status=202)


async def cluster_rebalance_progress(request: web.Request) -> web.Response:
    svc = _svc(request)
    _cluster(svc)
    if svc.last_rebalance is None:
        raise ApiError(404, "no_rebalance", "no rebalance was started (POST /cluster/rebalance)")
    return web.json_response(svc.last_rebalance.progress().to_json())


def failover_report_json(report: FailoverReport) -> dict[str, Any]:
    """A :class:`~engine.cluster.manager.FailoverReport` as JSON (vbucket numbers become string keys)."""
    return {
        "node": report.node,
        "graceful": report.graceful,
        "revision": report.revision,
        "promoted": {str(vb): n for vb, n in sorted(report.promoted.items())},
        "entries": {str(vb): None if e is None else {"vbuuid": e.vbuuid, "seqno": e.seqno}
                    for vb, e in sorted(report.entries.items())},
        "lost": list(report.lost),
        "pump_rounds": report.pump_rounds,
    }


def app_routes(app: web.Application) -> set[tuple[str, str]]:
    """``(METHOD, path)`` of every route ``app`` serves (HEAD, added by aiohttp for each GET, left out)."""
    out: set[tuple[str, str]] = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path and route.method != "HEAD":
            out.add((route.method, path))
    return out


async def openapi_json(request: web.Request) -> web.Response:
    from gateway.openapi import document

    return web.json_response(document(app_routes(request.app)))


def build_app(service: GatewayService) -> web.Application:
    from gateway.auth_api import add_routes as add_auth_routes  # local: it imports this module

    # errors outermost, so 401 / 403 are JSON errors too; every route's role: gateway/auth.py ROUTE_ACCESS
    app = web.Application(middlewares=[errors_middleware, auth_middleware], client_max_size=MAX_BODY)
    app[SERVICE] = service
    assert service.users is not None, "GatewayService.start opens the user store before the app is built"
    install_auth(app, service.users, service.settings.token_ttl_s)
    app.router.add_post("/docs/_bulk", bulk)
    app.router.add_get("/docs/{key}", get_doc)
    app.router.add_put("/docs/{key}", put_doc)
    app.router.add_delete("/docs/{key}", delete_doc)
    app.router.add_get("/streams", streams)
    app.router.add_get("/vbuckets", vbuckets)
    app.router.add_get("/vbuckets/{vb}", vbucket_status)
    app.router.add_get("/vbuckets/{vb}/failover-log", failover_log)
    app.router.add_get("/health", health)
    app.router.add_get("/health/ready", health)
    app.router.add_get("/health/live", health_live)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    # issue 3's spellings: /buckets/{bucket}/docs/{key} (the same handlers) and per-vbucket stats
    app.router.add_get("/buckets/{bucket}/docs/{key}", _in_bucket(get_doc))
    app.router.add_put("/buckets/{bucket}/docs/{key}", _in_bucket(put_doc))
    app.router.add_delete("/buckets/{bucket}/docs/{key}", _in_bucket(delete_doc))
    app.router.add_get("/buckets/{bucket}/stats", _in_bucket(bucket_stats))
    app.router.add_get("/cluster", cluster_status)
    app.router.add_get("/cluster/map", cluster_map)
    app.router.add_post("/cluster/failover", cluster_failover)
    app.router.add_post("/cluster/rebalance", cluster_rebalance)
    app.router.add_post("/cluster/recover", cluster_recover)
    app.router.add_get("/cluster/rebalance", cluster_rebalance_progress)
    app.router.add_get("/openapi.json", openapi_json)
    add_auth_routes(app)  # /auth/token, /users (docs/security.md)
    return app
