"""The gateway through a rebalance (issue 6 proof 1, in process): a fourth node rebalanced in and another out
while a writer continues and the publisher pumps. The gateway only follows the map (STATE_CHANGED stream ends,
map revisions): no rollback record, no data record twice, the topic replica and the Replicator equal the
actives, every acknowledged write present."""

from __future__ import annotations

import os
import random
from collections import Counter
from typing import Any

import pytest

from engine import EngineError, NotMyVBucket, TemporaryFailure
from engine.exceptions import KeyNotFound
from gateway.invariants import check_partition
from schemas.records import RecordType
from tests.gateway.kafka_util import TopicReplica
from tests.harness import CLUSTER_NVB as NVB
from tests.harness import ClusterHarness


class AckedWriter:
    """Writes and deletes through the map; TMPFAIL (a takeover in progress) / NOT_MY_VBUCKET are not
    acknowledged and not retried. ``expected`` is what every acknowledged operation leaves."""

    def __init__(self, h: ClusterHarness) -> None:
        self.h = h
        self.i = 0
        self.expected: dict[bytes, bytes | None] = {}
        self.refused = 0

    def write(self, n: int) -> None:
        c = self.h.cluster
        for _ in range(n):
            self.i += 1
            key = f"k{self.i % 120}"
            try:
                if self.i % 7 == 0:
                    c.delete(key)
                    self.expected[key.encode()] = None
                else:
                    value = f'{{"n": {self.i}}}'.encode()
                    c.write(key, value)
                    self.expected[key.encode()] = value
            except (TemporaryFailure, NotMyVBucket):
                self.refused += 1
            except KeyNotFound:
                self.expected[key.encode()] = None


def _run_rebalance(h: ClusterHarness, w: AckedWriter, **kw: Any) -> None:
    c = h.cluster
    reb = c.start_rebalance(**kw)
    for _ in range(20_000):
        if reb.done:
            break
        w.write(4)
        c.pump(rounds=1, max_messages=32)
        for _ in range(2):
            h.pub.pump()
    assert reb.status == "done", reb.error
    assert reb.moved == reb.total > 0


@pytest.mark.parametrize("mitigation", [False, True])
def test_rebalance_in_and_out_under_writes_no_rollback_no_duplicate(cluster_harness, mitigation: bool) -> None:
    h: ClusterHarness = cluster_harness(rollback_mitigation=mitigation)
    c = h.cluster
    w = AckedWriter(h)
    w.write(200)
    h.settle()
    logs = {vb: c.active_bucket(vb).failover_log(vb) for vb in range(NVB)}
    _run_rebalance(h, w, add=["n3"])
    assert "n3" in c.vbucket_map().nodes and c.vbucket_map().vbuckets_of("n3", slot=0)
    _run_rebalance(h, w, remove=["n1"])
    assert "n1" not in c.vbucket_map().nodes
    assert w.refused > 0  # takeovers answered TMPFAIL for a moment
    w.write(50)
    h.settle()
    # No failover entry anywhere: the gateway's position stays on the same history.
    assert {vb: c.active_bucket(vb).failover_log(vb) for vb in range(NVB)} == logs
    recs = h.check()  # check_partition on every partition; TopicReplica == actives
    assert not [r for _p, _o, r in recs if r.type is RecordType.ROLLBACK]
    assert h.pub.rollbacks == 0
    data = Counter((r.vbucket, r.vbuuid, r.seqno) for _p, _o, r in recs if r.is_data)
    assert not [k for k, n in data.items() if n > 1], "a data record was published twice"
    moved = {r.vbucket for _p, _o, r in recs if r.type is RecordType.STREAM_END}
    assert moved  # STATE_CHANGED ended the streams of moved actives
    assert h.pub.following() == {vb: c.vbucket_map().active(vb) for vb in range(NVB)}
    actives = h.actives()
    for key, value in w.expected.items():
        if value is None:
            assert key not in actives
        else:
            assert actives[key][0] == value
    with h.replicate() as rep:
        assert not rep.rollbacks
        assert rep.docs() == actives


#: GATEWAY_REBALANCE_SCHEDULES=N runs N schedules (default 4: without / with faults, mitigation off / on)
_SCHEDULES = [(seed, seed % 2 == 0, seed % 4 in (2, 3))
              for seed in range(1, 1 + int(os.environ.get("GATEWAY_REBALANCE_SCHEDULES", "4")))]


@pytest.mark.parametrize(("seed", "mitigation", "faults"), _SCHEDULES)
def test_random_rebalance_schedules(cluster_harness, seed: int, mitigation: bool, faults: bool) -> None:
    """Random schedules of writes, partial replication, publisher pumps and rebalances in / out (new nodes and
    nodes removed earlier), with crashes, restarts and failovers when ``faults``. Every partition keeps its
    invariants and the topic replica equals the actives; without faults no rollback record and no data record
    twice; with mitigation no rollback record at all."""
    rnd = random.Random(seed)
    h: ClusterHarness = cluster_harness(rollback_mitigation=mitigation)
    c = h.cluster
    counts: Counter[str] = Counter()
    fresh = 0
    for step in range(80):
        op = rnd.random()
        vbmap = c.vbucket_map()
        live = [n for n in vbmap.nodes if c.nodes[n].up]
        if op < 0.3:
            for i in range(rnd.randint(5, 30)):
                try:
                    c.write(f"r{rnd.randint(0, 120)}", f'{{"s": {step}, "i": {i}}}'.encode())
                except EngineError:
                    counts["refused"] += 1
        elif op < 0.5:
            c.pump(rounds=rnd.randint(1, 3), max_messages=rnd.randint(1, 40), flush=rnd.random() < 0.5)
        elif op < 0.7:
            for _ in range(rnd.randint(1, 5)):
                h.pub.pump()
        elif op < 0.82:
            if c.rebalance_running is None:
                try:
                    if rnd.random() < 0.5 or len(vbmap.nodes) <= 2:
                        back = sorted(set(c.ejected) - set(vbmap.nodes))
                        if back and rnd.random() < 0.5:
                            name = rnd.choice(back)
                        else:
                            fresh += 1
                            name = f"x{fresh}"
                        c.start_rebalance(add=[name])
                    else:
                        c.start_rebalance(remove=[rnd.choice(vbmap.nodes)])
                    counts["rebalance"] += 1
                except EngineError:
                    counts["rebalance_refused"] += 1
        elif not faults or op < 0.88:
            for _ in range(rnd.randint(1, 10)):
                c.pump()  # rebalance steps
        elif op < 0.92 and len(live) > 1:
            c.kill(rnd.choice(live))
            counts["kill"] += 1
        elif op < 0.96:
            down = [n for n in vbmap.nodes if not c.nodes[n].up]
            if down:
                c.restart(rnd.choice(down))
                counts["restart"] += 1
        elif len(vbmap.nodes) > 2:
            try:
                c.failover(rnd.choice(vbmap.nodes), graceful=rnd.random() < 0.5)
                counts["failover"] += 1
            except EngineError:
                counts["failover_refused"] += 1
    for n in c.vbucket_map().nodes:
        if not c.nodes[n].up:
            c.restart(n)
    for _ in range(100_000):
        if c.rebalance_running is None:
            break
        c.pump()
    h.settle()
    recs = h.records()
    for part in range(h.partitions):
        check_partition([(o, r) for p, o, r in recs if p == part])
    with_active = {vb for vb in range(NVB) if c.vbucket_map().active(vb) is not None}
    replica = TopicReplica()
    replica.apply_all(recs)
    assert {k: v for k, v in replica.state().items() if v[1] in with_active} == h.actives()
    rollbacks = [r for _p, _o, r in recs if r.type is RecordType.ROLLBACK]
    if mitigation or not faults:
        assert not rollbacks, counts
    if not faults:
        data = Counter((r.vbucket, r.vbuuid, r.seqno) for _p, _o, r in recs if r.is_data)
        assert not [k for k, n in data.items() if n > 1], "a data record was published twice"
    assert counts["rebalance"] > 0 or faults  # with faults a node may be down at every attempt
    print(seed, dict(counts), "rollback records:", len(rollbacks))
