"""The search indexer's Elasticsearch / OpenSearch backend (connectors/search/elastic.py, docs/search.md
"Elasticsearch / OpenSearch") against a real HTTP server answering the Elasticsearch API: noida-db
(tests/connectors/noida_es.py). Every test that talks to the server runs once per client library (``flavor``:
the ``elasticsearch`` 8.x client and ``opensearch-py``), both against noida-db: no Elasticsearch or OpenSearch
server runs here."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors.search.backend import Checkpoint, Delete, Position, SearchError, Upsert
from connectors.search.elastic import (
    CHECKPOINT_SUFFIX,
    ElasticsearchBackend,
    ElasticsearchConfigError,
    ElasticsearchSettings,
    ElasticsearchUnavailable,
    check_index_name,
    index_name_for_topic,
)
from tests.connectors.noida_es import FLAVOR_PARAMS, FaultyProxy, NoidaElasticsearch, free_port


@pytest.fixture(scope="module")
def es() -> Iterator[NoidaElasticsearch]:
    server = NoidaElasticsearch().start()
    yield server
    server.close()


@pytest.fixture(params=FLAVOR_PARAMS)
def flavor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def backend(url: str, tmp: Path, flavor: str, **kw: Any) -> ElasticsearchBackend:
    kw.setdefault("index", f"t-{uuid.uuid4().hex[:10]}")
    return ElasticsearchBackend(ElasticsearchSettings(url, flavor=flavor, **kw), tmp)  # type: ignore[arg-type]


def cp(gen: int, **positions: tuple[int, int]) -> Checkpoint:
    return Checkpoint(gen, {int(vb[2:]): Position(u, s) for vb, (u, s) in positions.items()}, "m1")


def test_index_names_follow_elasticsearch_rules() -> None:
    assert index_name_for_topic("dcp.default") == "dcp.default"
    assert index_name_for_topic("DCP.My Bucket#1") == "dcp.my_bucket_1"
    assert index_name_for_topic("_dcp.x") == "dcp.x"
    assert len((index_name_for_topic("x" * 400) + CHECKPOINT_SUFFIX).encode()) == 255
    for bad, rule in [("Upper", "lowercase"), ("a*b", "'\\*'"), ("_x", "start"), ("..", "'..'"), ("", "empty"),
                      ("a:b", "':'"), ("x" * 256, "255")]:
        with pytest.raises(ElasticsearchConfigError, match=rule):
            check_index_name(bad)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ElasticsearchConfigError, match="http"):
        ElasticsearchSettings("localhost:9200")
    with pytest.raises(ElasticsearchConfigError, match="routing"):
        ElasticsearchSettings("http://x", routing="shard")  # type: ignore[arg-type]
    with pytest.raises(ElasticsearchConfigError, match="batch_docs"):
        ElasticsearchSettings("http://x", batch_docs=0)
    with pytest.raises(ElasticsearchConfigError, match="lowercase"):
        ElasticsearchSettings("http://x", index="Docs")
    with pytest.raises(ElasticsearchConfigError, match="checkpoint index"):
        ElasticsearchSettings("http://x", index="x" * 250)
    with pytest.raises(ElasticsearchConfigError, match="backoff"):
        ElasticsearchSettings("http://x", backoff_initial_s=2, backoff_max_s=1)
    with pytest.raises(ElasticsearchConfigError, match="flavor"):
        ElasticsearchSettings("http://x", flavor="solr")  # type: ignore[arg-type]


def test_apply_commit_search_and_checkpoint(es: NoidaElasticsearch, flavor: str, tmp_path: Path) -> None:
    b = backend(es.url, tmp_path, flavor, routing="vbucket", batch_docs=3)
    assert b.checkpoint() is None
    st = b.apply([Upsert("a", 1, 1, b'{"name": "alice", "age": 30}'),
                  Upsert("b", 2, 1, b'{"name": "bob"}'),
                  Upsert("bin", 3, 1, b"\x00\x01"),          # binary: skipped and counted
                  Upsert("arr", 3, 2, b"[1, 2]"),            # JSON, not an object: no _source for it
                  Upsert("c", 1, 2, b'{"name": "carol"}'),
                  Delete("c", 1, 3),                          # a later op on a key wins
                  Upsert("d", 2, 2, b'{\n  "name": "dave"\n}')])  # pretty-printed: sent compact (NDJSON)
    assert (st.indexed, st.deleted, st.binary_skipped, st.rejected) == (4, 1, 2, 0)
    big = 2**64 - 5
    b.commit(cp(1, vb1=(big, 3), vb2=(7, 2)))
    assert b.checkpoint() == cp(1, vb1=(big, 3), vb2=(7, 2))
    assert b.docs() == {"a": {"name": "alice", "age": 30}, "b": {"name": "bob"}, "d": {"name": "dave"}}
    r = b.search("name:alice")
    assert [(h.key, h.fields) for h in r.hits] == [("a", {"name": "alice", "age": 30})] and r.total == 1
    assert r.checkpoint == cp(1, vb1=(big, 3), vb2=(7, 2))
    assert b.search("", limit=2).total == 3 and len(b.search("", limit=2).hits) == 2
    assert b.client.get(index=b.index, id="a", routing="1")["_routing"] == "1"
    with pytest.raises(SearchError):
        b.search("name:(alice")
    b.reset()
    assert b.docs() == {} and b.checkpoint() is None
    b.close()


def test_operations_sent_before_a_crash_are_applied_again(es: NoidaElasticsearch, flavor: str,
                                                          tmp_path: Path) -> None:
    """Bulks the cluster acknowledged without the checkpoint that follows them (kill -9 between the two): the
    checkpoint stays at the previous generation, and applying everything above it again gives the same index."""
    b = backend(es.url, tmp_path, flavor, batch_docs=2)
    b.apply([Upsert("k1", 0, 1, b'{"v": 1}')])
    b.commit(cp(1, vb0=(9, 1)))
    ops: list[Upsert | Delete] = [Upsert("k1", 0, 2, b'{"v": 2}'), Upsert("k2", 0, 3, b'{"v": 3}'),
                                  Delete("k3", 0, 4)]
    b.apply(ops)  # batch_docs=2: sent at once, no commit follows
    assert b.staged == 0 and b.docs()["k1"] == {"v": 2}
    assert b.checkpoint() == cp(1, vb0=(9, 1))
    b.close()
    again = backend(es.url, tmp_path, flavor, index=b.index)
    again.apply(ops)
    again.commit(cp(2, vb0=(9, 4)))
    assert again.docs() == {"k1": {"v": 2}, "k2": {"v": 3}} and again.checkpoint() == cp(2, vb0=(9, 4))
    again.close()


def test_refused_documents_go_to_the_rejection_log(es: NoidaElasticsearch, flavor: str, tmp_path: Path) -> None:
    b = backend(es.url, tmp_path, flavor)
    b.apply([Upsert("a", 0, 1, b'{"price": 10}')])
    b.commit(cp(1, vb0=(1, 1)))  # "price" is mapped as a number now
    st = b.apply([Upsert("b", 0, 2, b'{"price": "not a number"}'), Upsert("c", 0, 3, b'{"price": 3}')])
    b.commit(cp(2, vb0=(1, 3)))
    later = b.apply([])
    assert st.rejected + later.rejected == 1  # found at the commit: reported by the next apply
    assert set(b.docs()) == {"a", "c"} and b.checkpoint() == cp(2, vb0=(1, 3))
    rej = b.rejections.read()
    assert [(r["key"], r["status"], r["action"], r["seqno"]) for r in rej] == [("b", 400, "index", 2)]
    assert rej[0]["index"] == b.index and rej[0]["error"]["type"]
    assert b.status()["rejected"] == 1 and (tmp_path / "rejections.jsonl").exists()
    st = b.apply([Upsert("\udcff-not-utf8", 0, 4, b'{"x": 1}')])  # surrogate-escaped key: no _id for it
    assert st.rejected == 1 and b.rejections.read()[-1]["error"]["type"] == "key_not_utf8"
    b.close()


def test_unreachable_cluster_is_retried_and_nothing_is_lost(flavor: str, tmp_path: Path) -> None:
    server = NoidaElasticsearch(free_port())  # not started yet
    b = backend(server.url, tmp_path, flavor, backoff_initial_s=0.05, backoff_max_s=0.3, max_retries=None)
    errors: list[BaseException] = []

    def commit() -> None:
        try:
            b.apply([Upsert(f"k{i}", i % 4, i + 1, b'{"n": %d}' % i) for i in range(50)])
            b.commit(cp(1, vb0=(1, 50)))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=commit)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while b.status()["consecutive_failures"] < 3:
            assert time.monotonic() < deadline, b.status()
            time.sleep(0.05)
        st = b.status()
        assert st["reachable"] is False and st["last_error"] and st["retries"] >= 2
        server.start()
        t.join(60)
        assert not t.is_alive() and not errors, errors
        assert b.status()["reachable"] is True
        assert len(b.docs()) == 50 and b.checkpoint() == cp(1, vb0=(1, 50))
    finally:
        b.stop.set()
        t.join(10)
        b.close()
        server.close()


def test_bounded_retries_give_up_without_a_checkpoint(flavor: str, tmp_path: Path) -> None:
    b = backend(f"http://127.0.0.1:{free_port()}", tmp_path, flavor, max_retries=2, backoff_initial_s=0.01,
                backoff_max_s=0.02)
    b.apply([Upsert("a", 0, 1, b'{"x": 1}')])
    with pytest.raises(ElasticsearchUnavailable, match="2 retries"):
        b.commit(cp(1, vb0=(1, 1)))
    assert b.status()["retries"] == 2
    b.close()


def test_429_and_5xx_are_retried_with_backoff(es: NoidaElasticsearch, flavor: str, tmp_path: Path) -> None:
    proxy = FaultyProxy(es.url, ["429", "items-503", "503"])
    waits: list[float] = []
    try:
        b = ElasticsearchBackend(ElasticsearchSettings(proxy.url, flavor=flavor,  # type: ignore[arg-type]
                                                       index=f"f-{uuid.uuid4().hex[:8]}",
                                                       backoff_initial_s=0.01, backoff_max_s=0.05),
                                 tmp_path, sleep=waits.append)
        b.apply([Upsert(f"k{i}", 0, i + 1, b'{"n": %d}' % i) for i in range(5)] + [Delete("gone", 0, 9)])
        b.commit(cp(1, vb0=(1, 9)))
        assert proxy.refused == ["429", "items-503", "503"]
        assert len(b.docs()) == 5 and b.checkpoint() == cp(1, vb0=(1, 9)) and b.rejections.count == 0
        st = b.status()
        assert st["retries"] == 3 and st["reachable"] is True
        # exponential, jittered in [cap/2, cap], capped at backoff_max_s
        assert len(waits) == 3 and 0.005 <= waits[0] <= 0.01 and 0.01 <= waits[1] <= 0.02
        assert 0.02 <= waits[2] <= 0.04
        b.close()
    finally:
        proxy.close()


def test_bulk_refused_as_too_large_is_split_in_halves(es: NoidaElasticsearch, flavor: str, tmp_path: Path) -> None:
    """413 Payload Too Large (Elasticsearch's http.max_content_length, a proxy's body limit; a limiting proxy in
    front of noida-db here): the request is sent again as two halves, down to one operation; one document
    refused so alone goes to the rejection log, and the rest is indexed and checkpointed."""
    limit = 1500
    proxy = FaultyProxy(es.url, max_body_bytes=limit)
    try:
        b = backend(proxy.url, tmp_path, flavor, batch_docs=16)
        docs = {f"k{i:02d}": {"n": i, "pad": "x" * 200} for i in range(16)}
        ops: list[Upsert | Delete] = [Upsert(k, 0, i + 1, orjson.dumps(v)) for i, (k, v) in enumerate(docs.items())]
        ops.insert(7, Upsert("huge", 0, 100, orjson.dumps({"pad": "y" * (2 * limit)})))
        ops.append(Delete("gone", 0, 101))
        b.apply(ops)
        b.commit(cp(1, vb0=(1, 101)))
        assert proxy.too_large >= 4 and max(proxy.bodies) <= limit
        assert b.docs() == docs and b.checkpoint() == cp(1, vb0=(1, 101))
        rej = b.rejections.read()
        assert [(r["key"], r["status"], r["action"], r["seqno"]) for r in rej] == [("huge", 413, "index", 100)]
        assert rej[0]["error"]["type"] == "request_too_large"
        st = b.status()
        assert st["splits"] >= 4 and st["rejected"] == 1 and st["reachable"] is True and st["retries"] == 0
        # indexing goes on: the next batch fits and is sent whole
        b.apply([Upsert("after", 0, 102, b'{"n": 99}')])
        b.commit(cp(2, vb0=(1, 102)))
        assert b.docs()["after"] == {"n": 99} and b.rejections.count == 1
        b.close()
    finally:
        proxy.close()


def test_other_requests_are_retried_on_429_and_5xx(es: NoidaElasticsearch, flavor: str, tmp_path: Path) -> None:
    """Not only bulks: the index creation, the refresh, the checkpoint write and read and a search answered 429
    / 5xx are retried with backoff; a search still refused after SEARCH_RETRIES gives up (the query API's 503)."""
    proxy = FaultyProxy(es.url, ["503@dcpgw-checkpoint", "502@_refresh", "500@/_doc/checkpoint",
                                 "429@_search", "504@_doc/checkpoint"])
    waits: list[float] = []
    try:
        b = ElasticsearchBackend(ElasticsearchSettings(proxy.url, flavor=flavor,  # type: ignore[arg-type]
                                                       index=f"r-{uuid.uuid4().hex[:8]}",
                                                       backoff_initial_s=0.01, backoff_max_s=0.05),
                                 tmp_path, sleep=waits.append)
        b.apply([Upsert("a", 0, 1, b'{"name": "alice"}')])
        b.commit(cp(1, vb0=(1, 1)))
        assert proxy.refused[:3] == ["503@dcpgw-checkpoint", "502@_refresh", "500@/_doc/checkpoint"]
        r = b.search("name:alice")  # its checkpoint read (504) and the search (429) retried
        assert [h.key for h in r.hits] == ["a"] and r.checkpoint == cp(1, vb0=(1, 1)) and not proxy.faults
        assert b.status()["retries"] == 5 and len(waits) == 5 and b.status()["reachable"] is True
        proxy.faults = ["503@_search"] * 3
        with pytest.raises(ElasticsearchUnavailable, match="2 retries"):
            b.search("name:alice")
        assert proxy.faults == [] and b.status()["reachable"] is False
        b.close()
    finally:
        proxy.close()
