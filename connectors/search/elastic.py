"""The Elasticsearch / OpenSearch backend of the search indexer (docs/search.md "Elasticsearch / OpenSearch").

An :class:`~connectors.search.backend.IndexBackend`: the indexer's document store stays the source of truth
(rollback restores included, connectors/search/backend.py); this backend projects it into an index of a search
cluster through the ``_bulk`` API of the official client of its flavor (``elasticsearch`` 8.x or
``opensearch-py``: connectors/search/cluster_api.py, the only place where the two differ).

* **Staging and limits.** :meth:`ElasticsearchBackend.apply` keeps at most one operation per document id (the
  last one wins) and sends a bulk request as soon as the staged operations reach ``batch_docs`` operations,
  ``batch_bytes`` bytes of NDJSON or wait ``batch_ms``; :meth:`~ElasticsearchBackend.commit` sends the rest.
  Each bulk request holds at most ``batch_docs`` operations and about ``batch_bytes`` bytes.
* **Checkpoint after the bulk.** :meth:`~ElasticsearchBackend.commit` returns once every staged operation was
  acknowledged (or refused, see rejections), refreshes the index, and only then writes the checkpoint
  (generation + per-vbucket positions) as one document of the checkpoint index ``<index>-dcpgw-checkpoint``.
  The cluster may hold operations above its checkpoint (a crash between the two), never a checkpoint above
  its operations: on restart the indexer applies again everything above the checkpoint's generation, and since
  every operation replaces or deletes a whole document, applying it twice gives the same index. The checkpoint
  lives in the cluster, next to the index: an index deleted or restored from a snapshot carries its own
  checkpoint (or none: rebuilt from the store).
* **Retries.** 429 and 5xx answers (of a whole request or of single items) and connection failures are retried
  with exponential backoff (``backoff_initial_s`` doubling up to ``backoff_max_s``, jittered by the injected
  random source), ``max_retries`` times (default 3; None: until the cluster answers), then
  :class:`ElasticsearchUnavailable`: the indexer keeps consuming into its document store and tries again later
  (connectors/search/indexer.py). The checkpoint does not move while a batch is not acknowledged, so nothing
  is lost either way; :meth:`~ElasticsearchBackend.status` shows the cluster's state.
* **Rejections.** An item the cluster refuses with any other status (a mapping conflict, a document too large)
  is appended to the rejection log (``rejections.jsonl`` in the state directory: one JSON object per line) and
  counted; indexing goes on.
* **Too large (413).** A bulk request refused whole with 413 Payload Too Large (Elasticsearch's
  ``http.max_content_length``, a proxy's body limit) is split in halves, each sent on its own, down to one
  operation; one operation refused with 413 goes to the rejection log and indexing goes on.
* **Routing.** ``key`` (default): Elasticsearch's own routing by ``_id``. ``vbucket``: ``routing=<vbucket>``,
  every document of a vbucket on one shard (a read by id must then pass the same routing).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from connectors.exceptions import ConnectorError
from connectors.search.backend import (
    ApplyStats,
    Checkpoint,
    Delete,
    Hit,
    IndexOp,
    SearchError,
    SearchResult,
)
from connectors.search.cluster_api import (
    FLAVORS,
    ClusterApi,
    ClusterRefused,
    ClusterUnreachable,
    ElasticsearchApi,
    Flavor,
    OpenSearchApi,
    connect,
)

__all__ = [
    "CHECKPOINT_SUFFIX",
    "BulkOp",
    "BulkSender",
    "ElasticsearchBackend",
    "ElasticsearchConfigError",
    "ElasticsearchSettings",
    "ElasticsearchUnavailable",
    "RejectionLog",
    "check_index_name",
    "index_name_for_topic",
]

log = logging.getLogger(__name__)

#: characters Elasticsearch refuses in an index name (its MetadataCreateIndexService.validateIndexOrAliasName)
_ILLEGAL = set('\\/*?"<>| ,#:')
_MAX_NAME_BYTES = 255
#: the checkpoint index of index ``x`` is ``x`` + this suffix
CHECKPOINT_SUFFIX = "-dcpgw-checkpoint"
_CHECKPOINT_ID = "checkpoint"
#: retries of a search request (429 / 5xx / no connection) before the query API answers 503
SEARCH_RETRIES = 2


class ElasticsearchConfigError(ConnectorError):
    """A bad setting of the Elasticsearch backend (index name, routing, limits, URL)."""


class ElasticsearchUnavailable(ConnectorError):
    """The cluster did not acknowledge a request within ``max_retries`` retries (or refused it outright)."""


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
    ``-``, ``_``, ``+`` and ``.`` removed (a leading dot makes a hidden index), cut so that the checkpoint
    index name fits 255 bytes too. ``dcp.default`` stays ``dcp.default``."""
    s = "".join("_" if c in _ILLEGAL else c for c in topic.lower())
    s = re.sub(r"^[-_+.]+", "", s)
    s = s.encode()[:_MAX_NAME_BYTES - len(CHECKPOINT_SUFFIX)].decode("utf-8", "ignore")
    return check_index_name(s or "dcp")


@dataclass(frozen=True)
class ElasticsearchSettings:
    """How the backend talks to the cluster (docs/search.md "Elasticsearch / OpenSearch")."""

    url: str
    #: the cluster's client library: ``elasticsearch`` (8.x) or ``opensearch`` (``opensearch-py``)
    flavor: Flavor = "elasticsearch"
    #: the index (None: :func:`index_name_for_topic` of the topic); checked by :func:`check_index_name`
    index: str | None = None
    #: ``key``: Elasticsearch's default routing (by ``_id``); ``vbucket``: ``routing=<vbucket>``
    routing: Literal["key", "vbucket"] = "key"
    #: a bulk request holds at most this many operations ...
    batch_docs: int = 1000
    #: ... and at most about this many bytes of NDJSON (one larger document goes alone)
    batch_bytes: int = 5 << 20
    #: staged operations wait at most this long before a bulk request is sent
    batch_ms: int = 1000
    #: retries of a request (whole or items) on 429 / 5xx / no connection, then ElasticsearchUnavailable (the
    #: indexer keeps consuming into its document store and tries again later, docs/search.md "Backend
    #: failures"); None: until it answers (the caller blocks meanwhile)
    max_retries: int | None = 3
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 30.0
    request_timeout_s: float = 30.0
    #: the body of the index creation (``settings``, ``mappings``) when the index does not exist
    index_body: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not re.match(r"^https?://[^/\s]", self.url):
            raise ElasticsearchConfigError(f"--es-url {self.url!r}: must be an http:// or https:// URL")
        if self.flavor not in FLAVORS:
            raise ElasticsearchConfigError(f"flavor {self.flavor!r}: must be 'elasticsearch' or 'opensearch'")
        if self.index is not None:
            check_index_name(self.index)
            if len((self.index + CHECKPOINT_SUFFIX).encode()) > _MAX_NAME_BYTES:
                raise ElasticsearchConfigError(f"index name {self.index!r}: too long for its checkpoint index "
                                               f"({self.index}{CHECKPOINT_SUFFIX}, 255 bytes at most)")
        if self.routing not in ("key", "vbucket"):
            raise ElasticsearchConfigError(f"--es-routing {self.routing!r}: must be 'key' or 'vbucket'")
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
    key: str
    vbucket: int
    seqno: int
    source: bytes | None = None

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
                f.write(orjson.dumps({"time": now, "index": index, "key": _printable(op.key),
                                      "vbucket": op.vbucket, "seqno": op.seqno, "action": op.action,
                                      "status": status, "error": error}) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self.count += len(items)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_bytes().splitlines() if line.strip()]


def _printable(key: str) -> str:
    return key.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


#: a request the cluster (or a proxy in front of it) refuses as too large: split in halves, then rejected
_TOO_LARGE = 413


class BulkSender:
    """Sends operations as bulk requests within the limits, retrying 429 / 5xx / connection failures with
    exponential backoff, logging refused items; :attr:`status` says how the cluster answers."""

    def __init__(self, api: ClusterApi, settings: ElasticsearchSettings, index: str, rejections: RejectionLog, *,
                 sleep: Callable[[float], Any] | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time, stop: threading.Event | None = None) -> None:
        self.api = api
        self.settings = settings
        self.index = index
        self.rejections = rejections
        self.stop = stop or threading.Event()
        #: waits between retries (default: the stop event's wait, so that stopping cuts a backoff short)
        self.sleep = sleep or self.stop.wait
        self.rng = rng or random.Random()
        self.clock = clock
        self.requests = 0
        self.retries = 0
        #: bulk requests refused as too large (413) and sent again as two halves
        self.splits = 0
        self.indexed = 0
        self.deleted = 0
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.last_success: float | None = None

    @property
    def status(self) -> dict[str, Any]:
        return {"reachable": self.consecutive_failures == 0, "consecutive_failures": self.consecutive_failures,
                "last_error": self.last_error, "last_success": self.last_success, "bulk_requests": self.requests,
                "retries": self.retries, "splits": self.splits, "indexed": self.indexed, "deleted": self.deleted,
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
            meta: dict[str, Any] = {"_index": self.index, "_id": op.key}
            if by_vb:
                meta["routing"] = str(op.vbucket)
            lines.append(orjson.dumps({op.action: meta}))
            if op.action == "index":
                assert op.source is not None
                lines.append(op.source)
        return lines

    def _backoff(self, attempt: int) -> None:
        cap = min(self.settings.backoff_max_s, self.settings.backoff_initial_s * (2 ** min(attempt, 30)))
        if not self.stop.is_set():
            self.sleep(self.rng.uniform(cap / 2, cap))

    def send(self, ops: Sequence[BulkOp]) -> None:
        """Every operation acknowledged or logged as rejected; raises :class:`ElasticsearchUnavailable` after
        ``max_retries`` failed retries (or when stopped while retrying)."""
        for chunk in self.chunks(ops):
            self._send_chunk(chunk)

    def _send_chunk(self, chunk: list[BulkOp]) -> None:
        pending = chunk
        attempt = 0
        while pending:
            retry: list[BulkOp] = []
            try:
                self.requests += 1
                body = self.api.bulk(self._lines(pending), self.settings.request_timeout_s)
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
            except ClusterRefused as e:
                if e.status == _TOO_LARGE:
                    self._too_large(pending, e)
                    return
                if not _retryable(e.status):
                    raise ElasticsearchUnavailable(f"bulk request to {self.index!r} refused: {e}") from e
                retry = pending
                self.last_error = f"status {e.status}: {e}"
            except ClusterUnreachable as e:  # no connection, timeout
                retry = pending
                self.last_error = str(e)
            self.consecutive_failures += 1
            if self.settings.max_retries is not None and attempt >= self.settings.max_retries:
                raise ElasticsearchUnavailable(
                    f"bulk request to {self.index!r} not acknowledged after {attempt} retries: {self.last_error}")
            if self.stop.is_set():
                raise ElasticsearchUnavailable(f"stopped while retrying a bulk request: {self.last_error}")
            log.warning("%s: %d operations not acknowledged (%s); retry %d", self.api.flavor, len(retry),
                        self.last_error, attempt + 1)
            self._backoff(attempt)
            attempt += 1
            self.retries += 1
            pending = retry

    def _too_large(self, ops: list[BulkOp], e: ClusterRefused) -> None:
        """A bulk request refused with 413: its halves are sent on their own (each split again while refused);
        one operation refused so goes to the rejection log."""
        self.consecutive_failures = 0  # the cluster answered
        if len(ops) == 1:
            log.warning("%s: one operation (%r) refused as too large (413): rejected", self.api.flavor,
                        _printable(ops[0].key))
            self.rejections.write(self.index, [(ops[0], _TOO_LARGE, _error_object(e))])
            return
        self.splits += 1
        half = len(ops) // 2
        log.info("%s: a bulk request of %d operations refused as too large (413): sent as two halves",
                 self.api.flavor, len(ops))
        self._send_chunk(ops[:half])
        self._send_chunk(ops[half:])

    def call(self, what: str, fn: Callable[[], Any], max_retries: int | None = -1) -> Any:
        """``fn()`` (one request), retried like a bulk request on 429 / 5xx / no connection (``max_retries``:
        -1 = the settings'); another refusal raises :class:`ElasticsearchUnavailable`."""
        limit = self.settings.max_retries if max_retries == -1 else max_retries
        attempt = 0
        while True:
            try:
                out = fn()
                self.consecutive_failures = 0
                self.last_success = self.clock()
                return out
            except ClusterRefused as e:
                if not _retryable(e.status):
                    raise ElasticsearchUnavailable(f"{what}: refused by the cluster: {e}") from e
                self.last_error = f"{what}: status {e.status}: {e}"
            except ClusterUnreachable as e:
                self.last_error = f"{what}: {e}"
            self.consecutive_failures += 1
            if limit is not None and attempt >= limit:
                raise ElasticsearchUnavailable(f"{what}: not acknowledged after {attempt} retries: "
                                               f"{self.last_error}")
            if self.stop.is_set():
                raise ElasticsearchUnavailable(f"stopped while retrying: {self.last_error}")
            log.warning("%s: %s; retry %d", self.api.flavor, self.last_error, attempt + 1)
            self._backoff(attempt)
            attempt += 1
            self.retries += 1


class ElasticsearchBackend:
    """:class:`~connectors.search.backend.IndexBackend` on an index of an Elasticsearch or OpenSearch cluster
    (``settings.flavor``); see the module docstring. ``state_dir`` holds the rejection log. ``client``: the
    flavor's official client object (default: one for ``settings.url``, built by
    :func:`connectors.search.cluster_api.connect`). ``clock`` (monotonic seconds), ``sleep`` and ``rng`` are
    injected for the batch timer and the backoff."""

    def __init__(self, settings: ElasticsearchSettings, state_dir: str | Path, *, topic: str = "dcp",
                 client: Any = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] | None = None, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.index = settings.index or index_name_for_topic(topic)
        self.checkpoint_index = self.index + CHECKPOINT_SUFFIX
        if client is None:
            self.api = connect(settings.flavor, settings.url, settings.request_timeout_s)
        elif settings.flavor == "opensearch":
            self.api = OpenSearchApi(client)
        else:
            self.api = ElasticsearchApi(client)
        #: the official client object (reads the backend does not need: by id with routing, ...)
        self.client = self.api.client
        self.clock = clock
        self.stop = threading.Event()
        self.rejections = RejectionLog(Path(state_dir) / "rejections.jsonl")
        self.sender = BulkSender(self.api, settings, self.index, self.rejections, sleep=sleep, rng=rng,
                                 stop=self.stop)
        self._staged: dict[str, BulkOp] = {}
        self._staged_bytes = 0
        self._oldest: float | None = None
        self._ready = False
        #: rejections not yet reported in an ApplyStats (found while committing)
        self._unreported_rejections = 0
        self.commits = 0
        self.commit_seconds = 0.0

    # ------------------------------------------------------------------------------------------ indexes
    def _ensure_indexes(self) -> None:
        if self._ready:
            return
        def create(name: str, body: Mapping[str, Any]) -> None:
            if self.api.index_exists(name):
                return
            try:
                self.api.create_index(name, body)
            except ClusterRefused as e:
                if e.status != 400 or "resource_already_exists" not in str(e):
                    raise

        self.sender.call(f"create the index {self.index!r}", lambda: create(self.index, self.settings.index_body))
        # the checkpoint index indexes nothing of its one document (its positions are kept as a JSON string)
        self.sender.call(f"create the index {self.checkpoint_index!r}",
                         lambda: create(self.checkpoint_index, {"mappings": {"dynamic": False}}))
        self._ready = True

    # ------------------------------------------------------------------------------------------ writing
    def apply(self, ops: Sequence[IndexOp]) -> ApplyStats:
        st = ApplyStats()
        for op in ops:
            if isinstance(op, Delete):
                self._stage(BulkOp("delete", op.key, op.vbucket, op.seqno), st)
                st.deleted += 1
                continue
            try:
                doc = orjson.loads(op.value)
            except orjson.JSONDecodeError:
                doc = None
            if not isinstance(doc, dict):
                # binary (or a JSON scalar / array: no _source for it): not indexed, and no older version left
                st.binary_skipped += 1
                self._stage(BulkOp("delete", op.key, op.vbucket, op.seqno), st)
                continue
            self._stage(BulkOp("index", op.key, op.vbucket, op.seqno, orjson.dumps(doc)), st)
            st.indexed += 1
        before = self.rejections.count
        try:
            self._maybe_send()
        except BaseException:
            self.discard()
            raise
        st.rejected += self.rejections.count - before + self._unreported_rejections
        self._unreported_rejections = 0
        return st

    def _stage(self, op: BulkOp, st: ApplyStats) -> None:
        try:
            op.key.encode("utf-8")
        except UnicodeEncodeError:  # an _id is a UTF-8 string
            self.rejections.write(self.index, [(op, 0, {"type": "key_not_utf8",
                                                        "reason": "the key is not UTF-8: it cannot be an _id"})])
            st.rejected += 1
            return
        old = self._staged.pop(op.key, None)
        if old is not None:
            self._staged_bytes -= old.size()
        self._staged[op.key] = op
        self._staged_bytes += op.size()
        if self._oldest is None:
            self._oldest = self.clock()

    @property
    def staged(self) -> int:
        return len(self._staged)

    def _maybe_send(self) -> None:
        s = self.settings
        if self._staged and (len(self._staged) >= s.batch_docs or self._staged_bytes >= s.batch_bytes
                             or (self._oldest is not None and (self.clock() - self._oldest) * 1000 >= s.batch_ms)):
            self._send()

    def _send(self) -> None:
        if not self._staged:
            return
        self._ensure_indexes()
        self.sender.send(list(self._staged.values()))
        self._staged.clear()
        self._staged_bytes = 0
        self._oldest = None

    def commit(self, checkpoint: Checkpoint) -> None:
        """Send what is staged, refresh, then write the checkpoint (never before its operations). On
        :class:`ElasticsearchUnavailable` the staged operations are dropped: the indexer applies everything above
        the checkpoint's generation again."""
        t = time.perf_counter()
        before = self.rejections.count
        try:
            self._ensure_indexes()
            self._send()
        except BaseException:
            self.discard()
            raise
        self._unreported_rejections += self.rejections.count - before
        self.sender.call("refresh", lambda: self.api.refresh(self.index))
        body = {"checkpoint": json.dumps(checkpoint.to_json()), "index": self.index}
        self.sender.call("write the checkpoint", lambda: self.api.put(self.checkpoint_index, _CHECKPOINT_ID, body))
        self.commits += 1
        self.commit_seconds += time.perf_counter() - t

    def discard(self) -> None:
        """Forget the staged operations (the indexer applies them again from its store)."""
        self._staged.clear()
        self._staged_bytes = 0
        self._oldest = None

    def checkpoint(self, max_retries: int | None = None) -> Checkpoint | None:
        """The checkpoint document; read at start, so by default retried until the cluster answers (an
        indexer cannot start without it)."""
        def read() -> Checkpoint | None:
            src = self.api.get_source(self.checkpoint_index, _CHECKPOINT_ID)
            return None if src is None else Checkpoint.from_json(json.loads(src["checkpoint"]))

        return self.sender.call("read the checkpoint", read, max_retries)  # type: ignore[no-any-return]

    def reset(self) -> None:
        """Delete every document of the index and the checkpoint (the index itself, with its mappings, stays)."""
        self.discard()
        self._ensure_indexes()
        self.sender.call("delete the documents", lambda: self.api.delete_all(self.index))
        self.sender.call("delete the checkpoint", lambda: self.api.delete_all(self.checkpoint_index))

    # ------------------------------------------------------------------------------------------ reading
    def search(self, query: str, limit: int = 10, offset: int = 0) -> SearchResult:
        """The cluster's ``query_string`` syntax (Lucene's: ``field:value``, ``AND``/``OR``/``-``, phrases,
        ranges); an empty query matches everything. The checkpoint is read *before* the search: the answer
        reflects at least its positions."""
        # a query waits for a few retries at most (not for the cluster to come back, as indexing does)
        cp = self.checkpoint(SEARCH_RETRIES)
        try:
            r = self.sender.call("search", lambda: self.api.search(self.index, query, limit, offset), SEARCH_RETRIES)
        except ElasticsearchUnavailable as e:
            cause = e.__cause__
            if isinstance(cause, ClusterRefused) and cause.status == 400:
                raise SearchError(_reason(cause)) from e
            raise
        hits = [Hit(h["_id"], float(h.get("_score") or 0.0), dict(h.get("_source") or {}))
                for h in r["hits"]["hits"]]
        total = r["hits"]["total"]
        return SearchResult(hits, int(total["value"] if isinstance(total, dict) else total), cp)

    def docs(self) -> dict[str, dict[str, Any]]:
        """Every document of the index (refreshed first): key -> ``_source`` (tests, small indexes)."""
        self.api.refresh(self.index)
        return {h["_id"]: h["_source"] for h in self.api.scan(self.index)}

    def status(self) -> dict[str, Any]:
        return {"backend": self.settings.flavor, "url": self.settings.url, "index": self.index,
                "routing": self.settings.routing, "staged": len(self._staged), **self.sender.status,
                "commits": self.commits, "rejection_log": str(self.rejections.path)}

    def close(self) -> None:
        self.stop.set()
        self.api.close()


def _error_object(e: ClusterRefused) -> Any:
    """The cluster's ``error`` object of an answer (a 413 of a proxy has none: a made-up one)."""
    body = e.body
    if isinstance(body, dict) and body.get("error"):
        return body["error"]
    return {"type": "request_too_large" if e.status == _TOO_LARGE else "http_error",
            "reason": f"status {e.status}: {str(e)[:300]}"}


def _reason(e: Any) -> str:
    """The root cause's reason of an Elasticsearch error answer (what a 400 JSON body should say)."""
    try:
        err = e.body["error"]
        causes = err.get("root_cause") or [err]
        return str(causes[0].get("reason") or err.get("reason") or e)
    except (AttributeError, KeyError, TypeError, IndexError):
        return str(e)
