"""The random schedules of the node-process campaigns (test_process_cluster.py, test_process_rebalance.py):
the operations and their frequencies, and the Campaign that runs a schedule on node processes and checks the
invariants after it."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from engine import KeyNotFound, MutationToken, NotMyVBucket, TemporaryFailure
from engine.network.process_cluster import ProcessCluster
from tests.engine.process_model import ProcessClusterClient, actives_state, assert_replicas_equal_actives

NVB = 8
CFG: dict[str, Any] = {"checkpoint_max_items": 3, "backfill_chunk_items": 2}
KEYS = [f"k{i}" for i in range(24)]

_OPS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    "write": st.tuples(st.just("write"), st.sampled_from(KEYS), st.binary(min_size=1, max_size=6)),
    "burst": st.tuples(st.just("burst"), st.integers(2, 12)),
    "delete": st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    "pause": st.tuples(st.just("pause"), st.integers(0, 3)),
    "resume": st.tuples(st.just("resume"), st.integers(0, 3)),
    "persistence": st.tuples(st.just("persistence"), st.integers(0, 3), st.booleans()),
    "client": st.tuples(st.just("client"), st.integers(0, 1)),
    "wait": st.tuples(st.just("wait"), st.sampled_from([0.0, 0.02, 0.1])),
    "kill": st.tuples(st.just("kill"), st.integers(0, 3)),
    "restart": st.tuples(st.just("restart"), st.integers(0, 3)),
    "hard_failover": st.tuples(st.just("hard_failover"), st.integers(0, 3)),
    "graceful_failover": st.tuples(st.just("graceful_failover"), st.integers(0, 3)),
    # the scenario in one step: a node's replicas lag, clients read its newest items, SIGKILL, hard
    # failover
    "lagging_crash": st.tuples(st.just("lagging_crash"), st.integers(0, 3), st.integers(1, 10)),
}
_WEIGHTS = {"write": 8, "burst": 3, "delete": 2, "pause": 2, "resume": 2, "persistence": 2, "client": 3,
            "wait": 2, "kill": 2, "restart": 2, "hard_failover": 2, "graceful_failover": 1, "lagging_crash": 4}
op = st.sampled_from([k for k, w in _WEIGHTS.items() for _ in range(w)]).flatmap(lambda k: _OPS[k])


class Campaign:
    def __init__(self, base: Path, nodes: int) -> None:
        # a small replication flow-control buffer: the consumers' buffer acks are exercised all the time
        self.c = ProcessCluster.start(base, nodes=nodes, replicas=1, num_vbuckets=NVB, seed=None,
                                      replication_buffer_bytes=400, **CFG)
        self.clients = [ProcessClusterClient(self.c, "client-a"),
                        ProcessClusterClient(self.c, "client-b", use_client_log=False)]
        self.tokens: list[MutationToken] = []
        self.failovers = 0
        self.lagging_crashes = 0
        self.kills = 0
        self.checked = 0
        self.writes = 0
        self.lost: list[tuple[MutationToken, Any]] = []
        self.no_persist: set[str] = set()
        self.divergent: list[str] = []

    def _name(self, i: int) -> str:
        names = sorted(self.c.nodes)
        return names[i % len(names)]

    def _write(self, key: str, value: bytes) -> None:
        with contextlib.suppress(NotMyVBucket, TemporaryFailure):
            self.tokens.append(self.c.write(key, value).token)
            self.writes += 1

    def _can_fail_over(self, name: str, graceful: bool) -> bool:
        c = self.c
        vbmap = c.vbucket_map()
        if name not in vbmap.nodes or len(vbmap.nodes) < 2:
            return False
        if graceful and (not c.node(name).up or name in c.paused or self.no_persist or any(
                not c.node(n).up or n in c.paused for n in vbmap.nodes)):
            # a graceful failover waits until the replicas streamed and persisted the active's high seqno:
            # they must be streaming, and every node persisting (the manager refuses after its bound otherwise)
            return False
        return all(any(c.node(r).up for r in vbmap.replicas(vb)) for vb in vbmap.vbuckets_of(name, 0))

    def _acknowledged(self) -> list[MutationToken]:
        out = []
        for t in self.tokens:
            with contextlib.suppress(NotMyVBucket, TemporaryFailure):
                if self.c.is_replicated(t, persisted=True):
                    out.append(t)
        return out

    def _await_acks(self, timeout: float = 3.0) -> None:
        """When nothing holds replication back, wait until the writes so far are acknowledged (replicated and
        persisted), so the failover that follows has acknowledged writes to check."""
        c = self.c
        if c.paused or self.no_persist or not all(c.node(n).up for n in c.vbucket_map().nodes):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self._acknowledged()) < len(self.tokens):
            time.sleep(0.02)

    def failover(self, name: str, graceful: bool) -> None:
        c = self.c
        safe = self._acknowledged()
        c.failover(name, graceful=graceful)
        self.failovers += 1
        for t in safe:
            r = c.observe_seqno(t.vbucket, t.vbuuid)
            kept = (not r.failed_over) or (r.last_seqno is not None and t.seqno <= r.last_seqno)
            if not kept or r.current_seqno < t.seqno:
                self.lost.append((t, r))
            self.checked += 1

    def run(self, ops: list[tuple[Any, ...]]) -> None:
        for o in ops:
            self.step(o)
        self.finish()

    def step(self, o: tuple[Any, ...]) -> None:
        c = self.c
        kind = o[0]
        if kind == "write":
            self._write(o[1], o[2])
        elif kind == "burst":
            for i in range(o[1]):
                self._write(KEYS[(i * 7 + len(self.tokens)) % len(KEYS)], f"b{len(self.tokens)}".encode())
        elif kind == "delete":
            with contextlib.suppress(NotMyVBucket, TemporaryFailure, KeyNotFound):
                self.tokens.append(c.delete(o[1]).token)
        elif kind == "pause":
            c.pause_replication([self._name(o[1])])
        elif kind == "resume":
            c.resume_replication([self._name(o[1])])
        elif kind == "persistence":
            name = self._name(o[1])
            if c.node(name).up:
                (c.start_persistence if o[2] else c.stop_persistence)(name)
                (self.no_persist.discard if o[2] else self.no_persist.add)(name)
        elif kind == "client":
            self.clients[o[1]].poll_once()
        elif kind == "wait":
            time.sleep(o[1])
        elif kind == "kill":
            name = self._name(o[1])
            if c.node(name).up:
                c.kill(name)
                self.kills += 1
                self.no_persist.discard(name)  # a restarted node persists again
        elif kind == "restart":
            name = self._name(o[1])
            if not c.node(name).up:
                c.restart(name)
        elif kind == "lagging_crash":
            name = self._name(o[1])
            if c.node(name).up and self._can_fail_over(name, False):
                self._await_acks()
                before = set(c.paused)
                c.pause_replication([n for n in c.nodes if n != name])
                for i in range(o[2]):
                    self._write(KEYS[(i * 5 + len(self.tokens)) % len(KEYS)], f"l{len(self.tokens)}".encode())
                for client in self.clients:
                    client.poll(quiet_rounds=2)
                c.kill(name)
                self.kills += 1
                self.no_persist.discard(name)
                self.lagging_crashes += 1
                self.failover(name, False)
                c.resume_replication(set(c.paused) - before)
        elif kind in ("hard_failover", "graceful_failover"):
            name = self._name(o[1])
            graceful = kind == "graceful_failover"
            if self._can_fail_over(name, graceful):
                self.failover(name, graceful)

    def finish(self) -> None:
        c = self.c
        # Final: every node of the map up and persisting, replication resumed and settled.
        for name in c.vbucket_map().nodes:
            if not c.node(name).up:
                c.restart(name)
            c.start_persistence(name)
        c.resume_replication()
        c.settle()
        assert_replicas_equal_actives(c)
        expected = actives_state(c)
        for client in self.clients:
            try:
                client.converge(expected)
            except AssertionError as e:
                self.divergent.append(str(e))

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.c.close(clean=False)
