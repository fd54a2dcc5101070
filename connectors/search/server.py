"""The indexer's HTTP API (docs/search.md "Query API"): ``GET/POST /search``, ``GET /status``, ``GET /metrics``,
``GET /health``. Errors are JSON ``{"error": code, "message": ...}`` like the gateway's API.

Searches run in a worker thread (tantivy blocks); consistency waits poll the indexer's visible checkpoint from
the event loop.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from aiohttp import web

from connectors.exceptions import ConnectorError
from connectors.search.backend import Position, SearchError, SearchResult, SearchUnsupported
from connectors.search.consistency import (
    CONSISTENCY_LEVELS,
    MutationToken,
    SourcePositions,
    SourceUnavailable,
    SourceVBucket,
    index_token_rollback,
    lag_seqnos,
    missing,
    missing_tokens,
    token_rollback,
)
from connectors.search.indexer import SearchIndexer

__all__ = ["DEFAULT_TIMEOUT_MS", "MAX_LIMIT", "build_app"]

#: how long a consistent query waits by default, and at most
DEFAULT_TIMEOUT_MS: Final = 10_000
MAX_TIMEOUT_MS: Final = 300_000
MAX_LIMIT: Final = 10_000
#: deepest page (tantivy collects offset + limit documents)
MAX_OFFSET: Final = 100_000
#: seconds between two looks at the indexer's visible checkpoint while a query waits
POLL_INTERVAL: Final = 0.005

_INDEXER = web.AppKey("indexer", SearchIndexer)
_SOURCE: web.AppKey[SourcePositions | None] = web.AppKey("source")
_POOL = web.AppKey("pool", ThreadPoolExecutor)


class _Error(Exception):
    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.extra = extra


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except _Error as e:
        return web.json_response({"error": e.code, "message": str(e), **e.extra}, status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.json_response({"error": e.reason.lower().replace(" ", "_"), "message": e.text or e.reason},
                                 status=e.status)


def _int(raw: Any, name: str, default: int, lo: int, hi: int, *, json_body: bool = False) -> int:
    """A query parameter (a string of digits) or, ``json_body``, a member of a JSON body (a JSON integer: not a
    string, a fraction or a boolean)."""
    if raw is None:
        return default
    if isinstance(raw, bool) or (json_body and not isinstance(raw, int)):
        raise _Error(400, "invalid_argument", f"{name} must be an integer in {lo}..{hi}, got {json.dumps(raw)}")
    try:
        v = int(raw)
    except (TypeError, ValueError):
        raise _Error(400, "invalid_argument", f"{name} must be an integer in {lo}..{hi}, got {raw!r}") from None
    if not lo <= v <= hi:
        raise _Error(400, "invalid_argument", f"{name} must be in {lo}..{hi}, got {v}")
    return v


async def _source_vbuckets(request: web.Request, what: str) -> dict[int, SourceVBucket] | None:
    src = request.app[_SOURCE]
    if src is None:
        if what == "request_plus":
            raise _Error(400, "no_source", "request_plus needs the source's high seqnos: start the indexer with "
                                           "--source-url (the gateway's HTTP API)")
        return None
    try:
        return await src.vbuckets()
    except SourceUnavailable as e:
        raise _Error(503, "source_unavailable", str(e)) from e


async def _search(request: web.Request, query: Any, limit: int, offset: int, consistency: str,
                  tokens: list[MutationToken], timeout_ms: int) -> web.Response:
    ix = request.app[_INDEXER]
    if not isinstance(query, str):
        raise _Error(400, "invalid_argument", "query must be a string (tantivy's query syntax)")
    if not query.strip():
        raise _Error(400, "invalid_argument", "the query is empty: write * for every document")
    nvb = ix.vbuckets
    for t in tokens:
        if nvb is not None and t.vbucket >= nvb:
            raise _Error(400, "invalid_argument", f"no vbucket {t.vbucket}: topic {ix.topic!r} has {nvb} vbuckets "
                                                  f"(0..{nvb - 1})", vbucket=t.vbucket)
    if consistency not in CONSISTENCY_LEVELS:
        raise _Error(400, "invalid_argument",
                     f"consistency must be one of {', '.join(CONSISTENCY_LEVELS)}, got {consistency!r}")
    if consistency == "at_plus" and not tokens:
        raise _Error(400, "invalid_argument", "at_plus needs \"tokens\" (POST /search)")
    if tokens and consistency != "at_plus":
        raise _Error(400, "invalid_argument", f"tokens are only used with consistency at_plus, not {consistency}")
    started = time.monotonic()
    if consistency != "not_bounded":
        source = await _source_vbuckets(request, consistency)
        wanted: dict[int, int] = {}
        if consistency == "request_plus":
            assert source is not None
            wanted = {vb: v.high_seqno for vb, v in source.items()}
        else:
            for t in tokens:
                sv = None if source is None else source.get(t.vbucket)
                if sv is not None:
                    point = token_rollback(t, sv, ix.failover_log(t.vbucket))
                elif source is None:  # no --source-url: the indexer's own failover log decides
                    point = index_token_rollback(t, ix.failover_log(t.vbucket))
                else:
                    point = None
                if point is not None:
                    raise _Error(409, "token_rolled_back",
                                 f"the source no longer has vbucket {t.vbucket}'s write at seqno {t.seqno} of "
                                 f"branch {t.vbuuid}: it was rolled back to seqno {point}",
                                 vbucket=t.vbucket, vbuuid=t.vbuuid, seqno=t.seqno, rollback_seqno=point)
                wanted[t.vbucket] = max(wanted.get(t.vbucket, 0), t.seqno)
        logs = {} if source is None else {vb: v.failover_log for vb, v in source.items()}
        deadline = started + timeout_ms / 1000
        while True:
            if source is None:
                # at_plus without the source: each token's branch must be in the index's own failover log
                # (read before the checkpoint: the log of a commit is published before its checkpoint)
                own = {t.vbucket: ix.failover_log(t.vbucket) for t in tokens}
                left = missing_tokens(ix.visible, tokens, own)
            else:
                left = missing(ix.visible, wanted, logs)
            if not left:
                break
            if time.monotonic() >= deadline:
                raise _Error(504, "timeout", f"the index did not reach the {consistency} positions of "
                             f"{len(left)} vbucket(s) within {timeout_ms} ms", missing=left)
            await asyncio.sleep(POLL_INTERVAL)
    loop = asyncio.get_running_loop()
    try:
        res: SearchResult = await loop.run_in_executor(request.app[_POOL], ix.backend.search, query, limit, offset)
    except SearchError as e:
        raise _Error(400, "invalid_query", str(e)) from e
    except SearchUnsupported as e:
        raise _Error(501, "search_unsupported", str(e)) from e
    except ConnectorError as e:  # a search cluster that does not answer (connectors/search/elastic.py)
        raise _Error(503, "backend_unavailable", str(e)) from e
    cp = res.checkpoint
    return web.json_response({
        "hits": [{"key": h.key, "score": h.score, "fields": h.fields} for h in res.hits],
        "total": res.total,
        "seqnos": {} if cp is None else {str(vb): p.seqno for vb, p in sorted(cp.positions.items())},
        "vbuuids": {} if cp is None else {str(vb): p.vbuuid for vb, p in sorted(cp.positions.items())},
        "consistency": consistency, "took_ms": round((time.monotonic() - started) * 1000, 3)})


async def search_get(request: web.Request) -> web.Response:
    q = request.query
    if "q" not in q:
        raise _Error(400, "invalid_argument", "missing ?q= (tantivy's query syntax; * for every document)")
    return await _search(request, q["q"], _int(q.get("limit"), "limit", 10, 0, MAX_LIMIT),
                         _int(q.get("offset"), "offset", 0, 0, MAX_OFFSET), q.get("consistency", "not_bounded"), [],
                         _int(q.get("timeout_ms"), "timeout_ms", DEFAULT_TIMEOUT_MS, 0, MAX_TIMEOUT_MS))


async def search_post(request: web.Request) -> web.Response:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise _Error(400, "invalid_json", f"the body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise _Error(400, "invalid_argument", "the body must be a JSON object {\"query\", ...}")
    allowed = {"query", "limit", "offset", "consistency", "tokens", "timeout_ms"}
    unknown = set(body) - allowed
    if unknown:
        raise _Error(400, "invalid_argument", f"unknown member(s) {sorted(unknown)} (allowed: {sorted(allowed)})")
    if "query" not in body:
        raise _Error(400, "invalid_argument", "missing \"query\"")
    raw_tokens = body.get("tokens", [])
    if not isinstance(raw_tokens, list):
        raise _Error(400, "invalid_argument", "tokens must be an array of {\"vbucket\", \"vbuuid\", \"seqno\"}")
    try:
        tokens = [MutationToken.parse(t, i) for i, t in enumerate(raw_tokens)]
    except ValueError as e:
        raise _Error(400, "invalid_argument", str(e)) from e
    consistency = body.get("consistency", "at_plus" if tokens else "not_bounded")
    return await _search(request, body["query"],
                         _int(body.get("limit"), "limit", 10, 0, MAX_LIMIT, json_body=True),
                         _int(body.get("offset"), "offset", 0, 0, MAX_OFFSET, json_body=True), consistency, tokens,
                         _int(body.get("timeout_ms"), "timeout_ms", DEFAULT_TIMEOUT_MS, 0, MAX_TIMEOUT_MS,
                              json_body=True))


async def _with_lag(request: web.Request) -> dict[str, Any]:
    ix = request.app[_INDEXER]
    st = ix.status()
    src = request.app[_SOURCE]
    if src is not None:
        try:
            source: dict[int, SourceVBucket] = await src.vbuckets()
        except SourceUnavailable as e:
            st["source_error"] = str(e)
        else:
            by_vb = {v["vbucket"]: v for v in st["vbuckets"]}
            rows = []
            for vb, sv in sorted(source.items()):
                row = by_vb.get(vb, {"vbucket": vb, "vbuuid": 0, "indexed_seqno": 0})
                rows.append({**row, "source_high_seqno": sv.high_seqno,
                             "lag": lag_seqnos(Position(int(row["vbuuid"]), int(row["indexed_seqno"])), sv)})
            st["vbuckets"] = rows
            st["lag"] = sum(r["lag"] for r in rows)
    return st


async def status(request: web.Request) -> web.Response:
    return web.json_response(await _with_lag(request))


async def metrics(request: web.Request) -> web.Response:
    st = await _with_lag(request)
    lines = []

    def metric(name: str, kind: str, help_: str, value: Any, labels: str = "") -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{labels} {value}")

    for field, help_ in (("indexed", "documents indexed"), ("deleted", "documents removed (deleted, expired, "
                         "rolled back)"), ("binary_skipped", "binary documents skipped"),
                         ("field_rejected", "documents indexed without a field of the wrong type"),
                         ("rejected", "documents the backend refused"), ("rollbacks", "rollbacks applied"),
                         ("oversize", "changes without a value in the topic (too large for Kafka)"),
                         ("commits", "index commits"), ("sync_failures", "failed commits to the backend (retried)")):
        metric(f"dcpgw_search_{field}_total", "counter", help_, st[field])
    lines += ["# HELP dcpgw_search_commit_seconds index commit latency (apply + commit)",
              "# TYPE dcpgw_search_commit_seconds summary",
              f"dcpgw_search_commit_seconds_sum {st['commit_seconds_total']}",
              f"dcpgw_search_commit_seconds_count {st['commits']}"]
    metric("dcpgw_search_commit_seconds_max", "gauge", "slowest index commit", st["commit_seconds_max"])
    metric("dcpgw_search_pending_docs", "gauge", "changes consumed, not yet committed to the index",
           st["pending_docs"])
    lines += ["# HELP dcpgw_search_indexed_seqno seqno up to which the index reflects a vbucket",
              "# TYPE dcpgw_search_indexed_seqno gauge"]
    lines += [f'dcpgw_search_indexed_seqno{{vbucket="{v["vbucket"]}"}} {v["indexed_seqno"]}' for v in st["vbuckets"]]
    be = st.get("backend")
    if isinstance(be, dict) and "reachable" in be:  # a search cluster (docs/search.md "The Elasticsearch backend")
        metric("dcpgw_search_backend_reachable", "gauge", "1 when the search cluster answered the last request",
               int(bool(be["reachable"])))
        metric("dcpgw_search_backend_retries_total", "counter", "requests to the search cluster retried",
               be["retries"])
        metric("dcpgw_search_backend_bulk_requests_total", "counter", "bulk requests sent", be["bulk_requests"])
    if "lag" in st:
        lines += ["# HELP dcpgw_search_lag_seqnos seqnos between the index and the source history (docs/search.md)",
                  "# TYPE dcpgw_search_lag_seqnos gauge"]
        lines += [f'dcpgw_search_lag_seqnos{{vbucket="{v["vbucket"]}"}} {v["lag"]}' for v in st["vbuckets"]]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def health(request: web.Request) -> web.Response:
    """200 while the backend commits; 503 with the error while commits to it fail (and are retried)."""
    ix = request.app[_INDEXER]
    if ix.backend_error is not None:
        return web.json_response({"status": "failing", "generation": ix.visible.generation,
                                  "reasons": [f"index backend: {ix.backend_error}"]}, status=503)
    return web.json_response({"status": "ok", "generation": ix.visible.generation, "reasons": []})


def build_app(indexer: SearchIndexer, source: SourcePositions | None = None) -> web.Application:
    app = web.Application(middlewares=[_errors])
    app[_INDEXER] = indexer
    app[_SOURCE] = source
    app[_POOL] = ThreadPoolExecutor(2, thread_name_prefix="dcpgw-search")
    app.router.add_get("/search", search_get)
    app.router.add_post("/search", search_post)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)

    async def cleanup(app: web.Application) -> None:
        app[_POOL].shutdown(wait=False)
        if source is not None:
            await source.close()

    app.on_cleanup.append(cleanup)
    return app


async def serve(indexer: SearchIndexer, *, host: str = "127.0.0.1", port: int = 0,
                sock: socket.socket | None = None, source: SourcePositions | None = None,
                until_caught_up: bool = False, stop: asyncio.Event | None = None,
                on_listening: Callable[[int], None] | None = None) -> dict[str, Any]:
    """``dcpgw index``: consume in a worker thread while the query API answers on ``host:port`` (or on ``sock``,
    already bound); returns the summary when the indexer caught up (``until_caught_up``) or ``stop`` is set. An
    exception of the indexer thread is raised here."""
    app = build_app(indexer, source)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        if sock is None:
            sock = socket.create_server((host, port))
        site = web.SockSite(runner, sock)
        await site.start()
        if on_listening is not None:
            on_listening(int(sock.getsockname()[1]))
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.run_in_executor(None, indexer.run, until_caught_up)
        stopper: asyncio.Future[Any] = asyncio.ensure_future((stop or asyncio.Event()).wait())
        try:
            await asyncio.wait([done, stopper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not done.done():
                indexer.stop()
            await done  # raises what the indexer raised
    finally:
        await runner.cleanup()
    try:
        total: int | None = indexer.backend.search("*", 1).total
    except SearchUnsupported:
        total = None
    st = indexer.status()
    return {"topic": indexer.topic, "index_dir": str(indexer.dir), "docs": total, "generation": st["generation"],
            "indexed": st["indexed"], "deleted": st["deleted"], "binary_skipped": st["binary_skipped"],
            "field_rejected": st["field_rejected"], "rollbacks": st["rollbacks"], "commits": st["commits"]}
