"""The random cluster schedules of the hypothesis campaigns (test_cluster_properties.py, test_rebalance_properties.py):
the operations and their frequencies, and the Harness that runs a schedule on an in-process cluster and checks the
invariants after it."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from engine import KeyNotFound, MutationToken, NotMyVBucket, TemporaryFailure
from engine.cluster.local import Cluster
from tests.engine.cluster_model import ClusterClient, actives_state, assert_replicas_equal_actives

KEYS = [f"k{i}" for i in range(16)]
NVB = 8

_BUILDERS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    "write": st.tuples(st.just("write"), st.sampled_from(KEYS), st.binary(min_size=1, max_size=6)),
    "delete": st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    # pump some connections only (bitmask over the sorted connections), a few messages each
    "pump": st.tuples(st.just("pump"), st.integers(0, 2**12 - 1), st.integers(1, 8), st.booleans()),
    "pump_all": st.tuples(st.just("pump_all")),
    "flush": st.tuples(st.just("flush"), st.integers(0, 3)),
    "client": st.tuples(st.just("client"), st.integers(0, 1)),
    "crash": st.tuples(st.just("crash"), st.integers(0, 3)),
    "restart": st.tuples(st.just("restart"), st.integers(0, 3)),
    "hard_failover": st.tuples(st.just("hard_failover"), st.integers(0, 3)),
    "graceful_failover": st.tuples(st.just("graceful_failover"), st.integers(0, 3)),
}
#: relative frequencies of the operations in a schedule
_WEIGHTS = {"write": 10, "delete": 2, "pump": 4, "pump_all": 3, "flush": 2, "client": 3, "crash": 1,
            "restart": 2, "hard_failover": 1, "graceful_failover": 1}
op = st.sampled_from([k for k, w in _WEIGHTS.items() for _ in range(w)]).flatmap(lambda k: _BUILDERS[k])


class Harness:
    def __init__(self, base: Path, nodes: int, replicas: int) -> None:
        self.cluster = Cluster.create(base, nodes=nodes, replicas=replicas, num_vbuckets=NVB, seed=5,
                                      checkpoint_max_items=3, backfill_chunk_items=2)
        self.clients = [ClusterClient(self.cluster, "client-a"), ClusterClient(self.cluster, "client-b")]
        self.clients[1].consumer.use_client_log = False  # kv_engine's newest-vbuuid-only requests
        self.tokens: list[MutationToken] = []
        self.failovers = 0
        self.checked = 0
        self.client_rollbacks = 0
        self.replica_rollbacks = 0

    def _name(self, i: int) -> str:
        names = sorted(self.cluster.nodes)
        return names[i % len(names)]

    def _can_fail_over(self, name: str, graceful: bool) -> bool:
        c = self.cluster
        vbmap = c.vbucket_map()
        if name not in vbmap.nodes or len(vbmap.nodes) < 2:
            return False
        if graceful and not c.nodes[name].up:
            return False
        # keep every vbucket alive: each active on the node needs a live replica
        return all(any(c.nodes[r].up for r in vbmap.replicas(vb)) for vb in vbmap.vbuckets_of(name, 0))

    def _replicated(self) -> list[MutationToken]:
        out = []
        for t in self.tokens:
            try:
                if self.cluster.is_replicated(t, persisted=True):
                    out.append(t)
            except (NotMyVBucket, TemporaryFailure):
                pass
        return out

    def failover(self, name: str, graceful: bool) -> None:
        c = self.cluster
        safe = self._replicated()
        c.failover(name, graceful=graceful)
        self.failovers += 1
        for t in safe:
            r = c.observe_seqno(t.vbucket, t.vbuuid)
            assert (not r.failed_over) or (r.last_seqno is not None and t.seqno <= r.last_seqno), (t, r)
            active = c.active_bucket(t.vbucket).vbucket(t.vbucket)
            assert active.high_seqno >= t.seqno
            self.checked += 1

    def plain_step(self, o: tuple[Any, ...]) -> bool:
        """One write, delete, pump, flush or client poll of a schedule; False for another kind of operation."""
        c = self.cluster
        kind = o[0]
        if kind == "write":
            with contextlib.suppress(NotMyVBucket, TemporaryFailure):
                self.tokens.append(c.write(o[1], o[2]).token)
        elif kind == "delete":
            with contextlib.suppress(NotMyVBucket, TemporaryFailure, KeyNotFound):
                self.tokens.append(c.delete(o[1]).token)
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
        elif kind == "client":
            self.clients[o[1]].poll()
        else:
            return False
        return True

    def run(self, ops: list[tuple[Any, ...]]) -> None:
        c = self.cluster
        for o in ops:
            kind = o[0]
            if self.plain_step(o):
                continue
            if kind == "crash":
                name = self._name(o[1])
                if c.nodes[name].up:
                    c.kill(name)
            elif kind == "restart":
                name = self._name(o[1])
                if not c.nodes[name].up:
                    c.restart(name)
            elif kind in ("hard_failover", "graceful_failover"):
                name = self._name(o[1])
                graceful = kind == "graceful_failover"
                if self._can_fail_over(name, graceful):
                    self.failover(name, graceful)
        # Final: every node of the map back up, replication settled, clients caught up.
        for name in c.vbucket_map().nodes:
            if not c.nodes[name].up:
                c.restart(name)
        c.settle()
        assert_replicas_equal_actives(c)  # (c)
        expected = actives_state(c)
        for client in self.clients:
            client.poll()
            assert client.state() == expected  # (a)
            self.client_rollbacks += sum(len(s.rollbacks) for s in client.consumer.vbs.values())
        self.replica_rollbacks = sum(
            int(n.bucket.stats()["replica_rollbacks"]) for n in c.nodes.values() if n.bucket is not None)
        c.close()
