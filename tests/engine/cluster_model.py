"""Test helpers for clusters: a DCP client following the vbucket map, and replica/active comparisons."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from engine import DcpProducer, NotMyVBucket, RollbackRequired, StreamEnd, StreamEndReason, TemporaryFailure
from engine.cluster.local import Cluster
from engine.cluster.vbucket_map import VBucketMap
from engine.kv.vbucket import VBucket, VBucketState
from tests.engine.dcp_model import SnapshotConsumer, VBState


class MapFollower:
    """What a DCP client following the vbucket map does the same whether it reaches the nodes in process
    (ClusterClient) or over TCP (process_model.ProcessClusterClient): which streams to (re)open, the fall back
    to the last committed snapshot boundary, and the delivery of a producer's messages to the consumer."""

    consumer: SnapshotConsumer
    #: vbucket -> (node, producer) it streams from now
    source: dict[int, tuple[str, Any]]

    def _reset(self, vb: int) -> None:
        raise NotImplementedError

    def _rewind(self, vb: int) -> None:
        """Back to the last committed snapshot boundary, the stream not open."""
        st = self.consumer.vbs[vb]
        st.open = False
        st.pending.clear()
        st.marker = None
        b = st.history[-1][0]
        st.position.seqno = st.position.snap_start = st.position.snap_end = b

    def _streams_to_open(self, vbmap: VBucketMap) -> Iterator[tuple[int, VBState, str]]:
        """(vbucket, its consumer state, the active node) of every stream to (re)open; a stream whose node is no
        longer the active (or whose producer closed) is reset first."""
        for vb, st in self.consumer.vbs.items():
            src = self.source.get(vb)
            if st.open and src is not None:
                if not src[1].closed and vbmap.active(vb) == src[0]:
                    continue
                self._reset(vb)
            elif not st.open and vb in self.source:
                self._reset(vb)
            node = vbmap.active(vb)
            if node is None:
                continue
            yield vb, st, node

    def _deliver(self, p: object, msgs: list[Any]) -> None:
        """Hand ``p``'s messages to the consumer; a stream end other than OK resets the stream."""
        for m in msgs:
            src = self.source.get(m.vbucket)
            if src is None or src[1] is not p:
                continue  # the tail of a stream this client already moved away from
            self.consumer.handle(m)
            if isinstance(m, StreamEnd) and m.reason is not StreamEndReason.OK:
                self._reset(m.vbucket)


class ClusterClient(MapFollower):
    """A snapshot-aware DCP client (``SnapshotConsumer``) that streams every vbucket from its active node.

    On a stream end other than OK, or when the node it streamed from went away, it falls back to its last
    committed snapshot boundary, reloads the map and re-requests from the new active with its own position
    (rolling back as often as told).
    """

    def __init__(self, cluster: Cluster, name: str = "client") -> None:
        self.cluster = cluster
        self.name = name
        self.consumer = SnapshotConsumer(list(range(cluster.num_vbuckets)))
        self.producers: dict[str, DcpProducer] = {}
        #: vbucket -> (node, producer) it streams from now
        self.source: dict[int, tuple[str, DcpProducer]] = {}

    def _reset(self, vb: int) -> None:
        src = self.source.get(vb)
        p = src[1] if src is not None else None
        if p is not None and not p.closed:
            with contextlib.suppress(NotMyVBucket):
                p.close_stream(vb)
        self._rewind(vb)
        self.source.pop(vb, None)

    def _producer(self, node: str) -> DcpProducer | None:
        n = self.cluster.nodes[node]
        if not n.up:
            return None
        p = self.producers.get(node)
        if p is None or p.closed:
            assert n.bucket is not None
            p = n.bucket.dcp_producer(self.name)
            self.producers[node] = p
        return p

    def open_streams(self) -> None:
        for vb, st, node in self._streams_to_open(self.cluster.vbucket_map()):
            p = self._producer(node)
            if p is None:
                continue
            while True:
                try:
                    log = p.stream_request(**st.position.request_args())
                except RollbackRequired as rb:
                    self.consumer.rollback(vb, rb.seqno)
                    continue
                except NotMyVBucket:
                    break
                st.position.on_failover_log(log)
                st.open = True
                self.source[vb] = (node, p)
                break

    def poll(self, max_rounds: int = 100_000) -> int:
        """Stream until every producer runs dry; returns messages handled."""
        n = 0
        for _ in range(max_rounds):
            self.open_streams()
            moved = 0
            for node in sorted(self.producers):
                p = self.producers[node]
                if p.closed:
                    continue
                msgs = p.step()
                self._deliver(p, msgs)
                p.buffer_acknowledge(sum(m.dcp_size for m in msgs))
                moved += len(msgs)
            n += moved
            if not moved:
                return n
        raise AssertionError("client never ran dry")

    def state(self) -> dict[bytes, tuple[bytes, int]]:
        return self.consumer.state()


def actives_state(cluster: Cluster) -> dict[bytes, tuple[bytes, int]]:
    """Every live document of every vbucket, read from its mapped active node."""
    out: dict[bytes, tuple[bytes, int]] = {}
    vbmap = cluster.vbucket_map()
    for vb in range(vbmap.num_vbuckets):
        try:
            bucket = cluster.active_bucket(vb)
        except (NotMyVBucket, TemporaryFailure):
            continue
        for k, it in bucket.vbucket(vb).ht.items():
            if it.op.value == 0 and it.value is not None:
                out[k] = (it.value, vb)
    return out


def vb_image(vb: VBucket) -> dict[bytes, tuple[object, ...]]:
    """A vbucket's hash table with every field a replica must copy."""
    return {k: (it.seqno, it.rev_seqno, it.cas, it.op, it.value, it.flags, it.expiry, it.datatype)
            for k, it in vb.ht.items()}


def assert_replicas_equal_actives(cluster: Cluster) -> None:
    vbmap = cluster.vbucket_map()
    for vb in range(vbmap.num_vbuckets):
        try:
            active = cluster.active_bucket(vb).vbucket(vb)
        except (NotMyVBucket, TemporaryFailure):
            continue
        assert active.state is VBucketState.ACTIVE
        for r in vbmap.replicas(vb):
            node = cluster.nodes[r]
            if not node.up:
                continue
            assert node.bucket is not None
            rvb = node.bucket.vbucket(vb)
            assert rvb.state is VBucketState.REPLICA, (vb, r, rvb.state)
            assert rvb.high_seqno == active.high_seqno, (vb, r, rvb.high_seqno, active.high_seqno)
            assert vb_image(rvb) == vb_image(active), (vb, r)
            assert rvb.failover.entries == active.failover.entries, (vb, r)
            assert rvb.max_cas >= max((it.cas for it in active.ht.values()), default=0)
