"""Streamed applies (docs/search.md "Performance"): the indexer sends every store commit's rows to the tantivy
writer process without waiting, and commits the generation after them. A key changed several times within a
generation keeps its last version (tantivy's delete-then-add in opstamp order, no dedup before sending); a writer
killed -9 mid-generation loses its streamed applies, the generation's commit fails, and the recovery from the
document store ends with the index equal to the source."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from connectors.exceptions import ConnectorError
from connectors.search.backend import Checkpoint
from connectors.search.indexer import SearchIndexer
from connectors.search.mapping import DocumentMapping
from connectors.search.tantivy_writer import MAX_UNANSWERED, TantivyWriterProcess, WriterProcessDied
from tests.connectors.search.helpers import expected_index, index_contents
from tests.harness import write

MAPPING = DocumentMapping.dynamic_default()


def test_streamed_chunks_keep_the_last_version_of_a_key(tmp_path: Path) -> None:
    b = TantivyWriterProcess(tmp_path / "t", MAPPING)
    try:
        chunks: list[list[tuple[str, bytes | None, int, int]]] = [
            [("a", b'{"v": 1}', 0, 1), ("b", b'{"v": 1}', 0, 2)],
            [("a", b'{"v": 2}', 0, 3), ("b", None, 0, 4)],
            [("b", b'{"v": 3}', 0, 5), ("c", b'{"v": 1}', 0, 6)],
            [("a", b'{"v": 4}', 0, 7), ("c", None, 0, 8), ("c", b'{"v": 2}', 0, 9)],
        ]
        assert len(chunks) > MAX_UNANSWERED  # (some wait for an answer, some do not)
        for c in chunks:
            b.stream_rows(c)
        b.commit(Checkpoint(1, {}, MAPPING.id))
        st = b.take_stats()
        assert (st.indexed, st.deleted) == (7, 2)
        got = {k: (seq, f) for k, (_vb, seq, f) in b.keys().items()}
        assert got == {"a": (7, {"v": 4}), "b": (5, {"v": 3}), "c": (9, {"v": 2})}
        assert b.search("*", 10).total == 3
        # a failed chunk fails the commit after it: nothing of the generation is committed
        b.stream_rows([("d", b'{"v": 1}', 0, 10)])
        b.stream_rows([("bad",)])
        with pytest.raises(ConnectorError, match="tantivy writer"):
            b.commit(Checkpoint(2, {}, MAPPING.id))
        cp = b.checkpoint()
        assert cp is not None and cp.generation == 1
    finally:
        b.close()


def test_a_writer_killed_after_streamed_chunks_fails_the_commit(tmp_path: Path) -> None:
    b = TantivyWriterProcess(tmp_path / "t", MAPPING)
    try:
        b.stream_rows([("a", b'{"v": 1}', 0, 1)])
        b.commit(Checkpoint(1, {}, MAPPING.id))
        b.stream_rows([("b", b'{"v": 1}', 0, 2)])
        b.kill()
        with pytest.raises(WriterProcessDied):
            b.stream_rows([("c", b'{"v": 1}', 0, 3)])
            b.commit(Checkpoint(2, {}, MAPPING.id))
        assert set(b.keys()) == {"a"}
        cp = b.checkpoint()
        assert cp is not None and cp.generation == 1
    finally:
        b.close()


def test_streamed_applies_across_a_writer_kill_9_mid_generation(harness: Any, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # the consumer's flushes (each streams a chunk) come after every fetched batch of 20 records, not every 64
    # events of a queue the constructor filled while the writer started (the whole topic): no prefetch here
    monkeypatch.setattr("connectors.search.indexer.PREFETCH_RECORDS", 0)
    h = harness(nvb=4)
    write(h.bucket, 300)
    for i in range(0, 300, 3):  # keys changed again: several versions of a key within one generation
        h.bucket.set(f"k{i}", f'{{"n": {i}, "again": true}}'.encode())
    h.settle()
    # one generation for the whole topic (it ends only when the consumer is idle or caught up)
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, tmp_path / "ix", commit_docs=1_000_000,
                       commit_interval=3600.0, batch_size=20) as ix:
        b = ix.backend
        assert isinstance(b, TantivyWriterProcess)
        assert b.checkpoint() is None
        killed: list[int] = []
        stream = b.stream_rows
        # the chunks streamed since the last commit: an idle moment of the consumer (a loaded machine) may
        # commit before the third chunk, so the kill comes at the third chunk of whichever generation
        generation = {"commits": -1, "chunks": 0}

        def stream_and_kill(rows: Any) -> None:
            stream(rows)
            if killed:
                return
            if generation["commits"] != ix.stats.commits:
                generation.update(commits=ix.stats.commits, chunks=0)
            generation["chunks"] += 1
            if generation["chunks"] == 3:
                pid = b.pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

        b.stream_rows = stream_and_kill  # type: ignore[method-assign]
        ix.catch_up()
        assert killed, "the generation was not streamed in chunks"
        assert ix.stats.sync_failures >= 1  # the generation's commit failed: the streamed applies were lost
        assert ix.backend_error is None
        assert b.pid not in killed
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)
