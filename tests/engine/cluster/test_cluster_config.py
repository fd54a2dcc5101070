"""The CCCP cluster config (engine/cluster/cluster_config.py): the shape the official SDK's C++ core parses, -1 for
empty slots, ``nodesExt`` in ``serverList`` order, revisions that go up on every map or address change, a property
over random maps, and the bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import InvalidArgument
from engine.cluster.cluster_config import (
    HOST_PLACEHOLDER,
    ClusterConfigTracker,
    NodeAddress,
    build_cluster_config,
    encode_cluster_config,
)
from engine.cluster.local import Cluster
from engine.cluster.vbucket_map import MAX_REPLICAS, VBucketMap


def _addresses(names: list[str], base: int = 12000) -> dict[str, NodeAddress]:
    return {n: NodeAddress("127.0.0.1", kv=base + i, mgmt=8091) for i, n in enumerate(names)}


def _sdk_view(config: dict) -> list[list[str | None]]:
    """The chains as the C++ core reads them: ``vBucketMap`` numbers index the ``nodesExt`` list (host + kv)."""
    ext = config["nodesExt"]
    return [[None if i < 0 else f"{ext[i]['hostname']}:{ext[i]['services']['kv']}" for i in chain]
            for chain in config["vBucketServerMap"]["vBucketMap"]]


def test_shape_of_a_generated_map() -> None:
    m = VBucketMap.generate(["n0", "n1", "n2"], 1, 16)
    addrs = _addresses(m.nodes)
    cfg = build_cluster_config(m, addrs, rev=7, bucket_uuid="abc", this_node="n1")
    assert cfg["rev"] == 7 and cfg["revEpoch"] == 1 and cfg["name"] == "default" and cfg["uuid"] == "abc"
    assert cfg["nodeLocator"] == "vbucket" and "durableWrite" in cfg["bucketCapabilities"]
    sm = cfg["vBucketServerMap"]
    assert sm["hashAlgorithm"] == "CRC" and sm["numReplicas"] == 1
    assert sm["serverList"] == ["127.0.0.1:12000", "127.0.0.1:12001", "127.0.0.1:12002"]
    assert len(sm["vBucketMap"]) == 16 and all(len(c) == 2 for c in sm["vBucketMap"])
    assert [e["services"]["kv"] for e in cfg["nodesExt"]] == [12000, 12001, 12002]
    assert [bool(e.get("thisNode")) for e in cfg["nodesExt"]] == [False, True, False]
    assert [bool(n.get("thisNode")) for n in cfg["nodes"]] == [False, True, False]
    assert cfg["nodes"][0]["ports"]["direct"] == 12000 and cfg["nodes"][0]["hostname"] == "127.0.0.1:8091"
    for vb, chain in enumerate(m.chains):
        assert _sdk_view(cfg)[vb] == [addrs[n].server for n in chain]  # type: ignore[index]
    assert json.loads(encode_cluster_config(cfg)) == cfg


def test_empty_slots_and_nodes_without_address_are_minus_one() -> None:
    m = VBucketMap.generate(["a", "b", "c"], 2, 6)
    chains = [list(c) for c in m.chains]
    chains[0][2] = None
    m = m.with_chains(chains)
    addrs = _addresses(["a", "c"])  # b has no KV listener
    cfg = build_cluster_config(m, addrs, rev=1, bucket_uuid="u")
    sm = cfg["vBucketServerMap"]
    assert sm["serverList"] == ["127.0.0.1:12000", "127.0.0.1:12001"]
    assert [e["hostname"] for e in cfg["nodesExt"]] == ["127.0.0.1"] * 2
    idx = {"a": 0, "b": -1, "c": 1, None: -1}
    assert sm["vBucketMap"] == [[idx[n] for n in c] for c in m.chains]
    assert sm["vBucketMap"][0][2] == -1


def test_tls_ports_and_ipv6_hosts() -> None:
    m = VBucketMap.generate(["a"], 0, 2)
    cfg = build_cluster_config(m, {"a": NodeAddress("::1", kv_tls=11207, mgmt_tls=18091)}, rev=1, bucket_uuid="u")
    assert cfg["vBucketServerMap"]["serverList"] == ["[::1]:11207"]
    assert cfg["nodesExt"][0]["services"] == {"kvSSL": 11207, "mgmtSSL": 18091}
    assert cfg["vBucketServerMap"]["numReplicas"] == 0 and cfg["vBucketServerMap"]["vBucketMap"] == [[0], [0]]


def test_tracker_revisions_follow_failover_and_address_changes(tmp_path: Path) -> None:
    cluster = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=16)
    try:
        tracker = ClusterConfigTracker(bucket_uuid="u")
        addrs = _addresses(list(cluster.nodes))
        r1, body1 = tracker.encoded(cluster.vbucket_map(), addrs, "n0")
        assert r1 == cluster.vbucket_map().revision
        assert tracker.encoded(cluster.vbucket_map(), dict(addrs), "n0") == (r1, body1)  # nothing changed
        assert tracker.revision(cluster.vbucket_map(), addrs) == r1
        cluster.failover("n1")
        r2, body2 = tracker.encoded(cluster.vbucket_map(), addrs, "n0")
        assert r2 == r1 + 1
        cfg = json.loads(body2)
        assert cfg["rev"] == r2 and "127.0.0.1:12001" not in cfg["vBucketServerMap"]["serverList"]
        assert all(c[0] >= 0 for c in cfg["vBucketServerMap"]["vBucketMap"])  # every vbucket promoted
        moved = dict(addrs, n2=NodeAddress("127.0.0.1", kv=13002))
        r3 = tracker.revision(cluster.vbucket_map(), moved)
        assert r3 == r2 + 1
        assert tracker.config(cluster.vbucket_map(), moved)["vBucketServerMap"]["serverList"][-1] == "127.0.0.1:13002"
        # back to an earlier (map, addresses): still a new, higher revision -- never down
        assert tracker.revision(cluster.vbucket_map(), addrs) == r3 + 1
        cluster.start_rebalance()
        cluster.settle()
        while cluster.rebalance_running is not None:
            cluster.pump(rounds=8)
        r5 = tracker.revision(cluster.vbucket_map(), addrs)
        assert r5 > r3 + 1 and r5 >= cluster.vbucket_map().revision
        assert all(-1 not in c for c in tracker.config(cluster.vbucket_map(), addrs)["vBucketServerMap"]["vBucketMap"])
    finally:
        cluster.close()


@pytest.mark.parametrize("kwargs", [
    {"host": ""}, {"host": "h"}, {"host": "h", "kv": 0}, {"host": "h", "kv": 65536}, {"host": "h", "kv": "1"},
    {"host": "h", "kv": 1, "mgmt": -1}, {"host": "h", "kv_tls": True},
])
def test_bad_addresses(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        NodeAddress(**kwargs)


@pytest.mark.parametrize("rev, epoch", [(-1, 1), (1, -1), ("1", 1), (1.0, 1)])
def test_bad_revisions(rev: object, epoch: object) -> None:
    m = VBucketMap.generate(["a"], 0, 1)
    with pytest.raises(InvalidArgument):
        build_cluster_config(m, _addresses(["a"]), rev=rev, rev_epoch=epoch, bucket_uuid="u")  # type: ignore[arg-type]


@st.composite
def _maps(draw: st.DrawFn) -> tuple[VBucketMap, dict[str, NodeAddress]]:
    n = draw(st.integers(1, 6))
    names = [f"n{i}" for i in range(n)]
    replicas = draw(st.integers(0, min(MAX_REPLICAS, n - 1)))
    m = VBucketMap.generate(names, replicas, draw(st.integers(1, 40)))
    for _ in range(draw(st.integers(0, 4))):  # failovers, swaps, empty slots: any valid history of chains
        chains = [list(c) for c in m.chains]
        for vb in draw(st.lists(st.integers(0, m.num_vbuckets - 1), max_size=8)):
            perm = draw(st.permutations(chains[vb]))
            holes = draw(st.lists(st.booleans(), min_size=len(perm), max_size=len(perm)))
            chains[vb] = [None if h else x for x, h in zip(perm, holes, strict=True)]
        m = m.with_chains(chains)
    with_address = draw(st.lists(st.sampled_from(names), unique=True)) if draw(st.booleans()) else names
    return m, _addresses(with_address)


@settings(max_examples=150, deadline=None)
@given(_maps(), st.integers(0, 10))
def test_property_actives_in_server_list_and_replicas_distinct(drawn: tuple, this: int) -> None:
    m, addrs = drawn
    this_node = f"n{this}"
    cfg = build_cluster_config(m, addrs, rev=m.revision, bucket_uuid="u", this_node=this_node)
    sm = cfg["vBucketServerMap"]
    servers = sm["serverList"]
    assert len(servers) == len(set(servers)) == len(cfg["nodesExt"]) == len(cfg["nodes"])
    assert [f"{e['hostname']}:{e['services']['kv']}" for e in cfg["nodesExt"]] == servers
    assert sum(bool(e.get("thisNode")) for e in cfg["nodesExt"]) == (1 if this_node in addrs and
                                                                      this_node in m.nodes else 0)
    assert sm["numReplicas"] == m.num_replicas and len(sm["vBucketMap"]) == m.num_vbuckets
    for vb, (chain, numbers) in enumerate(zip(m.chains, sm["vBucketMap"], strict=True)):
        assert len(numbers) == m.num_replicas + 1
        assert all(-1 <= i < len(servers) for i in numbers)
        held = [i for i in numbers if i >= 0]
        assert len(held) == len(set(held)), (vb, numbers)  # a node never holds two copies
        active = chain[0]
        if active is not None and active in addrs:
            assert servers[numbers[0]] == addrs[active].server  # every vbucket's active is in serverList
        else:
            assert numbers[0] == -1
        assert [None if i < 0 else servers[i] for i in numbers] == [
            addrs[n].server if n is not None and n in addrs else None for n in chain]


def test_host_placeholder_is_the_clients_address_and_gcccp_has_no_bucket() -> None:
    m = VBucketMap.generate(["a", "b"], 1, 4)
    addrs = {"a": NodeAddress(HOST_PLACEHOLDER, kv=1000), "b": NodeAddress("10.0.0.2", kv=1001)}
    tracker = ClusterConfigTracker(bucket_uuid="u")
    cfg = tracker.config(m, addrs, "a", host="localhost")
    assert cfg["vBucketServerMap"]["serverList"] == ["localhost:1000", "10.0.0.2:1001"]
    assert [e["hostname"] for e in cfg["nodesExt"]] == ["localhost", "10.0.0.2"]
    rev = cfg["rev"]
    # another client's host name is the same revision (the placeholder, not the host, is what changes revisions)
    assert tracker.encoded(m, addrs, "a", host="::1")[0] == rev
    assert json.loads(tracker.encoded(m, addrs, "a", host="::1")[1])["vBucketServerMap"]["serverList"][0] == \
        "[::1]:1000"
    g = tracker.config(m, addrs, "b", host="h", with_bucket=False)
    assert g["rev"] == rev and "vBucketServerMap" not in g and "name" not in g
    assert g["nodesExt"][1] == {"services": {"kv": 1001}, "hostname": "10.0.0.2", "thisNode": True}
    with pytest.raises(InvalidArgument):
        tracker.config(m, addrs, "a", host="")
