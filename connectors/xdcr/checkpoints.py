"""Per-vbucket XDCR checkpoints and target positions in the replicator's state file (docs/xdcr.md
"Checkpoints").

As goxdcr's checkpoint manager keeps them: a checkpoint of a vbucket is the source position applied to the
target (vbuuid, seqno, snapshot range -- the client's :class:`ConsumerPosition`, with its Kafka offset) and the
target vbucket's (vbuuid, seqno) right after it; several are kept per vbucket, newest first. On start every
vbucket's last target position is checked against the target's failover log: if the target lost that
history (a failover on the target), the newest checkpoint whose target position it still holds is resumed
from, else the vbucket restarts from zero.

The tables live in the consumer's SQLite file and are written in its transaction: a checkpoint commits with
the position it names.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from connectors.client.replay import ConsumerPosition

__all__ = ["Checkpoint", "CheckpointStore", "history_holds"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS xdcr_checkpoints (
    vbucket INTEGER NOT NULL, created REAL NOT NULL, source TEXT NOT NULL,
    target_vbuuid INTEGER NOT NULL, target_seqno INTEGER NOT NULL,
    PRIMARY KEY (vbucket, created));
CREATE TABLE IF NOT EXISTS xdcr_target_position (
    vbucket INTEGER PRIMARY KEY, target_vbuuid INTEGER NOT NULL, target_seqno INTEGER NOT NULL)
"""


@dataclass(frozen=True)
class Checkpoint:
    vbucket: int
    created: float
    source: ConsumerPosition
    target_vbuuid: int
    target_seqno: int


def history_holds(failover_log: Sequence[tuple[int, int]], vbuuid: int, seqno: int) -> bool:
    """Does a vbucket with ``failover_log`` (newest first) still hold the history up to ``seqno`` written on
    branch ``vbuuid``? (docs/rollback.md: entry (u, s) owns the seqnos above s up to the next newer entry's.)"""
    if vbuuid == 0:
        return True  # the target gave no position (no MutationSeqno): nothing to check
    for i, (u, _s) in enumerate(failover_log):
        if u == vbuuid:
            return i == 0 or seqno <= failover_log[i - 1][1]
    return False


class CheckpointStore:
    def __init__(self, conn: sqlite3.Connection, keep: int = 5, clock: Callable[[], float] = time.time) -> None:
        self.conn = conn
        self.keep = keep
        self.clock = clock
        for stmt in _SCHEMA.split(";"):
            if stmt.strip():
                conn.execute(stmt)

    def add(self, pos: ConsumerPosition, target_vbuuid: int, target_seqno: int) -> None:
        now = self.clock()
        self.conn.execute("INSERT OR REPLACE INTO xdcr_checkpoints VALUES (?, ?, ?, ?, ?)",
                          (pos.vbucket, now, pos.to_json().decode(), target_vbuuid, target_seqno))
        self.conn.execute("DELETE FROM xdcr_checkpoints WHERE vbucket = ? AND created NOT IN (SELECT created FROM "
                          "xdcr_checkpoints WHERE vbucket = ? ORDER BY created DESC LIMIT ?)",
                          (pos.vbucket, pos.vbucket, self.keep))

    def list(self, vbucket: int) -> list[Checkpoint]:
        """Newest first."""
        rows = self.conn.execute("SELECT created, source, target_vbuuid, target_seqno FROM xdcr_checkpoints "
                                 "WHERE vbucket = ? ORDER BY created DESC", (vbucket,)).fetchall()
        return [Checkpoint(vbucket, c, ConsumerPosition.from_dict(json.loads(s)), int(u), int(q))
                for c, s, u, q in rows]

    def drop_after(self, vbucket: int, seqno: int) -> int:
        """Forget the vbucket's checkpoints above ``seqno`` (the source rolled back to it: they name a lost
        branch, and the mirror and mutation log no longer describe it). Returns how many."""
        gone = [ck.created for ck in self.list(vbucket) if ck.source.seqno > seqno]
        self.conn.executemany("DELETE FROM xdcr_checkpoints WHERE vbucket = ? AND created = ?",
                              [(vbucket, c) for c in gone])
        return len(gone)

    def drop(self, vbucket: int) -> None:
        self.conn.execute("DELETE FROM xdcr_checkpoints WHERE vbucket = ?", (vbucket,))
        self.conn.execute("DELETE FROM xdcr_target_position WHERE vbucket = ?", (vbucket,))

    def count(self, vbucket: int) -> int:
        """How many checkpoints the vbucket keeps."""
        return int(self.conn.execute("SELECT COUNT(*) FROM xdcr_checkpoints WHERE vbucket = ?",
                                     (vbucket,)).fetchone()[0])

    @staticmethod
    def counts(conn: sqlite3.Connection) -> dict[int, int]:
        """How many checkpoints each vbucket keeps."""
        return {int(vb): int(n) for vb, n in
                conn.execute("SELECT vbucket, COUNT(*) FROM xdcr_checkpoints GROUP BY vbucket")}

    def set_target_position(self, vbucket: int, vbuuid: int, seqno: int) -> None:
        self.conn.execute("INSERT OR REPLACE INTO xdcr_target_position VALUES (?, ?, ?)", (vbucket, vbuuid, seqno))

    def target_positions(self) -> dict[int, tuple[int, int]]:
        return self.read_target_positions(self.conn)

    @staticmethod
    def read_target_positions(conn: sqlite3.Connection) -> dict[int, tuple[int, int]]:
        return {int(v): (int(u), int(s)) for v, u, s in
                conn.execute("SELECT vbucket, target_vbuuid, target_seqno FROM xdcr_target_position")}
