"""Synchronous replication on the in-process cluster (sync-replication proof 2, engine side; docs/durability.md "What survives what"): an acknowledged MAJORITY
write survives hard failover of its active (the promoted prepare is re-committed, never aborted by timeout); a
timed-out write is ambiguous and never half-visible; a 1-replica chain after failover cannot meet a majority."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cluster.local import Cluster
from engine.exceptions import DurabilityImpossible, KeyNotFound, SyncWriteAmbiguous, SyncWriteInProgress
from engine.kv.durability import Durability, Level, ManualClock, SyncWriteState
from tests.engine.cluster_model import ClusterClient, actives_state, assert_replicas_equal_actives

NVB = 8
MAJ = Durability(Level.MAJORITY)


def _cluster(tmp: Path, replicas: int, clock: ManualClock) -> Cluster:
    return Cluster.create(tmp / "c", nodes=3, replicas=replicas, num_vbuckets=NVB, seed=3, clock=clock)


def test_write_with_each_level_commits_and_replicates(tmp_path: Path) -> None:
    clock = ManualClock()
    with _cluster(tmp_path, 2, clock) as c:
        for i, level in enumerate(Level):
            res = c.write(f"k{i}", f"v{i}".encode(), durability=Durability(level))
            assert c.get(f"k{i}").value == f"v{i}".encode()
            assert c.get(f"k{i}").seqno == res.seqno
        c.delete("k1", durability=MAJ)
        with pytest.raises(KeyNotFound):
            c.get("k1")
        c.settle()
        assert_replicas_equal_actives(c)


def test_a_pump_round_flushes_the_commits_it_made_possible_in_the_next_round(tmp_path: Path) -> None:
    """docs/durability.md "Flushing": the round whose flush makes a MAJORITY_AND_PERSIST_TO_ACTIVE prepare durable
    commits it (the waiter completes) but leaves the commit queued -- counted as movement -- and the next round
    persists it with that round's prepares; ``settle()`` ends with everything persisted on every node."""
    clock = ManualClock()
    with _cluster(tmp_path, 1, clock) as c:
        c.settle()
        sw = c.submit("k", b"v", durability=Durability(Level.MAJORITY_AND_PERSIST_TO_ACTIVE))
        name = c.vbucket_map().chains[sw.vbucket][0]
        assert name is not None
        active = c.nodes[name].require_bucket()
        vb = active.vbucket(sw.vbucket)
        assert c.pump(rounds=1) > 0
        assert sw.committed  # the prepare reached the replica and was persisted on the active
        assert vb.persisted_seqno == sw.prepare_seqno < vb.high_seqno  # the commit is not persisted yet
        assert active.dirty_vbuckets == 1
        assert c.pump(rounds=1) > 0  # it is sent to the replica and persisted
        assert vb.persisted_seqno == vb.high_seqno
        c.settle()
        for node in c.nodes.values():
            b = node.require_bucket()
            assert b.dirty_vbuckets == 0
            assert all(b.vbucket(v).persisted_seqno == b.vbucket(v).high_seqno for v in range(NVB))
        assert_replicas_equal_actives(c)


def test_acked_majority_write_survives_hard_failover_of_its_active(tmp_path: Path) -> None:
    clock = ManualClock()
    with _cluster(tmp_path, 2, clock) as c:
        c.settle()
        key = "durable"
        vb = c.vbucket_of(key)
        a, r1, r2 = c.vbucket_map().chains[vb]
        assert a and r1 and r2
        sw = c.submit(key, b"acked", durability=MAJ)
        # only a -> r1 moves: the prepare reaches r1, r1 acks, the active commits (majority 2 of 3)
        c.pump(only=[(a, r1)], flush=False)
        assert sw.committed
        assert c.get(key).value == b"acked"
        r1vb = c.node(r1).require_bucket().vbucket(vb)
        assert b"durable" in r1vb.prepares and b"durable" not in r1vb.ht  # the commit never left the active
        c.kill(a)
        report = c.failover(a)
        assert report.promoted[vb] == r1
        c.settle()  # r2 streams from r1, acks the prepare; r1 re-commits it (infinite timeout, never aborted)
        assert c.get(key).value == b"acked"
        new = c.node(r1).require_bucket().vbucket(vb)
        assert not new.prepares and new.durability is not None and new.durability.aborts == 0
        assert_replicas_equal_actives(c)


def test_one_replica_chain_after_failover_is_impossible_and_keeps_the_prepare(tmp_path: Path) -> None:
    clock = ManualClock()
    with _cluster(tmp_path, 1, clock) as c:
        c.settle()
        key = "durable"
        vb = c.vbucket_of(key)
        a, r = c.vbucket_map().chains[vb]
        assert a and r
        sw = c.submit(key, b"acked", durability=MAJ)
        c.pump(only=[(a, r)], flush=False)
        assert sw.committed
        c.kill(a)
        c.failover(a)
        c.settle()
        new = c.node(r).require_bucket().vbucket(vb)
        # chain [r, None]: majority 2, one defined node -> the promoted prepare waits (kv_engine: until a
        # rebalance refills the slot); it is neither lost nor visible, nor aborted by timeout
        assert new.prepares[b"durable"].value == b"acked"
        clock.advance(3600)
        c.pump()
        assert b"durable" in new.prepares
        with pytest.raises(SyncWriteInProgress):
            c.write(key, b"other")
        with pytest.raises(DurabilityImpossible):
            c.write("fresh" if c.vbucket_of("fresh") == vb else key + "x", b"v", durability=MAJ)


def test_timed_out_write_is_ambiguous_and_never_half_visible(tmp_path: Path) -> None:
    clock = ManualClock()
    with _cluster(tmp_path, 2, clock) as c:
        c.settle()
        client = ClusterClient(c, "gateway-like")
        client.poll()
        key = "late"
        vb = c.vbucket_of(key)
        a = c.vbucket_map().chains[vb][0]
        assert a
        c.write(key, b"before")
        sw = c.submit(key, b"timed-out", durability=Durability(Level.MAJORITY, 1500))
        c.pump(only=[], flush=True)  # nothing replicates
        clock.advance(1.5)
        c.pump(only=[])
        assert sw.state is SyncWriteState.ABORTED
        with pytest.raises(SyncWriteAmbiguous):
            sw.result()
        c.settle()
        client.poll()
        assert c.get(key).value == b"before"
        assert client.state() == actives_state(c)
        assert client.state()[key.encode()][0] == b"before"
        assert_replicas_equal_actives(c)
        # a write whose active is failed over before it completes is ambiguous too -- and all or nothing
        sw2 = c.submit(key, b"in-flight", durability=MAJ)
        c.kill(a)
        c.failover(a)
        assert sw2.state in (SyncWriteState.PENDING, SyncWriteState.AMBIGUOUS)
        c.settle()
        client.poll()
        assert c.get(key).value == b"before"  # the prepare never left the dead active
        assert client.state() == actives_state(c)


def test_wait_jumps_a_manual_clock_to_the_deadline(tmp_path: Path) -> None:
    clock = ManualClock()
    with _cluster(tmp_path, 2, clock) as c:
        c.settle()
        key = "k"
        vb = c.vbucket_of(key)
        _a, r1, r2 = c.vbucket_map().chains[vb]
        assert r1 and r2
        c.kill(r1)
        c.kill(r2)
        start = clock()
        with pytest.raises(SyncWriteAmbiguous):
            c.write(key, b"v", durability=Durability(Level.MAJORITY, 2000))
        assert clock() - start == pytest.approx(2.0)
        with pytest.raises(KeyNotFound):
            c.get(key)
