"""Clocks and RNGs are injected (docs/engine.md "Clocks and randomness"): the same seed and the same fake clock
give the same vbuuids, CAS values and rebalance decisions; the rebalance planner is a pure function
(engine/cluster/rebalance.py ``plan_rebalance``; docs/rebalance.md "The cluster interface")."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.bucket import Bucket
from engine.cluster.local import Cluster
from engine.cluster.manager import NodeControl
from engine.cluster.rebalance import (
    MovePhase,
    Rebalance,
    RebalanceCluster,
    RebalanceProgress,
    plan_chains,
    plan_rebalance,
)
from engine.cluster.vbucket_map import VBucketMap
from engine.config import BucketConfig
from engine.exceptions import InvalidArgument, NotMyVBucket, TemporaryFailure
from engine.kv.durability import ManualClock
from engine.kv.vbucket import VBucketInfo, VBucketState
from engine.network.process_rebalance import ProcessRebalance
from schemas.failover_log import FailoverLog


# ---------------------------------------------------------------------- one bucket: CAS and vbuuids
def _bucket(path: Path, clock: ManualClock, seed: int = 7) -> Bucket:
    cfg = BucketConfig(data_dir=path, num_vbuckets=4, seed=seed, tune_gc=False)
    return Bucket(cfg, clock=clock)


def test_cas_values_come_from_the_injected_clock(tmp_path: Path) -> None:
    clock = ManualClock(1_600_000_000.0)  # years before the wall clock: a CAS from time_ns() would be far above
    b = _bucket(tmp_path / "b", clock)
    try:
        first = b.set(b"k", b"v")
        assert first.cas == int(1_600_000_000.0 * 1_000_000_000) & ~0xFFFF
        second = b.set(b"k", b"w")
        assert second.cas == first.cas + 1  # the clock did not move: the HLC counter
        clock.advance(1.0)
        third = b.set(b"k", b"x")
        assert third.cas == int(1_600_000_001.0 * 1_000_000_000) & ~0xFFFF
    finally:
        b.close()


def test_an_injected_hlc_clock_drives_the_cas(tmp_path: Path) -> None:
    cfg = BucketConfig(data_dir=tmp_path / "b", num_vbuckets=2, seed=1, tune_gc=False)
    b = Bucket(cfg, clock=ManualClock(), hlc_clock=lambda: 5 << 16)
    try:
        assert b.set(b"a", b"1").cas == 5 << 16
        assert b.set(b"a", b"2").cas == (5 << 16) + 1
    finally:
        b.close()


def _bucket_history(path: Path, seed: int) -> tuple[list[int], list[list[tuple[int, int]]]]:
    clock = ManualClock()
    b = _bucket(path, clock, seed)
    try:
        cas = []
        for i in range(40):
            cas.append(b.set(f"k{i}".encode(), b"v").cas)
            clock.advance(0.001 * (i % 3))
        b.set_vbucket_state(1, VBucketState.REPLICA)
        b.promote(1)  # a failover entry: a new vbuuid from the seeded RNG
        return cas, [b.vbucket(vb).failover.to_pairs() for vb in range(4)]
    finally:
        b.close()


def test_same_seed_and_clock_give_the_same_vbuuids_and_cas(tmp_path: Path) -> None:
    cas, logs = _bucket_history(tmp_path / "a", 7)
    assert (cas, logs) == _bucket_history(tmp_path / "b", 7)
    assert len(logs[1]) == 2
    assert _bucket_history(tmp_path / "c", 8)[1] != logs  # the seed is what decides the vbuuids


def test_a_failover_log_without_an_rng_cannot_draw_a_vbuuid() -> None:
    log = FailoverLog.from_pairs([(0xA, 0)])  # a consumer's copy: read only
    assert log.latest.vbuuid == 0xA
    with pytest.raises(InvalidArgument, match="rng"):
        log.create_entry(5)
    with pytest.raises(InvalidArgument, match="rng"):
        FailoverLog()  # nothing to load: it would have to draw
    seeded = FailoverLog.new(rng=random.Random(2))
    assert seeded == FailoverLog.new(rng=random.Random(2))


# ---------------------------------------------------------------------- a whole cluster: failover + rebalance
def _snapshot(c: Cluster) -> dict[str, Any]:
    nodes: dict[str, Any] = {}
    for name in sorted(c.nodes):
        b = c.node(name).require_bucket()
        nodes[name] = [
            (b.vbucket(vb).state.value, b.vbucket(vb).failover.to_pairs(),
             sorted((k, it.seqno, it.cas) for k, it in b.vbucket(vb).ht.items()))
            for vb in range(c.num_vbuckets)]
    return {"map": c.vbucket_map().to_json(), "nodes": nodes}


def _cluster_run(path: Path) -> tuple[list[RebalanceProgress], dict[str, Any], Any]:
    clock = ManualClock()
    with Cluster.create(path, nodes=3, replicas=1, num_vbuckets=16, seed=3, clock=clock,
                        monotonic=ManualClock(0.0)) as c:
        for i in range(120):
            c.write(f"k{i}", f"v{i}")
            if i % 10 == 0:
                clock.advance(0.5)
        c.settle()
        c.failover("n2")  # hard: the replicas promoted get failover entries (seeded vbuuids)
        trace: list[RebalanceProgress] = []
        reb = c.start_rebalance(add=["n3", "n4"], progress=trace.append)
        plan = reb.plan
        i = 0
        while not reb.done:
            with contextlib.suppress(TemporaryFailure, NotMyVBucket):
                c.write(f"r{i}", f"x{i}")  # writes continue (TMPFAIL while a vbucket is taken over)
            clock.advance(0.01)
            i += 1
            c.pump()
        assert reb.status == "done"
        c.settle()
        return trace, _snapshot(c), plan


def test_same_seed_and_clock_give_the_same_cluster_history(tmp_path: Path) -> None:
    trace_a, snap_a, plan_a = _cluster_run(tmp_path / "a")
    trace_b, snap_b, plan_b = _cluster_run(tmp_path / "b")
    assert plan_a == plan_b
    assert trace_a == trace_b  # the same moves in the same phases at every step
    assert snap_a == snap_b  # the same map, states, failover logs (vbuuids) and CAS values on every node
    assert len(trace_a) > 1 and trace_a[-1].moved == len(plan_a.moves)


# ---------------------------------------------------------------------- the planner is pure
@st.composite
def maps_and_changes(draw: st.DrawFn) -> tuple[VBucketMap, list[str], list[str]]:
    n = draw(st.integers(1, 5))
    names = [f"n{i}" for i in range(n)]
    replicas = draw(st.integers(0, min(2, n - 1)))
    nvb = draw(st.sampled_from([1, 4, 16, 64]))
    m = VBucketMap.generate(names, replicas, nvb)
    failed = draw(st.lists(st.sampled_from(names), unique=True, max_size=n - 1))
    if failed:  # hard failovers: the slots of the failed nodes are empty (a chain may lose every copy)
        chains = [[x if x not in failed else None for x in ch] for ch in m.chains]
        m = m.with_chains(chains, [x for x in names if x not in failed])
    remove = draw(st.lists(st.sampled_from(list(m.nodes)), unique=True, max_size=len(m.nodes)))
    add = [f"a{i}" for i in range(draw(st.integers(0, 3)))]
    return m, add, remove


@settings(max_examples=150, deadline=None)
@given(case=maps_and_changes())
def test_the_planner_is_pure(case: tuple[VBucketMap, list[str], list[str]]) -> None:
    m, add, remove = case
    before = m.to_json()
    try:
        plan = plan_rebalance(m, add, remove)
    except InvalidArgument:
        with pytest.raises(InvalidArgument):
            plan_rebalance(VBucketMap.from_json(before), add, remove)
        return
    assert m.to_json() == before  # the input map is not touched
    assert plan_rebalance(VBucketMap.from_json(before), list(add), list(remove)) == plan  # same inputs, same plan
    assert plan_rebalance(m, add, remove) == plan
    assert list(plan.nodes) == [x for x in m.nodes if x not in remove] + add
    assert [list(ch) for ch in plan.chains] == plan_chains(m, list(plan.nodes))
    assert [mv.vbucket for mv in plan.moves] == [
        vb for vb in range(m.num_vbuckets) if list(m.chains[vb]) != list(plan.chains[vb])]
    for mv in plan.moves:
        assert mv.old == tuple(m.chains[mv.vbucket]) and mv.new == plan.chains[mv.vbucket]
    m.with_chains([list(ch) for ch in plan.chains], list(plan.nodes))  # a valid map


# ---------------------------------------------------------------------- the mover over the interface alone
class _Node:
    """A node's vbucket states, answering the NodeControl commands the mover reads."""

    def __init__(self, states: dict[int, VBucketState]) -> None:
        self.states = states

    def state_cas(self, vbucket: int) -> int:
        return 1

    def set_vbucket_state(self, vbucket: int, state: VBucketState, *, cas: int | None = None) -> int:
        self.states[vbucket] = state
        return 1

    def promote(self, vbucket: int, *, takeover: bool = False, cas: int | None = None) -> None:
        self.states[vbucket] = VBucketState.ACTIVE

    def vbucket_info(self, vbucket: int) -> VBucketInfo:
        return VBucketInfo(vbucket, self.states[vbucket], 1, 0, 0, 0, 0, ((1, 0),))


class _Cluster:
    """Just the :class:`RebalanceCluster` interface: the map, node states and a fake monotonic clock."""

    def __init__(self, vbmap: VBucketMap, nodes: dict[str, _Node], clock: ManualClock) -> None:
        self.map, self.nodes, self.clock = vbmap, nodes, clock
        self.blocked: set[int] = set()

    def vbucket_map(self) -> VBucketMap:
        return self.map

    def commit_map(self, vbmap: VBucketMap) -> None:
        self.map = vbmap

    def node_up(self, name: str) -> bool:
        return name in self.nodes

    def node_control(self, name: str) -> NodeControl:
        return self.nodes[name]

    def set_vbucket_state(self, name: str, vbucket: int, state: VBucketState) -> None:
        self.nodes[name].states[vbucket] = state

    def refresh_state_cas(self, name: str, vbucket: int) -> None: ...

    def begin_move(self, vbucket: int, nodes: Iterable[str]) -> None: ...

    def block_writes(self, vbucket: int) -> None:
        self.blocked.add(vbucket)

    def set_second_chain(self, vbucket: int, chain: Sequence[str | None]) -> None: ...

    def clear_second_chain(self, vbucket: int) -> None: ...

    def end_move(self, vbucket: int) -> None:
        self.blocked.discard(vbucket)

    def rewire(self) -> None: ...

    def eject_node(self, name: str) -> None: ...

    def rebalance_ended(self, rebalance: Rebalance) -> None: ...

    def monotonic_time(self) -> float:
        return self.clock()


def test_the_process_movers_takeover_timeout_reads_the_injected_monotonic_clock() -> None:
    vbmap = VBucketMap.generate(["n0", "n1"], 0, 2)
    nodes = {n: _Node({vb: VBucketState.ACTIVE if vbmap.active(vb) == n else VBucketState.DEAD
                       for vb in range(2)}) for n in ("n0", "n1")}
    clock = ManualClock(0.0)
    fake: RebalanceCluster = _Cluster(vbmap, nodes, clock)
    reb = ProcessRebalance(fake, [], ["n1"])  # n1's actives move to n0
    assert [m.vbucket for m in reb.queue] == [vb for vb in range(2) if vbmap.active(vb) == "n1"]
    move = reb.queue[0]
    move.phase = MovePhase.TAKEOVER
    move.takeover_deadline = fake.monotonic_time() + reb.takeover_timeout
    assert reb._takeover_result(move) is None  # still running by the fake clock
    clock.advance(reb.takeover_timeout + 1)
    assert reb._takeover_result(move) is False  # timed out by the fake clock: reverted by the mover
    nodes["n1"].states[move.vbucket] = VBucketState.DEAD
    nodes["n0"].states[move.vbucket] = VBucketState.ACTIVE
    assert reb._takeover_result(move) is True
