"""Topic setup and recovery of the publishing positions from Kafka (exactly once across crashes).

On start the gateway (1) reads the compacted checkpoint topic (acknowledged positions, key = vbucket) and
(2) replays every data partition from the smallest checkpointed offset + 1 to its end, applying each record to
its vbucket's position. The result is the position after the last record that is really in Kafka, whether or
not the previous process lived to checkpoint it. End of partition is detected with ``enable.partition.eof``
(not ListOffsets, whose answers are stale on some brokers: docs/kafka-compat.md).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from gateway.client_log import ClientLog, with_client_log
from gateway.exceptions import BrokerError, GatewayError
from gateway.position import PublishPosition
from gateway.records import decode, partition_for

log = logging.getLogger(__name__)


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
    admin = AdminClient(with_client_log(conf, probe_log))
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
    admin = AdminClient(client_config)
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
    admin = AdminClient(client_config)
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


def _consumer(client_config: dict[str, Any]) -> Consumer:
    return Consumer({
        **client_config,
        "group.id": f"dcpgw-recovery-{uuid.uuid4()}",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        "fetch.max.bytes": 64 * 1024 * 1024,
    })


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
        msgs = consumer.consume(10_000, 0.5)
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


def load_checkpoints(client_config: dict[str, Any], topic: str) -> dict[int, PublishPosition]:
    """The newest acknowledged position per vbucket from the checkpoint topic."""
    out: dict[int, PublishPosition] = {}
    c = _consumer(client_config)
    try:
        def take(m: Any) -> None:
            if m.value() is None:
                return
            try:
                p = PublishPosition.from_json(m.value())
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring corrupt checkpoint at offset %s: %s", m.offset(), e)
                return
            out[p.vbucket] = p

        _read_to_end(c, [TopicPartition(checkpoint_topic_name(topic), 0, 0)], take)
    finally:
        c.close()
    return out


def replay_tail(
    client_config: dict[str, Any], topic: str, num_partitions: int, num_vbuckets: int,
    positions: dict[int, PublishPosition], lost: dict[int, str] | None = None,
) -> dict[int, PublishPosition]:
    """Apply every record after each vbucket's checkpointed offset to its position. Returns all positions.

    ``lost`` (when given) gets the vbuckets whose checkpointed offset is at or beyond their partition's end,
    with why: the topic lost records Kafka had acknowledged (docs/reliability.md "Fault campaign", topic
    truncated)."""
    pos = {vb: positions.get(vb, PublishPosition(vb)) for vb in range(num_vbuckets)}
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
        self._p = Producer(producer_config)
        self.written = 0
        #: positions not yet handed to librdkafka (its queue was full), newest per vbucket
        self.pending: dict[int, PublishPosition] = {}

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
            del self.pending[vb]
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
        self._p = Producer(self._conf)

    def flush(self, timeout: float = 10.0) -> int:
        """Wait up to ``timeout`` seconds for the checkpoints to be delivered; what is still queued then is
        dropped (a lost checkpoint only means a longer tail replay at the next start). Returns how many
        were not delivered."""
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            self.write({})
            if self.pending:
                self._p.poll(0.05)
        try:
            left = int(self._p.flush(max(0.0, deadline - time.monotonic()))) + len(self.pending)
        except KafkaException as e:  # a fatal error of the idempotent producer (the broker lost its state)
            log.warning("checkpoints not flushed: %s", e)
            left = len(self._p) + len(self.pending)
        if left:
            with contextlib.suppress(KafkaException, RuntimeError):
                self._p.purge(in_queue=True, in_flight=True, blocking=False)
        return left
