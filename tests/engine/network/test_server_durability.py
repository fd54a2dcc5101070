"""Synchronous replication over TCP (docs/durability.md "Node processes"): node processes (engine/network/server.py) take sync writes in the durability frame info
(magic 0x08), answer them once committed, replicate prepares / commits to a replica process that seqno-acks
over DCP, and answer the 0xa0-0xa3 errors as typed exceptions (engine/network/remote.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Item, KeyNotFound, Op, VBucketState
from engine.exceptions import (
    DurabilityImpossible,
    DurabilityInvalidLevel,
    SyncWriteAmbiguous,
    SyncWriteInProgress,
)
from engine.kv.durability import Durability, Level
from engine.network.process_cluster import NodeProcess
from engine.network.protocol import Opcode
from tests.engine.nodes import NVB, drain, keys_on, wait_for

MAJ = Durability(Level.MAJORITY)


def test_single_node_sync_writes_and_errors_over_tcp(spawn) -> None:
    c = spawn().require()
    vb = 1
    k1, k2, k3, k4 = keys_on(vb, 4, "d")
    r = c.set(k1, b"v", vbucket=vb, durability=MAJ)  # no topology: the node alone is the majority
    assert c.get(k1, vbucket=vb).value == b"v" and r.seqno == 2  # prepare 1, commit 2
    r = c.set(k2, b"p", vbucket=vb, durability=Durability(Level.PERSIST_TO_MAJORITY, 5000))  # the flusher
    assert c.get(k2, vbucket=vb).value == b"p"
    c.delete(k1, vbucket=vb, durability=MAJ)
    with pytest.raises(KeyNotFound):
        c.get(k1, vbucket=vb)
    # a bad level in the frame: DURABILITY_INVALID_LEVEL over the wire
    with pytest.raises(DurabilityInvalidLevel):
        c._call(Opcode.SET, vbucket=vb, key=k3.encode(), value=b"x", extras=bytes(8), framing=bytes([0x11, 7]))
    # impossible chain
    c.set_replication_topology(vb, ["n0", None])
    with pytest.raises(DurabilityImpossible):
        c.set(k3, b"x", vbucket=vb, durability=MAJ)
    # a replica that never acks: a second write is refused while the first waits, then it is ambiguous
    c.set_replication_topology(vb, ["n0", "ghost"])
    c.set(k4, b"before", vbucket=vb)
    other = type(c)(c.host, c.port)  # a second connection: the first is blocked on its sync write
    errors: list[BaseException] = []

    def slow() -> None:
        try:
            other.set(k4, b"late", vbucket=vb, durability=Durability(Level.MAJORITY, 1500))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=slow)
    t.start()
    deadline = time.monotonic() + 10
    while True:
        try:
            c.set(k4, b"before", vbucket=vb)  # the same value: a probe until the prepare is there
        except SyncWriteInProgress:
            break
        assert time.monotonic() < deadline, "the prepare never appeared"
        time.sleep(0.01)
    t.join(30)
    assert len(errors) == 1 and isinstance(errors[0], SyncWriteAmbiguous)
    assert c.get(k4, vbucket=vb).value == b"before"  # timed out and aborted: never visible
    other.close()


def test_replica_process_acks_and_sync_messages_flow_over_dcp(spawn: Callable[..., NodeProcess]) -> None:
    a = spawn("a")
    b = spawn("b")
    ca, cb = a.require(), b.require()
    for vb in range(NVB):
        cb.set_vbucket_state(vb, VBucketState.REPLICA)
        ca.set_replication_topology(vb, ["a", "b"])
    cb.set_replication({"a": ("127.0.0.1", a.port, list(range(NVB)))})
    vb = 2
    k1, k2 = keys_on(vb, 2, "s")
    # a DCP client with sync writes sees prepare then commit; one without sees the commit as a mutation
    sync = ca.dcp_producer("sync-client")
    sync.control("enable_sync_writes", "true")
    sync.stream_request(vb, 0)
    plain = ca.dcp_producer("plain-client")
    plain.stream_request(vb, 0)
    r = ca.set(k1, b"durable", vbucket=vb, durability=MAJ)  # committed once b acked over DCP
    assert ca.get(k1, vbucket=vb).value == b"durable"
    got = drain(sync, lambda g: sum(isinstance(m, Item) for m in g) >= 2)
    items = [m for m in got if isinstance(m, Item)]
    assert [(m.op, m.prepared) for m in items[:2]] == [(Op.PREPARE, 0), (Op.MUTATION, r.seqno - 1)]
    got = drain(plain, lambda g: any(isinstance(m, Item) for m in g))
    pitems = [m for m in got if isinstance(m, Item)]
    assert [(m.op, m.seqno, m.value) for m in pitems] == [(Op.MUTATION, r.seqno, b"durable")]
    r2 = ca.set(k2, b"persisted", vbucket=vb, durability=Durability(Level.PERSIST_TO_MAJORITY, 10_000))

    def replica_has() -> bool:
        return cb.vbucket_info(vb).snapshot_persisted >= r2.seqno

    wait_for(replica_has)
    assert ca.get(k2, vbucket=vb).value == b"persisted"
    sync.close()
    plain.close()


def test_process_cluster_acked_durable_writes_survive_sigkill_and_hard_failover(tmp_path: Path) -> None:
    from engine.network.process_cluster import ProcessCluster

    with ProcessCluster.start(tmp_path / "pc", nodes=3, replicas=2, num_vbuckets=NVB, seed=3) as pc:
        acked: dict[str, bytes] = {}
        for i in range(24):
            key, value = f"dk{i}", f"v{i}".encode()
            level = (Level.MAJORITY, Level.MAJORITY_AND_PERSIST_TO_ACTIVE, Level.PERSIST_TO_MAJORITY)[i % 3]
            pc.write(key, value, durability=Durability(level, 10_000))
            acked[key] = value
        victim = "n0"
        pc.kill(victim)
        report = pc.failover(victim)
        assert report.promoted and not report.lost

        def visible(key: str) -> bool:
            # a prepare held by the promoted replica is re-committed once the other replica acks it
            try:
                return pc.get(key).value == acked[key]
            except KeyNotFound:
                return False

        for key in acked:
            wait_for(lambda key=key: visible(key))  # type: ignore[misc]
        pc.write("after", b"x", durability=MAJ)  # chains [r, r', None]: still a majority of 2
        assert pc.get("after").value == b"x"
