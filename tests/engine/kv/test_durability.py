"""Synchronous replication rules (docs/durability.md, engine/kv/durability.py), one test per rule: majority math, every
error code, invisible until commit for GET and DCP, no de-duplication of prepares, replicas ack only complete
snapshots (persist levels: persisted), timeout -> abort + ambiguous and the abort never visible, a write to a
key with a prepare in flight, storage / warmup / rollback with prepares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import Bucket, BucketConfig
from engine.dcp.replication import DcpConsumer
from engine.dcp.stream import SnapshotMarker
from engine.exceptions import (
    DurabilityImpossible,
    DurabilityInvalidLevel,
    InvalidArgument,
    KeyNotFound,
    Status,
    StorageError,
    SyncWriteAmbiguous,
    SyncWriteInProgress,
    TemporaryFailure,
    error_for_status,
)
from engine.kv.durability import (
    Durability,
    Level,
    ManualClock,
    SyncWrite,
    SyncWriteState,
    durability_possible,
    majority,
    parse_level,
)
from engine.kv.item import Item, Op
from engine.kv.vbucket import VBucketState

NVB = 4
MAJ = Durability(Level.MAJORITY)
PERSIST_ACTIVE = Durability(Level.MAJORITY_AND_PERSIST_TO_ACTIVE)
PERSIST_MAJ = Durability(Level.PERSIST_TO_MAJORITY)


def _bucket(path: Path, clock: ManualClock, seed: int = 1, **kw: Any) -> Bucket:
    cfg: dict[str, Any] = {"data_dir": path, "num_vbuckets": NVB, "seed": seed, "tune_gc": False}
    cfg.update(kw)
    return Bucket(BucketConfig(**cfg), clock=clock)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def active(tmp_path: Path, clock: ManualClock):
    b = _bucket(tmp_path / "a", clock)
    yield b
    if not b.closed:
        b.close(clean=False)


@pytest.fixture
def pair(tmp_path: Path, clock: ManualClock):
    a = _bucket(tmp_path / "a", clock, 1)
    r = _bucket(tmp_path / "r", clock, 2)
    for vb in range(NVB):
        r.set_vbucket_state(vb, VBucketState.REPLICA)
        a.set_replication_topology(vb, ["a", "r"])
    yield a, r
    for b in (a, r):
        if not b.closed:
            b.close(clean=False)


def _connect(a: Bucket, r: Bucket, *, sync: bool = True) -> DcpConsumer:
    name = "replication:a->r"
    c = DcpConsumer(name, r, a.dcp_producer(name), consumer_name="r" if sync else None)
    for vb in range(NVB):
        c.add_stream(vb)
    return c


def _drain(producer: Any, n: int = 100) -> list[Any]:
    out: list[Any] = []
    for _ in range(n):
        msgs = producer.step()
        if not msgs:
            break
        out.extend(msgs)
    return out


def _items(msgs: list[Any]) -> list[Item]:
    return [m for m in msgs if isinstance(m, Item)]


# ---------------------------------------------------------------------- levels, majority, timeouts, errors
@pytest.mark.parametrize(
    ("chain", "maj", "possible"),
    [
        (["a"], 1, True),                       # 0 replicas: kv_engine allows majority (the RFC says impossible)
        (["a", "b"], 2, True),
        (["a", None], 2, False),                # 1 replica slot empty after a failover
        (["a", "b", "c"], 2, True),
        (["a", "b", None], 2, True),
        (["a", None, None], 2, False),
        (["a", "b", "c", "d"], 3, True),
        (["a", "b", "c", None], 3, True),
        (["a", "b", None, None], 3, False),
    ],
)
def test_majority_math_table(chain: list[str | None], maj: int, possible: bool) -> None:
    # kv_engine ReplicationChain: majority = slots / 2 + 1 (empty slots counted); possible iff defined >= it
    assert majority(chain) == maj
    assert durability_possible(chain) is possible


def test_levels_parse_by_name_and_number_and_reject_the_rest() -> None:
    assert parse_level("majority") is Level.MAJORITY
    assert parse_level("MAJORITY_AND_PERSIST_TO_ACTIVE") is Level.MAJORITY_AND_PERSIST_TO_ACTIVE
    assert parse_level("persist-to-majority") is Level.PERSIST_TO_MAJORITY
    assert parse_level(2) is Level.MAJORITY_AND_PERSIST_TO_ACTIVE
    assert parse_level("0") is Level.NONE
    for bad in (4, -1, "strong", "", 1.0, None):
        with pytest.raises(DurabilityInvalidLevel) as e:
            parse_level(bad)  # type: ignore[arg-type]
        assert e.value.status == 0xA0


def test_timeout_default_floor_infinite_and_bad() -> None:
    assert Durability(Level.MAJORITY, 0).effective_timeout_ms(10_000, 1500) == 10_000
    assert Durability(Level.MAJORITY, 10).effective_timeout_ms(10_000, 1500) == 1500  # raised to the floor
    assert Durability(Level.MAJORITY, 2000).effective_timeout_ms(10_000, 1500) == 2000
    assert Durability(Level.MAJORITY, 0xFFFF).effective_timeout_ms(10_000, 1500) is None
    for bad in (-1, 0x10000, 1.5):
        with pytest.raises(InvalidArgument):
            Durability(Level.MAJORITY, bad)  # type: ignore[arg-type]


def test_status_codes_map_to_typed_exceptions() -> None:
    expected = {0xA0: DurabilityInvalidLevel, 0xA1: DurabilityImpossible, 0xA2: SyncWriteInProgress,
                0xA3: SyncWriteAmbiguous}
    for code, cls in expected.items():
        err = error_for_status(code)
        assert type(err) is cls and err.status == Status(code)
    assert SyncWriteInProgress.retriable and not SyncWriteAmbiguous.retriable
    assert not DurabilityImpossible.retriable


def test_durability_impossible_when_chain_lacks_a_majority(active: Bucket) -> None:
    vb = active.vbucket_of("k")
    active.set_replication_topology(vb, ["a", None])
    with pytest.raises(DurabilityImpossible) as e:
        active.set("k", b"v", durability=MAJ)
    assert e.value.status == 0xA1
    assert active.pending_sync_writes() == 0
    with pytest.raises(InvalidArgument):
        active.set_replication_topology(vb, [None, "b"])  # the active slot cannot be empty
    with pytest.raises(InvalidArgument):
        active.set("k", b"v", durability="majority")  # type: ignore[call-overload]


def test_level_none_is_a_plain_write(active: Bucket) -> None:
    res = active.set("k", b"v", durability=Durability(Level.NONE))
    assert not isinstance(res, SyncWrite)
    assert active.get("k").value == b"v"


# ---------------------------------------------------------------------- single node (no replicas)
def test_single_node_majority_commits_at_once_persist_levels_after_flush(active: Bucket) -> None:
    sw = active.set("m", b"1", durability=MAJ)
    assert sw.committed and active.get("m").value == b"1"
    res = sw.result()
    assert res.seqno == sw.prepare_seqno + 1  # the commit has a seqno of its own, after the prepare
    for d in (PERSIST_ACTIVE, PERSIST_MAJ):
        key = f"p{int(d.level)}"
        sw = active.set(key, b"2", durability=d)
        assert not sw.done
        with pytest.raises(KeyNotFound):
            active.get(key)  # invisible until committed
        with pytest.raises(TemporaryFailure):
            sw.result()
        active.flush_all()
        assert sw.committed and active.get(key).value == b"2"


@pytest.mark.parametrize("durability", [PERSIST_ACTIVE, PERSIST_MAJ])
def test_a_flush_round_leaves_the_commits_it_made_possible_to_the_next_flush(active: Bucket,
                                                                             durability: Durability) -> None:
    """docs/durability.md "Flushing": ``flush_round`` persists the prepare and commits it (the waiter
    completes), but the commit waits for the next flush instead of a transaction of its own; ``flush_all``
    flushes until nothing is dirty."""
    sw = active.set("p", b"2", durability=durability)
    vb = active.vbucket(sw.vbucket)
    flushed = active.items_flushed
    assert active.flush_round() == 1  # the prepare
    assert sw.committed and active.get("p").value == b"2"
    assert vb.persisted_seqno == sw.prepare_seqno < vb.high_seqno == sw.result().seqno
    assert active.dirty_vbuckets == 1  # the commit, queued after the round's transaction
    assert active.flush_round() == 1 and active.dirty_vbuckets == 0
    assert vb.persisted_seqno == vb.high_seqno and active.items_flushed == flushed + 2
    sw = active.set("q", b"3", durability=durability)
    assert active.flush_all() == 2 and sw.committed and active.dirty_vbuckets == 0  # two transactions


def test_a_flush_round_whose_later_transaction_fails_still_commits_what_the_earlier_one_persisted(
    tmp_path: Path, clock: ManualClock,
) -> None:
    """One transaction per vbucket (``flush_batch_items=1``); SQLite interrupts the second (a progress handler,
    installed once the first committed): the round raises, and the prepare the first transaction persisted is
    committed all the same -- its follow-up ran -- while the other stays a prepare, queued for the next flush."""
    b = _bucket(tmp_path / "f", clock, flush_batch_items=1)
    try:
        keys = [next(f"k{i}" for i in range(1000) if b.vbucket_of(f"k{i}") == vb) for vb in (0, 1)]
        writes = [b.set(k, b"v", durability=PERSIST_ACTIVE) for k in keys]
        storage = b.storage
        real = storage.flush_batches
        calls = []

        def flush_batches(*args: Any, **kw: Any) -> None:
            calls.append(1)
            if len(calls) == 2:
                storage._db.set_progress_handler(lambda: 1, 1)  # abort the statement: "interrupted"
            real(*args, **kw)

        storage.flush_batches = flush_batches  # type: ignore[method-assign]
        with pytest.raises(StorageError, match="interrupted"):
            b.flush_round()
        storage._db.set_progress_handler(None, 1)
        assert len(calls) == 2
        assert sorted(sw.committed for sw in writes) == [False, True]
        assert b.dirty_vbuckets == 2  # the commit, and the prepare whose transaction failed
        storage.flush_batches = real  # type: ignore[method-assign]
        b.flush_all()
        assert all(sw.committed for sw in writes) and b.dirty_vbuckets == 0
    finally:
        b.close(clean=False)


# ---------------------------------------------------------------------- active + replica
def test_prepare_invisible_until_replica_acks_then_committed(pair) -> None:
    a, r = pair
    a.set("k", b"old")
    c = _connect(a, r)
    c.drain()
    sw = a.set("k", b"new", durability=MAJ)
    assert not sw.done
    assert a.get("k").value == b"old"  # readers see the committed value only
    vb = a.vbucket(sw.vbucket)
    assert vb.prepares[b"k"].level == Level.MAJORITY
    c.drain()  # prepare reaches the replica, which acks -> commit at the active
    assert sw.committed and a.get("k").value == b"new"
    c.drain()  # the commit reaches the replica
    rv = r.vbucket(sw.vbucket)
    assert rv.ht[b"k"].value == b"new" and not rv.prepares
    assert rv.ht[b"k"].prepared == sw.prepare_seqno
    assert c.seqno_acks >= 1


def test_write_to_key_with_prepare_in_flight(pair) -> None:
    a, _r = pair
    a.set("k", b"old")
    sw = a.set("k", b"new", durability=MAJ)
    assert not sw.done
    for op in (lambda: a.set("k", b"x"), lambda: a.delete("k"), lambda: a.touch("k", 10),
               lambda: a.set("k", b"y", durability=MAJ), lambda: a.replace("k", b"z"),
               lambda: a.delete("k", durability=MAJ)):
        with pytest.raises(SyncWriteInProgress) as e:
            op()
        assert e.value.status == 0xA2
    a.set("other", b"fine")  # other keys are not blocked


def test_timeout_aborts_reports_ambiguous_and_abort_never_visible(pair, clock: ManualClock) -> None:
    a, r = pair
    a.set("k", b"old")
    gw = a.dcp_producer("gateway")  # a DCP client without sync writes
    gw.stream_request(a.vbucket_of("k"), 0)
    sw = a.set("k", b"new", durability=Durability(Level.MAJORITY, 2000))
    clock.advance(1.9)
    assert a.process_durability_timeouts() == 0 and not sw.done
    clock.advance(0.2)
    assert a.process_durability_timeouts() == 1
    assert sw.state is SyncWriteState.ABORTED
    with pytest.raises(SyncWriteAmbiguous) as e:
        sw.result()
    assert e.value.status == 0xA3
    assert a.get("k").value == b"old"
    msgs = _drain(gw)
    assert [(i.key, i.value) for i in _items(msgs)] == [(b"k", b"old")]
    assert all(i.op < Op.PREPARE for i in _items(msgs))
    # a replica (sync writes on) gets the prepare and the abort, and drops the prepare
    c = _connect(a, r)
    c.drain()
    rv = r.vbucket(sw.vbucket)
    assert not rv.prepares and rv.ht[b"k"].value == b"old"
    ops = [it.op for it in r.vbucket(sw.vbucket).ckpt.open.queued_items(sw.vbucket)]
    assert Op.ABORT in ops or rv.high_seqno == a.vbucket(sw.vbucket).high_seqno
    # the key is writable again
    sw2 = a.set("k", b"again", durability=MAJ)
    c.drain()
    assert sw2.committed


def test_timeout_zero_uses_bucket_default(tmp_path: Path, clock: ManualClock) -> None:
    b = _bucket(tmp_path / "b", clock, durability_timeout_ms=3000)
    try:
        b.set_replication_topology(b.vbucket_of("k"), ["a", "r"])
        sw = b.set("k", b"v", durability=MAJ)
        assert sw.deadline == pytest.approx(clock() + 3.0)
    finally:
        b.close()


def test_dcp_without_sync_writes_sees_commit_as_mutation_with_visible_marker_end(pair) -> None:
    a, _r = pair
    vbid = a.vbucket_of("k")
    gw = a.dcp_producer("gateway")
    gw.stream_request(vbid, 0)
    sync = a.dcp_producer("sync")
    sync.control("enable_sync_writes", "true")
    sync.stream_request(vbid, 0)
    sw = a.set("k", b"v", durability=MAJ)
    seen = _drain(gw)
    assert _items(seen) == []  # the prepare alone: nothing visible, no marker either
    assert not any(isinstance(m, SnapshotMarker) for m in seen)
    a.seqno_acknowledged(vbid, "r", sw.prepare_seqno)
    assert sw.committed
    seen = _drain(gw)
    items = _items(seen)
    assert [(i.op, i.seqno, i.value) for i in items] == [(Op.MUTATION, sw.result().seqno, b"v")]
    markers = [m for m in seen if isinstance(m, SnapshotMarker)]
    assert markers and markers[-1].end == sw.result().seqno
    # the sync-writes connection sees prepare then commit
    sitems = _items(_drain(sync))
    assert [(i.op, i.prepared) for i in sitems] == [(Op.PREPARE, 0), (Op.MUTATION, sw.prepare_seqno)]
    with pytest.raises(InvalidArgument):
        sync.control("enable_sync_writes", "maybe")
    with pytest.raises(InvalidArgument):
        sync.control("nonsense", "1")
    with pytest.raises(InvalidArgument):
        gw.seqno_acknowledged(vbid, 1)  # acks need sync writes and a consumer name


def test_backfill_hides_prepares_from_clients_without_sync_writes(pair) -> None:
    a, _r = pair
    vbid = a.vbucket_of("k")
    a.set("k", b"old")
    sw = a.set("k", b"new", durability=MAJ)
    a.flush_all()
    a.vbucket(vbid).ckpt.create_checkpoint()
    a.vbucket(vbid).ckpt.remove_unreferenced()
    gw = a.dcp_producer("gateway")
    gw.stream_request(vbid, 0, flags=0x02)  # DISK_ONLY: served from storage
    msgs = _drain(gw)
    assert [(i.key, i.value) for i in _items(msgs)] == [(b"k", b"old")]
    markers = [m for m in msgs if isinstance(m, SnapshotMarker)]
    assert markers[0].end == 1  # max visible seqno, not the prepare's
    sync = a.dcp_producer("sync")
    sync.control("enable_sync_writes", "true")
    sync.stream_request(vbid, 0, flags=0x02)
    assert [i.op for i in _items(_drain(sync))] == [Op.MUTATION, Op.PREPARE]
    assert not sw.done


def test_prepares_and_commits_never_deduplicate(pair) -> None:
    a, _r = pair
    vbid = a.vbucket_of("k")
    ck = a.vbucket(vbid).ckpt
    a.set("k", b"1")
    before = len(ck.checkpoints)
    sw = a.set("k", b"2", durability=MAJ)  # would de-duplicate "1" if it were a plain write
    a.seqno_acknowledged(vbid, "r", sw.prepare_seqno)  # the commit would de-duplicate the prepare
    a.set("k", b"3")  # and this the commit
    assert len(ck.checkpoints) == before + 3
    ops = [(it.op, it.value) for c in ck.checkpoints for it in c.queued_items(ck.vbucket)]
    assert ops == [(Op.MUTATION, b"1"), (Op.PREPARE, b"2"), (Op.MUTATION, b"2"), (Op.MUTATION, b"3")]


def test_replica_acks_only_complete_snapshots(pair: tuple[Bucket, Bucket]) -> None:
    a, r = pair
    vbid = a.vbucket_of("k")
    name = "replication:a->r"
    c = DcpConsumer(name, r, a.dcp_producer(name), consumer_name="r")
    c.add_stream(vbid)
    keys = [k for k in (f"k{i}" for i in range(200)) if a.vbucket_of(k) == vbid][:3]
    sws = [a.set(k, b"v", durability=MAJ) for k in keys]
    # one snapshot [s, s+2] holding three prepares; deliver the marker and one prepare only
    acked: list[int] = []
    orig = a.seqno_acknowledged

    def spy(vbucket: int, node: str, seqno: int) -> int:
        acked.append(seqno)
        return orig(vbucket, node, seqno)

    a.seqno_acknowledged = spy  # type: ignore[method-assign]
    c.step(max_messages=2)
    rv = r.vbucket(vbid)
    assert rv.high_seqno == sws[0].prepare_seqno and rv.snapshot_complete < sws[0].prepare_seqno
    assert all(s < sws[0].prepare_seqno for s in acked)  # a partial snapshot is not acked
    assert not any(sw.done for sw in sws)
    c.drain()
    assert max(acked) >= sws[-1].prepare_seqno
    assert all(sw.committed for sw in sws)


def test_persist_to_majority_waits_for_replica_and_active_persistence(pair) -> None:
    a, r = pair
    vbid = a.vbucket_of("k")
    c = _connect(a, r)
    c.drain()
    sw = a.set("k", b"v", durability=PERSIST_MAJ)
    c.drain()
    assert not sw.done  # replica received it in a complete snapshot but has not persisted it
    a.flush_all()
    assert not sw.done  # the active persisted; the replica's ack still holds back
    r.flush_all()
    c.acknowledge_seqnos()
    assert sw.committed
    # majority_and_persist_to_active: replica in memory is enough, the active must persist
    sw2 = a.set("k2", b"v", durability=PERSIST_ACTIVE, vbucket=None)
    c.drain()
    assert not sw2.done
    a.flush_all()
    assert sw2.committed
    assert vbid == sw.vbucket


def test_batched_replica_acks_equal_the_per_vbucket_ones(pair) -> None:
    """``Bucket.durability_ack_seqnos`` answers for every replica vbucket at once (what a connection's
    ``acknowledge_seqnos`` asks a node process in one hop): the same seqnos as one ``durability_ack_seqno``
    per vbucket, the vbuckets that are not replicas (or do not exist) left out."""
    a, r = pair
    c = _connect(a, r)
    c.drain()
    sws = [a.set(f"k{i}", b"v", durability=PERSIST_MAJ) for i in range(12)]
    c.drain()
    held = r.durability_ack_seqnos(range(NVB))
    assert held == {vb: r.durability_ack_seqno(vb) for vb in range(NVB)}
    a.flush_all()
    r.flush_all()
    moved = r.durability_ack_seqnos([*range(NVB), NVB, -1])
    assert moved == {vb: r.durability_ack_seqno(vb) for vb in range(NVB)}
    assert any(moved[vb] > held[vb] for vb in range(NVB))  # persisting let the persist-level acks move
    assert c.acknowledge_seqnos() == sum(moved[vb] > held[vb] for vb in range(NVB))
    assert all(sw.committed for sw in sws)
    assert c.acknowledge_seqnos() == 0  # nothing moved since
    r.set_vbucket_state(0, VBucketState.ACTIVE)
    assert 0 not in r.durability_ack_seqnos(range(NVB))


def test_persist_level_prepare_is_a_fence_for_later_prepares(pair) -> None:
    a, r = pair
    c = _connect(a, r)
    vbid = a.vbucket_of("k")
    keys = [k for k in (f"f{i}" for i in range(200)) if a.vbucket_of(k) == vbid][:2]
    first = a.set(keys[0], b"1", durability=PERSIST_ACTIVE)
    second = a.set(keys[1], b"2", durability=MAJ)
    c.drain()
    assert not first.done and not second.done  # commits in seqno order: the later one waits
    a.flush_all()
    assert first.committed and second.committed
    assert first.result().seqno < second.result().seqno


def test_vbucket_leaving_active_makes_waiters_ambiguous(pair) -> None:
    a, _r = pair
    sw = a.set("k", b"v", durability=MAJ)
    a.set_vbucket_state(sw.vbucket, VBucketState.DEAD)
    assert sw.state is SyncWriteState.AMBIGUOUS
    with pytest.raises(SyncWriteAmbiguous):
        sw.result()
    assert b"k" in a.vbucket(sw.vbucket).prepares  # not aborted: a new active may still commit it


def test_durable_delete(pair) -> None:
    a, r = pair
    c = _connect(a, r)
    a.set("k", b"v")
    with pytest.raises(KeyNotFound):
        a.delete("missing", durability=MAJ)
    sw = a.delete("k", durability=MAJ)
    assert a.get("k").value == b"v"
    c.drain()
    assert sw.committed
    with pytest.raises(KeyNotFound):
        a.get("k")
    c.drain()
    assert r.vbucket(sw.vbucket).ht[b"k"].op is Op.DELETION


def test_crash_with_prepare_in_flight_reloads_it_and_recommits(tmp_path: Path, clock: ManualClock) -> None:
    a = _bucket(tmp_path / "a", clock)
    vbid = a.vbucket_of("k")
    a.set_replication_topology(vbid, ["a", "r"])
    a.set("k", b"old")
    sw = a.set("k", b"new", durability=MAJ)
    a.flush_all()
    a.close(clean=False)
    a = _bucket(tmp_path / "a", clock)
    try:
        vb = a.vbucket(vbid)
        assert vb.prepares[b"k"].seqno == sw.prepare_seqno and vb.prepares[b"k"].level == Level.MAJORITY
        assert a.get("k").value == b"old"
        with pytest.raises(SyncWriteInProgress):
            a.set("k", b"x")
        clock.advance(3600)
        assert a.process_durability_timeouts() == 0  # no waiter: infinite timeout, never aborted
        a.set_replication_topology(vbid, ["a", "r"])
        a.seqno_acknowledged(vbid, "r", sw.prepare_seqno)
        assert a.get("k").value == b"new" and not vb.prepares
        a.flush_all()
        a.compact()
    finally:
        a.close()
    a = _bucket(tmp_path / "a", clock)
    try:
        assert a.get("k").value == b"new" and not a.vbucket(vbid).prepares
    finally:
        a.close()


def test_compaction_keeps_prepare_in_flight(tmp_path: Path, clock: ManualClock) -> None:
    a = _bucket(tmp_path / "a", clock, tombstone_purge_age_s=0, history_seqnos=0)
    vbid = a.vbucket_of("k")
    a.set_replication_topology(vbid, ["a", "r"])
    sw = a.set("k", b"v", durability=MAJ)
    a.set("other", b"o", vbucket=None)
    for i in range(5):
        a.set(f"z{i}", b"z")
    a.flush_all()
    clock.advance(10)
    a.compact()
    a.close(clean=False)
    a = _bucket(tmp_path / "a", clock)
    try:
        assert b"k" in a.vbucket(vbid).prepares and sw.prepare_seqno == a.vbucket(vbid).prepares[b"k"].seqno
    finally:
        a.close()


def test_replica_rollback_reloads_outstanding_prepares(pair) -> None:
    # kv_engine: a rollback reloads the prepares in flight at the rollback point from disk
    a, r = pair
    vbid = a.vbucket_of("k")
    name = "replication:a->r"
    c = DcpConsumer(name, r, a.dcp_producer(name), consumer_name="r")
    c.add_stream(vbid)
    sw = a.set("k", b"v", durability=PERSIST_MAJ)  # the replica acks only once persisted: no ack sent yet
    c.drain()
    r.flush_all()
    rv = r.vbucket(vbid)
    boundary = rv.snapshot_persisted
    assert boundary == sw.prepare_seqno and b"k" in rv.prepares
    a.flush_all()
    c.acknowledge_seqnos()
    assert sw.committed
    c.drain()  # the commit, in a later snapshot
    r.flush_all()
    assert b"k" not in rv.prepares and rv.ht[b"k"].value == b"v"
    c.close()
    assert r.rollback_vbucket(vbid, boundary) == boundary
    assert rv.prepares[b"k"].seqno == sw.prepare_seqno  # back in flight, from storage
    assert b"k" not in rv.ht
    r.close(clean=False)
    r2 = _bucket(r.config.data_dir, ManualClock(), 2)
    try:
        assert r2.vbucket(vbid).prepares[b"k"].seqno == sw.prepare_seqno
    finally:
        r2.close()


def test_replica_rejects_sync_messages_outside_snapshot(pair) -> None:
    _a, r = pair
    p = Item(b"k", b"v", 0, 5, 1, 1, 0, 0, 0, Op.PREPARE, 0, 1)
    with pytest.raises(InvalidArgument):
        r.apply_replica_message(p)


def test_backfill_chunks_smaller_than_the_hidden_rows_still_send_everything(tmp_path: Path, clock: ManualClock) -> None:
    # regression (campaign): the end of a backfill was judged on the rows left after hiding prepares / aborts
    a = _bucket(tmp_path / "a", clock, backfill_chunk_items=2)
    try:
        vbid = a.vbucket_of("k")
        a.set_replication_topology(vbid, ["a", "r"])
        keys = [k for k in (f"b{i}" for i in range(400)) if a.vbucket_of(k) == vbid][:6]
        for k in keys[:3]:
            sw = a.set(k, b"x", durability=Durability(Level.MAJORITY, 1500))
            clock.advance(2)
            a.process_durability_timeouts()
            assert sw.state is SyncWriteState.ABORTED
        for k in keys[3:]:
            a.set(k, b"visible")
        a.flush_all()
        vb = a.vbucket(vbid)
        vb.ckpt.create_checkpoint()
        vb.ckpt.remove_unreferenced()
        gw = a.dcp_producer("gw")
        gw.stream_request(vbid, 0, flags=0x02)
        assert [i.key.decode() for i in _items(_drain(gw))] == keys[3:]
    finally:
        a.close()


def test_replica_completing_a_prepare_by_a_disk_snapshot_mutation_forgets_it_on_disk(pair) -> None:
    # regression (campaign): a commit received as a plain mutation (backfill) must supersede the prepare row
    a, r = pair
    vbid = a.vbucket_of("k")
    c = _connect(a, r)
    sw = a.set("k", b"v", durability=Durability(Level.MAJORITY, 0xFFFF))
    c.step(max_messages=2)  # marker + prepare only
    r.flush_all()
    assert b"k" in r.vbucket(vbid).prepares
    a.seqno_acknowledged(vbid, "r", sw.prepare_seqno)
    assert sw.committed
    # the commit reaches the replica as the plain mutation a disk snapshot would carry
    commit = a.vbucket(vbid).ht[b"k"]
    rv = r.vbucket(vbid)
    c.close()
    plain = Item(commit.key, commit.value, vbid, commit.seqno + 0, commit.rev_seqno, commit.cas, 0, 0,
                 commit.datatype, Op.MUTATION)
    assert rv.high_seqno < plain.seqno
    r.apply_replica_message(SnapshotMarker(vbid, plain.seqno, plain.seqno, 0x02))  # type: ignore[arg-type]
    r.apply_replica_message(plain)
    assert not rv.prepares
    r.flush_all()
    r.close(clean=False)
    r2 = _bucket(r.config.data_dir, ManualClock(), 2)
    try:
        assert not r2.vbucket(vbid).prepares and r2.vbucket(vbid).ht[b"k"].value == b"v"
    finally:
        r2.close()


def test_promoted_replica_commits_held_prepares_only_once_it_has_a_topology(pair, clock: ManualClock) -> None:
    a, r = pair
    vbid = a.vbucket_of("k")
    c = _connect(a, r)
    sw = a.set("k", b"v", durability=Durability(Level.PERSIST_TO_MAJORITY, 1500))
    c.step(max_messages=2)  # the replica holds it; it acks only once persisted (not sent here)
    r.flush_all()
    a.set_vbucket_state(vbid, VBucketState.DEAD)
    assert sw.state is SyncWriteState.AMBIGUOUS
    c.close()
    r.promote(vbid)
    rv = r.vbucket(vbid)
    assert b"k" in rv.prepares
    other = next(k for k in (f"o{i}" for i in range(400)) if r.vbucket_of(k) == vbid)
    with pytest.raises(DurabilityImpossible):
        r.set(other, b"x", durability=MAJ)
    r.flush_all()
    clock.advance(3600)
    assert r.process_durability_timeouts() == 0 and b"k" in rv.prepares  # never aborted by timeout
    r.set_replication_topology(vbid, ["r"])  # e.g. the replica slot dropped: the promoted copy alone
    assert not rv.prepares and r.get("k").value == b"v"  # re-committed
