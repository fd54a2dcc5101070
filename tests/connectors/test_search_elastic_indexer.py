"""``SearchIndexer`` with the Elasticsearch / OpenSearch backend (docs/search.md "Elasticsearch / OpenSearch")
against a topic of the in-process gateway and noida-db (tests/connectors/noida_es.py), once per client library
(``flavor``): the cluster's index equals the source, also after rollbacks, a crash between a bulk and its
checkpoint, and while the cluster was unreachable."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from connectors.search.elastic import ElasticsearchBackend, ElasticsearchSettings
from connectors.search.indexer import SearchIndexer
from tests.connectors.noida_es import FLAVOR_PARAMS, FaultyProxy, NoidaElasticsearch, free_port
from tests.harness import Harness, write

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def es() -> Iterator[NoidaElasticsearch]:
    server = NoidaElasticsearch().start()
    yield server
    server.close()


@pytest.fixture(params=FLAVOR_PARAMS)
def flavor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def expected(h: Harness) -> dict[str, dict[str, Any]]:
    """The source's JSON-object documents: what the cluster's index must hold."""
    out = {}
    for k, (v, _vb) in h.bucket.state_snapshot().items():
        try:
            doc = orjson.loads(v)
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            out[k.decode()] = doc
    return out


def run(h: Harness, d: Path, settings: ElasticsearchSettings, **kw: Any) -> tuple[SearchIndexer, ElasticsearchBackend]:
    be = ElasticsearchBackend(settings, d, topic=h.topic, **kw)
    ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, d, backend=be)
    ix.catch_up()
    return ix, be


def close(ix: SearchIndexer, be: ElasticsearchBackend) -> None:
    ix.close()
    be.close()


def test_cluster_index_equals_source_and_is_exact_after_rollbacks(
        harness: Callable[..., Harness], flavor: str, es: NoidaElasticsearch, tmp_path: Path) -> None:
    h = harness(nvb=4, rollback_mitigation=False)
    write(h.bucket, 120)
    h.bucket.set("bin", b"\x00\x01\xff")
    h.bucket.flush_all()
    h.settle()
    settings = ElasticsearchSettings(es.url, flavor=flavor,  # type: ignore[arg-type]
                                     index=f"e-{uuid.uuid4().hex[:8]}", routing="vbucket", batch_docs=16)
    d = tmp_path / "ix"
    ix, be = run(h, d, settings)
    assert be.docs() == expected(h) and ix.stats.binary_skipped == 1
    assert be.status()["bulk_requests"] >= 6  # 96 documents, 16 per bulk
    close(ix, be)
    # published but never persisted: indexed, then lost by the engine's crash (rollback records follow)
    for i in range(0, 120, 3):
        h.bucket.set(f"k{i}", json.dumps({"n": -i, "lost": True}).encode())
    h.bucket.delete("k1")
    h.publish_unpersisted()
    ix, be = run(h, d, settings)
    assert be.docs()["k3"] == {"n": -3, "lost": True} and "k1" not in be.docs()
    close(ix, be)
    h.crash_engine()
    write(h.bucket, 10, start=500)
    h.bucket.flush_all()
    h.settle()
    ix, be = run(h, d, settings)
    assert ix.stats.rollbacks > 0
    assert be.docs() == expected(h) and be.docs()["k3"] == {"n": 3}
    cp = be.checkpoint()
    assert cp is not None and cp == ix.visible
    for vb in range(4):
        assert cp.positions[vb].seqno == h.bucket.vbucket(vb).high_seqno
    close(ix, be)


def test_crash_between_bulk_and_checkpoint_resumes_exactly(
        harness: Callable[..., Harness], flavor: str, es: NoidaElasticsearch, tmp_path: Path) -> None:
    """kill -9 after the cluster acknowledged a bulk but before the checkpoint was written: the restart applies
    the generations above the cluster's checkpoint again; a later rollback of those writes is still exact."""
    h = harness(nvb=4, rollback_mitigation=False)
    write(h.bucket, 60)
    h.bucket.flush_all()
    h.settle()
    settings = ElasticsearchSettings(es.url, flavor=flavor, index=f"c-{uuid.uuid4().hex[:8]}")  # type: ignore[arg-type]
    d = tmp_path / "ix"
    close(*run(h, d, settings))
    for i in range(30):
        h.bucket.set(f"k{i}", b'{"n": -1}')
    h.publish_unpersisted()

    class Killed(BaseException):
        pass

    be = ElasticsearchBackend(settings, d, topic=h.topic)
    before = be.checkpoint()
    real_commit = be.commit

    def bulk_then_die(checkpoint: Any) -> None:
        be._send()  # the cluster acknowledged the operations ...
        raise Killed  # ... and the process dies before the checkpoint is written

    be.commit = bulk_then_die  # type: ignore[method-assign]
    ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, d, backend=be)
    with pytest.raises(Killed):
        ix.catch_up()
    assert be.docs()["k2"] == {"n": -1} and be.checkpoint() == before
    be.commit = real_commit  # type: ignore[method-assign]
    ix.consumer.close()
    be.close()
    ix, be = run(h, d, settings)
    assert be.docs() == {k: v for k, v in ix_docs(ix).items()}
    close(ix, be)
    h.crash_engine()
    h.settle()
    ix, be = run(h, d, settings)
    assert ix.stats.rollbacks > 0 and be.docs() == expected(h) and be.docs()["k2"] == {"n": 2}
    close(ix, be)


def ix_docs(ix: SearchIndexer) -> dict[str, Any]:
    out = {}
    for k, (v, _vb) in ix.docs().items():
        try:
            doc = orjson.loads(v)
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            out[k] = doc
    return out


def test_unreachable_cluster_retries_status_and_nothing_lost(
        harness: Callable[..., Harness], flavor: str, tmp_path: Path) -> None:
    h = harness(nvb=4, rollback_mitigation=False)
    write(h.bucket, 50)
    h.bucket.flush_all()
    h.settle()
    server = NoidaElasticsearch(free_port())  # started later
    settings = ElasticsearchSettings(server.url, flavor=flavor,  # type: ignore[arg-type]
                                     index="u-idx", backoff_initial_s=0.05, backoff_max_s=0.3)
    be = ElasticsearchBackend(settings, tmp_path / "ix", topic=h.topic)
    errors: list[BaseException] = []
    holder: list[SearchIndexer] = []

    def go() -> None:
        try:
            ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, tmp_path / "ix", backend=be)
            holder.append(ix)
            ix.catch_up()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=go)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while be.status()["consecutive_failures"] < 3:
            assert time.monotonic() < deadline and not errors, (be.status(), errors)
            time.sleep(0.05)
        st = be.status()
        assert st["reachable"] is False and st["retries"] >= 2 and "Connection" in st["last_error"]
        server.start()
        t.join(120)
        assert not t.is_alive() and not errors, errors
        assert be.status()["reachable"] is True
        assert be.docs() == expected(h)
        cp = be.checkpoint()
        assert cp is not None and all(cp.positions[vb].seqno == h.bucket.vbucket(vb).high_seqno for vb in range(4))
    finally:
        be.stop.set()
        t.join(10)
        if holder:
            holder[0].close()
        be.close()
        server.close()


def test_bulks_refused_as_too_large_are_split_and_indexing_goes_on(
        harness: Callable[..., Harness], flavor: str, es: NoidaElasticsearch, tmp_path: Path) -> None:
    """A cluster (here a body-limiting proxy in front of noida-db) refusing bulks with 413: the indexer's
    batches are split, the one document too large alone is rejected and counted, every other document is
    indexed and the checkpoint reaches the source's high seqnos."""
    h = harness(nvb=4, rollback_mitigation=False)
    write(h.bucket, 60)
    h.bucket.set("huge", json.dumps({"pad": "z" * 5000}).encode())
    h.bucket.flush_all()
    h.settle()
    proxy = FaultyProxy(es.url, max_body_bytes=2000)
    try:
        settings = ElasticsearchSettings(proxy.url, flavor=flavor,  # type: ignore[arg-type]
                                         index=f"t-{uuid.uuid4().hex[:8]}")
        ix, be = run(h, tmp_path / "ix", settings)
        want = expected(h)
        del want["huge"]
        assert be.docs() == want and proxy.too_large > 0 and be.status()["splits"] > 0
        assert be.status()["rejected"] == 1 and [r["key"] for r in be.rejections.read()] == ["huge"], be.status()
        assert be.status()["retries"] == 0, be.status()
        cp = be.checkpoint()
        assert cp is not None and all(cp.positions[vb].seqno == h.bucket.vbucket(vb).high_seqno for vb in range(4))
        close(ix, be)
    finally:
        proxy.close()


def test_pending_docs_counts_changes_not_committed_during_an_outage(
        harness: Callable[..., Harness], flavor: str, tmp_path: Path) -> None:
    """/status ``pending_docs`` ("changes consumed, not yet committed to the index") keeps the changes of the
    generations the cluster refused while it is down, and goes to 0 once they are committed."""
    h = harness(nvb=4, rollback_mitigation=False)
    write(h.bucket, 20)
    h.bucket.flush_all()
    h.settle()
    server = NoidaElasticsearch(free_port()).start()
    settings = ElasticsearchSettings(server.url, flavor=flavor,  # type: ignore[arg-type]
                                     index="p-idx", backoff_initial_s=0.05, backoff_max_s=0.2, max_retries=1)
    be = ElasticsearchBackend(settings, tmp_path / "ix", topic=h.topic)
    ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, tmp_path / "ix", backend=be)
    t = threading.Thread(target=ix.run, daemon=True)
    t.start()

    def wait(what: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline and t.is_alive(), json.dumps({**ix.status(), "vbuckets": 0})
            time.sleep(0.05)

    try:
        wait(lambda: ix.stats.changes == 20 and ix.status()["pending_docs"] == 0 and ix.stats.commits > 0)
        server.stop()
        write(h.bucket, 30, start=100)
        h.bucket.flush_all()
        h.settle()
        # consumed, and refused by the cluster twice (the second time a retry of everything above its checkpoint)
        wait(lambda: ix.stats.changes == 50 and ix.stats.sync_failures >= 2)
        st = ix.status()
        assert st["backend_error"] and st["pending_docs"] == 30, st
        server.start()
        wait(lambda: ix.status()["pending_docs"] == 0 and ix.backend_error is None)
        assert be.docs() == expected(h)
    finally:
        ix.stop()
        t.join(30)
        be.stop.set()
        ix.close()
        be.close()
        server.close()
