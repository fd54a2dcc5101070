"""Property: failovers and rebalances *of the target* during replication (docs/xdcr.md "Proof", "Checkpoints").

The target is a three-node cluster with one replica behind one KV port per node (the cluster map, NOT_MY_VBUCKET
with the map as body: tests/connectors/xdcr/harness.py ``TargetClusterNodes``). Random histories mix the source's
writes, deletions, expiries and lost branches (rollback records) with the target's hard failovers (with its
replication stopped first, so the promoted replica lacks writes the replicator had sent and checkpointed),
graceful failovers, rebalances in and out -- between replicator runs and in the middle of one. After convergence
the target's documents and metadata (value, CAS, rev seqno, flags, expiry, deleted) equal the source's for every
key. Prints the counts (histories, rollbacks crossed, documents restored, target failovers, target histories
lost)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.xdcr.metrics import prometheus_text
from connectors.xdcr.replicator import XdcrReplicator, XdcrSettings
from gateway.broker import Broker
from tests.connectors.xdcr.harness import TargetClusterNodes, diverging, source_docs
from tests.connectors.xdcr.test_convergence import KEYS, Run

NVB = 8

source_op = st.one_of(
    st.tuples(st.just("set"), st.integers(0, KEYS - 1), st.sampled_from([10, 100, 600]), st.integers(0, 3),
              st.booleans()),
    st.tuples(st.just("delete"), st.integers(0, KEYS - 1)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("lost"), st.integers(1, 4)),
    st.tuples(st.just("replicate")),
)
target_op = st.one_of(
    st.tuples(st.just("pause_target")),
    st.tuples(st.just("hard_failover"), st.integers(0, 3)),
    st.tuples(st.just("graceful_failover"), st.integers(0, 3)),
    st.tuples(st.just("rebalance_in")),
    st.tuples(st.just("rebalance_out"), st.integers(0, 3)),
    st.tuples(st.just("failover_mid_run"), st.integers(0, 3), st.integers(0, 2)),
)
op = st.one_of(source_op, source_op, target_op)


class MidRunFailover(Exception):
    pass


class TopologyRun(Run):
    """One history against a fresh target cluster."""

    def __init__(self, broker: Broker, tmp: Path, target: TargetClusterNodes) -> None:
        super().__init__(broker, tmp, 0)
        self.target = target
        self.failovers = 0
        self.rebalances = 0
        self.history_lost = 0

    def _replicator(self) -> XdcrReplicator:
        return XdcrReplicator(self.h.client, self.h.topic, self.target.url, self.state,
                              user=TargetClusterNodes.USER, password=TargetClusterNodes.PASSWORD,
                              settings=XdcrSettings(batch_docs=5, checkpoint_interval=0, group_commit=3))

    def replicate(self) -> None:
        with self._replicator() as r:
            r.run(until_caught_up=True)
            self._count(r)

    def _count(self, r: XdcrReplicator) -> None:
        self.rollbacks += r.metrics.rollbacks
        self.restored += r.metrics.restored
        self.history_lost += r.metrics.target_history_lost
        r.metrics.rollbacks = r.metrics.restored = r.metrics.target_history_lost = 0

    def publish(self) -> None:
        """Persist and publish the source's writes (a ``lost`` branch publishes its own, unpersisted)."""
        self.h.bucket.flush_all()
        self.h.settle()

    def _pick(self, i: int) -> str:
        members = self.target.members()
        return members[i % len(members)]

    def _refill(self) -> None:
        """After a failover: a fresh node rebalanced in restores every vbucket's replica (ns_server's flow)."""
        self.target.replicating = True
        self.target.rebalance(add=[self.target.new_node_name()])
        self.rebalances += 1

    def hard_failover(self, i: int) -> None:
        self.target.failover(self._pick(i))
        self.failovers += 1
        self._refill()

    def apply(self, o: tuple[Any, ...]) -> None:
        kind = o[0]
        t = self.target
        if kind == "pause_target":
            t.replicating = False  # what the replicator writes from now on is on the target's actives only
        elif kind == "hard_failover":
            self.hard_failover(o[1])
        elif kind == "graceful_failover":
            t.replicating = True
            t.failover(self._pick(o[1]), graceful=True)
            self.failovers += 1
            self._refill()
        elif kind == "rebalance_in":
            if len(t.members()) < 4:
                t.replicating = True
                t.rebalance(add=[t.new_node_name()])
                self.rebalances += 1
        elif kind == "rebalance_out":
            if len(t.members()) > 2:
                t.replicating = True
                t.rebalance(remove=[self._pick(o[1])])
                self.rebalances += 1
        elif kind == "replicate":
            self.publish()
            self.replicate()
        elif kind == "failover_mid_run":
            self.failover_mid_run(o[1], o[2])
        else:
            super().apply(o)

    def failover_mid_run(self, i: int, after: int) -> None:
        """Source writes, then a replicator run during which (after ``after`` commits) a target node with writes
        its replica never got is failed over hard: the run must notice the lost history and resend."""
        for j in range(2 * KEYS):
            self.apply(("set", (self.n + j) % KEYS, 100, 2, False))
        self.publish()
        self.target.replicating = False
        r = self._replicator()
        commits = [0]
        r.start()
        inner = r._before_commit

        def hook() -> None:
            inner()
            commits[0] += 1
            if commits[0] == after + 1:
                self.hard_failover(i)

        r.store.hook = hook
        try:
            r.run(until_caught_up=True)
        finally:
            self._count(r)
            r.close()
        if commits[0] <= after:  # the run ended before the failover point: fail over afterwards
            self.hard_failover(i)

    def converge(self, node: Any = None) -> None:
        self.target.settle()
        self.h.bucket.flush_all()
        self.h.settle()
        self.replicate()
        src = source_docs(self.h.bucket)
        tgt = self.target.docs(sorted({self.key(i).encode() for i in range(KEYS)} | set(src)))
        bad = diverging(src, tgt)
        assert not bad, sorted(bad.items())[:4]


def _histories(n: int, broker: Broker, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, int]:
    totals = {"histories": 0, "rollbacks": 0, "restored": 0, "failovers": 0, "rebalances": 0, "lost": 0}
    seq = [0]

    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(op, min_size=3, max_size=12))
    def history(ops: list[tuple[Any, ...]]) -> None:
        seq[0] += 1
        base = tmp_path / f"h{seq[0]}"
        target = TargetClusterNodes(base / "target", nodes=3, replicas=1, num_vbuckets=NVB)
        run = TopologyRun(broker, base, target)
        try:
            for o in ops:
                run.apply(o)
            run.converge()
        finally:
            run.close()
            target.close()
        totals["histories"] += 1
        totals["rollbacks"] += run.rollbacks
        totals["restored"] += run.restored
        totals["failovers"] += run.failovers
        totals["rebalances"] += run.rebalances
        totals["lost"] += run.history_lost

    t0 = time.monotonic()
    history()
    with capsys.disabled():
        print(f"\nxdcr target topology: {totals['histories']} histories, {totals['rollbacks']} rollbacks crossed, "
              f"{totals['restored']} documents restored, {totals['failovers']} target failovers, "
              f"{totals['rebalances']} target rebalances, {totals['lost']} target histories lost and resent "
              f"({time.monotonic() - t0:.0f} s)")
    assert totals["histories"] >= n
    return totals


def test_target_failovers_and_rebalances_converge(kafka_broker: Broker, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _histories(int(os.environ.get("XDCR_TOPOLOGY_EXAMPLES", "6")), kafka_broker, tmp_path, capsys)


@pytest.mark.slow
def test_target_failovers_and_rebalances_converge_many(kafka_broker: Broker, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # 8 in CI (the suite's time budget; the 6-history variant above runs too); XDCR_TOPOLOGY_EXAMPLES_MANY=30+ for a longer campaign
    _histories(int(os.environ.get("XDCR_TOPOLOGY_EXAMPLES_MANY", "8")), kafka_broker, tmp_path, capsys)


def test_hard_failover_of_the_target_after_a_checkpoint_resends_what_it_lost(kafka_broker: Broker,
                                                                            tmp_path: Path) -> None:
    """The targeted case: the replicator checkpointed writes that only the target's active held; a hard
    failover promotes the replica without them; the next run detects it (OBSERVE_SEQNO on the recorded target
    position) and resends from an older checkpoint."""
    target = TargetClusterNodes(tmp_path / "target", nodes=3, replicas=1, num_vbuckets=NVB)
    run = TopologyRun(kafka_broker, tmp_path, target)
    try:
        for i in range(KEYS):
            run.apply(("set", i, 100, 1, False))
        run.apply(("replicate",))
        target.settle()
        run.apply(("pause_target",))
        for i in range(KEYS):
            run.apply(("set", i, 600, 3, False))
        run.apply(("replicate",))
        for name in target.members()[:1]:
            run.target.failover(name)
        run.target.replicating = True
        run.converge()
        assert run.history_lost > 0
    finally:
        run.close()
        target.close()


@pytest.mark.parametrize("writer_process", [True, False], ids=["writer-process", "writer-thread"])
def test_hard_failover_of_the_target_during_a_run_is_detected_by_the_run(kafka_broker: Broker, tmp_path: Path,
                                                                         writer_process: bool) -> None:
    """Every key written twice (two snapshots per vbucket in the topic), the target's replication stopped; the
    replicator commits after every snapshot, and after its first commit the node holding the vbucket just
    written is failed over hard (those writes lost, their position committed). The same run then writes that
    vbucket's second snapshot -- NOT_MY_VBUCKET, the new map, its check of the target positions
    (OBSERVE_SEQNO) find the lost history, and the run restarts from what the target holds."""
    target = TargetClusterNodes(tmp_path / "target", nodes=3, replicas=1, num_vbuckets=NVB)
    run = TopologyRun(kafka_broker, tmp_path, target)
    try:
        for size in (100, 600):
            for i in range(KEYS):
                run.apply(("set", i, size, 1, False))
            run.publish()
        target.replicating = False
        r = XdcrReplicator(run.h.client, run.h.topic, target.url, run.state, user=TargetClusterNodes.USER,
                           password=TargetClusterNodes.PASSWORD,
                           settings=XdcrSettings(batch_docs=5, checkpoint_interval=0, group_commit=1,
                                                 writer_process=writer_process))
        try:
            r.start()
            inner = r._before_commit
            victims: list[str] = []

            def hook() -> None:
                inner()
                written = [vb for vb, v in r.vbs.items() if v.written]
                if not victims and written:
                    victims.append(target.call(lambda: target.cluster.vbucket_map().chains[written[0]][0]))
                    target.failover(victims[0])
                    target.replicating = True

            r.store.hook = hook
            r.run(until_caught_up=True)
            assert victims and r.metrics.target_history_lost > 0  # noticed by the running replicator
            lost = r.metrics.target_history_lost
            assert f"dcpgw_xdcr_target_history_lost_total {lost}" in prometheus_text(r.status())
        finally:
            r.close()
        run.converge()
    finally:
        run.close()
        target.close()


def test_target_losing_the_restores_of_a_source_rollback_gets_them_again(kafka_broker: Broker,
                                                                         tmp_path: Path) -> None:
    """The source rolls back a branch that created a key; the target holds it (on its replicas too). The
    replicator restores the target (a dominated tombstone, forced) while the target's replication is stopped,
    and the target node holding it is failed over hard: the restore is lost. The source's new branch went past
    the lost one's seqnos in that vbucket (other keys), so the replicator's position is beyond them. The next run
    must not resume from a checkpoint of the lost branch (the rollback dropped those: their mutation-log entries
    are gone): it replays from before the branch, crosses the rollback record again and restores again."""
    from engine import vbucket_of

    target = TargetClusterNodes(tmp_path / "target", nodes=3, replicas=1, num_vbuckets=NVB)
    run = TopologyRun(kafka_broker, tmp_path, target)
    b = run.h.bucket
    try:
        lost_key = run.key(KEYS - 1)
        vb = vbucket_of(lost_key.encode(), NVB)
        others = [k for k in (f"{run.prefix}x{j}" for j in range(400)) if vbucket_of(k.encode(), NVB) == vb][:3]
        for k in others:
            b.set(k, b'{"v": 0}')
        run.apply(("replicate",))
        b.set(lost_key, b'{"lost": true}', flags=7)  # created on a branch the source then loses
        run.h.publish_unpersisted()
        run.replicate()
        run.h.crash_engine()
        target.settle()
        b = run.h.bucket  # the engine after its crash
        for j in range(3):  # the new branch goes past the lost one's seqnos in the vbucket
            for k in others:
                b.set(k, b'{"v": %d}' % (j + 1))
        target.replicating = False
        run.apply(("replicate",))  # crosses the rollback: the restore reaches the target's active only
        assert run.restored > 0
        victim = target.call(lambda: target.cluster.vbucket_map().chains[vb][0])
        target.failover(victim)
        run._refill()
        run.converge()
        assert run.history_lost > 0
    finally:
        run.close()
        target.close()
