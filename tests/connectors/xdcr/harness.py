"""Shared helpers of the XDCR tests: a target node process and the comparison of documents with their
metadata between the source (an in-process engine bucket) and a target node."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine import Bucket
from engine.exceptions import KeyNotFound
from engine.kv.vbucket import VBucketState
from engine.network.process_cluster import NodeProcess
from schemas.dcp import Op

#: (value or None, cas, rev seqno, flags, expiry, deleted)
Doc = tuple[bytes | None, int, int, int, int, bool]


def target_node(tmp: Path, name: str = "t0", nvb: int = 8, mode: str = "seqno", **cfg: Any) -> NodeProcess:
    node = NodeProcess(name, tmp / name, nvb, {"conflict_resolution": mode, **cfg})
    node.start()
    return node


def source_docs(bucket: Bucket) -> dict[bytes, Doc]:
    """Every document and tombstone of the bucket's active vbuckets with its metadata."""
    out: dict[bytes, Doc] = {}
    for vb in bucket.vbuckets():
        if vb.state is not VBucketState.ACTIVE:
            continue
        for k, it in vb.ht.items():
            deleted = it.op is not Op.MUTATION
            out[bytes(k)] = (None if deleted else bytes(it.value or b""), it.cas, it.rev_seqno, it.flags,
                             it.expiry, deleted)
    return out


def target_docs(node: NodeProcess, keys: dict[bytes, int]) -> dict[bytes, Doc]:
    """The target's version of each key (key -> vbucket); keys with neither document nor tombstone are
    absent."""
    c = node.require()
    out: dict[bytes, Doc] = {}
    for k, vb in keys.items():
        try:
            m = c.get_meta(k, vbucket=vb)
        except KeyNotFound:
            continue
        value = None if m.deleted else c.get(k, vbucket=vb).value
        out[k] = (value, m.cas, m.rev_seqno, m.flags, m.expiry, m.deleted)
    return out


def diverging(src: dict[bytes, Doc], tgt: dict[bytes, Doc]) -> dict[bytes, tuple[Doc | None, Doc | None]]:
    """Keys whose target version differs from the source's. A source deletion matches a target tombstone with
    the same metadata; a key the source does not hold at all (its branch was rolled back) matches an absent
    key or any target tombstone."""
    bad: dict[bytes, tuple[Doc | None, Doc | None]] = {}
    for k in set(src) | set(tgt):
        s, t = src.get(k), tgt.get(k)
        if s is None:
            if t is not None and not t[5]:
                bad[k] = (s, t)
        elif s != t:
            bad[k] = (s, t)
    return bad


class ClusterSide:
    """One cluster of a bidirectional pair: a single node process (every vbucket active on it, the XDCR
    target of the other side) and a gateway publisher streaming it into its own topic."""

    def __init__(self, broker: Any, tmp: Path, mode: str, nvb: int = 8) -> None:
        import uuid

        from engine.network.process_cluster import ProcessCluster
        from gateway.publisher import Publisher
        from gateway.resume import ensure_topics, recover_positions
        from schemas.codec import RecordEncoder
        from schemas.records import ValueFormat
        from tests.harness import producer_conf

        self.nvb = nvb
        self.pub: Any = None
        self.cluster = ProcessCluster.start(tmp, nodes=1, replicas=0, num_vbuckets=nvb, conflict_resolution=mode)
        try:
            self.client = {"bootstrap.servers": broker.bootstrap_servers}
            self.topic = f"dcp.x{uuid.uuid4().hex[:10]}"
            parts = ensure_topics(self.client, self.topic, nvb)
            positions = recover_positions(self.client, self.topic, parts, nvb)
            self.pub = Publisher(self.cluster, producer_conf(broker), self.topic, parts,
                                 RecordEncoder(ValueFormat.AVRO), positions)
            self.pub.open()
        except BaseException:
            self.close()
            raise
        self.node = next(iter(self.cluster.nodes.values()))

    @property
    def url(self) -> str:
        return f"couchbase://127.0.0.1:{self.node.port}"

    def publish(self, timeout: float = 30.0) -> None:
        """Pump until every vbucket's high seqno is in Kafka."""
        import time

        pub = self.pub
        c = self.node.require()
        deadline = time.monotonic() + timeout
        while True:
            for _ in range(20):
                pub.pump()
            highs = {vb: c.vbucket_info(vb).high_seqno for vb in range(self.nvb)}
            if pub.inflight == 0 and pub.held == 0 and all(
                    vb in pub.streaming and pub.sent[vb].seqno >= h for vb, h in highs.items()):
                return
            assert time.monotonic() < deadline, "publisher never caught up"
            pub.kafka.poll(0.01)

    def high_seqnos(self) -> dict[int, int]:
        c = self.node.require()
        return {vb: c.vbucket_info(vb).high_seqno for vb in range(self.nvb)}

    def close(self) -> None:
        try:
            if self.pub is not None:
                self.pub.close(timeout=5)
        finally:
            self.cluster.close(clean=False)


class TargetClusterNodes:
    """A multi-node XDCR target: an in-process cluster (``nodes`` nodes, ``replicas`` replicas) with one KV port per
    node (gateway/kv_cluster.py, as ``dcpgw up --nodes N`` serves it: the cluster map, NOT_MY_VBUCKET with the map
    as body, SCRAM, the with-meta opcodes for a ``replication_target`` user), pumped on a background event loop.
    ``replicating = False`` stops the cluster's replication (not a rebalance's moves, which need it): writes
    acknowledged meanwhile exist on the actives only, and a hard failover loses them."""

    USER = "xdcr"
    PASSWORD = "xdcr-target-pw"

    def __init__(self, data_dir: Path, *, nodes: int = 3, replicas: int = 1, num_vbuckets: int = 8,
                 **cluster: Any) -> None:
        import asyncio
        import threading
        from concurrent.futures import Future

        from engine.cluster.local import Cluster
        from engine.network.kv.frontend import StandaloneHooks
        from engine.security.roles import Role
        from engine.security.users import UserStore
        from gateway.kv_cluster import ClusterKvPorts

        self.users = UserStore.open(data_dir / "users")
        self.users.add(self.USER, self.PASSWORD, [Role.REPLICATION_TARGET, Role.DATA_READER])
        self.cluster = Cluster.create(data_dir / "cluster", nodes=nodes, replicas=replicas,
                                      num_vbuckets=num_vbuckets, **cluster)
        self.nvb = num_vbuckets
        self.replicating = True
        self.next_node = nodes
        self.loop = asyncio.new_event_loop()
        self.ports = ClusterKvPorts(self.cluster, self.users, bucket="default", host="127.0.0.1", first_port=0,
                                    hooks=StandaloneHooks())
        self._pump: Any = None
        ready: Future[None] = Future()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.ports.start())
                self._pump = self.loop.create_task(self._pump_loop())
                ready.set_result(None)
            except BaseException as e:  # handed to the constructor
                ready.set_exception(e)
                return
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True, name="xdcr-target-cluster")
        self.thread.start()
        ready.result(30)

    async def _pump_loop(self) -> None:
        import asyncio

        while True:
            if self.replicating or self.cluster.rebalance_running is not None:
                self.cluster.pump(rounds=2)
            else:
                self.cluster.pump(rounds=1, only=())  # flushes only
            await self.ports.sync()
            await asyncio.sleep(0.001)

    def call(self, fn: Any) -> Any:
        """Run ``fn`` on the loop's thread (the cluster's owner) and return its result."""
        from concurrent.futures import Future

        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed back to the caller
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(run)
        return fut.result(120)

    def members(self) -> list[str]:
        return list(self.call(lambda: self.cluster.vbucket_map().nodes))

    @property
    def url(self) -> str:
        """A ``couchbase://`` URL on the KV port of a node in the map (the replicator reads the map there)."""
        first = self.members()[0]
        return f"couchbase://127.0.0.1:{self.call(lambda: self.ports.ports[first])}/default"

    def failover(self, name: str, *, graceful: bool = False) -> None:
        self.call(lambda: self.cluster.failover(name, graceful=graceful))

    def rebalance(self, add: Sequence[str] = (), remove: Sequence[str] = (), timeout: float = 60.0) -> None:
        """Start a rebalance on the loop and wait until the pump loop finished it."""
        import time

        reb = self.call(lambda: self.cluster.start_rebalance(add=list(add), remove=list(remove)))
        deadline = time.monotonic() + timeout
        while not self.call(lambda: reb.done):
            assert time.monotonic() < deadline, "target rebalance did not finish"
            time.sleep(0.02)
        assert reb.status == "done", reb.error

    def new_node_name(self) -> str:
        self.next_node += 1
        return f"n{self.next_node - 1}"

    def settle(self) -> None:
        self.replicating = True
        self.call(self.cluster.settle)

    def docs(self, keys: Sequence[bytes]) -> dict[bytes, Doc]:
        """The version of each key on its active node (absent: neither document nor tombstone)."""

        def read() -> dict[bytes, Doc]:
            out: dict[bytes, Doc] = {}
            for k in keys:
                try:
                    m = self.cluster.get_meta(k)
                except KeyNotFound:
                    continue
                value = None if m.deleted else bytes(self.cluster.get(k).value)
                out[k] = (value, m.cas, m.rev_seqno, m.flags, m.expiry, m.deleted)
            return out

        return dict(self.call(read))

    def close(self) -> None:
        import asyncio
        import contextlib

        async def down() -> None:
            if self._pump is not None:
                self._pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._pump
            await self.ports.stop()
            self.cluster.close()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def cluster_docs(cluster: Any) -> dict[bytes, Doc]:
    """Every document and tombstone of an in-process cluster, each vbucket read on its active node."""
    vbmap = cluster.vbucket_map()
    out: dict[bytes, Doc] = {}
    for vb, chain in enumerate(vbmap.chains):
        if not chain or chain[0] is None:
            continue
        bucket = cluster.node(chain[0]).require_bucket()
        for k, it in bucket.vbucket(vb).ht.items():
            deleted = it.op is not Op.MUTATION
            out[bytes(k)] = (None if deleted else bytes(it.value or b""), it.cas, it.rev_seqno, it.flags,
                             it.expiry, deleted)
    return out
