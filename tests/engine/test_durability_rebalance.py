"""Synchronous replication across a rebalance (seed 004 x seed 003, issue 6 proof 3) on the in-process cluster.

kv_engine rules checked here: the mover's streams enable sync writes, so prepares / commits / aborts reach the
new copies and they seqno-ack; during a move the active's topology has a second chain (the post-move one,
kv_engine ``setVBucketState`` ``topology`` with two chains) and a prepare needs a majority of both; when the
old active goes dead in the takeover with a prepare in flight its waiter gets SYNC_WRITE_AMBIGUOUS, the new
active holds the prepare and commits it once durable on the new topology (never aborted by timeout); a
takeover is never blocked by a prepare in flight and a reverted takeover keeps it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.cluster import Cluster
from engine.durability import Durability, Level, ManualClock, SyncWriteState
from engine.exceptions import SyncWriteAmbiguous
from engine.item import Item
from engine.rebalance import MovePhase, Rebalance, VBucketMove
from engine.vbucket import VBucketState
from tests.engine.cluster_model import ClusterClient, actives_state, assert_replicas_equal_actives

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
        assert src.vbucket(vb).durability is not None
        assert src.vbucket(vb).durability.second_chain == tuple(move.new)
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
        reb._revert(move)  # the mover puts the original states back (seed 003)
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
            assert n.bucket is not None and n.bucket.vbucket(vb).durability is None or \
                n.bucket.vbucket(vb).durability.aborts == 0  # type: ignore[union-attr]
        assert_replicas_equal_actives(c)
