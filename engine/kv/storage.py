"""Durable storage by seqno: SQLite in WAL mode (the role of kv_engine's ``KVStore``: couchstore / magma).

Layout: one database per bucket.

* ``items`` -- every persisted version, keyed by ``(vb, seqno)`` (the by-seqno tree). A row whose key was
  written again later carries ``superseded`` = the seqno of the newer version; rows with ``superseded IS NULL``
  are the current state (tombstones included: ``op`` != 0). Prior versions are kept for a configurable history
  window so the exact state at an earlier seqno can be restored (rollback), and so a disk backfill can read
  the consistent state *as of* its snapshot end.
* ``vbstate`` -- per vbucket: state, failover log, persisted high seqno, the last persisted snapshot range,
  purge seqno, max CAS and ``history_start`` (below it, older versions may have been purged).
* ``meta`` -- the clean-shutdown marker.
* ``snapshots`` -- for replica vbuckets, the end seqno of every complete snapshot received from the active and
  persisted: the consistent points a replica can roll back to (docs/cluster.md "Replication": roll back to a
  snapshot boundary <= the rollback seqno; the items of a partial snapshot are an inconsistent state).

Every flush is one transaction: a disk snapshot with its seqno range (docs/engine.md "Snapshots, de-duplication and
consistency").

A flush can also run in the background (:meth:`Storage.submit_flush`, docs/engine.md "Background flush"): the
same transaction in the storage's writer process (engine/kv/storage_writer.py), with its own connection, which
makes the rows from the stored values and binds them in multi-row statements on an interpreter of its own. At
most one is in flight, and every other method of the storage first waits for it and hands its outcome to the
submitter's callback: the database is only ever used by one side at a time, and what a caller reads or writes
comes after the background transaction, as if it had run inline.
"""

from __future__ import annotations

import contextlib
import functools
import json
import marshal
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from engine.exceptions import StorageError
from engine.kv import storage_writer
from engine.kv.item import Item, Op
from engine.kv.storage_writer import StoredValueLayout, VBucketBatch, WriterSetup
from engine.kv.stored_value import _SYNC, HAS_SYNC, HEADER, NO_VALUE, pack

if TYPE_CHECKING:
    from engine.kv.vbucket import VBucket

#: (vb, seqno, key, value, flags, expiry, cas, rev, datatype, op); for a prepare ``op`` also carries its
#: durability level in bits 4-5 (``op | level << 4``, :func:`item_from_row`)
Row = tuple[int, int, bytes, bytes | None, int, int, int, int, int, int]

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS items (
    vb INTEGER NOT NULL, seqno INTEGER NOT NULL, key BLOB NOT NULL, value BLOB,
    flags INTEGER NOT NULL, expiry INTEGER NOT NULL, cas INTEGER NOT NULL, rev INTEGER NOT NULL,
    datatype INTEGER NOT NULL, op INTEGER NOT NULL, superseded INTEGER,
    PRIMARY KEY (vb, seqno)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS vbstate (
    vb INTEGER PRIMARY KEY, state TEXT NOT NULL, failover TEXT NOT NULL, high_seqno INTEGER NOT NULL,
    snap_start INTEGER NOT NULL, snap_end INTEGER NOT NULL, purge_seqno INTEGER NOT NULL,
    max_cas INTEGER NOT NULL, history_start INTEGER NOT NULL, max_deleted_rev INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
    vb INTEGER NOT NULL, seqno INTEGER NOT NULL, PRIMARY KEY (vb, seqno)) WITHOUT ROWID;
"""

#: ``PRAGMA user_version`` of a storage file this engine writes (docs/reliability.md, "Schema versions").
SCHEMA_VERSION: Final = 2


def _v0_to_v1(db: sqlite3.Connection) -> None:
    """Version 0 is the layout of _SCHEMA before files carried a version: the tables are unchanged."""


def _v1_to_v2(db: sqlite3.Connection) -> None:
    """Version 2 keeps each vbucket's highest purged tombstone revision (kv_engine ``max_deleted_seqno`` of
    ``vbucket_state``): a key created again after its tombstone was purged continues its revisions."""
    db.execute("ALTER TABLE vbstate ADD COLUMN max_deleted_rev INTEGER NOT NULL DEFAULT 0")


#: ``_MIGRATIONS[v]`` takes a file of schema version ``v`` to ``v + 1``, in one transaction with the rest.
_MIGRATIONS: Final = (_v0_to_v1, _v1_to_v2)


def _migrate(db: sqlite3.Connection, path: Path) -> None:
    """Bring the file at ``path`` to :data:`SCHEMA_VERSION` (a new file is created at it)."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise StorageError(f"storage at {path} has schema version {version}, newer than this engine's "
                           f"{SCHEMA_VERSION}: open it with the version that wrote it")
    if version == SCHEMA_VERSION:
        return
    existing = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='items'").fetchone()
    db.execute("BEGIN IMMEDIATE")
    try:
        if existing is not None:
            for step in _MIGRATIONS[version:]:
                step(db)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


_INSERT: Final = (
    "INSERT OR REPLACE INTO items (vb, seqno, key, value, flags, expiry, cas, rev, datatype, op) "
    "VALUES (?,?,?,?,?,?,?,?,?,?)"
)
_SUPERSEDE: Final = "UPDATE items SET superseded=? WHERE vb=? AND seqno=?"
_SCAN: Final = (
    "SELECT vb, seqno, key, value, flags, expiry, cas, rev, datatype, op FROM items "
    "WHERE vb=? AND seqno>? AND seqno<=? AND (superseded IS NULL OR superseded>?) ORDER BY seqno LIMIT ?"
)
_UPSERT_STATE: Final = (
    "INSERT OR REPLACE INTO vbstate (vb, state, failover, high_seqno, snap_start, snap_end, purge_seqno, "
    "max_cas, history_start, max_deleted_rev) VALUES (?,?,?,?,?,?,?,?,?,?)"
)
_BOUNDARY: Final = "INSERT OR IGNORE INTO snapshots (vb, seqno) VALUES (?, ?)"

#: rows per multi-row statement of a background flush (engine/kv/storage_writer.py ``write_rows``): few large
#: statements, each one ``sqlite3_step``, not a step per row
MULTIROW_ROWS: Final = 2048
_INSERT_HEAD: Final = _INSERT[:_INSERT.index("VALUES") + 7]
_STATE_HEAD: Final = _UPSERT_STATE[:_UPSERT_STATE.index("VALUES") + 7]
_BOUNDARY_HEAD: Final = _BOUNDARY[:_BOUNDARY.index("VALUES") + 7]
#: the superseded marks ``(newer_seqno, vb, old_seqno)`` of a background flush: one UPDATE ... FROM a VALUES list
#: (a primary-key search per mark, as :data:`_SUPERSEDE` does)
_SUPERSEDE_HEAD: Final = "UPDATE items SET superseded=v.column1 FROM (VALUES "
_SUPERSEDE_TAIL: Final = ") AS v WHERE items.vb=v.column2 AND items.seqno=v.column3"


@dataclass(slots=True)
class VBucketRecord:
    """The persisted state of one vbucket (kv_engine ``vbucket_state``)."""

    vb: int
    state: str
    failover: list[tuple[int, int]]
    high_seqno: int = 0
    snap_start: int = 0
    snap_end: int = 0
    purge_seqno: int = 0
    max_cas: int = 0
    history_start: int = 0
    #: the highest revision of a tombstone purged from this vbucket (kv_engine ``max_deleted_seqno``)
    max_deleted_rev: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    def as_params(self) -> tuple[object, ...]:
        return (
            self.vb,
            self.state,
            _failover_json(tuple(self.failover)),
            self.high_seqno,
            self.snap_start,
            self.snap_end,
            self.purge_seqno,
            self.max_cas,
            self.history_start,
            self.max_deleted_rev,
        )


#: SQLite's page cache of a storage connection, KiB: a fixed amount per bucket, not per item (docs/performance.md
#: "Engine"); :meth:`Storage.release_cache` hands it back
PAGE_CACHE_KIB: Final = 65536
#: the interpreter's switch interval once a storage runs a writer thread: the writer takes the GIL back to hand a
#: flush to its process and its outcome back, and waits for the thread running Python -- the event loop's -- to drop it,
#: up to the switch interval (CPython's default, 5 ms). At 1 ms a background flush starts in ~1.3 ms instead of
#: ~5 ms and rollback mitigation's write -> Kafka lag halves (docs/engine.md "Background flush": measured
#: 2026-12-02); bulk publishing is not slower. Lowered only, never raised (a process may already use less).
WRITER_SWITCH_INTERVAL_S: Final = 0.001


def hand_gil_over_promptly() -> None:
    """Lower the interpreter's switch interval to :data:`WRITER_SWITCH_INTERVAL_S` (a process-wide setting)
    unless it is lower already."""
    if sys.getswitchinterval() > WRITER_SWITCH_INTERVAL_S:
        sys.setswitchinterval(WRITER_SWITCH_INTERVAL_S)


#: what :meth:`Storage.submit_flush` hands the submitter when its transaction ended: None (committed) or the error
Landed = Callable[[StorageError | None], None]


#: engine/kv/stored_value.py's layout, for the writer process (it imports nothing of the engine)
STORED_VALUE_LAYOUT: Final[StoredValueLayout] = {
    "header": HEADER.format, "sync": _SYNC.format, "no_value": NO_VALUE, "has_sync": HAS_SYNC}
#: the writer process's script (run as a file: ``-I -S``, standard library only)
_WRITER_SCRIPT: Final = str(Path(storage_writer.__file__).resolve())
#: ``marshal`` format of a flush request: version 2 writes no back-references -- version 4 looks every object up in
#: a table of those already written, which doubled the calling thread's cost (measured 2026-12-02, 1M items in
#: 62 flushes: 0.79 s at version 4, 0.36 s at version 2)
MARSHAL_VERSION: Final = 2
#: how long closing the storage waits for its writer process to exit before it kills it
WRITER_EXIT_TIMEOUT_S: Final = 10.0


def writer_process_possible() -> bool:
    """Whether this interpreter can start the writer process: it needs a Python to run the script with. An
    embedded interpreter has no ``sys.executable``; a frozen application's is the application itself."""
    return bool(sys.executable) and not getattr(sys, "frozen", False)


def stored_batches(
        batches: Sequence[tuple[int, Sequence[bytes], Sequence[Item | bytes]]]) -> list[VBucketBatch]:
    """``batches`` with every entry a stored value: the items some writes queue (deletes, replica and sync
    writes) packed as the hash table would pack them (engine/kv/stored_value.py)."""
    out: list[VBucketBatch] = []
    for vb, keys, entries in batches:
        out.append((vb, keys, [e if isinstance(e, bytes) else pack(e) for e in entries]))
    return out


class Storage:
    """The bucket's SQLite store. Owned by the bucket and used from one thread, but for the writer thread of a
    background flush (:meth:`submit_flush`) -- the only user of the writer process -- which no other method
    overlaps."""

    def __init__(self, path: Path, *, synchronous: str = "NORMAL") -> None:
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise StorageError(f"invalid sqlite synchronous mode {synchronous!r}")
        self.path = path
        self._synchronous = synchronous.upper()
        self._busy_timeout_s = 5.0
        #: the writer thread and the writer process it talks to (made at the first background flush; a process
        #: that ended is made again at the next), the flush in flight and its submitter's callback
        self._writer: ThreadPoolExecutor | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        #: writer processes started (more than one: one ended -- killed, out of memory -- and was replaced)
        self.writer_starts = 0
        self._job: Future[None] | None = None
        self._landed: Landed | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
            self._db.execute(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")
            _migrate(self._db, path)
            self._db.executescript(_SCHEMA)
            # The previous owner's writer process, killed with its engine while it committed (docs/engine.md
            # "Background flush", "Its life"), holds the write lock until it is gone: take the lock once, so
            # that whatever this engine reads (warmup) comes after that commit, never before it.
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("COMMIT")
        except StorageError:
            self._db.close()
            raise
        except (sqlite3.Error, OSError) as e:
            raise StorageError(f"cannot open storage at {path}: {e}") from e

    @property
    def busy_timeout_s(self) -> float:
        """How long a write waits for another connection's write lock before it fails (SQLite's busy timeout,
        on both connections; sqlite3's default, 5 s)."""
        return self._busy_timeout_s

    @busy_timeout_s.setter
    def busy_timeout_s(self, seconds: float) -> None:
        self.settle()
        self._busy_timeout_s = seconds
        self._db.execute(f"PRAGMA busy_timeout={int(seconds * 1000)}")  # the writer process's: at each flush

    # ------------------------------------------------------------------ background flush
    @property
    def writer_pid(self) -> int | None:
        """The pid of the writer process (engine/kv/storage_writer.py), None before the first background flush
        and after it ended."""
        proc = self._proc
        return None if proc is None else proc.pid

    @property
    def flush_pending(self) -> bool:
        """A background flush was submitted and its outcome not handed over yet (:meth:`settle`)."""
        return self._job is not None

    @property
    def flush_done(self) -> bool:
        """No background flush is pending, or its transaction ended (:meth:`settle` would not wait)."""
        return self._job is None or self._job.done()

    def submit_flush(self, batches: Sequence[tuple[int, Sequence[bytes], Sequence[Item | bytes]]],
                     states: Iterable[VBucketRecord], boundaries: Sequence[tuple[int, int]],
                     landed: Landed) -> None:
        """:meth:`flush` in the writer process: ``batches`` are (vbucket, keys, entries) as the checkpoints
        queued them (stored values or items), which the process makes the rows of. Returns at once; ``landed``
        is called with None or the :class:`StorageError` from :meth:`settle` (this thread), which every other
        method calls first."""
        self.settle()
        if not writer_process_possible():
            self._flush_here(batches, states, boundaries, landed)
            return
        flat_states = [v for r in states for v in r.as_params()]
        flat_bounds = [v for b in boundaries for v in b]
        busy_ms = int(self._busy_timeout_s * 1000)
        try:
            payload = marshal.dumps(("flush", busy_ms, batches, flat_states, flat_bounds),  # type: ignore[arg-type]
                                    MARSHAL_VERSION)
        except ValueError:  # an entry is an Item (marshal takes built-in types only)
            payload = marshal.dumps(("flush", busy_ms, stored_batches(batches), flat_states, flat_bounds),
                                    MARSHAL_VERSION)
        self._landed = landed
        self._job = self._writer_thread().submit(self._request, payload)

    def _writer_thread(self) -> ThreadPoolExecutor:
        if self._writer is None:
            hand_gil_over_promptly()
            self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"storage-writer-{self.path.name}")
        return self._writer

    def start_writer(self) -> None:
        """Start the writer process now, in the background, for a storage about to flush in the background:
        the first background flush then does not wait for an interpreter to start (~0.1 s, more on a busy
        machine: the whole first flush's latency). Nothing to do when it runs, or cannot
        (:func:`writer_process_possible`); a failure to start is left to the first flush to report."""
        if self._proc is not None or self._job is not None or not writer_process_possible():
            return
        self._landed = None
        self._job = self._writer_thread().submit(self._start_writer)

    def _start_writer(self) -> None:
        """The writer thread (the process dies with the thread that started it)."""
        if self._proc is None:
            with contextlib.suppress(OSError):
                self._proc = self._spawn()

    def _flush_here(self, batches: Sequence[tuple[int, Sequence[bytes], Sequence[Item | bytes]]],
                    states: Iterable[VBucketRecord], boundaries: Sequence[tuple[int, int]],
                    landed: Landed) -> None:
        """No writer process can be started (:func:`writer_process_possible`): the flush is made on this thread
        now, as the inline flush makes it, and lands at the next :meth:`settle` like a background one."""
        job: Future[None] = Future()
        try:
            self.flush_batches(batches, states, boundaries)
        except StorageError as e:
            job.set_exception(e)
        except Exception as e:  # as settle() reports a writer's unexpected failure: the flush failed, not lost
            job.set_exception(StorageError(f"flush failed: {e}"))
        else:
            job.set_result(None)
        self._landed = landed
        self._job = job

    def _spawn(self) -> subprocess.Popen[bytes]:
        """The writer thread: start the writer process (from this thread, which it dies with) and set it up."""
        setup: WriterSetup = {
            "path": str(self.path), "synchronous": self._synchronous, "cache_kib": PAGE_CACHE_KIB,
            "layout": STORED_VALUE_LAYOUT, "multirow_rows": MULTIROW_ROWS, "insert_head": _INSERT_HEAD,
            "supersede_head": _SUPERSEDE_HEAD, "supersede_tail": _SUPERSEDE_TAIL, "boundary_head": _BOUNDARY_HEAD,
            "state_head": _STATE_HEAD,
        }
        proc = subprocess.Popen([sys.executable, "-I", "-S", _WRITER_SCRIPT, str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert proc.stdin is not None
            storage_writer.send(proc.stdin, marshal.dumps(dict(setup)))
        except BaseException:  # it ended at once (its pipe broke): not left behind unreaped
            proc.kill()
            proc.wait()
            raise
        self.writer_starts += 1
        return proc

    def _request(self, payload: bytes) -> None:
        """The writer thread: one request to the writer process and its reply; a failed request, or a process
        that ended, is a :class:`StorageError` (a process that ended is started again at the next request)."""
        try:
            proc = self._proc
            if proc is None:
                proc = self._proc = self._spawn()
            assert proc.stdin is not None and proc.stdout is not None
            storage_writer.send(proc.stdin, payload)
            reply = storage_writer.receive(proc.stdout)
        except OSError as e:  # could not start it, or its pipe broke (it ended)
            self._end_writer(kill=True)
            raise StorageError(f"flush failed: the storage writer process: {e}") from e
        if reply is None:
            code = self._end_writer(kill=True)
            raise StorageError(f"flush failed: the storage writer process ended (exit status {code})")
        err = marshal.loads(reply)
        if err is not None:
            raise StorageError(f"flush failed: {err}")

    def _end_writer(self, kill: bool = False) -> int | None:
        """The writer thread: end the writer process (closing its stdin ends it after the request in hand;
        ``kill`` does not wait) and reap it; its exit status."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if kill:
            proc.kill()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            return proc.wait(WRITER_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def settle(self) -> None:
        """Wait for the background flush in flight, if any, and hand its outcome to its submitter."""
        job = self._job
        if job is None:
            return
        try:
            job.result()
            err: StorageError | None = None
        except StorageError as e:
            err = e
        except Exception as e:  # the writer's connection could not even be opened (sqlite3 raises only Error)
            err = StorageError(f"flush failed: {e}")
        landed = self._landed
        self._job = self._landed = None
        if landed is not None:
            landed(err)

    def release_cache(self) -> None:
        """Free what SQLite's page cache holds (``PRAGMA shrink_memory``); it refills as reads need it."""
        self.settle()
        try:
            self._db.execute("PRAGMA shrink_memory")
            if self._writer is not None and self._proc is not None:
                self._writer.submit(self._request, marshal.dumps(("shrink",))).result()
        except (sqlite3.Error, StorageError) as e:
            raise StorageError(f"cannot release the page cache: {e}") from e

    # ------------------------------------------------------------------ meta
    def get_meta(self, key: str) -> str | None:
        self.settle()
        row = self._db.execute("SELECT v FROM meta WHERE k=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self.settle()
        self._db.execute("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------------ vbucket states
    def load_states(self) -> dict[int, VBucketRecord]:
        self.settle()
        out: dict[int, VBucketRecord] = {}
        for row in self._db.execute(
            "SELECT vb, state, failover, high_seqno, snap_start, snap_end, purge_seqno, max_cas, "
            "history_start, max_deleted_rev FROM vbstate"
        ):
            fo = [(int(u), int(s)) for u, s in json.loads(row[2])]
            out[row[0]] = VBucketRecord(row[0], row[1], fo, *row[3:])
        return out

    def save_states(self, records: Iterable[VBucketRecord]) -> None:
        self.settle()
        self._db.executemany(_UPSERT_STATE, [r.as_params() for r in records])

    # ------------------------------------------------------------------ flush
    def flush_batches(self, batches: Sequence[tuple[int, Sequence[bytes], Sequence[Item | bytes]]],
                      states: Iterable[VBucketRecord], boundaries: Sequence[tuple[int, int]] = ()) -> None:
        """:meth:`flush` of the checkpoints' ``batches`` (vbucket, keys, entries) on this thread: their rows and
        superseded marks made as the writer process makes them (``storage_writer.stored_rows``)."""
        superseded: list[tuple[int, int, int]] = []
        rows = storage_writer.stored_rows(stored_batches(batches), superseded, STORED_VALUE_LAYOUT)
        self.flush(rows, superseded, states, boundaries)

    def flush(
        self,
        rows: Iterable[Row],
        superseded: Sequence[tuple[int, int, int]],
        states: Iterable[VBucketRecord],
        boundaries: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Persist one batch atomically: new rows, superseded marks ``(newer_seqno, vb, old_seqno)``, states
        and replica snapshot boundaries ``(vb, end_seqno)``. ``rows`` may be an iterator that fills
        ``superseded`` as it goes (the flusher's): it is consumed first."""
        self.settle()
        db = self._db
        try:
            db.execute("BEGIN")
            db.executemany(_INSERT, rows)
            if superseded:
                db.executemany(_SUPERSEDE, superseded)
            if boundaries:
                db.executemany(_BOUNDARY, boundaries)
            db.executemany(_UPSERT_STATE, [r.as_params() for r in states])
            db.execute("COMMIT")
        except sqlite3.Error as e:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise StorageError(f"flush failed: {e}") from e

    # ------------------------------------------------------------------ reads
    def scan(self, vb: int, after: int, upto: int, limit: int) -> list[Row]:
        """Rows of the consistent state as of ``upto`` with seqno in ``(after, upto]``, in seqno order.

        The backfill's read (engine/dcp/backfill.py; ``upto`` is at most the persisted seqno, so landed): it does
        not wait for the background flush in flight, whose transaction runs in the writer process on a
        connection of its own -- what it commits is above ``upto``, its superseded marks above ``upto`` too,
        and SQLite's WAL gives this read one snapshot. So a stream's backfill, on the node's event loop, never
        waits for a flush (docs/engine.md "Background flush", "Landing")."""
        return self._db.execute(_SCAN, (vb, after, upto, upto, limit)).fetchall()

    def max_visible_seqno(self, vb: int, after: int, upto: int) -> int:
        """The highest seqno in ``(after, upto]`` of the state as of ``upto`` that is a mutation, deletion or
        expiration (not a prepare or abort); 0 if none. kv_engine's max-visible-seqno: the disk snapshot end a
        DCP client without sync writes is given. Walks backwards from ``upto``, so it is cheap. Like
        :meth:`scan` (the backfill's), it does not wait for the flush in flight."""
        row = self._db.execute(
            "SELECT seqno FROM items WHERE vb=? AND seqno>? AND seqno<=? AND op<3 AND "
            "(superseded IS NULL OR superseded>?) ORDER BY seqno DESC LIMIT 1", (vb, after, upto, upto)).fetchone()
        return 0 if row is None else int(row[0])

    def current(self, vb: int) -> Iterator[Row]:
        """The current version of every key of ``vb`` (tombstones included), in seqno order."""
        self.settle()
        return iter(
            self._db.execute(
                "SELECT vb, seqno, key, value, flags, expiry, cas, rev, datatype, op FROM items "
                "WHERE vb=? AND superseded IS NULL ORDER BY seqno",
                (vb,),
            )
        )

    def current_all(self) -> Iterator[Row]:
        """The current version of every key of every vbucket (warmup), by vbucket and seqno."""
        self.settle()
        return iter(
            self._db.execute(
                "SELECT vb, seqno, key, value, flags, expiry, cas, rev, datatype, op FROM items "
                "WHERE superseded IS NULL ORDER BY vb, seqno"
            )
        )

    def get(self, vb: int, key: bytes) -> Row | None:
        self.settle()
        row = self._db.execute(
            "SELECT vb, seqno, key, value, flags, expiry, cas, rev, datatype, op FROM items "
            "WHERE vb=? AND key=? AND superseded IS NULL",
            (vb, key),
        ).fetchone()
        return None if row is None else tuple(row)

    def count(self, vb: int) -> int:
        self.settle()
        return int(self._db.execute("SELECT COUNT(*) FROM items WHERE vb=?", (vb,)).fetchone()[0])

    def snapshot_boundary(self, vb: int, seqno: int) -> int:
        """The newest persisted complete-snapshot end of replica ``vb`` at or below ``seqno`` (0 if none)."""
        self.settle()
        (b,) = self._db.execute(
            "SELECT COALESCE(MAX(seqno), 0) FROM snapshots WHERE vb=? AND seqno<=?", (vb, seqno)).fetchone()
        return int(b)

    # ------------------------------------------------------------------ rollback / compaction
    def rollback(self, vb: int, seqno: int, record: VBucketRecord) -> bool:
        """Restore ``vb`` on disk to exactly its state at ``seqno``.

        Returns False (and changes nothing) when older versions needed for that were purged
        (``seqno < history_start``): the caller must then rebuild the vbucket from zero.
        """
        self.settle()
        if seqno < record.history_start:
            return False
        db = self._db
        try:
            db.execute("BEGIN")
            db.execute("DELETE FROM items WHERE vb=? AND seqno>?", (vb, seqno))
            db.execute("UPDATE items SET superseded=NULL WHERE vb=? AND superseded>?", (vb, seqno))
            db.execute("DELETE FROM snapshots WHERE vb=? AND seqno>?", (vb, seqno))
            db.execute(_UPSERT_STATE, record.as_params())
            db.execute("COMMIT")
        except sqlite3.Error as e:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise StorageError(f"rollback of vb {vb} failed: {e}") from e
        return True

    def reset_vbucket(self, vb: int, record: VBucketRecord | None) -> None:
        """Delete every row of ``vb`` (rollback to zero / vbucket deletion)."""
        self.settle()
        db = self._db
        db.execute("BEGIN")
        db.execute("DELETE FROM items WHERE vb=?", (vb,))
        db.execute("DELETE FROM snapshots WHERE vb=?", (vb,))
        if record is None:
            db.execute("DELETE FROM vbstate WHERE vb=?", (vb,))
        else:
            db.execute(_UPSERT_STATE, record.as_params())
        db.execute("COMMIT")

    def compact(self, vb: int, history_upto: int, tombstones_upto: int, tombstone_before: int) -> tuple[int, int]:
        """Purge prior versions superseded at or below ``history_upto`` and tombstones (current rows with
        ``op`` != 0) with seqno <= ``tombstones_upto`` whose delete time is before ``tombstone_before``.

        Returns ``(max purged superseded seqno, max purged tombstone seqno)`` (0 when nothing was purged):
        the caller raises ``history_start`` and the purge seqno from them.
        """
        self.settle()
        db = self._db
        db.execute("BEGIN")
        try:
            (hmax,) = db.execute(
                "SELECT COALESCE(MAX(superseded), 0) FROM items WHERE vb=? AND superseded IS NOT NULL "
                "AND superseded<=?",
                (vb, history_upto),
            ).fetchone()
            db.execute(
                "DELETE FROM items WHERE vb=? AND superseded IS NOT NULL AND superseded<=?", (vb, history_upto)
            )
            (tmax,) = db.execute(
                "SELECT COALESCE(MAX(seqno), 0) FROM items WHERE vb=? AND superseded IS NULL AND op IN (1, 2, 5) "
                "AND seqno<=? AND expiry<?",
                (vb, tombstones_upto, tombstone_before),
            ).fetchone()
            db.execute(
                # tombstones and aborts; a prepare in flight is never purged (docs/durability.md)
                "DELETE FROM items WHERE vb=? AND superseded IS NULL AND op IN (1, 2, 5) AND seqno<=? AND expiry<?",
                (vb, tombstones_upto, tombstone_before),
            )
            db.execute("COMMIT")
        except sqlite3.Error as e:
            db.execute("ROLLBACK")
            raise StorageError(f"compaction of vb {vb} failed: {e}") from e
        return int(hmax), int(tmax)

    def close(self) -> None:
        """Close the connections (after the background flush in flight, whose outcome goes to its submitter)."""
        try:
            self.settle()
        finally:
            if self._writer is not None:
                self._writer.submit(self._end_writer).result()
                self._writer.shutdown(wait=True)
                self._writer = None
            try:
                self._db.close()
            except sqlite3.Error as e:  # pragma: no cover - close failure is unusual
                raise StorageError(f"close failed: {e}") from e


_OPS: Final = tuple(Op)


def item_from_row(row: Row) -> Item:
    """The :class:`Item` a stored row holds (warmup, rollback and disk backfills read them)."""
    vb, seqno, key, value, flags, expiry, cas, rev, datatype, op = row
    if op < 3:
        return Item(key, value, vb, seqno, rev, cas, flags, expiry, datatype, _OPS[op])
    # a prepare (its durability level in bits 4-5) or an abort (docs/durability.md, Row above)
    return Item(key, value, vb, seqno, rev, cas, flags, expiry, datatype, _OPS[op & 15], 0, op >> 4)


def vbucket_record(vb: VBucket, high_seqno: int | None = None,
                   snap: tuple[int, int] | None = None) -> VBucketRecord:
    """The state record the storage persists for ``vb`` (kv_engine ``vbucket_state``); a flush gives the high
    seqno and snapshot it persists (else the vbucket's persisted ones)."""
    if snap is None:
        snap = vb.persisted_snap
    return VBucketRecord(
        vb.id, vb.state.value, vb.failover.to_pairs(), vb.persisted_seqno if high_seqno is None else high_seqno,
        snap[0], snap[1], vb.purge_seqno, vb.max_cas, vb.history_start, vb.max_deleted_rev,
    )


@functools.lru_cache(maxsize=4096)
def _failover_json(pairs: tuple[tuple[int, int], ...]) -> str:
    """A failover log as stored (JSON pairs): every flush writes the state record of each vbucket it touched,
    and a log changes only at a failover or a rollback -- so the text is made once per log, not per flush (in a
    steady state of small flushes it cost ~3 us of the flushing thread per vbucket and flush)."""
    return json.dumps(pairs)
