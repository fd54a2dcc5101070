"""A reference DCP consumer for tests: applies whole snapshots only, resumes, and rolls back exactly.

It is the client docs/engine.md "Snapshots, de-duplication and consistency" asks for (never expose a partial
snapshot) and docs/rollback.md describes:
committed state is kept per vbucket with its history at every snapshot boundary, so a ROLLBACK(s) restores the
state at the newest boundary <= s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import (
    Bucket,
    DcpProducer,
    Item,
    Message,
    Op,
    RollbackRequired,
    SnapshotMarker,
    StreamEnd,
    StreamEndReason,
)
from schemas.position import VBucketPosition


@dataclass
class VBState:
    position: VBucketPosition
    docs: dict[bytes, bytes] = field(default_factory=dict)
    history: list[tuple[int, dict[bytes, bytes]]] = field(default_factory=lambda: [(0, {})])
    pending: list[Item] = field(default_factory=list)
    marker: SnapshotMarker | None = None
    open: bool = False
    rollbacks: list[int] = field(default_factory=list)


class SnapshotConsumer:
    def __init__(self, vbuckets: list[int], *, use_client_log: bool = True) -> None:
        self.vbs = {vb: VBState(VBucketPosition(vb)) for vb in vbuckets}
        self.use_client_log = use_client_log
        self.markers_seen: list[SnapshotMarker] = []
        self.items_seen = 0

    # -------------------------------------------------------------- streaming
    def open_streams(self, producer: DcpProducer) -> None:
        for vb, st in self.vbs.items():
            if st.open:
                continue
            while True:
                args = st.position.request_args()
                if not self.use_client_log:
                    args["failover_log"] = None
                try:
                    log = producer.stream_request(**args)
                except RollbackRequired as rb:
                    self.rollback(vb, rb.seqno)
                    continue
                st.position.on_failover_log(log)
                st.open = True
                break

    def drain(self, producer: DcpProducer, *, max_steps: int = 100_000, ack: bool = True) -> int:
        n = 0
        for _ in range(max_steps):
            msgs = producer.step()
            if not msgs:
                return n
            nbytes = 0
            for m in msgs:
                nbytes += m.dcp_size
                self.handle(m)
                n += 1
            if ack:
                producer.buffer_acknowledge(nbytes)
        raise AssertionError("producer never ran dry")

    def handle(self, m: Message) -> None:
        st = self.vbs[m.vbucket]
        if type(m) is SnapshotMarker:
            assert not st.pending or st.marker is None, "marker inside an incomplete snapshot"
            if st.marker is not None and st.pending:
                raise AssertionError(f"new marker {m} before snapshot {st.marker} completed")
            assert m.start <= m.end
            assert m.end > st.position.seqno or m.start <= st.position.seqno + 1
            st.marker = m
            st.position.on_snapshot(m.start, m.end)
            self.markers_seen.append(m)
        elif type(m) is Item:
            mk = st.marker
            assert mk is not None, "item before any marker"
            assert mk.start <= m.seqno <= mk.end, f"{m} outside {mk}"
            assert m.seqno > st.position.seqno, f"{m} not after {st.position.seqno}"
            assert not st.pending or st.pending[-1].seqno < m.seqno
            st.pending.append(m)
            st.position.on_item(m.seqno)
            self.items_seen += 1
            if m.seqno == mk.end:
                self._commit(st)
        else:
            assert isinstance(m, StreamEnd)
            st.open = False
            if m.reason is StreamEndReason.OK and st.pending:
                self._commit(st)
            st.pending.clear()

    def _commit(self, st: VBState) -> None:
        keys = set()
        for it in st.pending:
            assert it.key not in keys, f"duplicate key {it.key!r} within a snapshot"
            keys.add(it.key)
            if it.op is Op.MUTATION:
                assert it.value is not None
                st.docs[it.key] = it.value
            else:
                st.docs.pop(it.key, None)
        assert st.marker is not None
        st.pending.clear()
        st.position.complete_snapshot()
        st.history.append((st.position.seqno, dict(st.docs)))

    def disconnect(self) -> None:
        """Consumer restart: everything uncommitted is forgotten; positions fall back to the last boundary."""
        for st in self.vbs.values():
            st.open = False
            st.pending.clear()
            st.marker = None
            b = st.history[-1][0]
            st.position.seqno = st.position.snap_start = st.position.snap_end = b

    def rollback(self, vb: int, seqno: int) -> None:
        st = self.vbs[vb]
        st.rollbacks.append(seqno)
        while len(st.history) > 1 and st.history[-1][0] > seqno:
            st.history.pop()
        boundary, docs = st.history[-1]
        st.docs = dict(docs)
        st.pending.clear()
        st.marker = None
        st.position.rollback(seqno, boundary)

    # -------------------------------------------------------------- checks
    def state(self) -> dict[bytes, tuple[bytes, int]]:
        out: dict[bytes, tuple[bytes, int]] = {}
        for vb, st in self.vbs.items():
            for k, v in st.docs.items():
                out[k] = (v, vb)
        return out


def sync(bucket: Bucket, consumer: SnapshotConsumer, name: str = "model") -> DcpProducer:
    producer = bucket.dcp_producer(name)
    consumer.open_streams(producer)
    consumer.drain(producer)
    return producer
