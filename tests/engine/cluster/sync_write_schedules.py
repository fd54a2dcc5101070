"""The random sync-write schedules of the hypothesis campaigns (test_durability_properties.py,
test_durability_rebalance.py): the operations and their frequencies, and the Harness that runs a schedule on an
in-process cluster and checks the durability invariants after it."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from engine import NotMyVBucket, TemporaryFailure
from engine.cluster.local import Cluster
from engine.exceptions import DurabilityImpossible, SyncWriteInProgress
from engine.kv.durability import Durability, Level, ManualClock, SyncWrite, durability_possible
from tests.engine.cluster_model import ClusterClient, actives_state, assert_replicas_equal_actives

NVB = 8

_BUILDERS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    "sync": st.tuples(st.just("sync"), st.integers(1, 3), st.sampled_from([0, 0, 1500, 3000, 0xFFFF])),
    "plain": st.tuples(st.just("plain"), st.integers(0, 7)),
    "pump": st.tuples(st.just("pump"), st.integers(0, 2**12 - 1), st.integers(1, 6), st.booleans()),
    "pump_all": st.tuples(st.just("pump_all")),
    "flush": st.tuples(st.just("flush"), st.integers(0, 3)),
    "tick": st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 2.0, 5.0, 12.0])),
    "crash": st.tuples(st.just("crash"), st.integers(0, 3)),
    "restart": st.tuples(st.just("restart"), st.integers(0, 3)),
    "hard_failover": st.tuples(st.just("hard_failover"), st.integers(0, 3), st.booleans()),
}
_WEIGHTS = {"sync": 10, "plain": 2, "pump": 6, "pump_all": 2, "flush": 2, "tick": 2, "crash": 1, "restart": 2,
            "hard_failover": 1}
op = st.sampled_from([k for k, w in _WEIGHTS.items() for _ in range(w)]).flatmap(lambda k: _BUILDERS[k])


class Harness:
    def __init__(self, base: Path, nodes: int, replicas: int) -> None:
        self.clock = ManualClock()
        self.cluster = Cluster.create(base, nodes=nodes, replicas=replicas, num_vbuckets=NVB, seed=11,
                                      clock=self.clock, checkpoint_max_items=3, backfill_chunk_items=2)
        self.client = ClusterClient(self.cluster, "client-nosync")
        self.pending: list[tuple[SyncWrite, bytes, int]] = []
        #: acked writes: key -> (value, level, crashes seen when the write was submitted)
        self.acked: dict[bytes, tuple[bytes, int, int]] = {}
        #: crashes seen when each sync write of :meth:`step` was submitted (by key): a replica's seqno-ack can
        #: precede the client's ack, and a crash of that replica in between still loses an in-memory level
        #: (docs/durability.md "What survives what"). Writes a subclass submits count from their ack.
        self.crashes_at_submit: dict[bytes, int] = {}
        self.crashes = 0
        self.failovers = 0
        self.n = 0
        self.stats = {"acked": 0, "ambiguous": 0, "checked": 0, "awaiting_recommit": 0}

    def _name(self, i: int) -> str:
        names = sorted(self.cluster.nodes)
        return names[i % len(names)]

    def _collect(self) -> None:
        still = []
        for sw, value, level in self.pending:
            if sw.committed:
                self.acked[sw.key] = (value, level, self.crashes_at_submit.get(sw.key, self.crashes))
                self.stats["acked"] += 1
            elif sw.done:
                self.stats["ambiguous"] += 1
            else:
                still.append((sw, value, level))
        self.pending = still

    def _can_fail_over(self, name: str) -> bool:
        c = self.cluster
        vbmap = c.vbucket_map()
        if self.failovers or name not in vbmap.nodes or len(vbmap.nodes) < 2:
            return False
        # one failure at a time: a majority of every chain must survive the failover (with another node down
        # too, a node that missed an acknowledged write could be promoted -- no durability level survives the
        # loss of a majority, in kv_engine either)
        return all(c.nodes[n].up for n in vbmap.nodes if n != name)

    def step(self, o: tuple[Any, ...]) -> None:
        """One operation other than a hard failover: sync, plain, pumps, flush, tick, crash, restart."""
        c = self.cluster
        kind = o[0]
        if kind == "sync":
            self.n += 1
            key, value = f"s{self.n}", f"v{self.n}".encode()
            with contextlib.suppress(NotMyVBucket, TemporaryFailure, DurabilityImpossible):
                sw = c.submit(key, value, durability=Durability(Level(o[1]), o[2]))
                self.pending.append((sw, value, o[1]))
                self.crashes_at_submit[sw.key] = self.crashes
        elif kind == "plain":
            with contextlib.suppress(NotMyVBucket, TemporaryFailure, SyncWriteInProgress):
                c.write(f"p{o[1]}", f"plain{self.n}".encode())
        elif kind == "pump":
            conns = c.connections()
            only = [k for i, k in enumerate(conns) if o[1] >> i & 1]
            c.pump(only=only, max_messages=o[2], flush=o[3])
        elif kind == "pump_all":
            c.pump(rounds=4)
        elif kind == "flush":
            node = c.nodes[self._name(o[1])]
            if node.up:
                assert node.bucket is not None
                node.bucket.flush_all()
        elif kind == "tick":
            self.clock.advance(o[1])
            c.process_durability_timeouts()
        elif kind == "crash":
            name = self._name(o[1])
            if c.nodes[name].up:
                c.kill(name)
                self.crashes += 1
        elif kind == "restart":
            name = self._name(o[1])
            if not c.nodes[name].up:
                c.restart(name)

    def run(self, ops: list[tuple[Any, ...]]) -> None:
        c = self.cluster
        for o in ops:
            kind = o[0]
            if kind == "hard_failover":
                name = self._name(o[1])
                if self._can_fail_over(name):
                    if o[2] and c.nodes[name].up:
                        # the node dies, then it is failed over: not a crash the acknowledged writes must be
                        # spared -- losing it is exactly what the majority on the other nodes is for
                        c.kill(name)
                    c.failover(name)
                    self.failovers += 1
            else:
                self.step(o)
            self._collect()
        for name in c.vbucket_map().nodes:
            if not c.nodes[name].up:
                c.restart(name)
        c.settle()
        self._collect()
        self.check()
        c.close()

    def check(self) -> None:
        c = self.cluster
        vbmap = c.vbucket_map()
        for key, (value, level, crashes) in self.acked.items():
            if level != Level.PERSIST_TO_MAJORITY and crashes != self.crashes:
                continue  # in-memory durability: not guaranteed past a crash after a replica's seqno-ack
            vb = c.vbucket_of(key)
            active = c.active_bucket(vb).vbucket(vb)
            it = active.ht.get(key)
            if it is not None and it.value == value and it.op.value == 0:
                self.stats["checked"] += 1
                continue
            p = active.prepares.get(key)
            assert p is not None and p.value == value and not durability_possible(vbmap.chains[vb]), (
                f"lost acknowledged durable write {key!r} level {level} (vb {vb}, chain {vbmap.chains[vb]})")
            self.stats["awaiting_recommit"] += 1
        for vb, chain in enumerate(vbmap.chains):
            if chain[0] is None:
                continue
            active = c.active_bucket(vb).vbucket(vb)
            if durability_possible(chain):
                assert not active.prepares, (vb, chain, active.prepares)
            for r in vbmap.replicas(vb):
                rb = c.nodes[r].bucket
                assert rb is not None
                rv = rb.vbucket(vb)
                assert {k: p.seqno for k, p in rv.prepares.items()} == {
                    k: p.seqno for k, p in active.prepares.items()}, (vb, r)
        assert_replicas_equal_actives(c)
        self.client.poll()
        assert self.client.state() == actives_state(c)
