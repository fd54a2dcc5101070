"""Shared helpers of the XDCR tests: a target node process and the comparison of documents with their
metadata between the source (an in-process engine bucket) and a target node."""

from __future__ import annotations

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
            positions = recover_positions({**self.client, "fetch.wait.max.ms": 20}, self.topic, parts, nvb)
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
