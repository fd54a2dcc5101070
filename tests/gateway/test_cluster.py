"""The gateway following an in-process cluster (issue 5 proofs 1 and 2 for the gateway, plus rollback
mitigation): hard and graceful failover while publishing into a real broker, read back by the rollback-aware
Replicator (connectors/) and by the reference TopicReplica; every partition keeps the record-format invariants."""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest

from engine import DcpProducer, EngineError
from gateway.invariants import check_partition
from schemas.records import DecodedRecord, RecordType
from tests.gateway.kafka_util import TopicReplica
from tests.harness import CLUSTER_NVB as NVB
from tests.harness import ClusterHarness


def _rollbacks(recs: list[tuple[int, int, DecodedRecord]]) -> list[DecodedRecord]:
    return [r for _p, _o, r in recs if r.type is RecordType.ROLLBACK]


def test_hard_failover_with_lagging_replicas_publishes_rollbacks_and_consumers_converge(cluster_harness) -> None:
    h: ClusterHarness = cluster_harness(rollback_mitigation=False)
    c = h.cluster
    h.write(300)
    h.settle()
    victim = "n1"
    mine = c.vbucket_map().vbuckets_of(victim, slot=0)
    # newest items: on the victim's actives, published from memory, only partly replicated
    h.write(300)
    c.pump(rounds=1, max_messages=3)
    h.publish()
    behind = []
    for vb in mine:
        active = c.nodes[victim].bucket.vbucket(vb)  # type: ignore[union-attr]
        rep = c.nodes[c.vbucket_map().replicas(vb)[0]].bucket.vbucket(vb)  # type: ignore[union-attr]
        if rep.snapshot_complete < active.high_seqno <= h.pub.sent[vb].seqno:
            behind.append(vb)
    assert behind, "the replicas must lack items the gateway already published"
    old_uuids = {vb: c.nodes[victim].bucket.failover_log(vb)[0].vbuuid for vb in mine}  # type: ignore[union-attr]
    c.kill(victim)
    report = c.failover(victim)
    assert set(report.promoted) == set(mine) and not report.lost
    for vb in mine:
        entry = report.entries[vb]
        assert entry is not None and entry.vbuuid != old_uuids[vb]  # promotion: a new branch
    h.write(200)
    h.settle()
    assert h.pub.following() == {vb: c.vbucket_map().active(vb) for vb in range(NVB)}
    recs = h.check()
    rbs = _rollbacks(recs)
    assert {r.vbucket for r in rbs} >= set(behind)
    for r in rbs:
        # rolled back to the new branch point (or below it), with the new active's log
        assert r.failover_log is not None and r.failover_log[0].vbuuid == report.entries[r.vbucket].vbuuid  # type: ignore[union-attr]
        assert r.seqno <= report.entries[r.vbucket].seqno  # type: ignore[union-attr]
    assert h.pub.rollbacks == len(rbs)
    with h.replicate() as rep:
        assert rep.rollbacks, "the Replicator was told to roll back"
        assert rep.docs() == h.actives()


def test_graceful_failover_under_writes_loses_and_duplicates_nothing(cluster_harness) -> None:
    h: ClusterHarness = cluster_harness(rollback_mitigation=False)
    c = h.cluster
    report = None
    for step in range(30):
        h.write(20)
        c.pump(rounds=1, max_messages=16)
        for _ in range(3):
            h.pub.pump()
        if step == 12:
            report = c.failover("n2", graceful=True)
    assert report is not None and report.graceful and report.promoted
    assert all(e is None for e in report.entries.values())  # takeover: no new branch
    h.settle()
    recs = h.check()
    assert not _rollbacks(recs)
    data = Counter((r.vbucket, r.vbuuid, r.seqno) for _p, _o, r in recs if r.is_data)
    assert not [k for k, n in data.items() if n > 1], "a data record was published twice"
    ends = [r for _p, _o, r in recs if r.type is RecordType.STREAM_END]
    assert {r.vbucket for r in ends} == set(report.promoted)  # STATE_CHANGED ended the moved streams
    assert h.pub.following() == {vb: c.vbucket_map().active(vb) for vb in range(NVB)}
    with h.replicate() as rep:
        assert not rep.rollbacks
        assert rep.docs() == h.actives()


@pytest.mark.parametrize("mitigation", [False, True])
def test_every_moved_vbucket_gets_its_stream_end_when_a_round_steps_few_messages(cluster_harness,
                                                                                 mitigation: bool) -> None:
    """A graceful failover ends every stream of the old active (STATE_CHANGED); the publisher steps a connection
    ``max_messages`` at a time, and must not detach the moved vbuckets with their stream ends still queued on the
    live connection (with 1024 vbuckets, those past the service loop's 256 got no stream-end record)."""
    h: ClusterHarness = cluster_harness(rollback_mitigation=mitigation)
    c = h.cluster
    h.write(200)
    h.settle()
    report = c.failover("n2", graceful=True)
    assert len(report.promoted) >= 2
    for _ in range(50):
        h.pub.pump(max_messages=1)
    h.settle()
    recs = h.check()
    ends = [r for _p, _o, r in recs if r.type is RecordType.STREAM_END]
    assert {r.vbucket for r in ends} == set(report.promoted)
    assert h.pub.following() == {vb: c.vbucket_map().active(vb) for vb in range(NVB)}
    with h.replicate() as rep:
        assert rep.docs() == h.actives()


def test_rollback_mitigation_publishes_only_what_every_replica_persisted(cluster_harness) -> None:
    h: ClusterHarness = cluster_harness(rollback_mitigation=True)
    c = h.cluster
    h.write(300)
    h.settle()
    victim = "n0"
    mine = c.vbucket_map().vbuckets_of(victim, slot=0)
    # caught-up replicas: everything is published
    h.write(100)
    h.settle()
    assert h.pub.held == 0
    # then items the replicas never get: held back, not published
    h.write(200)
    h.publish()
    assert h.pub.held > 0
    for vb in mine:
        high = c.nodes[victim].bucket.vbucket(vb).high_seqno  # type: ignore[union-attr]
        rep = c.nodes[c.vbucket_map().replicas(vb)[0]].bucket.vbucket(vb)  # type: ignore[union-attr]
        assert h.pub.sent[vb].seqno <= rep.snapshot_persisted <= high
    c.kill(victim)
    c.failover(victim)
    h.write(100)
    h.settle()
    recs = h.check()
    assert not _rollbacks(recs) and h.pub.rollbacks == 0
    with h.replicate() as rep:
        assert not rep.rollbacks
        assert rep.docs() == h.actives()


def test_rollback_mitigation_merges_the_snapshots_the_replicas_persisted_together(cluster_harness) -> None:
    """Cluster mode: writes trickle in, the publisher steps after each (a snapshot per step and vbucket), held
    while the replicas have not persisted them; replication then catches up and each vbucket's held snapshots
    are released together and published merged (gateway/snapshot_merge.py) -- no key twice in a published
    snapshot, every DCP byte buffer-acknowledged, the topic equal to the actives."""
    h: ClusterHarness = cluster_harness(rollback_mitigation=True)
    h.settle()
    for _ in range(60):
        h.write(1)
        h.pub.pump()
    assert h.pub.held > 0
    h.settle()
    assert h.pub.held == 0 and h.pub.snapshots_merged > 0
    recs = h.check()
    data = [r for _p, _o, r in recs if r.is_data]
    for r in (r for _p, _o, r in recs if r.type is RecordType.SNAPSHOT):
        keys = [d.key for d in data if d.vbucket == r.vbucket and d.vbuuid == r.vbuuid
                and r.snap_start <= d.seqno <= r.snap_end]
        assert len(keys) == len(set(keys))
    producers = h.pub.source.producers()
    assert all(isinstance(p, DcpProducer) and p.unacked_bytes == 0 for p in producers) and producers


def test_node_down_then_back_without_failover_waits_then_rolls_back_what_it_lost(cluster_harness) -> None:
    h: ClusterHarness = cluster_harness(rollback_mitigation=False)
    c = h.cluster
    h.write(200)
    h.settle()
    victim = "n0"
    mine = set(c.vbucket_map().vbuckets_of(victim, slot=0))
    h.write(200)
    h.publish()  # published from memory; the victim never flushes them
    c.kill(victim)
    for _ in range(20):
        h.pub.pump()  # its vbuckets wait: the map still names the dead node (writes answer TMPFAIL)
    assert set(h.pub.following()) == set(range(NVB)) - mine
    c.restart(victim)  # warmup after a crash: a new branch at the persisted seqno of each active vbucket
    h.write(100)
    h.settle()
    assert h.pub.following() == {vb: c.vbucket_map().active(vb) for vb in range(NVB)}
    recs = h.check()
    assert {r.vbucket for r in _rollbacks(recs)} == mine
    with h.replicate() as rep:
        assert rep.docs() == h.actives()


def test_a_position_holding_only_a_marker_requests_from_its_last_complete_snapshot() -> None:
    from gateway.resume import PublishPosition

    # A failover can end a stream between a snapshot marker and its first item: the position then holds
    # nothing of that snapshot, and its range would make the re-request ERANGE (start < snap_start).
    p = PublishPosition(3)
    p.on_snapshot(1, 10)
    p.on_data(10)
    p.on_snapshot(12, 15)
    args = p.request_args()
    assert (args["start_seqno"], args["snap_start"], args["snap_end"]) == (10, 10, 10)
    p.on_data(12)
    args = p.request_args()
    assert (args["start_seqno"], args["snap_start"], args["snap_end"]) == (12, 12, 15)


#: GATEWAY_CLUSTER_SCHEDULES=N runs N schedules (default 4: both shapes, mitigation off and on)
_SHAPES = [(3, 1, False), (3, 1, True), (4, 2, False), (4, 2, True)]
_SCHEDULES = [(seed, *_SHAPES[(seed - 1) % 4])
              for seed in range(1, 1 + int(os.environ.get("GATEWAY_CLUSTER_SCHEDULES", "4")))]


@pytest.mark.parametrize(("seed", "nodes", "replicas", "mitigation"), _SCHEDULES)
def test_random_failure_schedules_keep_consumers_equal_to_the_actives(
        cluster_harness, seed: int, nodes: int, replicas: int, mitigation: bool) -> None:
    """Random schedules of writes, partial replication, node flushes, publisher pumps, crashes, restarts and
    hard / graceful failovers. After the last step the topic keeps every invariant, a rollback-aware consumer
    equals the actives (vbuckets that kept an active copy), and with mitigation no rollback record was ever
    needed."""
    rnd = random.Random(seed)
    h: ClusterHarness = cluster_harness(nodes=nodes, replicas=replicas, rollback_mitigation=mitigation)
    c = h.cluster
    counts: Counter[str] = Counter()
    for _step in range(60):
        op = rnd.random()
        vbmap = c.vbucket_map()
        live = [n for n in vbmap.nodes if c.nodes[n].up]
        if op < 0.35:
            for i in range(rnd.randint(5, 40)):
                try:
                    h.cluster.write(f"r{rnd.randint(0, 120)}", f'{{"s": {_step}, "i": {i}}}'.encode())
                except EngineError:
                    counts["refused"] += 1
        elif op < 0.55:
            c.pump(rounds=rnd.randint(1, 3), max_messages=rnd.randint(1, 20), flush=rnd.random() < 0.5)
        elif op < 0.65 and live:
            c.nodes[rnd.choice(live)].bucket.flush_all()  # type: ignore[union-attr]
        elif op < 0.85:
            for _ in range(rnd.randint(1, 5)):
                h.pub.pump()
        elif op < 0.90 and len(live) > 1:
            c.kill(rnd.choice(live))
            counts["kill"] += 1
        elif op < 0.94:
            down = [n for n in vbmap.nodes if not c.nodes[n].up]
            if down:
                c.restart(rnd.choice(down))
                counts["restart"] += 1
        elif len(vbmap.nodes) > 2:
            victim = rnd.choice(vbmap.nodes)
            graceful = rnd.random() < 0.5
            try:
                c.failover(victim, graceful=graceful)
                counts["graceful" if graceful else "hard"] += 1
            except EngineError:
                counts["failover_refused"] += 1
    for n in c.vbucket_map().nodes:
        if not c.nodes[n].up:
            c.restart(n)
    h.settle()
    recs = h.records()
    for part in range(h.partitions):
        check_partition([(o, r) for p, o, r in recs if p == part])
    with_active = {vb for vb in range(NVB) if c.vbucket_map().active(vb) is not None}
    replica = TopicReplica()
    replica.apply_all(recs)
    assert {k: v for k, v in replica.state().items() if v[1] in with_active} == h.actives()
    if mitigation:
        assert not _rollbacks(recs), counts
    print(seed, dict(counts), "rollback records:", len(_rollbacks(recs)))
