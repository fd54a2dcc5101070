"""Property: over random histories -- writes of JSON, binary and wrong-typed documents, deletes, expiries, hard
failovers that lose unpersisted writes (rollback records), gateway restarts, indexer runs and indexer deaths
between its store commit and its index commit -- the index ends holding exactly the source's documents with
their stored fields (docs/search.md "Exactness")."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from connectors.search.backend import Checkpoint
from connectors.search.indexer import SearchIndexer
from connectors.search.mapping import DocumentMapping
from engine.exceptions import KeyNotFound
from gateway.broker import Broker
from tests.connectors.search.helpers import drop_writer, expected_index, index_contents
from tests.harness import Harness

MAPPING = DocumentMapping.from_dict({"types": [
    {"name": "u", "key_prefix": "u", "fields": {"t": "text", "n": "numeric", "tag": "keyword"}}]})

KEYS = st.sampled_from([f"{p}{i}" for p in ("u", "k") for i in range(12)])
WORDS = st.sampled_from(["alpha", "beta", "gamma", "delta"])
VALUES = st.one_of(
    st.builds(lambda t, n, tag: json.dumps({"t": t, "n": n, "tag": tag}).encode(),
              WORDS, st.one_of(st.integers(0, 99), st.just("NaN-ish")), WORDS),
    st.builds(lambda t: json.dumps({"other": t, "nested": {"x": [1, t]}}).encode(), WORDS),
    st.just(b"\x00\xffbinary"),
)
MUTATIONS = st.lists(st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES, st.booleans()),
    st.tuples(st.just("delete"), KEYS),
    st.just(("expire",)),
), min_size=1, max_size=6)
#: a round: mutations, maybe persisted, published; then the indexer runs (or dies), then maybe a hard failover
#: (the engine restarts from disk: what was not persisted is lost -- a rollback for an indexer that applied it)
ROUND = st.tuples(MUTATIONS, st.sampled_from([False, False, True]), st.sampled_from(["none", "index", "kill"]),
                  st.sampled_from(["none", "crash", "crash", "gateway"]))
#: every history starts with writes indexed from memory and lost in a hard failover (a rollback for sure)
ROUNDS = st.builds(lambda first, rest: [(first, False, "index", "crash"), *rest], MUTATIONS,
                   st.lists(ROUND, max_size=4))


class Died(BaseException):
    """kill -9 of the indexer between its store commit and its index commit."""


def _die(checkpoint: Checkpoint) -> None:
    raise Died


def _index(h: Harness, d: Path, kill: bool = False, log_max: int = 100_000) -> int:
    """Run the indexer to the end of the topic (or kill it at its first index commit); rollbacks applied."""
    h.pub.kafka.flush(10)
    ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, d, mapping=MAPPING, commit_docs=7,
                       mutation_log_max=log_max)
    if not kill:
        with ix:
            ix.catch_up()
            return ix.stats.rollbacks
    ix.backend.commit = _die  # type: ignore[method-assign]
    with contextlib.suppress(Died):
        ix.catch_up()
    # the process is gone: nothing more is committed, its locks go with it
    ix.consumer.consumer.close()
    drop_writer(ix)
    ix.store.conn.close()
    return ix.stats.rollbacks


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(rounds=ROUNDS, log_max=st.sampled_from([2, 100_000]))
def test_index_equals_the_source_after_any_history(kafka_broker: Broker, tmp_path_factory: Any,
                                                   rounds: list[tuple[Any, ...]], log_max: int) -> None:
    """``log_max`` 2: most rollbacks reach below the bounded mutation log and rebuild their vbucket from zero."""
    note(f"rounds={rounds!r} log_max={log_max}")
    tmp = tmp_path_factory.mktemp("search")
    now = [time.time()]
    h = Harness(kafka_broker, tmp, nvb=4, clock=lambda: now[0], rollback_mitigation=False)
    d = tmp / "ix"
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
                rollbacks += _index(h, d, kill=indexer == "kill", log_max=log_max)
            if failure == "crash":
                h.crash_engine()
            elif failure == "gateway":
                h.restart_gateway()
        h.bucket.set("final", b'{"t": "end"}')
        # an item past its expiry is invisible to reads but streams its expiration only once the pager (or an
        # access) expires it; a crash may also have taken back an expiration: page the source once more
        h.bucket.run_expiry_pager()
        h.bucket.flush_all()
        h.settle()
        with SearchIndexer(h.broker.bootstrap_servers, h.topic, d, mapping=MAPPING, mutation_log_max=log_max) as ix:
            ix.catch_up()
            rollbacks += ix.stats.rollbacks
            event(f"rollbacks applied by the indexer: {'yes' if rollbacks else 'no'}")
            assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), MAPPING)
            assert {k.encode(): v for k, v in ix.docs().items()} == h.bucket.state_snapshot()
    finally:
        h.close()
