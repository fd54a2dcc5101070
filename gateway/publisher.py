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
  published and a crash of the whole process cannot publish history the engine will lose;
* cluster mode (:class:`~engine.cluster.Cluster` or :class:`~engine.process_cluster.ProcessCluster` source,
  docs/gateway-cluster.md): every vbucket is streamed from its active node; on a stream end (STATE_CHANGED on failover), a dead connection (node down) or NOT_MY_VBUCKET
  the map is reloaded and the vbucket re-requested from the new active with the gateway's own published
  position, exactly as after a restart. Rollback mitigation there holds each vbucket's DCP messages in a buffer
  until observe-by-seqno says they are persisted on the active and every replica (Couchbase Kafka connector).
"""

from __future__ import annotations

import contextlib
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
    RangeError,
    RollbackRequired,
    SnapshotMarker,
    StreamEnd,
    StreamFlags,
    TemporaryFailure,
)
from engine.cluster import Cluster
from engine.failover_log import FailoverEntry
from engine.process_cluster import ProcessCluster
from engine.stream import Message as DcpStreamMessage
from engine.stream import StreamState
from gateway.config import StreamFrom
from gateway.exceptions import GatewayError
from gateway.position import PublishPosition
from gateway.records import KafkaRecord, RecordEncoder, partition_for
from gateway.source import BucketSource, DcpConnection, DcpSource, Topology, make_source

log = logging.getLogger(__name__)

#: what a DCP step hands the publisher (its streams never have the TAKEOVER flag, so no set-vbucket-state)
DcpMessage = DcpStreamMessage


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
    #: the DCP connection the message came from (its bytes are buffer-acknowledged there)
    producer: DcpConnection | None = None
    #: time.monotonic() when the record was handed to the publisher (age of the oldest unacknowledged record)
    t: float = 0.0


@dataclass(slots=True)
class _Queued:
    """A record whose position is already taken (``sent`` moved) but that librdkafka's full queue did not
    accept yet: produced, in order, before anything else on a later pump (docs/reliability.md)."""

    vb: int
    rec: KafkaRecord | None
    dcp_bytes: int
    pos: PublishPosition | None
    seqno: int
    producer: DcpConnection | None
    t: float


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
    """Bridges one bucket's (or one cluster's) DCP streams into one Kafka topic."""

    def __init__(
        self,
        source: Bucket | Cluster | ProcessCluster | DcpSource,
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
        self.source: DcpSource = make_source(source, connection_name, flow_control_bytes)
        self.is_cluster = self.source.is_cluster
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
        nvb = self.source.num_vbuckets
        #: the DCP connection each vbucket streams from now (None: not streaming)
        self._owner: list[DcpConnection | None] = [None] * nvb
        #: cluster mode: vbuckets to re-request on the next pump, and those waiting for the topology to change
        self._detached: set[int] = set()
        self._waiting: set[int] = set()
        self._topo: Topology | None = None
        #: a connection died during the last step: check every vbucket's connection on the next _follow
        self._recheck = False
        #: cluster-mode rollback mitigation: DCP messages not yet persisted everywhere, per vbucket, in order
        self._held: dict[int, deque[DcpMessage]] = {}
        #: the last persisted-everywhere seqno seen per vbucket (saves an observe per pump)
        self._safe: dict[int, int] = {}
        # position after the last record produced (sent) and after the last record acknowledged
        self.sent: dict[int, PublishPosition] = {vb: positions.get(vb, PublishPosition(vb)) for vb in range(nvb)}
        self.acked: dict[int, PublishPosition] = {vb: p.copy() for vb, p in self.sent.items()}
        self._inflight: dict[int, deque[_Inflight]] = {}
        #: records librdkafka's queue refused (BufferError), oldest first: DCP is not stepped while any wait
        self._backlog: deque[_Queued] = deque()
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
        self.restreams = 0

    @property
    def bucket(self) -> Bucket:
        """The single bucket streamed (single-bucket mode only)."""
        src = self.source
        if not isinstance(src, BucketSource):
            raise GatewayError("the publisher streams a cluster, not one bucket")
        return src.bucket

    @property
    def dcp(self) -> DcpProducer | None:
        """The single DCP connection (single-bucket mode; None in cluster mode)."""
        src = self.source
        if not isinstance(src, BucketSource):
            return None
        ps = src.producers()
        return ps[0] if ps else None

    @staticmethod
    def _buffer_ack(p: DcpConnection, nbytes: int) -> None:
        """DCP buffer-ack; a connection that died meanwhile (a node process killed) has nothing to ack to."""
        with contextlib.suppress(TemporaryFailure):
            p.buffer_acknowledge(nbytes)

    # ------------------------------------------------------------------ streams
    def _event(self, name: str, vb: int, value: int = 1) -> None:
        if self._on_event is not None:
            self._on_event(name, vb, value)

    def open(self) -> None:
        """Open the DCP connection(s) and a stream per vbucket from its position (per ``stream_from``)."""
        self.source.open()
        self._topo = self.source.topology()
        for vb in range(self.source.num_vbuckets):
            self.open_stream(vb)

    def open_stream(self, vb: int) -> None:
        pos = self.sent[vb]
        use_saved = self.stream_from.startswith("saved-offset") and not pos.is_fresh
        if self.stream_from == "beginning" and not pos.is_fresh:
            # A deliberate replay over a topic that already has this vbucket's records: tell consumers with a
            # rollback record to 0, so the re-sent history is not mistaken for duplicates.
            self._publish_rollback(vb, 0)
        from_now = (self.stream_from == "now") or (self.stream_from == "saved-offset-or-now" and not use_saved)
        if not self._request(vb, from_now) and self.is_cluster:
            self._waiting.add(vb)

    def _request(self, vb: int, from_now: bool) -> bool:
        """Stream request for ``vb`` from the publisher's own position (or from now); ROLLBACK answers become
        rollback records and the request is repeated (dcp-reference.md "Client rules": rollbacks can repeat).
        Returns False when the vbucket cannot be streamed now (NOT_MY_VBUCKET, node down)."""
        pos = self.sent[vb]
        src = self.source
        for _attempt in range(64):
            try:
                dcp = src.producer_for(vb)
                if from_now:
                    log_ = dcp.stream_request(vb, 0, MAX_SEQNO, flags=StreamFlags.FROM_LATEST)
                    self._publish_failover_log(vb, log_)
                    # Deliberately skip the history: the position jumps to the high seqno.
                    high = src.high_seqno(vb)
                    pos.seqno = pos.snap_start = pos.snap_end = pos.boundary = high
                    self._owner[vb] = dcp
                    self.streaming.add(vb)
                    return True
                log_ = dcp.stream_request(end_seqno=MAX_SEQNO, **pos.request_args())
            except RollbackRequired as rb:
                self._publish_rollback(vb, rb.seqno)
                continue
            except (NotMyVBucket, TemporaryFailure) as e:
                # kv_engine client rule: NOT_MY_VBUCKET -> reload the map; retried when the topology changes.
                if self.is_cluster:
                    log.info("vbucket %d is not streamable now (%s); waiting for the map to change", vb, e)
                else:
                    log.warning("vbucket %d is not streamable now; skipped", vb)
                return False
            except RangeError as e:
                if not self.is_cluster:
                    raise
                log.error("vbucket %d: stream request refused (%s); retried when the map changes", vb, e)
                return False
            self._publish_failover_log(vb, log_)
            self._owner[vb] = dcp
            self.streaming.add(vb)
            return True
        raise GatewayError(f"vbucket {vb}: stream request kept rolling back")

    # ------------------------------------------------------------------ following the cluster
    def _detach(self, vb: int) -> None:
        """Stop streaming ``vb`` from its current connection; it is re-requested on the next pump."""
        p = self._owner[vb]
        self._owner[vb] = None
        self.streaming.discard(vb)
        self._safe.pop(vb, None)
        held = self._held.pop(vb, None)
        if p is not None:
            if held:
                # never published: the re-request from the published position streams them again
                self._buffer_ack(p, sum(m.dcp_size for m in held))
            old = p.streams.get(vb)
            # a remote stream has no state: it is in ``streams`` until its stream-end was read
            if not p.closed and old is not None and getattr(old, "state", None) is not StreamState.DEAD:
                # over TCP the node may have ended it meanwhile (NOT_MY_VBUCKET) or died (NodeUnavailable)
                with contextlib.suppress(NotMyVBucket, TemporaryFailure):
                    p.close_stream(vb)
            if old is not None:
                # forget the ended stream (its stream-end must not be taken for the next stream's)
                p.discard_stream(vb)
        self._detached.add(vb)

    def _follow(self) -> None:
        """Cluster mode: when the map or the live nodes changed, detach every vbucket whose connection died or
        whose active moved, and give the waiting ones another try; then re-request every detached vbucket
        from the new active with the published position (vbuuid, seqno, snapshot range) -- the DCP client rule
        "on NOT_MY_VBUCKET or a stream end, reload the map and re-request with your own position"."""
        src = self.source
        topo = src.topology()
        if topo != self._topo or self._recheck:
            self._topo = topo
            self._recheck = False
            self._detached |= self._waiting
            self._waiting.clear()
            for vb, p in enumerate(self._owner):
                if p is not None and (p.closed or src.node_of(p) != src.active_node(vb)):
                    self._detach(vb)
        if self._detached:
            todo = sorted(self._detached)
            self._detached.clear()
            for vb in todo:
                self.restreams += 1
                self._event("restream", vb)
                if not self._request(vb, False):
                    self._waiting.add(vb)

    def _publish_rollback(self, vb: int, seqno: int) -> None:
        pos = self.sent[vb]
        restart = pos.on_rollback(seqno)
        engine_log = self.source.failover_log(vb)
        rec = self.encoder.rollback(vb, seqno, engine_log, snap_start=restart, snap_end=restart)
        self._produce(vb, rec, 0, pos.copy())
        self.rollbacks += 1
        self._event("rollback", vb, seqno)
        log.info("vbucket %d: engine answered ROLLBACK(%d); restarting from %d", vb, seqno, restart)

    def _publish_failover_log(self, vb: int, entries: list[FailoverEntry]) -> None:
        pos = self.sent[vb]
        pos.on_failover_log(entries)
        high = self.source.high_seqno(vb)
        rec = self.encoder.failover_log(vb, entries, high, pos.snap_start, pos.snap_end)
        self._produce(vb, rec, 0, pos.copy())

    # ------------------------------------------------------------------ pumping
    def pump(self, max_messages: int = 8192) -> int:
        """One round: serve delivery reports, then DCP step -> Kafka produce. Returns DCP messages handled.

        Delivery reports are served *before* the step: their DCP buffer-acks free the flow-control budget the
        step then uses. So a round that returns 0 with nothing in flight really had nothing to stream (serving
        them after the step could empty ``inflight`` right after a step the full buffer held back, and a
        caller waiting for "0 moved, nothing in flight" would stop with items still to send).
        """
        if self.error is not None:
            raise PublishError(f"publishing stopped: {self.error}") from self.error
        self.kafka.poll(0)
        if self.error is not None:  # a delivery report just served said a record was lost
            raise PublishError(f"publishing stopped: {self.error}") from self.error
        if self._backlog:
            # librdkafka's queue was full (broker slow or paused): hand it the waiting records first and
            # step DCP only once they are all in; never wait for room on this (the event loop's) thread.
            n = self._drain()
            if self._backlog:
                return n
        if self.is_cluster:
            return self._pump_cluster(max_messages)
        src = self.source
        dcp = src.producer_for(0) if self._topo is not None else None
        assert dcp is not None, "open() first"
        src.before_step(self.rollback_mitigation)
        msgs = dcp.step(max_messages)
        if msgs:
            self._publish(msgs)
        return len(msgs)

    def _pump_cluster(self, max_messages: int) -> int:
        assert self._topo is not None, "open() first"
        n = 0
        owner = self._owner
        held = self._held if self.rollback_mitigation else None
        for p in self.source.producers():
            try:
                msgs = p.step(max_messages)
            except TemporaryFailure:
                # A node process's connection dropped (SIGKILL: NodeUnavailable). The DCP client rule treats it
                # like NOT_MY_VBUCKET: force the topology check below, which detaches the connection's vbuckets
                # and re-requests them from the map's active with the published position.
                self._recheck = True
                continue
            if not msgs:
                continue
            n += len(msgs)
            mine: list[DcpMessage] = []
            stale = 0
            for m in msgs:
                if owner[m.vbucket] is p:
                    mine.append(m)
                else:
                    stale += m.dcp_size  # the tail of a stream the gateway already moved away from
            if stale:
                self._buffer_ack(p, stale)
            if held is None:
                self._publish(mine)
                continue
            for m in mine:
                vb = m.vbucket
                if type(m) is StreamEnd:
                    q = held.pop(vb, None)
                    if q:
                        # Not persisted everywhere, never published: dropped; the re-request streams what
                        # survived again.
                        self._buffer_ack(p, sum(x.dcp_size for x in q))
                    self._publish([m])
                else:
                    q = held.get(vb)
                    if q is None:
                        q = held[vb] = deque()
                    q.append(m)
        if held:
            n += self._release()
        # after the step: streams that ended (STATE_CHANGED) were published as stream-end records first
        self._follow()
        return n

    def _release(self) -> int:
        """Publish held messages that are persisted on the active and every replica (Couchbase Kafka connector
        rollback mitigation). A snapshot is released only once its whole range is persisted everywhere: then
        a promoted replica's branch point is at or above the published snapshot's end, and kv_engine's
        needsRollback (rule 7: snap_end <= upper) answers "no rollback" to the re-request. Order is kept; the
        marker is published before its items."""
        released = 0
        safe_seen = self._safe
        for vb in list(self._held):
            q = self._held[vb]
            out: list[DcpMessage] = []
            safe = safe_seen.get(vb, 0)
            while q:
                m = q[0]
                if type(m) is SnapshotMarker and m.end > safe:
                    safe = self.source.persisted_everywhere(vb, self.sent[vb].vbuuid)
                    safe_seen[vb] = safe
                    if m.end > safe:
                        break
                out.append(q.popleft())
            if not q:
                del self._held[vb]
            if out:
                released += len(out)
                self._publish(out)
        return released

    @property
    def held(self) -> int:
        """DCP messages held back by cluster-mode rollback mitigation."""
        return sum(len(q) for q in self._held.values())

    def _publish(self, msgs: list[DcpMessage]) -> None:
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
                if self.is_cluster:
                    # STATE_CHANGED (failover), ROLLBACK, DISCONNECTED...: reload the map and re-request.
                    self._detach(vb)

    def _produce(
        self, vb: int, rec: KafkaRecord | None, dcp_bytes: int, pos: PublishPosition | None, seqno: int = -1
    ) -> None:
        queued = _Queued(vb, rec, dcp_bytes, pos, seqno, self._owner[vb], time.monotonic())
        if self._backlog or not self._send(queued):
            # keep the order: once one record waits, every later one waits behind it
            self._backlog.append(queued)

    def _drain(self) -> int:
        """Produce waiting records in order until librdkafka's queue is full again. Returns how many went."""
        n = 0
        backlog = self._backlog
        while backlog:
            if not self._send(backlog[0]):
                break
            backlog.popleft()
            n += 1
        return n

    def _send(self, r: _Queued) -> bool:
        """Produce one record (never waits). False when librdkafka's queue is full: nothing was changed, the
        caller keeps the record for a later pump."""
        vb = r.vb
        part = partition_for(vb, self.num_partitions)
        q = self._inflight.get(part)
        if q is None:
            q = self._inflight[part] = deque()
        rec = r.rec
        if rec is None:
            # Filtered item: acknowledged once everything before it on this partition is delivered.
            entry = _Inflight(vb, r.dcp_bytes, r.pos, True, r.producer, r.t)
            if q:
                q.append(entry)
            else:
                self._ack(entry, self.acked[vb].offset)
            return True
        try:
            self.kafka.produce(self.topic, rec.value, rec.key, partition=part, headers=rec.headers)
        except BufferError:
            return False
        # appended after produce(): delivery reports are only served by poll(), so none can come in between
        q.append(_Inflight(vb, r.dcp_bytes, r.pos, False, r.producer, r.t))
        self.records_sent += 1
        self.bytes_sent += len(rec.value or b"") + len(rec.key or b"")
        return True

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
        if entry.dcp_bytes and entry.producer is not None:
            try:  # noqa: SIM105 -- the hot path: no context manager per delivered record
                entry.producer.buffer_acknowledge(entry.dcp_bytes)
            except TemporaryFailure:
                pass  # the connection died meanwhile (a node process killed): nothing to acknowledge to
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
        """Records not yet acknowledged: produced, or waiting for room in librdkafka's queue."""
        return sum(len(q) for q in self._inflight.values()) + len(self._backlog)

    @property
    def backlog(self) -> int:
        """Records waiting for room in librdkafka's queue (the broker is slow or paused)."""
        return len(self._backlog)

    def oldest_unacked_age(self, now: float | None = None) -> float:
        """Seconds since the oldest record not yet acknowledged by Kafka was handed over (0.0: none)."""
        oldest = min((q[0].t for q in self._inflight.values() if q), default=None)
        if self._backlog:
            t = self._backlog[0].t
            oldest = t if oldest is None else min(oldest, t)
        if oldest is None:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - oldest)

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for outstanding deliveries (blocking: for shutdown and tests, never on the event loop's
        thread while it serves requests). Returns how many remain."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            self._drain()
            self.kafka.poll(0.05)
        return self.inflight

    def status(self, vb: int) -> dict[str, int | bool]:
        high, persisted = self.source.seqnos(vb)
        acked = self.acked[vb]
        return {
            "vbucket": vb,
            "partition": partition_for(vb, self.num_partitions),
            "streaming": vb in self.streaming,
            "engine_high_seqno": high,
            "engine_persisted_seqno": persisted,
            "published_seqno": self.sent[vb].seqno,
            "acknowledged_seqno": acked.seqno,
            "acknowledged_offset": acked.offset,
            "lag": max(0, high - acked.seqno),
            "vbuuid": self.sent[vb].vbuuid,
        }

    def lag(self) -> tuple[int, int]:
        """(total, worst) over vbuckets of the active's high seqno - the acknowledged seqno."""
        total = worst = 0
        src = self.source
        acked = self.acked
        for vb in range(src.num_vbuckets):
            d = src.seqnos(vb)[0] - acked[vb].seqno
            if d > 0:
                total += d
                worst = max(worst, d)
        return total, worst

    def following(self) -> dict[int, str]:
        """vbucket -> the node its stream reads from now (cluster mode; streaming vbuckets only)."""
        src = self.source
        return {vb: src.node_of(p) for vb, p in enumerate(self._owner) if p is not None and not p.closed}

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        self._owner = [None] * len(self._owner)
        self._held.clear()
        self.source.close()
