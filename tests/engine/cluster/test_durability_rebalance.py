"""Synchronous replication across a rebalance (docs/durability.md "Sync writes during a rebalance", issue 6 proof 3) on the in-process cluster.

kv_engine rules checked here: the mover's streams enable sync writes, so prepares / commits / aborts reach the
new copies and they seqno-ack; during a move the active's topology has a second chain (the post-move one,
kv_engine ``setVBucketState`` ``topology`` with two chains) and a prepare needs a majority of both; when the
old active goes dead in the takeover with a prepare in flight its waiter gets SYNC_WRITE_AMBIGUOUS, the new
active holds the prepare and commits it once durable on the new topology (never aborted by timeout); a
takeover is never blocked by a prepare in flight and a reverted takeover keeps it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.bucket import Bucket
from engine.cluster.local import Cluster
from engine.cluster.rebalance import MovePhase, Rebalance, VBucketMove
from engine.config import BucketConfig
from engine.exceptions import (
    DurabilityImpossible,
    InvalidArgument,
    NotMyVBucket,
    SyncWriteAmbiguous,
    SyncWriteInProgress,
    TemporaryFailure,
)
from engine.kv.durability import Durability, Level, ManualClock, SyncWriteState, majority
from engine.kv.item import Item
from engine.kv.vbucket import VBucketState
from engine.network.process_cluster import NodeProcess
from engine.network.protocol import STATE_CODES, Opcode
from tests.engine.cluster.sync_write_schedules import _BUILDERS as _DUR_BUILDERS
from tests.engine.cluster.sync_write_schedules import Harness
from tests.engine.cluster_model import ClusterClient, actives_state, assert_replicas_equal_actives
from tests.engine.nodes import CFG, keys_on
from tests.engine.nodes import NVB as SERVER_NVB

NVB = 8
MAJ = Durability(Level.MAJORITY)


class CountingClient(ClusterClient):
    """A map-following DCP client without sync writes that also counts the data messages per key."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster, "counting-client")
        self.seen: dict[bytes, list[bytes | None]] = {}
        handle = self.consumer.handle

        def counting(m: Any) -> Any:
            if type(m) is Item:
                self.seen.setdefault(m.key, []).append(m.value)
            return handle(m)

        self.consumer.handle = counting  # type: ignore[method-assign]


def test_second_chain_needs_a_majority_of_both_chains(tmp_path: Path) -> None:
    """kv_engine: a topology of two chains (the post-move one second) -- a prepare commits only once durable
    on both; the second chain's nodes ack like any replica; a second chain without a majority makes sync
    writes impossible; a malformed one is refused."""
    clock = ManualClock()
    b = Bucket(BucketConfig(data_dir=tmp_path / "a", num_vbuckets=NVB, tune_gc=False), clock=clock)
    try:
        vb = b.vbucket_of("k")
        b.set_replication_topology(vb, ["a", "b"], ["c", "b"])
        sw = b.set("k", b"v", vbucket=vb, durability=MAJ)
        b.seqno_acknowledged(vb, "b", sw.prepare_seqno)
        assert not sw.done  # [a, b] satisfied, [c, b] not (a is not in it)
        b.seqno_acknowledged(vb, "c", sw.prepare_seqno)
        assert sw.committed and b.get("k", vbucket=vb).value == b"v"
        # the old active kept as a replica of the new chain counts with its own ack there
        b.set_replication_topology(vb, ["a", "b"], ["c", "a"])
        sw = b.set("k", b"w", vbucket=vb, durability=MAJ)
        b.seqno_acknowledged(vb, "c", sw.prepare_seqno)
        assert not sw.done  # [c, a] satisfied, [a, b] not
        b.seqno_acknowledged(vb, "b", sw.prepare_seqno)
        assert sw.committed
        b.set_replication_topology(vb, ["a", "b"], ["c", None])
        with pytest.raises(DurabilityImpossible):
            b.set("k", b"x", vbucket=vb, durability=MAJ)
        with pytest.raises(InvalidArgument):
            b.set_replication_topology(vb, ["a", "b"], [None, "b"])
        with pytest.raises(InvalidArgument):
            b.set_replication_topology(vb, ["a", "b"], ["c", "d", "e", "f", "g"])
        b.set_replication_topology(vb, ["a", "b"])  # the move is over: one chain again
        sw = b.set("k", b"y", vbucket=vb, durability=MAJ)
        b.seqno_acknowledged(vb, "b", sw.prepare_seqno)
        assert sw.committed
    finally:
        b.close()


@pytest.fixture
def node_process(tmp_path: Path) -> Iterator[NodeProcess]:
    node = NodeProcess("n0", tmp_path / "n0", SERVER_NVB, dict(CFG))
    node.start()
    yield node
    node.kill()


def test_node_process_takes_a_two_chain_topology(node_process: NodeProcess) -> None:
    """SET_VBUCKET_STATE's ``topology`` over TCP carries up to two chains (kv_engine); more is EINVAL."""
    c = node_process.require()
    vb = 1
    (k,) = keys_on(vb, 1, "t")
    c.set_replication_topology(vb, ["n0"], ["n0"])
    assert c.set(k, b"v", vbucket=vb, durability=MAJ).seqno == 2  # both chains: the node alone
    c.set_replication_topology(vb, ["n0"], ["x", None])  # the post-move chain cannot reach a majority
    with pytest.raises(DurabilityImpossible):
        c.set(k, b"w", vbucket=vb, durability=MAJ)
    with pytest.raises(InvalidArgument):
        c._call(Opcode.SET_VBUCKET_STATE, vbucket=vb, extras=bytes([STATE_CODES["active"]]),
                value=orjson.dumps({"topology": [["n0"], ["n0"], ["n0"]]}))
    c.set_replication_topology(vb, ["n0"])
    assert c.set(k, b"w", vbucket=vb, durability=MAJ).seqno == 4


def _key_of(c: Cluster, vb: int, prefix: str = "k") -> str:
    return next(f"{prefix}{i}" for i in range(10_000) if c.vbucket_of(f"{prefix}{i}") == vb)


def _flush(c: Cluster) -> None:
    for n in c.nodes.values():
        if n.up:
            assert n.bucket is not None
            n.bucket.flush_all()


def _step_mover_only(c: Cluster, reb: Rebalance, move: VBucketMove, until: MovePhase, rounds: int = 500) -> None:
    """Advance the rebalance alone (the map's replication connections do not move: the old chain's
    replicas lag) until ``move`` reaches ``until``."""
    order = list(MovePhase)
    for _ in range(rounds):
        if order.index(move.phase) >= order.index(until):
            return
        reb.step()
        _flush(c)
    raise AssertionError(f"move of vbucket {move.vbucket} stuck in {move.phase}")


def _takeover_move(c: Cluster, reb: Rebalance) -> VBucketMove:
    return next(m for m in reb.queue + reb.running if m.takeover)


def test_sync_write_in_flight_across_a_takeover_commits_on_the_new_active(tmp_path: Path) -> None:
    clock = ManualClock()
    with Cluster.create(tmp_path / "c", nodes=3, replicas=1, num_vbuckets=NVB, seed=3, clock=clock) as c:
        c.settle()
        client = CountingClient(c)
        reb = c.start_rebalance(add=["n3"])
        move = _takeover_move(c, reb)
        vb = move.vbucket
        key = _key_of(c, vb)
        # Wait until the takeover stream runs; then a sync write reaches the old active's node (kv_engine
        # accepts writes until the vbucket is dead; the manager's TMPFAIL is only the front end's routing).
        _step_mover_only(c, reb, move, MovePhase.TAKEOVER)
        src = c.node(move.source).require_bucket()
        monitor = src.vbucket(vb).durability
        assert monitor is not None
        assert monitor.second_chain == tuple(move.new)
        sw = src.set(key, b"in-flight", vbucket=vb, durability=MAJ)
        # only the mover moves: the old chain's replica never acks, the takeover goes on anyway
        _step_mover_only(c, reb, move, MovePhase.DONE)
        assert src.vbucket(vb).state is VBucketState.DEAD
        assert sw.state is SyncWriteState.AMBIGUOUS
        with pytest.raises(SyncWriteAmbiguous):
            sw.result()
        new = c.node(move.target).require_bucket().vbucket(vb)
        assert new.state is VBucketState.ACTIVE
        # the new active holds the prepare (no waiter: infinite timeout) ...
        assert key.encode() in new.prepares or new.ht.get(key.encode()) is not None
        clock.advance(3600)  # ... never aborted by timeout
        while not reb.done:
            c.pump()
        c.settle()
        assert c.get(key).value == b"in-flight"
        assert not new.prepares and new.durability is not None and new.durability.aborts == 0
        client.poll()
        assert client.seen[key.encode()] == [b"in-flight"]  # exactly once, at the commit
        assert client.state() == actives_state(c)
        assert_replicas_equal_actives(c)


@pytest.mark.parametrize("after_dead", [False, True])
def test_reverted_takeover_keeps_the_prepare(tmp_path: Path, after_dead: bool) -> None:
    clock = ManualClock()
    with Cluster.create(tmp_path / "c", nodes=3, replicas=1, num_vbuckets=NVB, seed=3, clock=clock) as c:
        c.settle()
        reb = c.start_rebalance(add=["n3"])
        move = _takeover_move(c, reb)
        vb = move.vbucket
        key = _key_of(c, vb)
        _step_mover_only(c, reb, move, MovePhase.TAKEOVER)
        src = c.node(move.source).require_bucket()
        sw = src.set(key, b"kept", vbucket=vb, durability=MAJ)
        if after_dead:
            for _ in range(100):
                if src.vbucket(vb).state is VBucketState.DEAD:
                    break
                reb.step()
            assert src.vbucket(vb).state is VBucketState.DEAD
            assert move.phase is MovePhase.TAKEOVER
        reb._revert(move)  # the mover puts the original states back (docs/rebalance.md "The mover")
        assert src.vbucket(vb).state is VBucketState.ACTIVE
        assert c.node(move.target).require_bucket().vbucket(vb).state is VBucketState.REPLICA
        # dead for a moment: the waiter was answered ambiguous; else it still waits
        assert sw.state is (SyncWriteState.AMBIGUOUS if after_dead else SyncWriteState.PENDING)
        assert key.encode() in src.vbucket(vb).prepares  # the prepare stays and completes
        if after_dead:
            clock.advance(3600)  # a prepare without a waiter is never aborted by timeout
        while not reb.done:
            c.pump()
        c.settle()
        assert reb.status == "done" and reb.reverts == 1
        if not after_dead:
            assert sw.result().seqno == c.get(key).seqno  # the waiter got the commit
        assert c.get(key).value == b"kept"
        for n in c.nodes.values():
            assert n.bucket is not None
            m = n.bucket.vbucket(vb).durability
            assert m is None or m.aborts == 0  # the kept prepare was never aborted
        assert_replicas_equal_actives(c)


# ---------------------------------------------------------------------- an acked write, a rebalance, a failover
@pytest.mark.parametrize("replicas", [1, 2])
def test_acked_majority_write_survives_rebalance_then_hard_failover_of_any_node(
        tmp_path: Path, replicas: int) -> None:
    for victim in ["n0", "n1", "n2", "n3"]:
        clock = ManualClock()
        with Cluster.create(tmp_path / f"c{victim}", nodes=3, replicas=replicas, num_vbuckets=NVB, seed=3,
                            clock=clock) as c:
            c.settle()
            keys = [_key_of(c, vb, "d") for vb in range(NVB)]
            for key in keys:
                vb = c.vbucket_of(key)
                a, r1 = c.vbucket_map().chains[vb][:2]
                assert a and r1
                sw = c.submit(key, b"acked-" + key.encode(), durability=MAJ)
                c.pump(only=[(a, r1)], flush=False)  # a majority (a, r1) holds the prepare; only a the commit
                assert sw.committed
            c.rebalance(add=["n3"])  # every vbucket rebalanced over 4 nodes while the commits travel
            assert c.vbucket_map().nodes == ["n0", "n1", "n2", "n3"]
            c.kill(victim)
            c.failover(victim)
            c.settle()
            for key in keys:
                vb = c.vbucket_of(key)
                active = c.active_bucket(vb).vbucket(vb)
                it = active.ht.get(key.encode())
                assert it is not None and it.value == b"acked-" + key.encode(), (victim, key, vb)
                assert c.get(key).value == b"acked-" + key.encode()
            assert_replicas_equal_actives(c)


# ---------------------------------------------------------------------- the campaign (issue 6 proof 3)
_RB_BUILDERS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    **_DUR_BUILDERS,
    # a sync write that reaches the node the map names active, bypassing the manager's TMPFAIL of a moving
    # vbucket (kv_engine accepts writes until the vbucket is dead): prepares in flight across takeovers
    "sync_node": st.tuples(st.just("sync_node"), st.integers(1, 3), st.sampled_from([0, 1500, 0xFFFF])),
    "rebalance_in": st.tuples(st.just("rebalance_in"), st.integers(0, 3)),
    "rebalance_out": st.tuples(st.just("rebalance_out"), st.integers(0, 4)),
    "rebalance_swap": st.tuples(st.just("rebalance_swap"), st.integers(0, 4)),
    # the mover alone (the map's connections lag) or whole pumps
    "rebalance_step": st.tuples(st.just("rebalance_step"), st.integers(1, 6), st.booleans()),
    "rebalance_finish": st.tuples(st.just("rebalance_finish")),
    # a sync write to the source of a running takeover, then mover-only steps: a prepare in flight when the
    # old active goes dead
    "takeover_write": st.tuples(st.just("takeover_write"), st.integers(1, 3), st.integers(1, 4)),
}
_RB_WEIGHTS = {"sync": 8, "sync_node": 5, "plain": 2, "pump": 5, "pump_all": 2, "flush": 3, "tick": 2,
               "crash": 1, "restart": 2, "hard_failover": 2, "rebalance_in": 2, "rebalance_out": 2,
               "rebalance_swap": 1, "rebalance_step": 8, "rebalance_finish": 1, "takeover_write": 3}
_rb_op = st.sampled_from([k for k, w in _RB_WEIGHTS.items() for _ in range(w)]).flatmap(lambda k: _RB_BUILDERS[k])


class RebalanceDurabilityHarness(Harness):
    """test_durability_properties' harness (its invariants) plus rebalances and repeated hard failovers."""

    def __init__(self, base: Path, nodes: int, replicas: int) -> None:
        super().__init__(base, nodes, replicas)
        self.started: list[Rebalance] = []
        self.fresh = 0
        self.rstats = {"takeover_prepares": 0, "node_syncs": 0, "ambiguous_committed": 0}
        #: writes answered SYNC_WRITE_AMBIGUOUS (by a takeover, a failover or a timeout): key -> value
        self.ambiguous: dict[bytes, bytes] = {}

    def _collect(self) -> None:
        for sw, value, _level in self.pending:
            if sw.state is SyncWriteState.AMBIGUOUS:
                self.ambiguous[sw.key] = value
        super()._collect()

    def _can_fail_over(self, name: str) -> bool:
        """A majority of each chain survives: every chain holding ``name`` has no other node down and no
        empty slot beyond what its majority allows after losing ``name`` (an acknowledged write is on a
        majority, so at least one of its holders remains)."""
        c = self.cluster
        vbmap = c.vbucket_map()
        if name not in vbmap.nodes or len(vbmap.nodes) < 2 or name in c.failed:
            return False
        for chain in vbmap.chains:
            if name not in chain:
                continue
            lost = sum(1 for n in chain if n is None or n == name or not c.nodes[n].up)
            if lost > majority(chain) - 1:
                return False
        return True

    def _start(self, add: list[str], remove: list[str]) -> None:
        c = self.cluster
        if c.rebalance_running is not None:
            return
        with contextlib.suppress(InvalidArgument, TemporaryFailure):
            self.started.append(c.start_rebalance(add=add, remove=remove))

    def _new_name(self) -> str:
        self.fresh += 1
        return f"x{self.fresh}"

    def _mover_step(self, whole: bool) -> None:
        c = self.cluster
        reb = c.rebalance_running
        if reb is None:
            return
        taking = [m for m in reb.running if m.phase is MovePhase.TAKEOVER]
        if whole:
            c.pump()
        else:
            reb.step()
        for m in taking:
            # the old active is dead: what it still held as prepares went to the new active
            if m.source in c.nodes and c.nodes[m.source].up:
                src = c.nodes[m.source].bucket
                assert src is not None
                if src.vbucket(m.vbucket).state is VBucketState.DEAD:
                    self.rstats["takeover_prepares"] += len(src.vbucket(m.vbucket).prepares)

    def _takeover_write(self, level: Level, steps: int) -> None:
        c = self.cluster
        reb = c.rebalance_running
        moves = [] if reb is None else [m for m in reb.running if m.phase is MovePhase.TAKEOVER]
        if not moves or not c.nodes[moves[0].source].up:
            return
        m = moves[0]
        b = c.nodes[m.source].bucket
        assert b is not None
        self.n += 1
        key = _key_of(c, m.vbucket, f"t{self.n}-")
        value = f"v{self.n}".encode()
        with contextlib.suppress(NotMyVBucket, DurabilityImpossible, SyncWriteInProgress):
            sw = b.set(key, value, vbucket=m.vbucket, durability=Durability(level))
            self.pending.append((sw, value, int(level)))
            self.rstats["node_syncs"] += 1
        for _ in range(steps):
            self._mover_step(False)

    def _finish(self) -> None:
        c = self.cluster
        for _ in range(100_000):
            if c.rebalance_running is None:
                return
            c.pump()
        raise AssertionError("rebalance never finished")

    def run(self, ops: list[tuple[Any, ...]]) -> None:
        c = self.cluster
        for o in ops:
            kind = o[0]
            vbmap = c.vbucket_map()
            if kind == "rebalance_in":
                back = sorted(set(c.ejected + c.failed) - set(vbmap.nodes))
                self._start([back[o[1] % len(back)] if back and o[1] % 2 else self._new_name()], [])
            elif kind == "rebalance_out":
                self._start([], [vbmap.nodes[o[1] % len(vbmap.nodes)]])
            elif kind == "rebalance_swap":
                self._start([self._new_name()], [vbmap.nodes[o[1] % len(vbmap.nodes)]])
            elif kind == "rebalance_step":
                for _ in range(o[1]):
                    self._mover_step(o[2])
            elif kind == "rebalance_finish":
                self._finish()
            elif kind == "sync_node":
                self.n += 1
                key, value = f"s{self.n}", f"v{self.n}".encode()
                vb = c.vbucket_of(key)
                with contextlib.suppress(NotMyVBucket, TemporaryFailure, DurabilityImpossible, SyncWriteInProgress):
                    c.push_topologies()
                    sw = c.active_bucket(vb).set(key, value, vbucket=vb, durability=Durability(Level(o[1]), o[2]))
                    self.pending.append((sw, value, o[1]))
                    self.rstats["node_syncs"] += 1
            elif kind == "takeover_write":
                self._takeover_write(Level(o[1]), o[2])
            elif kind == "hard_failover":
                name = self._name(o[1])
                if self._can_fail_over(name):
                    if o[2] and c.nodes[name].up:
                        c.kill(name)  # dies, then failed over: the majority elsewhere is what survives it
                    c.failover(name)
                    self.failovers += 1
            else:
                self.step(o)
            self._collect()
        for name in c.vbucket_map().nodes:
            if not c.nodes[name].up:
                c.restart(name)
        self._finish()
        c.settle()
        self._collect()
        self.check()
        state = actives_state(c)
        for doc_key in sorted(state):
            assert c.get(doc_key).value == state[doc_key][0]  # GETs agree with the actives
        for doc_key, value in self.ambiguous.items():
            if doc_key in state and state[doc_key][0] == value:
                self.rstats["ambiguous_committed"] += 1  # answered ambiguous, committed by a new active
        c.close()


RB_MAX_EXAMPLES = int(os.environ.get("DURABILITY_REBALANCE_EXAMPLES", "60"))
RB_STATS = {"runs": 0, "rebalances": 0, "finished": 0, "moved": 0, "failovers": 0, "acked": 0, "checked": 0,
            "ambiguous": 0, "awaiting_recommit": 0, "takeover_prepares": 0, "node_syncs": 0,
            "ambiguous_committed": 0}


@settings(max_examples=RB_MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_rb_op, min_size=20, max_size=90), nodes=st.integers(3, 4), replicas=st.integers(1, 2))
def test_rebalance_failover_sync_write_schedules_lose_no_acknowledged_durable_write(
        tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[Any, ...]], nodes: int, replicas: int) -> None:
    h = RebalanceDurabilityHarness(tmp_path_factory.mktemp("durreb"), nodes, replicas)
    h.run(ops)
    RB_STATS["runs"] += 1
    RB_STATS["rebalances"] += len(h.started)
    RB_STATS["finished"] += sum(1 for r in h.started if r.status == "done")
    RB_STATS["moved"] += sum(r.moved for r in h.started)
    RB_STATS["failovers"] += h.failovers
    for k in ("acked", "checked", "ambiguous", "awaiting_recommit"):
        RB_STATS[k] += h.stats[k]
    for k in ("takeover_prepares", "node_syncs", "ambiguous_committed"):
        RB_STATS[k] += h.rstats[k]


def test_report_campaign_counts() -> None:
    # Not an invariant: the campaign's size, visible with -s.
    print(f"\ndurability x rebalance campaign: {RB_STATS} at {time.strftime('%H:%M:%S')}")


# ---------------------------------------------------------------------- node processes
@pytest.mark.slow
def test_process_rebalance_with_sync_writes_then_hard_failover_loses_no_acked_write(tmp_path: Path) -> None:
    """Node processes (ProcessRebalance: the destination's own replication links, which enable sync writes, are
    the mover's consumers; the second chain travels in SET_VBUCKET_STATE's topology): sync writes of every
    level while n3 is rebalanced in and n0 out, then n1 is SIGKILLed and hard failed over -- every acknowledged
    durable write is visible on the new actives, replicas equal actives."""
    from engine.network.process_cluster import ProcessCluster
    from tests.engine.process_model import actives_state as process_actives_state
    from tests.engine.process_model import assert_replicas_equal_actives as process_replicas_equal

    c = ProcessCluster.start(tmp_path / "pc", nodes=3, replicas=2, num_vbuckets=NVB, checkpoint_max_items=3,
                             backfill_chunk_items=2)
    try:
        acked: dict[bytes, bytes] = {}
        refused = {"n": 0, "ambiguous": 0}
        counter = {"i": 0}

        def write(n: int) -> None:
            for _ in range(n):
                counter["i"] += 1
                i = counter["i"]
                key, value = f"d{i % 48}", f"v{i}"
                level = Level(1 + i % 3)
                try:
                    c.write(key, value, durability=Durability(level, 10_000))
                except (TemporaryFailure, NotMyVBucket, SyncWriteInProgress, DurabilityImpossible):
                    refused["n"] += 1
                    continue
                except SyncWriteAmbiguous:
                    refused["ambiguous"] += 1
                    acked.pop(key.encode(), None)  # outcome unknown: no longer checked
                    continue
                acked[key.encode()] = value.encode()

        write(40)
        assert c.rebalance(add=["n3"], progress=lambda p: write(1)).status == "done"
        assert c.rebalance(remove=["n0"], progress=lambda p: write(1)).status == "done"
        write(10)
        c.kill("n1")
        c.failover("n1")
        c.settle()
        state = process_actives_state(c)
        for k, v in acked.items():
            assert state.get(k, (None,))[0] == v, (k, refused)
        process_replicas_equal(c)
        assert len(acked) >= 40
    finally:
        c.close(clean=False)


_PROC_OP = st.one_of(
    st.tuples(st.just("sync"), st.integers(1, 3)),
    st.tuples(st.just("sync"), st.integers(1, 3)),
    st.tuples(st.just("pause"), st.integers(0, 4)),
    st.tuples(st.just("resume")),
    st.tuples(st.just("rebalance_in"), st.integers(1, 3)),
    st.tuples(st.just("rebalance_out"), st.integers(0, 4), st.integers(1, 3)),
    st.tuples(st.just("crash"), st.integers(0, 4)),
    st.tuples(st.just("failover"), st.integers(0, 4)),
)
PROC_EXAMPLES = int(os.environ.get("DURABILITY_REBALANCE_PROCESS_EXAMPLES", "4"))
PROC_STATS = {"runs": 0, "rebalances": 0, "moved": 0, "acked": 0, "checked": 0, "failovers": 0, "crashes": 0}


@pytest.mark.slow
@settings(max_examples=PROC_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(_PROC_OP, min_size=6, max_size=14))
def test_process_rebalance_sync_write_schedules_lose_no_acknowledged_durable_write(
        tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[Any, ...]]) -> None:
    """Node processes, 3+ nodes with 2 replicas: sync writes of every level (also inside rebalances, from the
    progress callback), paused replication, SIGKILL + restart, rebalance in / out, SIGKILL + hard failover
    while every chain is whole (a majority of each chain survives). Zero lost acknowledged durable writes
    (PERSIST_TO_MAJORITY always, the in-memory levels when no other node crashed after the ack)."""
    from engine.exceptions import EngineError
    from engine.network.process_cluster import ProcessCluster

    base = tmp_path_factory.mktemp("pdurreb")
    acked: dict[str, tuple[bytes, int, int]] = {}
    state = {"n": 0, "crashes": 0, "fresh": 0}
    with ProcessCluster.start(base, nodes=3, replicas=2, num_vbuckets=NVB, seed=5) as pc:

        def sync(level: int) -> None:
            state["n"] += 1
            key, value = f"s{state['n']}", f"v{state['n']}".encode()
            try:
                pc.write(key, value, durability=Durability(Level(level), 3000))
            except EngineError:
                return  # ambiguous, impossible, moving (TMPFAIL), node down: not acknowledged
            acked[key] = (value, level, state["crashes"])

        def rebalance(add: list[str], remove: list[str], level: int) -> None:
            pc.resume_replication()
            with contextlib.suppress(EngineError):
                p = pc.rebalance(add=add, remove=remove, progress=lambda _p: sync(level))
                PROC_STATS["rebalances"] += 1
                PROC_STATS["moved"] += p.moved

        for o in ops:
            kind = o[0]
            nodes = list(pc.vbucket_map().nodes)
            if kind == "sync":
                sync(o[1])
            elif kind == "pause":
                pc.resume_replication()
                pc.pause_replication([nodes[o[1] % len(nodes)]])  # one replica lags at a time
            elif kind == "resume":
                pc.resume_replication()
            elif kind == "rebalance_in":
                state["fresh"] += 1
                rebalance([f"x{state['fresh']}"], [], o[1])
            elif kind == "rebalance_out" and len(nodes) > 3:
                rebalance([], [nodes[o[1] % len(nodes)]], o[2])
            elif kind == "crash":
                name = nodes[o[1] % len(nodes)]
                pc.kill(name)
                pc.restart(name)
                state["crashes"] += 1
                PROC_STATS["crashes"] += 1
            elif kind == "failover" and len(nodes) > 3 and all(
                    None not in ch for ch in pc.vbucket_map().chains):
                pc.resume_replication()
                name = nodes[o[1] % len(nodes)]
                pc.kill(name)  # SIGKILL, then hard failover: every chain keeps a majority
                pc.failover(name)
                PROC_STATS["failovers"] += 1
        pc.resume_replication()
        pc.settle()
        for key, (value, level, at) in acked.items():
            PROC_STATS["acked"] += 1
            if level != Level.PERSIST_TO_MAJORITY and at != state["crashes"]:
                continue
            deadline = time.monotonic() + 15
            while True:
                with contextlib.suppress(EngineError):
                    if pc.get(key).value == value:
                        break
                assert time.monotonic() < deadline, f"lost acknowledged durable write {key} (level {level})"
                time.sleep(0.02)
            PROC_STATS["checked"] += 1
    PROC_STATS["runs"] += 1


def test_report_process_campaign_counts() -> None:
    print(f"\nprocess durability x rebalance campaign: {PROC_STATS} at {time.strftime('%H:%M:%S')}")
