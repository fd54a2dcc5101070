"""The gateway's core: every vbucket's DCP stream into its own Kafka partition, exactly once.

Synchronous and single-threaded like the engine: :meth:`Publisher.pump` moves one batch (DCP step -> encode ->
``Producer.produce``) and serves delivery reports; the service's event loop calls it repeatedly.

Delivery (issue "Gateway"):

* idempotent producer, ``acks=all``, ordering preserved per partition;
* a record's position is *acknowledged* only from its delivery report; delivery reports of one partition arrive
  in produce order, so a FIFO per partition maps each report to the record it acknowledges;
* DCP flow control: the bytes of a DCP message are buffer-acknowledged to the engine only when its record was
  delivered, so a slow or paused broker stalls the stream with bounded gateway memory;
* checkpoints (compacted topic, key = vbucket) are written from acknowledged positions only;
* ROLLBACK from the engine -> a ``rollback`` record, the position falls back to the newest published snapshot
  boundary at or below the rollback seqno, re-request (rollbacks may repeat); never from zero unless the engine
  says zero;
* rollback mitigation (default on): the engine is flushed before every DCP step, so only persisted items are
  published and a crash of the whole process cannot publish history the engine will lose.
"""

from __future__ import annotations

import logging
import re
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from engine import (
    MAX_SEQNO,
    Bucket,
    DcpProducer,
    Item,
    NotMyVBucket,
    RollbackRequired,
    SnapshotMarker,
    StreamEnd,
    StreamFlags,
)
from engine.failover_log import FailoverEntry
from gateway.config import StreamFrom
from gateway.exceptions import GatewayError
from gateway.position import PublishPosition
from gateway.records import KafkaRecord, RecordEncoder, partition_for

log = logging.getLogger(__name__)



class PublishError(GatewayError):
    """Kafka refused a record permanently (the gateway stops; restart resumes from the partition tail)."""


@dataclass(slots=True)
class _Inflight:
    vbucket: int
    dcp_bytes: int
    # position after this record (only for records that move the position), else None
    pos: PublishPosition | None
    #: a filtered-out item: no record, no delivery report; acknowledged with the record before it
    filtered: bool = False


class KeyFilter:
    """Key prefix and/or regex filter (a key must match every filter given)."""

    def __init__(self, prefix: str | None = None, regex: str | None = None) -> None:
        self.prefix = prefix.encode() if prefix else None
        self.regex = re.compile(regex.encode()) if regex else None

    @property
    def active(self) -> bool:
        return self.prefix is not None or self.regex is not None

    def __call__(self, key: bytes) -> bool:
        if self.prefix is not None and not key.startswith(self.prefix):
            return False
        return self.regex is None or self.regex.search(key) is not None


class Publisher:
    """Bridges one bucket's DCP streams into one Kafka topic."""

    def __init__(
        self,
        bucket: Bucket,
        producer_config: dict[str, Any],
        topic: str,
        num_partitions: int,
        encoder: RecordEncoder,
        positions: dict[int, PublishPosition],
        *,
        stream_from: StreamFrom = "saved-offset-or-beginning",
        key_filter: KeyFilter | None = None,
        flow_control_bytes: int = 16 * 1024 * 1024,
        rollback_mitigation: bool = True,
        connection_name: str = "dcpgw",
        on_event: Callable[[str, int, int], None] | None = None,
    ) -> None:
        self.bucket = bucket
        self.topic = topic
        self.num_partitions = num_partitions
        self.encoder = encoder
        self.key_filter = key_filter or KeyFilter()
        self.stream_from = stream_from
        self.rollback_mitigation = rollback_mitigation
        self.flow_control_bytes = flow_control_bytes
        self.connection_name = connection_name
        self._on_event = on_event
        # The producer must not keep the publisher alive (a reference cycle would leave librdkafka's threads
        # running until a cyclic GC): its delivery callback holds a weak reference.
        ref = weakref.ref(self)

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            pub = ref()
            if pub is not None:
                pub._on_delivery(err, msg)

        self.kafka = Producer({**producer_config, "on_delivery": on_delivery})
        self.dcp: DcpProducer | None = None
        nvb = bucket.num_vbuckets
        # position after the last record produced (sent) and after the last record acknowledged
        self.sent: dict[int, PublishPosition] = {vb: positions.get(vb, PublishPosition(vb)) for vb in range(nvb)}
        self.acked: dict[int, PublishPosition] = {vb: p.copy() for vb, p in self.sent.items()}
        self._inflight: dict[int, deque[_Inflight]] = {}
        self._dirty_acked: set[int] = set()
        self.streaming: set[int] = set()
        self.error: BaseException | None = None
        # stats
        self.records_sent = 0
        self.records_acked = 0
        self.bytes_sent = 0
        self.rollbacks = 0
        self.errors = 0
        self.items_filtered = 0

    # ------------------------------------------------------------------ streams
    def _event(self, name: str, vb: int, value: int = 1) -> None:
        if self._on_event is not None:
            self._on_event(name, vb, value)

    def open(self) -> None:
        """Open the DCP connection and a stream per vbucket from its position (per ``stream_from``)."""
        self.dcp = self.bucket.dcp_producer(self.connection_name, buffer_size=self.flow_control_bytes)
        for vb in range(self.bucket.num_vbuckets):
            self.open_stream(vb)

    def open_stream(self, vb: int) -> None:
        dcp = self.dcp
        assert dcp is not None
        pos = self.sent[vb]
        use_saved = self.stream_from.startswith("saved-offset") and not pos.is_fresh
        if self.stream_from == "beginning" and not pos.is_fresh:
            # A deliberate replay over a topic that already has this vbucket's records: tell consumers with a
            # rollback record to 0, so the re-sent history is not mistaken for duplicates.
            self._publish_rollback(vb, 0)
        from_now = (self.stream_from == "now") or (self.stream_from == "saved-offset-or-now" and not use_saved)
        for _attempt in range(64):
            try:
                if from_now:
                    log_ = dcp.stream_request(vb, 0, MAX_SEQNO, flags=StreamFlags.FROM_LATEST)
                    self._publish_failover_log(vb, log_)
                    # Deliberately skip the history: the position jumps to the high seqno.
                    high = self.bucket.vbucket(vb).high_seqno
                    pos.seqno = pos.snap_start = pos.snap_end = pos.boundary = high
                    self.streaming.add(vb)
                    return
                else:
                    log_ = dcp.stream_request(end_seqno=MAX_SEQNO, **pos.request_args())
            except RollbackRequired as rb:
                self._publish_rollback(vb, rb.seqno)
                continue
            except NotMyVBucket:
                log.warning("vbucket %d is not streamable now; skipped", vb)
                return
            self._publish_failover_log(vb, log_)
            self.streaming.add(vb)
            return
        raise GatewayError(f"vbucket {vb}: stream request kept rolling back")

    def _publish_rollback(self, vb: int, seqno: int) -> None:
        pos = self.sent[vb]
        restart = pos.on_rollback(seqno)
        engine_log = self.bucket.failover_log(vb)
        rec = self.encoder.rollback(vb, seqno, engine_log, snap_start=restart, snap_end=restart)
        self._produce(vb, rec, 0, pos.copy())
        self.rollbacks += 1
        self._event("rollback", vb, seqno)
        log.info("vbucket %d: engine answered ROLLBACK(%d); restarting from %d", vb, seqno, restart)

    def _publish_failover_log(self, vb: int, entries: list[FailoverEntry]) -> None:
        pos = self.sent[vb]
        pos.on_failover_log(entries)
        high = self.bucket.vbucket(vb).high_seqno
        rec = self.encoder.failover_log(vb, entries, high, pos.snap_start, pos.snap_end)
        self._produce(vb, rec, 0, pos.copy())

    # ------------------------------------------------------------------ pumping
    def pump(self, max_messages: int = 8192) -> int:
        """One round: DCP step -> Kafka produce; serve delivery reports. Returns DCP messages handled."""
        if self.error is not None:
            raise PublishError(f"publishing stopped: {self.error}") from self.error
        dcp = self.dcp
        assert dcp is not None, "open() first"
        if self.rollback_mitigation and self.bucket.dirty_vbuckets:
            # Persisted-only publishing: everything step() returns below is already on disk.
            self.bucket.flush()
            if self.bucket.dirty_vbuckets:
                self.bucket.flush_all()
        msgs = dcp.step(max_messages)
        if msgs:
            self._publish(msgs)
        self.kafka.poll(0)
        return len(msgs)

    def _publish(self, msgs: list[SnapshotMarker | Item | StreamEnd]) -> None:
        enc = self.encoder
        sent = self.sent
        kf = self.key_filter
        filtering = kf.active
        for m in msgs:
            if type(m) is Item:
                vb = m.vbucket
                pos = sent[vb]
                size = m.dcp_size
                if filtering and not kf(m.key):
                    self.items_filtered += 1
                    pos.seqno = m.seqno
                    done = m.seqno >= pos.snap_end
                    if done:
                        pos.complete_if_done()
                    self._produce(vb, None, size, pos.copy() if done else None)
                    continue
                rec = enc.data(m, pos.vbuuid, pos.snap_start, pos.snap_end)
                pos.on_data(m.seqno)
                self._produce(vb, rec, size, pos.copy() if m.seqno >= pos.snap_end else None, m.seqno)
            elif type(m) is SnapshotMarker:
                vb = m.vbucket
                pos = sent[vb]
                pos.on_snapshot(m.start, m.end)
                rec = enc.snapshot(m, pos.vbuuid)
                self._produce(vb, rec, m.dcp_size, None)
            else:
                assert isinstance(m, StreamEnd)
                vb = m.vbucket
                pos = sent[vb]
                self.streaming.discard(vb)
                rec = enc.stream_end(m, pos.vbuuid, pos.seqno, pos.snap_start, pos.snap_end)
                self._produce(vb, rec, m.dcp_size, None)
                self._event("stream_end", vb, int(m.reason))

    def _produce(
        self, vb: int, rec: KafkaRecord | None, dcp_bytes: int, pos: PublishPosition | None, seqno: int = -1
    ) -> None:
        part = partition_for(vb, self.num_partitions)
        q = self._inflight.get(part)
        if q is None:
            q = self._inflight[part] = deque()
        if rec is None:
            # Filtered item: acknowledged once everything before it on this partition is delivered.
            entry = _Inflight(vb, dcp_bytes, pos, True)
            if q:
                q.append(entry)
            else:
                self._ack(entry, self.acked[vb].offset)
            return
        q.append(_Inflight(vb, dcp_bytes, pos))
        while True:
            try:
                self.kafka.produce(self.topic, rec.value, rec.key, partition=part, headers=rec.headers)
                break
            except BufferError:
                # librdkafka's queue is full (broker slow): serve delivery reports, then retry.
                self.kafka.poll(0.05)
        self.records_sent += 1
        self.bytes_sent += len(rec.value or b"") + len(rec.key or b"")

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        part = msg.partition()
        q = self._inflight.get(part) if part is not None else None
        if not q:
            log.error("delivery report for partition %s with nothing in flight", part)
            return
        entry = q.popleft()
        if err is not None:
            self.errors += 1
            self.error = KafkaException(err)
            log.error("record for vbucket %d not delivered: %s", entry.vbucket, err)
            return
        self.records_acked += 1
        offset = msg.offset()
        assert offset is not None  # delivered records have offsets
        self._ack(entry, offset)
        # filtered items queued behind this record are acknowledged with it
        while q and q[0].filtered:
            self._ack(q.popleft(), offset)

    def _ack(self, entry: _Inflight, offset: int) -> None:
        if entry.dcp_bytes and self.dcp is not None:
            self.dcp.buffer_acknowledge(entry.dcp_bytes)
        vb = entry.vbucket
        if entry.filtered:
            # a filtered item's "offset" is that of the last record before it on the partition; the
            # vbucket's own last record may be older, so only the position moves.
            if entry.pos is not None:
                entry.pos.offset = self.acked[vb].offset
                self.acked[vb] = entry.pos
                self._dirty_acked.add(vb)
            return
        # Only records that end a snapshot (or carry a failover log / rollback) move the acknowledged
        # position: a checkpoint is always an exact resume point (bytewax: the state *after* the last item
        # of a complete unit), and the tail replay from its offset + 1 rebuilds any partial snapshot.
        if entry.pos is not None:
            entry.pos.offset = offset
            self.acked[vb] = entry.pos
            self._dirty_acked.add(vb)

    # ------------------------------------------------------------------ checkpoints & status
    def take_checkpoints(self) -> dict[int, PublishPosition]:
        """Acknowledged positions changed since the last call (to write to the checkpoint topic)."""
        out = {vb: self.acked[vb].copy() for vb in self._dirty_acked}
        self._dirty_acked.clear()
        return out

    @property
    def inflight(self) -> int:
        return sum(len(q) for q in self._inflight.values())

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for outstanding deliveries. Returns how many remain."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            self.kafka.poll(0.05)
        return self.inflight

    def status(self, vb: int) -> dict[str, int | bool]:
        v = self.bucket.vbucket(vb)
        acked = self.acked[vb]
        return {
            "vbucket": vb,
            "partition": partition_for(vb, self.num_partitions),
            "streaming": vb in self.streaming,
            "engine_high_seqno": v.high_seqno,
            "engine_persisted_seqno": v.persisted_seqno,
            "published_seqno": self.sent[vb].seqno,
            "acknowledged_seqno": acked.seqno,
            "acknowledged_offset": acked.offset,
            "lag": max(0, v.high_seqno - acked.seqno),
            "vbuuid": self.sent[vb].vbuuid,
        }

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        if self.dcp is not None:
            if self.bucket.producers.get(self.connection_name) is self.dcp:
                self.bucket.close_producer(self.connection_name)
            self.dcp = None
