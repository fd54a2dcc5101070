"""Regression (docs/durability.md "Storage, warmup, rollback, failover"): a replica that persisted a prepare, crashed,
and then received the prepare's abort from a disk backfill (a DCP_ABORT that carries no prepared seqno: the
storage keeps none for an abort) must supersede the prepare on disk -- else its next warmup reloads the
aborted prepare and the replica tracks a prepare its active no longer has (kv_engine PassiveDurabilityMonitor:
an abort completes the prepare the replica tracks for its key). Shrunk from the hypothesis campaign of
test_durability_properties.py."""

from __future__ import annotations

from pathlib import Path

from engine.cluster.local import Cluster
from engine.kv.durability import Durability, Level, ManualClock


def test_abort_from_disk_backfill_supersedes_the_replicas_persisted_prepare(tmp_path: Path) -> None:
    clock = ManualClock()
    c = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=8, seed=11, clock=clock,
                       checkpoint_max_items=3, backfill_chunk_items=2)
    try:
        vb = c.vbucket_of("k")
        active, replica = c.vbucket_map().chains[vb]
        assert active is not None and replica is not None
        sw = c.submit("k", b"v", durability=Durability(Level.MAJORITY, 0))
        clock.advance(12.0)
        c.process_durability_timeouts()  # no replica acked: the prepare is aborted on the active
        assert sw.done and not sw.committed
        c.pump(only=[(active, replica)], max_messages=2, flush=False)  # the replica gets the prepare only
        rb = c.nodes[replica].bucket
        assert rb is not None
        assert set(rb.vbucket(vb).prepares) == {b"k"}
        rb.flush_all()  # ... and persists it
        c.kill(replica)
        c.pump(only=[], flush=True)  # the active persists the abort: its checkpoint no longer holds it
        c.restart(replica)  # warmup reloads the persisted prepare; the abort comes from a disk backfill
        c.settle()
        rb = c.nodes[replica].bucket
        assert rb is not None
        assert rb.vbucket(vb).prepares == {}
        c.kill(replica)  # the next warmup must not reload the aborted prepare
        c.restart(replica)
        c.settle()
        rb = c.nodes[replica].bucket
        assert rb is not None
        assert rb.vbucket(vb).prepares == {}
        ab = c.active_bucket(vb)
        assert ab.vbucket(vb).prepares == {}
        assert rb.vbucket(vb).high_seqno == ab.vbucket(vb).high_seqno
    finally:
        c.close()


def test_campaign_counts_crashes_since_submit_for_in_memory_levels(tmp_path: Path) -> None:
    """The campaign's model (docs/durability.md "What survives what"): a replica's seqno-ack stays counted when the
    replica then crashes (kv_engine's active durability monitor keeps a chain node's ack until the topology
    changes), so a MAJORITY_AND_PERSIST_TO_ACTIVE write is committed -- acknowledged to the client -- on the
    active's flush *after* its replica crashed, and a failover of the active then loses it: not guaranteed,
    since the memory of the replica that acked is gone. Shrunk from the campaign (seed 7)."""
    from tests.engine.cluster.sync_write_schedules import Harness

    h = Harness(tmp_path, 3, 1)
    h.run([("sync", 1, 0), ("sync", 1, 0), ("sync", 2, 0), ("pump", 2, 2, False), ("crash", 2), ("pump_all",),
           ("restart", 2), ("hard_failover", 0, False)])
    value, level, crashes_at_submit = h.acked[b"s3"]
    assert (value, level, crashes_at_submit, h.crashes) == (b"v3", 2, 0, 1)
