"""What the storage's disk holds, read by a connection of its own, and faults on it: shared by the background
flush tests (test_flusher.py) and the writer process tests (test_storage_writer.py)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine import Bucket, BucketConfig

NVB = 4


def open_bucket(path: Path, **overrides: object) -> Bucket:
    cfg: dict[str, object] = {"data_dir": path, "num_vbuckets": NVB, "seed": 3, "checkpoint_max_items": 8}
    cfg.update(overrides)
    b = Bucket(BucketConfig(**cfg))
    b.storage.busy_timeout_s = 0.05  # a write-locked database fails a flush at once
    return b


def db_file(b: Bucket) -> Path:
    return b.storage.path


def on_disk(path: Path) -> tuple[dict[int, int], dict[bytes, list[tuple[int, bytes | None, int]]]]:
    """Read by a connection of its own: per vbucket the highest committed seqno, and per key its current rows
    (``superseded IS NULL``: exactly one per key when the disk is consistent)."""
    db = sqlite3.connect(str(path))
    try:
        highs = {vb: s for vb, s in db.execute("SELECT vb, MAX(seqno) FROM items GROUP BY vb")}
        current: dict[bytes, list[tuple[int, bytes | None, int]]] = {}
        for key, seqno, value, op in db.execute(
                "SELECT key, seqno, value, op FROM items WHERE superseded IS NULL ORDER BY seqno"):
            current.setdefault(bytes(key), []).append((seqno, value, op))
        return highs, current
    finally:
        db.close()


@contextmanager
def write_locked(path: Path) -> Iterator[None]:
    """Another connection holds the database's write lock: every write transaction fails (no busy timeout)."""
    db = sqlite3.connect(str(path), isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        db.execute("ROLLBACK")
        db.close()


def assert_persisted_is_on_disk(b: Bucket) -> None:
    highs, _cur = on_disk(db_file(b))
    for vb in range(NVB):
        v = b.vbucket(vb)
        assert v.persisted_seqno <= highs.get(vb, 0) or v.persisted_seqno == 0, (vb, v.persisted_seqno, highs)


def assert_disk_equals(b: Bucket, model: dict[bytes, bytes | None]) -> None:
    _highs, current = on_disk(db_file(b))
    for key, rows in current.items():
        assert len(rows) == 1, (key, rows)  # one current version per key: every superseded mark was written
    live = {k: rows[0][1] for k, rows in current.items() if rows[0][2] == 0}
    assert live == {k: v for k, v in model.items() if v is not None}
