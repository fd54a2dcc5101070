"""Pure parts: mapping extraction (types, arrays, pointers, wrong types) and the consistency rules (covered
seqnos on branches, rolled-back tokens)."""

from __future__ import annotations

import datetime

import pytest

from connectors.search.backend import Checkpoint, Position
from connectors.search.consistency import (
    MutationToken,
    SourceVBucket,
    covered_seqno,
    lag_seqnos,
    missing,
    token_rollback,
)
from connectors.search.mapping import DocumentMapping, MappingError
from schemas.failover_log import FailoverEntry as E

M = DocumentMapping.from_dict({"types": [
    {"name": "t", "key_regex": "^t:", "fields": {
        "tags": "keyword", "score": "numeric", "at": "date", "a_b": {"pointer": "/a~1b/0", "type": "text"},
        "raw": {"pointer": "", "type": "stored"}}}]})


def test_extraction_types_arrays_pointers_and_wrong_types() -> None:
    doc = {"tags": ["x", "y"], "score": 2, "at": 1_600_000_000, "a/b": ["first", "second"]}
    ex = M.extract("t:1", doc)
    assert ex.doc_type == "t" and ex.dynamic is None and not ex.rejected
    assert ex.fields["tags"] == ["x", "y"] and ex.fields["score"] == [2.0] and ex.fields["a_b"] == ["first"]
    assert ex.fields["at"] == [datetime.datetime(2020, 9, 13, 12, 26, 40, tzinfo=datetime.UTC)]
    assert ex.stored["raw"] == doc and ex.stored["tags"] == ["x", "y"]
    bad = M.extract("t:2", {"tags": ["x", 3], "score": True, "at": "yesterday"})
    assert sorted(bad.rejected) == ["at", "score", "tags"] and set(bad.fields) == {"raw"}
    assert M.extract("other", [1, 2]).stored == {"value": [1, 2]}  # the dynamic default type


@pytest.mark.parametrize("bad", [
    [], {"types": {}}, {"types": [{"name": "a", "key_prefix": 1}]},
    {"types": [{"name": "a", "key_prefix": "a", "fields": {"doc": "text"}}]},
    {"types": [{"name": "a", "key_prefix": "a", "fields": {"x": {"type": "text", "stored": "yes"}}}]},
    {"types": [{"name": "a", "key_prefix": "a"}, {"name": "a", "key_prefix": "b"}]},
    {"types": [{"name": "a", "key_prefix": "a", "fields": {"x": {"type": "text", "pointer": "/a~2"}}}]},
    {"default": {"name": "x", "key_prefix": "y"}},
])
def test_invalid_mappings(bad: object) -> None:
    with pytest.raises(MappingError, match="mapping <mapping>: "):
        DocumentMapping.from_dict(bad)


def test_covered_seqno_follows_branches() -> None:
    src = [E(30, 100), E(20, 50), E(10, 0)]  # newest first
    assert covered_seqno(Position(30, 120), src) == 120
    assert covered_seqno(Position(20, 80), src) == 80  # same history: branch 20 runs up to 100
    assert covered_seqno(Position(20, 130), src) == 100  # a lost tail above the branch point
    assert covered_seqno(Position(10, 70), src) == 50
    assert covered_seqno(Position(99, 70), src) == 0  # a branch the source does not know
    assert covered_seqno(None, src) == 0
    cp = Checkpoint(1, {0: Position(20, 130)})
    assert missing(cp, {0: 101, 1: 0}, {0: src}) == [{"vbucket": 0, "wanted_seqno": 101, "indexed_seqno": 100}]
    assert missing(cp, {0: 100}, {0: src}) == []


def test_lag_counts_what_is_missing_and_what_the_source_lost() -> None:
    """docs/search.md "Lag": 0 only when the index ends at the source's own history."""
    sv = SourceVBucket(0, 130, (E(30, 100), E(20, 50), E(10, 0)))
    assert lag_seqnos(Position(30, 130), sv) == 0
    assert lag_seqnos(Position(30, 120), sv) == 10
    assert lag_seqnos(Position(20, 80), sv) == 50  # same history, behind
    # the index holds 101..130 of branch 20, which the source lost at 100 (its seqnos 101..130 are another
    # branch's): not caught up although the seqnos are equal
    assert lag_seqnos(Position(20, 130), sv) == 30 + 30
    assert lag_seqnos(Position(99, 40), sv) == 130 + 40  # a branch the source does not know
    assert lag_seqnos(None, sv) == 130
    # the source rolled back below the index (a crash lost writes the index has): the owed rollback counts
    assert lag_seqnos(Position(30, 140), SourceVBucket(0, 120, sv.failover_log)) == 20


def test_token_rollback_points() -> None:
    sv = SourceVBucket(0, 150, (E(30, 100), E(20, 50), E(10, 0)))
    assert token_rollback(MutationToken(0, 30, 140), sv) is None
    assert token_rollback(MutationToken(0, 20, 100), sv) is None
    assert token_rollback(MutationToken(0, 20, 101), sv) == 100  # written on branch 20 after the failover point
    assert token_rollback(MutationToken(0, 77, 90), sv) == 0  # unknown everywhere
    # unknown to the source, but the indexer saw branch 77 fork from 20 at 60: the source shares up to 60
    assert token_rollback(MutationToken(0, 77, 90), sv, [E(77, 60), E(20, 50), E(10, 0)]) == 60
    with pytest.raises(ValueError, match=r"tokens\[2\].seqno"):
        MutationToken.parse({"vbucket": 1, "vbuuid": 2, "seqno": -1}, 2)
