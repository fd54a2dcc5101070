"""The cluster of engine node processes (engine/network/process_cluster.py): SIGKILL, hard and graceful failover, a DCP
client over TCP following the map, and a hypothesis campaign over random crash / failover schedules."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import KeyNotFound, MutationToken, NotMyVBucket, TemporaryFailure, VBucketState
from engine.cluster.vbucket_map import VBucketMap
from engine.exceptions import InvalidArgument
from engine.network.process_cluster import MAP_FILE, ProcessCluster
from tests.engine.process_model import ProcessClusterClient, actives_state, assert_replicas_equal_actives

NVB = 8
CFG: dict[str, Any] = {"checkpoint_max_items": 3, "backfill_chunk_items": 2}


#: make_cluster() (tests/engine/conftest.py) starts node processes with these options
CLUSTER = ProcessCluster
CLUSTER_DEFAULTS: dict[str, Any] = {**CFG, "num_vbuckets": NVB}


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_start_routes_and_replicates(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1)
    vbmap = c.vbucket_map()
    assert VBucketMap.from_json((c.base_dir / MAP_FILE).read_text()) == vbmap
    assert len({c.node(n).pid for n in vbmap.nodes}) == 3  # separate processes
    res = c.write("doc", b"v1")
    vb = c.vbucket_of("doc")
    assert c.get("doc").value == b"v1"
    replica = vbmap.replicas(vb)[0]
    with pytest.raises(NotMyVBucket):
        c.client(replica).get("doc", vbucket=vb)
    assert c.client(replica).vbucket_state(vb) is VBucketState.REPLICA
    _wait(lambda: c.is_replicated(res.token, persisted=True))
    c.settle()
    assert_replicas_equal_actives(c)
    c.delete("doc")
    with pytest.raises(KeyNotFound):
        c.get("doc")


def test_sigkill_active_with_lagging_replicas_then_hard_failover(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1)
    client = ProcessClusterClient(c, "client-a")
    client_b = ProcessClusterClient(c, "client-b", use_client_log=False)  # kv_engine newest-vbuuid requests
    # 1. writes acknowledged after observe said "replicated and persisted"
    acked: dict[str, MutationToken] = {}
    for i in range(48):
        acked[f"a{i}"] = c.write(f"a{i}", f"acked-{i}".encode()).token
    _wait(lambda: all(c.is_replicated(t, persisted=True) for t in acked.values()))
    # 2. the replicas stop receiving: the victim's newest items exist on it only; the clients read them
    victim = "n0"
    mine = c.vbucket_map().vbuckets_of(victim, 0)
    c.pause_replication()
    lost = {f"b{i}": c.write(f"b{i}", f"lagging-{i}".encode()).token for i in range(48)}
    lost_on_victim = {k: t for k, t in lost.items() if t.vbucket in mine}
    assert lost_on_victim
    client.converge(actives_state(c))
    client_b.converge(actives_state(c, "reader-b"))
    assert all(k.encode() in client.state() for k in lost_on_victim)
    old_uuids = {vb: c.client(victim).failover_log(vb)[0].vbuuid for vb in mine}
    # 3. SIGKILL the victim, hard failover
    c.kill(victim)
    report = c.failover(victim)
    assert sorted(report.promoted) == mine and not report.lost
    for vb in mine:
        entry = report.entries[vb]
        assert entry is not None and entry.vbuuid != old_uuids[vb]
        new_active = c.vbucket_map().active(vb)
        assert new_active == report.promoted[vb] and new_active != victim
        assert c.client(new_active).failover_log(vb)[0] == entry  # the new branch
        lost_here = [t.seqno for t in lost_on_victim.values() if t.vbucket == vb]
        if lost_here:
            assert entry.seqno < min(lost_here)  # the branch point is below everything the replica lacked
    c.resume_replication()
    # 4. the clients roll back and converge to the new actives' state
    expected = actives_state(c)
    client.converge(expected)
    client_b.converge(expected)
    assert client.rollbacks() >= 1 and client_b.rollbacks() >= 1
    for k in lost_on_victim:
        assert k.encode() not in expected  # the lagging writes of the victim's vbuckets are gone
    # 5. every write acknowledged as replicated and persisted survived
    for k, t in acked.items():
        assert c.get(k).value == f"acked-{k[1:]}".encode()
        r = c.observe_seqno(t.vbucket, t.vbuuid)
        assert not r.failed_over or (r.last_seqno is not None and t.seqno <= r.last_seqno)
    for t in lost_on_victim.values():
        assert not c.is_replicated(t)  # observe: "failover happened, re-check the document"
    c.settle()
    assert_replicas_equal_actives(c)
    client.close()
    client_b.close()


def test_graceful_failover_loses_nothing_and_needs_no_rollback(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1)
    client = ProcessClusterClient(c, "client")
    toks = [c.write(f"g{i}", f"v{i}".encode()).token for i in range(40)]
    client.converge(actives_state(c))
    report = c.failover("n1", graceful=True)
    assert all(e is None for e in report.entries.values())
    expected = actives_state(c)
    assert {k: v for k, (v, _vb) in expected.items()} == {f"g{i}".encode(): f"v{i}".encode() for i in range(40)}
    client.converge(expected)
    assert client.rollbacks() == 0
    for t in toks:
        assert c.is_replicated(t) or c.vbucket_map().replicas(t.vbucket) == []
        assert not c.observe_seqno(t.vbucket, t.vbuuid).failed_over
    with pytest.raises(InvalidArgument):
        c.failover("n1")
    client.close()


def test_graceful_failover_under_writes_loses_nothing(make_cluster) -> None:
    c = make_cluster(nodes=3, replicas=1)
    client = ProcessClusterClient(c, "client")
    acked: dict[str, bytes] = {}
    refused = [0]
    done = [0]
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            k = f"w{i % 64}"
            v = f"v{i}".encode()
            try:
                c.write(k, v)
            except (TemporaryFailure, NotMyVBucket):
                refused[0] += 1  # blocked while its vbucket moves, or the map changed: not acknowledged
                time.sleep(0.002)
                continue
            acked[k] = v
            done[0] += 1
            i += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        _wait(lambda: len(acked) >= 64)
        client.poll_once()
        report = c.failover("n2", graceful=True)
        n = done[0]
        _wait(lambda: done[0] >= n + 100)  # the writes go on, to the new actives
    finally:
        stop.set()
        t.join(10)
    print(f"\ngraceful failover under writes: {c.graceful_reactivations} vbuckets re-activated, "
          f"{refused[0]} writes refused, {done[0]} acknowledged")
    assert all(e is None for e in report.entries.values())  # takeover: no new branch
    c.settle()
    expected = actives_state(c)
    assert {k.decode(): v for k, (v, _vb) in expected.items()} == acked  # nothing lost
    client.converge(expected)
    assert client.rollbacks() == 0
    client.close()


def test_graceful_failover_keeps_a_write_that_slipped_in(make_cluster, monkeypatch) -> None:
    # A write already on its way when the manager blocked the vbucket reaches the node after the replicas
    # caught up: the manager sees the dead vbucket's high seqno moved, makes it active again, lets the
    # replicas stream the rest and only then promotes (no acknowledged write lost).
    c = make_cluster(nodes=3, replicas=1)
    victim = "n1"
    vb = c.vbucket_map().vbuckets_of(victim, 0)[0]
    key = next(f"s{i}" for i in range(10_000) if c.vbucket_of(f"s{i}") == vb)
    c.write(key, b"before")
    real = ProcessCluster._set_state
    slipped: list[int] = []

    replica = c.vbucket_map().replicas(vb)[0]

    def set_state(self: ProcessCluster, name: str, vbucket: int, state: VBucketState) -> None:
        if name == victim and vbucket == vb and state is VBucketState.DEAD and not slipped:
            self.pause_replication([replica])  # the replica must not get it before the vbucket is dead
            slipped.append(self.client(victim).set(key, b"slipped-in", vbucket=vb).seqno)
        real(self, name, vbucket, state)
        if name == victim and vbucket == vb and state is VBucketState.ACTIVE and slipped:
            self.resume_replication([replica])

    monkeypatch.setattr(ProcessCluster, "_set_state", set_state)
    report = c.failover(victim, graceful=True)
    assert slipped and c.graceful_reactivations >= 1 and report.entries[vb] is None
    assert c.get(key).value == b"slipped-in"
    assert c.client(report.promoted[vb]).vbucket_info(vb).high_seqno >= slipped[0]


def test_restart_after_sigkill_replicas_roll_back(make_cluster) -> None:
    c = make_cluster(nodes=2, replicas=1)
    for i in range(20):
        c.write(f"r{i}", b"first")
    c.settle()
    victim = "n0"
    c.stop_persistence(victim)
    for i in range(20):
        c.write(f"r{i}", b"unpersisted")  # replicated, never persisted on the victim
    _wait(lambda: all(c.client("n1").vbucket_info(vb).high_seqno == c.client(victim).vbucket_info(vb).high_seqno
                      for vb in c.vbucket_map().vbuckets_of(victim, 0)))
    retries = c.stale_cas_retries
    c.kill(victim)
    c.restart(victim)  # warmup: its actives get a failover entry at the persisted snapshot
    assert c.stale_cas_retries >= retries
    c.settle()
    assert_replicas_equal_actives(c)  # the replicas that were ahead rolled back
    assert int(c.client("n1").stats()["replica_rollbacks"]) >= 1
    for i in range(20):
        vb = c.vbucket_of(f"r{i}")
        if c.vbucket_map().active(vb) == victim:
            assert c.get(f"r{i}").value == b"first"


# ---------------------------------------------------------------------------------------------- campaign
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
        if graceful and (not c.node(name).up or name in c.paused or any(
                not c.node(n).up or n in c.paused for n in vbmap.nodes)):
            return False  # a graceful failover waits for the replicas: they must be streaming
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


#: raise for a longer campaign: PROCESS_PROP_EXAMPLES=100 pytest tests/engine/network/test_process_cluster.py -s
MAX_EXAMPLES = int(os.environ.get("PROCESS_PROP_EXAMPLES", "12"))
STATS = {"runs": 0, "writes": 0, "kills": 0, "lagging_crashes": 0, "failovers": 0, "acked_checked": 0, "client_rollbacks": 0,
         "divergent_consumers": 0, "lost_acked_writes": 0}


@pytest.mark.slow
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=15, max_size=45), nodes=st.integers(3, 4))
def test_process_cluster_campaign(tmp_path_factory, ops, nodes) -> None:
    h = Campaign(tmp_path_factory.mktemp("pc"), nodes)
    try:
        h.run(ops)
    finally:
        h.close()
    STATS["runs"] += 1
    STATS["writes"] += h.writes
    STATS["kills"] += h.kills
    STATS["lagging_crashes"] += h.lagging_crashes
    STATS["failovers"] += h.failovers
    STATS["acked_checked"] += h.checked
    STATS["client_rollbacks"] += sum(cl.rollbacks() for cl in h.clients)
    STATS["divergent_consumers"] += len(h.divergent)
    STATS["lost_acked_writes"] += len(h.lost)
    assert not h.divergent, h.divergent  # every consumer converged to the actives' state
    assert not h.lost, h.lost  # every write acknowledged as replicated and persisted survived the failovers


@pytest.mark.slow
def test_report_process_campaign_counts() -> None:
    # Not an invariant: the campaign's size with -s (a divergent consumer or a lost acknowledged write also
    # fails the example that found it).
    print(f"\nprocess cluster campaign: {STATS} at {time.strftime('%H:%M:%S')}")
