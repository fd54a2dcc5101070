"""The consumer state file's schema version: a file of the previous version (version 0: the tables of the
state store, the mutation log and connectors.replicate before files carried ``PRAGMA user_version``) opens,
migrates forward and keeps its data; a newer version is refused."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from connectors.client.mutation_log import MutationLog
from connectors.client.state import SCHEMA_VERSION, SqliteStateStore
from connectors.exceptions import StateStoreError
from connectors.replicate import Replicator
from gateway.broker import Broker

#: the exact CREATE statements of schema version 0 (state store, mutation log, replicator)
_V0 = [
    "CREATE TABLE IF NOT EXISTS dcp_consumer_state (topic TEXT NOT NULL, "
    "vbucket INTEGER NOT NULL, state TEXT NOT NULL, PRIMARY KEY (topic, vbucket))",
    "CREATE TABLE IF NOT EXISTS dcp_consumer_offsets (topic TEXT NOT NULL, "
    "partition INTEGER NOT NULL, offset INTEGER NOT NULL, "
    "PRIMARY KEY (topic, partition))",
    """CREATE TABLE IF NOT EXISTS dcp_mutation_log (
    vbucket INTEGER NOT NULL,
    seqno INTEGER NOT NULL,
    key BLOB NOT NULL,
    prior_value BLOB,
    prior_seqno INTEGER NOT NULL,
    PRIMARY KEY (vbucket, seqno, key)
) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS dcp_mutation_log_floor (
    vbucket INTEGER PRIMARY KEY,
    floor INTEGER NOT NULL,
    entries INTEGER NOT NULL
)""",
    "CREATE TABLE IF NOT EXISTS docs (key TEXT PRIMARY KEY, value BLOB, vbucket INTEGER, seqno INTEGER)",
]

STATE = {"vbucket": 0, "vbuuid": 77, "applied_seqno": 5, "snap_start": 4, "snap_end": 5, "offset": 9,
         "failover_log": [[77, 0]]}


def _version_0_file(path: Path, topic: str) -> None:
    db = sqlite3.connect(str(path))
    for stmt in _V0:
        db.execute(stmt)
    db.execute("INSERT INTO dcp_consumer_state VALUES (?, 0, ?)", (topic, json.dumps(STATE)))
    db.execute("INSERT INTO dcp_consumer_offsets VALUES (?, 0, 10)", (topic,))
    db.execute("INSERT INTO dcp_mutation_log VALUES (0, 5, ?, ?, 3)", (b"a", b'{"v":1}'))
    db.execute("INSERT INTO dcp_mutation_log_floor VALUES (0, 0, 1)")
    db.execute("INSERT INTO docs VALUES ('a', ?, 0, 5)", (b'{"v":2}',))
    db.commit()
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0
    db.close()


def test_version_0_state_file_migrates_and_keeps_its_data(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    _version_0_file(path, "t")
    store = SqliteStateStore(path, "t")
    try:
        assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 1
        st = store.load(0)
        # the version-0 row (written with ``applied_seqno``) reads back whole; it is re-serialized in the one
        # position form (``seqno``: schemas.position.VBucketPosition)
        expected = {k: v for k, v in STATE.items() if k != "applied_seqno"} | {"seqno": STATE["applied_seqno"]}
        assert st is not None and st.to_dict() == expected
        assert store.partition_offsets() == {0: 10}
        log = MutationLog(store.conn)
        assert log.entries(0) == 1 and log.can_undo_to(0, 4)
        undo = log.undo_to(0, 4)
        assert [(u.key, u.prior_value, u.prior_seqno) for u in undo] == [(b"a", b'{"v":1}', 3)]
        assert store.conn.execute("SELECT key, value, seqno FROM docs").fetchall() == [("a", b'{"v":2}', 5)]
    finally:
        store.close()


def test_replicator_opens_a_version_0_replica(kafka_broker: Broker, make_topic: Callable[..., str],
                                              tmp_path: Path) -> None:
    topic = make_topic()
    path = tmp_path / "replica.sqlite"
    _version_0_file(path, topic)
    with Replicator(kafka_broker.bootstrap_servers, topic, path, dead_letter=None) as rep:
        assert rep.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert rep.conn.execute("SELECT key, seqno FROM docs").fetchall() == [("a", 5)]
        st = rep.consumer.store.load(0)
        assert st is not None and st.applied_seqno == 5


def test_state_file_of_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.sqlite"
    db = sqlite3.connect(str(path))
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StateStoreError, match="newer than this library"):
        SqliteStateStore(path, "t")
