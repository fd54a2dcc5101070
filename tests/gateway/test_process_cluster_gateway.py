"""The gateway following a cluster of engine node *processes* (engine/network/process_cluster.py): DCP over TCP, nodes
killed with SIGKILL, hard and graceful failover, a real broker; read back by the rollback-aware Replicator
(connectors/) and the reference TopicReplica; every partition keeps the record-format invariants (issue 5 proofs 1
and 2 with separate processes; docs/gateway-cluster.md "Process clusters")."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import KeyNotFound
from engine.cluster.rebalance import RebalanceProgress
from engine.network.process_cluster import ProcessCluster
from gateway.broker import Broker
from gateway.publisher import Publisher
from gateway.resume import ensure_topics, recover_positions
from gateway.source import ProcessClusterSource
from schemas.codec import RecordEncoder
from schemas.records import DecodedRecord, RecordType, ValueFormat
from tests.engine.process_model import BackgroundWriter, actives_state
from tests.gateway.kafka_util import TopicChecks
from tests.harness import harnesses, producer_conf

pytestmark = pytest.mark.slow

NVB = 8
#: small checkpoints: the victim's newest items span several snapshots
CFG: dict[str, Any] = {"checkpoint_max_items": 5}

Records = list[tuple[int, int, DecodedRecord]]


class ProcessHarness(TopicChecks):
    """Three node processes, one replica, one gateway publisher following the map into a fresh topic."""

    def __init__(self, broker: Broker, tmp: Path, *, nodes: int = 3, replicas: int = 1, **pub_kw: Any) -> None:
        self.broker = broker
        self.tmp = tmp
        self.pub: Publisher | None = None
        self.cluster = ProcessCluster.start(tmp / "cluster", nodes=nodes, replicas=replicas, num_vbuckets=NVB,
                                            **CFG)
        try:
            self.client = {"bootstrap.servers": broker.bootstrap_servers}
            self.topic = f"dcp.pc{uuid.uuid4().hex[:10]}"
            self.partitions = ensure_topics(self.client, self.topic, NVB)
            positions = recover_positions(self.client, self.topic, self.partitions, NVB)
            self.pub = Publisher(self.cluster, producer_conf(broker), self.topic, self.partitions,
                                 RecordEncoder(ValueFormat.AVRO), positions, **pub_kw)
            self.pub.open()
        except BaseException:
            self.close()
            raise
        assert isinstance(self.pub.source, ProcessClusterSource)
        self.written = 0
        self.keys: set[str] = set()

    @property
    def publisher(self) -> Publisher:
        assert self.pub is not None
        return self.pub

    def write(self, n: int, prefix: str = "k") -> None:
        """``n`` writes through the map (every fifth key of the batch is deleted again)."""
        c = self.cluster
        for i in range(self.written, self.written + n):
            key = f"{prefix}{i % 150}"
            c.write(key, f'{{"n": {i}}}'.encode())
            if i % 5 == 0:
                c.delete(key)
            self.keys.add(key)
        self.written += n

    def highs(self) -> dict[int, int]:
        """High seqno of every vbucket whose active node is up (asked over TCP)."""
        c = self.cluster
        out: dict[int, int] = {}
        for vb in range(NVB):
            name = c.vbucket_map().active(vb)
            if name is not None and c.node(name).up:
                out[vb] = c.client(name).vbucket_info(vb).high_seqno
        return out

    def publish(self, timeout: float = 20.0) -> None:
        """Pump until every live active's high seqno is published, nothing is held and Kafka acknowledged
        everything (replication runs in the nodes on their own meanwhile)."""
        pub = self.publisher
        deadline = time.monotonic() + timeout
        while True:
            for _ in range(20):
                pub.pump()
            highs = self.highs()
            if (pub.inflight == 0 and pub.held == 0
                    and all(vb in pub.streaming and pub.sent[vb].seqno >= h for vb, h in highs.items())):
                return
            assert time.monotonic() < deadline, (
                f"publisher never caught up: held={pub.held} inflight={pub.inflight} "
                f"behind={ {vb: (pub.sent[vb].seqno, h) for vb, h in highs.items() if pub.sent[vb].seqno < h} } "
                f"streaming={sorted(pub.streaming)}")
            pub.kafka.poll(0.01)

    def pump_for(self, seconds: float) -> None:
        pub = self.publisher
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pub.pump()

    def actives(self) -> dict[bytes, tuple[bytes, int]]:
        """Every live document, read from the actives: a fresh DCP reader over TCP, cross-checked with a GET
        of every key ever written (routed by the map to the active node)."""
        c = self.cluster
        state = actives_state(c)
        by_get: dict[bytes, tuple[bytes, int]] = {}
        for key in sorted(self.keys):
            try:
                by_get[key.encode()] = (c.get(key).value, c.vbucket_of(key))
            except KeyNotFound:
                continue
        assert by_get == state
        return state

    def following_the_map(self) -> bool:
        vbmap = self.cluster.vbucket_map()
        return self.publisher.following() == {vb: vbmap.active(vb) for vb in range(NVB)}

    def close(self) -> None:
        """Close the publisher, then SIGKILL every node process (also after a failed test)."""
        try:
            if self.pub is not None:
                self.pub.close(timeout=5)
        finally:
            self.cluster.close(clean=False)


@pytest.fixture
def process_harness(kafka_broker: Broker, tmp_path: Path) -> Iterator[Callable[..., ProcessHarness]]:
    made: list[ProcessHarness] = []
    with harnesses(kafka_broker, tmp_path, ProcessHarness, prefix="c") as make:
        def track(**kw: Any) -> ProcessHarness:
            made.append(make(**kw))
            return made[-1]

        yield track
    for h in made:
        assert not any(n.up for n in h.cluster.nodes.values()), "a node process survived the test"


def _rollbacks(recs: Records) -> list[DecodedRecord]:
    return [r for _p, _o, r in recs if r.type is RecordType.ROLLBACK]


def test_sigkill_and_hard_failover_with_lagging_replicas(process_harness) -> None:
    h: ProcessHarness = process_harness(rollback_mitigation=False)
    c = h.cluster
    pub = h.publisher
    h.write(200)
    c.settle()
    h.publish()
    victim = "n1"
    mine = c.vbucket_map().vbuckets_of(victim, slot=0)
    # The replicas stop receiving: the victim's newest items exist on it only, and the gateway publishes them.
    c.pause_replication()
    h.write(200)
    h.publish()
    behind = []
    for vb in mine:
        active = c.client(victim).vbucket_info(vb)
        rep = c.client(c.vbucket_map().replicas(vb)[0]).vbucket_info(vb)
        if rep.snapshot_complete < active.high_seqno <= pub.sent[vb].seqno:
            behind.append(vb)
    assert behind, "the replicas must lack items the gateway already published"
    old_uuids = {vb: c.failover_entry(victim, vb).vbuuid for vb in mine}
    pid = c.node(victim).pid
    c.kill(victim)  # SIGKILL
    assert pid is not None and not c.node(victim).up
    report = c.failover(victim)
    c.resume_replication()
    assert set(report.promoted) == set(mine) and not report.lost
    for vb in mine:
        entry = report.entries[vb]
        assert entry is not None and entry.vbuuid != old_uuids[vb]  # promotion: a new branch
    h.write(100)
    c.settle()
    h.publish()
    assert h.following_the_map()
    recs = h.check()
    rbs = _rollbacks(recs)
    assert {r.vbucket for r in rbs} >= set(behind)
    assert {r.vbucket for r in rbs} <= set(mine)
    for r in rbs:
        entry = report.entries[r.vbucket]
        assert entry is not None
        # rolled back to the new branch point (or below it), with the new active's log
        assert r.failover_log is not None and r.failover_log[0].vbuuid == entry.vbuuid
        assert r.seqno <= entry.seqno
    assert pub.rollbacks == len(rbs)
    with h.replicate() as rep:
        assert rep.rollbacks, "the Replicator was told to roll back"
        assert rep.docs() == h.actives()
    print(f"\nhard failover after SIGKILL: {len(behind)} of {len(mine)} vbuckets behind, {len(rbs)} rollback "
          f"records, {pub.restreams} re-streams")


def test_graceful_failover_under_writes_no_rollback_no_duplicate(process_harness) -> None:
    h: ProcessHarness = process_harness(rollback_mitigation=False)
    c = h.cluster
    with BackgroundWriter(c, "w", 96) as w:
        acked = w.acked
        h.pump_for(1.0)
        assert len(acked) >= 50
        report = c.failover("n2", graceful=True)  # the writer goes on while the replicas catch up
        n = len(acked)
        h.pump_for(1.0)
    assert not w.errors, w.errors
    assert len(acked) >= n
    h.keys.update(acked)
    assert report.graceful and report.promoted
    assert all(e is None for e in report.entries.values())  # takeover: no new branch
    c.settle()
    h.publish()
    assert h.following_the_map()
    recs = h.check()
    assert not _rollbacks(recs) and h.publisher.rollbacks == 0
    data = Counter((r.vbucket, r.vbuuid, r.seqno) for _p, _o, r in recs if r.is_data)
    assert not [k for k, n in data.items() if n > 1], "a data record was published twice"
    ends = [r for _p, _o, r in recs if r.type is RecordType.STREAM_END]
    assert {r.vbucket for r in ends} == set(report.promoted)  # STATE_CHANGED ended the moved streams
    expected = h.actives()
    assert {k.decode(): v for k, (v, _vb) in expected.items()} == acked  # nothing acknowledged was lost
    with h.replicate() as rep:
        assert not rep.rollbacks
        assert rep.docs() == expected
    print(f"\ngraceful failover under writes: {len(acked)} keys, {w.refused} writes refused, "
          f"{c.graceful_reactivations} vbuckets re-activated, {len(data)} data records")


def test_mitigation_hard_failover_after_catch_up_publishes_no_rollback(process_harness) -> None:
    h: ProcessHarness = process_harness(rollback_mitigation=True)
    c = h.cluster
    pub = h.publisher
    h.write(200)
    c.settle()
    h.publish()
    assert pub.held == 0
    victim = "n0"
    mine = c.vbucket_map().vbuckets_of(victim, slot=0)
    # Then items the replicas never get: held back, never published.
    c.pause_replication()
    h.write(150)
    highs = h.highs()
    deadline = time.monotonic() + 10
    while not all(c.client(victim).vbucket_info(vb).persisted_seqno >= highs[vb] for vb in mine):
        assert time.monotonic() < deadline
        h.pump_for(0.05)
    h.pump_for(0.3)
    assert pub.held > 0
    for vb in mine:
        rep = c.client(c.vbucket_map().replicas(vb)[0]).vbucket_info(vb)
        assert pub.sent[vb].seqno <= rep.snapshot_persisted < highs[vb]
    held = pub.held
    c.kill(victim)  # SIGKILL
    report = c.failover(victim)
    c.resume_replication()
    assert set(report.promoted) == set(mine)
    assert all(e is not None for e in report.entries.values())  # hard failover: new branches
    h.write(100)
    c.settle()
    h.publish()
    assert h.following_the_map()
    recs = h.check()
    assert not _rollbacks(recs) and pub.rollbacks == 0
    with h.replicate() as rep:
        assert not rep.rollbacks
        assert rep.docs() == h.actives()
    print(f"\nmitigation: {held} messages held at the SIGKILL, no rollback record, {pub.restreams} re-streams")


def test_rebalance_in_and_out_under_writes_no_rollback_no_duplicate(process_harness) -> None:
    """Issue 6 proof 1 with node processes: n3 rebalanced in and n0 out (takeover over TCP) while a writer
    thread continues and the publisher pumps: no rollback record, no data record twice, consumers equal the
    actives, every acknowledged write present, no failover entry."""
    h: ProcessHarness = process_harness(rollback_mitigation=False)
    c = h.cluster
    with BackgroundWriter(c, "r", 96) as w:  # a refused write: its vbucket is being taken over, or the map changed
        acked = w.acked
        h.pump_for(0.5)
        logs = {vb: c.client(c.vbucket_map().active(vb) or "").failover_log(vb) for vb in range(NVB)}
        pub = h.publisher

        def pump_three(_p: RebalanceProgress) -> None:
            for _ in range(3):
                pub.pump()

        first = c.rebalance(add=["n3"], progress=pump_three)
        second = c.rebalance(remove=["n0"], progress=pump_three)
        h.pump_for(0.5)
    assert not w.errors, w.errors
    assert first.status == second.status == "done" and first.moved > 0 and second.moved > 0
    assert "n0" not in c.vbucket_map().nodes and c.vbucket_map().vbuckets_of("n3", slot=0)
    h.keys.update(acked)
    c.settle()
    h.publish()
    assert h.following_the_map()
    for vb in range(NVB):
        assert c.client(c.vbucket_map().active(vb) or "").failover_log(vb) == logs[vb]
    recs = h.check()
    assert not _rollbacks(recs) and h.publisher.rollbacks == 0
    data = Counter((r.vbucket, r.vbuuid, r.seqno) for _p, _o, r in recs if r.is_data)
    assert not [k for k, n in data.items() if n > 1], "a data record was published twice"
    expected = h.actives()
    assert {k.decode(): v for k, (v, _vb) in expected.items()} == acked  # nothing acknowledged was lost
    with h.replicate() as rep:
        assert not rep.rollbacks
        assert rep.docs() == expected
    print(f"\nrebalance of node processes under writes: {len(acked)} keys, {first.moved}+{second.moved} "
          f"vbuckets moved, {len(data)} data records")


def _handed_back_with_a_silent_node(process_harness: Any, monkeypatch: Any, call: str
                                    ) -> tuple[ProcessHarness, list[int], dict[int, Any], set[int]]:
    """60 writes published, then vbuckets 0 and 3 removed from the publisher (as a group member hands them
    off) with their acknowledged positions; the source's ``call`` (one request to the node) fails once per
    vbucket with ``NodeUnavailable`` (a node that does not answer). Returns the harness, the vbuckets, their
    positions and the vbuckets whose silence is still to come."""
    from engine.network.remote import NodeUnavailable

    h: ProcessHarness = process_harness(nodes=1, replicas=0)
    pub = h.publisher
    h.write(60)
    h.publish()
    victims = [0, 3]
    before = {vb: pub.acked[vb].copy() for vb in victims}
    pub.remove_vbuckets(victims)
    assert pub.unacked(victims) == 0
    real = getattr(pub.source, call)
    silent = set(victims)

    def once_silent(vb: int) -> Any:
        if vb in silent:
            silent.discard(vb)
            raise NodeUnavailable(f"node n0: no answer to {call} (injected)")
        return real(vb)

    monkeypatch.setattr(pub.source, call, once_silent)
    return h, victims, before, silent


def test_a_node_silent_during_a_stream_request_is_asked_again(process_harness, monkeypatch) -> None:
    """docs/scale-out.md: a node that stops answering right after it accepted a stream request (the STAT for
    the failover-log record times out: a busy node, ``NodeUnavailable``) ends neither the publisher nor its
    group member (the hand-off raised it into the membership thread: the member exited). The stream is closed,
    nothing is published for it, and it is asked again after ``STREAM_RETRY_S`` although the map never changed;
    the topic then holds every write once and a replay equals the engine."""
    h, victims, before, silent = _handed_back_with_a_silent_node(process_harness, monkeypatch, "high_seqno")
    pub = h.publisher
    records = pub.records_sent
    pub.add_vbuckets(before)  # what a group member's hand-off does; must not raise
    assert not silent, "the injected silence was not reached"
    assert not set(victims) & pub.streaming and pub.records_sent == records  # nothing produced for them
    h.write(60)
    h.publish(timeout=30)  # asked again after STREAM_RETRY_S, with the map unchanged
    assert set(victims) <= pub.streaming
    recs = h.check()
    data = Counter((r.vbucket, r.vbuuid, r.seqno) for _p, _o, r in recs if r.is_data)
    assert not [k for k, n in data.items() if n > 1], "a data record was published twice"
    with h.replicate() as rep:
        assert rep.docs() == h.actives()


def test_a_node_silent_when_a_replay_from_zero_starts_is_asked_again(process_harness, monkeypatch) -> None:
    """A deliberate replay (``rollback_to_zero``, or ``stream_from=beginning`` over a topic holding the vbucket):
    the rollback record to 0 needs the node's failover log; a node that does not answer then ends neither the
    publisher nor its group member's hand-off (it raised). Nothing is published for the vbucket until the node
    answers; then the rollback record to 0 comes first, the history is re-sent after it, and a rollback-aware
    replay equals the engine."""
    h, victims, before, silent = _handed_back_with_a_silent_node(process_harness, monkeypatch, "failover_log")
    pub = h.publisher
    monkeypatch.setattr(pub, "rollback_to_zero", True)
    records = pub.records_sent
    pub.add_vbuckets(before)  # must not raise
    assert not silent, "the injected silence was not reached"
    assert not set(victims) & pub.streaming and pub.records_sent == records  # nothing produced for them
    h.publish(timeout=30)  # asked again after STREAM_RETRY_S
    assert set(victims) <= pub.streaming
    recs = h.check()
    for vb in victims:
        mine = [r for _p, _o, r in recs if r.vbucket == vb]
        zero = [i for i, r in enumerate(mine) if r.rollback_seqno == 0]
        assert len(zero) == 1, f"vbucket {vb}: {len(zero)} rollback records to 0"
        # the history again after it (a backfill: each key's current version, up to the high seqno)
        replayed = [r.seqno for r in mine[zero[0]:] if r.is_data]
        assert replayed and max(replayed) == max(r.seqno for r in mine[:zero[0]] if r.is_data)
    with h.replicate() as rep:
        assert rep.docs() == h.actives()


def test_mitigation_holding_a_vbucket_back_is_logged_not_silent(process_harness, monkeypatch, caplog) -> None:
    """docs/reliability.md: with the node's persistence stopped, rollback mitigation publishes nothing of the new
    writes -- and says so every ``HELD_WARN_S`` (which vbuckets, the snapshot end waited for, what is persisted
    everywhere). Once persistence resumes, everything is published and the warnings stop."""
    import logging

    import gateway.publisher as publisher_mod

    monkeypatch.setattr(publisher_mod, "HELD_WARN_S", 0.5)
    h: ProcessHarness = process_harness(nodes=1, replicas=0)
    pub = h.publisher
    h.write(20)
    h.publish()
    assert pub.held_warnings == 0
    h.cluster.stop_persistence("n0")
    h.write(40)
    with caplog.at_level(logging.WARNING, logger="gateway.publisher"):
        h.pump_for(2.0)
    assert pub.held > 0 and pub.held_warnings >= 2, (pub.held, pub.held_warnings)
    warned = [r.getMessage() for r in caplog.records if "rollback mitigation" in r.getMessage()]
    assert warned and "persisted everywhere" in warned[0] and "is persistence stopped" in warned[0], warned
    h.cluster.start_persistence("n0")
    h.publish()
    n = pub.held_warnings
    h.pump_for(1.0)
    assert pub.held == 0 and pub.held_warnings == n
    recs = h.check()
    assert not _rollbacks(recs)
    with h.replicate() as rep:
        assert rep.docs() == h.actives()
