"""The storage's writer process: where a background flush's SQLite transaction runs (docs/engine.md
"Background flush", "Where it runs").

A background flush was a transaction on a writer *thread*; its rows were made on the calling thread and bound
into SQLite statements by the writer thread with the GIL held (``sqlite3`` binds every parameter under the GIL:
~0.8 us a row of ten values), so a bulk flush took the GIL from the thread that publishes for about a
second per million rows, and made its rows there for almost another. Here the stored values go to a process of
the storage's own: the calling thread only serializes them (``marshal``: ~0.1 us an item), the storage's
writer thread hands them over on a pipe and waits with the GIL released, and this process makes the rows, binds
them and runs the transaction on its own interpreter (the other core).

The file is standard library only: the storage starts it as a script (``python -I -S storage_writer.py
PARENT_PID``), which imports nothing of the engine -- what it needs (the stored-value layout, the SQL, the
pragmas) comes in its setup message; the engine imports it too, for :func:`stored_rows` (an inline flush makes
its rows with the same function) and the framing.

Messages (the parent's writer thread <-> this process, on its stdin / stdout): an 8-byte little-endian length,
then a ``marshal`` payload. First the setup (:class:`WriterSetup` as a dict), then requests, each answered by
one reply: ``("flush", busy_timeout_ms, batches, states, bounds)`` -> None once committed, else the error's
text (the transaction rolled back); ``("shrink",)`` -> None. The end of stdin (the storage closed, or its
process died) ends this process; SIGINT and SIGTERM do not (a Ctrl-C reaches the whole process group). It dies
with the thread that started it (Linux ``PR_SET_PDEATHSIG``): after a kill -9 of the engine no orphan commits
anything behind the next process's back (an uncommitted WAL transaction of a killed process is discarded).
"""

from __future__ import annotations

import marshal
import os
import signal
import sqlite3
import struct
import sys
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import IO, Any, Final, TypedDict

#: the frame of every message: its payload's length
_FRAME: Final = struct.Struct("<Q")
#: prctl(2) option: the signal this process gets when the thread that started it ends
_PR_SET_PDEATHSIG: Final = 1

#: (vb, seqno, key, value, flags, expiry, cas, rev, datatype, op): engine.kv.storage.Row
StoredRow = tuple[int, int, bytes, bytes | None, int, int, int, int, int, int]
#: one vbucket's part of a flush: (vbucket, keys, stored values), the keys and values paired by position
VBucketBatch = tuple[int, Sequence[bytes], Sequence[bytes]]


class StoredValueLayout(TypedDict):
    """engine/kv/stored_value.py's layout, as the setup message carries it."""

    #: struct format of the header: seqno, cas, rev seqno, prev seqno, flags, expiry, datatype, op bits
    header: str
    #: struct format of the sync-write field that follows the header when ``has_sync`` is set
    sync: str
    #: op bits: no value (a tombstone without a body); a sync-write field follows the header
    no_value: int
    has_sync: int


class WriterSetup(TypedDict):
    """The first message: what the process writes and how."""

    path: str
    synchronous: str
    cache_kib: int
    layout: StoredValueLayout
    #: rows per multi-row statement, and the statements' heads and tails (engine/kv/storage.py)
    multirow_rows: int
    insert_head: str
    supersede_head: str
    supersede_tail: str
    boundary_head: str
    state_head: str


def send(stream: IO[bytes], payload: bytes) -> None:
    """Write one message."""
    stream.write(_FRAME.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def receive(stream: IO[bytes]) -> bytes | None:
    """Read one message; None at the end of the stream (also one cut short)."""
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    (n,) = _FRAME.unpack(head)
    payload = stream.read(n)
    return payload if len(payload) == n else None


def stored_rows(batches: Sequence[VBucketBatch], superseded: list[tuple[int, int, int]],
                layout: StoredValueLayout) -> Iterator[StoredRow]:
    """The storage rows of ``batches`` (stored values, engine/kv/stored_value.py), made as SQLite takes them,
    and the "superseded" marks ``(newer seqno, vb, older seqno)`` they imply, appended to ``superseded`` on the
    way: a version supersedes its key's previous one, a commit or abort its prepare (docs/durability.md)."""
    header = struct.Struct(layout["header"])
    head = header.unpack_from
    h = header.size
    sync_field = struct.Struct(layout["sync"])
    no_value = layout["no_value"]
    has_sync = layout["has_sync"]
    special = no_value | has_sync
    op_bits = 0xFF & ~special
    add = superseded.append
    for vbid, keys, entries in batches:
        for key, e in zip(keys, entries, strict=True):
            seqno, cas, rev, prev, flags, exp, dt, bits = head(e)
            if not bits & special:  # a plain mutation: the ingest path's every item
                yield (vbid, seqno, key, e[h:], flags, exp, cas, rev, dt, bits)
                if prev:
                    add((seqno, vbid, prev))
                continue
            at = h
            sync = 0
            if bits & has_sync:
                sync = sync_field.unpack_from(e, at)[0]
                at += sync_field.size
            # a prepare's durability level rides in bits 4-5 of the op column (engine.kv.storage.item_from_row)
            yield (vbid, seqno, key, None if bits & no_value else e[at:], flags, exp, cas, rev, dt,
                   (bits & op_bits) | (sync & 3) << 4)
            if prev:
                add((seqno, vbid, prev))
            if sync > 3:  # prepared << 2 | level: a commit / abort supersedes its prepare on disk
                add((seqno, vbid, sync >> 2))


def write_rows(db: sqlite3.Connection, head: str, width: int, flat: Sequence[object], per_statement: int,
               tail: str = "") -> None:
    """``head VALUES (?,..),(?,..),.. tail`` over ``flat`` (rows of ``width`` values laid end to end), in
    statements of at most ``per_statement`` rows and of at most the connection's limit of parameters (SQLite's
    SQLITE_MAX_VARIABLE_NUMBER: 32,766 by default, 999 in builds older than 3.32); the full-size statement is
    cached by the connection. Each statement is one ``sqlite3_step``, run with the GIL released."""
    per = max(1, min(per_statement, db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // width))
    row = "(" + ",".join("?" * width) + ")"
    step = per * width
    full = f"{head}{','.join([row] * per)}{tail}"
    for i in range(0, len(flat), step):
        part = flat[i:i + step]
        n = len(part) // width
        db.execute(full if n == per else f"{head}{','.join([row] * n)}{tail}", part)


class _Writer:
    """This process's side: one connection, one transaction per flush request."""

    def __init__(self, setup: WriterSetup) -> None:
        self.setup = setup
        self.busy_ms = -1
        self.db = sqlite3.connect(setup["path"], isolation_level=None)
        self.db.execute(f"PRAGMA synchronous={setup['synchronous']}")
        self.db.execute(f"PRAGMA cache_size=-{setup['cache_kib']}")

    def flush(self, busy_ms: int, batches: Sequence[VBucketBatch], states: Sequence[object],
              bounds: Sequence[object]) -> None:
        s = self.setup
        db = self.db
        if busy_ms != self.busy_ms:
            db.execute(f"PRAGMA busy_timeout={busy_ms}")
            self.busy_ms = busy_ms
        superseded: list[tuple[int, int, int]] = []
        rows = list(chain.from_iterable(stored_rows(batches, superseded, s["layout"])))
        # one mark per row, the last (an UPDATE ... FROM applies one of several matches)
        last = {(vb, old): newer for newer, vb, old in superseded}
        marks = [v for (vb, old), newer in last.items() for v in (newer, vb, old)]
        per = s["multirow_rows"]
        try:
            db.execute("BEGIN")
            write_rows(db, s["insert_head"], 10, rows, per)
            if marks:
                write_rows(db, s["supersede_head"], 3, marks, per, s["supersede_tail"])
            if bounds:
                write_rows(db, s["boundary_head"], 2, bounds, per)
            write_rows(db, s["state_head"], 10, states, per)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def serve(self, requests: IO[bytes], replies: IO[bytes]) -> None:
        while (payload := receive(requests)) is not None:
            req: Any = marshal.loads(payload)
            try:
                if req[0] == "flush":
                    self.flush(*req[1:])
                elif req[0] == "shrink":
                    self.db.execute("PRAGMA shrink_memory")
                else:
                    raise ValueError(f"unknown request {req[0]!r}")
                reply = None
            except (sqlite3.Error, ValueError, OSError, MemoryError) as e:
                reply = f"{type(e).__name__}: {e}"
            send(replies, marshal.dumps(reply))


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the thread that started this process ends (Linux); exit if that already happened."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # pragma: no cover - not Linux: the end of stdin still ends it
        pass
    if os.getppid() != parent:
        os._exit(1)


def main(argv: Sequence[str]) -> int:
    _die_with_parent(int(argv[1]))
    # Its life is its storage's: a Ctrl-C or SIGTERM sent to the whole process group (a terminal, systemd)
    # leaves the flush in flight to finish; the engine's exit ends this process (stdin closed, or the kernel).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    payload = receive(requests)
    if payload is None:
        return 0
    _Writer(marshal.loads(payload)).serve(requests, replies)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
