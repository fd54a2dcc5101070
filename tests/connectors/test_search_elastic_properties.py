"""Property: over random histories -- JSON, binary and array documents, deletes, expiries, hard failovers that lose unpersisted writes
(rollback records), gateway restarts, indexer runs and indexer deaths between a bulk the cluster acknowledged
and its checkpoint -- the cluster's index ends holding exactly the source's JSON-object documents (docs/search.md
"Elasticsearch / OpenSearch"). Against noida-db, once per client library (``elasticsearch``, ``opensearch-py``)."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from connectors.search.backend import Checkpoint
from connectors.search.elastic import ElasticsearchBackend, ElasticsearchSettings
from connectors.search.indexer import SearchIndexer
from engine.exceptions import KeyNotFound
from gateway.broker import Broker
from tests.connectors.noida_es import FLAVOR_PARAMS, NoidaElasticsearch
from tests.harness import Harness

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

KEYS = st.sampled_from([f"k{i}" for i in range(12)])
WORDS = st.sampled_from(["alpha", "beta", "gamma"])
VALUES = st.one_of(
    st.builds(lambda t, n: json.dumps({"t": t, "n": n}).encode(), WORDS, st.integers(0, 99)),
    st.builds(lambda t: json.dumps({"other": t, "nested": {"x": [1, 2]}}).encode(), WORDS),
    st.just(b"\x00\xffbinary"),
    st.just(b"[1, 2, 3]"),
)
MUTATIONS = st.lists(st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES, st.booleans()),
    st.tuples(st.just("delete"), KEYS),
    st.just(("expire",)),
), min_size=1, max_size=6)
ROUNDS = st.lists(st.tuples(MUTATIONS, st.booleans(), st.sampled_from(["none", "index", "kill"]),
                            st.sampled_from(["none", "crash", "crash", "gateway"])), min_size=1, max_size=5)


@pytest.fixture(scope="module")
def es() -> Iterator[NoidaElasticsearch]:
    server = NoidaElasticsearch().start()
    yield server
    server.close()


class Died(BaseException):
    """kill -9 of the indexer after the cluster acknowledged a bulk, before the checkpoint was written."""


def _index(h: Harness, d: Path, settings_: ElasticsearchSettings, kill: bool = False) -> int:
    h.pub.kafka.flush(10)
    be = ElasticsearchBackend(settings_, d, topic=h.topic)
    ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, d, backend=be, commit_docs=5)
    if kill:
        def die(checkpoint: Checkpoint) -> None:
            be._send()
            raise Died

        be.commit = die  # type: ignore[method-assign]
    try:
        with contextlib.suppress(Died):
            ix.catch_up()
        return ix.stats.rollbacks
    finally:
        if kill:  # the process is gone: nothing more is committed
            ix.consumer.consumer.close()
            ix.store.conn.close()
        else:
            ix.close()
        be.close()


@pytest.mark.parametrize("flavor", FLAVOR_PARAMS)
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(rounds=ROUNDS)
def test_cluster_index_equals_the_source_after_any_history(kafka_broker: Broker, es: NoidaElasticsearch,
                                                           flavor: str, tmp_path_factory: Any,
                                                           rounds: list[Any]) -> None:
    tmp = tmp_path_factory.mktemp("es")
    now = [time.time()]
    h = Harness(kafka_broker, tmp, nvb=4, clock=lambda: now[0], rollback_mitigation=False)
    d = tmp / "ix"
    s = ElasticsearchSettings(es.url, flavor=flavor,  # type: ignore[arg-type]
                              index=f"p-{uuid.uuid4().hex[:10]}", batch_docs=3)
    rollbacks = 0
    try:
        for mutations, persist, indexer, failure in rounds:
            for op in mutations:
                if op[0] == "set":
                    h.bucket.set(op[1], op[2], expiry=5 if op[3] else 0)
                elif op[0] == "delete":
                    with contextlib.suppress(KeyNotFound):
                        h.bucket.delete(op[1])
                else:
                    now[0] += 10
                    h.bucket.run_expiry_pager()
            if persist:
                h.bucket.flush_all()
            h.publish_unpersisted(20)
            if indexer != "none":
                rollbacks += _index(h, d, s, kill=indexer == "kill")
            if failure == "crash":
                h.crash_engine()
            elif failure == "gateway":
                h.restart_gateway()
        # a document that expired while its expiration was lost in a failover is expired again only when the
        # engine processes its expiry (the pager, as Couchbase's): until then it is in the topic, not in the
        # source's state_snapshot()
        h.bucket.run_expiry_pager()
        h.bucket.set("final", b'{"t": "end"}')
        h.bucket.flush_all()
        h.settle()
        be = ElasticsearchBackend(s, d, topic=h.topic)
        with SearchIndexer(h.broker.bootstrap_servers, h.topic, d, backend=be) as ix:
            ix.catch_up()
            rollbacks += ix.stats.rollbacks
            event(f"rollbacks applied by the indexer: {'yes' if rollbacks else 'no'}")
            source = {}
            for k, (v, _vb) in h.bucket.state_snapshot().items():
                with contextlib.suppress(orjson.JSONDecodeError):
                    doc = orjson.loads(v)
                    if isinstance(doc, dict):
                        source[k.decode()] = doc
            assert {k.encode(): v for k, v in ix.docs().items()} == h.bucket.state_snapshot()
            assert be.docs() == source, (be.rejections.read(), be.status(), ix.visible)
            assert be.rejections.read() == []
        be.close()
    finally:
        h.close()
