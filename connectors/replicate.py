"""Reference application of the client library: keep a SQLite table equal to the source bucket.

``docs(key TEXT PRIMARY KEY, value BLOB, vbucket INTEGER, seqno INTEGER)`` holds every live document
(deletions and expirations remove the row). Each snapshot is applied in one SQLite transaction together with
the consumer state and the mutation log (they share the file): a crash leaves the replica at a snapshot
boundary of every vbucket, and the consumer resumes exactly there. Rollbacks restore the undo list of the
mutation log, or wipe the vbucket's rows when it must be rebuilt from zero.

A record of the topic that does not decode (corrupt) is copied once to the dead-letter topic (``{topic}.dlq``)
and remembered in the file (``replicate_dead_letters``): met again (a later run reads the partition from an
offset before it), it is not copied again. ``run(skip_corrupt=True)`` (what ``dcpgw replicate`` does) then goes
on after it, counting it in ``dead_letters``; without it the :class:`~connectors.exceptions.DecodeError` is raised
and a later ``run()`` goes on after the record.

CLI: ``dcpgw replicate --topic dcp.default --db replica.sqlite [--until-caught-up]``.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from connectors.client.consumer import (
    DEFAULT_BATCH_SIZE,
    ChangeStreamConsumer,
    DeadLetter,
    DeadLetterTopic,
    RollbackInstruction,
)
from connectors.client.mutation_log import DEFAULT_MAX_ENTRIES, Prior
from connectors.client.replay import Oversize, Snapshot
from connectors.exceptions import ConnectorError, DecodeError

__all__ = ["Replicator"]

#: in the consumer's state file: a change here is a migration step of connectors.client.state (SCHEMA_VERSION)
_SCHEMA = "CREATE TABLE IF NOT EXISTS docs (key TEXT PRIMARY KEY, value BLOB, vbucket INTEGER, seqno INTEGER)"
#: the corrupt records already copied to the dead-letter destination (a new table: files without it get it)
_DEAD_SCHEMA = ("CREATE TABLE IF NOT EXISTS replicate_dead_letters (topic TEXT NOT NULL, kafka_partition INTEGER "
                "NOT NULL, kafka_offset INTEGER NOT NULL, error TEXT, PRIMARY KEY (topic, kafka_partition, kafka_offset))")


log = logging.getLogger(__name__)

def _k(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


class Replicator:
    """Replicates ``topic`` into the ``docs`` table of ``db`` (see the module docstring)."""

    def __init__(self, kafka: str | Mapping[str, Any], topic: str, db: str | Path, *,
                 group_id: str | None = None, mutation_log_max: int = DEFAULT_MAX_ENTRIES,
                 dead_letter: str | None = "{topic}.dlq", batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        if dead_letter is not None and not isinstance(dead_letter, str):
            raise ConnectorError(f"dead_letter must be a topic name ({{topic}} is replaced) or None, got "
                                 f"{type(dead_letter).__name__} {dead_letter!r}")
        self.topic = topic
        #: the consumer's dead-letter destination is this object: it copies a record once (see the module)
        self.consumer = ChangeStreamConsumer(kafka, topic, group_id=group_id, state_path=db,
                                             prior_lookup=self._priors, mutation_log_max=mutation_log_max,
                                             dead_letter=self._dead_letter, batch_size=batch_size)
        try:
            self._dlq: DeadLetterTopic | None = (None if dead_letter is None
                                                 else self.consumer.dead_letter_topic(dead_letter))
        except ConnectorError:
            self.consumer.close()
            raise
        store = self.consumer.store
        assert hasattr(store, "conn")
        self.conn: sqlite3.Connection = store.conn
        self.conn.execute(_SCHEMA)
        self.conn.execute(_DEAD_SCHEMA)
        #: corrupt records copied to the dead-letter destination by this object (one already copied by an
        #: earlier run, met again, is not copied or counted again)
        self.dead_letters = 0
        self.snapshots = 0
        self.changes = 0
        #: changes Kafka refused as too large (oversize records): the table keeps the key's previous value
        self.oversize: list[Oversize] = []
        self.rollbacks: list[RollbackInstruction] = []

    def _priors(self, vbucket: int, keys: Sequence[bytes]) -> dict[bytes, Prior]:
        out: dict[bytes, Prior] = {}
        for i in range(0, len(keys), 500):
            chunk = keys[i:i + 500]
            q = f"SELECT key, value, seqno FROM docs WHERE key IN ({','.join('?' * len(chunk))})"
            for k, v, s in self.conn.execute(q, [_k(x) for x in chunk]):
                out[k.encode("utf-8", "surrogateescape")] = (bytes(v), int(s))
        return out

    def on_snapshot(self, snap: Snapshot) -> None:
        # inside the consumer's transaction: committed together with the state by consumer.commit()
        ups = []
        dels = []
        for c in snap.changes:
            if c.deleted:
                dels.append((_k(c.key),))
            else:
                assert c.value is not None
                ups.append((_k(c.key), c.value, c.vbucket, c.seqno))
        # changes are in seqno order; the last change of a key wins, so apply them in order
        if not dels:
            self.conn.executemany("INSERT OR REPLACE INTO docs VALUES (?, ?, ?, ?)", ups)
        else:
            for c in snap.changes:
                if c.deleted:
                    self.conn.execute("DELETE FROM docs WHERE key = ?", (_k(c.key),))
                else:
                    self.conn.execute("INSERT OR REPLACE INTO docs VALUES (?, ?, ?, ?)",
                                      (_k(c.key), c.value, c.vbucket, c.seqno))
        self.snapshots += 1
        self.changes += len(snap.changes)

    def on_rollback(self, rb: RollbackInstruction) -> None:
        self.rollbacks.append(rb)
        if rb.rebuild_from_zero:
            self.conn.execute("DELETE FROM docs WHERE vbucket = ?", (rb.vbucket,))
            return
        for u in rb.undo:
            if u.prior_value is None:
                self.conn.execute("DELETE FROM docs WHERE key = ?", (_k(u.key),))
            else:
                self.conn.execute("INSERT OR REPLACE INTO docs VALUES (?, ?, ?, ?)",
                                  (_k(u.key), u.prior_value, rb.vbucket, u.prior_seqno))

    def run(self, until_caught_up: bool = True, *, skip_corrupt: bool = False) -> None:
        """Apply the topic (to its end with ``until_caught_up``). A corrupt record is dead-lettered (once) and
        then raises :class:`DecodeError`, or with ``skip_corrupt`` is logged and passed over."""
        self.consumer.run(self.on_snapshot, self.on_rollback, until_caught_up=until_caught_up,
                          on_oversize=self.on_oversize, on_error=self.on_corrupt if skip_corrupt else None)

    def on_corrupt(self, e: DecodeError) -> None:
        log.warning("replicate: corrupt record at %s[%d]@%d passed over (dead-lettered once): %s", e.topic,
                    e.partition, e.offset, e)

    def _dead_letter(self, dl: DeadLetter) -> None:
        """The consumer's dead-letter callback: copy ``dl`` to the dead-letter topic unless an earlier run did."""
        seen = self.conn.execute("SELECT 1 FROM replicate_dead_letters WHERE topic = ? AND kafka_partition = ? AND "
                                 "kafka_offset = ?", (dl.topic, dl.partition, dl.offset)).fetchone()
        if seen is not None:
            return
        if self._dlq is not None:
            self._dlq.copy(dl)
        # written in the consumer's open transaction: committed with the next confirmed events (run() flushes
        # before it hands the DecodeError on); a crash before that copies the record again on the next run
        self.conn.execute("INSERT OR IGNORE INTO replicate_dead_letters VALUES (?, ?, ?, ?)",
                          (dl.topic, dl.partition, dl.offset, dl.error))
        self.dead_letters += 1

    def on_oversize(self, o: Oversize) -> None:
        """A change Kafka refused as too large: the table keeps the key's previous value (docs/client.md)."""
        self.oversize.append(o)
        log.warning("replicate: key %r of vbucket %d changed at seqno %d but its %d-byte value is not in the topic "
                    "(Kafka refused it as too large: %s); the table keeps the previous value", o.key, o.vbucket,
                    o.seqno, o.size, o.reason)

    def docs(self) -> dict[bytes, tuple[bytes, int]]:
        """key -> (value, vbucket), like ``engine.Bucket.state_snapshot()``."""
        return {k.encode("utf-8", "surrogateescape"): (bytes(v), int(vb))
                for k, v, vb in self.conn.execute("SELECT key, value, vbucket FROM docs")}

    def close(self) -> None:
        self.consumer.close()
        if self._dlq is not None:
            self._dlq.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
