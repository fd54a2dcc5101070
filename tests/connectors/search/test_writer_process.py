"""The tantivy writer in a process of its own (connectors/search/tantivy_writer.py, docs/search.md
"Performance"): killed -9 under a running indexer, the failure is reported and the index still ends equal to the
source; the child exits when its indexer goes; a new writer waits for an old one's lock; a rollback undone from
the changelog (connectors/client/changelog.py) in a store written before it."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from connectors.client.changelog import segment_entries
from connectors.exceptions import ConnectorError
from connectors.search.backend import Checkpoint, Delete, Upsert
from connectors.search.indexer import CHANGELOG_TABLE, SearchIndexer
from connectors.search.mapping import DocumentMapping
from connectors.search.tantivy_writer import TantivyWriterProcess, WriterProcessDied
from tests.connectors.search.helpers import expected_index, index_contents
from tests.harness import process_gone, write

MAPPING = DocumentMapping.dynamic_default()


def test_writer_killed_9_is_reported_and_the_index_ends_equal(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=4)
    write(h.bucket, 120)
    h.settle()
    d = tmp_path / "ix"
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d, commit_docs=10, batch_size=20) as ix:
        assert isinstance(ix.backend, TantivyWriterProcess)
        assert ix.backend.checkpoint() is None  # (waits until the writer is ready)
        pid = ix.backend.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        ix.catch_up()
        assert ix.stats.sync_failures >= 1  # reported (then retried with a new writer process)
        assert ix.backend.pid != pid
        assert ix.backend_error is None
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)
    # killed between two commits of a later run: the next start resumes exactly
    write(h.bucket, 60, start=120)
    h.settle()
    ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, d, commit_docs=10, batch_size=20)
    try:
        assert isinstance(ix.backend, TantivyWriterProcess)
        ix.backend.kill()
        with pytest.raises(WriterProcessDied, match="exited"):
            ix.backend.apply([Upsert("x", 0, 1, b'{"a": 1}')])
    finally:
        ix.close()
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:
        ix.catch_up()
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)


def test_the_writer_exits_with_its_parent_and_a_new_one_waits_for_the_lock(tmp_path: Path) -> None:
    b = TantivyWriterProcess(tmp_path / "t", MAPPING)
    b.apply([Upsert("a", 0, 1, b'{"n": 1}')])
    b.commit(Checkpoint(1, {}, MAPPING.id))
    b.apply([Upsert("b", 0, 2, b'{"n": 2}')])  # applied, never committed
    pid = b.pid
    assert pid is not None
    # a second writer on the same index while the first holds the lock: it waits, then gets it
    got: list[Any] = []
    second = TantivyWriterProcess(tmp_path / "t", MAPPING)
    t = threading.Thread(target=lambda: got.append(second.checkpoint()))
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not got  # still waiting for the lock
    # the parent's end of the pipe closes (as when the indexer dies): the child exits, dropping "b"
    b.close()
    assert process_gone(pid)
    t.join(30)
    assert got and got[0] is not None and got[0].generation == 1
    assert set(second.keys()) == {"a"}
    second.close()


def test_writer_that_cannot_open_the_index_fails_every_request(tmp_path: Path) -> None:
    p = tmp_path / "t"
    p.write_text("not a directory")
    b = TantivyWriterProcess(p, MAPPING)
    try:
        with pytest.raises(ConnectorError, match="tantivy writer"):
            b.checkpoint()
    finally:
        b.close()
    with pytest.raises(ConnectorError, match="closed"):
        b.apply([])


def _to_legacy_layout(store: Path, *, keep_changelog: bool, extra: tuple[str, bytes, int, int, int] | None = None
                      ) -> None:
    """Rewrite a store into the layout before session 11: every live document in ``search_docs`` (of the
    generation the backend committed), the changelog without generations -- or gone altogether (the layout before
    the changelog). ``extra``: one more row (key, value, vbucket, seqno, generation)."""
    conn = sqlite3.connect(store)
    conn.execute("CREATE TABLE search_docs (key TEXT NOT NULL, value BLOB, vbucket INTEGER NOT NULL, "
                 "seqno INTEGER NOT NULL, gen INTEGER NOT NULL, PRIMARY KEY (vbucket, key))")
    newest: dict[bytes, tuple[int, int, bytes]] = {}
    for vb, data in conn.execute(f"SELECT vbucket, data FROM {CHANGELOG_TABLE} ORDER BY vbucket, last_seqno"):
        for seqno, key, version in segment_entries(data):
            newest[key] = (vb, seqno, version)
    top = conn.execute(f"SELECT max(gen) FROM {CHANGELOG_TABLE}").fetchone()[0]
    conn.executemany("INSERT INTO search_docs VALUES (?, ?, ?, ?, ?)",
                     [(k.decode(), v[1:], vb, sq, top) for k, (vb, sq, v) in newest.items() if v[:1] == b"\x01"])
    if extra is not None:
        conn.execute("INSERT INTO search_docs VALUES (?, ?, ?, ?, ?)", extra)
    conn.execute("DROP TABLE search_restored")
    if keep_changelog:
        conn.execute(f"ALTER TABLE {CHANGELOG_TABLE} DROP COLUMN gen")
    else:
        conn.execute(f"DROP TABLE {CHANGELOG_TABLE}")
        conn.execute(f"DROP TABLE {CHANGELOG_TABLE}_floor")
    conn.commit()
    conn.close()


def _indexed(harness: Any, tmp_path: Path, n: int) -> tuple[Any, Path, int, dict[str, Any]]:
    """``n`` documents written, persisted, published and indexed (4 vbuckets): the harness, the index directory,
    the committed generation and the index's contents."""
    h = harness(nvb=4, rollback_mitigation=False)
    write(h.bucket, n)
    h.bucket.flush_all()
    h.settle()
    d = tmp_path / "ix"
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:
        ix.catch_up()
        return h, d, ix.visible.generation, index_contents(ix)


def test_a_store_written_before_the_changelog_undoes_rollbacks_from_its_documents(harness: Any,
                                                                                tmp_path: Path) -> None:
    """A store of the mutation-log layout (documents in ``search_docs``, no changelog table) starts each
    vbucket's changelog from its documents at its position, and the table goes: a later rollback is exact."""
    h, d, _gen, _before = _indexed(harness, tmp_path, 80)
    _to_legacy_layout(d / "store.sqlite", keep_changelog=False)
    # overwrite persisted documents and add new ones in memory only: published, indexed, then lost
    for i in range(0, 120, 3):
        h.bucket.set(f"k{i}", json.dumps({"lost": i}).encode())
    h.bucket.delete("k1")
    h.publish_unpersisted()
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:
        assert ix.conn.execute(f"SELECT count(*) FROM {CHANGELOG_TABLE}").fetchone()[0] >= 1  # adopted
        assert ix.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'search_docs'").fetchone() is None
        ix.catch_up()
        assert any(f.get("lost") is not None for _vb, f in index_contents(ix).values())
    h.crash_engine()
    write(h.bucket, 10, start=1000)
    h.bucket.flush_all()
    h.settle()
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:
        ix.catch_up()
        assert ix.stats.rollbacks > 0
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)
        assert ix.docs() == {k.decode(): v for k, v in h.bucket.state_snapshot().items()}


def test_a_legacy_store_row_the_backend_never_committed_is_indexed_at_start(harness: Any, tmp_path: Path) -> None:
    """A store of the layout with ``search_docs`` and a changelog without generations, holding a row above the
    backend's committed generation (a crash between the store's commit and the backend's): the migration keeps
    it, the first sync indexes it, and the changelog's segments written before are not applied again."""
    h, d, gen, before = _indexed(harness, tmp_path, 40)
    _to_legacy_layout(d / "store.sqlite", keep_changelog=True, extra=("k0", b'{"late": 1}', 0, 10**6, gen + 1))
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:
        assert ix.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'search_docs'").fetchone() is None
        ix.catch_up()
        got = index_contents(ix)
        assert got["k0"][1] == {"late": 1}
        assert {k: v for k, v in got.items() if k != "k0"} == {k: v for k, v in before.items() if k != "k0"}
        assert ix.stats.indexed == 1 and ix.visible.generation > gen


@pytest.mark.parametrize("restart", [False, True])
def test_skipped_deletes_never_leave_two_versions(tmp_path: Path, restart: bool) -> None:
    """A fresh index's writer skips the deletes of keys it never added; every replaced or deleted key is
    still deleted -- in one batch, across batches, after a failed request, and after a restart on a non-empty
    index (which deletes every key again)."""
    b = TantivyWriterProcess(tmp_path / "t", MAPPING)
    try:
        b.apply([Upsert("a", 0, 1, b'{"v": 1}'), Upsert("b", 0, 2, b'{"v": 1}'), Upsert("a", 0, 3, b'{"v": 2}')])
        b.commit(Checkpoint(1, {}, MAPPING.id))
        if restart:
            b.close()
            b = TantivyWriterProcess(tmp_path / "t", MAPPING)
        b.apply([Upsert("b", 0, 4, b'{"v": 2}'), Delete("a", 0, 5), Upsert("c", 0, 6, b'{"v": 1}')])
        b.commit(Checkpoint(2, {}, MAPPING.id))
        with pytest.raises(ConnectorError):
            b.apply_rows([("d", b'{"v": 1}', 0, 7), ("bad",)])  # a request the writer fails
        b.apply([Upsert("a", 0, 8, b'{"v": 3}'), Upsert("c", 0, 9, b'{"v": 2}')])
        b.commit(Checkpoint(3, {}, MAPPING.id))
        got = {k: (seq, f) for k, (_vb, seq, f) in b.keys().items()}
        assert got == {"a": (8, {"v": 3}), "b": (4, {"v": 2}), "c": (9, {"v": 2})}
        assert b.search("*", 10).total == 3
    finally:
        b.close()


def test_an_index_directory_the_writer_cannot_open_fails_the_indexer_at_start(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=2)
    write(h.bucket, 5)
    h.settle()
    d = tmp_path / "ix"
    d.mkdir()
    (d / "tantivy").write_text("not a directory")
    with pytest.raises(ConnectorError, match="tantivy writer"):
        SearchIndexer(h.broker.bootstrap_servers, h.topic, d)
    (d / "tantivy").unlink()
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:  # the store was closed: it opens again
        ix.catch_up()
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)


def test_the_writer_process_runs_the_parents_code_from_any_working_directory(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The child is started without ``site`` on the parent's import path, headed by this ``connectors`` package:
    a ``connectors`` package in the working directory (another checkout) is not what it runs."""
    other = tmp_path / "cwd" / "connectors"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("raise ImportError('the working directory\\'s connectors package')\n")
    monkeypatch.chdir(other.parent)
    b = TantivyWriterProcess(tmp_path / "t", MAPPING)
    try:
        b.apply([Upsert("a", 0, 1, b'{"v": 1}')])
        b.commit(Checkpoint(1, {}, MAPPING.id))
        assert b.keys() == {"a": (0, 1, {"v": 1})}
    finally:
        b.close()


def test_streamed_changelog_segments_apply_as_their_rows(tmp_path: Path) -> None:
    """The indexer streams a snapshot's changelog segment (vbucket, its packed entries) instead of its rows:
    the writer applies each entry in order -- ``b"\\x01" + body`` an upsert, ``b"\\x00"`` a delete -- mixed
    with plain rows (a rollback's), keys decoded from UTF-8 as the store's."""
    from connectors.client.changelog import ENTRY_HEAD as CHANGELOG_HEAD
    from connectors.client.changelog import pack_entry, segment_entries
    from connectors.search import tantivy_writer

    assert tantivy_writer.ENTRY_HEAD.format == CHANGELOG_HEAD.format
    seg = b"".join([pack_entry(5, b"a", b'\x01{"v": 1}'), pack_entry(6, "bé".encode(), b'\x01{"v": 2}'),
                    pack_entry(7, b"a", b"\x00"), pack_entry(8, b"c", b'\x01{"v": 3}')])
    assert [sq for sq, _, _ in segment_entries(seg)] == [5, 6, 7, 8]
    ops = tantivy_writer._ops([("z", b'{"v": 0}', 3, 4, 1), (3, seg), ("z", None, 3, 9, 1)])
    assert [(type(o).__name__, o.key, o.vbucket, o.seqno, getattr(o, "value", None)) for o in ops] == [
        ("_UpsertRow", "z", 3, 4, b'{"v": 0}'), ("_UpsertRow", "a", 3, 5, b'{"v": 1}'),
        ("_UpsertRow", "bé", 3, 6, b'{"v": 2}'), ("Delete", "a", 3, 7, None),
        ("_UpsertRow", "c", 3, 8, b'{"v": 3}'), ("Delete", "z", 3, 9, None)]
    b = TantivyWriterProcess(tmp_path / "t", MAPPING)
    try:
        b.stream_rows([("z", b'{"v": 0}', 3, 4, 1), (3, seg)])
        b.commit(Checkpoint(1, {}, MAPPING.id))
        assert b.take_stats().indexed == 4
        assert {k: (vb, sq, f) for k, (vb, sq, f) in b.keys().items()} == {
            "z": (3, 4, {"v": 0}), "bé": (3, 6, {"v": 2}), "c": (3, 8, {"v": 3})}
    finally:
        b.close()


def test_the_consumer_decodes_while_the_writer_process_starts(harness: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The constructor waits for the writer process's start (its checkpoint) and meanwhile fetches and decodes
    the first records -- nothing applied: the index still ends equal to the source; the wait stops at
    ``PREFETCH_RECORDS``."""
    from connectors.search import indexer as indexer_module

    h = harness(nvb=4)
    write(h.bucket, 150)
    h.settle()
    real = TantivyWriterProcess.started
    monkeypatch.setattr(TantivyWriterProcess, "started", lambda self: False)  # (a slow start)
    monkeypatch.setattr(indexer_module, "PREFETCH_RECORDS", 40)
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, tmp_path / "ix", batch_size=20) as ix:
        assert 40 <= ix.consumer.records_consumed < 40 + 20
        assert ix.stats.changes == 0 and ix.store.partition_offsets() == {}
        monkeypatch.setattr(TantivyWriterProcess, "started", real)
        ix.catch_up()
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)
