"""SQLite storage: flush batches, as-of scans, rollback with history, compaction and purge seqno."""

from __future__ import annotations

import pytest

from engine import Bucket, InvalidArgument, KeyNotFound
from engine.exceptions import StorageError
from engine.kv.storage import Storage, VBucketRecord


def _vb_of(b: Bucket, key: str) -> int:
    return b.vbucket_of(key)


def test_flush_persists_and_updates_persisted_seqno(make_bucket) -> None:
    b = make_bucket(num_vbuckets=1)
    for i in range(10):
        b.set(f"k{i}", f"v{i}")
    vb = b.vbucket(0)
    assert vb.persisted_seqno == 0
    assert b.flush() == 10
    assert vb.persisted_seqno == 10 and vb.persisted_snap == (1, 10)
    assert b.storage.count(0) == 10
    assert b.flush() == 0


def test_scan_is_consistent_as_of_its_end(make_bucket) -> None:
    b = make_bucket(num_vbuckets=1)
    b.set("a", b"1")  # 1
    b.set("b", b"1")  # 2
    b.flush()
    b.set("a", b"2")  # 3
    b.flush()
    b.delete("b")  # 4
    b.flush()
    rows = b.storage.scan(0, 0, 2, 100)
    assert [(r[1], r[2], r[3]) for r in rows] == [(1, b"a", b"1"), (2, b"b", b"1")]
    rows = b.storage.scan(0, 0, 4, 100)
    assert [(r[1], r[2], r[9]) for r in rows] == [(3, b"a", 0), (4, b"b", 1)]


def test_rollback_restores_exact_state(make_bucket) -> None:
    b = make_bucket(num_vbuckets=1)
    b.set("a", b"1")
    b.set("b", b"1")
    b.flush()
    b.set("a", b"2")
    b.delete("b")
    b.flush()
    rec = VBucketRecord(0, "active", [(1, 0)], high_seqno=2, snap_start=2, snap_end=2)
    assert b.storage.rollback(0, 2, rec)
    cur = {r[2]: (r[3], r[9]) for r in b.storage.current(0)}
    assert cur == {b"a": (b"1", 0), b"b": (b"1", 0)}
    assert b.storage.load_states()[0].high_seqno == 2


def test_compaction_purges_history_beyond_window_then_rollback_is_refused(make_bucket) -> None:
    b = make_bucket(num_vbuckets=1, history_seqnos=3)
    for i in range(10):
        b.set("a", str(i))
        b.flush()  # every version reaches disk
    assert b.storage.count(0) == 10
    b.compact(0)
    vb = b.vbucket(0)
    # versions superseded at or below persisted(10) - window(3) = 7 are gone
    assert vb.history_start == 7
    assert sorted(r[1] for r in b.storage.scan(0, 0, 10, 100)) == [10]
    assert b.storage.count(0) == 4  # seqnos 7..10
    rec = VBucketRecord(0, "active", [(1, 0)], history_start=vb.history_start)
    assert not b.storage.rollback(0, 5, rec)  # not restorable exactly: caller rebuilds from zero
    assert b.storage.count(0) == 4  # and nothing changed
    assert b.storage.rollback(0, 8, rec)
    assert [(r[1], r[3]) for r in b.storage.current(0)] == [(8, b"7")]


def test_compaction_purges_old_tombstones_and_raises_purge_seqno(make_bucket, clock) -> None:
    b = make_bucket(clock=clock, num_vbuckets=1, tombstone_purge_age_s=60)
    b.set("a", b"1")
    b.set("b", b"1")
    b.delete("a")  # 3
    b.set("c", b"1")  # 4
    b.flush()
    b.compact()
    assert b.vbucket(0).purge_seqno == 0  # too young
    clock.now += 120
    b.compact()
    assert b.vbucket(0).purge_seqno == 3
    assert [r[1] for r in b.storage.current(0)] == [2, 4]
    with pytest.raises(KeyNotFound):
        b.get("a")


def test_highest_tombstone_is_never_purged(make_bucket, clock) -> None:
    b = make_bucket(clock=clock, num_vbuckets=1, tombstone_purge_age_s=0)
    b.set("a", b"1")
    b.delete("a")
    b.flush()
    clock.now += 10
    b.compact()
    assert [r[1] for r in b.storage.current(0)] == [2]


def test_a_key_created_again_after_its_tombstone_was_purged_continues_its_revisions(make_bucket, clock) -> None:
    """kv_engine keeps the purged tombstones' highest revision (``max_deleted_seqno``), in memory and in the
    vbucket state on disk: a document created again must not start over at revision 1, or XDCR's seqno conflict
    resolution on a target that still has the tombstone (revision 3) rejects it as older."""
    b = make_bucket(clock=clock, num_vbuckets=1, tombstone_purge_age_s=0)
    b.set("a", b"1")
    b.set("a", b"2")
    b.delete("a")  # revision 3
    b.set("z", b"1")  # keeps the tombstone from being the highest seqno (never purged)
    b.flush()
    clock.now += 10
    b.compact()
    assert b.vbucket(0).purge_seqno == 3 and b"a" not in b.vbucket(0).ht
    b.set("a", b"again")
    assert b.get_meta("a").rev_seqno == 4
    b.delete("a")  # revision 5, purged again, then the bucket restarts: the high-water mark is persisted
    b.set("y", b"1")
    b.flush()
    clock.now += 10
    b.compact()
    b.close()
    b = make_bucket(clock=clock, num_vbuckets=1, tombstone_purge_age_s=0)
    b.set("a", b"third")
    assert b.get_meta("a").rev_seqno == 6


def test_bad_storage_settings(tmp_path) -> None:
    with pytest.raises(StorageError):
        Storage(tmp_path / "x.db", synchronous="SOMETIMES")
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(StorageError):
        Storage(blocker / "sub" / "x.db")


def test_reopen_keeps_everything_after_clean_close(make_bucket, tmp_path) -> None:
    b = make_bucket()
    for i in range(50):
        b.set(f"k{i}", f"v{i}", flags=i)
    b.delete("k3")
    logs = {vb: b.failover_log(vb) for vb in range(8)}
    max_cas = max(b.vbucket(vb).max_cas for vb in range(8))
    b.close()
    b2 = make_bucket()
    assert b2.was_clean
    for i in range(50):
        if i == 3:
            with pytest.raises(KeyNotFound):
                b2.get("k3")
        else:
            g = b2.get(f"k{i}")
            assert (g.value, g.flags) == (f"v{i}".encode(), i)
    assert {vb: b2.failover_log(vb) for vb in range(8)} == logs  # clean restart adds no entry
    r = b2.set("k1", b"new")
    assert r.cas > max_cas  # the CAS clock never goes back across a restart
    assert b2.get("k1").rev_seqno == 2


def test_num_vbuckets_mismatch_is_rejected(make_bucket) -> None:
    b = make_bucket(num_vbuckets=8)
    b.close()
    with pytest.raises(InvalidArgument):
        make_bucket(num_vbuckets=4)


def test_release_cache_keeps_data_and_a_closed_store_says_so(tmp_path) -> None:
    """Storage.release_cache (docs/performance.md "Engine": the page cache is not counted per item)."""
    st = Storage(tmp_path / "s.sqlite3")
    st.flush([(0, 1, b"k", b"v", 0, 0, 1, 1, 0, 0)], [], [])
    st.release_cache()
    assert [r[2] for r in st.current(0)] == [b"k"]
    st.close()
    with pytest.raises(StorageError, match="page cache"):
        st.release_cache()


def test_state_records_keep_the_failover_log_after_a_failover(make_bucket) -> None:
    """The state record's failover log is stored as JSON pairs, newest first; its text is cached per log
    (engine/kv/storage.py ``_failover_json``): a failover between flushes must still reach the disk."""
    import json
    import sqlite3

    b = make_bucket(num_vbuckets=1)
    b.set("a", b"1")
    b.flush()
    before = b.vbucket(0).failover.to_pairs()
    b.set_vbucket_state(0, "replica")
    b.set_vbucket_state(0, "active")  # a new branch: a new failover entry
    b.set("a", b"2")
    b.flush()
    after = b.vbucket(0).failover.to_pairs()
    assert len(after) == len(before) + 1 and after[1:] == before
    db = sqlite3.connect(b.storage.path)
    stored = db.execute("SELECT failover FROM vbstate WHERE vb=0").fetchone()[0]
    db.close()
    assert json.loads(stored) == [list(p) for p in after]
    assert b.storage.load_states()[0].failover == after
