"""What the target was sent, at which of its positions: the Spark job's check that the target still holds
what it wrote (docs/xdcr.md "Spark job").

The standalone replicator owns its source positions and, when the target lost history, moves them back to a
checkpoint (``checkpoints.py``). The Spark job cannot: Spark owns the source offsets. So it keeps, per target
vbucket and key, the last version it wrote there with the target's mutation token of that write (vbuuid,
seqno; kv_engine answers it with HELLO ``MutationSeqno``) and the vbucket's newest token. On start, and whenever
a write answers with a vbuuid the job had not seen for the vbucket, the target's failover log is read: a
write whose token the target no longer holds (``history_holds``, the rule of docs/rollback.md -- a hard
failover or an unclean restart of the target lost it) is written again from this record, with the options it
had (a forced undo stays forced). A resend the target refuses (it holds an equal or newer version) is marked
as held from the vbucket's current branch start.

One row per (target vbucket, key): the table grows with the keys, not the changes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from connectors.xdcr.checkpoints import history_holds
from connectors.xdcr.document import DocVersion
from connectors.xdcr.target import WriteOp

__all__ = ["TargetLedger"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS xdcr_target_docs (
    target_vbucket INTEGER NOT NULL, key BLOB NOT NULL, source_vbucket INTEGER NOT NULL,
    target_vbuuid INTEGER NOT NULL, target_seqno INTEGER NOT NULL, options INTEGER NOT NULL,
    expiration INTEGER NOT NULL, version BLOB NOT NULL, PRIMARY KEY (target_vbucket, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS xdcr_target_position (
    vbucket INTEGER PRIMARY KEY, target_vbuuid INTEGER NOT NULL, target_seqno INTEGER NOT NULL)
"""


class TargetLedger:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        for stmt in _SCHEMA.split(";"):
            if stmt.strip():
                conn.execute(stmt)

    def record(self, op: WriteOp, target_vbucket: int, token: tuple[int, int] | None) -> bool:
        """A write the target accepted; True when its vbuuid is new for the vbucket (a failover or restart of
        the target since the last write: check its history with :meth:`take_lost`)."""
        u, s = token if token is not None else (0, 0)
        self.conn.execute("INSERT OR REPLACE INTO xdcr_target_docs VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                          (target_vbucket, op.version.key, op.vbucket, u, s, op.options, int(op.expiration),
                           op.version.pack()))
        if token is None:
            return False
        prev = self.position(target_vbucket)
        if prev is not None and prev[0] != u:
            return True  # the position moves to the new branch once its history is checked (take_lost)
        if prev is None or s > prev[1]:
            self.conn.execute("INSERT OR REPLACE INTO xdcr_target_position VALUES (?, ?, ?)",
                              (target_vbucket, u, s))
        return False

    def position(self, target_vbucket: int) -> tuple[int, int] | None:
        row = self.conn.execute("SELECT target_vbuuid, target_seqno FROM xdcr_target_position WHERE vbucket = ?",
                                (target_vbucket,)).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def positions(self) -> dict[int, tuple[int, int]]:
        return {int(v): (int(u), int(s)) for v, u, s in
                self.conn.execute("SELECT vbucket, target_vbuuid, target_seqno FROM xdcr_target_position")}

    def take_lost(self, target_vbucket: int, failover_log: Sequence[tuple[int, int]]) -> list[WriteOp]:
        """The writes to ``target_vbucket`` whose position its ``failover_log`` (newest first) no longer holds,
        to send again (none when the vbucket's recorded position is held: everything below it is). Their rows
        move to the current branch's start (the resends that succeed record their own tokens; those the target
        refuses -- it holds an equal or newer version -- stay there), and the vbucket's position to the newest
        write recorded on the current branch."""
        pos = self.position(target_vbucket)
        if pos is None or not failover_log:
            return []
        branch = failover_log[0]
        out = []
        if not history_holds(failover_log, *pos):
            for key, svb, u, s, opts, exp, ver in self.conn.execute(
                    "SELECT key, source_vbucket, target_vbuuid, target_seqno, options, expiration, version FROM "
                    "xdcr_target_docs WHERE target_vbucket = ?", (target_vbucket,)).fetchall():
                if not history_holds(failover_log, int(u), int(s)):
                    out.append(WriteOp(int(svb), DocVersion.unpack(bytes(key), bytes(ver)), int(opts),
                                       expiration=bool(exp)))
            self.conn.executemany("UPDATE xdcr_target_docs SET target_vbuuid = ?, target_seqno = ? WHERE "
                                  "target_vbucket = ? AND key = ?",
                                  [(*branch, target_vbucket, o.version.key) for o in out])
        (top,) = self.conn.execute("SELECT max(target_seqno) FROM xdcr_target_docs WHERE target_vbucket = ? AND "
                                   "target_vbuuid = ?", (target_vbucket, branch[0])).fetchone()
        self.conn.execute("INSERT OR REPLACE INTO xdcr_target_position VALUES (?, ?, ?)",
                          (target_vbucket, branch[0], max(branch[1], int(top or 0))))
        return out
