"""Consumer state stores: where a :class:`~connectors.client.consumer.ChangeStreamConsumer` keeps, per
vbucket, the :class:`~connectors.client.replay.ConsumerPosition` of the last confirmed event and, per partition,
the offset to resume from.

:class:`StateStore` is the pluggable protocol; :class:`SqliteStateStore` the default. It shares its SQLite file
(and connection) with the :class:`~connectors.client.mutation_log.MutationLog`, so one transaction per
confirmed event (or group of events) covers the state, the mutation log and -- when the application keeps its data in the same file
(``connectors.replicate``) -- the application's change.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from connectors.client.replay import ConsumerPosition
from connectors.exceptions import StateStoreError

__all__ = ["SCHEMA_VERSION", "MemoryStateStore", "SqliteStateStore", "StateStore"]

#: ``PRAGMA user_version`` of a state file this library writes. It covers every table the connectors keep in
#: that file: ``dcp_consumer_state``, ``dcp_consumer_offsets``, the mutation log's ``dcp_mutation_log`` and
#: ``dcp_mutation_log_floor`` and ``connectors.replicate``'s ``docs`` (docs/reliability.md, "Schema versions").
SCHEMA_VERSION = 1


def _v0_to_v1(conn: sqlite3.Connection) -> None:
    """Version 0 is the layout before state files carried a version: the tables are unchanged."""


#: ``_MIGRATIONS[v]`` takes a state file of schema version ``v`` to ``v + 1``.
_MIGRATIONS = (_v0_to_v1,)


def _migrate(conn: sqlite3.Connection, path: str | Path) -> None:
    """Bring the state file at ``path`` to :data:`SCHEMA_VERSION` (a new file is created at it)."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise StateStoreError(f"the state store {path} has schema version {version}, newer than this "
                              f"library's {SCHEMA_VERSION}: open it with the version that wrote it")
    if version == SCHEMA_VERSION:
        return
    existing = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type='table' AND name='dcp_consumer_state'").fetchone()
    conn.execute("BEGIN IMMEDIATE")
    try:
        if existing is not None:
            for step in _MIGRATIONS[version:]:
                step(conn)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


@runtime_checkable
class StateStore(Protocol):
    """Per-vbucket consumer state and per-partition resume offsets of one topic."""

    def load(self, vbucket: int) -> ConsumerPosition | None:
        """The state saved for ``vbucket``, or None (never confirmed anything: start from the beginning)."""
        ...

    def partition_offsets(self) -> dict[int, int]:
        """partition -> the offset to resume from (every record below it is settled)."""
        ...

    def begin(self) -> None:
        """Start one event's part of the transaction (before the application applies it)."""
        ...

    def save(self, states: Iterable[ConsumerPosition], partition_offsets: Mapping[int, int], *,
             durable: bool = True) -> None:
        """Save ``states`` and ``partition_offsets``, ending the event begun by :meth:`begin`. ``durable``:
        commit now, with every event saved before; else the store may keep the transaction open until
        :meth:`flush` (group commit: one commit for several events, all or none of them)."""
        ...

    def flush(self) -> None:
        """Commit every event saved so far."""
        ...

    def rollback(self) -> None:
        """Abandon the event begun by :meth:`begin` (events saved before it stay, :meth:`flush` commits
        them)."""
        ...

    def close(self) -> None: ...


class SqliteStateStore:
    """The default store: tables ``dcp_consumer_state`` and ``dcp_consumer_offsets`` of a SQLite file.

    ``conn`` is public: the mutation log and applications that want their writes in the same transaction use
    it between :meth:`begin` and :meth:`save`.
    """

    def __init__(self, path: str | Path, topic: str) -> None:
        self.path = Path(path)
        self.topic = topic
        self._in_event = False
        try:
            self.conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            try:
                _migrate(self.conn, path)
            except StateStoreError:
                self.conn.close()
                raise
            self.conn.execute("CREATE TABLE IF NOT EXISTS dcp_consumer_state (topic TEXT NOT NULL, "
                              "vbucket INTEGER NOT NULL, state TEXT NOT NULL, PRIMARY KEY (topic, vbucket))")
            self.conn.execute("CREATE TABLE IF NOT EXISTS dcp_consumer_offsets (topic TEXT NOT NULL, "
                              "partition INTEGER NOT NULL, offset INTEGER NOT NULL, "
                              "PRIMARY KEY (topic, partition))")
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot open the state store {path}: {e}") from e

    def load(self, vbucket: int) -> ConsumerPosition | None:
        try:
            row = self.conn.execute("SELECT state FROM dcp_consumer_state WHERE topic = ? AND vbucket = ?",
                                    (self.topic, vbucket)).fetchone()
            return None if row is None else ConsumerPosition.from_dict(json.loads(row[0]))
        except (sqlite3.Error, ValueError, KeyError) as e:
            raise StateStoreError(f"cannot load the state of vbucket {vbucket}: {e}") from e

    def load_all(self) -> dict[int, ConsumerPosition]:
        rows = self.conn.execute("SELECT vbucket, state FROM dcp_consumer_state WHERE topic = ?",
                                 (self.topic,)).fetchall()
        return {int(vb): ConsumerPosition.from_dict(json.loads(s)) for vb, s in rows}

    def partition_offsets(self) -> dict[int, int]:
        try:
            rows = self.conn.execute("SELECT partition, offset FROM dcp_consumer_offsets WHERE topic = ?",
                                     (self.topic,)).fetchall()
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot load the partition offsets: {e}") from e
        return {int(p): int(o) for p, o in rows}

    def begin(self) -> None:
        try:
            if not self.conn.in_transaction:
                self.conn.execute("BEGIN IMMEDIATE")
            if not self._in_event:
                self.conn.execute("SAVEPOINT dcp_event")
                self._in_event = True
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot begin a transaction on {self.path}: {e}") from e

    def save(self, states: Iterable[ConsumerPosition], partition_offsets: Mapping[int, int], *,
             durable: bool = True) -> None:
        try:
            self.begin()
            self.conn.executemany("INSERT OR REPLACE INTO dcp_consumer_state VALUES (?, ?, ?)",
                                  [(self.topic, s.vbucket, s.to_json().decode()) for s in states])
            if partition_offsets:
                self.conn.executemany("INSERT OR REPLACE INTO dcp_consumer_offsets VALUES (?, ?, ?)",
                                      [(self.topic, p, o) for p, o in partition_offsets.items()])
            self.conn.execute("RELEASE dcp_event")
            self._in_event = False
            if durable:
                self.conn.execute("COMMIT")
        except sqlite3.Error as e:
            self.rollback()
            raise StateStoreError(f"cannot save the consumer state to {self.path}: {e}") from e

    def flush(self) -> None:
        try:
            if self._in_event:
                raise StateStoreError("flush() inside an event: save() or rollback() it first")
            if self.conn.in_transaction:
                self.conn.execute("COMMIT")
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot commit the consumer state to {self.path}: {e}") from e

    def rollback(self) -> None:
        try:
            if self._in_event:
                self._in_event = False
                self.conn.execute("ROLLBACK TO dcp_event")
                self.conn.execute("RELEASE dcp_event")
        except sqlite3.Error as e:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            raise StateStoreError(f"cannot roll back the transaction on {self.path}: {e}") from e

    def close(self) -> None:
        self.rollback()
        self.flush()
        self.conn.close()


class MemoryStateStore:
    """A store that keeps nothing across processes (tests, throw-away consumers). No mutation log."""

    def __init__(self) -> None:
        self.states: dict[int, ConsumerPosition] = {}
        self.offsets: dict[int, int] = {}

    def load(self, vbucket: int) -> ConsumerPosition | None:
        s = self.states.get(vbucket)
        return None if s is None else s.copy()

    def partition_offsets(self) -> dict[int, int]:
        return dict(self.offsets)

    def begin(self) -> None:
        pass

    def save(self, states: Iterable[ConsumerPosition], partition_offsets: Mapping[int, int], *,
             durable: bool = True) -> None:
        for s in states:
            self.states[s.vbucket] = s.copy()
        self.offsets.update(partition_offsets)

    def flush(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass
