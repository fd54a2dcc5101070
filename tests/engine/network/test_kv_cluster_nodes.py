"""The per-node cluster config provider of the KV port (engine/network/kv/cluster_nodes.py) over a real in-process
cluster: who serves a vbucket (active / replica / NOT_MY_VBUCKET / TMPFAIL), the same revision on every node,
``thisNode``, and the map after a hard failover and a rebalance that adds a node and removes one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.cluster.cluster_config import HOST_PLACEHOLDER, ClusterConfigTracker, NodeAddress
from engine.cluster.local import Cluster
from engine.exceptions import InvalidArgument, KeyNotFound, NotMyVBucket, TemporaryFailure
from engine.kv.vbucket import RELATIVE_EXPIRY_LIMIT
from engine.network.kv.cluster_nodes import ClusterNodeConfig

NVB = 16


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=NVB)
    try:
        yield c
    finally:
        c.close()


def _providers(c: Cluster, ports: dict[str, int]) -> dict[str, ClusterNodeConfig]:
    tracker = ClusterConfigTracker(bucket_uuid="u")

    def addresses() -> dict[str, NodeAddress]:
        return {n: NodeAddress(HOST_PLACEHOLDER, kv=p) for n, p in ports.items() if n in c.nodes}

    return {n: ClusterNodeConfig(c, n, tracker, addresses) for n in ports}


def _finish_rebalance(c: Cluster) -> None:
    for _ in range(10_000):
        if c.rebalance_running is None:
            return
        c.pump(rounds=8)
    raise AssertionError("rebalance did not finish")


def test_active_replica_and_not_my_vbucket(cluster: Cluster) -> None:
    ports = {"n0": 11210, "n1": 11211, "n2": 11212}
    prov = _providers(cluster, ports)
    m = cluster.vbucket_map()
    for vb in range(NVB):
        active, replica = m.chains[vb]
        assert prov[active].bucket_for(vb) is cluster.nodes[active].bucket  # type: ignore[index]
        assert prov[replica].replica_bucket_for(vb) is cluster.nodes[replica].bucket  # type: ignore[index]
        for n in ports:
            if n != active:
                with pytest.raises(NotMyVBucket):
                    prov[n].bucket_for(vb)
            if n != replica:
                with pytest.raises(NotMyVBucket):
                    prov[n].replica_bucket_for(vb)
    for bad in (-1, NVB, 1 << 16):
        with pytest.raises(NotMyVBucket):
            prov["n0"].bucket_for(bad)
    revs = {p.rev for p in prov.values()}
    assert len(revs) == 1
    cfgs = {n: p.config("127.0.0.1", bucket=True) for n, p in prov.items()}
    for n, cfg in cfgs.items():
        assert [e.get("thisNode", False) for e in cfg["nodesExt"]] == [x == n for x in ports]
        assert cfg["vBucketServerMap"]["serverList"] == [f"127.0.0.1:{p}" for p in ports.values()]
    rev, body = prov["n1"].config_bytes("localhost")
    assert json.loads(body)["rev"] == rev and json.loads(body)["nodesExt"][0]["hostname"] == "localhost"
    g = prov["n2"].config("h", bucket=False)
    assert "vBucketServerMap" not in g and g["rev"] == rev


def test_failover_then_rebalance_moves_the_map(cluster: Cluster) -> None:
    ports = {"n0": 2000, "n1": 2001, "n2": 2002, "n3": 2003}
    prov = _providers(cluster, ports)
    rev0 = prov["n0"].rev
    was_on_n1 = cluster.vbucket_map().vbuckets_of("n1", slot=0)
    cluster.failover("n1")
    assert prov["n0"].rev == prov["n2"].rev == rev0 + 1
    for vb in was_on_n1:
        with pytest.raises(NotMyVBucket):
            prov["n1"].bucket_for(vb)  # the failed-over node is still up; it serves nothing
        new = cluster.vbucket_map().active(vb)
        assert new in ("n0", "n2") and prov[new].bucket_for(vb) is cluster.nodes[new].bucket
    cfg = prov["n0"].config("127.0.0.1", bucket=True)
    assert "127.0.0.1:2001" not in cfg["vBucketServerMap"]["serverList"]
    assert any(-1 in chain for chain in cfg["vBucketServerMap"]["vBucketMap"])  # replicas lost with n1
    cluster.start_rebalance(add=["n3"])
    _finish_rebalance(cluster)
    rev2 = prov["n3"].rev
    assert rev2 > rev0 + 1
    cfg = prov["n3"].config("127.0.0.1", bucket=True)
    assert cfg["vBucketServerMap"]["serverList"] == ["127.0.0.1:2000", "127.0.0.1:2002", "127.0.0.1:2003"]
    assert all(-1 not in chain for chain in cfg["vBucketServerMap"]["vBucketMap"])
    assert cfg["nodesExt"][2].get("thisNode") is True
    mine = cluster.vbucket_map().vbuckets_of("n3", slot=0)
    assert mine and all(prov["n3"].bucket_for(vb) is cluster.nodes["n3"].bucket for vb in mine)
    with pytest.raises(NotMyVBucket):
        prov["n1"].bucket_for(0)  # failed over: serves nothing
    cluster.start_rebalance(remove=["n0"])
    _finish_rebalance(cluster)
    assert "n0" not in cluster.nodes and prov["n2"].rev > rev2
    with pytest.raises(NotMyVBucket):
        prov["n0"].bucket_for(0)  # ejected: gone from the cluster
    assert prov["n2"].config("127.0.0.1", bucket=True)["vBucketServerMap"]["serverList"] == [
        "127.0.0.1:2002", "127.0.0.1:2003"]


def test_blocked_writes_and_a_down_node(cluster: Cluster) -> None:
    prov = _providers(cluster, {"n0": 1, "n1": 2, "n2": 3})
    vb = cluster.vbucket_map().vbuckets_of("n0", slot=0)[0]
    prov["n0"].admit_write(vb)
    cluster.block_writes(vb)
    with pytest.raises(TemporaryFailure):
        prov["n0"].admit_write(vb)
    cluster.kill("n2")
    vb2 = cluster.vbucket_map().vbuckets_of("n2", slot=0)[0]
    with pytest.raises(TemporaryFailure):
        prov["n2"].bucket_for(vb2)


def test_replica_reads(cluster: Cluster) -> None:
    prov = _providers(cluster, {"n0": 1, "n1": 2, "n2": 3})
    cluster.write("k1", b'{"a": 1}')
    cluster.write("gone", b"x", expiry=RELATIVE_EXPIRY_LIMIT + 1)  # an absolute expiry long past
    cluster.settle()
    vb = cluster.vbucket_of("k1")
    active, replica = cluster.vbucket_map().chains[vb]
    g = prov[replica].replica_bucket_for(vb).get_replica(b"k1", vbucket=vb)  # type: ignore[index]
    assert g.value == b'{"a": 1}' and g.cas == cluster.get("k1").cas
    with pytest.raises(NotMyVBucket):
        cluster.nodes[active].bucket.get_replica(b"k1", vbucket=vb)  # type: ignore[union-attr,index]
    missing = next(k for k in (f"nope{i}".encode() for i in range(1000)) if cluster.vbucket_of(k) == vb)
    with pytest.raises(KeyNotFound):
        prov[replica].replica_bucket_for(vb).get_replica(missing, vbucket=vb)  # type: ignore[index]
    vb2 = cluster.vbucket_of("gone")
    r2 = cluster.vbucket_map().chains[vb2][1]
    with pytest.raises(KeyNotFound):
        prov[r2].replica_bucket_for(vb2).get_replica(b"gone", vbucket=vb2)  # type: ignore[index]


@st.composite
def _histories(draw: st.DrawFn) -> list[tuple[str, str]]:
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        steps.append((draw(st.sampled_from(["failover", "add", "remove", "rebalance"])),
                      draw(st.sampled_from(["n0", "n1", "n2", "n3", "n4"]))))
    return steps


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_histories())
def test_property_exactly_the_configs_active_serves_each_vbucket(tmp_path_factory: pytest.TempPathFactory,
                                                                 history: list[tuple[str, str]]) -> None:
    """Over random histories of hard failovers and rebalances (nodes added and removed): every node serves the same
    revision, the revision goes up whenever the map changes, and for every vbucket exactly the node the config
    names as active serves it (NOT_MY_VBUCKET everywhere else); replica slots likewise for GET_REPLICA."""
    c = Cluster.create(tmp_path_factory.mktemp("h"), nodes=3, replicas=1, num_vbuckets=8)
    try:
        ports = {f"n{i}": 3000 + i for i in range(5)}
        prov = _providers(c, ports)
        last_rev, last_map = prov["n0"].rev, c.vbucket_map()
        for op, node in history:
            m = c.vbucket_map()
            try:
                if op == "failover" and node in m.nodes and len(m.nodes) > 1:
                    c.failover(node)
                elif op == "add" and node not in c.nodes:
                    c.start_rebalance(add=[node])
                elif op == "remove" and node in m.nodes and len(m.nodes) > 2:
                    c.start_rebalance(remove=[node])
                elif op == "rebalance":
                    c.start_rebalance()
            except InvalidArgument:
                continue  # a refused request changes nothing
            event(op)
            _finish_rebalance(c)
            revs = {p.rev for n, p in prov.items()}
            assert len(revs) == 1
            rev = revs.pop()
            if c.vbucket_map() is not last_map:
                assert rev > last_rev
            last_rev, last_map = rev, c.vbucket_map()
            cfg = prov["n0"].config("127.0.0.1", bucket=True)
            servers = cfg["vBucketServerMap"]["serverList"]
            by_server = {f"127.0.0.1:{p}": n for n, p in ports.items()}
            for vb, chain in enumerate(cfg["vBucketServerMap"]["vBucketMap"]):
                active = by_server[servers[chain[0]]] if chain[0] >= 0 else None
                replicas = {by_server[servers[i]] for i in chain[1:] if i >= 0}
                for n, p in prov.items():
                    if n == active:
                        assert p.bucket_for(vb) is c.nodes[n].bucket
                    else:
                        with pytest.raises((NotMyVBucket, TemporaryFailure)):
                            p.bucket_for(vb)
                    if n in replicas:
                        assert p.replica_bucket_for(vb) is c.nodes[n].bucket
                    else:
                        with pytest.raises((NotMyVBucket, TemporaryFailure)):
                            p.replica_bucket_for(vb)
    finally:
        c.close()
