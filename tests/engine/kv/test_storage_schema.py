"""engine.kv.storage schema versions: a file of the previous schema version (version 0: the tables before files
carried ``PRAGMA user_version``) opens, migrates forward and keeps its data; a newer version is refused."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from engine.exceptions import StorageError
from engine.kv.storage import SCHEMA_VERSION, Storage

#: the exact CREATE statements of schema version 0
_V0 = """
CREATE TABLE IF NOT EXISTS items (
    vb INTEGER NOT NULL, seqno INTEGER NOT NULL, key BLOB NOT NULL, value BLOB,
    flags INTEGER NOT NULL, expiry INTEGER NOT NULL, cas INTEGER NOT NULL, rev INTEGER NOT NULL,
    datatype INTEGER NOT NULL, op INTEGER NOT NULL, superseded INTEGER,
    PRIMARY KEY (vb, seqno)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS vbstate (
    vb INTEGER PRIMARY KEY, state TEXT NOT NULL, failover TEXT NOT NULL, high_seqno INTEGER NOT NULL,
    snap_start INTEGER NOT NULL, snap_end INTEGER NOT NULL, purge_seqno INTEGER NOT NULL,
    max_cas INTEGER NOT NULL, history_start INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
    vb INTEGER NOT NULL, seqno INTEGER NOT NULL, PRIMARY KEY (vb, seqno)) WITHOUT ROWID;
"""


def _version_0_file(path: Path) -> None:
    db = sqlite3.connect(str(path))
    db.executescript(_V0)
    db.executemany("INSERT INTO items VALUES (?,?,?,?,?,?,?,?,?,?,?)", [
        (0, 1, b"a", b'{"v":1}', 0, 0, 101, 1, 1, 0, 3),
        (0, 2, b"b", b"raw", 7, 0, 102, 1, 0, 0, None),
        (0, 3, b"a", b'{"v":2}', 0, 0, 103, 2, 1, 0, None),
    ])
    db.execute("INSERT INTO vbstate VALUES (0, 'active', ?, 3, 3, 3, 0, 103, 0)", (json.dumps([[77, 0]]),))
    db.execute("INSERT INTO meta VALUES ('uuid', 'bucket-1')")
    db.execute("INSERT INTO snapshots VALUES (0, 3)")
    db.commit()
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0
    db.close()


def test_version_0_file_migrates_and_keeps_its_data(tmp_path: Path) -> None:
    path = tmp_path / "bucket.sqlite3"
    _version_0_file(path)
    s = Storage(path)
    try:
        assert s._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        st = s.load_states()[0]
        assert (st.state, st.failover, st.high_seqno, st.max_cas) == ("active", [(77, 0)], 3, 103)
        assert s.get_meta("uuid") == "bucket-1"
        assert [(r[1], r[2], r[3]) for r in s.scan(0, 0, 3, 10)] == [(2, b"b", b"raw"), (3, b"a", b'{"v":2}')]
        row = s.get(0, b"a")
        assert row is not None and row[3] == b'{"v":2}'
        assert s.snapshot_boundary(0, 3) == 3
    finally:
        s.close()
    reopened = Storage(path)  # already current: opens as is
    assert reopened.get_meta("uuid") == "bucket-1"
    reopened.close()


def test_new_file_gets_the_current_version(tmp_path: Path) -> None:
    s = Storage(tmp_path / "new.sqlite3")
    assert s._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    s.close()


def test_file_of_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.sqlite3"
    db = sqlite3.connect(str(path))
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StorageError, match="newer than this engine"):
        Storage(path)
