"""The bounded, persisted mutation log."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from connectors.client.mutation_log import LogTooShort, MutationLog, Undo


def mlog(tmp_path: Path, n: int = 100) -> MutationLog:
    return MutationLog(sqlite3.connect(tmp_path / "m.sqlite", isolation_level=None), n)


def test_undo_gives_oldest_prior_per_key_and_removes_entries(tmp_path: Path) -> None:
    m = mlog(tmp_path)
    m.record(0, [(1, b"a"), (2, b"b")], {})
    m.record(0, [(3, b"a")], {b"a": (b"a1", 1)})
    m.record(0, [(4, b"a"), (5, b"c")], {b"a": (b"a3", 3)})
    m.record(1, [(4, b"x")], {})
    assert m.undo_to(0, 2) == [Undo(b"a", b"a1", 1), Undo(b"c", None, 0)]
    assert m.undo_to(0, 2) == []  # taken
    assert m.undo_to(0, 0) == [Undo(b"a", None, 0), Undo(b"b", None, 0)]
    assert m.entries(1) == 1


def test_re_recording_a_change_keeps_the_first_prior(tmp_path: Path) -> None:
    m = mlog(tmp_path)
    m.record(0, [(1, b"a")], {})
    m.record(0, [(1, b"a")], {b"a": (b"new", 1)})  # redelivered after a crash: already applied
    assert m.undo_to(0, 0) == [Undo(b"a", None, 0)]


def test_trim_bounds_the_log_and_raises_the_floor(tmp_path: Path) -> None:
    m = mlog(tmp_path, n=3)
    for s in range(1, 7):
        m.record(0, [(s, b"k%d" % s)], {})
        m.trim(0)
    assert m.entries(0) == 3 and m.floor(0) == 3
    assert m.can_undo_to(0, 3) and not m.can_undo_to(0, 2)
    with pytest.raises(LogTooShort):
        m.undo_to(0, 2)
    assert [u.key for u in m.undo_to(0, 4)] == [b"k5", b"k6"]
    m.clear(0)
    assert m.floor(0) == 0 and m.entries(0) == 0


def test_persisted_across_connections(tmp_path: Path) -> None:
    m = mlog(tmp_path)
    m.record(3, [(7, b"a")], {b"a": (b"old", 2)})
    m.conn.close()
    assert mlog(tmp_path).undo_to(3, 6) == [Undo(b"a", b"old", 2)]
