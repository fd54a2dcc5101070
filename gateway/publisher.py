"""The gateway's core: every vbucket's DCP stream into its own Kafka partition, exactly once.

Synchronous and single-threaded like the engine: :meth:`Publisher.pump` moves one batch (DCP step -> encode ->
``Producer.produce``) and serves delivery reports; the service's event loop calls it repeatedly.

Delivery (issue "Gateway"):

* idempotent producer, ``acks=all``, ordering preserved per partition;
* a record's position is *acknowledged* only from a delivery report; delivery reports of one partition arrive
  in produce order, so a FIFO per partition maps each report to the record it acknowledges. A data record
  followed by another of its partition in the same batch is produced without a report: the next report
  acknowledges both, its offset proving, by counting, that every record in between was written;
* DCP flow control: the bytes of a DCP message are buffer-acknowledged to the engine only when its record was
  delivered, so a slow or paused broker stalls the stream with bounded gateway memory;
* checkpoints (compacted topic, key = vbucket) are written from acknowledged positions only;
* ROLLBACK from the engine -> a ``rollback`` record, the position falls back to the newest published snapshot
  boundary at or below the rollback seqno, re-request (rollbacks may repeat); never from zero unless the engine
  says zero;
* rollback mitigation (default on): the engine is flushed before every DCP step, so only persisted items are
  published and a crash of the whole process cannot publish history the engine will lose;
* cluster mode (:class:`~engine.cluster.local.Cluster` or :class:`~engine.network.process_cluster.ProcessCluster` source,
  docs/gateway-cluster.md): every vbucket is streamed from its active node; on a stream end (STATE_CHANGED on failover), a dead connection (node down) or NOT_MY_VBUCKET
  the map is reloaded and the vbucket re-requested from the new active with the gateway's own published
  position, exactly as after a restart. Rollback mitigation there holds each vbucket's DCP messages in a buffer
  until observe-by-seqno says they are persisted on the active and every replica (Couchbase Kafka connector).

Records Kafka refuses as too large (docs/reliability.md "Large documents"): a record larger than
``large_record_bytes`` is produced *alone* on its partition (nothing else of the partition in flight before or
after it until its delivery report), so a refusal -- synchronous from ``produce()`` (the producer's
``message.max.bytes``) or in its delivery report (the topic's ``max.message.bytes``) -- affects that record
only and the partition's FIFO of in-flight records stays exact. ``oversize_policy`` then decides: ``skip``
publishes an oversize control record in its place (same vbucket, seqno, snapshot; it takes the refused
record's FIFO entry, so positions, buffer-acks and checkpoints move as if the data record had been
delivered), ``fail`` stops that vbucket's stream only (:attr:`Publisher.failed_vbuckets`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from confluent_kafka import KafkaError, KafkaException, Message

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
from engine.cluster.local import Cluster
from engine.dcp.stream import MARKER_SIZE, StreamState
from engine.dcp.stream import Message as DcpStreamMessage
from engine.network.process_cluster import ProcessCluster
from gateway.config import StreamFrom
from gateway.exceptions import GatewayError
from gateway.kafka.clients import producer as kafka_producer
from gateway.resume import PublishPosition
from gateway.snapshot_merge import merge_snapshots
from gateway.source import BucketSource, DcpConnection, DcpSource, Topology, make_source
from schemas.codec import Headers, RecordEncoder
from schemas.failover_log import FailoverEntry, stream_rollback
from schemas.records import KafkaRecord
from schemas.topics import partition_for

log = logging.getLogger(__name__)

#: what a DCP step hands the publisher (its streams never have the TAKEOVER flag, so no set-vbucket-state)
DcpMessage = DcpStreamMessage


#: Kafka's answers to a record (batch) larger than a limit: the producer's message.max.bytes (from produce()), the
#: topic's / broker's max.message.bytes (MSG_SIZE_TOO_LARGE = MESSAGE_TOO_LARGE) or the batch
#: (RECORD_LIST_TOO_LARGE) in the delivery report
_TOO_LARGE: Final = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
#: records above this many bytes are produced alone on their partition unless the publisher is told the
#: topic's limit: Apache Kafka's default max.message.bytes (1048588) minus a margin
DEFAULT_LARGE_RECORD_BYTES: Final = 1_000_000
#: a stream request that found its node silent is tried again after this many seconds (docs/scale-out.md)
STREAM_RETRY_S: Final = 1.0
#: when the map moved vbuckets away from a live connection: steps (of DRAIN_MESSAGES) it may take to hand over the
#: stream ends it still holds before those vbuckets are detached (Publisher._drain_moved)
DRAIN_STEPS: Final = 64
DRAIN_MESSAGES: Final = 4096
#: rollback mitigation holding a vbucket's messages this long without releasing any is logged (a warning every
#: as many seconds while it lasts: persistence stopped, a replica down, a disk full -- never silent)
HELD_WARN_S: float = 30.0
#: what librdkafka adds to key + value + headers per record (record and batch framing), for size estimates
_RECORD_OVERHEAD: Final = 128

OversizePolicy = Literal["skip", "fail"]
#: the publisher's hot path's data record waiting for the next message: (partition, vbucket, key, value,
#: headers, DCP bytes, position after it or None, its item, its vbucket's sent position)
_Pending = tuple[int, int, bytes, bytes | None, Headers, int, PublishPosition | None, Item,
                 PublishPosition]


def record_size(rec: KafkaRecord) -> int:
    """Bytes of ``rec`` on the wire, about (key + value + header names and values + framing)."""
    n = _RECORD_OVERHEAD + len(rec.key or b"") + len(rec.value or b"")
    for name, value in rec.headers:
        n += len(name) + len(value or b"")
    return n


class PublishError(GatewayError):
    """Kafka refused a record permanently (the gateway stops; restart resumes from the partition tail)."""


class TopicLost(PublishError):
    """The topic lost records Kafka had acknowledged (docs/reliability.md "Fault campaign", topic truncated):
    a partition's delivery report carried an offset at or below one already acknowledged, or the partition
    or topic no longer exists. The service republishes every vbucket from seqno 0 after a rollback record
    to 0 (:class:`Publisher` with ``rollback_to_zero``)."""


class DeliveryTimedOut(PublishError):
    """Records waited in librdkafka past ``message.timeout.ms`` (a busy or paused broker) and were failed
    locally (``_MSG_TIMED_OUT``), or the broker refused the producer's epoch or sequence afterwards (librdkafka
    bumps the epoch of an idempotent producer whose in-flight records timed out). Records that were in flight
    may still have been written (possibly persisted), so the acknowledged positions are the only safe ones: a
    group member recovers
    in-process from the partitions' tails (gateway/member.py, docs/scale-out.md "Delivery within the lease");
    anywhere else the gateway stops as on any :class:`PublishError`."""


class ProducerFailed(PublishError):
    """librdkafka's idempotent producer hit a fatal error (e.g. the broker lost its producer state: out-of-order
    sequence). The service opens a new publisher from the positions Kafka acknowledged (docs/reliability.md
    "Fault campaign")."""


#: delivery errors after which a new producer resuming from the partitions' tails goes on, as a restart would
#: (:class:`DeliveryTimedOut`): records timed out in librdkafka (message.timeout.ms), and the broker's answers
#: to the requests of a producer whose epoch librdkafka bumped after in-flight records timed out
_RENEWABLE: Final = frozenset({KafkaError._MSG_TIMED_OUT, KafkaError.PRODUCER_FENCED,
                               KafkaError.INVALID_PRODUCER_EPOCH, KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
                               KafkaError.UNKNOWN_PRODUCER_ID})
#: delivery errors that say the partition (or the whole topic) the gateway was producing to is gone
_TOPIC_GONE: Final = frozenset({KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC,
                                KafkaError.UNKNOWN_TOPIC_OR_PART})


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
    #: a data record's item and (vbuuid, snap_start, snap_end), kept while Kafka may still refuse it as too
    #: large (an oversize record is then built from them)
    item: Item | None = None
    meta: tuple[int, int, int] | None = None
    #: record_size() of the record, when it was produced alone on its partition (0: not)
    large: int = 0
    #: time.monotonic() when the record was handed to the publisher (age of the oldest unacknowledged record)
    t: float = 0.0
    #: Kafka sends a delivery report for this record. False for a filtered item (no record) and for a data
    #: record produced without a report: it is acknowledged by the next reported record of its partition, whose
    #: offset proves every record between them was written (docs/gateway.md "Publishing path", "Acknowledge")
    reported: bool = True
    #: records this entry stands for: consecutive records of one vbucket on the partition produced without a
    #: report are one entry (``dcp_bytes`` summed; ``pos`` the last position among them, after its
    #: ``pos_at``-th record). Always 1 for a reported record and a filtered item.
    count: int = 1
    pos_at: int = 1


class DeliveryBudget:
    """How many records a publisher may leave in librdkafka (queued or in flight) so that each is delivered
    within about ``target_s`` (docs/scale-out.md "Delivery within the lease"): the delivery rate measured over
    the last ``interval_s`` times ``target_s``, between ``floor`` and ``ceiling`` records.

    Measured on the records Kafka acknowledged: while records waited in librdkafka all through an interval the
    broker was the bottleneck and the limit follows its rate, down as well as up; otherwise the rate says how
    fast records came, not how fast the broker can take them, and the limit only grows. Growth is bounded: at
    most twice the limit per interval, and after an interval in which librdkafka ran empty at most twice the
    most records it held in that interval (a queue that never filled says nothing of a fuller one: a burst
    after a quiet spell -- persisted items released at once -- starts from what the broker was seen to take).
    A delivery timeout drops the limit to ``floor`` (:meth:`timed_out`). ``clock`` is injectable (tests)."""

    def __init__(self, target_s: float, *, floor: int = 256, ceiling: int = 100_000, interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if target_s <= 0:
            raise GatewayError(f"the delivery target must be positive, got {target_s}")
        self.target_s = target_s
        self.floor = floor
        self.ceiling = max(floor, ceiling)
        self.interval_s = interval_s
        self.clock = clock
        #: records allowed in librdkafka now
        self.limit = min(self.ceiling, max(floor, 4 * floor))
        #: the last measured delivery rate, records/s (None: not measured yet)
        self.rate: float | None = None
        #: rounds that stepped nothing because the limit was reached
        self.waits = 0
        self._t0: float | None = None
        self._d0 = 0
        self._min_queued = 0
        self._max_queued = 0

    def room(self, delivered: int, queued: int) -> int:
        """Records that may be handed to librdkafka now, given the records acknowledged so far (``delivered``,
        a running total) and those librdkafka holds (``queued``)."""
        now = self.clock()
        if self._t0 is None:
            self._t0, self._d0, self._min_queued, self._max_queued = now, delivered, queued, queued
        else:
            self._min_queued = min(self._min_queued, queued)
            self._max_queued = max(self._max_queued, queued)
            dt = now - self._t0
            if dt >= self.interval_s:
                rate = (delivered - self._d0) / dt
                self.rate = rate
                want = min(self.ceiling, max(self.floor, int(rate * self.target_s)))
                grown = min(want, 2 * self.limit)  # at most twice per interval
                if self._min_queued > 0:
                    self.limit = grown  # always busy: the broker's pace, down at once, up at most 2x
                else:
                    # only up (a quiet interval says nothing of the broker), and no further than twice what
                    # librdkafka held in it
                    self.limit = max(self.limit, min(grown, 2 * self._max_queued))
                self._t0, self._d0, self._min_queued, self._max_queued = now, delivered, queued, queued
        room = self.limit - queued
        if room <= 0:
            self.waits += 1
        return room

    def timed_out(self) -> None:
        """Records timed out in librdkafka: start again from the floor."""
        self.limit = self.floor
        self._t0 = None


class _QueueFull(Exception):
    """librdkafka's queue has no room now (BufferError with records queued): keep the record for a later pump."""


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
        oversize_policy: OversizePolicy = "skip",
        large_record_bytes: int = DEFAULT_LARGE_RECORD_BYTES,
        rollback_to_zero: bool = False,
        vbuckets: Iterable[int] | None = None,
        delivery_budget: DeliveryBudget | None = None,
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
        if oversize_policy not in ("skip", "fail"):
            raise GatewayError(f"oversize_policy must be 'skip' or 'fail', got {oversize_policy!r}")
        self.oversize_policy: OversizePolicy = oversize_policy
        self.large_record_bytes = large_record_bytes
        self._producer_config = producer_config
        #: bumped by :meth:`renew_producer`: a replaced producer's delivery reports are ignored
        self._producer_gen = 0
        self.kafka = self._new_producer()
        #: when set, records left in librdkafka are bounded so that each is delivered within its target
        #: (a group member: well within the lease, docs/scale-out.md "Delivery within the lease")
        self.delivery_budget = delivery_budget
        #: records failed since the producer was (re)created with _MSG_TIMED_OUT (or an epoch error that follows
        #: in-flight timeouts, _RENEWABLE): pump() then raises DeliveryTimedOut
        self.timed_out = 0
        #: producers replaced in-process (:meth:`renew_producer`)
        self.producer_renewals = 0
        nvb = self.source.num_vbuckets
        #: the vbuckets this publisher streams (all unless ``vbuckets`` names a subset: one member of a group of
        #: gateway processes, docs/scale-out.md); :meth:`add_vbuckets` / :meth:`remove_vbuckets` change it
        self.assigned: set[int] = set(range(nvb)) if vbuckets is None else set(vbuckets)
        #: vbuckets other processes publish whose positions :meth:`observe_positions` reports
        self.observed: set[int] = set()
        #: vbuckets removed by :meth:`remove_vbuckets`: what their closed streams still deliver is dropped
        self._released: set[int] = set()
        #: the DCP connection each vbucket streams from now (None: not streaming)
        self._owner: list[DcpConnection | None] = [None] * nvb
        #: cluster mode: vbuckets to re-request on the next pump, and those waiting for the topology to change
        self._detached: set[int] = set()
        self._waiting: set[int] = set()
        self._topo: Topology | None = None
        #: a connection died during the last step: check every vbucket's connection on the next _follow
        self._recheck = False
        #: a stream request found its node silent (``TemporaryFailure``, not NOT_MY_VBUCKET): the waiting
        #: vbuckets are tried again at this ``time.monotonic()`` even if the topology never changes (a node busy
        #: past the client's timeout comes back with the same map)
        self._retry_at: float | None = None
        #: cluster-mode rollback mitigation: DCP messages not yet persisted everywhere, per vbucket, in order
        self._held: dict[int, deque[DcpMessage]] = {}
        #: the last persisted-everywhere seqno seen per vbucket (saves an observe per pump)
        self._safe: dict[int, int] = {}
        #: per vbucket whose held messages wait for persistence: since when nothing of it was released; when the
        #: next warning about them may be logged; warnings logged so far
        self._held_since: dict[int, float] = {}
        self._held_warn_at = 0.0
        self.held_warnings = 0
        #: the source's persistence epoch at the last full pass of :meth:`_release`, and whether a held queue got
        #: a new head (or a pass was cut short) since: without either, a pass would release nothing
        self._released_epoch: int | None = None
        self._release_due = True
        #: snapshot markers rollback mitigation merged away (gateway/snapshot_merge.py)
        self.snapshots_merged = 0
        # position after the last record produced (sent) and after the last record acknowledged
        self.sent: dict[int, PublishPosition] = {vb: positions.get(vb, PublishPosition(vb)) for vb in range(nvb)}
        self.acked: dict[int, PublishPosition] = {vb: p.copy() for vb, p in self.sent.items()}
        self._inflight: dict[int, deque[_Inflight]] = {}
        #: records in those FIFOs beyond one per entry (runs of unreported records share an entry: _Inflight.count)
        self._merged = 0
        #: records librdkafka's queue had no room for (BufferError), oldest first, with their partitions:
        #: DCP is not stepped while any wait (docs/reliability.md "Stalled broker and health")
        self._backlog: deque[tuple[int, _Inflight, KafkaRecord | None]] = deque()
        self._dirty_acked: set[int] = set()
        #: delivered DCP bytes not yet buffer-acknowledged, and the connection they go to (_add_buffer_ack)
        self._ack_to: DcpConnection | None = None
        self._ack_bytes = 0
        #: partitions waiting for a large record (delivered alone): what to produce after it, in order
        self._blocked: dict[int, deque[tuple[_Inflight, KafkaRecord | None]]] = {}
        #: large records Kafka refused in their delivery report (handled after the poll that served it)
        self._refusals: list[tuple[int, _Inflight, str]] = []
        self.streaming: set[int] = set()
        self.error: BaseException | None = None
        #: vbuckets stopped by oversize_policy=fail (or a too-large refusal that could not be replaced):
        #: vbucket -> reason; the other vbuckets keep publishing
        self.failed_vbuckets: dict[int, str] = {}
        # stats
        self.records_sent = 0
        self.records_acked = 0
        self.bytes_sent = 0
        self.rollbacks = 0
        self.errors = 0
        self.items_filtered = 0
        self.restreams = 0
        #: oversize control records published in place of records Kafka refused as too large
        self.oversize_records = 0
        #: :meth:`purge` ran: delivery reports are ignored
        self._closing = False
        #: every vbucket's stream starts with a rollback record to 0 (the topic lost its log: TopicLost)
        self.rollback_to_zero = rollback_to_zero
        #: vbuckets whose deliberate replay (:meth:`open_stream`) still owes its rollback record to 0
        self._replay_from_zero: set[int] = set()
        #: why the topic is known to have lost acknowledged records (None: it has not); pump() raises TopicLost
        self.lost: str | None = None
        #: partitions another producer writes to as well: every record produced there gets a delivery report
        self._shared_parts: set[int] = set()
        #: the producer's fatal error (None: none); pump() raises ProducerFailed
        self.fatal: str | None = None
        #: per partition, the highest offset Kafka acknowledged (a lower one later means the log was lost)
        self._last_offset: dict[int, int] = {}
        for vb, p in self.sent.items():
            part = partition_for(vb, num_partitions)
            self._last_offset[part] = max(self._last_offset.get(part, -1), p.offset)

    def _new_producer(self) -> Any:
        # The producer must not keep the publisher alive (a reference cycle would leave librdkafka's threads
        # running until a cyclic GC): its delivery callback holds a weak reference.
        ref = weakref.ref(self)
        gen = self._producer_gen

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            pub = ref()
            if pub is not None and pub._producer_gen == gen:
                pub._on_delivery(err, msg)

        # No default delivery callback: each produce() that wants a report passes this one (a record produced
        # without it costs librdkafka's report nothing on this thread).
        self._dr = on_delivery
        #: partitions this producer produced a reported record to: a record may go without a report only after
        #: one (its run's check needs the offset of the reported record before it)
        self._reported_parts: set[int] = set()
        return kafka_producer(self._producer_config)

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
        if self.rollback_mitigation and isinstance(self.source, BucketSource):
            self.source.bucket.start_flush_writer()  # its first background flush comes with the first step
        self._topo = self.source.topology()
        for vb in sorted(self.assigned):
            self.open_stream(vb)

    # ------------------------------------------------------------------ group membership (docs/scale-out.md)
    def add_vbuckets(self, positions: dict[int, PublishPosition]) -> None:
        """Start streaming the vbuckets of ``positions`` (recovered from the checkpoint topic and the partition
        tail, exactly as after a restart: gateway/resume.py) -- another member published them until now."""
        for vb, p in sorted(positions.items()):
            if vb in self.assigned:
                continue
            self._released.discard(vb)
            self.assigned.add(vb)
            self.failed_vbuckets.pop(vb, None)
            self.sent[vb] = p.copy()
            self.acked[vb] = p.copy()
            part = partition_for(vb, self.num_partitions)
            self._last_offset[part] = max(self._last_offset.get(part, -1), p.offset)
            self.open_stream(vb)

    def remove_vbuckets(self, vbuckets: Iterable[int]) -> None:
        """Stop streaming ``vbuckets`` (another member takes them over). Their records already handed to the
        producer stay in flight: the caller waits until :meth:`unacked` says none is left (and writes their
        checkpoints) before the new owner may start. DCP messages not yet published are dropped (their bytes
        buffer-acknowledged); the new owner streams them again from the published position."""
        for vb in sorted(vbuckets):
            if vb not in self.assigned:
                continue
            self.assigned.discard(vb)
            self._released.add(vb)
            self._replay_from_zero.discard(vb)
            self._waiting.discard(vb)
            self._detach(vb, restream=False)
            self._detached.discard(vb)

    def unacked(self, vbuckets: Iterable[int]) -> int:
        """Records of ``vbuckets`` produced (or waiting to be) and not yet acknowledged by Kafka."""
        vbs = set(vbuckets)
        n = sum(e.count for q in self._inflight.values() for e in q if e.vbucket in vbs)
        n += sum(1 for _p, e, _r in self._backlog if e.vbucket in vbs)
        n += sum(1 for q in self._blocked.values() for e, _r in q if e.vbucket in vbs)
        return n

    def open_stream(self, vb: int) -> None:
        pos = self.sent[vb]
        use_saved = self.stream_from.startswith("saved-offset") and not pos.is_fresh
        if self.rollback_to_zero or (self.stream_from == "beginning" and not pos.is_fresh):
            # A deliberate replay over a topic that already has this vbucket's records: consumers are told with
            # a rollback record to 0 (published by the stream request, which handles a node that does not
            # answer), so the re-sent history is not mistaken for duplicates.
            self._replay_from_zero.add(vb)
        from_now = (self.stream_from == "now") or (self.stream_from == "saved-offset-or-now" and not use_saved)
        if not self._request(vb, from_now) and self.is_cluster:
            self._waiting.add(vb)

    def _request(self, vb: int, from_now: bool) -> bool:
        """Stream request for ``vb`` from the publisher's own position (or from now); ROLLBACK answers become
        rollback records and the request is repeated (docs/gateway-cluster.md "Following the vbucket map": rollbacks can repeat).
        Returns False when the vbucket cannot be streamed now (NOT_MY_VBUCKET, node down)."""
        if vb in self.failed_vbuckets:
            return False  # stopped by oversize_policy=fail until the gateway restarts
        pos = self.sent[vb]
        src = self.source
        if vb in self._replay_from_zero:
            try:
                engine_log = src.failover_log(vb)
            except (NotMyVBucket, TemporaryFailure) as e:
                return self._not_streamable(vb, None, e)  # asked again, the rollback record first
            self._publish_rollback(vb, 0, engine_log)
            self._replay_from_zero.discard(vb)
        for _attempt in range(64):
            dcp = None
            try:
                dcp = src.producer_for(vb)
                if from_now:
                    log_ = dcp.stream_request(vb, 0, MAX_SEQNO, flags=StreamFlags.FROM_LATEST)
                else:
                    log_ = dcp.stream_request(end_seqno=MAX_SEQNO, **pos.request_args())
                # read before anything is produced: a node that does not answer now leaves no record behind
                high = src.high_seqno(vb)
            except RollbackRequired as rb:
                try:
                    engine_log = src.failover_log(vb)
                except (NotMyVBucket, TemporaryFailure) as e:
                    return self._not_streamable(vb, None, e)
                self._publish_rollback(vb, rb.seqno, engine_log)
                continue
            except (NotMyVBucket, TemporaryFailure) as e:
                return self._not_streamable(vb, dcp, e)
            except RangeError as e:
                if not self.is_cluster:
                    raise
                log.error("vbucket %d: stream request refused (%s); retried when the map changes", vb, e)
                return False
            self._publish_failover_log(vb, log_, high)
            if from_now:
                # Deliberately skip the history: the position jumps to the high seqno.
                pos.seqno = pos.snap_start = pos.snap_end = pos.boundary = high
            self._owner[vb] = dcp
            self.streaming.add(vb)
            return True
        raise GatewayError(f"vbucket {vb}: stream request kept rolling back")

    def _not_streamable(self, vb: int, dcp: DcpConnection | None, e: Exception) -> bool:
        """A stream request answered NOT_MY_VBUCKET, or the node went silent (``TemporaryFailure``) during it."""
        if dcp is not None and vb in dcp.streams:
            # the stream opened but the node went silent after: closed, re-requested like the others
            with contextlib.suppress(NotMyVBucket, TemporaryFailure):
                dcp.close_stream(vb)
            dcp.discard_stream(vb)
        # kv_engine client rule: NOT_MY_VBUCKET -> reload the map; retried when the topology changes (a node
        # that went silent: after a pause as well)
        if not isinstance(e, NotMyVBucket) and self._retry_at is None:
            self._retry_at = time.monotonic() + STREAM_RETRY_S
        if self.is_cluster:
            log.info("vbucket %d is not streamable now (%s); waiting for the map to change", vb, e)
        else:
            log.warning("vbucket %d is not streamable now; skipped", vb)
        return False

    # ------------------------------------------------------------------ following the cluster
    def _detach(self, vb: int, restream: bool = True) -> None:
        """Stop streaming ``vb`` from its current connection; it is re-requested on the next pump (unless
        ``restream`` is False: the vbucket was removed)."""
        p = self._owner[vb]
        self._owner[vb] = None
        self.streaming.discard(vb)
        self._safe.pop(vb, None)
        held = self._unhold(vb)
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
        if restream:
            self._detached.add(vb)

    def _follow(self) -> None:
        """Cluster mode: when the map or the live nodes changed, detach every vbucket whose connection died or
        whose active moved, and give the waiting ones another try; then re-request every detached vbucket
        from the new active with the published position (vbuuid, seqno, snapshot range) -- the DCP client rule
        "on NOT_MY_VBUCKET or a stream end, reload the map and re-request with your own position"."""
        src = self.source
        topo = src.topology()
        retry = self._retry_at is not None and time.monotonic() >= self._retry_at
        if topo != self._topo or self._recheck or retry:
            self._topo = topo
            self._recheck = False
            self._retry_at = None
            self._detached |= self._waiting
            self._waiting.clear()
            self._drain_moved()
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

    def _drain_moved(self) -> None:
        """Before the vbuckets whose active moved are detached: step each live connection still streaming one of
        them until it has nothing more (at most :data:`DRAIN_STEPS` steps), so that the stream ends the old
        active sent (STATE_CHANGED: a graceful failover, a takeover) are published as stream-end records -- a
        pump round steps a connection only ``max_messages`` at a time, and detaching closes a stream with what
        it still had queued (docs/gateway-cluster.md "What Kafka sees")."""
        src = self.source
        live: list[DcpConnection] = []
        for vb, p in enumerate(self._owner):
            if p is not None and not p.closed and p not in live and src.node_of(p) != src.active_node(vb):
                live.append(p)
        for p in live:
            for _ in range(DRAIN_STEPS):
                if not self._step_connection(p, DRAIN_MESSAGES):
                    break

    def _publish_rollback(self, vb: int, seqno: int, engine_log: list[FailoverEntry]) -> None:
        pos = self.sent[vb]
        restart = pos.on_rollback(seqno)
        rec = self.encoder.rollback(vb, seqno, engine_log, snap_start=restart, snap_end=restart)
        self._produce(vb, rec, 0, pos.copy())
        self.rollbacks += 1
        self._event("rollback", vb, seqno)
        log.info("vbucket %d: engine answered ROLLBACK(%d); restarting from %d", vb, seqno, restart)

    def _publish_failover_log(self, vb: int, entries: list[FailoverEntry], high: int) -> None:
        pos = self.sent[vb]
        pos.on_failover_log(entries)
        rec = self.encoder.failover_log(vb, entries, high, pos.snap_start, pos.snap_end)
        self._produce(vb, rec, 0, pos.copy())

    # ------------------------------------------------------------------ pumping
    def pump(self, max_messages: int = 8192, *, wait_for_flush: bool = True) -> int:
        """One round: serve delivery reports, then DCP step -> Kafka produce. Returns DCP messages handled.

        With rollback mitigation on a single bucket, a round that moved nothing while what it holds waits for
        the background flush in flight waits for that flush (so that 0 still means "everything written is
        published"); ``wait_for_flush=False`` returns 0 at once instead -- the service's loop, which must not
        block, looks again shortly (:attr:`waiting_for_flush`).

        Delivery reports are served *before* the step: their DCP buffer-acks free the flow-control budget the
        step then uses. So a round that returns 0 with nothing in flight really had nothing to stream (serving
        them after the step could empty ``inflight`` right after a step the full buffer held back, and a
        caller waiting for "0 moved, nothing in flight" would stop with items still to send).
        """
        self._raise_lost()
        if self.error is not None:
            self._raise_error()
        self.kafka.poll(0)
        self._send_buffer_acks()  # also those of delivery reports a caller's own poll served
        self._raise_lost()  # a delivery report just served says the topic lost its log
        if self._refusals or self._blocked:
            self._after_poll()
        if self.error is not None:  # a delivery report just served said a record was lost
            self._raise_error()
        budget = self.delivery_budget
        if budget is not None:
            # docs/scale-out.md "Delivery within the lease": hand librdkafka no more than the broker delivers
            # within the target; the rest waits in the engine (DCP flow control), not in librdkafka's queue
            room = budget.room(self.records_acked, len(self.kafka))
            if room <= 0:
                return 0
            max_messages = min(max_messages, room)
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
        if self.rollback_mitigation and isinstance(src, BucketSource):
            # The bucket persists in the background (docs/gateway.md "Publishing path"): a step may return
            # items the flush in flight has not landed yet, held here as in cluster mode until persisted.
            src.before_step()
            n = self._step_held(dcp, max_messages)
            while wait_for_flush and n == 0 and self.waiting_for_flush:
                # What is held waits for the flush in flight: wait for it (the writer thread works meanwhile)
                # rather than answer 0, which tells the caller everything written is published. Nothing held
                # (a publisher without streams, as `dcpgw up --gateways K`'s own): nothing to wait for.
                src.before_step(wait=True)
                n = self._step_held(dcp, max_messages)
            return n
        msgs = dcp.step(max_messages)
        if msgs:
            self._publish(msgs)
        return len(msgs)

    def _step_connection(self, p: DcpConnection, max_messages: int) -> int:
        """One DCP step of cluster connection ``p``: its messages published (or held, rollback mitigation), those
        of streams the gateway already moved away from buffer-acked; returns the messages moved."""
        try:
            msgs = p.step(max_messages)
        except TemporaryFailure:
            # A node process's connection dropped (SIGKILL: NodeUnavailable). The DCP client rule treats it like
            # NOT_MY_VBUCKET: force the topology check, which detaches the connection's vbuckets and re-requests
            # them from the map's active with the published position.
            self._recheck = True
            return 0
        if not msgs:
            return 0
        owner = self._owner
        mine: list[DcpMessage] = []
        stale = 0
        for m in msgs:
            if owner[m.vbucket] is p:
                mine.append(m)
            else:
                stale += m.dcp_size  # the tail of a stream the gateway already moved away from
        if stale:
            self._buffer_ack(p, stale)
        if self.rollback_mitigation:
            self._hold(p, mine)
        else:
            self._publish(mine)
        return len(msgs)

    def _raise_error(self) -> None:
        err = self.error
        cls = DeliveryTimedOut if self.timed_out else PublishError
        raise cls(f"publishing stopped: {err}") from err

    def _raise_lost(self) -> None:
        if self.lost is not None:
            raise TopicLost(self.lost)
        if self.fatal is not None:
            raise ProducerFailed(self.fatal)

    def _pump_cluster(self, max_messages: int) -> int:
        assert self._topo is not None, "open() first"
        n = 0
        held = self._held if self.rollback_mitigation else None
        for p in self.source.producers():
            n += self._step_connection(p, max_messages)
        if held:
            n += self._release(max_messages * max(1, len(self.source.producers())))
        # after the step: streams that ended (STATE_CHANGED) were published as stream-end records first
        self._follow()
        return n

    def _step_held(self, dcp: DcpConnection, max_messages: int) -> int:
        """One DCP step of a bucket that persists in the background: hold what it returns, publish what is
        persisted; returns the messages moved."""
        msgs = dcp.step(max_messages)
        if msgs:
            self._hold(dcp, msgs)
        return len(msgs) + (self._release(max_messages) if self._held else 0)

    def _hold(self, p: DcpConnection, msgs: list[DcpMessage]) -> None:
        """Queue ``msgs`` of connection ``p`` per vbucket until persisted (:meth:`_release`); a stream end is
        published at once and drops what its vbucket held."""
        held = self._held
        for m in msgs:
            vb = m.vbucket
            if type(m) is StreamEnd:
                q = self._unhold(vb)
                if q:
                    # Not persisted everywhere, never published: dropped; the re-request streams what
                    # survived again.
                    self._buffer_ack(p, sum(x.dcp_size for x in q))
                self._publish([m])
            else:
                q = held.get(vb)
                if q is None:
                    q = held[vb] = deque()
                    self._release_due = True  # a new head: it may be persisted already
                q.append(m)

    def _release(self, limit: int) -> int:
        """Publish held messages that are persisted on the active and every replica (Couchbase Kafka connector
        rollback mitigation). A snapshot is released only once its whole range is persisted everywhere: then
        a promoted replica's branch point is at or above the published snapshot's end, and kv_engine's
        needsRollback (rule 7: snap_end <= upper) answers "no rollback" to the re-request. Order is kept; the
        marker is published before its items.

        At most ``limit`` messages per call (a landed flush releases up to 16,384 at once: ~0.25 s of the
        caller's thread, the service's event loop); a vbucket cut short goes to the back of the queue, so the
        next call starts with the others."""
        released = 0
        safe_seen = self._safe
        since = self._held_since
        now = time.monotonic()
        held = self._held
        epoch = self.source.persistence_epoch
        if epoch is not None and epoch == self._released_epoch and not self._release_due:
            # Nothing persisted since the last pass and no queue got a new head: each is still stopped at a
            # snapshot its vbucket has not persisted (a pass per pump round cost 15 % of the thread at 1024
            # vbuckets and a steady trickle of writes).
            if since and now >= self._held_warn_at:
                self._warn_held(now)
            return 0
        self._released_epoch = epoch
        self._release_due = False
        batch: list[DcpMessage] = []
        for vb in list(held):
            room = limit - released
            if room <= 0:
                self._release_due = True  # the rest is looked at in the next pass
                break
            q = held[vb]
            out: list[DcpMessage] = []
            safe = safe_seen.get(vb, 0)
            markers = 0
            while q and len(out) < room:
                m = q[0]
                if type(m) is SnapshotMarker:
                    if m.end > safe:
                        safe = self.source.persisted_everywhere(vb, self.sent[vb].vbuuid)
                        safe_seen[vb] = safe
                        if m.end > safe:
                            break
                    markers += 1
                out.append(q.popleft())
            if not q:
                del held[vb]
            elif len(out) == room:
                held[vb] = held.pop(vb)  # cut short by the limit: to the back
                self._release_due = True
            if out:
                since.pop(vb, None)
                released += len(out)
                if markers > 1:
                    # docs/gateway.md "Publishing path": the small memory snapshots of many steps, as one
                    out, merged_bytes = merge_snapshots(out)
                    if merged_bytes:
                        self._buffer_ack_vb(vb, merged_bytes)
                        self.snapshots_merged += merged_bytes // MARKER_SIZE
                batch.extend(out)
            elif q:
                since.setdefault(vb, now)
        if batch:
            self._publish(batch)  # one call for every vbucket released (its hot path spans vbuckets)
        if since and now >= self._held_warn_at:
            self._warn_held(now)
        return released

    def _unhold(self, vb: int) -> deque[DcpMessage] | None:
        """Drop what rollback mitigation holds of ``vb`` (its stream is gone); returns it, to be buffer-acked."""
        self._held_since.pop(vb, None)
        return self._held.pop(vb, None)

    def _warn_held(self, now: float) -> None:
        """Say which vbuckets rollback mitigation has held back for ``HELD_WARN_S`` or more, and why."""
        since = self._held_since
        stalled = sorted(vb for vb, t in since.items() if now - t >= HELD_WARN_S)
        if not stalled:
            self._held_warn_at = min(since.values()) + HELD_WARN_S  # the earliest any can be due
            return
        self._held_warn_at = now + HELD_WARN_S
        self.held_warnings += 1
        vb = stalled[0]
        head = self._held[vb][0]  # a queue is only ever stopped at a marker
        end = head.end if isinstance(head, SnapshotMarker) else -1
        log.warning(
            "rollback mitigation: %d vbuckets (%s) have published nothing for %.0f s or more: their next snapshot "
            "is not persisted on the active and every replica yet (vbucket %d: snapshot end %d, persisted "
            "everywhere %d; %d messages held in all) -- is persistence stopped, a replica down or a disk full?",
            len(stalled), ", ".join(map(str, stalled[:8])) + (", ..." if len(stalled) > 8 else ""),
            now - since[vb], vb, end, self._safe.get(vb, 0), self.held)

    @property
    def waiting_for_flush(self) -> bool:
        """Single bucket, rollback mitigation: messages are held for the background flush in flight."""
        src = self.source
        return bool(self._held) and isinstance(src, BucketSource) and src.flush_in_flight

    @property
    def held(self) -> int:
        """DCP messages held back by cluster-mode rollback mitigation."""
        return sum(len(q) for q in self._held.values())

    def _publish(self, msgs: list[DcpMessage]) -> None:
        enc = self.encoder
        sent = self.sent
        kf = self.key_filter
        filtering = kf.active
        failed = self.failed_vbuckets
        if self._released:
            failed = {**failed, **dict.fromkeys(self._released, "removed")}
        # The hot path (docs/gateway.md "Publishing path"): a data record that is not large, with nothing
        # waiting for room and its partition not held by a large record, goes straight to produce() and its
        # FIFO -- what _produce -> _send -> _try_produce would do, without their calls and per-record
        # item/snapshot references. Anything else (the queue full, a refusal, a large record) takes that path.
        produce = self.kafka.produce
        dr = self._dr
        reported_parts = self._reported_parts
        shared_parts = self._shared_parts
        topic = self.topic
        nparts = self.num_partitions
        inflight = self._inflight
        owner = self._owner
        backlog = self._backlog
        blocked = self._blocked
        large_bytes = self.large_record_bytes
        data_fields = enc.data_fields
        now = time.monotonic()  # one hand-over time per batch (oldest_unacked_age)
        # records_sent / bytes_sent of the hot path, counted here and added once (finally: also when an error
        # leaves the loop); the FIFO of the last partition produced to (a FIFO is never removed from _inflight)
        sent_n = sent_bytes = merged = 0
        last_part = -1
        last_q: deque[_Inflight] = deque()
        # The hot path's last data record, produced when the next message says whether it needs a delivery
        # report of its own: not when the next is a hot record of the same partition (whose report, or that of
        # a later one, acknowledges it); every other message, and the end of the batch, produce it with one.
        pend: _Pending | None = None
        try:
            for m in msgs:
                if failed and m.vbucket in failed:
                    # the vbucket's stream was stopped (oversize_policy=fail): the tail it had already sent
                    self._buffer_ack_vb(m.vbucket, m.dcp_size)
                    continue
                if type(m) is Item:
                    vb = m.vbucket
                    pos = sent[vb]
                    size = m.dcp_size
                    if filtering and not kf(m.key):
                        if pend is not None:
                            self._produce_pending(pend, now)
                            pend = None
                        self.items_filtered += 1
                        pos.seqno = m.seqno
                        done = m.seqno >= pos.snap_end
                        if done:
                            pos.complete_if_done()
                        self._produce(vb, None, size, pos.copy() if done else None)
                        continue
                    key, value, headers = data_fields(m, pos.vbuuid, pos.snap_start, pos.snap_end)
                    seqno = m.seqno
                    if seqno >= pos.snap_end:
                        pos.on_data(seqno)
                        after = pos.copy()
                    else:
                        pos.seqno = seqno  # on_data inside a snapshot: only the seqno moves (gateway/resume.py)
                        after = None
                    part = vb % nparts
                    hot = not backlog and not (blocked and part in blocked) and (
                        value is None or len(value) <= large_bytes)
                    if pend is not None:
                        ppart, pvb, pkey, pvalue, pheaders = pend[0], pend[1], pend[2], pend[3], pend[4]
                        quiet = hot and ppart == part and part in reported_parts and part not in shared_parts
                        try:
                            # positional (topic, value, key, partition, on_delivery, callback, timestamp (0:
                            # now), headers): keyword arguments cost produce() a str and a dict lookup per name
                            produce(topic, pvalue, pkey, ppart, None if quiet else dr, None, 0, pheaders)
                        except (BufferError, KafkaException):
                            # the general path produces it again and handles the refusal / full queue
                            self._produce_general(pend)
                            hot = hot and not backlog
                        else:
                            if not quiet:
                                reported_parts.add(ppart)
                            sent_n += 1
                            sent_bytes += len(pvalue or b"") + len(pkey)
                            if ppart != last_part:
                                # the items of one snapshot come one after the other: one FIFO lookup per run
                                last_part = ppart
                                q = inflight.get(ppart)
                                if q is None:
                                    q = inflight[ppart] = deque()
                                last_q = q
                            tail = last_q[-1] if quiet and last_q else None
                            if tail is not None and not tail.reported and tail.vbucket == pvb \
                                    and not tail.filtered and tail.producer is owner[pvb]:
                                # the run goes on: one entry for it (no object and no acknowledgement per record)
                                n = tail.count = tail.count + 1
                                tail.dcp_bytes += pend[5]
                                if pend[6] is not None:
                                    tail.pos = pend[6]
                                    tail.pos_at = n
                                merged += 1
                            else:
                                last_q.append(_Inflight(pvb, pend[5], pend[6], False, owner[pvb], None, None, 0, now,
                                                        not quiet))
                        pend = None
                    if hot:
                        pend = (part, vb, key, value, headers, size, after, m, pos)
                        continue
                    self._produce(vb, KafkaRecord(key, value, headers), size, after, m,
                                  (pos.vbuuid, pos.snap_start, pos.snap_end))
                elif type(m) is SnapshotMarker:
                    if pend is not None:
                        self._produce_pending(pend, now)
                        pend = None
                    vb = m.vbucket
                    pos = sent[vb]
                    pos.on_snapshot(m.start, m.end)
                    rec = enc.snapshot(m, pos.vbuuid)
                    self._produce(vb, rec, m.dcp_size, None)
                else:
                    assert isinstance(m, StreamEnd)
                    if pend is not None:
                        self._produce_pending(pend, now)
                        pend = None
                    vb = m.vbucket
                    pos = sent[vb]
                    self.streaming.discard(vb)
                    rec = enc.stream_end(m, pos.vbuuid, pos.seqno, pos.snap_start, pos.snap_end)
                    self._produce(vb, rec, m.dcp_size, None)
                    self._event("stream_end", vb, int(m.reason))
                    if self.is_cluster:
                        # STATE_CHANGED (failover), ROLLBACK, DISCONNECTED...: reload the map and re-request.
                        self._detach(vb)
            if pend is not None:
                self._produce_pending(pend, now)
        finally:
            self.records_sent += sent_n
            self.bytes_sent += sent_bytes
            self._merged += merged

    def _produce_pending(self, pend: _Pending, now: float) -> None:
        """Produce the hot path's pending data record with a delivery report (the general path: also when the
        queue is full or Kafka refuses it)."""
        part, vb, key, value, headers, size, after, _item, _pos = pend
        try:
            self.kafka.produce(self.topic, value, key, part, self._dr, None, 0, headers)  # as in _publish
        except (BufferError, KafkaException):
            self._produce_general(pend)
            return
        self._reported_parts.add(part)
        self.records_sent += 1
        self.bytes_sent += len(value or b"") + len(key)
        q = self._inflight.get(part)
        if q is None:
            q = self._inflight[part] = deque()
        q.append(_Inflight(vb, size, after, False, self._owner[vb], None, None, 0, now))

    def _produce_general(self, pend: _Pending) -> None:
        """The hot path's pending data record through the general path (queue full, refused by produce())."""
        _part, vb, key, value, headers, size, after, item, pos = pend
        self._produce(vb, KafkaRecord(key, value, headers), size, after, item,
                      (pos.vbuuid, pos.snap_start, pos.snap_end))

    def _produce(
        self, vb: int, rec: KafkaRecord | None, dcp_bytes: int, pos: PublishPosition | None,
        item: Item | None = None, meta: tuple[int, int, int] | None = None,
    ) -> None:
        part = partition_for(vb, self.num_partitions)
        entry = _Inflight(vb, dcp_bytes, pos, rec is None, self._owner[vb], item, meta, t=time.monotonic(),
                          reported=rec is not None)
        if self._backlog or not self._send(part, entry, rec):
            # keep the order: once one record waits for room, every later one waits behind it
            self._backlog.append((part, entry, rec))

    def _drain(self) -> int:
        """Produce waiting records in order until librdkafka's queue is full again. Returns how many went."""
        n = 0
        backlog = self._backlog
        while backlog:
            if not self._send(*backlog[0]):
                break
            backlog.popleft()
            n += 1
        return n

    def _send(self, part: int, entry: _Inflight, rec: KafkaRecord | None) -> bool:
        """Produce one record, or queue it behind a large record of its partition; never waits. False when
        librdkafka's queue is full: nothing was changed, the caller keeps the record for a later pump."""
        blocked = self._blocked.get(part)
        if blocked is not None:
            blocked.append((entry, rec))  # the partition waits for a large record's delivery report
            return True
        q = self._inflight.get(part)
        if q is None:
            q = self._inflight[part] = deque()
        if rec is None:
            # Filtered item: acknowledged once everything before it on this partition is delivered.
            if q:
                q.append(entry)
            else:
                self._ack(entry, self.acked[entry.vbucket].offset)
            return True
        value = rec.value
        large = len(value) > self.large_record_bytes if value is not None else False
        if large:
            size = record_size(rec)
            if q:
                # Produced alone: it waits until everything before it on the partition is delivered, so a
                # refusal of its batch refuses it only.
                self._blocked[part] = deque([(entry, rec)])
                return True
        try:
            refused = self._try_produce(part, rec)
        except _QueueFull:
            return False
        if refused is not None:
            # too large for the producer: nothing was queued, so what replaces it keeps the order
            self._refused(part, entry, record_size(rec), refused)
            return True
        if large:
            entry.large = size
            self._blocked[part] = deque()  # nothing else of the partition until its delivery report
        else:
            entry.item = entry.meta = None
        # appended after produce(): delivery reports are only served by poll(), so none can come in between
        q.append(entry)
        return True

    def _try_produce(self, part: int, rec: KafkaRecord) -> str | None:
        """Produce ``rec``; returns why the producer refused it as too large (None: queued). Raises
        :class:`_QueueFull` when librdkafka's queue has no room now (never waits for it)."""
        try:
            self.kafka.produce(self.topic, rec.value, rec.key, part, self._dr, None, 0, rec.headers)  # as in _publish
        except BufferError:
            if len(self.kafka) == 0:
                # nothing queued to wait for: the record alone is larger than the producer's queue
                return "larger than the producer queue (queue.buffering.max.kbytes)"
            raise _QueueFull from None
        except KafkaException as e:
            err = e.args[0]
            if isinstance(err, KafkaError) and err.code() in _TOO_LARGE:
                return f"{err.name()}: {err.str()}"
            if isinstance(err, KafkaError) and (err.fatal() or err.code() == KafkaError._FATAL):
                self.fatal = f"{err.name()}: {err.str()}"
                raise ProducerFailed(self.fatal) from e
            raise
        self._reported_parts.add(part)
        self.records_sent += 1
        self.bytes_sent += len(rec.value or b"") + len(rec.key or b"")
        return None

    def _refused(self, part: int, entry: _Inflight, size: int, reason: str) -> None:
        """Kafka refused ``entry``'s record as too large, and nothing after it on the partition was produced:
        publish the oversize record in its place (``skip``) or stop the vbucket (``fail``)."""
        vb = entry.vbucket
        item, meta = entry.item, entry.meta
        entry.item = entry.meta = None
        entry.large = 0
        if item is None or meta is None:
            self._fail_vbucket(vb, entry, f"a control record of {size} bytes was refused: {reason}")
            return
        what = f"key {item.key!r}, vbucket {vb}, seqno {item.seqno}, {size} bytes"
        if self.oversize_policy == "fail":
            self._fail_vbucket(vb, entry, f"Kafka refused the record of {what}: {reason}")
            return
        rec = self.encoder.oversize(item, meta[0], meta[1], meta[2], size, reason)
        try:
            again = self._try_produce(part, rec)
        except _QueueFull:
            # no room now: the oversize record goes first once the partition is released (_after_poll)
            waiting = self._blocked.get(part)
            if waiting is None:
                waiting = self._blocked[part] = deque()
            waiting.appendleft((entry, rec))
            again = None
        else:
            if again is None:
                q = self._inflight.get(part)
                if q is None:
                    q = self._inflight[part] = deque()
                q.append(entry)
        if again is not None:
            self._fail_vbucket(vb, entry, f"Kafka refused the record of {what} and its oversize record: {again}")
            return
        self.oversize_records += 1
        self._event("oversize", vb, item.seqno)
        log.warning("published an oversize record in place of the record of %s (oversize_policy=skip): %s",
                    what, reason)

    def _fail_vbucket(self, vb: int, entry: _Inflight, reason: str) -> None:
        """Stop ``vb``'s stream (the others keep publishing); its acknowledged position stays before the
        refused record, so a restart streams it again from there."""
        if vb not in self.failed_vbuckets:
            self.failed_vbuckets[vb] = reason
            log.error("vbucket %d stopped: %s", vb, reason)
        self._discard(entry)
        self.streaming.discard(vb)
        p = self._owner[vb]
        if p is not None and not p.closed and vb in p.streams:
            with contextlib.suppress(NotMyVBucket, TemporaryFailure):
                p.close_stream(vb)
            p.discard_stream(vb)
        held = self._unhold(vb)
        if held:
            self._buffer_ack_vb(vb, sum(m.dcp_size for m in held))
        for waiting in self._blocked.values():
            self._drop_vbucket(waiting, vb, 0)  # (entry, record)
        self._drop_vbucket(self._backlog, vb, 1)  # (partition, entry, record)
        self._uncover()

    def _uncover(self) -> None:
        """Records produced without a delivery report whose reported successor on their partition will never be
        produced (dropped with a stopped vbucket): no report will tell whether they were written, so they leave
        the partition's FIFO unacknowledged (their positions do not move; a restart finds them in the tail) and
        the partition's next record is produced with a report."""
        waiting = {part for part, _e, _r in self._backlog}
        waiting.update(part for part, w in self._blocked.items() if w)
        for part, q in self._inflight.items():
            if not q or q[-1].reported or part in waiting:
                continue
            tail = []
            for e in reversed(q):
                if e.reported:
                    break
                tail.append(e)
            uncovered = sum(e.count for e in tail if not e.filtered)
            if uncovered:  # (filtered items alone after a reported record are acknowledged with it)
                for e in tail:
                    q.pop()
                    self._merged -= e.count - 1
                    self._discard(e)
                self._reported_parts.discard(part)
                log.warning("partition %d: %d record(s) produced without a delivery report are left "
                            "unacknowledged (the record after them was dropped)", part, uncovered)

    def _drop_vbucket(self, waiting: deque[Any], vb: int, at: int) -> None:
        """Remove ``vb``'s records from a waiting queue whose tuples hold their entry at index ``at`` (their DCP
        bytes buffer-acknowledged)."""
        mine = [w for w in waiting if w[at].vbucket == vb]
        if not mine:
            return
        kept = [w for w in waiting if w[at].vbucket != vb]
        waiting.clear()
        waiting.extend(kept)
        for w in mine:
            self._discard(w[at])

    def _discard(self, entry: _Inflight) -> None:
        """A record that will never be produced: its DCP bytes are buffer-acknowledged (flow control)."""
        if entry.dcp_bytes and entry.producer is not None:
            self._buffer_ack(entry.producer, entry.dcp_bytes)

    def _buffer_ack_vb(self, vb: int, nbytes: int) -> None:
        p = self._owner[vb]
        if p is None and not self.is_cluster:
            p = self.dcp  # a removed vbucket's late messages came over the one connection
        if p is not None and nbytes:
            self._buffer_ack(p, nbytes)

    def _after_poll(self) -> None:
        """Handle large records Kafka refused in their delivery report, then produce what waited behind
        large records that are now delivered."""
        while self._refusals:
            part, entry, reason = self._refusals.pop(0)
            self._refused(part, entry, entry.large, reason)
        for part in list(self._blocked):
            if self._inflight.get(part):
                continue
            waiting = self._blocked.pop(part)
            while waiting:
                entry, rec = waiting[0]
                if entry.vbucket in self.failed_vbuckets:
                    waiting.popleft()
                    self._discard(entry)
                    continue
                again = self._blocked.get(part)
                if again is not None:  # blocked again by a large record: the rest waits behind it
                    again.extend(waiting)
                    break
                if not self._send(part, entry, rec):
                    # librdkafka's queue is full: the rest goes ahead of the backlog (the backlog's records
                    # of this partition came after them)
                    self._backlog.extendleft((part, e, r) for e, r in reversed(waiting))
                    break
                waiting.popleft()

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if self._closing or self.lost is not None or self.fatal is not None:
            return  # purged at shutdown / the topic lost its log: nothing is acknowledged any more
        part = msg.partition()
        q = self._inflight.get(part) if part is not None else None
        if not q:
            log.error("delivery report for partition %s with nothing in flight", part)
            return
        entry = q.popleft()
        if not entry.reported:
            self._on_run_delivery(part, q, entry, err, msg)  # type: ignore[arg-type]  # part: checked by q
            return
        if err is None:
            # the common case, kept short: one delivered record (the general _ack below does the same)
            offset = msg.offset()
            last = self._last_offset
            if offset is not None and part is not None and offset > last.get(part, -1):
                last[part] = offset
                self.records_acked += 1
                p = entry.producer
                if p is self._ack_to and p is not None:
                    self._ack_bytes += entry.dcp_bytes
                elif entry.dcp_bytes and p is not None:
                    self._add_buffer_ack(p, entry.dcp_bytes)
                pos = entry.pos
                if pos is not None and not entry.filtered:
                    vb = entry.vbucket
                    pos.offset = offset
                    self.acked[vb] = pos
                    self._dirty_acked.add(vb)
                while q and q[0].filtered:
                    self._ack(q.popleft(), offset)
                return
        if err is not None:
            self._delivery_failed(part, entry, err)
            return
        offset = msg.offset()
        assert offset is not None and part is not None  # delivered records have offsets
        if self._log_lost(part, offset):
            return
        self._last_offset[part] = offset
        self.records_acked += 1
        self._ack(entry, offset)
        # filtered items queued behind this record are acknowledged with it
        while q and q[0].filtered:
            self._ack(q.popleft(), offset)

    def _on_run_delivery(self, part: int, q: deque[_Inflight], first: _Inflight, err: KafkaError | None,
                         msg: Message) -> None:
        """The delivery report of a record produced after records without one (``first`` and what follows it
        up to that record, all of partition ``part``): they were written if the report's offset is exactly as
        many records after the partition's previous report (delivery reports of a partition come in produce
        order, and the records between two of them were produced by this producer, one after the other); a
        failed report fails them all, as if each had its own."""
        run = [first]
        self._merged -= first.count - 1
        while not run[-1].reported:
            if not q:
                log.error("delivery report for partition %s: the records before it are not in flight", part)
                return
            e = q.popleft()
            self._merged -= e.count - 1
            run.append(e)
        if err is not None:
            for e in run:
                if e.filtered:
                    self._discard(e)
                else:
                    self._delivery_failed(part, e, err)
            return
        offset = msg.offset()
        assert offset is not None  # delivered records have offsets
        if self._log_lost(part, offset):
            return
        prev = self._last_offset.get(part, -1)
        records = sum(e.count for e in run if not e.filtered)
        if offset - prev < records:
            # fewer offsets than records: one produced without a report was not written (librdkafka failed it
            # on its own, e.g. message.timeout.ms while queued, and wrote the next). The positions after the
            # missing record cannot be acknowledged: the publisher stops as after a delivery timeout and resumes
            # from the partitions' tails (DeliveryTimedOut)
            self.errors += 1
            self.timed_out += 1
            for e in run:
                self._discard(e)
            if self.error is None:
                self.error = KafkaException(KafkaError(
                    KafkaError._MSG_TIMED_OUT,
                    f"partition {part}: Kafka acknowledged offset {offset}, {offset - prev} after the previous "
                    f"report, for {records} records produced in between: {records - (offset - prev)} not written"))
            log.error("%s", self.error)
            return
        if offset - prev > records and part not in self._shared_parts:
            # more: another producer wrote to the partition in between (a partition several group members
            # share when the topic has fewer partitions than vbuckets). The count proves nothing there any more:
            # every later record of the partition is produced with a report of its own
            self._shared_parts.add(part)
            log.warning("partition %d of %s: another producer writes to it; its records get a delivery report "
                        "each from now on", part, self.topic)
        self._last_offset[part] = offset
        self.records_acked += records
        # each record's offset: counted from the previous report's (exact when nothing else wrote in between,
        # else at or below the record's: a checkpoint's tail replay then starts early, never late); the
        # reported record's own from its report. An entry of several records: its position's record's offset.
        at = prev
        reported = run[-1]
        for e in run:
            if e.filtered:
                self._ack(e, at)
            elif e is reported:
                at = offset
                self._ack(e, at)
            else:
                self._ack(e, at + e.pos_at)
                at += e.count
        while q and q[0].filtered:
            self._ack(q.popleft(), offset)

    def _log_lost(self, part: int, offset: int) -> bool:
        """Offsets of a partition only grow: a delivery report at or below one already acknowledged says the
        broker lost the log the gateway had published there (:attr:`lost`; pump() raises TopicLost)."""
        prev = self._last_offset.get(part, -1)
        if offset > prev:
            return False
        self.lost = (f"partition {part} of {self.topic} lost its log: Kafka acknowledged a record at "
                     f"offset {offset} after acknowledging offset {prev}")
        return True

    def _delivery_failed(self, part: int | None, entry: _Inflight, err: KafkaError) -> None:
        """Kafka did not take ``entry``'s record (its delivery report said ``err``)."""
        if err.code() in _TOO_LARGE:
            reason = f"{err.name()}: {err.str()}"
            if entry.large and part is not None:
                # produced alone: nothing after it on the partition was produced; replaced after this poll
                self._refusals.append((part, entry, reason))
            else:
                # refused with a batch it shared: its vbucket cannot be continued without a gap
                self.errors += 1
                self._fail_vbucket(entry.vbucket, entry, f"Kafka refused a batch as too large: {reason}")
            return
        if err.fatal() or err.code() == KafkaError._FATAL:
            self.fatal = f"{err.name()}: {err.str()}"
            return
        if err.code() in _TOPIC_GONE:
            self.lost = (f"partition {part} of {self.topic} is gone ({err.name()}) after Kafka acknowledged "
                         f"records up to offset {self._last_offset.get(part or 0, -1)} there")
            return
        self.errors += 1
        if err.code() in _RENEWABLE:
            # never delivered (or possibly, and then found in the tail): its DCP bytes go back to the window,
            # as for a record dropped by renew_producer()
            self._discard(entry)
            # one line per producer, not one per record (thousands time out together)
            self.timed_out += 1
            if self.timed_out > 1:
                return
        if self.error is None:
            self.error = KafkaException(err)
        log.error("record for vbucket %d not delivered: %s", entry.vbucket, err)

    def _add_buffer_ack(self, p: DcpConnection, nbytes: int) -> None:
        """Count ``nbytes`` of delivered records for a DCP buffer-ack to ``p``. Acknowledged per batch, not per
        record (:meth:`_send_buffer_acks`, after every poll and before every DCP step): the flow-control
        budget a step sees is the same, with one call per poll instead of one per delivery report."""
        if p is self._ack_to:
            self._ack_bytes += nbytes
            return
        self._send_buffer_acks()
        self._ack_to = p
        self._ack_bytes = nbytes

    def _send_buffer_acks(self) -> None:
        """Send the DCP buffer-ack counted by :meth:`_add_buffer_ack`."""
        p = self._ack_to
        if p is not None:
            n = self._ack_bytes
            self._ack_to = None
            self._ack_bytes = 0
            self._buffer_ack(p, n)

    def _ack(self, entry: _Inflight, offset: int) -> None:
        if entry.dcp_bytes and entry.producer is not None:
            self._add_buffer_ack(entry.producer, entry.dcp_bytes)
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
        """Records not yet acknowledged: produced, waiting behind a large record, or waiting for room in
        librdkafka's queue."""
        n = sum(len(q) for q in self._inflight.values()) + self._merged + len(self._backlog)
        if self._blocked:
            n += sum(len(q) for q in self._blocked.values())
        return n

    @property
    def backlog(self) -> int:
        """Records waiting for room in librdkafka's queue (the broker is slow or paused)."""
        return len(self._backlog)

    def oldest_unacked_age(self, now: float | None = None) -> float:
        """Seconds since the oldest record not yet acknowledged by Kafka was handed over (0.0: none)."""
        oldest = min((q[0].t for q in self._inflight.values() if q), default=None)
        for waiting in self._blocked.values():
            if waiting:
                t = waiting[0][0].t
                oldest = t if oldest is None else min(oldest, t)
        if self._backlog:
            t = self._backlog[0][1].t
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
            self._send_buffer_acks()
            if self._refusals or self._blocked:
                self._after_poll()
        self._send_buffer_acks()
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
            "lag": self._lag_of(vb, high),
            "vbuuid": self.sent[vb].vbuuid,
        }

    def observe_positions(self, positions: Mapping[int, PublishPosition]) -> None:
        """``dcpgw up --gateways K``: the acknowledged positions of vbuckets other processes publish (read from
        the checkpoint topic, :class:`~gateway.resume.CheckpointFollower`), so that :meth:`status` and
        :meth:`lag` report the group's progress. Vbuckets this publisher streams keep their own."""
        for vb, p in positions.items():
            if vb not in self.assigned and 0 <= vb < len(self._owner):
                self.acked[vb] = self.sent[vb] = p
                self.observed.add(vb)

    def lag(self) -> tuple[int, int]:
        """(total, worst) of :meth:`_lag_of` over the vbuckets streamed or observed."""
        total = worst = 0
        src = self.source
        for vb in sorted(self.assigned | self.observed):
            d = self._lag_of(vb, src.seqnos(vb)[0])
            if d > 0:
                total += d
                worst = max(worst, d)
        return total, worst

    def _lag_of(self, vb: int, high: int) -> int:
        """How far ``vb``'s partition is from the active's ``high`` seqno (docs/gateway.md "Lag"): the
        seqnos not yet acknowledged; the seqnos the partition holds beyond it (the engine lost them: the
        rollback record is owed); at least 1 while a vbucket this publisher streams awaits its stream request
        (not opened yet, or re-requested after the map changed) or has a record in flight that changes its
        branch (a rollback record back to the same seqno); for a vbucket another process publishes
        (observed), at least 1 while its reported position is on a branch the engine lost. A vbucket waiting
        for an active (cluster mode: none can stream it now, its high seqno reads 0) counts only the seqnos
        known to be unpublished."""
        acked = self.acked[vb]
        d = high - acked.seqno
        if vb in self._waiting:
            return max(0, d)
        if d < 0:
            return -d
        if d == 0:
            if vb in self.assigned:
                sent = self.sent[vb]
                if self._topo is None or vb in self._detached or sent.seqno != acked.seqno \
                        or sent.vbuuid != acked.vbuuid:
                    return 1
            elif vb in self.observed and not self._on_engine_history(vb, acked, high):
                # another process's position on a branch the engine lost: its rollback record is owed
                return 1
        return d

    def _on_engine_history(self, vb: int, pos: PublishPosition, high: int) -> bool:
        """Would the active stream ``vb`` from ``pos`` without a rollback? The decision the stream request
        from ``pos`` gets (``stream_rollback``, as engine/dcp/producer.py ``stream_request`` decides). Unknown (no
        active now): True."""
        try:
            engine_log = self.source.failover_log(vb)
        except (NotMyVBucket, TemporaryFailure):
            return True
        a = pos.request_args()
        point = stream_rollback(log=engine_log, start_seqno=a["start_seqno"], high_seqno=high, vbuuid=a["vbuuid"],
                                snap_start=a["snap_start"], snap_end=a["snap_end"], purge_seqno=0,
                                client_log=a["failover_log"])
        return point is None

    def following(self) -> dict[int, str]:
        """vbucket -> the node its stream reads from now (cluster mode; streaming vbuckets only)."""
        src = self.source
        return {vb: src.node_of(p) for vb, p in enumerate(self._owner) if p is not None and not p.closed}

    def close(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` seconds for outstanding deliveries, then drop what librdkafka still holds
        (:meth:`purge`) and close the DCP connection(s). Bounded whatever the broker does (paused, gone, lost
        its log): what was not acknowledged is not in the checkpoints and is published again after a restart
        (docs/reliability.md "Fault campaign")."""
        if self.flush(timeout):
            self.purge()
        self._owner = [None] * len(self._owner)
        self._held.clear()
        self._held_since.clear()
        self.source.close()

    def renew_producer(self) -> int:
        """Drop every record handed to librdkafka and not acknowledged, and go on with a new producer -- the
        in-process equivalent of a restart after a :class:`DeliveryTimedOut` (or :class:`ProducerFailed`). Only
        once every vbucket was removed (:meth:`remove_vbuckets`): the caller recovers their positions from the
        partitions' tails, as a restarted gateway does, and adds them again (:meth:`add_vbuckets`); the acknowledged
        positions and their checkpoints stay valid. The dropped records' DCP bytes are buffer-acknowledged.
        Returns how many records were dropped."""
        if self.assigned:
            raise GatewayError("renew_producer: remove every vbucket first")
        old = self.kafka
        self.purge()
        with contextlib.suppress(KafkaException, RuntimeError):
            old.poll(0)  # the purged records' reports, ignored (_closing)
        dropped = 0
        for q in self._inflight.values():
            for e in q:
                self._discard(e)
                dropped += e.count
        self._inflight.clear()
        self._merged = 0
        for _part, e, _rec in self._backlog:
            self._discard(e)
        dropped += len(self._backlog)
        self._backlog.clear()
        for waiting in self._blocked.values():
            for e, _rec in waiting:
                self._discard(e)
            dropped += len(waiting)
        self._blocked.clear()
        self._refusals.clear()
        self._send_buffer_acks()
        self._producer_gen += 1  # the old producer's late reports (if any) are ignored
        self.kafka = self._new_producer()
        self._closing = False
        self.error = None
        self.fatal = None
        self.timed_out = 0
        self.producer_renewals += 1
        if self.delivery_budget is not None:
            self.delivery_budget.timed_out()
        return dropped

    def purge(self) -> None:
        """Drop every record librdkafka still queues or has in flight, without waiting, so that destroying
        the producer never waits for a broker; their delivery reports are not served (nothing of them is
        acknowledged)."""
        self._closing = True
        with contextlib.suppress(KafkaException, RuntimeError):
            self.kafka.purge(in_queue=True, in_flight=True, blocking=False)
