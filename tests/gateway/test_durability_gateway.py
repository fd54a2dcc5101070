"""Sync-replication proof 2 (docs/durability.md "What survives what") with the gateway publishing to Kafka: a MAJORITY write acknowledged to the client survives
hard failover of its active -- in the new active, in Kafka (read back by the reference TopicReplica) and in
``connectors.replicate.Replicator``'s replica; timed-out writes are ambiguous and never half-visible: readers,
Kafka and the Replicator see all of such a write or none of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.exceptions import KeyNotFound
from engine.kv.durability import Durability, Level, ManualClock, SyncWriteState
from gateway.broker import Broker
from schemas.records import RecordType
from tests.harness import CLUSTER_NVB as NVB
from tests.harness import ClusterHarness


def _keys_on(h: ClusterHarness, vbs: set[int], prefix: str, n: int) -> list[str]:
    out = [k for k in (f"{prefix}{i}" for i in range(5000)) if h.cluster.vbucket_of(k) in vbs]
    return out[:n]


def test_acked_majority_write_survives_failover_in_kafka_and_replicator(kafka_broker: Broker, tmp_path: Path) -> None:
    h = ClusterHarness(kafka_broker, tmp_path / "c", replicas=2, rollback_mitigation=False)
    try:
        c = h.cluster
        clock = ManualClock()
        c.clock = clock
        for node in c.nodes.values():
            bucket = node.require_bucket()
            bucket.clock = clock
            for vb in bucket.vbuckets():
                vb.clock = clock
        h.write(60)
        h.settle()
        victim = "n1"
        mine = set(c.vbucket_map().vbuckets_of(victim, slot=0))
        ka, kb, kc = _keys_on(h, mine, "dur", 3)
        vba, vbb = c.vbucket_of(ka), c.vbucket_of(kb)
        r1a = c.vbucket_map().chains[vba][1]
        r1b = c.vbucket_map().chains[vbb][1]
        assert r1a and r1b
        # A: majority, acknowledged once the first replica acked (the commit stays on the victim)
        a = c.submit(ka, b'{"w": "A"}', durability=Durability(Level.MAJORITY))
        c.pump(only=[(victim, r1a)], flush=False)
        assert a.committed
        h.publish()  # the gateway publishes the commit from the victim's memory
        published = {r.key for _p, _o, r in h.records() if r.type is RecordType.MUTATION}
        assert ka.encode() in published
        # B: persist_to_majority; its prepare reaches a replica, nobody persists it, it times out
        b = c.submit(kb, b'{"w": "B"}', durability=Durability(Level.PERSIST_TO_MAJORITY, 1500))
        c.pump(only=[(victim, r1b)], flush=False)
        assert not b.done
        # C: majority; its prepare reaches nobody, it times out
        cc = c.submit(kc, b'{"w": "C"}', durability=Durability(Level.MAJORITY, 1500))
        clock.advance(2.0)
        c.node(victim).require_bucket().process_durability_timeouts()
        assert b.state is SyncWriteState.ABORTED and cc.state is SyncWriteState.ABORTED
        h.publish()
        published = {r.key for _p, _o, r in h.records() if r.is_data}
        assert kb.encode() not in published and kc.encode() not in published  # prepares / aborts never sent
        for k in (kb, kc):
            with pytest.raises(KeyNotFound):
                c.get(k)  # readers never saw them either
        c.kill(victim)
        report = c.failover(victim)
        assert not report.lost and mine <= set(report.promoted)
        h.write(30, prefix="after")
        h.settle()
        # A survived; B's prepare was on the promoted replica: re-committed whole (the ambiguous outcome);
        # C's never left the victim: gone whole
        assert c.get(ka).value == b'{"w": "A"}'
        assert c.get(kb).value == b'{"w": "B"}'
        with pytest.raises(KeyNotFound):
            c.get(kc)
        assert h.pub.following() == {vb: c.vbucket_map().active(vb) for vb in range(NVB)}
        h.check()  # record invariants on every partition; Kafka's replica equals the actives
        with h.replicate() as rep:
            docs = rep.docs()
            assert docs == h.actives()
            assert ka.encode() in docs and kb.encode() in docs and kc.encode() not in docs
    finally:
        h.close()
