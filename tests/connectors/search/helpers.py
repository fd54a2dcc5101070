"""Shared by the search tests: what the index must hold for a bucket's documents."""

from __future__ import annotations

import json
from typing import Any

from connectors.search.indexer import SearchIndexer
from connectors.search.mapping import DocumentMapping
from connectors.search.tantivy_backend import TantivyBackend
from connectors.search.tantivy_writer import TantivyWriterProcess


def expected_index(source: dict[bytes, tuple[bytes, int]], mapping: DocumentMapping) -> dict[str, tuple[int, Any]]:
    """key -> (vbucket, stored fields) of every JSON document of ``source`` (binary documents are not indexed)."""
    out = {}
    for k, (v, vb) in source.items():
        try:
            body = json.loads(v)
        except ValueError:
            continue
        out[k.decode()] = (vb, mapping.extract(k.decode(), body).stored)
    return out


def index_contents(ix: SearchIndexer) -> dict[str, tuple[int, Any]]:
    assert isinstance(ix.backend, TantivyBackend | TantivyWriterProcess)
    return {k: (vb, fields) for k, (vb, _seq, fields) in ix.backend.keys().items()}


def drop_writer(ix: SearchIndexer) -> None:
    """The indexer's process is gone (a crash): its tantivy writer goes without committing, its lock with it."""
    b = ix.backend
    if isinstance(b, TantivyWriterProcess):
        b.kill()
        b.close()
    else:
        assert isinstance(b, TantivyBackend)
        b.writer.rollback()
        b.writer.wait_merging_threads()
