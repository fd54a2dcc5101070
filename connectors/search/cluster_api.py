"""The search cluster's client library, one class per flavor (docs/search.md "Elasticsearch / OpenSearch").

The cluster backend (connectors/search/elastic.py) does its batching, retries, checkpoints and rejection log
once, on :class:`ClusterApi`; what differs between Elasticsearch and OpenSearch is only here: which official
client is built (``elasticsearch`` 8.x, which refuses a server that does not answer ``X-Elastic-Product:
Elasticsearch``, or ``opensearch-py``), how its calls are spelled, and which exceptions it raises. Every call
either returns the cluster's JSON answer or raises one of two typed errors:

* :class:`ClusterRefused` -- the cluster answered with an HTTP error status (``status``, its JSON ``body``);
* :class:`ClusterUnreachable` -- no answer: connection refused, reset, timeout, TLS failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Protocol

from connectors.exceptions import ConnectorError

__all__ = ["FLAVORS", "ClusterApi", "ClusterRefused", "ClusterUnreachable", "ElasticsearchApi", "Flavor",
           "OpenSearchApi", "connect"]

Flavor = Literal["elasticsearch", "opensearch"]
FLAVORS: tuple[Flavor, ...] = ("elasticsearch", "opensearch")


class ClusterRefused(ConnectorError):
    """The cluster answered a request with an error ``status`` (``body``: its JSON answer, if any)."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class ClusterUnreachable(ConnectorError):
    """The request got no answer (connection refused or reset, timeout)."""


class ClusterApi(Protocol):
    """What the cluster backend asks of a cluster; every method raises :class:`ClusterRefused` or
    :class:`ClusterUnreachable` for a failed request."""

    flavor: Flavor
    #: the official client object (for callers that need more than this protocol, e.g. tests reading by id)
    client: Any

    def bulk(self, lines: Sequence[bytes], timeout_s: float) -> dict[str, Any]: ...
    def index_exists(self, index: str) -> bool: ...
    def create_index(self, index: str, body: Mapping[str, Any]) -> None: ...
    def refresh(self, index: str) -> None: ...
    def put(self, index: str, doc_id: str, doc: Mapping[str, Any]) -> None: ...
    def get_source(self, index: str, doc_id: str) -> dict[str, Any] | None: ...
    def delete_all(self, index: str) -> None: ...
    def search(self, index: str, query: str, size: int, offset: int) -> dict[str, Any]: ...
    def scan(self, index: str) -> Iterator[dict[str, Any]]: ...
    def close(self) -> None: ...


def _body(x: Any) -> Any:
    return x.body if hasattr(x, "body") else x


class ElasticsearchApi:
    """The ``elasticsearch`` 8.x client (``elasticsearch>=8.15,<9``)."""

    flavor: Flavor = "elasticsearch"

    def __init__(self, client: Any) -> None:
        self.client = client

    @classmethod
    def connect(cls, url: str, timeout_s: float) -> ElasticsearchApi:
        from elasticsearch import Elasticsearch

        # the transport's own retries (immediate, no backoff) are off: the backend retries, with backoff
        return cls(Elasticsearch(url, request_timeout=timeout_s, max_retries=0, retry_on_status=(),
                                 retry_on_timeout=False))

    @contextmanager
    def _errors(self) -> Iterator[None]:
        from elasticsearch import ApiError, TransportError

        try:
            yield
        except ApiError as e:
            raise ClusterRefused(int(e.meta.status), str(e), e.body) from e
        except TransportError as e:  # no connection, timeout
            raise ClusterUnreachable(f"{type(e).__name__}: {e}") from e

    def _call(self, fn: Callable[[], Any]) -> Any:
        with self._errors():
            return _body(fn())

    def bulk(self, lines: Sequence[bytes], timeout_s: float) -> dict[str, Any]:
        return self._call(lambda: self.client.options(request_timeout=timeout_s).bulk(  # type: ignore[no-any-return]
            operations=list(lines)))

    def index_exists(self, index: str) -> bool:
        return bool(self._call(lambda: self.client.indices.exists(index=index)))

    def create_index(self, index: str, body: Mapping[str, Any]) -> None:
        self._call(lambda: self.client.indices.create(index=index, **body))

    def refresh(self, index: str) -> None:
        self._call(lambda: self.client.indices.refresh(index=index))

    def put(self, index: str, doc_id: str, doc: Mapping[str, Any]) -> None:
        self._call(lambda: self.client.index(index=index, id=doc_id, document=doc, refresh=True))

    def get_source(self, index: str, doc_id: str) -> dict[str, Any] | None:
        try:
            r = self._call(lambda: self.client.get(index=index, id=doc_id))
        except ClusterRefused as e:
            if e.status == 404:
                return None
            raise
        return dict(r["_source"])

    def delete_all(self, index: str) -> None:
        self._call(lambda: self.client.delete_by_query(index=index, query={"match_all": {}}, refresh=True,
                                                       conflicts="proceed"))

    def search(self, index: str, query: str, size: int, offset: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"q": query} if query.strip() else {"query": {"match_all": {}}}
        return self._call(lambda: self.client.search(  # type: ignore[no-any-return]
            index=index, size=size, from_=offset, track_total_hits=True, **kw))

    def scan(self, index: str) -> Iterator[dict[str, Any]]:
        r = self._call(lambda: self.client.search(index=index, query={"match_all": {}}, size=1000, scroll="1m"))
        while r["hits"]["hits"]:
            yield from r["hits"]["hits"]
            with self._errors():
                r = _body(self.client.scroll(scroll_id=r["_scroll_id"], scroll="1m"))

    def close(self) -> None:
        self.client.close()


class OpenSearchApi:
    """The ``opensearch-py`` client (``opensearch-py>=3.2,<4``): talks to OpenSearch (and to any server that
    answers the same REST API; it does not check ``X-Elastic-Product``)."""

    flavor: Flavor = "opensearch"

    def __init__(self, client: Any) -> None:
        self.client = client

    @classmethod
    def connect(cls, url: str, timeout_s: float) -> OpenSearchApi:
        from opensearchpy import OpenSearch

        # the transport's own retries (immediate, no backoff) are off: the backend retries, with backoff
        return cls(OpenSearch(url, timeout=timeout_s, max_retries=0, retry_on_status=(), retry_on_timeout=False))

    @contextmanager
    def _errors(self) -> Iterator[None]:
        from opensearchpy.exceptions import ConnectionError as OsConnectionError
        from opensearchpy.exceptions import TransportError

        try:
            yield
        except OsConnectionError as e:  # a TransportError without a status: no connection, timeout
            raise ClusterUnreachable(f"{type(e).__name__}: {e}") from e
        except TransportError as e:
            status = e.status_code if isinstance(e.status_code, int) else 500
            raise ClusterRefused(status, str(e), e.info) from e

    def _call(self, fn: Callable[[], Any]) -> Any:
        with self._errors():
            return fn()

    def bulk(self, lines: Sequence[bytes], timeout_s: float) -> dict[str, Any]:
        body = b"\n".join(lines) + b"\n"
        return self._call(lambda: self.client.bulk(body=body, request_timeout=timeout_s))  # type: ignore[no-any-return]

    def index_exists(self, index: str) -> bool:
        return bool(self._call(lambda: self.client.indices.exists(index=index)))

    def create_index(self, index: str, body: Mapping[str, Any]) -> None:
        self._call(lambda: self.client.indices.create(index=index, body=dict(body) or None))

    def refresh(self, index: str) -> None:
        self._call(lambda: self.client.indices.refresh(index=index))

    def put(self, index: str, doc_id: str, doc: Mapping[str, Any]) -> None:
        self._call(lambda: self.client.index(index=index, id=doc_id, body=dict(doc), refresh=True))

    def get_source(self, index: str, doc_id: str) -> dict[str, Any] | None:
        try:
            r = self._call(lambda: self.client.get(index=index, id=doc_id))
        except ClusterRefused as e:
            if e.status == 404:
                return None
            raise
        return dict(r["_source"])

    def delete_all(self, index: str) -> None:
        self._call(lambda: self.client.delete_by_query(index=index, body={"query": {"match_all": {}}},
                                                       refresh=True, conflicts="proceed"))

    def search(self, index: str, query: str, size: int, offset: int) -> dict[str, Any]:
        if query.strip():
            return self._call(lambda: self.client.search(  # type: ignore[no-any-return]
                index=index, q=query, size=size, from_=offset, track_total_hits=True))
        return self._call(lambda: self.client.search(  # type: ignore[no-any-return]
            index=index, body={"query": {"match_all": {}}}, size=size, from_=offset, track_total_hits=True))

    def scan(self, index: str) -> Iterator[dict[str, Any]]:
        r = self._call(lambda: self.client.search(index=index, body={"query": {"match_all": {}}}, size=1000,
                                                  scroll="1m"))
        while r["hits"]["hits"]:
            yield from r["hits"]["hits"]
            with self._errors():
                r = _body(self.client.scroll(scroll_id=r["_scroll_id"], scroll="1m"))

    def close(self) -> None:
        self.client.close()


def connect(flavor: Flavor, url: str, timeout_s: float) -> ClusterApi:
    """The :class:`ClusterApi` of ``flavor`` for the cluster at ``url``."""
    if flavor == "opensearch":
        return OpenSearchApi.connect(url, timeout_s)
    return ElasticsearchApi.connect(url, timeout_s)
