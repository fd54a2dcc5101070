"""Queries on dynamically indexed documents (docs/search.md "Mapping", "Query API"): unqualified terms search
every string value of a dynamic document (the catch-all field ``_all``), ranges work on its numbers in both
spellings (``age:[30 TO 40]`` and ``doc.age:[30 TO 40]``: the JSON field ``doc`` is fast), and an index built
before those fields is rebuilt from the document store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import tantivy

from connectors.search.backend import SearchError
from connectors.search.indexer import SearchIndexer
from connectors.search.mapping import DocumentMapping
from connectors.search.tantivy_backend import META_KEY
from tests.connectors.search.helpers import expected_index, index_contents
from tests.harness import Harness

pytestmark = pytest.mark.kafka

DOCS = {
    "carol": {"name": "Carol White", "age": 40, "score": 2.5, "contact": {"city": "Oslo"}, "tags": ["red fox", "zed"]},
    "bob": {"name": "Bob Stone", "age": 25, "score": 7, "note": "white noise"},
    "dan": {"name": "Dan", "age": 33, "pets": [{"kind": "white cat"}]},
}

MAPPED = DocumentMapping.from_dict({"types": [
    {"name": "user", "key_prefix": "user::", "fields": {"title": "text", "age": "numeric"}},
    {"name": "order", "key_prefix": "order-", "dynamic": True, "fields": {"total": "numeric"}}],
    "default": {"dynamic": False, "fields": {"title": "text"}}})


def index(h: Harness, d: Path, **kw: Any) -> SearchIndexer:
    ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, d, **kw)
    ix.catch_up()
    return ix


def keys(ix: SearchIndexer, q: str) -> list[str]:
    return sorted(x.key for x in ix.backend.search(q, 100).hits)


def test_unqualified_terms_search_every_string_value_of_a_dynamic_document(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=4)
    for k, v in DOCS.items():
        h.bucket.set(k, json.dumps(v).encode())
    h.settle()
    with index(h, tmp_path / "ix") as ix:
        assert keys(ix, "name:carol") == ["carol"]
        assert keys(ix, "carol") == ["carol"]  # a member's value
        assert keys(ix, '"carol white"') == ["carol"]  # a phrase within one value
        assert keys(ix, '"white carol"') == []
        assert keys(ix, '"fox zed"') == []  # no phrase across two values
        assert keys(ix, "oslo") == ["carol"]  # nested object
        assert keys(ix, "zed") == ["carol"]  # array element
        assert keys(ix, "white") == ["bob", "carol", "dan"]  # any member, objects in arrays too
        assert keys(ix, "white AND cat") == ["dan"]
        assert keys(ix, "name") == []  # member names are not values
        assert keys(ix, "40") == []  # nor are numbers text


def test_unqualified_terms_in_dynamic_types_of_a_mapping(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=4)
    h.bucket.set("order-1", b'{"item": "Carol Pen", "total": 9.5, "qty": 3}')
    h.bucket.set("user::1", b'{"title": "carol", "bio": "pen pal", "age": 35}')
    h.bucket.set("misc", b'{"title": "pen", "other": "carol"}')
    h.settle()
    with index(h, tmp_path / "ix", mapping=MAPPED) as ix:
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), MAPPED)
        assert keys(ix, "carol") == ["order-1", "user::1"]  # misc's "other" is not indexed (not dynamic)
        assert keys(ix, "pen") == ["misc", "order-1"]  # user::1's bio is not a field of its type
        assert keys(ix, "qty:[1 TO 5]") == ["order-1"]
        assert keys(ix, "total:[9 TO 10]") == ["order-1"]
        assert keys(ix, "age:[30 TO 40]") == ["user::1"]  # the mapped numeric field


def test_ranges_on_the_numbers_of_dynamic_documents_in_both_spellings(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=4)
    for k, v in DOCS.items():
        h.bucket.set(k, json.dumps(v).encode())
    h.settle()
    with index(h, tmp_path / "ix") as ix:
        assert keys(ix, "age:40") == ["carol"]
        assert keys(ix, "age:[30 TO 40]") == ["carol", "dan"]
        assert keys(ix, "doc.age:[30 TO 40]") == ["carol", "dan"]
        assert keys(ix, "age:{33 TO 40]") == ["carol"]
        assert keys(ix, "age:>30") == ["carol", "dan"]
        assert keys(ix, "score:[2 TO 8]") == ["bob", "carol"]  # floats and integers
        assert keys(ix, "age:[30 TO 40] AND score:[0 TO 5]") == ["carol"]
        assert keys(ix, "age:[30 TO 40] -name:dan") == ["carol"]
        # a phrase that merely contains "age:" is left alone
        assert keys(ix, '"age:[1 TO 2]" OR age:[20 TO 30]') == ["bob"]
        assert keys(ix, "nosuch:[1 TO 2]") == []  # a member no document has
        with pytest.raises(SearchError, match="Syntax Error"):
            ix.backend.search("age:[30 TO")


def _pre_catch_all_index(path: Path, ix_keys: dict[str, tuple[int, int, dict[str, Any]]], checkpoint: bytes) -> None:
    """An index as built before the catch-all field: ``doc`` not fast, no ``_all`` (the schema of then)."""
    shutil.rmtree(path)
    path.mkdir()
    sb = tantivy.SchemaBuilder()
    sb.add_text_field("_key", stored=True, tokenizer_name="raw")
    sb.add_text_field("_kind", stored=False, tokenizer_name="raw")
    sb.add_text_field("_type", stored=True, tokenizer_name="raw")
    sb.add_unsigned_field("_vb", stored=True, indexed=True, fast=True)
    sb.add_unsigned_field("_seq", stored=True, indexed=True, fast=True)
    sb.add_bytes_field("_stored", stored=True)
    sb.add_bytes_field("_meta", stored=True)
    sb.add_json_field("doc", stored=False)
    old = tantivy.Index(sb.build(), path=str(path))
    w = old.writer(15_000_000, 1)
    for k, (vb, seq, fields) in ix_keys.items():
        d = tantivy.Document()
        d.add_text("_key", k)
        d.add_text("_kind", "doc")
        d.add_text("_type", "default")
        d.add_unsigned("_vb", vb)
        d.add_unsigned("_seq", seq)
        d.add_bytes("_stored", json.dumps(fields).encode())
        d.add_json("doc", json.dumps(fields))
        w.add_document(d)
    d = tantivy.Document()
    d.add_text("_key", META_KEY)
    d.add_text("_kind", "meta")
    d.add_bytes("_meta", checkpoint)
    w.add_document(d)
    w.commit()
    w.wait_merging_threads()


def test_an_index_built_before_the_catch_all_field_is_rebuilt_from_the_store(harness: Any,
                                                                              tmp_path: Path) -> None:
    h = harness(nvb=4)
    for k, v in DOCS.items():
        h.bucket.set(k, json.dumps(v).encode())
    h.settle()
    d = tmp_path / "ix"
    with index(h, d) as ix:
        held = ix.backend.keys()  # type: ignore[attr-defined]
        cp = json.dumps(ix.visible.to_json()).encode()  # the same mapping id: only the schema differs
    _pre_catch_all_index(d / "tantivy", held, cp)
    with index(h, d) as ix:
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)
        assert keys(ix, "carol") == ["carol"]
        assert keys(ix, "age:[30 TO 40]") == ["carol", "dan"]
