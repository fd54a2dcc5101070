"""An application's changelog (docs/client.md "Mutation log"): the source's history as the application applied
it, per vbucket in seqno order, from which a rollback restores every key changed above the rollback point to
its version at that point. The XDCR replicator (docs/xdcr.md "Source rollbacks") and the search indexer
(docs/search.md "How it stays exact") keep one each, in their state file (tables ``table``, default
``xdcr_changelog``, and ``{table}_floor``).

Append-only: each snapshot adds one *segment* row (the vbucket, its first and last seqno, the packed versions
of its changes in seqno order) -- one SQLite insert per snapshot, no per-key index, nothing read on the hot
path. A key's prior version is looked up only when a rollback asks for it: the keys changed above the rollback
point ``r`` are read from the segments above ``r``, and for each its newest version at or below ``r``, scanning
the segments below ``r`` newest first until every key is found; a key with none did not exist at ``r``. A
version is opaque bytes of the application's (the replicator's packed ``DocVersion``, the indexer's body).

Bounded as the client's mutation log (``max_entries`` per vbucket): above a vbucket's *floor* every entry is
kept; when more than twice ``max_entries`` lie above it, the floor rises to a segment boundary leaving at least
``max_entries`` above, and the segments at or below it are compacted into one that keeps each key's newest
version only -- its version at the floor, what a rollback to any seqno at or above the floor needs (as
couchstore's by-seqno index keeps a key once). A rollback below the floor raises
:class:`~connectors.client.mutation_log.LogTooShort`: the client rebuilds the vbucket from zero.

Each segment carries a *generation* (0 unless the application says otherwise): an application that applies
the changelog somewhere else in batches (the search indexer's index backend) tags the segments with the batch
they belong to and reads back, after a crash, every segment above the last batch it saw committed
(:meth:`Changelog.segments_above`). Within a vbucket generations never decrease with the seqno (a rollback or a
snapshot delivered again removes the segments above it first), so the segments above a generation are a suffix
of each vbucket's; a compacted segment takes the highest generation it merged, a segment cut at a rollback
point keeps its own.

For the consumer it plays the client's :class:`~connectors.client.mutation_log.MutationLog` (the same methods:
the consumer asks it for undo lists, trims and clears it); :meth:`Changelog.record` does nothing, the
application appends the versions itself (:meth:`Changelog.append`) and the consumer's prior look-ups are not
needed. It writes in the caller's transaction (the consumer's), never commits.
"""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence

from connectors.client.mutation_log import DEFAULT_MAX_ENTRIES, LogTooShort, MutationLog, Prior, Undo
from connectors.exceptions import StateStoreError

__all__ = ["ENTRY_HEAD", "Changelog", "pack_entry", "segment_entries"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
    vbucket INTEGER NOT NULL, last_seqno INTEGER NOT NULL, first_seqno INTEGER NOT NULL,
    entries INTEGER NOT NULL, data BLOB NOT NULL, gen INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (vbucket, last_seqno));
CREATE TABLE IF NOT EXISTS {t}_floor (vbucket INTEGER PRIMARY KEY, floor INTEGER NOT NULL)
"""

#: an entry of a segment: seqno, key length, version length; then the version (``DocVersion.pack``), the key
ENTRY_HEAD = _HEAD = struct.Struct(">QHI")


def pack_entry(seqno: int, key: bytes, version: bytes) -> bytes:
    """One entry of a segment (a caller building a whole segment may join ``ENTRY_HEAD.pack(seqno, len(key),
    len(version))``, the version's pieces and the key instead: the same bytes)."""
    return _HEAD.pack(seqno, len(key), len(version)) + version + key


def segment_entries(data: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    """(seqno, key, version) of each entry of a segment's ``data``, in seqno order."""
    return _entries(data)


def _entries(data: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    """(seqno, key, packed version) of a segment, in seqno order."""
    pos, end, size, unpack = 0, len(data), _HEAD.size, _HEAD.unpack_from
    while pos < end:
        seqno, klen, vlen = unpack(data, pos)
        pos += size
        version = data[pos:pos + vlen]
        pos += vlen
        yield seqno, data[pos:pos + klen], version
        pos += klen


class Changelog(MutationLog):
    records_priors = False

    def __init__(self, conn: sqlite3.Connection, max_entries: int = DEFAULT_MAX_ENTRIES, *,
                 table: str = "xdcr_changelog") -> None:
        if not table.isidentifier():
            raise ValueError(f"changelog table name {table!r} is not an identifier")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.conn = conn
        self.max_entries = max_entries
        self.table = table
        #: vbucket -> the keys it held when :meth:`clear` wiped it (what a rebuild from zero must tombstone)
        self.cleared: dict[int, list[bytes]] = {}
        # caches (reloaded from the table when missing): entries above the floor, highest seqno appended
        self._above: dict[int, int] = {}
        self._last: dict[int, int] = {}
        try:
            for stmt in _SCHEMA.format(t=table).split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            if "gen" not in {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}:
                # a table written before segments had generations: its segments are of generation 0
                conn.execute(f"ALTER TABLE {table} ADD COLUMN gen INTEGER NOT NULL DEFAULT 0")
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot create the changelog tables {table}: {e}") from e

    # ------------------------------------------------------------------------------------------ writing
    def append(self, vbucket: int, first: int, last: int, entries: Sequence[bytes]) -> None:
        """One snapshot's changes (``pack_entry`` each, seqno order, seqnos ``first`` .. ``last``). A snapshot
        delivered again (seqnos at or below what the vbucket holds) replaces what it covers."""
        if entries:
            self.append_segment(vbucket, first, last, len(entries), b"".join(entries))

    def append_segment(self, vbucket: int, first: int, last: int, count: int, data: bytes, gen: int = 0) -> None:
        """:meth:`append` of a segment packed by the caller: ``count`` entries, ``data`` their ``pack_entry``
        bytes joined (the indexer builds it in one pass, and streams the same bytes to its writer process), of
        generation ``gen`` (module docstring)."""
        try:
            if first <= self._last_seqno(vbucket):
                self._truncate_above(vbucket, first - 1)
            self.conn.execute(f"INSERT INTO {self.table} VALUES (?, ?, ?, ?, ?, ?)",
                              (vbucket, last, first, count, data, gen))
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot write the changelog of vbucket {vbucket}: {e}") from e
        self._last[vbucket] = last
        if vbucket in self._above:
            self._above[vbucket] += count

    def record(self, vbucket: int, changes: Iterable[tuple[int, bytes]], priors: Mapping[bytes, Prior]) -> int:
        """Nothing: the versions are appended by the replicator (:meth:`append`)."""
        return 0

    def trim(self, vbucket: int) -> int:
        """Compact ``vbucket`` when more than twice ``max_entries`` lie above its floor (module docstring).
        Returns the count of entries dropped."""
        try:
            if self._entries_above(vbucket) <= 2 * self.max_entries:
                return 0
            acc, floor = 0, None
            for last, n in self.conn.execute(f"SELECT last_seqno, entries FROM {self.table} WHERE vbucket = ? "
                                             "ORDER BY last_seqno DESC", (vbucket,)):
                if acc >= self.max_entries:
                    floor = int(last)
                    break
                acc += int(n)
            if floor is None:
                return 0
            newest: dict[bytes, tuple[int, bytes]] = {}
            total = gen = 0
            for data, g in self.conn.execute(f"SELECT data, gen FROM {self.table} WHERE vbucket = ? AND "
                                             "last_seqno <= ? ORDER BY last_seqno", (vbucket, floor)):
                gen = max(gen, int(g))
                for seqno, key, version in _entries(data):
                    newest[key] = (seqno, version)
                    total += 1
            kept = sorted((sq, k, v) for k, (sq, v) in newest.items())
            self.conn.execute(f"DELETE FROM {self.table} WHERE vbucket = ? AND last_seqno <= ?", (vbucket, floor))
            self.conn.execute(f"INSERT INTO {self.table} VALUES (?, ?, ?, ?, ?, ?)",
                              (vbucket, floor, kept[0][0], len(kept), b"".join(pack_entry(*e) for e in kept), gen))
            self.conn.execute(f"INSERT INTO {self.table}_floor VALUES (?, ?) ON CONFLICT(vbucket) DO UPDATE SET "
                              "floor = max(floor, excluded.floor)", (vbucket, floor))
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot compact the changelog of vbucket {vbucket}: {e}") from e
        self._above[vbucket] = acc
        return total - len(kept)

    def clear(self, vbucket: int) -> None:
        """Forget ``vbucket`` (it is rebuilt from zero; the floor goes back to 0). The keys it held are left
        in :attr:`cleared`."""
        try:
            self.cleared[vbucket] = self.keys(vbucket)
            self.conn.execute(f"DELETE FROM {self.table} WHERE vbucket = ?", (vbucket,))
            self.conn.execute(f"DELETE FROM {self.table}_floor WHERE vbucket = ?", (vbucket,))
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot clear the changelog of vbucket {vbucket}: {e}") from e
        self._above.pop(vbucket, None)
        self._last.pop(vbucket, None)

    def truncate_above(self, vbucket: int, seqno: int) -> None:
        """Drop the entries above ``seqno`` (the vbucket resumes from an older position and reads them
        again)."""
        try:
            self._truncate_above(vbucket, seqno)
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot truncate the changelog of vbucket {vbucket}: {e}") from e

    def rewind(self, vbucket: int, seqno: int) -> None:
        """The vbucket resumes from an older position (a checkpoint the target still holds, docs/xdcr.md
        "Checkpoints"): drop the entries above ``seqno``, the replay appends them again. Raises
        :class:`LogTooShort` below the floor (what the changelog holds there is newer than ``seqno``: the caller
        rebuilds the vbucket from zero)."""
        fl = self.floor(vbucket)
        if seqno < fl:
            raise LogTooShort(vbucket, seqno, fl)
        self.truncate_above(vbucket, seqno)

    def forget_cached(self) -> None:
        """The caller's transaction was rolled back: what this object cached of it is reloaded from the
        tables."""
        self._above.clear()
        self._last.clear()
        self.cleared.clear()

    def _truncate_above(self, vbucket: int, seqno: int) -> list[tuple[int, bytes, bytes]]:
        """Drop the entries above ``seqno``; returns them (seqno order)."""
        dropped: list[tuple[int, bytes, bytes]] = []
        kept: list[tuple[int, bytes, bytes]] = []
        kept_gen = 0
        rows = self.conn.execute(f"SELECT data, gen FROM {self.table} WHERE vbucket = ? AND last_seqno > ? "
                                 "ORDER BY last_seqno", (vbucket, seqno)).fetchall()
        if not rows:
            return dropped
        for data, g in rows:
            for e in _entries(data):
                if e[0] > seqno:
                    dropped.append(e)
                else:
                    kept.append(e)
                    kept_gen = int(g)
        self.conn.execute(f"DELETE FROM {self.table} WHERE vbucket = ? AND last_seqno > ?", (vbucket, seqno))
        if kept:  # the part of a segment that straddles ``seqno`` (keeps its generation)
            self.conn.execute(f"INSERT INTO {self.table} VALUES (?, ?, ?, ?, ?, ?)",
                              (vbucket, kept[-1][0], kept[0][0], len(kept), b"".join(pack_entry(*e) for e in kept),
                               kept_gen))
        self._above.pop(vbucket, None)
        self._last.pop(vbucket, None)
        return dropped

    # ------------------------------------------------------------------------------------------ reading
    def floor(self, vbucket: int) -> int:
        row = self.conn.execute(f"SELECT floor FROM {self.table}_floor WHERE vbucket = ?", (vbucket,)).fetchone()
        return 0 if row is None else int(row[0])

    def entries(self, vbucket: int) -> int:
        row = self.conn.execute(f"SELECT COALESCE(SUM(entries), 0) FROM {self.table} WHERE vbucket = ?",
                                (vbucket,)).fetchone()
        return int(row[0])

    def keys(self, vbucket: int) -> list[bytes]:
        """Every key the vbucket's changelog holds a version of (sorted)."""
        out: set[bytes] = set()
        for (data,) in self.conn.execute(f"SELECT data FROM {self.table} WHERE vbucket = ?", (vbucket,)):
            out.update(k for _, k, _ in _entries(data))
        return sorted(out)

    def versions(self, vbucket: int) -> dict[bytes, tuple[int, bytes]]:
        """key -> (seqno, packed version) of each key's newest version in the changelog."""
        out: dict[bytes, tuple[int, bytes]] = {}
        for (data,) in self.conn.execute(f"SELECT data FROM {self.table} WHERE vbucket = ? ORDER BY last_seqno",
                                         (vbucket,)):
            for seqno, key, version in _entries(data):
                out[key] = (seqno, version)
        return out

    def segments_above(self, gen: int) -> Iterator[tuple[int, int, bytes]]:
        """(vbucket, generation, data) of every segment of a generation above ``gen``, by vbucket and seqno (a
        suffix of each vbucket's segments: the module docstring)."""
        try:
            for vb, g, data in self.conn.execute(f"SELECT vbucket, gen, data FROM {self.table} WHERE gen > ? "
                                                 "ORDER BY vbucket, last_seqno", (gen,)).fetchall():
                yield int(vb), int(g), data
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot read the changelog: {e}") from e

    def top_generation(self) -> int:
        """The highest generation of a segment (0 when empty)."""
        row = self.conn.execute(f"SELECT max(gen) FROM {self.table}").fetchone()
        return int(row[0] or 0)

    def undo_to(self, vbucket: int, seqno: int) -> list[Undo]:
        """Every key changed above ``seqno`` with its version at ``seqno`` (``prior_value`` the packed
        ``DocVersion``, None when the key did not exist then); the entries above ``seqno`` are removed. Raises
        :class:`LogTooShort` below the floor."""
        try:
            fl = self.floor(vbucket)
            if seqno < fl:
                raise LogTooShort(vbucket, seqno, fl)
            changed = {k for _, k, _ in self._truncate_above(vbucket, seqno)}
            found: dict[bytes, Undo] = {}
            if changed:
                cur = self.conn.execute(f"SELECT data FROM {self.table} WHERE vbucket = ? AND last_seqno <= ? "
                                        "ORDER BY last_seqno DESC", (vbucket, seqno))
                for (data,) in cur:
                    for sq, key, version in reversed(list(_entries(data))):
                        if key in changed and key not in found:
                            found[key] = Undo(key, version, sq)
                    if len(found) == len(changed):
                        break
                cur.close()
        except sqlite3.Error as e:
            raise StateStoreError(f"cannot read the changelog of vbucket {vbucket}: {e}") from e
        return [found.get(k) or Undo(k, None, 0) for k in sorted(changed)]

    # ------------------------------------------------------------------------------------------ caches
    def _last_seqno(self, vbucket: int) -> int:
        last = self._last.get(vbucket)
        if last is None:
            row = self.conn.execute(f"SELECT MAX(last_seqno) FROM {self.table} WHERE vbucket = ?",
                                    (vbucket,)).fetchone()
            last = self._last[vbucket] = 0 if row[0] is None else int(row[0])
        return last

    def _entries_above(self, vbucket: int) -> int:
        n = self._above.get(vbucket)
        if n is None:
            row = self.conn.execute(f"SELECT COALESCE(SUM(entries), 0) FROM {self.table} WHERE vbucket = ? AND "
                                    "last_seqno > ?", (vbucket, self.floor(vbucket))).fetchone()
            n = self._above[vbucket] = int(row[0])
        return n

    def adopt(self, vbucket: int, floor: int, versions: Iterable[tuple[int, bytes, bytes]]) -> None:
        """Start ``vbucket`` from each key's version at ``floor`` ((seqno, key, packed version); a state file
        of the source-mirror layout is migrated so)."""
        kept = sorted(versions)
        if kept:
            self.conn.execute(f"INSERT INTO {self.table} VALUES (?, ?, ?, ?, ?, 0)",
                              (vbucket, floor, kept[0][0], len(kept), b"".join(pack_entry(*e) for e in kept)))
        self.conn.execute(f"INSERT OR REPLACE INTO {self.table}_floor VALUES (?, ?)", (vbucket, floor))
        self._above.pop(vbucket, None)
        self._last.pop(vbucket, None)
