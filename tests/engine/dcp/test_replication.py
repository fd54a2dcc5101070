"""The replica side of DCP (engine/dcp/replication.py): replicas equal their active, persist in seqno order, adopt
the producer's failover log, roll back exactly (or rebuild from zero) and reject bad input with typed errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import (
    Bucket,
    BucketConfig,
    FailoverEntry,
    InvalidArgument,
    Item,
    NotMyVBucket,
    Op,
    SnapshotFlags,
    SnapshotMarker,
    VBucketState,
)
from engine.dcp.replication import DcpConsumer, PassiveState
from engine.dcp.stream import StreamEndReason
from tests.engine.cluster_model import vb_image

NVB = 4


def _bucket(path: Path, seed: int, **kw: Any) -> Bucket:
    cfg: dict[str, Any] = {"data_dir": path, "num_vbuckets": NVB, "seed": seed, "tune_gc": False}
    cfg.update(kw)
    return Bucket(BucketConfig(**cfg))


@pytest.fixture
def pair(tmp_path: Path):
    active = _bucket(tmp_path / "a", 1)
    replica = _bucket(tmp_path / "r", 2)
    for vb in range(NVB):
        replica.set_vbucket_state(vb, VBucketState.REPLICA)
    yield active, replica
    for b in (active, replica):
        if not b.closed:
            b.close(clean=False)


def _connect(active: Bucket, replica: Bucket, name: str = "replication:a->r") -> DcpConsumer:
    c = DcpConsumer(name, replica, active.dcp_producer(name))
    for vb in range(NVB):
        c.add_stream(vb)
    return c


def _assert_equal(active: Bucket, replica: Bucket) -> None:
    for vb in range(NVB):
        a, r = active.vbucket(vb), replica.vbucket(vb)
        assert r.high_seqno == a.high_seqno
        assert vb_image(r) == vb_image(a)
        assert r.max_cas == max((it.cas for it in a.ht.values()), default=0) or a.high_seqno == 0
        assert replica.failover_log(vb) == active.failover_log(vb)


def _writes(b: Bucket, n: int, prefix: str = "k") -> None:
    for i in range(n):
        b.set(f"{prefix}{i % 13}", f"v{i}".encode(), flags=i, expiry=0 if i % 3 else 4_000_000_000)
        if i % 7 == 3:
            b.delete(f"{prefix}{i % 13}")


def test_replica_equals_active_after_pump(pair) -> None:
    active, replica = pair
    _writes(active, 60)
    active.flush()  # part of it from disk (backfill), the rest from memory
    _writes(active, 40, "m")
    c = _connect(active, replica)
    c.drain()
    _assert_equal(active, replica)
    # deletions arrive as tombstones with the active's rev seqno and CAS
    vb = active.vbucket_of("k3")
    assert replica.vbucket(vb).ht[b"k3"].op is active.vbucket(vb).ht[b"k3"].op
    # the replica rejects front-end reads and writes
    with pytest.raises(NotMyVBucket):
        replica.get("k1")
    with pytest.raises(NotMyVBucket):
        replica.set("k1", b"x")
    # more writes keep flowing over the open streams
    _writes(active, 30, "z")
    c.drain()
    _assert_equal(active, replica)
    assert replica.stats()["replica_rollbacks"] == 0


def test_replica_persists_in_seqno_order_and_survives_restart(pair, tmp_path: Path) -> None:
    active, replica = pair
    _writes(active, 80)
    c = _connect(active, replica)
    c.drain()
    received = {vb: sorted(it.seqno for ck in replica.vbucket(vb).ckpt.checkpoints for it in ck.items
                           if it is not None) for vb in range(NVB)}
    assert all(received.values())
    # small flush batches: what is on disk is always a seqno prefix of what was received
    while replica.dirty_vbuckets:
        replica.flush(max_items=3)
        for vb in range(NVB):
            p = replica.vbucket(vb).persisted_seqno
            on_disk = sorted(r[0] for r in replica.storage._db.execute("SELECT seqno FROM items WHERE vb=?", (vb,)))
            assert on_disk == [s for s in received[vb] if s <= p]
    for vb in range(NVB):
        # every item received is on disk (a replica checkpoint holds one snapshot: no de-duplication)
        got = sorted(r[1] for r in replica.storage.scan(vb, 0, 1 << 62, 1 << 30))
        assert replica.storage.count(vb) == c.streams[vb].items
        assert got == sorted(set(got))
        rvb = replica.vbucket(vb)
        assert rvb.persisted_seqno == rvb.high_seqno == rvb.snapshot_persisted
        assert replica.storage.snapshot_boundary(vb, rvb.high_seqno) == rvb.high_seqno
    replica.close(clean=False)
    again = _bucket(tmp_path / "r", 2)
    try:
        for vb in range(NVB):
            assert again.vbucket(vb).state is VBucketState.REPLICA
            assert vb_image(again.vbucket(vb)) == vb_image(active.vbucket(vb))
            # a replica never gets a warmup failover entry (kv_engine: only active vbuckets do)
            assert again.failover_log(vb) == active.failover_log(vb)
    finally:
        again.close()


def test_replica_adopts_producer_failover_log_on_ok(pair) -> None:
    active, replica = pair
    own = replica.failover_log(0)
    assert own != active.failover_log(0)
    c = DcpConsumer("rep", replica, active.dcp_producer("rep"))
    log = c.add_stream(0)
    assert log == active.failover_log(0) == replica.failover_log(0)
    # persisted too
    assert replica.storage.load_states()[0].failover == [(e.vbuuid, e.seqno) for e in log]


def test_partial_snapshot_position_and_resume(pair) -> None:
    active, replica = pair
    vb = 0
    keys = [k for k in (f"p{i}" for i in range(200)) if active.vbucket_of(k) == vb][:10]
    for k in keys:
        active.set(k, b"1")
    active.flush()
    name = "rep"
    c = DcpConsumer(name, replica, active.dcp_producer(name))
    c.add_stream(vb)
    # apply a marker and only part of the snapshot by hand, as a slow connection would
    msgs = c.producer.step(max_messages=4)
    for m in msgs:
        replica.apply_replica_message(m)
    rvb = replica.vbucket(vb)
    start, s, e = replica.replica_position(vb)
    assert start == rvb.high_seqno == 3 and (s, e) == (0, 10)
    assert rvb.snapshot_complete == 0
    replica.flush_all()
    assert rvb.persisted_snap == (0, 10) and rvb.snapshot_persisted == 0
    # reconnect: the request carries the partial snapshot's range and resumes inside it
    c2 = DcpConsumer("rep2", replica, active.dcp_producer("rep2"))
    c2.add_stream(vb)
    c2.drain()
    assert rvb.high_seqno == 10 and rvb.snapshot_complete == 10
    assert vb_image(rvb) == vb_image(active.vbucket(vb))


def test_rollback_to_exact_earlier_state(pair) -> None:
    active, replica = pair
    vb = 1
    keys = [k for k in (f"r{i}" for i in range(400)) if active.vbucket_of(k) == vb][:6]
    for k in keys:
        active.set(k, b"one")
    c = _connect(active, replica)
    c.drain()
    replica.flush_all()
    image_at_6 = vb_image(replica.vbucket(vb))
    high6 = replica.vbucket(vb).high_seqno
    for k in keys[:3]:
        active.set(k, b"two")
    active.delete(keys[4])
    c.drain()
    replica.flush_all()
    assert replica.vbucket(vb).high_seqno == high6 + 4
    # roll back into the middle: lands on the newest complete snapshot boundary <= 8 (= 6 here)
    reached = replica.rollback_vbucket(vb, high6 + 2)
    rvb = replica.vbucket(vb)
    assert reached == high6
    assert rvb.high_seqno == rvb.persisted_seqno == high6
    assert vb_image(rvb) == image_at_6
    assert all(e.seqno <= high6 for e in rvb.failover.entries)
    assert replica.stats()["replica_rollbacks"] == 1
    # re-stream from the boundary: converges again
    c.close()
    c2 = _connect(active, replica, "again")
    c2.drain()
    _assert_equal(active, replica)


def test_stream_request_rollback_after_active_crash(tmp_path: Path) -> None:
    # The active crashes with items the replica already has; after the unclean warmup it has a new failover
    # entry at its persisted seqno, and the replica's request is answered ROLLBACK.
    active = _bucket(tmp_path / "a", 1, num_vbuckets=1)
    replica = _bucket(tmp_path / "r", 2, num_vbuckets=1)
    replica.set_vbucket_state(0, VBucketState.REPLICA)
    for i in range(5):
        active.set(f"a{i}", b"x")
    active.flush()
    c = DcpConsumer("rep", replica, active.dcp_producer("rep"))
    c.add_stream(0)
    c.drain()
    for i in range(5):
        active.set(f"b{i}", b"y")  # seqnos 6..10, never persisted on the active
    c.drain()
    replica.flush_all()
    assert replica.vbucket(0).high_seqno == 10
    active.close(clean=False)
    active = _bucket(tmp_path / "a", 1, num_vbuckets=1)
    assert active.failover_log(0)[0].seqno == 5
    c2 = DcpConsumer("rep2", replica, active.dcp_producer("rep2"))
    c2.add_stream(0)
    assert c2.rollbacks == 1
    rvb = replica.vbucket(0)
    assert rvb.high_seqno == 5 and set(rvb.ht) == {f"a{i}".encode() for i in range(5)}
    assert replica.failover_log(0) == active.failover_log(0)
    active.set("c", b"z")
    c2.drain()
    assert vb_image(rvb) == vb_image(active.vbucket(0))
    active.close()
    replica.close()


def test_rollback_rebuilds_from_zero_when_history_purged(tmp_path: Path) -> None:
    replica = _bucket(tmp_path / "r", 2, num_vbuckets=1, history_seqnos=0)
    active = _bucket(tmp_path / "a", 1, num_vbuckets=1)
    replica.set_vbucket_state(0, VBucketState.REPLICA)
    c = DcpConsumer("rep", replica, active.dcp_producer("rep"))
    c.add_stream(0)
    for i in range(10):
        active.set("same", str(i).encode())  # every version in its own snapshot on the replica
        active.set(f"u{i}", b"u")
        c.drain()
        replica.flush_all()
    replica.compact(0)
    rvb = replica.vbucket(0)
    assert rvb.history_start > 4
    reached = replica.rollback_vbucket(0, 4)
    assert reached == 0
    assert replica.stats()["replica_rebuilds"] == 1
    assert rvb.high_seqno == 0 and not rvb.ht and replica.storage.count(0) == 0
    c.close()
    c2 = DcpConsumer("rep2", replica, active.dcp_producer("rep2"))
    c2.add_stream(0)
    c2.drain()
    assert vb_image(rvb) == vb_image(active.vbucket(0))
    active.close()
    replica.close()


def test_promote_adds_entry_at_last_complete_snapshot_and_rolls_back_partial(pair) -> None:
    active, replica = pair
    vb = 2
    keys = [k for k in (f"q{i}" for i in range(400)) if active.vbucket_of(k) == vb][:8]
    for k in keys[:4]:
        active.set(k, b"1")
    c = DcpConsumer("rep", replica, active.dcp_producer("rep"))
    c.add_stream(vb)
    c.drain()
    for k in keys[4:]:
        active.set(k, b"2")
    for m in c.producer.step(max_messages=3):  # marker + 2 of the 4 items of the second snapshot
        replica.apply_replica_message(m)
    rvb = replica.vbucket(vb)
    assert rvb.high_seqno == 6 and rvb.snapshot_complete == 4
    old = replica.failover_log(vb)
    entry = replica.promote(vb)
    assert entry is not None and entry.seqno == 4
    assert replica.failover_log(vb) == [entry, *old]
    assert rvb.state is VBucketState.ACTIVE and rvb.high_seqno == 4
    assert set(rvb.ht) == {k.encode() for k in keys[:4]}
    # the promoted vbucket serves writes with CAS above everything it received
    new_key = next(k for k in (f"n{i}" for i in range(400)) if active.vbucket_of(k) == vb)
    res = replica.set(new_key, b"v")
    assert res.seqno == 5 and res.vbuuid == entry.vbuuid
    assert res.cas > max(it.cas for it in active.vbucket(vb).ht.values())


def test_bad_input_gets_typed_errors(pair: tuple[Bucket, Bucket]) -> None:
    active, replica = pair
    c = DcpConsumer("rep", replica, active.dcp_producer("rep"))
    with pytest.raises(NotMyVBucket):
        c.add_stream(NVB)  # unknown vbucket
    replica.set_vbucket_state(3, VBucketState.DEAD)
    with pytest.raises(NotMyVBucket):
        c.add_stream(3)  # not a replica here
    with pytest.raises(NotMyVBucket):
        replica.apply_replica_message(SnapshotMarker(3, 0, 1, SnapshotFlags.MEMORY))
    with pytest.raises(NotMyVBucket):
        active.apply_replica_message(SnapshotMarker(0, 0, 1, SnapshotFlags.MEMORY))  # active vbucket
    with pytest.raises(NotMyVBucket):
        replica.apply_replica_message(SnapshotMarker(99, 0, 1, SnapshotFlags.MEMORY))
    item = Item(b"k", b"v", 0, 1, 1, 123, op=Op.MUTATION)
    with pytest.raises(InvalidArgument):
        replica.apply_replica_message(item)  # no open snapshot
    replica.apply_replica_message(SnapshotMarker(0, 1, 2, SnapshotFlags.MEMORY))
    with pytest.raises(InvalidArgument):
        replica.apply_replica_message(Item(b"k", b"v", 0, 5, 1, 123))  # beyond the snapshot end
    with pytest.raises(InvalidArgument):
        replica.apply_replica_message("junk")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        replica.rollback_vbucket(0, -1)
    with pytest.raises(NotMyVBucket):
        active.rollback_vbucket(0, 0)  # kv_engine rolls back replica vbuckets only
    with pytest.raises(NotMyVBucket):
        active.promote(0)
    with pytest.raises(InvalidArgument):
        DcpConsumer("", replica, active.dcp_producer("x"))
    # a source vbucket that is not active answers NOT_MY_VBUCKET to a replication stream
    active.set_vbucket_state(1, VBucketState.REPLICA)
    with pytest.raises(NotMyVBucket):
        c.add_stream(1)


def test_stream_ends_with_state_changed_when_active_changes_state(pair) -> None:
    active, replica = pair
    _writes(active, 10)
    c = _connect(active, replica)
    c.drain()
    active.set_vbucket_state(0, VBucketState.DEAD)
    c.drain()
    assert c.streams[0].state is PassiveState.DEAD
    assert c.streams[0].end_reason is StreamEndReason.STATE_CHANGED
    assert c.is_open(1)


def test_replace_failover_log_rejects_empty(pair) -> None:
    _active, replica = pair
    with pytest.raises(InvalidArgument):
        replica.replace_failover_log(0, [])
    replica.replace_failover_log(0, [FailoverEntry(77, 0)])
    assert replica.failover_log(0) == [FailoverEntry(77, 0)]


def test_replica_crash_inside_partial_snapshot_resumes_with_its_range(tmp_path: Path) -> None:
    active = _bucket(tmp_path / "a", 1, num_vbuckets=1)
    replica = _bucket(tmp_path / "r", 2, num_vbuckets=1)
    replica.set_vbucket_state(0, VBucketState.REPLICA)
    for i in range(4):
        active.set(f"a{i}", b"1")
    c = DcpConsumer("rep", replica, active.dcp_producer("rep"))
    c.add_stream(0)
    c.drain()
    for i in range(6):
        active.set(f"b{i}", b"2")  # seqnos 5..10, one memory snapshot
    for m in c.producer.step(max_messages=4):  # marker + 5, 6, 7
        assert isinstance(m, (SnapshotMarker, Item))
        replica.apply_replica_message(m)
    replica.flush_all()
    replica.close(clean=False)
    replica = _bucket(tmp_path / "r", 2, num_vbuckets=1)
    rvb = replica.vbucket(0)
    assert rvb.state is VBucketState.REPLICA
    assert replica.replica_position(0) == (7, 5, 10)
    assert rvb.snapshot_complete == rvb.snapshot_persisted == 4
    c2 = DcpConsumer("rep2", replica, active.dcp_producer("rep2"))
    c2.add_stream(0)
    assert c2.rollbacks == 0
    c2.drain()
    replica.flush_all()
    assert vb_image(rvb) == vb_image(active.vbucket(0))
    assert rvb.snapshot_persisted == 10 and replica.storage.snapshot_boundary(0, 10) == 10
    active.close()
    replica.close()
