"""The Elasticsearch / OpenSearch backend of the search indexer (docs/search.md "Elasticsearch backend").

Documents go to the cluster through the official ``elasticsearch`` client's ``_bulk`` API. What this module
adds to a plain bulk loop, and why:

* **Positions after the bulk.** The per-vbucket positions (the consumer state, its mutation log and the partition
  offsets) live in a local SQLite file under the state directory, and its transaction is committed only after
  every bulk request holding the documents of that transaction was acknowledged by the cluster
  (:class:`BulkCommitStore`). The cluster may be ahead of the file, never behind it: a restart resumes from the
  file's last commit and re-sends what came after it. Each bulk carries at most one operation per document id
  (the last one of the batch) and re-sending an operation gives the same document, so re-sent batches leave the
  index exactly as the source (no lost document, no stale version).
* **Exact rollbacks.** The consumer's mutation log needs each key's prior version as the index holds it. It is
  read from a local copy of the indexed versions (``search_es_docs`` in the same SQLite file, same
  transaction), not from the cluster: after a crash between a bulk and its commit the cluster already holds the
  re-delivered snapshot's versions, and reading them would record the snapshot itself as its prior version.
  The copy costs one row (key, vbucket, seqno, value) per live JSON document.
* **Retries.** 429 and 5xx answers (whole request or single items) and connection failures are retried with
  exponential backoff (``backoff_initial_s`` doubling up to ``backoff_max_s``, full jitter from the injected
  random source), ``max_retries`` times (None: until the cluster answers; the status shows it meanwhile).
  Nothing is committed while a batch is not acknowledged, so nothing is lost either way.
* **Rejections.** An item the cluster refuses with any other 4xx (a mapping conflict, a document too large) is
  written to the rejection log (``rejections.jsonl`` under the state directory: one JSON object per line) and
  counted; the indexer goes on. The local copy keeps the source's version all the same (it is what a rollback
  must restore).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from connectors.client.mutation_log import Prior
from connectors.client.replay import ConsumerPosition
from connectors.client.state import SqliteStateStore
from connectors.exceptions import ConnectorError

__all__ = [
    "BulkCommitStore",
    "BulkOp",
    "ElasticsearchBackend",
    "ElasticsearchConfigError",
    "ElasticsearchSettings",
    "ElasticsearchUnavailable",
    "RejectionLog",
    "check_index_name",
    "index_name_for_topic",
]

log = logging.getLogger(__name__)

#: memcached datatype bit of a JSON document (docs/record-format.md)
DATATYPE_JSON = 0x01

#: characters Elasticsearch refuses in an index name (its MetadataCreateIndexService.validateIndexOrAliasName)
_ILLEGAL = set('\\/*?"<>| ,#:')
_MAX_NAME_BYTES = 255


class ElasticsearchConfigError(ConnectorError):
    """A bad setting of the Elasticsearch backend (index name, routing, limits, URL)."""


class ElasticsearchUnavailable(ConnectorError):
    """The cluster did not acknowledge a bulk request within ``max_retries`` retries."""


def check_index_name(name: str) -> str:
    """``name`` if Elasticsearch accepts it as an index name, else :class:`ElasticsearchConfigError` saying
    which rule it breaks: lowercase only; none of ``\\ / * ? " < > | , # :`` nor a space; not starting with
    ``-``, ``_`` or ``+``; not ``.`` or ``..``; at most 255 bytes (UTF-8)."""
    if not name:
        raise ElasticsearchConfigError("index name: must not be empty")
    if name != name.lower():
        raise ElasticsearchConfigError(f"index name {name!r}: must be lowercase")
    bad = sorted({c for c in name if c in _ILLEGAL})
    if bad:
        raise ElasticsearchConfigError(f"index name {name!r}: must not contain {' '.join(repr(c) for c in bad)}")
    if name[0] in "-_+":
        raise ElasticsearchConfigError(f"index name {name!r}: must not start with '-', '_' or '+'")
    if name in (".", ".."):
        raise ElasticsearchConfigError(f"index name {name!r}: must not be '.' or '..'")
    if len(name.encode()) > _MAX_NAME_BYTES:
        raise ElasticsearchConfigError(f"index name {name!r}: longer than {_MAX_NAME_BYTES} bytes")
    return name


def index_name_for_topic(topic: str) -> str:
    """The default index name of a topic: lowercased, every illegal character replaced by ``_``, leading
    ``-``, ``_``, ``+`` and ``.`` removed (a leading dot makes a hidden index), cut to 255 bytes. ``dcp.default``
    stays ``dcp.default``."""
    s = "".join("_" if c in _ILLEGAL else c for c in topic.lower())
    s = re.sub(r"^[-_+.]+", "", s)
    s = s.encode()[:_MAX_NAME_BYTES].decode("utf-8", "ignore")
    return check_index_name(s or "dcp")


@dataclass(frozen=True)
class ElasticsearchSettings:
    """How the backend talks to the cluster (docs/search.md "Elasticsearch backend")."""

    url: str
    #: the index (None: :func:`index_name_for_topic` of the topic); checked by :func:`check_index_name`
    index: str | None = None
    #: ``key``: Elasticsearch's default routing (by ``_id``); ``vbucket``: ``routing=<vbucket>``, every document
    #: of a vbucket on one shard (reads by id must then pass the same routing)
    routing: Literal["key", "vbucket"] = "key"
    #: a bulk request holds at most this many operations ...
    batch_docs: int = 1000
    #: ... and at most about this many bytes of NDJSON (one larger document goes alone)
    batch_bytes: int = 5 << 20
    #: operations wait at most this long before a bulk request is sent (the commit that follows moves the positions)
    batch_ms: int = 1000
    #: retries of a bulk request (whole or items) on 429 / 5xx / no connection; None: until it answers
    max_retries: int | None = None
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 30.0
    request_timeout_s: float = 30.0
    #: create the index (with these settings) when it does not exist
    index_settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not re.match(r"^https?://", self.url):
            raise ElasticsearchConfigError(f"--es-url {self.url!r}: must be an http:// or https:// URL")
        if self.index is not None:
            check_index_name(self.index)
        if self.routing not in ("key", "vbucket"):
            raise ElasticsearchConfigError(f"routing {self.routing!r}: must be 'key' or 'vbucket'")
        for name in ("batch_docs", "batch_bytes", "batch_ms"):
            if int(getattr(self, name)) < 1:
                raise ElasticsearchConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries is not None and self.max_retries < 0:
            raise ElasticsearchConfigError(f"max_retries must be >= 0 or None, got {self.max_retries}")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ElasticsearchConfigError("backoff: need 0 < backoff_initial_s <= backoff_max_s")


@dataclass(frozen=True, slots=True)
class BulkOp:
    """One bulk operation: ``index`` (``source`` is the compact JSON object) or ``delete``."""

    action: Literal["index", "delete"]
    key: bytes
    vbucket: int
    seqno: int
    source: bytes | None = None

    @property
    def doc_id(self) -> str:
        return self.key.decode("utf-8")

    def size(self) -> int:
        return len(self.key) + 80 + (len(self.source) if self.source else 0)


class RejectionLog:
    """Documents the cluster refused: one JSON object per line in ``path`` (appended, flushed and fsynced per
    batch): ``time``, ``index``, ``key``, ``vbucket``, ``seqno``, ``action``, ``status``, ``error`` (the
    cluster's error object, or the reason the backend refused it itself)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.count = 0
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, index: str, items: Sequence[tuple[BulkOp, int, Any]]) -> None:
        if not items:
            return
        now = self.clock()
        with open(self.path, "ab") as f:
            for op, status, error in items:
                f.write(orjson.dumps({"time": now, "index": index, "key": op.key.decode("utf-8", "replace"),
                                      "vbucket": op.vbucket, "seqno": op.seqno, "action": op.action,
                                      "status": status, "error": error}) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self.count += len(items)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_bytes().splitlines() if line.strip()]


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


class BulkSender:
    """Sends operations as bulk requests within the limits, retrying 429 / 5xx / connection failures with
    exponential backoff, logging refused items; :attr:`status` says how the cluster answers."""

    def __init__(self, client: Any, settings: ElasticsearchSettings, index: str, rejections: RejectionLog, *,
                 sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time, stop: threading.Event | None = None) -> None:
        self.client = client
        self.settings = settings
        self.index = index
        self.rejections = rejections
        self.sleep = sleep
        self.rng = rng or random.Random()
        self.clock = clock
        self.stop = stop or threading.Event()
        self.requests = 0
        self.retries = 0
        self.indexed = 0
        self.deleted = 0
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.last_success: float | None = None

    @property
    def status(self) -> dict[str, Any]:
        return {"reachable": self.consecutive_failures == 0, "consecutive_failures": self.consecutive_failures,
                "last_error": self.last_error, "last_success": self.last_success, "bulk_requests": self.requests,
                "retries": self.retries, "indexed": self.indexed, "deleted": self.deleted,
                "rejected": self.rejections.count}

    def chunks(self, ops: Sequence[BulkOp]) -> Iterable[list[BulkOp]]:
        cur: list[BulkOp] = []
        size = 0
        for op in ops:
            s = op.size()
            if cur and (len(cur) >= self.settings.batch_docs or size + s > self.settings.batch_bytes):
                yield cur
                cur, size = [], 0
            cur.append(op)
            size += s
        if cur:
            yield cur

    def _lines(self, ops: Sequence[BulkOp]) -> list[bytes]:
        lines: list[bytes] = []
        by_vb = self.settings.routing == "vbucket"
        for op in ops:
            meta: dict[str, Any] = {"_index": self.index, "_id": op.doc_id}
            if by_vb:
                meta["routing"] = str(op.vbucket)
            lines.append(orjson.dumps({op.action: meta}))
            if op.action == "index":
                assert op.source is not None
                lines.append(op.source)
        return lines

    def _backoff(self, attempt: int) -> None:
        cap = min(self.settings.backoff_max_s, self.settings.backoff_initial_s * (2 ** min(attempt, 30)))
        self.stop.wait(0) if self.stop.is_set() else self.sleep(self.rng.uniform(cap / 2, cap))

    def send(self, ops: Sequence[BulkOp]) -> None:
        """Every operation acknowledged or logged as rejected; raises :class:`ElasticsearchUnavailable` after
        ``max_retries`` failed retries (or when stopped while retrying)."""
        for chunk in self.chunks(ops):
            self._send_chunk(chunk)

    def _send_chunk(self, chunk: list[BulkOp]) -> None:
        from elasticsearch import ApiError, TransportError

        pending = chunk
        attempt = 0
        while pending:
            retry: list[BulkOp] = []
            try:
                self.requests += 1
                resp = self.client.options(request_timeout=self.settings.request_timeout_s).bulk(
                    operations=self._lines(pending))
                body = resp.body if hasattr(resp, "body") else resp
                rejected: list[tuple[BulkOp, int, Any]] = []
                for op, item in zip(pending, body["items"], strict=True):
                    res = next(iter(item.values()))
                    st = int(res.get("status", 500))
                    if 200 <= st < 300 or (op.action == "delete" and st == 404):
                        if op.action == "index":
                            self.indexed += 1
                        else:
                            self.deleted += 1
                    elif _retryable(st):
                        retry.append(op)
                        self.last_error = f"item status {st}: {res.get('error')}"
                    else:
                        rejected.append((op, st, res.get("error")))
                self.rejections.write(self.index, rejected)
                if not retry:
                    self.consecutive_failures = 0
                    self.last_success = self.clock()
                    return
            except ApiError as e:
                if not _retryable(int(e.meta.status)):
                    raise ElasticsearchUnavailable(f"bulk request to {self.index!r} refused: {e}") from e
                retry = pending
                self.last_error = f"status {e.meta.status}: {e}"
            except TransportError as e:  # no connection, timeout
                retry = pending
                self.last_error = f"{type(e).__name__}: {e}"
            self.consecutive_failures += 1
            if self.settings.max_retries is not None and attempt >= self.settings.max_retries:
                raise ElasticsearchUnavailable(
                    f"bulk request to {self.index!r} not acknowledged after {attempt} retries: {self.last_error}")
            if self.stop.is_set():
                raise ElasticsearchUnavailable(f"stopped while retrying a bulk request: {self.last_error}")
            log.warning("elasticsearch: %d operations not acknowledged (%s); retry %d", len(retry),
                        self.last_error, attempt + 1)
            self._backoff(attempt)
            attempt += 1
            self.retries += 1
            pending = retry


#: the local copy of the indexed versions, in the consumer's state file (same transaction as the positions)
_SCHEMA = ("CREATE TABLE IF NOT EXISTS search_es_docs (key BLOB PRIMARY KEY, vbucket INTEGER NOT NULL, "
           "seqno INTEGER NOT NULL, value BLOB NOT NULL) WITHOUT ROWID")


class ElasticsearchBackend:
    """Turns snapshots and rollback instructions into bulk operations (see the module docstring).

    ``conn``: the consumer state file's connection (the local copy lives there, in the consumer's
    transaction). Pending operations are kept per document id, last one wins, and sent by :meth:`flush`
    (called before each commit of the state file by :class:`BulkCommitStore`) or earlier when they exceed the
    batch limits."""

    def __init__(self, settings: ElasticsearchSettings, topic: str, state_dir: Path, conn: sqlite3.Connection, *,
                 client: Any = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.index = settings.index or index_name_for_topic(topic)
        self.conn = conn
        conn.execute(_SCHEMA)
        if client is None:
            from elasticsearch import Elasticsearch

            client = Elasticsearch(settings.url, request_timeout=settings.request_timeout_s)
        self.client = client
        self.clock = clock
        self.stop = threading.Event()
        self.rejections = RejectionLog(Path(state_dir) / "rejections.jsonl")
        self.sender = BulkSender(client, settings, self.index, self.rejections, sleep=sleep, rng=rng,
                                 stop=self.stop)
        self._pending: dict[bytes, BulkOp] = {}
        self._pending_bytes = 0
        self._oldest: float | None = None
        self._index_ready = False
        #: documents the backend did not send: binary (not JSON) or JSON that is not an object
        self.skipped_binary = 0
        self.skipped_not_object = 0
        #: keys that are not UTF-8 (an Elasticsearch ``_id`` is a string): logged as rejections
        self.skipped_bad_key = 0
        self.commits = 0
        self.commit_seconds = 0.0

    # ------------------------------------------------------------------------------------------ the index
    def ensure_index(self) -> None:
        """Create the index when it does not exist (retried like a bulk request while unreachable)."""
        from elasticsearch import ApiError, TransportError

        attempt = 0
        while not self._index_ready:
            try:
                if not self.client.indices.exists(index=self.index):
                    kw = {"settings": dict(self.settings.index_settings)} if self.settings.index_settings else {}
                    self.client.indices.create(index=self.index, **kw)
                self._index_ready = True
            except ApiError as e:
                if e.meta.status == 400 and "resource_already_exists" in str(e):
                    self._index_ready = True
                    break
                if not _retryable(int(e.meta.status)):
                    raise ElasticsearchUnavailable(f"cannot create the index {self.index!r}: {e}") from e
                self._failed(attempt, f"status {e.meta.status}: {e}")
                attempt += 1
            except TransportError as e:
                self._failed(attempt, f"{type(e).__name__}: {e}")
                attempt += 1

    def _failed(self, attempt: int, error: str) -> None:
        s = self.sender
        s.consecutive_failures += 1
        s.last_error = error
        if self.settings.max_retries is not None and attempt >= self.settings.max_retries:
            raise ElasticsearchUnavailable(f"{self.settings.url}: not reachable after {attempt} retries: {error}")
        if self.stop.is_set():
            raise ElasticsearchUnavailable(f"stopped while waiting for {self.settings.url}: {error}")
        log.warning("elasticsearch %s: %s; retry %d", self.settings.url, error, attempt + 1)
        s.retries += 1
        s._backoff(attempt)

    # ---------------------------------------------------------------------------------------- priors
    def priors(self, vbucket: int, keys: Sequence[bytes]) -> dict[bytes, Prior]:
        """The mutation log's ``prior_lookup``: the versions the index holds (from the local copy)."""
        out: dict[bytes, Prior] = {}
        for i in range(0, len(keys), 500):
            chunk = list(keys[i:i + 500])
            q = f"SELECT key, value, seqno FROM search_es_docs WHERE key IN ({','.join('?' * len(chunk))})"
            for k, v, s in self.conn.execute(q, chunk):
                out[bytes(k)] = (bytes(v), int(s))
        return out

    # ---------------------------------------------------------------------------------------- applying
    def _source(self, key: bytes, value: bytes, datatype: int) -> bytes | None:
        if not datatype & DATATYPE_JSON:
            self.skipped_binary += 1
            return None
        try:
            doc = orjson.loads(value)
        except orjson.JSONDecodeError:
            self.skipped_binary += 1
            return None
        if not isinstance(doc, dict):
            self.skipped_not_object += 1
            return None
        return orjson.dumps(doc)

    def _put(self, op: BulkOp) -> None:
        try:
            op.doc_id  # noqa: B018 - an Elasticsearch _id is a string
        except UnicodeDecodeError:
            self.skipped_bad_key += 1
            self.rejections.write(self.index, [(op, 0, {"type": "key_not_utf8",
                                                        "reason": "the key is not UTF-8: no _id for it"})])
            return
        old = self._pending.get(op.key)
        if old is not None:
            self._pending_bytes -= old.size()
        self._pending[op.key] = op
        self._pending_bytes += op.size()
        if self._oldest is None:
            self._oldest = self.clock()

    def _set(self, key: bytes, vbucket: int, seqno: int, value: bytes, datatype: int) -> None:
        self.conn.execute("INSERT OR REPLACE INTO search_es_docs VALUES (?, ?, ?, ?)",
                          (key, vbucket, seqno, value))
        src = self._source(key, value, datatype)
        if src is None:  # not indexable: make sure an older JSON version is not left behind
            self._put(BulkOp("delete", key, vbucket, seqno))
        else:
            self._put(BulkOp("index", key, vbucket, seqno, src))

    def _delete(self, key: bytes, vbucket: int, seqno: int) -> None:
        self.conn.execute("DELETE FROM search_es_docs WHERE key = ?", (key,))
        self._put(BulkOp("delete", key, vbucket, seqno))

    def apply_changes(self, vbucket: int, changes: Iterable[Any]) -> None:
        """Apply a complete snapshot's changes (``connectors.client.replay.Change``), in seqno order."""
        for c in changes:
            if c.deleted:
                self._delete(c.key, vbucket, c.seqno)
            else:
                self._set(c.key, vbucket, c.seqno, c.value, c.datatype)
        self.maybe_send()

    def apply_rollback(self, vbucket: int, undo: Iterable[Any], rebuild_from_zero: bool) -> None:
        """Restore the versions the undo list names (``prior_value`` None: delete), or delete every document
        of the vbucket (rebuild from zero)."""
        if rebuild_from_zero:
            keys = [bytes(k) for (k,) in self.conn.execute("SELECT key FROM search_es_docs WHERE vbucket = ?",
                                                          (vbucket,))]
            for k in keys:
                self._delete(k, vbucket, 0)
        else:
            for u in undo:
                if u.prior_value is None:
                    self._delete(u.key, vbucket, u.prior_seqno)
                else:
                    # the local copy keeps no datatype: a restored value is JSON if it parses as JSON
                    self._set(u.key, vbucket, u.prior_seqno, u.prior_value, DATATYPE_JSON)
        self.maybe_send()

    # ---------------------------------------------------------------------------------------- sending
    @property
    def pending(self) -> int:
        return len(self._pending)

    def maybe_send(self) -> None:
        """Send early when the pending operations exceed a batch limit or waited ``batch_ms`` (the cluster may
        be ahead of the positions, never behind)."""
        s = self.settings
        if self._pending and (len(self._pending) >= s.batch_docs or self._pending_bytes >= s.batch_bytes
                              or (self._oldest is not None
                                  and (self.clock() - self._oldest) * 1000 >= s.batch_ms)):
            self.flush()

    def flush(self) -> None:
        """Send every pending operation; returns once each was acknowledged or logged as rejected."""
        if not self._pending:
            return
        self.ensure_index()
        ops = list(self._pending.values())
        self.sender.send(ops)
        self._pending.clear()
        self._pending_bytes = 0
        self._oldest = None

    def discard(self) -> None:
        """Forget the pending operations (their transaction is rolled back: they are delivered again)."""
        self._pending.clear()
        self._pending_bytes = 0
        self._oldest = None

    def refresh(self) -> None:
        self.client.indices.refresh(index=self.index)

    def docs(self) -> dict[bytes, dict[str, Any]]:
        """Every document of the index (refreshed first): key -> ``_source`` (tests, small indexes)."""
        self.refresh()
        out: dict[bytes, dict[str, Any]] = {}
        resp = self.client.search(index=self.index, query={"match_all": {}}, size=1000, scroll="1m")
        while True:
            hits = resp["hits"]["hits"]
            if not hits:
                break
            for h in hits:
                out[h["_id"].encode()] = h["_source"]
            resp = self.client.scroll(scroll_id=resp["_scroll_id"], scroll="1m")
        return out

    def status(self) -> dict[str, Any]:
        return {"backend": "elasticsearch", "url": self.settings.url, "index": self.index,
                "routing": self.settings.routing, "pending": len(self._pending), **self.sender.status,
                "skipped_binary": self.skipped_binary, "skipped_not_object": self.skipped_not_object,
                "rejection_log": str(self.rejections.path)}

    def close(self) -> None:
        self.stop.set()
        self.client.close()


class BulkCommitStore(SqliteStateStore):
    """The consumer's SQLite state store, committing only after the backend's pending bulk operations were
    acknowledged (``before_commit`` is called first; if it raises, nothing is committed)."""

    def __init__(self, path: str | Path, topic: str) -> None:
        super().__init__(path, topic)
        self.before_commit: Callable[[], None] = lambda: None
        self.on_commit: Callable[[float], None] = lambda seconds: None

    def save(self, states: Iterable[ConsumerPosition], partition_offsets: Mapping[int, int], *,
             durable: bool = True) -> None:
        super().save(states, partition_offsets, durable=False)
        if durable:
            self.flush()

    def abandon(self) -> None:
        """Roll back the open transaction, every event in it (they are delivered again after a restart)."""
        self._in_event = False
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def flush(self) -> None:
        if self.conn.in_transaction and not self._in_event:
            t = time.perf_counter()
            self.before_commit()
            super().flush()
            self.on_commit(time.perf_counter() - t)
        else:
            super().flush()


class ElasticsearchIndexer:
    """Indexes ``topic`` into an Elasticsearch index: the rollback-aware consumer (state, mutation log and the
    local copy in ``state_dir/es-state.sqlite``) feeding an :class:`ElasticsearchBackend`."""

    def __init__(self, kafka: str | Mapping[str, Any], topic: str, state_dir: str | Path,
                 settings: ElasticsearchSettings, *, client: Any = None, group_commit: int = 256,
                 sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> None:
        from connectors.client.consumer import ChangeStreamConsumer

        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = BulkCommitStore(self.state_dir / "es-state.sqlite", topic)
        self.backend = ElasticsearchBackend(settings, topic, self.state_dir, self.store.conn, client=client,
                                            sleep=sleep, rng=rng)
        self.store.before_commit = self.backend.flush
        self.store.on_commit = self._committed
        self.consumer = ChangeStreamConsumer(kafka, topic, state_store=self.store,
                                             prior_lookup=self.backend.priors, group_commit=group_commit)
        self.snapshots = 0
        self.rollbacks = 0
        self.changes = 0

    def _committed(self, seconds: float) -> None:
        self.backend.commits += 1
        self.backend.commit_seconds += seconds

    def _on_snapshot(self, snap: Any) -> None:
        self.backend.apply_changes(snap.vbucket, snap.changes)
        self.snapshots += 1
        self.changes += len(snap.changes)

    def _on_rollback(self, rb: Any) -> None:
        self.backend.apply_rollback(rb.vbucket, rb.undo, rb.rebuild_from_zero)
        self.rollbacks += 1

    def run(self, until_caught_up: bool = False) -> None:
        """Consume until stopped (or caught up); returns with everything applied committed."""
        self.backend.ensure_index()
        self.consumer.run(self._on_snapshot, self._on_rollback, until_caught_up=until_caught_up)

    def positions(self) -> dict[int, int]:
        """vbucket -> the seqno the committed positions (and so the index) reflect."""
        return {vb: p.seqno for vb, p in self.store.load_all().items()}

    def status(self) -> dict[str, Any]:
        return {**self.backend.status(), "snapshots": self.snapshots, "rollbacks": self.rollbacks,
                "changes": self.changes, "commits": self.backend.commits,
                "commit_seconds": round(self.backend.commit_seconds, 6)}

    def stop(self) -> None:
        """Thread- and signal-safe: ``run`` returns (a bulk being retried gives up: nothing is committed)."""
        self.backend.stop.set()
        self.consumer.stop()

    def abandon(self) -> None:
        """Drop every operation not committed yet (the local copy and positions roll back with them)."""
        self.backend.discard()
        self.store.abandon()

    def close(self) -> None:
        if self.store.conn.in_transaction:
            # run() raised before its last commit (the cluster did not acknowledge, or the application
            # stopped): what was not committed is delivered again on the next start, as after a kill -9
            self.abandon()
        self.consumer.close()
        self.backend.close()
