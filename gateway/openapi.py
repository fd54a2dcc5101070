"""The OpenAPI 3 document of the gateway's HTTP API, served at ``GET /openapi.json`` (docs/gateway.md).

Hand-written: every route of :func:`gateway.api.build_app` with its parameters, bodies and responses. A test
(tests/gateway/test_api_input.py) checks that every route the app serves is described here; the served document
holds only the routes the running app has (``/health/live`` and ``/health/ready`` come with the health checks).
The HTTP API fuzz (tests/gateway/test_api_fuzz.py) drives the API from this document.
"""

from __future__ import annotations

import copy
from typing import Any

from gateway import __version__

_JSON = "application/json"

ERROR = {
    "type": "object",
    "required": ["error", "message"],
    "properties": {"error": {"type": "string"}, "message": {"type": "string"}},
}
TOKEN = {
    "type": "object",
    "required": ["vbucket", "vbuuid", "seqno"],
    "description": "the write's mutation token (at_plus search queries, docs/search.md)",
    "properties": {k: {"type": "integer"} for k in ("vbucket", "vbuuid", "seqno")},
}
MUTATION = {
    "type": "object",
    "required": ["vbucket", "vbuuid", "seqno", "cas", "token"],
    "properties": {**{k: {"type": "integer"} for k in ("vbucket", "vbuuid", "seqno", "cas")}, "token": TOKEN},
}
BULK_ENTRY = {
    "type": "object",
    "required": ["key"],
    "additionalProperties": False,
    "properties": {
        "key": {"type": "string", "minLength": 1, "maxLength": 250,
                "description": "the document key (1..250 bytes of UTF-8)"},
        "value": {"description": "the document: a string is stored as its UTF-8 bytes, anything else as "
                                 "compact JSON; required except for op=delete"},
        "encoding": {"type": "string", "enum": ["base64"], "description": "value is base64 of the bytes"},
        "op": {"type": "string", "enum": ["upsert", "insert", "replace", "delete"], "default": "upsert"},
        "expiry": {"type": "integer", "minimum": 0, "maximum": 4294967295, "default": 0},
        "flags": {"type": "integer", "minimum": 0, "maximum": 4294967295, "default": 0},
        "cas": {"type": "integer", "minimum": 0, "maximum": 18446744073709551615, "default": 0,
                "description": "write only if the document's CAS is still this (0: unconditional)"},
    },
}
BULK_RESULT = {
    "type": "object",
    "required": ["written", "failed", "errors", "items"],
    "properties": {
        "written": {"type": "integer"},
        "failed": {"type": "integer"},
        "errors": {"type": "boolean"},
        "items": {"type": "array", "items": {
            "type": "object",
            "required": ["key", "status"],
            "properties": {
                "key": {"type": "string"}, "status": {"type": "integer"},
                "error": {"type": "string"}, "message": {"type": "string"},
                "vbucket": {"type": "integer"}, "vbuuid": {"type": "integer"}, "seqno": {"type": "integer"},
                "cas": {"type": "integer"}, "token": TOKEN,
            },
        }},
    },
}
HEALTH = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"type": "string"}, "reasons": {"type": "array", "items": {}}},
}
PROGRESS = {
    "type": "object",
    "required": ["status", "total", "moved"],
    "properties": {"status": {"type": "string", "enum": ["running", "done", "failed"]},
                   "total": {"type": "integer"}, "moved": {"type": "integer"},
                   "nodes": {"type": "array", "items": {"type": "string"}}},
}
NODE_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}
ROLE = {"type": "string", "enum": ["admin", "data_writer", "data_reader", "dcp_reader", "replication_target"]}
USER = {"type": "object", "required": ["name", "roles"],
        "properties": {"name": {"type": "string"}, "roles": {"type": "array", "items": ROLE}}}
USER_NAME = {"name": "name", "in": "path", "required": True, "description": "user name (1..128 characters)",
             "schema": {"type": "string", "minLength": 1, "maxLength": 128}}
TOKEN = {"type": "object", "required": ["token", "expires_at"],
         "properties": {"token": {"type": "string"}, "expires_at": {"type": "string", "format": "date-time"},
                        "expires_in": {"type": "integer"}, "user": {"type": "string"}}}
#: docs/security.md: Basic credentials or a bearer token from POST /auth/token on every route but /health/live
SECURITY_SCHEMES = {"basic": {"type": "http", "scheme": "basic"},
                    "bearer": {"type": "http", "scheme": "bearer"}}
PUBLIC_PATHS = frozenset({"/health/live"})
OBJECT: dict[str, Any] = {"type": "object"}


def _resp(description: str, schema: dict[str, Any] | None = None, ctype: str = _JSON) -> dict[str, Any]:
    r: dict[str, Any] = {"description": description}
    if schema is not None:
        r["content"] = {ctype: {"schema": schema}}
    return r


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "bad request (JSON error)", 401: "no or bad credentials (WWW-Authenticate)",
            403: "the user lacks the role the route needs", 404: "not found (JSON error)", 405: "method not allowed",
            409: "conflict", 412: "CAS mismatch / document exists", 413: "too large",
            503: "temporarily unavailable (Retry-After)", 504: "sync write ambiguous"}
    return {str(c): _resp(text[c], ERROR) for c in codes}


def _q(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


KEY = {"name": "key", "in": "path", "required": True, "description": "document key (1..250 bytes)",
       "schema": {"type": "string", "minLength": 1, "maxLength": 250}}
BUCKET = {"name": "bucket", "in": "path", "required": True, "schema": {"type": "string"},
          "description": "the bucket this gateway serves (any other: 404 no_bucket)"}
VB = {"name": "vb", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0},
      "description": "vbucket number"}
U32 = {"type": "integer", "minimum": 0, "maximum": 4294967295}
DURABILITY = [
    _q("durability", {"type": "string", "enum": ["none", "majority", "majority_and_persist_to_active",
                                                  "persist_to_majority"]},
       "a sync write, answered once committed (docs/durability.md)"),
    _q("timeout_ms", {"type": "integer", "minimum": 0, "maximum": 65535}, "sync write timeout (needs durability)"),
]
IF_MATCH = {"name": "If-Match", "in": "header", "required": False, "schema": {"type": "string"},
            "description": "the document's CAS (ETag): write / delete only if unchanged"}
IF_NONE_MATCH = {"name": "If-None-Match", "in": "header", "required": False,
                 "schema": {"type": "string", "enum": ["*"]}, "description": "insert only"}
DOC_WRITE_ERRORS = (400, 404, 409, 412, 413, 503, 504)

PATHS: dict[str, dict[str, Any]] = {
    "/docs/_bulk": {"post": {
        "summary": "write a batch of documents (a 4xx means nothing was written; 200 answers per item)",
        "parameters": DURABILITY,
        "requestBody": {"required": True, "content": {_JSON: {"schema": {"type": "array", "items": BULK_ENTRY}}}},
        "responses": {"200": _resp("per-item results", BULK_RESULT), **_errors(400, 413)},
    }},
    "/docs/{key}": {
        "get": {"summary": "read a document", "parameters": [KEY],
                "responses": {"200": {"description": "the document body (ETag = CAS)",
                                      "content": {"application/json": {"schema": {}},
                                                  "application/octet-stream": {"schema": {}}}},
                              **_errors(400, 404, 503)}},
        "put": {"summary": "write a document", "parameters": [
                    KEY, _q("expiry", U32, "seconds (<= 30 days) or epoch time"), _q("flags", U32, "client flags"),
                    IF_MATCH, IF_NONE_MATCH, *DURABILITY],
                "requestBody": {"required": False, "content": {"application/octet-stream": {"schema": {
                    "type": "string", "format": "binary"}}}},
                "responses": {"200": _resp("written", MUTATION), "201": _resp("inserted", MUTATION),
                              **_errors(*DOC_WRITE_ERRORS)}},
        "delete": {"summary": "delete a document", "parameters": [KEY, IF_MATCH, *DURABILITY],
                   "responses": {"200": _resp("deleted", MUTATION), **_errors(*DOC_WRITE_ERRORS)}},
    },
    # issue 3's spellings of the document routes and the per-vbucket stats; {bucket} must be the served bucket
    "/buckets/{bucket}/docs/{key}": {
        "get": {"summary": "read a document (as /docs/{key}; also X-DCP-CAS, X-DCP-Vbuuid headers)",
                "parameters": [BUCKET, KEY],
                "responses": {"200": {"description": "the document body (ETag = CAS)",
                                      "content": {"application/json": {"schema": {}},
                                                  "application/octet-stream": {"schema": {}}}},
                              **_errors(400, 404, 503)}},
        "put": {"summary": "write a document (as /docs/{key})", "parameters": [
                    BUCKET, KEY, _q("expiry", U32, "seconds (<= 30 days) or epoch time"),
                    _q("flags", U32, "client flags"), IF_MATCH, IF_NONE_MATCH, *DURABILITY],
                "requestBody": {"required": False, "content": {"application/octet-stream": {"schema": {
                    "type": "string", "format": "binary"}}}},
                "responses": {"200": _resp("written", MUTATION), "201": _resp("inserted", MUTATION),
                              **_errors(*DOC_WRITE_ERRORS)}},
        "delete": {"summary": "delete a document (as /docs/{key})", "parameters": [BUCKET, KEY, IF_MATCH,
                                                                                   *DURABILITY],
                   "responses": {"200": _resp("deleted", MUTATION), **_errors(*DOC_WRITE_ERRORS)}},
    },
    "/buckets/{bucket}/stats": {"get": {
        "summary": "per vbucket high_seqno, persisted_seqno, published_seqno, acknowledged_seqno, vbuuid; totals",
        "parameters": [BUCKET], "responses": {"200": _resp("stats", OBJECT), **_errors(404)}}},
    "/streams": {"get": {"summary": "publishing status of every vbucket",
                         "responses": {"200": _resp("per vbucket", {"type": "array", "items": OBJECT})}}},
    "/vbuckets": {"get": {"summary": "every vbucket's high seqno, vbuuid and failover log (search consistency)",
                          "responses": {"200": _resp("{\"vbuckets\": [...]}", OBJECT)}}},
    "/vbuckets/{vb}": {"get": {"summary": "one vbucket's publishing status and engine stats", "parameters": [VB],
                               "responses": {"200": _resp("status", OBJECT), **_errors(400, 404)}}},
    "/vbuckets/{vb}/failover-log": {"get": {
        "summary": "a vbucket's failover log", "parameters": [VB],
        "responses": {"200": _resp("the log, newest first", OBJECT), **_errors(400, 404)}}},
    "/health": {"get": {"summary": "readiness (same as /health/ready)",
                        "responses": {"200": _resp("ready", HEALTH), "503": _resp("not ready", HEALTH)}}},
    "/health/live": {"get": {"summary": "the process is alive",
                             "responses": {"200": _resp("alive", HEALTH), "503": _resp("not alive", HEALTH)}}},
    "/health/ready": {"get": {"summary": "ready: broker reachable, streams progressing, storage healthy",
                              "responses": {"200": _resp("ready", HEALTH), "503": _resp("not ready", HEALTH)}}},
    "/metrics": {"get": {"summary": "Prometheus metrics",
                         "responses": {"200": _resp("text exposition format", {"type": "string"}, "text/plain")}}},
    "/stats": {"get": {"summary": "engine and publisher statistics", "responses": {"200": _resp("stats", OBJECT)}}},
    "/openapi.json": {"get": {"summary": "this document", "responses": {"200": _resp("OpenAPI 3", OBJECT)}}},
    "/auth/token": {
        "post": {"summary": "a bearer token for the Basic credentials sent (expires after token_ttl_s)",
                 "responses": {"200": _resp("the token", TOKEN)}},
        "delete": {"summary": "revoke the bearer token this request is authenticated with",
                   "responses": {"200": _resp("revoked", OBJECT), **_errors(400)}},
    },
    "/users": {"get": {"summary": "admin: every user and its roles",
                       "responses": {"200": _resp("users", {"type": "array", "items": USER})}}},
    "/users/{name}": {
        "put": {"summary": "admin: create a user (password required) or change its roles / password",
                "parameters": [USER_NAME],
                "requestBody": {"required": True, "content": {_JSON: {"schema": {
                    "type": "object", "required": ["roles"], "additionalProperties": False,
                    "properties": {"password": {"type": "string", "minLength": 1},
                                   "roles": {"type": "array", "minItems": 1, "items": ROLE}}}}}},
                "responses": {"200": _resp("updated", USER), "201": _resp("created", USER),
                              **_errors(400, 409, 413)}},
        "delete": {"summary": "admin: delete a user (its tokens are revoked)", "parameters": [USER_NAME],
                   "responses": {"200": _resp("deleted", OBJECT), **_errors(404, 409)}},
    },
    "/cluster": {"get": {"summary": "cluster mode: nodes, vbucket counts, map revision, gateway following",
                         "responses": {"200": _resp("status", OBJECT), **_errors(404)}}},
    "/cluster/map": {"get": {"summary": "cluster mode: the vbucket map",
                             "responses": {"200": _resp("revision, nodes, chains", OBJECT), **_errors(404)}}},
    "/cluster/failover": {"post": {
        "summary": "cluster mode: fail a node over",
        "requestBody": {"required": True, "content": {_JSON: {"schema": {
            "type": "object", "required": ["node"], "additionalProperties": False,
            "properties": {"node": NODE_NAME, "graceful": {"type": "boolean", "default": False}}}}}},
        "responses": {"200": _resp("the failover report", OBJECT), **_errors(400, 404, 413, 503)}}},
    "/cluster/recover": {"post": {
        "summary": "cluster mode: recover a failed-over node (delta: with its data; full: streamed from zero)",
        "requestBody": {"required": True, "content": {_JSON: {"schema": {
            "type": "object", "required": ["node"], "additionalProperties": False,
            "properties": {"node": NODE_NAME, "mode": {"type": "string", "enum": ["delta", "full"],
                                                       "default": "delta"}}}}}},
        "responses": {"200": _resp("the recovery report", OBJECT), **_errors(400, 404, 413, 503)}}},
    "/cluster/rebalance": {
        "post": {
            "summary": "cluster mode: start a rebalance (at most 8 nodes added, 64 nodes in the cluster)",
            "requestBody": {"required": False, "content": {_JSON: {"schema": {
                "type": "object", "additionalProperties": False,
                "properties": {"add": {"type": "array", "maxItems": 8, "items": NODE_NAME},
                               "remove": {"type": "array", "maxItems": 64, "items": NODE_NAME}}}}}},
            "responses": {"202": _resp("started: its progress", PROGRESS), **_errors(400, 404, 409, 413, 503)}},
        "get": {"summary": "cluster mode: progress of the running or last rebalance",
                "responses": {"200": _resp("progress", PROGRESS), **_errors(404)}},
    },
}


def document(routes: set[tuple[str, str]] | None = None) -> dict[str, Any]:
    """The OpenAPI document; with ``routes`` (``(METHOD, path)`` pairs the app serves) only those operations."""
    paths: dict[str, dict[str, Any]] = {}
    for path, ops in PATHS.items():
        kept = {m: copy.deepcopy(op) for m, op in ops.items() if routes is None or (m.upper(), path) in routes}
        for op in kept.values():
            if path in PUBLIC_PATHS:
                op["security"] = []
            else:
                op["responses"].update(_errors(401, 403))
        if kept:
            paths[path] = kept
    return {
        "openapi": "3.0.3",
        "info": {"title": "dcp-gateway HTTP API", "version": __version__,
                 "description": "Documents, streams, operations and cluster administration (docs/gateway.md). "
                                "Every error is a JSON body {\"error\", \"message\"} with a 4xx status."},
        "paths": paths,
        "components": {"securitySchemes": copy.deepcopy(SECURITY_SCHEMES)},
        "security": [{"basic": []}, {"bearer": []}],
    }


def described() -> set[tuple[str, str]]:
    """Every ``(METHOD, path)`` this module describes."""
    return {(m.upper(), p) for p, ops in PATHS.items() for m in ops}
