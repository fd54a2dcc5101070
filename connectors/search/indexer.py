"""The search indexer: a gateway topic into an index backend, exact after rollbacks (docs/search.md).

Two stores, one order:

1. **The document store** (``store.sqlite`` in the index directory): the changelog
   (``connectors/client/changelog.py``, table ``search_changelog``), one segment per snapshot written inside the
   rollback-aware consumer's transaction with the consumer state -- exactly ``connectors.replicate``'s pattern,
   so each key's newest version there always equals the source at a snapshot boundary of every vbucket,
   rollbacks included (the changelog's undo list restores the lost-branch documents to their version at the
   rollback point; those restored versions are kept in ``search_restored`` until the backend has them). A
   deletion or expiration is a version of its own (a tombstone). Every segment and restored version carries
   the *generation* it was written in.
2. **The index backend** (tantivy by default): after the store committed, the rows of the generations the backend
   has not committed yet are applied to it and committed with a :class:`~connectors.search.backend.Checkpoint`
   (the generation and the per-vbucket positions of the store at that moment) -- atomically in tantivy's case. The
   tantivy writer process gets each store commit's rows as soon as it happened (streamed, no answer awaited), and
   the generation's commit after them; the other backends get a generation at a time.
   Then the generation moves on and the synced restored versions are purged.

A crash anywhere leaves the backend at a committed generation at or below the store's; on start the changes above
it (the restored versions and changelog segments of the later generations) are applied again (upserts and
deletes are idempotent), so the index equals the store -- no document lost, no stale version left -- and the
consumer resumes where the store's last commit was. Backend commits are batched by
size (``commit_docs``) and time (``commit_interval``), and happen as soon as the topic is idle.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Self

from connectors.client.changelog import ENTRY_HEAD, Changelog, segment_entries
from connectors.client.consumer import (
    DEFAULT_BATCH_SIZE,
    ChangeStreamConsumer,
    ClientEvent,
    RollbackInstruction,
)
from connectors.client.mutation_log import DEFAULT_MAX_ENTRIES, Prior
from connectors.client.replay import ConsumerPosition, Oversize, Snapshot
from connectors.client.state import SqliteStateStore
from connectors.exceptions import ConnectorError
from connectors.search.backend import ApplyStats, Checkpoint, Delete, IndexBackend, IndexOp, Position, Upsert
from connectors.search.mapping import DocumentMapping
from connectors.search.tantivy_writer import TantivyWriterProcess
from schemas.failover_log import FailoverEntry
from schemas.records import RecordType

__all__ = ["DEFAULT_COMMIT_DOCS", "DEFAULT_COMMIT_INTERVAL", "IndexerStats", "SearchIndexer"]

log = logging.getLogger(__name__)

#: backend commit after this many changed documents ...
DEFAULT_COMMIT_DOCS: Final = 20_000
#: ... or this many seconds after the first uncommitted change (and whenever the topic is idle)
DEFAULT_COMMIT_INTERVAL: Final = 1.0
#: SQLite page cache of the document store, KiB (SQLite's default of 2 MiB holds a few hundred pages: a store of
#: some 100 000 documents then reads most of the pages every snapshot writes -- its vbucket's rows, its mutation
#: log -- back from the file)
STORE_CACHE_KIB: Final = 64 * 1024
#: WAL pages between two checkpoints of the document store (SQLite's default 1000: some 4 MB, a checkpoint --
#: copying the pages into the file and syncing it -- every ~15 000 indexed documents, in the consumer's thread);
#: 16384 pages of 4 KiB: the WAL grows to 64 MiB between checkpoints
STORE_WAL_PAGES: Final = 16384
#: chunks of streamed rows handed to the commit thread and not sent to the writer yet, at most: above it the
#: consumer's next store commits add to the chunk it sends later (the consumer never waits for the writer)
MAX_QUEUED_CHUNKS: Final = 3
#: records the consumer fetches and decodes at most while the constructor waits for the writer process to start
PREFETCH_RECORDS: Final = 50_000
#: longest wait between two attempts to commit to a failing backend (doubling from 0.5 s)
MAX_RETRY_BACKOFF: Final = 30.0

#: part of the consumer's state file (docs/search.md "Files"): the versions rollbacks restored (value NULL: the
#: key did not exist at the rollback point, or its vbucket was rebuilt from zero) until the backend committed
#: their generation -- the changelog no longer holds what they undid. Empty without rollbacks. (Stores before
#: session 11 kept every document in a table ``search_docs`` as well, written per change: a quarter of the
#: consumer thread's time; the changelog holds the same versions. Such a store is migrated at start.)
_SCHEMA = ("CREATE TABLE IF NOT EXISTS search_restored (key TEXT NOT NULL, value BLOB, vbucket INTEGER NOT NULL, "
           "seqno INTEGER NOT NULL, gen INTEGER NOT NULL, PRIMARY KEY (vbucket, key))",)
_LEGACY_DOCS: Final = "search_docs"
#: the indexer's changelog (connectors/client/changelog.py): a version is b"\x01" + the body, or b"\x00" for a
#: deletion or expiration
CHANGELOG_TABLE: Final = "search_changelog"
_LIVE: Final = b"\x01"
_GONE: Final = b"\x00"


def _k(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def _body(version: bytes | None) -> bytes | None:
    """The body a changelog version holds; None for a deletion or expiration (or no version at all)."""
    return bytes(version[1:]) if version is not None and version[:1] == _LIVE else None


#: a changed document as the store holds it and the backend gets it: (key, value -- None: deleted --, vbucket,
#: seqno, generation); one tuple per change, the store's row and the pending change alike (no objects per change
#: on the consumer's thread; the commit thread turns them into :class:`IndexOp`s, or hands them as they are to a
#: backend that takes rows -- :meth:`TantivyWriterProcess.apply_rows`)
Row = tuple[str, bytes | None, int, int, int]
#: what is streamed to the writer process: store rows, or a snapshot's changelog segment as (vbucket, its bytes)
#: -- the writer reads the changes from the segment (no tuples per change pickled by the commit thread)
Streamed = Row | tuple[int, bytes]


def _ops(rows: Sequence[Row]) -> list[IndexOp]:
    return [Delete(k, vb, s) if v is None else Upsert(k, vb, s, v) for k, v, vb, s, _ in rows]


@dataclass(slots=True)
class _Commit:
    """One generation handed to the backend: its operations and checkpoint; the outcome once applied."""

    checkpoint: Checkpoint
    rows: list[Row]
    #: the failover logs of the checkpoint's positions (the query side's token checks)
    logs: dict[int, list[FailoverEntry]]
    #: the ops were read back from the store (everything above the backend's generation)
    recover: bool
    #: set when a commit handed to the commit thread is done (None: committed in the consumer's thread)
    done: threading.Event | None = None
    error: BaseException | None = None
    #: the rows were streamed to the backend already (``rows`` unused)
    streamed: bool = False
    #: the changes uncommitted in the backend that this commit commits (its generation and the failed ones before)
    handed: int = 0


@dataclass(slots=True)
class _Chunk:
    """Rows and segments of committed store transactions streamed to the writer before their generation's
    commit."""

    rows: list[Streamed]


@dataclass(slots=True)
class IndexerStats:
    """Counters of /status and /metrics (docs/search.md "Status and metrics")."""

    snapshots: int = 0
    changes: int = 0
    rollbacks: int = 0
    #: documents indexed / removed / skipped as binary / indexed without a wrong-typed field / refused (backend)
    indexed: int = 0
    deleted: int = 0
    binary_skipped: int = 0
    field_rejected: int = 0
    rejected: int = 0
    #: changes whose value Kafka refused as too large (the index keeps the previous version)
    oversize: int = 0
    commits: int = 0
    #: backend syncs that failed (retried with backoff; the document store keeps the changes)
    sync_failures: int = 0
    commit_seconds_total: float = 0.0
    commit_seconds_last: float = 0.0
    commit_seconds_max: float = 0.0

    def add(self, a: ApplyStats) -> None:
        self.indexed += a.indexed
        self.deleted += a.deleted
        self.binary_skipped += a.binary_skipped
        self.field_rejected += a.field_rejected
        self.rejected += a.rejected


def _no_priors(vbucket: int, keys: Sequence[bytes]) -> dict[bytes, Prior]:
    """The consumer's prior look-up: nothing to look up (the changelog answers the undo lists itself)."""
    return {}


class _IndexingConsumer(ChangeStreamConsumer):
    """The client, with three hooks: after every store commit (``flush``), when a poll found nothing, and when
    the event being applied is abandoned (its store writes are rolled back)."""

    def __init__(self, *args: Any, after_flush: Callable[[bool], None], on_abandon: Callable[[], None],
                 **kw: Any) -> None:
        self.after_flush = after_flush
        self.on_abandon = on_abandon
        super().__init__(*args, **kw)

    def abandon(self) -> None:
        super().abandon()
        self.on_abandon()

    def flush(self) -> None:
        super().flush()
        self.after_flush(False)

    def _next_event(self, timeout: float) -> ClientEvent | None:
        ev = super()._next_event(timeout)
        if ev is None and self._open is None:
            self.after_flush(True)
        return ev


class SearchIndexer:
    """Index ``topic`` into ``backend`` (default: a tantivy index in ``index_dir/tantivy``) through the document
    store ``index_dir/store.sqlite``. :meth:`run` consumes (in the calling thread); :attr:`visible` is the
    checkpoint searches see; :meth:`search` and the waits of :mod:`connectors.search.consistency` are safe from
    other threads."""

    def __init__(self, kafka: str | Mapping[str, Any], topic: str, index_dir: str | Path, *,
                 mapping: DocumentMapping | None = None, backend: IndexBackend | None = None,
                 mutation_log_max: int = DEFAULT_MAX_ENTRIES, batch_size: int = DEFAULT_BATCH_SIZE,
                 commit_docs: int = DEFAULT_COMMIT_DOCS, commit_interval: float = DEFAULT_COMMIT_INTERVAL,
                 dead_letter: str | None = "{topic}.dlq", poll_timeout: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dir = Path(index_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.topic = topic
        self.mapping = mapping or DocumentMapping.dynamic_default()
        self.commit_docs = commit_docs
        self.commit_interval = commit_interval
        self.clock = clock
        self.stats = IndexerStats()
        self._owns_backend = backend is None
        if backend is None:
            # the writer in a process of its own: document building runs beside the consumer (docs/search.md
            # "Performance")
            backend = TantivyWriterProcess(self.dir / "tantivy", self.mapping)
        self.backend: IndexBackend = backend
        try:
            self.consumer = _IndexingConsumer(kafka, topic, state_path=self.dir / "store.sqlite",
                                              prior_lookup=_no_priors, mutation_log_max=mutation_log_max,
                                              dead_letter=dead_letter, batch_size=batch_size,
                                              poll_timeout=poll_timeout, after_flush=self._after_flush,
                                              on_abandon=self._on_abandon)
        except BaseException:
            if self._owns_backend:
                self.backend.close()
            raise
        #: the topic's vbuckets -- one per partition (None: unknown) -- a token naming another is refused
        self.vbuckets: int | None = None
        try:
            assigned = self.consumer.consumer.assignment()
        except Exception:  # (a consumer without its assignment yet: the query API checks nothing then)
            assigned = []
        if assigned:
            self.vbuckets = max(tp.partition for tp in assigned) + 1
        store = self.consumer.store
        assert isinstance(store, SqliteStateStore)
        self.store = store
        self.conn: sqlite3.Connection = store.conn
        self.conn.execute(f"PRAGMA cache_size = -{STORE_CACHE_KIB}")
        self.conn.execute(f"PRAGMA wal_autocheckpoint = {STORE_WAL_PAGES}")
        for stmt in _SCHEMA:
            self.conn.execute(stmt)
        had_changelog = self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?",
                                          (CHANGELOG_TABLE,)).fetchone() is not None
        #: the source's history as indexed, per vbucket: plays the client's mutation log (undo lists at a
        #: rollback), appended once per snapshot -- no prior look-ups on the hot path (docs/search.md)
        self.changelog = Changelog(self.conn, mutation_log_max, table=CHANGELOG_TABLE)
        self.consumer.mutation_log = self.changelog
        #: the changes of the generation not handed to the backend yet: rows (for a backend taking a generation at
        #: a time, and the versions rollbacks restored) and -- streamed to the writer process as changelog
        #: segments -- only the count of the snapshots' changes
        self._pending: dict[str, Row] = {}
        self._pending_changes = 0
        #: changes handed to the backend in generations it has not committed (a commit in flight, or failed and
        #: waiting for its retry): with the pending ones, /status ``pending_docs``
        self._handed = 0
        self._first_pending = 0.0
        #: backend failures in a row, when the next sync may be tried, and the last failure (None: healthy)
        self._failures = 0
        self._retry_at = 0.0
        self.backend_error: str | None = None
        self._stopping = threading.Event()
        self._sync_lock = threading.Lock()
        #: the backend commit in progress (at most one), and whether commits may still start (not when closing)
        self._inflight: _Commit | None = None
        self._jobs: queue.SimpleQueue[_Commit | _Chunk | None] = queue.SimpleQueue()
        #: streaming (the tantivy writer process; docs/search.md "Performance"): after every store commit its
        #: rows go to the writer at once, the generation's commit follows them; the other backends get a
        #: generation at a time. ``_unsent``: rows and changelog segments committed in the store and not handed
        #: to the commit thread
        self._streaming = isinstance(backend, TantivyWriterProcess)
        self._unsent: list[Streamed] = []
        self._queued_chunks = 0
        #: a streamed chunk of the current generation failed (commit thread only): the generation's commit fails
        #: with it, the later chunks before it are skipped
        self._stream_error: BaseException | None = None
        self._worker: threading.Thread | None = None
        self._closing = False
        self._changed = threading.Condition()
        try:
            if isinstance(backend, TantivyWriterProcess):
                # while the writer process starts (a fresh interpreter, tantivy, the index: most of this
                # constructor's time), the consumer fetches and decodes the first records; nothing is applied
                # before the backend's checkpoint is known (docs/search.md "Performance")
                first = self.consumer.records_consumed
                while (not backend.started() and self.consumer.records_consumed - first < PREFETCH_RECORDS
                       and self.consumer.prefetch(0.005)):
                    pass
            # (the tantivy writer process reports here when it cannot open the index)
            cp = self.backend.checkpoint()
        except BaseException:
            self._closing = True  # (no backend sync from the consumer's last flush)
            self.consumer.close()
            if self._owns_backend:
                self.backend.close()
            raise
        stored = store.load_all()
        #: per-vbucket failover logs of the committed positions (read by the query side's token checks)
        self._logs: dict[int, list[FailoverEntry]] = {vb: list(p.failover_log) for vb, p in stored.items()}
        if cp is not None and not stored:
            # a new store beside an old index: the index holds nothing the store can vouch for
            log.warning("search index in %s has a checkpoint but the document store is new: rebuilding it", self.dir)
            self.backend.reset()
            cp = None
        self.visible: Checkpoint = cp or Checkpoint(0, {}, self.mapping.id)
        if self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (_LEGACY_DOCS,)).fetchone() is not None:
            self._migrate_legacy_store(had_changelog)
        top = max(self.changelog.top_generation(),
                  self.conn.execute("SELECT max(gen) FROM search_restored").fetchone()[0] or 0)
        #: the generation rows are written with now (always above the backend's committed one)
        self.gen = max(int(top), self.visible.generation) + 1
        #: rows above the backend's generation written before this process: applied by the first sync
        self._recover = int(top) > self.visible.generation

    def _migrate_legacy_store(self, had_changelog: bool) -> None:
        """A store with a ``search_docs`` table (every document, written per change): its rows the backend has
        not committed move to ``search_restored`` (the first sync applies them); a store written before the
        changelog too (its rollbacks undone from the client's mutation log) starts each vbucket's changelog from
        its documents, its floor at the vbucket's position (a rollback below it rebuilds the vbucket from zero);
        then the table goes. One transaction."""
        own = not self.conn.in_transaction
        if own:
            self.conn.execute("BEGIN IMMEDIATE")
        try:
            self.conn.execute(f"INSERT OR REPLACE INTO search_restored SELECT key, value, vbucket, seqno, gen FROM "
                              f"{_LEGACY_DOCS} WHERE gen > ?", (self.visible.generation,))
            positions = self.store.load_all()
            if not had_changelog and positions:
                by_vb: dict[int, list[tuple[int, bytes, bytes]]] = {vb: [] for vb in positions}
                for k, v, vb, sq in self.conn.execute(
                        f"SELECT key, value, vbucket, seqno FROM {_LEGACY_DOCS} WHERE value IS NOT NULL"):
                    by_vb.setdefault(int(vb), []).append((int(sq), k.encode("utf-8", "surrogateescape"),
                                                          _LIVE + bytes(v)))
                for vb, rows in by_vb.items():
                    p = positions.get(vb)
                    self.changelog.adopt(vb, max([r[0] for r in rows] + [p.seqno if p else 0]), rows)
                log.info("search index %s: the document store's %d vbuckets start a changelog", self.dir,
                         len(by_vb))
            self.conn.execute(f"DROP TABLE {_LEGACY_DOCS}")
            if own:
                self.conn.execute("COMMIT")
        except BaseException:
            if own and self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise

    def _rows_above(self, gen: int) -> list[Row]:
        """Every change of the store in a generation above ``gen`` (what a backend committed at ``gen`` may
        lack), one row per key with its current version: the versions rollbacks restored, then the changelog's
        segments above ``gen`` in seqno order (a suffix of each vbucket's history, so a key's last row there is
        its newest version; what a rollback undid is no longer in the changelog)."""
        out: dict[str, Row] = {}
        for k, v, vb, sq, g in self.conn.execute(
                "SELECT key, value, vbucket, seqno, gen FROM search_restored WHERE gen > ? ORDER BY gen", (gen,)):
            out[k] = (k, None if v is None else bytes(v), int(vb), int(sq), int(g))
        for vb, g, data in self.changelog.segments_above(gen):
            for seqno, key, version in segment_entries(data):
                k = _k(key)
                out[k] = (k, _body(version), vb, seqno, g)
        return list(out.values())

    def _pending_count(self) -> int:
        """Changes of the generation not handed to the backend yet."""
        return len(self._pending) + self._pending_changes

    def pending_docs(self) -> int:
        """Changes consumed and not committed to the backend yet: the generation's, and those of the generations
        handed to the backend and not committed -- in flight, or failed and kept for the retry (/status)."""
        return self._pending_count() + self._handed

    def _drop_pending(self) -> None:
        self._pending = {}
        self._pending_changes = 0

    def _on_abandon(self) -> None:
        # the open event's rows were rolled back with its savepoint: what is pending in memory can no longer be
        # told apart, so the next sync reads the committed rows instead
        self._drop_pending()
        self._unsent = []
        self._recover = True
        self.changelog.forget_cached()

    # ------------------------------------------------------------------------------- the store side
    def _on_snapshot(self, snap: Snapshot) -> None:
        # inside the consumer's transaction (committed with its state and mutation log)
        gen = self.gen
        changes = snap.changes
        self.stats.snapshots += 1
        if not changes:
            return
        # the changelog segment's bytes (pack_entry's bytes, joined once): the store's one write for the snapshot
        # and, streamed as they are, the writer process's input (docs/search.md "Performance")
        parts: list[bytes] = []
        part = parts.append
        head = ENTRY_HEAD.pack
        if not self._pending_count():
            self._first_pending = self.clock()
        mutation = RecordType.MUTATION
        vb = changes[0].vbucket  # a snapshot is one vbucket's
        for c in changes:
            key = c.key
            seqno = c.seqno
            if c.type is not mutation:  # a deletion or expiration
                part(head(seqno, len(key), 1))
                part(_GONE)
            else:
                value = c.value
                assert value is not None
                part(head(seqno, len(key), len(value) + 1))
                part(_LIVE)
                part(value)
            part(key)
        data = b"".join(parts)
        if self._streaming:
            # the writer reads the changes from the segment: only their count is kept here
            self._unsent.append((vb, data))
            self._pending_changes += len(changes)
        else:
            # the generation's rows for a backend that takes a generation at a time (changes are in seqno
            # order: the last change of a key wins)
            pending = self._pending
            for c in changes:
                k = _k(c.key)
                pending[k] = (k, None if c.type is not mutation else c.value, vb, c.seqno, gen)
        # the document store's one write per snapshot (the segment is of generation ``gen``: a recovery reads it
        # back while the backend has not committed it)
        self.changelog.append_segment(vb, changes[0].seqno, changes[-1].seqno, len(changes), data, gen)
        self.stats.changes += len(changes)

    def _on_rollback(self, rb: RollbackInstruction) -> None:
        self.stats.rollbacks += 1
        gen = self.gen
        if not self._pending_count():
            self._first_pending = self.clock()
        restore = "INSERT OR REPLACE INTO search_restored VALUES (?, ?, ?, ?, ?)"
        if rb.rebuild_from_zero:
            # the client cleared the changelog before handing the instruction out; it kept the keys it held
            keys = [_k(k) for k in self.changelog.cleared.pop(rb.vbucket, [])]
            gone: list[Row] = [(k, None, rb.vbucket, 0, gen) for k in keys]
            self.conn.executemany(restore, gone)
            for row in gone:
                self._pending[row[0]] = row
                if self._streaming:
                    self._unsent.append(row)
            log.warning("search index: vbucket %d rolled back beyond the mutation log: its %d keys are removed "
                        "and indexed again from the topic", rb.vbucket, len(keys))
            return
        for u in rb.undo:
            k = _k(u.key)
            # the version at the rollback point, from the changelog: absent, deleted, or b"\x01" + its body
            body = _body(u.prior_value)
            r: Row = (k, None, rb.vbucket, 0, gen) if body is None else (k, body, rb.vbucket, u.prior_seqno, gen)
            self.conn.execute(restore, r)
            self._pending[k] = r
            if self._streaming:
                self._unsent.append(r)

    def _on_oversize(self, o: Oversize) -> None:
        self.stats.oversize += 1
        log.warning("search index: key %r of vbucket %d changed at seqno %d but its %d-byte value is not in the "
                    "topic (%s); the index keeps the previous version", o.key, o.vbucket, o.seqno, o.size, o.reason)

    # ------------------------------------------------------------------------------ the backend side
    def _after_flush(self, idle: bool) -> None:
        if self._closing:
            return
        if self._unsent and self._queued_chunks < MAX_QUEUED_CHUNKS:
            self._stream()
        job = self._inflight
        if job is not None:
            if job.done is not None and not job.done.is_set():
                return  # still committing: the changes since go into the next commit
            if not self._try_sync("take_in"):
                return
        pending = self._pending_count()
        if not pending and not self._recover:
            return
        now = self.clock()
        if now < self._retry_at:
            return
        if (idle or self._recover or pending >= self.commit_docs
                or now - self._first_pending >= self.commit_interval):
            self._try_sync("background")

    def _try_sync(self, how: str = "now") -> bool:
        """``how``: "now" -- :meth:`sync`; "background" -- start the backend commit in a thread of its own (the
        consumer goes on with the next generation meanwhile, docs/search.md "Performance"); "take_in" -- only
        finish the commit in progress. When the backend fails (a search cluster unreachable, a full disk, ...)
        nothing is lost: the store keeps every change and a later sync applies everything above the backend's
        committed generation again, after a backoff (docs/search.md "Backend failures"). False when it failed."""
        try:
            with self._sync_lock:
                self._take_in()
                if how == "now":
                    self._sync_now()
                elif how == "background" and (self._pending_count() or self._recover):
                    self._start_commit(background=True)
        except Exception as e:
            now = self.clock()
            self.stats.sync_failures += 1
            self.backend_error = f"{type(e).__name__}: {e}"
            self._drop_pending()
            self._unsent = []
            self._recover = True
            self._retry_at = now + min(MAX_RETRY_BACKOFF, 0.5 * 2 ** min(self._failures, 10))
            self._failures += 1
            log.warning("search index: committing to the backend failed (%s); the changes stay in the "
                        "document store, retrying in %.1f s", self.backend_error, self._retry_at - now)
            return False
        return True

    def _stream(self) -> None:
        """Hand the rows committed in the store since the last hand-over to the commit thread, which sends them
        to the writer without waiting for it (docs/search.md "Performance"). Only rows of committed store
        transactions: the consumer's flush committed them (an abandoned event's rows never get here)."""
        rows, self._unsent = self._unsent, []
        if self._recover:
            return  # the next commit reads everything above the backend's generation from the store
        with self._changed:
            self._queued_chunks += 1
        self._ensure_worker()
        self._jobs.put(_Chunk(rows))

    def _ensure_worker(self) -> None:
        if self._worker is None:
            # one thread for every background commit (starting one per commit waits for it to be scheduled)
            self._worker = threading.Thread(target=self._commit_loop, name="dcpgw-index-commit", daemon=True)
            self._worker.start()

    def positions(self) -> dict[int, ConsumerPosition]:
        """The store's committed per-vbucket positions."""
        return self.store.load_all()

    def sync(self) -> bool:
        """Apply what the store committed since the backend's generation and commit the backend, after the
        commit in progress if there is one (call only between events: after the consumer's flush). Returns False
        when there was nothing to do."""
        with self._sync_lock:
            self._take_in()
            return self._sync_now()

    def _sync_now(self) -> bool:
        if not self._pending_count() and not self._recover:
            return False
        job = self._start_commit(background=False)
        self._inflight = job
        self._take_in()
        return True

    def _start_commit(self, background: bool) -> _Commit:
        """Hand the generation's changes to the backend: apply + commit with the checkpoint of the store's
        committed positions, in a thread of its own (``background``) or in this one. The store's rows of this
        generation are committed first; rows written from now on belong to the next generation."""
        if self.conn.in_transaction:
            self.store.flush()
        streamed = self._streaming and not self._recover
        if self._streaming:
            # the generation's last rows before its commit (after the others, in the commit thread's order);
            # a commit waits in that thread too
            background = True
            if self._unsent:
                self._stream()
        gen = self.gen
        if self._recover:
            rows = self._rows_above(self.visible.generation)
        else:
            rows = list(self._pending.values())
        store_pos = self.positions()
        positions = {vb: Position(p.vbuuid, p.seqno) for vb, p in store_pos.items()}
        job = _Commit(Checkpoint(gen, positions, self.mapping.id), rows,
                      {vb: list(p.failover_log) for vb, p in store_pos.items()}, self._recover, streamed=streamed)
        with self._changed:
            # (a recovery's rows were handed before -- or written by an earlier process: counted by key then)
            self._handed = max(self._handed + self._pending_count(), len(rows) if self._recover else 0)
            job.handed = self._handed
        self._drop_pending()
        self._recover = False
        self.gen = gen + 1
        if background:
            job.done = threading.Event()
            self._inflight = job
            self._ensure_worker()
            self._jobs.put(job)
        else:
            self._commit(job)
        return job

    def _commit_loop(self) -> None:
        """The commit thread: the streamed chunks and background commits handed to it, in order, until None."""
        while (job := self._jobs.get()) is not None:
            if isinstance(job, _Chunk):
                try:
                    if self._stream_error is None:
                        b = self.backend
                        assert isinstance(b, TantivyWriterProcess)
                        b.stream_rows(job.rows)
                except BaseException as e:
                    self._stream_error = e  # the generation's commit fails with it (nothing is committed)
                finally:
                    with self._changed:
                        self._queued_chunks -= 1
                continue
            try:
                self._commit(job)
            finally:
                assert job.done is not None
                job.done.set()

    def _commit(self, job: _Commit) -> None:
        """Apply and commit one generation (the commit thread, or the consumer's); publishes the checkpoint to
        searches when the backend took it. A failure is kept in the job, for :meth:`_take_in`."""
        try:
            t0 = time.perf_counter()
            b = self.backend
            if isinstance(b, TantivyWriterProcess):
                err, self._stream_error = self._stream_error, None
                if err is not None and not job.recover:  # (a recovery applies everything above the commit again)
                    raise err
                applied = ApplyStats() if job.streamed else b.apply_rows(job.rows)
                b.commit(job.checkpoint)
                applied.add(b.take_stats())
            else:
                applied = b.apply(_ops(job.rows))
                b.commit(job.checkpoint)
            dt = time.perf_counter() - t0
        except BaseException as e:
            job.error = e
            if isinstance(self.backend, TantivyWriterProcess):
                self.backend.take_stats()  # (the retry applies the generation again: counted then)
            return
        st = self.stats
        st.add(applied)
        st.commits += 1
        st.commit_seconds_total += dt
        st.commit_seconds_last = dt
        st.commit_seconds_max = max(st.commit_seconds_max, dt)
        self._logs = job.logs
        with self._changed:
            self.visible = job.checkpoint
            self._handed -= job.handed
            self._changed.notify_all()

    def _take_in(self) -> None:
        """Wait for the commit in progress, if any, and finish it in the consumer's thread: raise its failure,
        or purge the tombstones it synced (their deletion is in the index now)."""
        job = self._inflight
        if job is None:
            return
        if job.done is not None:
            job.done.wait()
        self._inflight = None
        if job.error is not None:
            if not isinstance(job.error, Exception):
                self._closing = True  # (the process is going down: no further commit is started)
            raise job.error
        self._failures = 0
        self._retry_at = 0.0
        self.backend_error = None
        # the versions rollbacks restored are in the index now (an empty table without rollbacks)
        self.conn.execute("DELETE FROM search_restored WHERE gen <= ?", (job.checkpoint.generation,))

    def wait_visible(self, predicate: Callable[[Checkpoint], bool], timeout: float) -> Checkpoint:
        """Block until ``predicate(visible)`` or ``timeout`` seconds; returns the visible checkpoint then."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self.visible):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self.visible

    # ------------------------------------------------------------------------------------------ running
    def run(self, until_caught_up: bool = False) -> None:
        """Consume (until :meth:`stop`, or until caught up), then commit everything to the backend -- retrying
        a failing backend with backoff until it succeeds or :meth:`stop` is called (then
        :class:`~connectors.exceptions.ConnectorError`: the document store keeps the changes)."""
        self._stopping.clear()
        self.consumer.run(self._on_snapshot, self._on_rollback, until_caught_up=until_caught_up,
                          on_oversize=self._on_oversize)
        while not self._try_sync():
            if self._stopping.wait(max(0.0, self._retry_at - self.clock())):
                raise ConnectorError(f"the index backend failed ({self.backend_error}): the last changes are not in "
                                     f"the index; they are kept in {self.dir / 'store.sqlite'} and indexed at the "
                                     f"next start")

    def stop(self) -> None:
        self._stopping.set()
        self.consumer.stop()

    def catch_up(self) -> None:
        """Consume until every partition is read to its end, then commit the backend."""
        self.run(until_caught_up=True)

    def failover_log(self, vbucket: int) -> list[FailoverEntry]:
        """The failover log of ``vbucket`` as of the visible checkpoint (thread-safe)."""
        return self._logs.get(vbucket, [])

    def docs(self) -> dict[str, tuple[bytes, int]]:
        """The document store: key -> (value, vbucket) of every live document (each key's newest version in the
        changelog)."""
        out: dict[str, tuple[bytes, int]] = {}
        for vb in sorted({int(vb) for (vb,) in self.conn.execute(f"SELECT DISTINCT vbucket FROM {CHANGELOG_TABLE}")}):
            for key, (_seqno, version) in self.changelog.versions(vb).items():
                body = _body(version)
                if body is not None:
                    out[_k(key)] = (body, vb)
        return out

    def status(self) -> dict[str, Any]:
        """Counters and the per-vbucket positions searches see (thread-safe: no store access)."""
        vis = self.visible
        return {"topic": self.topic, "generation": vis.generation, "mapping_id": self.mapping.id,
                "backend_error": self.backend_error, "pending_docs": self.pending_docs(), "records_consumed": self.consumer.records_consumed,
                **asdict(self.stats),
                "vbuckets": [{"vbucket": vb, "vbuuid": p.vbuuid, "indexed_seqno": p.seqno}
                             for vb, p in sorted(vis.positions.items())],
                # a search cluster's side (connectors/search/elastic.py): reachable, retries, last error
                **({"backend": self.backend.status()} if hasattr(self.backend, "status") else {})}

    def close(self) -> None:
        self._closing = True
        try:
            try:
                with self._sync_lock:
                    self._take_in()
            except Exception as e:  # its changes are in the store: the next start indexes them
                log.warning("search index: the last backend commit failed (%s: %s)", type(e).__name__, e)
            self.consumer.close()
        finally:
            if self._worker is not None:
                self._jobs.put(None)
                self._worker.join()
                self._worker = None
            if self._owns_backend:
                self.backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
