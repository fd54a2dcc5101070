"""The search indexer against a topic of the in-process gateway: the index equals the source (connectors/search,
docs/search.md "Exactness")."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from connectors.search.backend import Checkpoint, SearchError
from connectors.search.indexer import SearchIndexer
from connectors.search.mapping import DocumentMapping
from connectors.search.tantivy_backend import TantivyBackend
from connectors.search.tantivy_writer import TantivyWriterProcess
from tests.connectors.search.helpers import drop_writer, expected_index, index_contents
from tests.harness import Harness, write

MAPPING = DocumentMapping.from_dict({"types": [
    {"name": "user", "key_prefix": "user::", "fields": {
        "name": {"pointer": "/name", "type": "text"},
        "email": {"pointer": "/contact/email", "type": "keyword"},
        "age": {"pointer": "/age", "type": "numeric"},
        "joined": {"pointer": "/joined", "type": "date"},
        "note": {"pointer": "/note", "type": "stored"}}}]})


def index(h: Harness, d: Path, **kw: Any) -> SearchIndexer:
    ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, d, **kw)
    ix.catch_up()
    return ix


def test_index_equals_the_source_with_mapping_binary_and_wrong_types(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=4)
    b = h.bucket
    b.set("user::1", json.dumps({"name": "Alice Smith", "contact": {"email": "a@x.io"}, "age": 31,
                                 "joined": "2020-05-01T10:00:00Z", "note": {"vip": True}}).encode())
    b.set("user::2", json.dumps({"name": "Bob", "age": "old", "contact": {"email": "b@x.io"}}).encode())
    b.set("user::3", b'{"name": "Carol"}')
    b.set("user::3", b'{"name": "Carol Jones", "age": 40}')
    b.set("blob", b"\x00\x01binary")
    b.set("order-1", b'{"item": "pen", "qty": 2}')
    b.set("gone", b'{"x": 1}')
    b.delete("gone")
    write(b, 40, prefix="k")
    h.settle()
    with index(h, tmp_path / "ix", mapping=MAPPING) as ix:
        assert index_contents(ix) == expected_index(b.state_snapshot(), MAPPING)
        st = ix.stats
        assert st.binary_skipped == 1 and st.field_rejected == 1  # user::2's age is a string
        r = ix.backend.search("name:smith")
        assert [x.key for x in r.hits] == ["user::1"]
        assert r.hits[0].fields == {"name": "Alice Smith", "email": "a@x.io", "age": 31,
                                    "joined": "2020-05-01T10:00:00Z", "note": {"vip": True}}
        assert [x.key for x in ix.backend.search("age:[30 TO 35]").hits] == ["user::1"]
        assert [x.key for x in ix.backend.search('email:"b@x.io"').hits] == ["user::2"]
        assert [x.key for x in ix.backend.search("joined:[2020-01-01T00:00:00Z TO 2021-01-01T00:00:00Z]").hits] \
            == ["user::1"]
        assert [x.key for x in ix.backend.search("item:pen").hits] == ["order-1"]  # dynamic default type
        assert r.checkpoint is not None and r.checkpoint.positions == {
            vb: ix.visible.positions[vb] for vb in r.checkpoint.positions}
        for vb in range(4):
            assert ix.visible.positions[vb].seqno == b.vbucket(vb).high_seqno
        with pytest.raises(SearchError, match="Syntax Error"):
            ix.backend.search("name:(")


def test_engine_crash_rollback_restores_the_lost_branch(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=4, rollback_mitigation=False)
    write(h.bucket, 80)
    h.bucket.flush_all()
    h.settle()
    d = tmp_path / "ix"
    with index(h, d):
        pass
    # overwrite persisted documents and add new ones in memory only: published, indexed, then lost
    for i in range(0, 120, 3):
        h.bucket.set(f"k{i}", json.dumps({"lost": i}).encode())
    h.bucket.delete("k1")
    h.publish_unpersisted()
    with index(h, d) as ix:
        assert any(f.get("lost") is not None for _vb, f in index_contents(ix).values())
    h.crash_engine()
    write(h.bucket, 10, start=1000)
    h.bucket.flush_all()
    h.settle()
    with index(h, d) as ix:
        assert ix.stats.rollbacks > 0
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)
        assert not any("lost" in x.fields for x in ix.backend.search("*", 500).hits)


def test_crash_between_store_and_index_commit_resumes_exactly(harness: Any, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The store committed, the backend did not (the process died in between): the next start applies the rows
    above the backend's generation again."""
    h = harness(nvb=4)
    write(h.bucket, 60)
    h.settle()
    d = tmp_path / "ix"
    with index(h, d) as ix:
        gen0 = ix.visible.generation
    write(h.bucket, 60, start=60)
    for i in range(2, 60, 5):
        h.bucket.delete(f"k{i}")
    h.settle()

    class Died(BaseException):
        pass

    def die(self: TantivyWriterProcess, cp: Checkpoint) -> None:
        raise Died

    monkeypatch.setattr(TantivyWriterProcess, "commit", die)
    ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, d)
    with pytest.raises(Died):
        ix.catch_up()
    ix.consumer.consumer.close()  # the process is gone: nothing else is closed or committed
    drop_writer(ix)  # drops the writer and its lock
    ix.store.conn.close()
    monkeypatch.undo()
    with index(h, d) as ix2:
        assert ix2.visible.generation > gen0
        assert index_contents(ix2) == expected_index(h.bucket.state_snapshot(), ix2.mapping)


def test_mapping_change_rebuilds_the_index_from_the_store(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=2)
    h.bucket.set("user::1", b'{"name": "Alice", "age": 3}')
    write(h.bucket, 20)
    h.settle()
    d = tmp_path / "ix"
    with index(h, d) as ix:
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)
    with index(h, d, mapping=MAPPING) as ix:
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), MAPPING)
        assert [x.key for x in ix.backend.search("age:[1 TO 5]").hits] == ["user::1"]


def test_backend_commits_run_beside_the_consumer(harness: Any, tmp_path: Path) -> None:
    """A backend commit runs in a thread of its own while the consumer stores the next generation
    (docs/search.md "How it stays exact"): slow commits, many generations, and the index still equals the source
    once caught up, at the store's last generation."""
    h = harness(nvb=4)
    write(h.bucket, 200)  # every fifth key deleted again
    h.settle()
    threads: list[str] = []
    generations: list[int] = []

    class Slow(TantivyBackend):
        def commit(self, checkpoint: Checkpoint) -> None:
            threads.append(threading.current_thread().name)
            generations.append(checkpoint.generation)
            time.sleep(0.05)
            super().commit(checkpoint)

    d = tmp_path / "ix"
    backend = Slow(d / "tantivy", DocumentMapping.dynamic_default())
    try:
        with SearchIndexer(h.broker.bootstrap_servers, h.topic, d, backend=backend, commit_docs=20,
                           batch_size=50) as ix:
            ix.catch_up()
            assert "dcpgw-index-commit" in threads
            assert generations == sorted(set(generations)) and len(generations) > 1
            assert ix.visible.generation == generations[-1] == ix.gen - 1
            assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)
            # the synced tombstones were purged from the store
            assert ix.conn.execute("SELECT count(*) FROM search_restored").fetchone()[0] == 0
    finally:
        backend.close()
