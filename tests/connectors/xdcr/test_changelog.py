"""The replicator's changelog (connectors/client/changelog.py, docs/xdcr.md "Source rollbacks"): a rollback's
undo list is each changed key's version at the rollback point, exactly, across compactions, truncations and
earlier rollbacks; below the floor it refuses (the client rebuilds from zero); the segments above a generation hold
every newer version (the search indexer's recovery). Real SQLite, a model history."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.client.changelog import Changelog, pack_entry, segment_entries
from connectors.client.mutation_log import LogTooShort
from connectors.client.state import SqliteStateStore
from connectors.xdcr.document import DocVersion
from connectors.xdcr.replicator import XdcrReplicator

KEYS = [f"k{i}".encode() for i in range(6)]


def _version(key: bytes, seqno: int) -> bytes:
    return DocVersion(key, seqno * 7, seqno, 0, 0, seqno % 5 == 0, 1, None if seqno % 5 == 0 else b"v%d" % seqno).pack()


class Model:
    """The full history of one vbucket: [(seqno, key, version)] in seqno order."""

    def __init__(self) -> None:
        self.history: list[tuple[int, bytes, bytes]] = []

    def at(self, key: bytes, seqno: int) -> bytes | None:
        out = None
        for sq, k, v in self.history:
            if sq <= seqno and k == key:
                out = v
        return out


ops = st.lists(st.one_of(
    st.tuples(st.just("snap"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=5)),
    st.tuples(st.just("rollback"), st.integers(0, 12)),
    st.tuples(st.just("trim"), st.just(0)),
    st.tuples(st.just("rewind"), st.integers(0, 12)),
), max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(1, 6))
def test_undo_lists_are_the_versions_at_the_rollback_point_also_after_rewinds(steps: list[tuple[str, object]], bound: int) -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    log = Changelog(conn, max_entries=bound)
    model = Model()
    seqno = 0
    vb = 3
    for kind, arg in steps:
        if kind == "snap":
            assert isinstance(arg, list)
            entries = []
            first = seqno + 1
            for key in arg:
                seqno += 1
                v = _version(key, seqno)
                entries.append(pack_entry(seqno, key, v))
                model.history.append((seqno, key, v))
            log.append(vb, first, seqno, entries)
        elif kind == "rollback":
            assert isinstance(arg, int)
            to = max(0, seqno - arg)
            if to < log.floor(vb):
                with pytest.raises(LogTooShort):
                    log.undo_to(vb, to)
                log.clear(vb)
                assert log.cleared.pop(vb) == sorted({k for _, k, _ in model.history})
                model.history.clear()
                seqno = 0  # rebuilt from zero: the source's history starts again
                continue
            undo = log.undo_to(vb, to)
            changed = sorted({k for sq, k, _ in model.history if sq > to})
            assert [u.key for u in undo] == changed
            for u in undo:
                assert u.prior_value == model.at(u.key, to)
            model.history = [e for e in model.history if e[0] <= to]
            seqno = to
        elif kind == "rewind":
            # the replicator resumes the vbucket from an older checkpoint (the target lost history): the
            # entries above it go, the replay appends the same seqnos again (here: the next snaps)
            assert isinstance(arg, int)
            to = max(0, seqno - arg)
            if to < log.floor(vb):
                with pytest.raises(LogTooShort):
                    log.rewind(vb, to)
                continue
            log.rewind(vb, to)
            model.history = [e for e in model.history if e[0] <= to]
            seqno = to
        else:
            log.trim(vb)
            assert log.entries(vb) <= len(model.history)
        newest = {k: (sq, v) for sq, k, v in model.history}
        assert log.versions(vb) == newest
    conn.close()


def test_a_snapshot_delivered_again_replaces_what_it_covers() -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    log = Changelog(conn)
    log.append(0, 1, 3, [pack_entry(i, b"a%d" % i, _version(b"a", i)) for i in (1, 2, 3)])
    log.append(0, 2, 3, [pack_entry(i, b"a%d" % i, _version(b"a", i + 10)) for i in (2, 3)])
    assert log.entries(0) == 3
    assert log.versions(0)[b"a3"] == (3, _version(b"a", 13))
    log.truncate_above(0, 1)
    assert log.keys(0) == [b"a1"]


def test_a_state_file_with_the_source_mirror_is_migrated(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    store = SqliteStateStore(state / "xdcr.sqlite", "t")
    store.conn.execute("CREATE TABLE xdcr_docs (key BLOB PRIMARY KEY, vbucket INTEGER NOT NULL, "
                       "seqno INTEGER NOT NULL, version BLOB NOT NULL)")
    store.conn.executemany("INSERT INTO xdcr_docs VALUES (?, ?, ?, ?)",
                           [(b"x", 1, 4, _version(b"x", 4)), (b"y", 1, 9, _version(b"y", 9))])
    store.close()
    r = XdcrReplicator("127.0.0.1:1", "t", "couchbase://127.0.0.1:1", state)
    try:
        assert r.changelog.floor(1) == 9
        assert r.changelog.versions(1) == {b"x": (4, _version(b"x", 4)), b"y": (9, _version(b"y", 9))}
        with pytest.raises(LogTooShort):
            r.changelog.undo_to(1, 8)
        assert r.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'xdcr_docs'").fetchone() is None
    finally:
        r.close()


#: more keys than the bound's entries: some keys' newest versions end up in compacted segments
MANY_KEYS = [f"m{i}".encode() for i in range(20)]
gen_ops = st.lists(st.one_of(
    st.tuples(st.just("snap"), st.lists(st.sampled_from(MANY_KEYS), min_size=1, max_size=6)),
    st.tuples(st.just("commit"), st.just(0)),
    st.tuples(st.just("rollback"), st.integers(0, 12)),
    st.tuples(st.just("trim"), st.just(0)),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(gen_ops, st.integers(1, 3))
def test_segments_above_a_generation_hold_every_newer_version(steps: list[tuple[str, object]], bound: int) -> None:
    """The search indexer's recovery (docs/search.md "How it stays exact"): segments tagged with the generation
    they were appended in, across compactions (a compacted segment takes the highest generation it merged) and
    rollbacks (a cut segment keeps its own). For every generation g: the segments above g are a suffix of the
    vbucket's history, and every key whose newest version was appended above g is there with that version."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    log = Changelog(conn, max_entries=bound, table="search_changelog")
    history: list[tuple[int, bytes, bytes, int]] = []  # (seqno, key, version, generation)
    seqno, gen, vb = 0, 1, 2
    for kind, arg in steps:
        if kind == "snap":
            assert isinstance(arg, list)
            first = seqno + 1
            entries = []
            for key in arg:
                seqno += 1
                v = _version(key, seqno)
                entries.append(pack_entry(seqno, key, v))
                history.append((seqno, key, v, gen))
            log.append_segment(vb, first, seqno, len(entries), b"".join(entries), gen)
        elif kind == "commit":
            gen += 1
        elif kind == "rollback":
            assert isinstance(arg, int)
            to = max(0, seqno - arg)
            if to < log.floor(vb):
                log.clear(vb)
                history.clear()
                seqno = 0
                continue
            log.undo_to(vb, to)
            history = [e for e in history if e[0] <= to]
            seqno = to
        else:
            log.trim(vb)
        assert log.top_generation() == max((g for *_, g in history), default=0)
        for g in range(gen + 1):
            above = [(s, k, v) for _vb, _g, data in log.segments_above(g) for s, k, v in segment_entries(data)]
            below = [s for s, _k, _v in segment_entries(b"".join(
                d for (d,) in conn.execute("SELECT data FROM search_changelog WHERE gen <= ?", (g,))))]
            assert not above or not below or min(s for s, _k, _v in above) > max(below)  # a suffix
            newest = {k: (s, v, eg) for s, k, v, eg in history}
            got = {k: (s, v) for s, k, v in above}  # in seqno order: the last one of a key wins
            for k, (s, v, eg) in newest.items():
                if eg > g:
                    assert got.get(k) == (s, v), (g, k)
    conn.close()
