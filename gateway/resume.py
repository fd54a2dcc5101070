"""The gateway's per-vbucket publishing position, topic setup, and recovery of the positions from Kafka
(exactly once across crashes).

Exactly once into Kafka without transactions (docs/reliability.md): every record says exactly where it sits in
its vbucket's history (headers ``dcp.seqno``, ``dcp.snap.*``, ``dcp.vbuuid``; failover-log and rollback records
carry the log), so the position after the last record *written* can be rebuilt by replaying the partition tail.
A compacted checkpoint topic, written only from delivery reports, bounds how much tail must be replayed: it
never covers an unacknowledged record, and the replay from ``offset + 1`` covers whatever was acknowledged
after it.

:class:`PublishPosition` is the contract's :class:`~schemas.position.VBucketPosition` with one addition,
``boundary``: the end of the last snapshot the gateway published *completely*. On ROLLBACK(s) the gateway
restarts from the newest boundary <= s, because the records it published between that boundary and s may not
form a consistent state on their own (de-duplication inside a snapshot; docs/rollback.md).

On start the gateway (1) reads the compacted checkpoint topic (acknowledged positions, key = vbucket) and
(2) replays every data partition from the smallest checkpointed offset + 1 to its end, applying each record to
its vbucket's position. The result is the position after the last record that is really in Kafka, whether or
not the previous process lived to checkpoint it. End of partition is detected with ``enable.partition.eof``
(not ListOffsets, whose answers are stale on some brokers: docs/kafka-compat.md).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import ConfigResource, NewTopic

from gateway.exceptions import BrokerError, GatewayError
from gateway.kafka import ClientLog, admin_client, consumer, produce_blocking, producer
from schemas.codec import decode
from schemas.failover_log import FailoverEntry
from schemas.position import VBucketPosition
from schemas.records import DecodedRecord, RecordType
from schemas.topics import partition_for

log = logging.getLogger(__name__)

#: how many recent snapshot boundaries are remembered per vbucket
MAX_BOUNDARIES = 512
#: how many of them a checkpoint record carries
_CHECKPOINT_BOUNDARIES = 32


@dataclass(slots=True)
class PublishPosition(VBucketPosition):
    """Where a vbucket's published record stream stands (after the last record): the contract's position (its
    ``vbuuid`` the one data records are stamped with) plus the gateway's completed-snapshot boundaries and the
    Kafka offset of the last record it covers."""

    #: end of the last completely published snapshot
    boundary: int = 0
    #: Kafka offset of the last record this position covers (-1: none)
    offset: int = -1
    #: recent complete-snapshot ends, ascending (for rollbacks)
    boundaries: list[int] = field(default_factory=list)
    #: a rollback record was the last record: the stream must restart from ``seqno``
    pending_rollback: bool = False

    # ------------------------------------------------------------------ transitions
    def on_snapshot(self, start: int, end: int) -> None:
        if self.snap_end and start > self.snap_end and self.seqno < self.snap_end:
            # The previous snapshot's tail was filtered out: a new snapshot starting after it means it
            # completed.
            self._complete(self.snap_end)
        VBucketPosition.on_snapshot(self, start, end)

    def on_data(self, seqno: int) -> None:
        self.on_item(seqno)
        if seqno >= self.snap_end:
            self._complete(seqno)

    def on_failover_log(self, log: Sequence[FailoverEntry]) -> None:
        VBucketPosition.on_failover_log(self, log)
        self.pending_rollback = False

    def on_rollback(self, seqno: int) -> int:
        """Apply a ROLLBACK(seqno): restart from the newest known boundary <= seqno. Returns it."""
        i = bisect.bisect_right(self.boundaries, seqno)
        b = self.boundaries[i - 1] if i else 0
        if self.boundary <= seqno:
            b = max(b, self.boundary)
        del self.boundaries[i:]
        self.rollback(seqno, b)
        self.boundary = b
        self.pending_rollback = True
        return b

    def _complete(self, end: int) -> None:
        self.seqno = max(self.seqno, end)
        self.boundary = end
        bs = self.boundaries
        if not bs or bs[-1] < end:
            bs.append(end)
            if len(bs) > MAX_BOUNDARIES:
                del bs[: len(bs) - MAX_BOUNDARIES]

    def complete_if_done(self) -> None:
        """The DCP stream delivered the whole current snapshot (its last item may have been filtered)."""
        if self.snap_end and self.seqno < self.snap_end:
            self._complete(self.snap_end)

    def apply(self, rec: DecodedRecord, offset: int) -> None:
        """Replay one record of this vbucket read back from Kafka."""
        t = rec.type
        if t is RecordType.SNAPSHOT:
            self.on_snapshot(rec.snap_start, rec.snap_end)
            self.vbuuid = rec.vbuuid or self.vbuuid
        elif t is RecordType.FAILOVER_LOG:
            self.on_failover_log(list(rec.failover_log or ()))
        elif t is RecordType.ROLLBACK:
            # Our own log, pruned above the rollback seqno, is what the re-request sends; the engine's new log
            # arrives with the failover-log record at stream OK.
            self.on_rollback(rec.seqno)
        elif t is RecordType.STREAM_END:
            pass
        else:
            self.vbuuid = rec.vbuuid
            self.on_data(rec.seqno)
        self.offset = offset

    @property
    def is_fresh(self) -> bool:
        return self.offset < 0 and not self.failover_log and self.seqno == 0

    # ------------------------------------------------------------------ persistence (checkpoint records)
    def to_dict(self) -> dict[str, Any]:
        d = VBucketPosition.to_dict(self)
        d["boundary"] = self.boundary
        d["offset"] = self.offset
        d["boundaries"] = self.boundaries[-_CHECKPOINT_BOUNDARIES:]
        d["pending_rollback"] = self.pending_rollback
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        return cls(
            **cls.fields_from(d),
            boundary=int(d["boundary"]),
            offset=int(d["offset"]),
            boundaries=[int(x) for x in d.get("boundaries", [])],
            pending_rollback=bool(d.get("pending_rollback", False)),
        )

    def copy(self) -> Self:
        return self._copy_with(self.boundary, self.offset, list(self.boundaries), self.pending_rollback)


def checkpoint_topic_name(topic: str) -> str:
    """The compacted topic holding acknowledged positions of ``topic`` (internal; key = vbucket)."""
    return f"_dcpgw-checkpoints.{topic}"


def wait_for_kafka(client_config: dict[str, Any], timeout: float, *,
                   setting: str | None = "kafka_connect_timeout_s") -> None:
    """Return once the cluster in ``client_config`` answers a metadata request; :class:`BrokerError` naming
    the bootstrap address and librdkafka's last connection error when it does not within ``timeout`` seconds
    (setting ``kafka_connect_timeout_s``). Its own log lines are only collected, not logged: the error says it.
    """
    servers = client_config.get("bootstrap.servers", "?")
    probe_log = ClientLog(quiet=True)
    conf = {k: v for k, v in client_config.items() if k not in ("logger", "error_cb")}
    admin = admin_client(conf, log=probe_log)
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        remaining = deadline - time.monotonic()
        try:
            admin.list_topics(timeout=max(0.05, min(1.0, remaining)))
            return
        except KafkaException as e:
            last = str(e.args[0].str() if e.args and hasattr(e.args[0], "str") else e)
        admin.poll(0)  # serves the error callbacks: the per-broker connection errors
        if time.monotonic() >= deadline:
            why = probe_log.last_error or last
            within = f"{timeout:g}s" + (f" ({setting})" if setting else "")
            raise BrokerError(f"Kafka at {servers} is unreachable: no answer within {within}; last error: {why}")


def ensure_topics(
    client_config: dict[str, Any], topic: str, partitions: int, replication_factor: int = 1,
    timeout: float = 30.0, max_message_bytes: int | None = None,
) -> int:
    """Create the data topic (``partitions`` partitions; ``max.message.bytes`` = ``max_message_bytes`` when
    given) and the compacted checkpoint topic if missing.

    Returns the data topic's actual partition count (an existing topic may have fewer: vbucket v then goes
    to partition v mod P).
    """
    admin = admin_client(client_config)
    data_config = {"max.message.bytes": str(max_message_bytes)} if max_message_bytes else {}
    wanted = [
        NewTopic(topic, num_partitions=partitions, replication_factor=replication_factor, config=data_config),
        NewTopic(checkpoint_topic_name(topic), num_partitions=1, replication_factor=replication_factor,
                 config={"cleanup.policy": "compact"}),
    ]
    for nt, fut in admin.create_topics(wanted, request_timeout=timeout).items():
        try:
            fut.result()
        except KafkaException as e:
            err = e.args[0]
            if err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise BrokerError(f"cannot create topic {nt}: {err}") from e
    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(topic, timeout=timeout)
        t = md.topics.get(topic)
        if t is not None and t.error is None and t.partitions:
            return len(t.partitions)
        if time.monotonic() > deadline:
            raise BrokerError(f"topic {topic} did not become available")
        time.sleep(0.1)


def topic_record_limit(
    client_config: dict[str, Any], topic: str, needed: int, timeout: float = 30.0,
) -> int | None:
    """The data topic's ``max.message.bytes`` (None when the broker does not say: Tansu answers only the
    configs set at creation, docs/kafka-compat.md). Logs a warning with the numbers when it is below
    ``needed`` (the largest record the gateway may produce): larger records are then handled by the
    ``oversize_policy`` (docs/reliability.md "Large documents")."""
    admin = admin_client(client_config)
    try:
        futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)],
                                         request_timeout=timeout)
        configs = next(iter(futures.values())).result(timeout=timeout)
    except KafkaException as e:
        log.warning("cannot read the configuration of topic %s (%s): its record size limit is unknown", topic, e)
        return None
    entry = configs.get("max.message.bytes")
    if entry is None or entry.value is None:
        return None
    try:
        limit = int(entry.value)
    except ValueError:
        return None
    if limit < needed:
        log.warning(
            "topic %s has max.message.bytes=%d, below the %d bytes of the largest record the gateway may "
            "produce (the engine's largest value plus key and headers): larger records are handled by "
            "oversize_policy; raise it with kafka-configs --alter --add-config max.message.bytes=%d",
            topic, limit, needed, needed)
    return limit


#: ``fetch.wait.max.ms`` of the consumers that read partitions to their end (recovery, replay of the tail)
READ_TO_END_FETCH_WAIT_MS = 20


def _consumer(client_config: dict[str, Any]) -> Consumer:
    return consumer(client_config, {
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        # a partition's EOF is reported only after a fetch that came back empty, and the broker holds an empty
        # fetch up to fetch.wait.max.ms (500 by default): each read to the end would wait that long
        "fetch.wait.max.ms": READ_TO_END_FETCH_WAIT_MS,
        "auto.offset.reset": "earliest",
        "fetch.max.bytes": 64 * 1024 * 1024,
    }, group_id=f"dcpgw-recovery-{uuid.uuid4()}")


def _read_to_end(
    consumer: Consumer, assignment: list[TopicPartition], on_message: Callable[[Any], None],
    timeout: float = 120.0, ends: dict[int, int] | None = None,
) -> None:
    """Read every assigned partition to its end; ``ends`` (when given) gets each partition's end offset (the
    high watermark the fetch carried: correct even where ListOffsets is stale, docs/kafka-compat.md)."""
    if not assignment:
        return
    consumer.assign(assignment)
    pending = {(tp.topic, tp.partition) for tp in assignment}
    #: partitions nothing was read from yet, with the offset they were assigned at
    unread: dict[tuple[str | None, int | None], int] = {(tp.topic, tp.partition): tp.offset for tp in assignment}
    deadline = time.monotonic() + timeout
    while pending:
        if time.monotonic() > deadline:
            raise BrokerError(f"timed out reading {len(pending)} partitions to their end")
        # the first message (or EOF event) of the window, then what is already fetched: consume(n, timeout)
        # alone would wait out its whole timeout unless n messages arrive (0.5 s per call, twice per recovery)
        first = consumer.poll(0.5)
        msgs = [first, *consumer.consume(9_999, 0)] if first is not None else []
        if not msgs:
            # A start offset beyond the partition's end (the topic lost its log): Kafka answers
            # OFFSET_OUT_OF_RANGE (reset, then EOF), some brokers (Tansu) only empty fetches that never reach
            # EOF; the high watermark those fetches carried says where the end is.
            for key, start in list(unread.items()):
                if key not in pending:
                    continue
                topic, part = key
                if topic is None or part is None:
                    continue
                with contextlib.suppress(KafkaException):
                    _lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, part), cached=True)
                    if 0 <= hi < start:
                        pending.discard(key)
                        if ends is not None:
                            ends[part] = hi
        for m in msgs:
            if m.error() is None:
                unread.pop((m.topic(), m.partition()), None)
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard((m.topic(), m.partition()))
                    eof_part, end = m.partition(), m.offset()
                    if ends is not None and eof_part is not None and end is not None:
                        ends[eof_part] = end
                    continue
                raise BrokerError(f"reading {m.topic()}[{m.partition()}]: {err}")
            on_message(m)


def checkpoint_of(message: Any, *, warn: bool) -> PublishPosition | None:
    """The position a checkpoint-topic record holds; None for a tombstone or a corrupt record (logged with
    ``warn``)."""
    value = message.value()
    if value is None:
        return None
    try:
        return PublishPosition.from_json(value)
    except (ValueError, KeyError, TypeError) as e:
        if warn:
            log.warning("ignoring corrupt checkpoint at offset %s: %s", message.offset(), e)
        return None


def load_checkpoints(client_config: dict[str, Any], topic: str) -> dict[int, PublishPosition]:
    """The newest acknowledged position per vbucket from the checkpoint topic."""
    out: dict[int, PublishPosition] = {}
    c = _consumer(client_config)
    try:
        def take(m: Any) -> None:
            p = checkpoint_of(m, warn=True)
            if p is not None:
                out[p.vbucket] = p

        _read_to_end(c, [TopicPartition(checkpoint_topic_name(topic), 0, 0)], take)
    finally:
        c.close()
    return out


class CheckpointFollower:
    """Follows the checkpoint topic of ``topic`` in a daemon thread: :attr:`positions` holds the newest
    acknowledged position per vbucket written by any gateway process (``dcpgw up --gateways K``: the members'
    progress, which the ``up`` process's own API reports, docs/scale-out.md). Starts at the partition's end: the
    ``up`` process read everything before at its start (:func:`recover_positions`); with ``from_beginning`` at
    its start (bench.gateway's scale-out runs: one consumer reading on, not :func:`load_checkpoints` again and
    again)."""

    def __init__(self, client_config: dict[str, Any], topic: str, poll_s: float = 0.2, *,
                 from_beginning: bool = False) -> None:
        self.topic = topic
        self.poll_s = poll_s
        #: vbucket -> the newest checkpointed position seen (replaced whole: read from any thread)
        self.positions: dict[int, PublishPosition] = {}
        # a fetch that finds nothing new waits at most a poll (librdkafka's default 500 ms: a checkpoint written
        # just after an empty fetch was seen up to half a second late)
        self._consumer = consumer(client_config, {"enable.auto.commit": False, "auto.offset.reset": "latest",
                                                  "fetch.wait.max.ms": max(1, round(poll_s * 1000))},
                                  group_id=f"dcpgw-progress-{uuid.uuid4()}")
        self._consumer.assign([TopicPartition(checkpoint_topic_name(topic), 0,
                                              OFFSET_BEGINNING if from_beginning else OFFSET_END)])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcpgw-checkpoint-follower", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        c = self._consumer
        while not self._stop.is_set():
            try:
                msgs = c.consume(1000, self.poll_s)
            except KafkaException as e:  # the broker away: librdkafka reconnects; tried again
                log.debug("checkpoint follower: %s", e)
                self._stop.wait(self.poll_s)
                continue
            if not msgs:
                continue
            latest = dict(self.positions)
            for m in msgs:
                # (load_checkpoints warns about a corrupt checkpoint at the next start)
                p = checkpoint_of(m, warn=False) if m.error() is None else None
                if p is not None:
                    latest[p.vbucket] = p
            self.positions = latest

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        with contextlib.suppress(RuntimeError, KafkaException):
            self._consumer.close()


def replay_tail(
    client_config: dict[str, Any], topic: str, num_partitions: int, num_vbuckets: int,
    positions: dict[int, PublishPosition], lost: dict[int, str] | None = None,
    vbuckets: Sequence[int] | None = None,
) -> dict[int, PublishPosition]:
    """Apply every record after each vbucket's checkpointed offset to its position. Returns all positions
    (only those of ``vbuckets`` when given: a group member taking them over, docs/scale-out.md; only their
    partitions are read, the records of other vbuckets there are skipped).

    ``lost`` (when given) gets the vbuckets whose checkpointed offset is at or beyond their partition's end,
    with why: the topic lost records Kafka had acknowledged (docs/reliability.md "Fault campaign", topic
    truncated)."""
    wanted = range(num_vbuckets) if vbuckets is None else sorted(set(vbuckets))
    pos = {vb: positions.get(vb, PublishPosition(vb)) for vb in wanted}
    start: dict[int, int] = {}
    for vb, p in pos.items():
        part = partition_for(vb, num_partitions)
        o = p.offset + 1
        start[part] = min(start.get(part, o), o)
    c = _consumer(client_config)
    replayed = 0

    def take(m: Any) -> None:
        nonlocal replayed
        rec = decode(m.key(), m.value(), m.headers())
        p = pos.get(rec.vbucket)
        if p is None and 0 <= rec.vbucket < num_vbuckets:
            return  # another member's vbucket
        if p is None:
            raise GatewayError(f"record for vbucket {rec.vbucket} in {topic}: the bucket has {num_vbuckets}")
        if m.offset() <= p.offset:
            return  # already covered by this vbucket's checkpoint
        p.apply(rec, m.offset())
        replayed += 1

    ends: dict[int, int] = {}
    try:
        _read_to_end(c, [TopicPartition(topic, part, off) for part, off in sorted(start.items())], take,
                     ends=ends)
    finally:
        c.close()
    if lost is not None:
        for vb, p in sorted(positions.items()):
            if vb not in pos:
                continue
            end = ends.get(partition_for(vb, num_partitions))
            if end is not None and p.offset >= end:
                lost[vb] = (f"partition {partition_for(vb, num_partitions)} of {topic} ends at offset {end}, "
                            f"but vbucket {vb}'s checkpoint says Kafka acknowledged offset {p.offset}")
    log.info("replayed %d records of %s after the checkpoints", replayed, topic)
    return pos


def recover_positions(
    client_config: dict[str, Any], topic: str, num_partitions: int, num_vbuckets: int,
    lost: dict[int, str] | None = None,
) -> dict[int, PublishPosition]:
    return replay_tail(client_config, topic, num_partitions, num_vbuckets, load_checkpoints(client_config, topic),
                       lost)


class CheckpointWriter:
    """Writes acknowledged positions to the compacted checkpoint topic.

    :meth:`write` never waits (it runs on the event loop's thread): positions librdkafka's full queue does not
    take now are kept, newest per vbucket, and produced first by the next :meth:`write` or :meth:`flush`."""

    def __init__(self, producer_config: dict[str, Any], topic: str) -> None:
        self.topic = checkpoint_topic_name(topic)
        self._conf = producer_config
        self.written = 0
        #: positions not yet handed to librdkafka (its queue was full, or Kafka did not take them), newest per
        #: vbucket
        self.pending: dict[int, PublishPosition] = {}
        #: the newest position handed to librdkafka per vbucket, written again when a checkpoint record is not
        #: delivered: a group member's producer fails records after its lease (docs/scale-out.md "Delivery within
        #: the lease"), and a vbucket whose position does not move afterwards would otherwise keep an old
        #: checkpoint for good
        self._latest: dict[int, PublishPosition] = {}
        #: checkpoint records Kafka did not take (their vbucket's newest position went back to ``pending``)
        self.failed = 0
        self._p = self._producer()

    def _producer(self) -> Any:
        ref = weakref.ref(self)

        def on_delivery(err: KafkaError | None, msg: Any) -> None:
            w = ref()
            if w is not None and err is not None:
                w._not_delivered(msg)

        return producer(self._conf, on_delivery=on_delivery)

    def _not_delivered(self, msg: Any) -> None:
        self.failed += 1
        try:
            vb = int(msg.key())
        except (TypeError, ValueError):
            return
        latest = self._latest.get(vb)
        if latest is not None and vb not in self.pending:
            self.pending[vb] = latest

    def write(self, positions: dict[int, PublishPosition]) -> None:
        self.pending.update(positions)
        for vb in list(self.pending):
            try:
                self._p.produce(self.topic, self.pending[vb].to_json(), str(vb).encode(), partition=0)
            except BufferError:
                break
            except KafkaException as e:
                self._renew(e)
                break
            self._latest[vb] = self.pending.pop(vb)
            self.written += 1
        self._p.poll(0)

    def _renew(self, e: KafkaException) -> None:
        """A fatal error of the idempotent producer (e.g. the broker lost its state: out-of-order sequence): a
        new producer; the positions not handed over stay pending. Anything else is raised."""
        err = e.args[0] if e.args else None
        if not isinstance(err, KafkaError) or not (err.fatal() or err.code() == KafkaError._FATAL):
            raise e
        log.warning("checkpoint producer failed (%s): a new one takes over", err)
        with contextlib.suppress(KafkaException, RuntimeError):
            self._p.purge(in_queue=True, in_flight=True, blocking=False)
        self._p = self._producer()

    def flush(self, timeout: float = 10.0) -> int:
        """Hand every pending position to librdkafka, waiting for room in its queue, and wait for their
        acknowledgements, all within ``timeout`` seconds; what is still queued then is dropped (a lost checkpoint
        only means a longer tail replay at the next start). Returns how many were not delivered."""
        deadline = time.monotonic() + timeout
        for vb in list(self.pending):
            try:
                produce_blocking(self._p, self.topic, self.pending[vb].to_json(), str(vb).encode(), partition=0,
                                 timeout=max(0.0, deadline - time.monotonic()))
            except (BufferError, KafkaException):  # no room in time, or the producer failed (fatal error)
                break
            self._latest[vb] = self.pending.pop(vb)
            self.written += 1
        try:
            left = int(self._p.flush(max(0.0, deadline - time.monotonic()))) + len(self.pending)
        except KafkaException as e:  # a fatal error of the idempotent producer (the broker lost its state)
            log.warning("checkpoints not flushed: %s", e)
            left = len(self._p) + len(self.pending)
        if left:
            with contextlib.suppress(KafkaException, RuntimeError):
                self._p.purge(in_queue=True, in_flight=True, blocking=False)
        return left
