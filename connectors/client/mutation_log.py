"""The client's mutation log (docs/client.md "Mutation log"): how to undo what a rollback takes back.

Before the application applies a snapshot, the consumer records, for every key the snapshot changes, the
key's *prior version* in the application (its value and seqno, or its absence) under the seqno of the change.
After a rollback to seqno ``s`` the application restores, for every key changed above ``s``, the oldest prior
version recorded above ``s`` -- the version the key had at ``s``.

The log is bounded: at most ``max_entries`` entries per vbucket, the oldest are dropped first. Each vbucket
remembers the highest seqno it dropped (its *floor*); a rollback below the floor cannot be undone from the log
(:meth:`MutationLog.undo_to` raises :class:`LogTooShort`) and the client rebuilds that vbucket from zero.

It lives in a SQLite database (the state store's), in the caller's transaction: the log, the consumer state
and -- for applications that keep their data in the same file -- the data change in one commit.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from connectors.exceptions import StateStoreError

__all__ = ["DEFAULT_MAX_ENTRIES", "LogTooShort", "MutationLog", "Prior", "Undo"]

#: default bound of the log, entries per vbucket
DEFAULT_MAX_ENTRIES = 100_000

#: a key's version in the application: (value, seqno); a key missing from a mapping of priors is absent
Prior = tuple[bytes, int]


@dataclass(frozen=True, slots=True)
class Undo:
    """Restore ``key`` to ``prior_value`` (None: the key did not exist -- delete it)."""

    key: bytes
    prior_value: bytes | None
    #: the seqno of the restored version (0 when the key did not exist)
    prior_seqno: int = 0


class LogTooShort(StateStoreError):
    """The mutation log of a vbucket no longer reaches back to the rollback seqno."""

    def __init__(self, vbucket: int, seqno: int, floor: int) -> None:
        super().__init__(f"mutation log of vbucket {vbucket} starts above seqno {floor}: cannot undo to {seqno}")
        self.vbucket = vbucket
        self.seqno = seqno
        self.floor = floor


#: part of the state file's schema: a change here is a migration step of connectors.client.state (SCHEMA_VERSION)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS dcp_mutation_log (
    vbucket INTEGER NOT NULL,
    seqno INTEGER NOT NULL,
    key BLOB NOT NULL,
    prior_value BLOB,
    prior_seqno INTEGER NOT NULL,
    PRIMARY KEY (vbucket, seqno, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS dcp_mutation_log_floor (
    vbucket INTEGER PRIMARY KEY,
    floor INTEGER NOT NULL,
    entries INTEGER NOT NULL
);
"""


class MutationLog:
    """Per-vbucket bounded log of prior versions on a SQLite connection (no commits: the caller's
    transaction). ``max_entries`` bounds each vbucket's log; trimming happens in :meth:`trim`."""

    #: :meth:`record` needs the prior versions of the keys a snapshot changes (a log that keeps the versions
    #: the application applied instead -- connectors/client/changelog.py -- does not: the consumer then skips
    #: the look-up)
    records_priors = True

    def __init__(self, conn: sqlite3.Connection, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.conn = conn
        self.max_entries = max_entries
        try:
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    conn.execute(stmt)
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot create the mutation log tables: {e}") from e

    # ------------------------------------------------------------------------------------------ writing
    def record(self, vbucket: int, changes: Iterable[tuple[int, bytes]], priors: Mapping[bytes, Prior]) -> int:
        """Record the prior version of every ``(seqno, key)`` changed; ``priors`` maps key -> (value, seqno)
        of the keys that exist in the application (missing keys are recorded as absent). A change already
        recorded keeps its first prior version (a snapshot delivered again after a crash). Returns the count
        of entries written."""
        rows = []
        for seqno, key in changes:
            p = priors.get(key)
            rows.append((vbucket, seqno, key, None if p is None else p[0], 0 if p is None else p[1]))
        if not rows:
            return 0
        try:
            cur = self.conn.executemany(
                "INSERT OR IGNORE INTO dcp_mutation_log VALUES (?, ?, ?, ?, ?)", rows)
            n = cur.rowcount if cur.rowcount >= 0 else len(rows)
            self.conn.execute(
                "INSERT INTO dcp_mutation_log_floor VALUES (?, 0, ?) ON CONFLICT(vbucket) DO UPDATE SET "
                "entries = entries + excluded.entries", (vbucket, n))
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot write the mutation log of vbucket {vbucket}: {e}") from e
        return n

    def trim(self, vbucket: int) -> int:
        """Drop the oldest entries of ``vbucket`` above ``max_entries``; raises the floor. Returns the count
        dropped."""
        try:
            row = self.conn.execute("SELECT floor, entries FROM dcp_mutation_log_floor WHERE vbucket = ?",
                                    (vbucket,)).fetchone()
            if row is None or row[1] <= self.max_entries:
                return 0
            excess = row[1] - self.max_entries
            cut = self.conn.execute(
                "SELECT seqno FROM dcp_mutation_log WHERE vbucket = ? ORDER BY seqno LIMIT 1 OFFSET ?",
                (vbucket, excess - 1)).fetchone()
            if cut is None:
                return 0
            # drop whole seqnos (every key of a change goes together)
            n = self.conn.execute("DELETE FROM dcp_mutation_log WHERE vbucket = ? AND seqno <= ?",
                                  (vbucket, cut[0])).rowcount
            self.conn.execute("UPDATE dcp_mutation_log_floor SET floor = max(floor, ?), entries = entries - ? "
                              "WHERE vbucket = ?", (cut[0], n, vbucket))
            return int(n)
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot trim the mutation log of vbucket {vbucket}: {e}") from e

    def clear(self, vbucket: int) -> None:
        """Forget a vbucket's log (it is rebuilt from zero): the floor goes back to 0."""
        try:
            self.conn.execute("DELETE FROM dcp_mutation_log WHERE vbucket = ?", (vbucket,))
            self.conn.execute("DELETE FROM dcp_mutation_log_floor WHERE vbucket = ?", (vbucket,))
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot clear the mutation log of vbucket {vbucket}: {e}") from e

    # ------------------------------------------------------------------------------------------ reading
    def floor(self, vbucket: int) -> int:
        """The highest seqno dropped from the log (0: it reaches back to the beginning)."""
        row = self.conn.execute("SELECT floor FROM dcp_mutation_log_floor WHERE vbucket = ?",
                                (vbucket,)).fetchone()
        return 0 if row is None else int(row[0])

    def entries(self, vbucket: int) -> int:
        row = self.conn.execute("SELECT COUNT(*) FROM dcp_mutation_log WHERE vbucket = ?", (vbucket,)).fetchone()
        return int(row[0])

    def can_undo_to(self, vbucket: int, seqno: int) -> bool:
        return seqno >= self.floor(vbucket)

    def undo_to(self, vbucket: int, seqno: int) -> list[Undo]:
        """What to restore so that every key changed above ``seqno`` is back to its version at ``seqno``
        (one :class:`Undo` per key: its oldest prior version above ``seqno``), and remove those entries.

        Raises :class:`LogTooShort` when entries above ``seqno`` were trimmed.
        """
        try:
            fl = self.floor(vbucket)
            if seqno < fl:
                raise LogTooShort(vbucket, seqno, fl)
            rows = self.conn.execute(
                "SELECT key, prior_value, prior_seqno FROM dcp_mutation_log WHERE vbucket = ? AND seqno > ? "
                "ORDER BY seqno DESC", (vbucket, seqno)).fetchall()
            oldest: dict[bytes, Undo] = {}
            for key, value, pseq in rows:  # newest first: the last one seen per key is the oldest
                oldest[bytes(key)] = Undo(bytes(key), None if value is None else bytes(value), int(pseq))
            n = self.conn.execute("DELETE FROM dcp_mutation_log WHERE vbucket = ? AND seqno > ?",
                                  (vbucket, seqno)).rowcount
            self.conn.execute("UPDATE dcp_mutation_log_floor SET entries = max(0, entries - ?) WHERE vbucket = ?",
                              (n, vbucket))
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot read the mutation log of vbucket {vbucket}: {e}") from e
        return sorted(oldest.values(), key=lambda u: u.key)
