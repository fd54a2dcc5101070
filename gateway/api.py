"""The gateway's HTTP API (aiohttp).

Documents: ``GET/PUT/DELETE /docs/{key}`` (the body is the document; CAS travels as the ETag, ``If-Match`` makes
a write conditional, ``If-None-Match: *`` makes a PUT an insert, ``?expiry=`` and ``?flags=`` set metadata;
``?durability=majority|majority_and_persist_to_active|persist_to_majority[&timeout_ms=N]`` makes it a sync write
answered once committed -- seed 004, docs/durability.md),
``POST /docs/_bulk`` (a JSON array of ``{"key", "value"}`` upserts; used by ``dcpgw load``).
Streams: ``GET /streams``, ``GET /vbuckets/{vb}``, ``GET /vbuckets/{vb}/failover-log``.
Operations: ``GET /health``, ``GET /metrics``, ``GET /stats``.
Cluster (``dcpgw up --nodes N``): ``GET /cluster``, ``GET /cluster/map``, ``POST /cluster/failover``
(``{"node": "n1", "graceful": false}``; answers the failover report), ``POST /cluster/rebalance``
(``{"add": ["n3"], "remove": ["n1"]}``; starts it, answers 202 with its progress) and ``GET /cluster/rebalance``
(progress of the running or last rebalance).

Every error is a JSON body ``{"error": <code>, "message": <text>}`` with a 4xx status (5xx only for server
faults), mapped from the engine's typed exceptions.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine import Bucket, Datatype
from engine.cluster import Cluster, FailoverReport
from engine.durability import Durability, Level, SyncWrite, parse_level
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
from gateway.source import cluster_summary

if TYPE_CHECKING:
    from gateway.service import GatewayService

log = logging.getLogger(__name__)

SERVICE: web.AppKey[GatewayService] = web.AppKey("service")
MAX_BODY = 64 * 1024 * 1024

_STATUS_FOR: list[tuple[type[EngineError], int, str]] = [
    # synchronous replication (seed 004; docs/durability.md "HTTP"): a bad level is the client's fault; the
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


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    svc = request.app[SERVICE]
    try:
        return await handler(request)
    except ApiError as e:
        svc.metrics.http_errors.labels(str(e.status)).inc()
        return _json_error(e.status, e.code, e.message)
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
            return _json_error(e.status, e.reason.lower().replace(" ", "_"), e.text or e.reason)
        raise


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


def _key(request: web.Request) -> bytes:
    """The document key of ``/docs/{key}``: the *raw* path segment percent-decoded to bytes, which must be
    UTF-8 (docs/gateway.md, "Keys"). aiohttp's ``match_info`` cannot be used: it leaves an undecodable
    sequence such as ``%FF`` as the literal text ``%FF``, which would alias the key ``%FF`` (``/docs/%25FF``)."""
    raw = request.rel_url.raw_path
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
    return {"vbucket": res.vbucket, "vbuuid": res.vbuuid, "seqno": res.seqno, "cas": res.cas}


def _durability(request: web.Request) -> Durability | None:
    """``?durability=<level>[&timeout_ms=N]`` (seed 004): None for a plain write (no parameter or ``none``).
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
async def get_doc(request: web.Request) -> web.Response:
    svc = _svc(request)
    key = _key(request)
    g = _bucket(svc, key).get(key)
    ctype = "application/json" if g.datatype & Datatype.JSON else "application/octet-stream"
    return web.Response(
        body=g.value, content_type=ctype,
        headers={"ETag": f'"{g.cas}"', "X-DCP-Flags": str(g.flags), "X-DCP-Expiry": str(g.expiry),
                 "X-DCP-Vbucket": str(g.vbucket), "X-DCP-Seqno": str(g.seqno), "X-DCP-Rev": str(g.rev_seqno)})


async def put_doc(request: web.Request) -> web.Response:
    svc = _svc(request)
    key = _key(request)
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
    svc.wake()
    return web.json_response(_mutation(res), status=201 if insert else 200, headers={"ETag": f'"{res.cas}"'})


async def delete_doc(request: web.Request) -> web.Response:
    svc = _svc(request)
    key = _key(request)
    durability = _durability(request)
    bucket = _bucket(svc, key)
    if durability is not None:
        if svc.cluster is not None:
            svc.cluster.push_topologies()
        sw = bucket.delete(key, cas=_cas_header(request), durability=durability)
        res = await _completed(svc, bucket, sw)
    else:
        res = bucket.delete(key, cas=_cas_header(request))
    svc.wake()
    return web.json_response(_mutation(res))


async def bulk(request: web.Request) -> web.Response:
    svc = _svc(request)
    try:
        docs = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_json", f"body must be a JSON array of documents: {e}") from e
    if not isinstance(docs, list):
        raise ApiError(400, "invalid_argument", "body must be a JSON array of {\"key\", \"value\"} objects")
    # Validate everything first: a bad entry rejects the batch before anything is written.
    prepared: list[tuple[bytes, bytes, int]] = []
    for i, d in enumerate(docs):
        if not isinstance(d, dict) or "key" not in d or "value" not in d:
            raise ApiError(400, "invalid_argument", f"entry {i}: needs \"key\" and \"value\"")
        k, v = d["key"], d["value"]
        if not isinstance(k, str) or not 0 < len(k.encode()) <= 250:
            raise ApiError(400, "invalid_argument", f"entry {i}: key must be a string of 1..250 bytes")
        if d.get("encoding") == "base64":
            if not isinstance(v, str):
                raise ApiError(400, "invalid_argument", f"entry {i}: base64 values must be strings")
            try:
                vb = base64.b64decode(v, validate=True)
            except ValueError as e:
                raise ApiError(400, "invalid_argument", f"entry {i}: bad base64: {e}") from e
        elif isinstance(v, str):
            vb = v.encode()
        else:
            vb = json.dumps(v, separators=(",", ":")).encode()
        exp = d.get("expiry", 0)
        if not isinstance(exp, int) or exp < 0:
            raise ApiError(400, "invalid_argument", f"entry {i}: expiry must be a non-negative integer")
        prepared.append((k.encode(), vb, exp))
    written = 0
    if svc.cluster is None:
        assert svc.bucket is not None
        bset = svc.bucket.set
        for k, v, exp in prepared:
            bset(k, v, expiry=exp)
            written += 1
    else:
        for k, v, exp in prepared:
            _bucket(svc, k).set(k, v, expiry=exp)
            written += 1
    svc.wake()
    return web.json_response({"written": written})


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


async def failover_log(request: web.Request) -> web.Response:
    svc = _svc(request)
    assert svc.publisher is not None
    vb = _vb(request)
    return web.json_response({"vbucket": vb, "failover_log": [
        {"vbuuid": e.vbuuid, "seqno": e.seqno} for e in svc.publisher.source.failover_log(vb)]})


async def health(request: web.Request) -> web.Response:
    svc = _svc(request)
    pub = svc.publisher
    ok = pub is not None and pub.error is None and bool(svc.buckets())
    body = {"status": "ok" if ok else "failing", "topic": svc.topic, "bootstrap_servers": svc.bootstrap_servers,
            "streams": len(pub.streaming) if pub else 0}
    if pub is not None and pub.error is not None:
        body["error"] = str(pub.error)
    return web.json_response(body, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    svc = _svc(request)
    assert svc.publisher is not None
    return web.Response(body=svc.metrics.render(svc.publisher),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def stats(request: web.Request) -> web.Response:
    svc = _svc(request)
    assert svc.publisher is not None
    pub = svc.publisher
    if svc.bucket is not None:
        body: dict[str, Any] = dict(svc.bucket.stats())
    else:
        assert svc.cluster is not None
        body = {"bucket": svc.settings.bucket, "vbuckets": svc.cluster.num_vbuckets, "items": pub.source.items(),
                "checkpoint_memory": pub.source.checkpoint_memory(), "nodes": len(svc.cluster.nodes),
                "map_revision": svc.cluster.vbucket_map().revision, "restreams": pub.restreams,
                "held": pub.held}
    body.update({
        "topic": svc.topic,
        "records_published": pub.records_sent,
        "records_acknowledged": pub.records_acked,
        "rollbacks": pub.rollbacks,
        "errors": pub.errors,
        "inflight": pub.inflight,
        "streams": len(pub.streaming),
        "lag": pub.lag()[0],
    })
    return web.json_response(body)


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
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_json", f"body must be a JSON object: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_argument", 'body must be a JSON object {"node": ..., "graceful": ...}')
    unknown = sorted(set(body) - {"node", "graceful"})
    if unknown:
        raise ApiError(400, "invalid_argument", f"unknown fields {unknown}")
    node = body.get("node")
    graceful = body.get("graceful", False)
    if not isinstance(node, str) or not node:
        raise ApiError(400, "invalid_argument", '"node" must be a node name (a non-empty string)')
    if not isinstance(graceful, bool):
        raise ApiError(400, "invalid_argument", '"graceful" must be true or false')
    report = svc.failover(node, graceful)
    return web.json_response(failover_report_json(report))


def _node_list(body: dict[str, Any], field: str) -> list[str]:
    value = body.get(field, [])
    if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
        raise ApiError(400, "invalid_argument", f'"{field}" must be a list of node names (non-empty strings)')
    return list(value)


async def cluster_rebalance(request: web.Request) -> web.Response:
    """Start a rebalance; 202 with its progress. The pump loop runs it step by step (gateway/service.py)."""
    svc = _svc(request)
    c = _cluster(svc)
    try:
        body = json.loads(await request.read() or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_json", f"body must be a JSON object: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_argument", 'body must be a JSON object {"add": [...], "remove": [...]}')
    unknown = sorted(set(body) - {"add", "remove"})
    if unknown:
        raise ApiError(400, "invalid_argument", f"unknown fields {unknown}")
    add, remove = _node_list(body, "add"), _node_list(body, "remove")
    if c.rebalance_running is not None:
        raise ApiError(409, "rebalance_running", "a rebalance is already running (GET /cluster/rebalance)")
    reb = svc.rebalance(add, remove)
    return web.json_response(reb.progress().to_json(), status=202)


async def cluster_rebalance_progress(request: web.Request) -> web.Response:
    svc = _svc(request)
    _cluster(svc)
    if svc.last_rebalance is None:
        raise ApiError(404, "no_rebalance", "no rebalance was started (POST /cluster/rebalance)")
    return web.json_response(svc.last_rebalance.progress().to_json())


def failover_report_json(report: FailoverReport) -> dict[str, Any]:
    """A :class:`~engine.cluster.FailoverReport` as JSON (vbucket numbers become string keys)."""
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


def build_app(service: GatewayService) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=MAX_BODY)
    app[SERVICE] = service
    app.router.add_post("/docs/_bulk", bulk)
    app.router.add_get("/docs/{key}", get_doc)
    app.router.add_put("/docs/{key}", put_doc)
    app.router.add_delete("/docs/{key}", delete_doc)
    app.router.add_get("/streams", streams)
    app.router.add_get("/vbuckets/{vb}", vbucket_status)
    app.router.add_get("/vbuckets/{vb}/failover-log", failover_log)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_get("/cluster", cluster_status)
    app.router.add_get("/cluster/map", cluster_map)
    app.router.add_post("/cluster/failover", cluster_failover)
    app.router.add_post("/cluster/rebalance", cluster_rebalance)
    app.router.add_get("/cluster/rebalance", cluster_rebalance_progress)
    return app
