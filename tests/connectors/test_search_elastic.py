"""The search indexer's Elasticsearch backend (connectors/search/elastic.py, docs/search.md "Elasticsearch
backend") against a real HTTP server answering the Elasticsearch API: noida-db (tests/connectors/noida_es.py).
No Elasticsearch or OpenSearch server runs here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors.search.elastic import (
    ElasticsearchConfigError,
    ElasticsearchIndexer,
    ElasticsearchSettings,
    ElasticsearchUnavailable,
    check_index_name,
    index_name_for_topic,
)
from tests.connectors.noida_es import NoidaElasticsearch, free_port
from tests.harness import Harness, write

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def es() -> Iterator[NoidaElasticsearch]:
    server = NoidaElasticsearch().start()
    yield server
    server.close()


def expected(h: Harness) -> dict[bytes, dict[str, Any]]:
    """The source's JSON-object documents, as the index must hold them."""
    out = {}
    for k, (v, _vb) in h.bucket.state_snapshot().items():
        try:
            doc = orjson.loads(v)
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            out[k] = doc
    return out


def index(h: Harness, state: Path, settings: ElasticsearchSettings, **kw: Any) -> ElasticsearchIndexer:
    ix = ElasticsearchIndexer(h.client, h.topic, state, settings, **kw)
    ix.run(until_caught_up=True)
    return ix


def test_index_names_follow_elasticsearch_rules() -> None:
    assert index_name_for_topic("dcp.default") == "dcp.default"
    assert index_name_for_topic("DCP.My Bucket#1") == "dcp.my_bucket_1"
    assert index_name_for_topic("_dcp.x") == "dcp.x"
    assert len(index_name_for_topic("x" * 400).encode()) == 255
    for bad, rule in [("Upper", "lowercase"), ("a*b", "'*'"), ("_x", "start"), ("..", "'..'"), ("", "empty"),
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


def test_index_equals_source_then_exact_after_rollback_and_restart(
        harness: Callable[..., Harness], es: NoidaElasticsearch, tmp_path: Path) -> None:
    h = harness(rollback_mitigation=False)
    write(h.bucket, 120)
    h.bucket.set("bin1", b"\x00\x01\xff")  # binary: skipped and counted
    h.bucket.set("arr", b"[1, 2]")         # JSON but not an object: skipped and counted
    h.bucket.flush_all()
    h.settle()
    settings = ElasticsearchSettings(es.url, index=f"t-{h.topic[4:]}", routing="vbucket", batch_docs=7,
                                     batch_ms=50)
    ix = index(h, tmp_path / "s", settings)
    assert ix.backend.docs() == expected(h)
    st = ix.status()
    assert st["skipped_binary"] == 1 and st["skipped_not_object"] == 1 and st["rejected"] == 0
    assert st["bulk_requests"] > 10  # batch_docs=7
    ix.close()
    # writes published but never persisted: indexed, then lost by the crash (rollback records follow)
    for i in range(60):
        h.bucket.set(f"k{i}", b'{"n": -1, "branch": 1}')
    h.bucket.delete("k1")
    h.publish_unpersisted()
    ix = index(h, tmp_path / "s", settings)
    assert ix.backend.docs()[b"k2"] == {"n": -1, "branch": 1} and ix.status()["rejected"] == 0
    ix.close()
    h.crash_engine()
    write(h.bucket, 10, start=500)
    h.bucket.flush_all()
    h.settle()
    ix = index(h, tmp_path / "s", settings)
    assert ix.rollbacks > 0
    assert ix.backend.docs() == expected(h)
    ix.close()


def test_crash_between_bulk_and_commit_resumes_exactly(
        harness: Callable[..., Harness], es: NoidaElasticsearch, tmp_path: Path) -> None:
    """The cluster holds a batch whose positions were never committed (kill -9 after the bulk): the restart
    sends it again, and a later rollback of that batch still restores the versions from before it."""
    h = harness(rollback_mitigation=False)
    write(h.bucket, 80)
    h.bucket.flush_all()
    h.settle()
    settings = ElasticsearchSettings(es.url, index=f"c-{h.topic[4:]}")
    index(h, tmp_path / "s", settings).close()
    for i in range(40):
        h.bucket.set(f"k{i}", b'{"n": -1}')
    h.publish_unpersisted()

    class Killed(BaseException):
        pass

    ix = ElasticsearchIndexer(h.client, h.topic, tmp_path / "s", settings)
    sent = ix.backend.flush

    def bulk_then_die() -> None:
        sent()  # the cluster acknowledged the batch ...
        raise Killed  # ... and the process dies before the positions are committed

    ix.store.before_commit = bulk_then_die
    with pytest.raises(Killed):
        ix.run(until_caught_up=True)
    assert ix.backend.docs()[b"k2"] == {"n": -1}
    ix.close()
    ix = index(h, tmp_path / "s", settings)  # delivered again, committed
    ix.close()
    h.crash_engine()
    h.settle()
    ix = index(h, tmp_path / "s", settings)
    assert ix.rollbacks > 0
    assert ix.backend.docs() == expected(h)
    assert ix.backend.docs()[b"k2"] == {"n": 2}
    ix.close()


def test_refused_documents_go_to_the_rejection_log(
        harness: Callable[..., Harness], es: NoidaElasticsearch, tmp_path: Path) -> None:
    h = harness(rollback_mitigation=False)
    h.bucket.set("a", b'{"price": 10}')
    h.bucket.flush_all()
    h.settle()
    settings = ElasticsearchSettings(es.url, index=f"r-{h.topic[4:]}")
    index(h, tmp_path / "s", settings).close()  # "price" is mapped as a number
    h.bucket.set("b", b'{"price": "not a number"}')
    h.bucket.set("c", b'{"price": 3}')
    h.bucket.flush_all()
    h.settle()
    ix = index(h, tmp_path / "s", settings)
    assert set(ix.backend.docs()) == {b"a", b"c"}
    rej = ix.backend.rejections.read()
    assert [(r["key"], r["status"], r["action"]) for r in rej] == [("b", 400, "index")]
    assert rej[0]["index"] == settings.index and rej[0]["error"]["type"]
    assert ix.status()["rejected"] == 1
    ix.close()


def test_unreachable_cluster_is_retried_and_nothing_is_lost(
        harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = harness(rollback_mitigation=False)
    write(h.bucket, 50)
    h.bucket.flush_all()
    h.settle()
    server = NoidaElasticsearch(free_port())  # not started yet
    settings = ElasticsearchSettings(server.url, index="u-idx", backoff_initial_s=0.05, backoff_max_s=0.3)
    ix = ElasticsearchIndexer(h.client, h.topic, tmp_path / "s", settings)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            ix.run(until_caught_up=True)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while ix.status()["consecutive_failures"] < 3:
            assert time.monotonic() < deadline, ix.status()
            time.sleep(0.05)
        st = ix.status()
        assert st["reachable"] is False and st["last_error"] and st["retries"] >= 2
        assert ix.positions() == {}  # nothing committed while the cluster does not answer
        server.start()
        t.join(120)
        assert not t.is_alive() and not errors, errors
        assert ix.status()["reachable"] is True
        assert ix.backend.docs() == expected(h)
        assert sum(ix.positions().values()) > 0
    finally:
        ix.stop()
        t.join(10)
        ix.close()
        server.close()


def test_bounded_retries_give_up_without_moving_positions(
        harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = harness(rollback_mitigation=False)
    write(h.bucket, 10)
    h.bucket.flush_all()
    h.settle()
    settings = ElasticsearchSettings(f"http://127.0.0.1:{free_port()}", index="g-idx", max_retries=2,
                                     backoff_initial_s=0.01, backoff_max_s=0.02)
    ix = ElasticsearchIndexer(h.client, h.topic, tmp_path / "s", settings)
    with pytest.raises(ElasticsearchUnavailable, match="2 retries"):
        ix.run(until_caught_up=True)
    assert ix.positions() == {}
    ix.close()
