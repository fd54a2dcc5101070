"""The background flush (docs/engine.md "Background flush"): ``Bucket.start_flush`` / ``complete_flush``.

Real SQLite throughout: the fault is a real one (another connection holding the database's write lock, so the
writer process's transaction fails with "database is locked"), the crash a real SIGKILL of a child process.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Item, KeyNotFound, SnapshotMarker
from engine.exceptions import StorageError
from engine.kv.checkpoint import FLUSH_PIN_CURSOR
from tests.engine.kv.disk_model import (
    NVB,
    assert_disk_equals,
    assert_persisted_is_on_disk,
    db_file,
    on_disk,
    open_bucket,
    write_locked,
)

ROOT = Path(__file__).resolve().parents[3]
def test_background_flush_counts_as_persisted_only_once_landed(tmp_path: Path) -> None:
    b = open_bucket(tmp_path / "d")
    try:
        for i in range(100):
            b.set(f"k{i}", b'{"a": %d}' % i)
        assert b.start_flush() == 100
        assert b.flush_pending
        # nothing counts as persisted before it landed, whatever the writer process has done by now
        assert all(b.vbucket(vb).persisted_seqno == 0 for vb in range(NVB))
        assert b.complete_flush(wait=True) == NVB
        assert not b.flush_pending
        assert {vb: b.vbucket(vb).persisted_seqno for vb in range(NVB)} == {
            vb: b.vbucket(vb).high_seqno for vb in range(NVB)}
        assert_persisted_is_on_disk(b)
        assert FLUSH_PIN_CURSOR not in b.vbucket(0).ckpt.cursors
        assert b.vbucket_stats(0)["cursors"] == 1  # the pin is gone with the flush
    finally:
        b.close()


def test_any_storage_access_lands_the_flush_first(tmp_path: Path) -> None:
    """A state save after a background flush writes a record that includes what the flush persisted (the
    record is made after the flush landed), so the vbucket state on disk never goes back."""
    b = open_bucket(tmp_path / "d")
    try:
        for i in range(40):
            b.set(f"k{i}", b"v")
        b.start_flush()
        high = b.vbucket(1).high_seqno
        b.set_vbucket_state(1, "replica")
        assert b.vbucket(1).persisted_seqno == high
        db = sqlite3.connect(str(db_file(b)))
        (on_disk,) = db.execute("SELECT high_seqno FROM vbstate WHERE vb=1").fetchone()
        db.close()
        assert on_disk == high
        b.complete_flush()
    finally:
        b.close()


def test_failed_background_flush_loses_nothing_and_is_retried(tmp_path: Path) -> None:
    b = open_bucket(tmp_path / "d", checkpoint_max_items=10_000)  # one open checkpoint: writes de-duplicate
    model: dict[bytes, bytes | None] = {}
    try:
        for i in range(60):
            b.set(f"k{i}", b"one")
            model[f"k{i}".encode()] = b"one"
        b.flush_all()
        for i in range(60):  # new versions: the flush below has to mark the old rows superseded
            b.set(f"k{i}", b"two")
            model[f"k{i}".encode()] = b"two"
        before = {vb: b.vbucket(vb).persisted_seqno for vb in range(NVB)}
        with write_locked(db_file(b)):
            assert b.start_flush() == 60
            # written again while the flush is in flight: kept queued, not de-duplicated (it may fail)
            for i in range(0, 60, 3):
                b.set(f"k{i}", b"three")
                model[f"k{i}".encode()] = b"three"
            with pytest.raises(StorageError, match="locked"):
                b.complete_flush(wait=True)
            assert b.stats()["flush_failures"] == 1 and "locked" in str(b.stats()["flush_error"])
            with pytest.raises(StorageError, match="locked"):  # the inline flush counts the same
                b.flush()
            assert b.stats()["flush_failures"] == 2
        assert {vb: b.vbucket(vb).persisted_seqno for vb in range(NVB)} == before
        assert b.dirty_vbuckets == NVB
        assert not b.flush_pending
        b.start_flush(10_000)
        b.complete_flush(wait=True)
        # the error is the last flush's: gone once one committed; the count stays (docs/reliability.md)
        assert b.stats()["flush_error"] == "" and b.stats()["flush_failures"] == 2
        b.flush_all()
        assert_persisted_is_on_disk(b)
        assert_disk_equals(b, model)
    finally:
        b.close()
    again = open_bucket(tmp_path / "d")
    try:
        for k, v in model.items():
            assert again.get(k).value == v
    finally:
        again.close()


def test_sync_flush_and_close_land_the_background_flush(tmp_path: Path) -> None:
    b = open_bucket(tmp_path / "d")
    for i in range(30):
        b.set(f"k{i}", b"v")
    b.start_flush(5)
    b.flush()  # lands the one in flight first, then flushes inline
    assert not b.flush_pending
    b.start_flush()
    b.close(clean=False)  # the storage waits for the writer process before it closes
    again = open_bucket(tmp_path / "d")
    try:
        assert sum(again.vbucket(vb).high_seqno for vb in range(NVB)) == 30
    finally:
        again.close()


# ---------------------------------------------------------------------------------------------------- property
_keys = st.sampled_from([f"k{i}".encode() for i in range(12)])
#: a write: a new value, or a delete (None)
_writes = st.lists(st.tuples(_keys, st.one_of(st.none(), st.binary(min_size=0, max_size=12))), max_size=12)
#: one round of a history: writes; a background flush of up to N items started (the database write-locked by
#: another connection or not); writes while it is in flight; landed (waiting or not); an inline flush or not;
#: the DCP stream read or not
_rounds = st.lists(st.tuples(_writes, st.booleans(), st.one_of(st.none(), st.integers(1, 30)), _writes,
                             st.booleans(), st.booleans(), st.booleans()), max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rounds=_rounds, max_items=st.sampled_from([8, 10_000]))
def test_background_flushes_in_any_interleaving_end_equal_to_the_writes(
        tmp_path_factory: pytest.TempPathFactory, rounds: list[tuple[Any, ...]], max_items: int) -> None:
    """Random histories of writes, background flushes (landing or failing), inline flushes and a DCP stream:
    a persisted seqno never claims what is not committed, the disk ends with exactly the written state (one
    current row per key: a write that replaces an item of a flush in flight keeps that item queued, so a
    failed flush writes it again with its superseded mark), the stream never has a key twice in a snapshot
    and replays to it, and a reopened bucket holds it."""
    path = tmp_path_factory.mktemp("bg") / "d"
    b = open_bucket(path, checkpoint_max_items=max_items)  # 10,000: one open checkpoint, writes de-duplicate
    model: dict[bytes, bytes | None] = {}
    dcp = b.dcp_producer("replay")
    for vb in range(NVB):
        dcp.stream_request(vb, 0)
    seen: dict[bytes, bytes | None] = {}
    in_snapshot: dict[int, set[bytes]] = {}

    def read_stream() -> None:
        for m in dcp.step(10_000):
            if isinstance(m, SnapshotMarker):
                in_snapshot[m.vbucket] = set()
            elif isinstance(m, Item):
                keys = in_snapshot[m.vbucket]
                assert m.key not in keys, f"key {m.key!r} twice in one snapshot"  # de-duplication's rule
                keys.add(m.key)
                seen[m.key] = m.value if m.op.value == 0 else None

    def write(writes: list[tuple[bytes, bytes | None]]) -> None:
        for key, value in writes:
            if value is not None:
                b.set(key, value)
                model[key] = value
                continue
            try:
                b.delete(key)
                model[key] = None
            except KeyNotFound:
                assert model.get(key) is None

    try:
        for before, locked, start, during, wait, inline, step in rounds:
            write(before)
            with write_locked(db_file(b)) if locked else nullcontext():
                if start is not None:
                    with suppress(StorageError):  # the previous one failed: raised here, retried later
                        b.start_flush(start)
                write(during)
                with suppress(StorageError):
                    b.complete_flush(wait=wait)
            if inline:
                with suppress(StorageError):
                    b.flush()
            if step:
                read_stream()
            assert_persisted_is_on_disk(b)
        b.flush_all()
        read_stream()
        assert_persisted_is_on_disk(b)
        assert_disk_equals(b, model)
        assert {k: v for k, v in seen.items() if v is not None} == {k: v for k, v in model.items() if v is not None}
        assert all(b.vbucket(vb).persisted_seqno == b.vbucket(vb).high_seqno for vb in range(NVB))
    finally:
        b.close(clean=False)
    again = open_bucket(path, checkpoint_max_items=max_items)
    try:
        for k, v in model.items():
            if v is None:
                with pytest.raises(KeyNotFound):
                    again.get(k)
            else:
                assert again.get(k).value == v
    finally:
        again.close()


# ---------------------------------------------------------------------------------------------------- crash
_CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from engine import Bucket, BucketConfig
    b = Bucket(BucketConfig(data_dir=Path(sys.argv[1]), num_vbuckets=4, seed=3))
    n = 0
    for rnd in range(20):
        for i in range(500):
            b.set(f"k{n}", b'{"n": %d}' % n)
            n += 1
        b.start_flush(700)
        b.complete_flush(wait=rnd % 2 == 0)
        print(json.dumps({"persisted": {vb: b.vbucket(vb).persisted_seqno for vb in range(4)}}), flush=True)
    print("READY", flush=True)  # a flush may be in flight now
    time.sleep(60)
""")


def test_sigkill_with_a_background_flush_in_flight_keeps_every_landed_item(tmp_path: Path) -> None:
    data = tmp_path / "d"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(data)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    last: dict[str, int] = {}
    for line in proc.stdout:
        if line.strip() == "READY":
            break
        last = json.loads(line)["persisted"]
    else:
        proc.wait()
        raise AssertionError(f"child exited early with {proc.returncode}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert last and any(last.values())
    b = open_bucket(data, checkpoint_max_items=10_000)
    try:
        assert not b.was_clean
        for vb, persisted in last.items():
            # everything that had landed survived the kill (the flush in flight may or may not have)
            assert b.vbucket(int(vb)).high_seqno >= persisted
        highs, current = on_disk(db_file(b))
        assert all(len(rows) == 1 for rows in current.values())
        assert sum(highs.values()) == len(current)  # one version per key: no update in this run
    finally:
        b.close()


@pytest.mark.parametrize("limit", [999, 32_766])
def test_multirow_statements_stay_within_the_connections_parameter_limit(limit: int) -> None:
    """A background flush binds many rows per statement; SQLite builds before 3.32 allow 999 parameters, later
    ones 32,766 by default: the statements are cut to the connection's limit, and every row arrives."""
    from engine.kv.storage_writer import write_rows

    db = sqlite3.connect(":memory:", isolation_level=None)
    db.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, limit)
    db.execute("CREATE TABLE t (a INTEGER PRIMARY KEY, b BLOB, c INTEGER)")
    rows = [(i, b"v%d" % i, 0) for i in range(5_000)]
    write_rows(db, "INSERT INTO t (a, b, c) VALUES ", 3, [v for r in rows for v in r], 2048)
    write_rows(db, "UPDATE t SET c=v.column2 FROM (VALUES ", 2, [v for i in range(0, 5_000, 2) for v in (i, 7)], 2048,
                ") AS v WHERE t.a=v.column1")
    assert db.execute("SELECT a, b, c FROM t ORDER BY a").fetchall() == [
        (i, b"v%d" % i, 7 if i % 2 == 0 else 0) for i in range(5_000)]


@pytest.mark.parametrize("before", [0.005, 0.0005])
def test_a_storage_with_a_writer_thread_hands_the_gil_over_within_a_millisecond(before: float) -> None:
    """engine/kv/storage.py WRITER_SWITCH_INTERVAL_S: the first background flush lowers the interpreter's switch
    interval (CPython's default 5 ms) to 1 ms -- never raises a lower one. Its own process: the setting is
    process-wide."""
    code = textwrap.dedent(f"""
        import pathlib, sys, tempfile
        from engine import Bucket, BucketConfig
        sys.setswitchinterval({before})
        b = Bucket(BucketConfig(data_dir=pathlib.Path(tempfile.mkdtemp()), num_vbuckets=4))
        b.set(b"k", b'{{"a": 1}}')
        b.flush()
        inline = sys.getswitchinterval()  # an inline flush starts no writer thread
        b.set(b"k", b'{{"a": 2}}')
        assert b.start_flush() == 1
        b.complete_flush(wait=True)
        b.close()
        print(inline, sys.getswitchinterval())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    inline, after = map(float, out.stdout.split())
    assert inline == pytest.approx(before)
    assert after == pytest.approx(min(before, 0.001))
