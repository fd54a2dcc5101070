"""The KV port of a cluster (gateway/kv_cluster.py): one listener per node over an in-process cluster pumped on its
event loop (tests/gateway/kv_cluster_harness.py), checked with a raw client -- the same config (``rev``) from
every node, NOT_MY_VBUCKET with the current map as body, GET_REPLICA on the replica, CLUSTERMAP_CHANGE_NOTIFICATION
pushed to DUPLEX connections that asked for it after a failover, listeners for added nodes and none for ejected
ones, TMPFAIL while a vbucket's writes are stopped, ports ``kv_port + I`` -- and with the official SDK across a
hard failover and a rebalance (the end-to-end version through ``dcpgw up``: test_kv_sdk_cluster.py)."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from engine.kv.vbucket import vbucket_of
from engine.network.kv.features import Feature
from engine.network.kv.opcodes import CLUSTERMAP_CHANGE_NOTIFICATION, SERVER_REQ_MAGIC, KVStatus
from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.protocol import HEADER, HEADER_LEN, SET_EXTRAS
from tests.engine.network.kv.harness import RawClient
from tests.gateway.kv_cluster_harness import PASSWORD, KvClusterNodes

NVB = 16
NO_PUSH: list[int] = [Feature.TCP_NODELAY, Feature.MUTATION_SEQNO, Feature.XERROR, Feature.SELECT_BUCKET,
                      Feature.JSON, Feature.ALT_REQUEST_SUPPORT, Feature.SYNC_REPLICATION]


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[KvClusterNodes]:
    h = KvClusterNodes(tmp_path, nodes=3, replicas=1, num_vbuckets=NVB)
    try:
        yield h
    finally:
        h.close()


def _client(h: KvClusterNodes, node: str, features: list[int] | None = None) -> RawClient:
    return RawClient(h.port(node), nvb=NVB).login("app", PASSWORD, features=features)


def _config(c: RawClient) -> dict:
    f = c.call(Op.GET_CLUSTER_CONFIG)
    assert f.status == 0, f
    return dict(json.loads(f.value))


def _key_on(h: KvClusterNodes, node: str, slot: int = 0, prefix: str = "key") -> bytes:
    vbmap = h.call(h.cluster.vbucket_map)
    for i in range(10_000):
        k = f"{prefix}{i}".encode()
        chain = vbmap.chains[vbucket_of(k, NVB)]
        if chain[slot] == node:
            return k
    raise AssertionError(f"no key with {node} in slot {slot}")


def test_every_node_serves_the_same_map(nodes: KvClusterNodes) -> None:
    ports = nodes.call(lambda: nodes.ports.ports)
    assert list(ports) == ["n0", "n1", "n2"] and len(set(ports.values())) == 3
    cfgs = {}
    for n in ports:
        c = _client(nodes, n)
        cfgs[n] = _config(c)
        c.close()
    assert len({c["rev"] for c in cfgs.values()}) == 1
    servers = [f"127.0.0.1:{p}" for p in ports.values()]
    vbmap = nodes.call(nodes.cluster.vbucket_map)
    index = {n: i for i, n in enumerate(ports)}
    for n, cfg in cfgs.items():
        sm = cfg["vBucketServerMap"]
        assert sm["serverList"] == servers and sm["numReplicas"] == 1
        assert sm["vBucketMap"] == [[index[x] for x in chain] for chain in vbmap.chains]  # type: ignore[index]
        assert [e.get("thisNode", False) for e in cfg["nodesExt"]] == [x == n for x in ports]
        assert [e["services"]["kv"] for e in cfg["nodesExt"]] == list(ports.values())


@pytest.mark.parametrize("mode", ["seqno", "lww"])
def test_the_config_tells_the_conflict_resolution_an_xdcr_source_checks(tmp_path: Path, mode: str) -> None:
    """``conflictResolutionType`` in the bucket config of every node (and of a single node's port): what an XDCR
    source reads to refuse a target of another mode (docs/xdcr.md "Conflict resolution")."""
    from connectors.xdcr.connection import Credentials
    from connectors.xdcr.document import ConflictMode
    from connectors.xdcr.target import TargetCluster, TargetSpec
    from tests.engine.network.kv.harness import PASSWORD as SINGLE_PASSWORD
    from tests.engine.network.kv.harness import KVNode

    h = KvClusterNodes(tmp_path / "c", nodes=2, replicas=1, num_vbuckets=NVB, conflict_resolution=mode)
    single = KVNode(tmp_path / "s", conflict_resolution=mode)
    try:
        for node in ("n0", "n1"):
            c = _client(h, node)
            assert _config(c)["conflictResolutionType"] == mode
            c.close()
        for port, password in ((h.port("n0"), PASSWORD), (single.port, SINGLE_PASSWORD)):
            target = TargetCluster(TargetSpec.parse(f"couchbase://127.0.0.1:{port}/default"),
                                   Credentials("app", password))
            target.connect()
            try:
                assert target.conflict_mode() is ConflictMode(mode)
            finally:
                target.close()
    finally:
        single.close()
        h.close()


def test_not_my_vbucket_carries_the_map_and_replica_reads(nodes: KvClusterNodes) -> None:
    key = _key_on(nodes, "n0")
    vb = vbucket_of(key, NVB)
    replica = nodes.call(nodes.cluster.vbucket_map).chains[vb][1]
    active = _client(nodes, "n0")
    f = active.doc(Op.SET, key, extras=SET_EXTRAS.pack(0, 0), value=b'{"v": 1}', datatype=0x01)
    assert f.status == 0, f
    other = _client(nodes, "n2" if replica == "n1" else "n1")  # neither active nor replica
    f = other.doc(Op.GET, key)
    assert f.status == KVStatus.NOT_MY_VBUCKET and f.datatype & 0x01
    body = json.loads(f.value)
    assert body["rev"] == _config(active)["rev"] and len(body["vBucketServerMap"]["vBucketMap"]) == NVB
    assert other.doc(Op.GET_REPLICA, key).status == KVStatus.NOT_MY_VBUCKET
    assert active.doc(Op.GET_REPLICA, key).status == KVStatus.NOT_MY_VBUCKET  # the active holds no replica
    rc = _client(nodes, replica)  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while (f := rc.doc(Op.GET_REPLICA, key)).status == KVStatus.KEY_ENOENT and time.monotonic() < deadline:
        time.sleep(0.01)  # replication is asynchronous
    assert f.status == 0 and f.value == b'{"v": 1}', f
    assert rc.doc(Op.GET, key).status == KVStatus.NOT_MY_VBUCKET
    for c in (active, other, rc):
        c.close()


def _next_frame(c: RawClient) -> tuple[int, int, bytes, bytes, bytes]:
    """(magic, opcode, extras, key, value) of the next frame, server requests (magic 0x82) included."""
    magic, opcode, keylen, extlen, _dt, _st, bodylen, _op, _cas = HEADER.unpack(c._exact(HEADER_LEN))
    body = c._exact(bodylen)
    return magic, opcode, body[:extlen], body[extlen:extlen + keylen], body[extlen + keylen:]


def _read_push(c: RawClient, timeout: float = 10.0) -> tuple[int, bytes, dict]:
    """The next CLUSTERMAP_CHANGE_NOTIFICATION: (revision extras, bucket key, config)."""
    c.sock.settimeout(timeout)
    while True:
        magic, opcode, extras, key, value = _next_frame(c)
        if magic == SERVER_REQ_MAGIC and opcode == CLUSTERMAP_CHANGE_NOTIFICATION:
            return int.from_bytes(extras, "big"), key, json.loads(value)


def test_failover_pushes_the_new_map_to_duplex_clients(nodes: KvClusterNodes) -> None:
    push = _client(nodes, "n0")
    assert Feature.CLUSTERMAP_CHANGE_NOTIFICATION in push.features and Feature.DUPLEX in push.features
    quiet = _client(nodes, "n2", features=NO_PUSH)
    rev0 = _config(push)["rev"]
    key = _key_on(nodes, "n1")
    nodes.call(lambda: nodes.cluster.failover("n1"))
    rev, bucket, cfg = _read_push(push)
    assert bucket == b"default" and rev == cfg["rev"] == rev0 + 1
    n1 = f"127.0.0.1:{nodes.port('n1')}"
    assert n1 not in cfg["vBucketServerMap"]["serverList"]
    # the client without the feature got nothing pushed: its next answer is the one it asks for
    quiet.sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        _next_frame(quiet)
    quiet.sock.settimeout(10)
    assert _config(quiet)["rev"] == rev
    # the failed-over node (still up) answers NOT_MY_VBUCKET with the new map for what it served
    old = _client(nodes, "n1")
    f = old.doc(Op.GET, key)
    assert f.status == KVStatus.NOT_MY_VBUCKET and json.loads(f.value)["rev"] == rev
    new_active = cfg["vBucketServerMap"]["serverList"][cfg["vBucketServerMap"]["vBucketMap"][vbucket_of(key, NVB)][0]]
    assert new_active != n1
    for c in (push, quiet, old):
        c.close()


def test_rebalance_starts_and_stops_listeners(nodes: KvClusterNodes) -> None:
    push = _client(nodes, "n2")
    n0_port = nodes.port("n0")
    nodes.call(lambda: nodes.cluster.start_rebalance(add=["n3"], remove=["n0"]))
    deadline = time.monotonic() + 60
    while nodes.call(lambda: nodes.cluster.rebalance_running) is not None:
        assert time.monotonic() < deadline, "rebalance did not finish"
        time.sleep(0.02)
    deadline = time.monotonic() + 10
    while "n0" in nodes.call(lambda: nodes.ports.ports) and time.monotonic() < deadline:
        time.sleep(0.01)
    ports = nodes.call(lambda: nodes.ports.ports)
    assert set(ports) == {"n1", "n2", "n3"}
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", n0_port), timeout=2).close()
    quiet = _client(nodes, "n2", features=NO_PUSH)
    cfg = _config(quiet)
    quiet.close()
    assert cfg["vBucketServerMap"]["serverList"] == [f"127.0.0.1:{ports[n]}" for n in ("n1", "n2", "n3")]
    assert all(-1 not in chain for chain in cfg["vBucketServerMap"]["vBucketMap"])
    pushed = 0
    push.sock.settimeout(0.5)
    try:
        while True:
            pushed += _next_frame(push)[0] == SERVER_REQ_MAGIC
    except TimeoutError:
        pass
    assert pushed >= 1 and nodes.ports.pushes >= 2
    c3 = _client(nodes, "n3")
    key = _key_on(nodes, "n3")
    assert c3.doc(Op.SET, key, extras=SET_EXTRAS.pack(0, 0), value=b"x").status == 0
    push.close()
    c3.close()


def test_writes_to_a_vbucket_being_moved_answer_tmpfail(nodes: KvClusterNodes) -> None:
    key = _key_on(nodes, "n0")
    vb = vbucket_of(key, NVB)
    c = _client(nodes, "n0")
    nodes.call(lambda: nodes.cluster.block_writes(vb))
    assert c.doc(Op.SET, key, extras=SET_EXTRAS.pack(0, 0), value=b"x").status == KVStatus.TMPFAIL
    assert c.doc(Op.GET, key).status == KVStatus.KEY_ENOENT  # reads go on
    f = c.doc(Op.SETQ, key, extras=SET_EXTRAS.pack(0, 0), value=b"x")  # the quiet-SET lane stops there too
    assert (f.status, f.opcode) == (KVStatus.TMPFAIL, Op.SETQ)
    other = _client(nodes, "n1")
    f = other.doc(Op.SETQ, key, extras=SET_EXTRAS.pack(0, 0), value=b"x")  # not the active: the map as answer
    assert f.status == KVStatus.NOT_MY_VBUCKET and json.loads(f.value)["vBucketServerMap"]
    other.close()
    nodes.call(lambda: nodes.cluster.end_move(vb))
    assert c.doc(Op.SET, key, extras=SET_EXTRAS.pack(0, 0), value=b"x").status == 0
    c.close()


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_ports_follow_the_first_port(tmp_path: Path) -> None:
    # Below the kernel's ephemeral range: no connection of a concurrent test takes base + 2 meanwhile (it did
    # once, in CI, when base itself came from the ephemeral range).
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(10_000, max(10_001, low - 10))
        if all(_free(base + i) for i in range(3)):
            break
    else:
        pytest.skip("no three free ports below the ephemeral range")
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
    except OSError:
        pytest.skip("the port next to the chosen one is in use")
    try:
        h = KvClusterNodes(tmp_path, nodes=3, replicas=1, num_vbuckets=NVB, first_port=base)
    except OSError:
        taken.close()
        pytest.skip("the chosen port got taken meanwhile")
    try:
        ports = h.call(lambda: h.ports.ports)
        assert ports["n0"] == base and ports["n2"] == base + 2
        assert ports["n1"] not in (base + 1, 0)  # taken: a free port instead
    finally:
        h.close()
        taken.close()


def test_official_sdk_follows_failover_and_rebalance(nodes: KvClusterNodes) -> None:
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.durability import DurabilityLevel, ServerDurability
    from couchbase.exceptions import DurabilityImpossibleException, DurabilitySyncWriteInProgressException
    from couchbase.options import ClusterOptions, ClusterTimeoutOptions, UpsertOptions

    opts = ClusterOptions(PasswordAuthenticator("app", PASSWORD), timeout_options=ClusterTimeoutOptions(
        kv_timeout=timedelta(seconds=5), kv_durable_timeout=timedelta(seconds=10),
        connect_timeout=timedelta(seconds=5), bootstrap_timeout=timedelta(seconds=10)))
    cluster = Cluster(f"couchbase://127.0.0.1:{nodes.port('n1')}", opts)
    try:
        coll = cluster.bucket("default").default_collection()
        durably = UpsertOptions(durability=ServerDurability(DurabilityLevel.MAJORITY))
        durable = {}
        for i in range(30):
            coll.upsert(f"plain{i}", {"i": i})
            durable[f"durable{i}"] = coll.upsert(f"durable{i}", {"i": i}, durably).cas
        replicas = list(coll.get_all_replicas("durable3"))
        assert sorted(r.is_replica for r in replicas) == [False, True]
        assert all(r.content_as[dict] == {"i": 3} for r in replicas)
        nodes.call(lambda: nodes.cluster.failover("n1"))  # the node the SDK bootstrapped from
        # a vbucket whose chain lost its replica cannot reach a majority until a rebalance refills it:
        # DURABILITY_IMPOSSIBLE, as Couchbase Server answers; the other vbuckets' durable writes go on
        vbmap = nodes.call(nodes.cluster.vbucket_map)
        impossible = 0
        for i in range(30, 60):
            k = f"durable{i}"
            full = None not in vbmap.chains[vbucket_of(k.encode(), NVB)]
            try:
                durable[k] = coll.upsert(k, {"i": i}, durably).cas
                assert full, k
            except DurabilityImpossibleException:
                assert not full, k
                impossible += 1
            coll.upsert(f"plain{i}", {"i": i})  # plain writes reach every vbucket's new active
        assert impossible > 0
        nodes.call(lambda: nodes.cluster.start_rebalance(add=["n3"]))
        i = 60
        while nodes.call(lambda: nodes.cluster.rebalance_running) is not None:
            with contextlib.suppress(DurabilityImpossibleException, DurabilitySyncWriteInProgressException):
                durable[f"durable{i}"] = coll.upsert(f"durable{i}", {"i": i}, durably).cas
            i += 1
        for j in range(i, i + 30):  # refilled: every vbucket takes durable writes again
            durable[f"durable{j}"] = coll.upsert(f"durable{j}", {"i": j}, durably).cas
        for k, cas in durable.items():
            g = coll.get(k)
            assert g.content_as[dict] == {"i": int(k[7:])} and g.cas == cas

        def active_items_on_n3() -> int:
            b = nodes.cluster.nodes["n3"].bucket
            assert b is not None
            return sum(len(v.ht) for v in b.vbuckets() if v.state.value == "active")

        on_n3 = nodes.call(active_items_on_n3)
        for j in range(40):
            coll.upsert(f"after{j}", {"j": j})
        assert nodes.call(active_items_on_n3) > on_n3  # the SDK writes to the new node
    finally:
        cluster.close()


def test_tls_cluster_lists_kv_ssl_and_the_sdk_connects_with_couchbases(tmp_path: Path) -> None:
    import trustme
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions, ClusterTimeoutOptions

    from engine.security.tls import server_context

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(tmp_path / "key.pem")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    h = KvClusterNodes(tmp_path / "c", nodes=3, replicas=1, num_vbuckets=NVB,
                       ssl_context=server_context(tmp_path / "cert.pem", tmp_path / "key.pem"))
    try:
        ports = h.call(lambda: h.ports.ports)
        cfg = h.call(lambda: h.ports.tracker.config(h.cluster.vbucket_map(), h.ports.addresses(), "n0",
                                                      host="127.0.0.1"))
        assert [e["services"] for e in cfg["nodesExt"]] == [{"kvSSL": p} for p in ports.values()]
        timeouts = ClusterTimeoutOptions(kv_timeout=timedelta(seconds=5), connect_timeout=timedelta(seconds=10),
                                         bootstrap_timeout=timedelta(seconds=10))
        cluster = Cluster(f"couchbases://127.0.0.1:{ports['n2']}", ClusterOptions(
            PasswordAuthenticator("app", PASSWORD, cert_path=str(tmp_path / "ca.pem")), timeout_options=timeouts))
        try:
            coll = cluster.bucket("default").default_collection()
            for i in range(40):  # keys on every node
                coll.upsert(f"tls{i}", {"i": i})
            assert all(coll.get(f"tls{i}").content_as[dict] == {"i": i} for i in range(40))
        finally:
            cluster.close()
    finally:
        h.close()
