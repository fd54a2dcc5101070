"""The broker layer against a real Kafka-protocol broker (no mocks): produce/consume round trip,
outage simulation with pause/resume, start failures, and selection rules."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from gateway.broker import (
    Broker,
    EmbeddedTansuBroker,
    ExternalBroker,
    TestcontainersBroker,
    select_broker,
)
from gateway.exceptions import BrokerError, BrokerStartError, DcpGatewayError, GatewayError
from gateway.resume import READ_TO_END_FETCH_WAIT_MS

PARTITIONS = 4


def partition_of(message: Message) -> int:
    partition = message.partition()
    assert partition is not None
    return partition


def offset_of(message: Message) -> int:
    offset = message.offset()
    assert offset is not None
    return offset


def consume_all(
    broker: Broker, topic: str, partitions: int, expected: int, timeout: float = 60.0
) -> list[Message]:
    """Read every partition from the beginning until each reports EOF and ``expected`` records arrived."""
    consumer = Consumer(
        broker.client_config(
            **{
                "group.id": f"reader-{topic}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "fetch.wait.max.ms": READ_TO_END_FETCH_WAIT_MS,
            }
        )
    )
    try:
        # Manual assignment: no group rebalance involved (cooperative-sticky never completes on Tansu).
        consumer.assign([TopicPartition(topic, p, -2) for p in range(partitions)])  # -2 = OFFSET_BEGINNING
        records: list[Message] = []
        at_eof: set[int] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (len(at_eof) < partitions or len(records) < expected):
            message = consumer.poll(0.5)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                assert error.code() == KafkaError._PARTITION_EOF, error
                at_eof.add(partition_of(message))
                continue
            at_eof.discard(partition_of(message))
            records.append(message)
        assert len(at_eof) == partitions, f"EOF seen on {sorted(at_eof)} only"
        return records
    finally:
        consumer.close()


def test_idempotent_round_trip_keeps_headers_and_partition_order(
    kafka_broker: Broker, make_topic: Callable[..., str]
) -> None:
    topic = make_topic(partitions=PARTITIONS)
    producer = Producer(
        kafka_broker.client_config(**{"enable.idempotence": True, "acks": "all", "linger.ms": 5})
    )
    delivered: list[tuple[int, int]] = []
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(err)
        else:
            delivered.append((partition_of(msg), offset_of(msg)))

    total = 1000
    for i in range(total):
        producer.produce(
            topic,
            key=f"key-{i}".encode(),
            value=f"value-{i}".encode(),
            partition=i % PARTITIONS,
            # Repeated header keys and an empty value must survive as sent, in order.
            headers=[("seq", str(i).encode()), ("tag", b"a"), ("tag", b"b"), ("empty", b"")],
            on_delivery=on_delivery,
        )
        producer.poll(0)
    assert producer.flush(60) == 0
    assert errors == []
    assert len(delivered) == total

    records = consume_all(kafka_broker, topic, PARTITIONS, total)
    assert len(records) == total
    by_partition: dict[int, list[Message]] = defaultdict(list)
    for record in records:
        by_partition[partition_of(record)].append(record)
    assert sorted(by_partition) == list(range(PARTITIONS))
    for partition, messages in by_partition.items():
        expected_seqs = list(range(partition, total, PARTITIONS))
        assert len(messages) == len(expected_seqs)
        # Offsets are dense from 0 and records come back in the order they were produced.
        assert [m.offset() for m in messages] == list(range(len(expected_seqs)))
        assert [m.key() for m in messages] == [f"key-{seq}".encode() for seq in expected_seqs]
        for message, seq in zip(messages, expected_seqs, strict=True):
            assert message.value() == f"value-{seq}".encode()
            assert message.headers() == [
                ("seq", str(seq).encode()),
                ("tag", b"a"),
                ("tag", b"b"),
                ("empty", b""),
            ]


def test_pause_stalls_delivery_and_resume_completes_it(
    kafka_broker: Broker, make_topic: Callable[..., str]
) -> None:
    if not isinstance(kafka_broker, EmbeddedTansuBroker):
        pytest.skip(f"pause/resume needs the embedded broker, not {kafka_broker.kind}")
    topic = make_topic(partitions=1)
    producer = Producer(
        kafka_broker.client_config(
            **{"enable.idempotence": True, "acks": "all", "message.timeout.ms": 120_000}
        )
    )
    delivered: list[int] = []
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(err)
        else:
            delivered.append(offset_of(msg))

    # Warm up: connections and the idempotent producer id exist before the outage.
    producer.produce(topic, b"before", on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert delivered == [0]

    with kafka_broker.paused_for():
        assert kafka_broker.paused
        for i in range(100):
            producer.produce(topic, f"during-{i}".encode(), on_delivery=on_delivery)
        stalled_until = time.monotonic() + 2.0
        while time.monotonic() < stalled_until:
            producer.poll(0.1)
        assert len(delivered) == 1, "records were acknowledged while the broker was paused"
        assert len(producer) == 100  # still queued / in flight
    assert not kafka_broker.paused

    assert producer.flush(60) == 0
    assert errors == []
    assert delivered == list(range(101))
    records = consume_all(kafka_broker, topic, 1, 101)
    assert [r.value() for r in records] == [b"before"] + [f"during-{i}".encode() for i in range(100)]


def test_bad_binary_path_raises_broker_start_error(tmp_path: Path) -> None:
    with pytest.raises(BrokerStartError, match="does not exist or is not executable"):
        EmbeddedTansuBroker(binary=tmp_path / "no-such-tansu").start()


def test_binary_that_exits_raises_broker_start_error_with_its_log(tmp_path: Path) -> None:
    fake = tmp_path / "not-a-broker"
    fake.write_text("#!/bin/sh\necho 'refusing to start' >&2\nexit 3\n")
    fake.chmod(0o755)
    broker = EmbeddedTansuBroker(binary=fake, start_timeout=10, log_dir=tmp_path / "logs")
    with pytest.raises(BrokerStartError, match="exited with status 3") as info:
        broker.start()
    assert "refusing to start" in str(info.value)
    assert not broker.running
    # Three tries at fresh ports (the port may have been taken meanwhile), all logged; the log is kept.
    assert (tmp_path / "logs" / "tansu.log").read_text().count("refusing to start") == 3


def test_broker_errors_share_the_product_root() -> None:
    assert issubclass(BrokerStartError, BrokerError)
    assert issubclass(BrokerError, GatewayError)
    assert issubclass(GatewayError, DcpGatewayError)
    assert BrokerError.retriable and BrokerStartError.retriable
    assert not GatewayError.retriable


def test_embedded_stop_leaves_no_process_and_restart_is_empty() -> None:
    broker = EmbeddedTansuBroker()
    with broker:
        pid = broker.pid
        log_dir = broker.log_path.parent if broker.log_path else None
        admin = AdminClient(broker.client_config())
        admin.create_topics([NewTopic("kept", num_partitions=1, replication_factor=1)])["kept"].result(30)
        assert "kept" in admin.list_topics(timeout=10).topics
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert log_dir is not None and not log_dir.exists()
    with pytest.raises(BrokerError):
        _ = broker.bootstrap_servers
    # Memory storage: a restarted broker is an empty cluster (docs/kafka-compat.md).
    with broker:
        assert "kept" not in AdminClient(broker.client_config()).list_topics(timeout=10).topics


def test_select_broker_rules() -> None:
    external = select_broker({"KAFKA_BOOTSTRAP_SERVERS": "kafka:9092"})
    assert isinstance(external, ExternalBroker)
    assert external.kind == "external"
    assert external.bootstrap_servers == "kafka:9092"
    assert isinstance(
        select_broker({"DCPGW_BROKER": "embedded", "KAFKA_BOOTSTRAP_SERVERS": "x:1"}), EmbeddedTansuBroker
    )
    assert isinstance(select_broker({"DCPGW_BROKER": "testcontainers"}), TestcontainersBroker)
    with pytest.raises(BrokerError):
        select_broker({"DCPGW_BROKER": "external"})
    with pytest.raises(BrokerError):
        select_broker({"DCPGW_BROKER": "bogus"})
