"""The storage's writer process (engine/kv/storage_writer.py, docs/engine.md "Background flush"): the rows it
makes are the items' rows, a writer process that dies fails only its flush (nothing lost, the next flush starts
another), and it dies with the engine -- real processes, real SIGKILLs, real SQLite."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Bucket, BucketConfig, Item
from engine.exceptions import StorageError
from engine.kv.storage import STORED_VALUE_LAYOUT, item_from_row
from engine.kv.storage_writer import stored_rows
from engine.kv.stored_value import pack
from schemas.dcp import Op
from tests.engine.kv.disk_model import NVB, assert_disk_equals, assert_persisted_is_on_disk, write_locked
from tests.harness import process_gone

ROOT = Path(__file__).resolve().parents[3]

_u32 = st.integers(0, 2**32 - 1)
_u64 = st.integers(0, 2**64 - 1)


@st.composite
def _items(draw: st.DrawFn) -> Item:
    op = draw(st.sampled_from([Op.MUTATION, Op.DELETION, Op.EXPIRATION, Op.PREPARE, Op.ABORT]))
    value = draw(st.none() | st.binary(max_size=40))
    seqno = draw(st.integers(2, 2**48))
    it = Item(draw(st.binary(min_size=1, max_size=20)), value, draw(st.integers(0, 1023)), seqno,
              draw(_u64), draw(_u64), draw(_u32), draw(_u32), draw(st.integers(0, 7)), op,
              draw(st.integers(0, seqno - 1)))
    # sync writes: a prepare's level (1-3); a commit / abort also names its prepare's seqno (prepared << 2)
    it.sync = draw(st.sampled_from([0, 1, 2, 3]) | st.integers(1, seqno - 1).map(lambda p: p << 2 | 1)
                   if op in (Op.PREPARE, Op.ABORT) else st.just(0))
    return it


@settings(max_examples=200, deadline=None)
@given(st.lists(_items(), max_size=30))
def test_the_rows_of_stored_values_are_the_rows_of_their_items(items: list[Item]) -> None:
    """What the writer process writes for a packed item: the item's columns, a prepare's durability level in
    bits 4-5 of ``op``, and a superseded mark for the version it replaces and for a completed prepare."""
    batches = [(it.vbucket, [it.key], [pack(it)]) for it in items]
    marks: list[tuple[int, int, int]] = []
    rows = list(stored_rows(batches, marks, STORED_VALUE_LAYOUT))
    assert rows == [(it.vbucket, it.seqno, it.key, it.value, it.flags, it.expiry, it.cas, it.rev_seqno,
                     it.datatype, int(it.op) | (it.sync & 3) << 4) for it in items]
    assert marks == [m for it in items for m in (
        [(it.seqno, it.vbucket, it.prev_seqno)] if it.prev_seqno else []) + (
        [(it.seqno, it.vbucket, it.sync >> 2)] if it.sync > 3 else [])]
    for it, row in zip(items, rows, strict=True):
        back = item_from_row(row)
        assert (back.key, back.value, back.seqno, back.cas, back.op) == (it.key, it.value, it.seqno, it.cas, it.op)


def open_bucket(path: Path) -> Bucket:
    return Bucket(BucketConfig(data_dir=path, num_vbuckets=NVB, seed=3, checkpoint_max_items=10_000))


def test_a_killed_writer_process_fails_only_its_flush_and_the_next_flush_starts_another(tmp_path: Path) -> None:
    b = open_bucket(tmp_path / "d")
    model: dict[bytes, bytes | None] = {}
    try:
        for i in range(50):
            b.set(f"k{i}", b"one")
            model[f"k{i}".encode()] = b"one"
        assert b.start_flush() == 50
        b.complete_flush(wait=True)
        first = b.storage.writer_pid
        assert first is not None
        for i in range(0, 50, 2):
            b.set(f"k{i}", b"two")
            model[f"k{i}".encode()] = b"two"
        b.delete("k1")
        model[b"k1"] = None
        before = {vb: b.vbucket(vb).persisted_seqno for vb in range(NVB)}
        with write_locked(b.storage.path):
            b.storage.busy_timeout_s = 30.0  # the writer process waits for the lock: killed while it waits
            assert b.start_flush() == 26
            time.sleep(0.3)
            os.kill(first, signal.SIGKILL)
            with pytest.raises(StorageError, match="storage writer process ended"):
                b.complete_flush(wait=True)
        assert process_gone(first)
        assert b.storage.writer_pid is None
        assert {vb: b.vbucket(vb).persisted_seqno for vb in range(NVB)} == before
        assert b.stats()["flush_failures"] == 1
        assert b.start_flush() == 26  # the same items again, in a new writer process
        b.complete_flush(wait=True)
        assert b.storage.writer_pid not in (None, first)
        stats = b.stats()
        assert stats["flush_error"] == ""
        assert stats["storage_writer_starts"] == 2 and stats["storage_writer_pid"] == b.storage.writer_pid
        assert_persisted_is_on_disk(b)
        assert_disk_equals(b, model)
    finally:
        b.close()


def test_the_writer_process_started_ahead_serves_the_first_background_flush(tmp_path: Path) -> None:
    """``start_flush_writer`` (a gateway with rollback mitigation, a node process) starts the process in the
    background; the first background flush is then written by that very process."""
    b = open_bucket(tmp_path / "d")
    try:
        b.start_flush_writer()
        b.set("k", b"v")  # the engine goes on meanwhile
        assert b.start_flush() == 1  # lands the start first
        pid = b.storage.writer_pid
        assert pid is not None and not process_gone(pid, timeout=0.1)
        b.complete_flush(wait=True)
        b.start_flush_writer()  # running: nothing to do
        assert b.stats()["storage_writer_starts"] == 1 and b.storage.writer_pid == pid
        assert_persisted_is_on_disk(b)
        assert_disk_equals(b, {b"k": b"v"})
    finally:
        b.close()
    assert process_gone(pid)


@pytest.mark.parametrize("interpreter", ["embedded", "frozen"])
def test_without_an_interpreter_to_start_the_background_flush_runs_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interpreter: str) -> None:
    """An embedded interpreter (no ``sys.executable``) or a frozen application (``sys.frozen``: its executable
    is the application) cannot start the writer process: a background flush is made on the calling thread and
    lands as one made in the process would -- a failed one too (items stay queued, the next flush writes them)."""
    if interpreter == "embedded":
        monkeypatch.setattr(sys, "executable", "")
    else:
        monkeypatch.setattr(sys, "frozen", True, raising=False)
    b = open_bucket(tmp_path / "d")
    model: dict[bytes, bytes | None] = {}
    try:
        for i in range(30):
            b.set(f"k{i}", b"one")
            model[f"k{i}".encode()] = b"one"
        assert b.start_flush() == 30
        b.complete_flush(wait=True)
        b.delete("k3")
        model[b"k3"] = None
        b.set("k4", b"two")
        model[b"k4"] = b"two"
        before = {vb: b.vbucket(vb).persisted_seqno for vb in range(NVB)}
        with write_locked(b.storage.path):
            b.storage.busy_timeout_s = 0.05
            assert b.start_flush() == 2
            with pytest.raises(StorageError, match="locked"):
                b.complete_flush(wait=True)
        assert {vb: b.vbucket(vb).persisted_seqno for vb in range(NVB)} == before
        assert b.start_flush() == 2
        b.complete_flush(wait=True)
        b.start_flush_writer()  # none can start: nothing happens
        stats = b.stats()
        assert stats["storage_writer_starts"] == 0 and stats["storage_writer_pid"] == 0
        assert stats["flush_failures"] == 1 and stats["flush_error"] == ""
        assert_persisted_is_on_disk(b)
        assert_disk_equals(b, model)
    finally:
        b.close()


def test_a_ctrl_c_leaves_the_writer_to_its_storage_and_close_ends_it(tmp_path: Path) -> None:
    """SIGINT / SIGTERM to the process group (a terminal's Ctrl-C, systemd) do not end the writer process: the
    engine's own shutdown does (end of its stdin)."""
    b = open_bucket(tmp_path / "d")
    b.set("k", b"v")
    b.start_flush()
    b.complete_flush(wait=True)
    pid = b.storage.writer_pid
    assert pid is not None
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    b.set("k2", b"v")
    assert b.start_flush() == 1
    b.complete_flush(wait=True)
    assert b.storage.writer_pid == pid and b.vbucket(b.vbucket_of("k2")).persisted_seqno > 0
    b.close()
    assert process_gone(pid)


_ENGINE = textwrap.dedent("""
    import pathlib, sqlite3, sys, time
    from engine import Bucket, BucketConfig
    b = Bucket(BucketConfig(data_dir=pathlib.Path(sys.argv[1]), num_vbuckets=4, checkpoint_max_items=10_000))
    for i in range(200):
        b.set(f"k{i}", b"v")
    b.start_flush()
    b.complete_flush(wait=True)
    for i in range(200, 400):
        b.set(f"k{i}", b"v")
    lock = sqlite3.connect(str(b.storage.path), isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # the next flush's writer waits for this lock: in flight at the kill
    b.storage.busy_timeout_s = 60.0
    b.start_flush()
    print(b.storage.writer_pid, flush=True)
    time.sleep(120)
""")


def test_the_writer_process_dies_with_the_engine(tmp_path: Path) -> None:
    """kill -9 of the engine's process while its writer process waits to write: the kernel ends the writer
    too (PR_SET_PDEATHSIG), so no orphan commits behind the back of the next process that opens the data."""
    data = tmp_path / "d"
    proc = subprocess.Popen([sys.executable, "-c", _ENGINE, str(data)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), (line, proc.wait())
    writer = int(line)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert process_gone(writer)
    b = open_bucket(data)
    try:
        assert not b.was_clean
        assert len(b.state_snapshot()) == 200  # what the first flush persisted; the second never committed
    finally:
        b.close()


def test_opening_the_data_waits_for_a_commit_still_holding_the_write_lock(tmp_path: Path) -> None:
    """A writer process killed with its engine while it committed holds SQLite's write lock until it is gone;
    the next engine's open takes that lock first, so its warmup sees the commit (not the state before it)."""
    data = tmp_path / "d"
    b = open_bucket(data)
    b.set("before", b"v")
    b.close()
    path = b.storage.path
    late = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    late.execute("BEGIN IMMEDIATE")
    # the lingering commit: a row and the state record that covers it
    vb = b.vbucket_of("late")
    late.execute("INSERT INTO items (vb, seqno, key, value, flags, expiry, cas, rev, datatype, op) "
                 "VALUES (?, 1000, ?, ?, 0, 0, 1, 1, 0, 0)", (vb, b"late", b"w"))
    late.execute("UPDATE vbstate SET high_seqno=1000, snap_start=1000, snap_end=1000 WHERE vb=?", (vb,))

    def commit_late() -> None:
        late.execute("COMMIT")
        late.close()

    commit = threading.Timer(0.5, commit_late)
    commit.start()
    t = time.monotonic()
    again = open_bucket(data)
    try:
        assert time.monotonic() - t >= 0.4
        assert again.get("late").value == b"w" and again.vbucket(vb).high_seqno == 1000
    finally:
        commit.join()
        again.close()
