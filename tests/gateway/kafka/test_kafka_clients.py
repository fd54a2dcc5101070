"""gateway.kafka: the one place that builds Kafka clients (client log attached, each client given only the
properties librdkafka applies to it) and the bounded BufferError retry for callers that may wait. Real
librdkafka clients, the real test broker; an unreachable broker is 127.0.0.1:1."""

from __future__ import annotations

import logging
import time
import uuid

import pytest

from gateway.broker import Broker
from gateway.kafka import ClientLog, admin_client, consumer, produce_blocking, producer
from gateway.kafka.properties import PropertyValue, consumer_only, producer_only
from gateway.resume import CheckpointWriter, PublishPosition, ensure_topics, load_checkpoints

UNREACHABLE = {"bootstrap.servers": "127.0.0.1:1", "reconnect.backoff.ms": 10, "reconnect.backoff.max.ms": 20}


def test_client_roles_come_from_librdkafka() -> None:
    props: dict[str, PropertyValue] = {
        "fetch.min.bytes": 5, "auto.offset.reset": "earliest", "linger.ms": 3, "acks": "all",
        "compression.type": "lz4", "socket.timeout.ms": 1000, "client.id": "x"}
    assert consumer_only(props) == {"fetch.min.bytes", "auto.offset.reset"}
    assert producer_only(props) == {"linger.ms", "acks", "compression.type"}


def test_factories_attach_the_client_log_and_drop_foreign_properties(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "t.kafka.factory")
    log = ClientLog(logging.getLogger("t.kafka.factory"), interval_s=60)
    p = producer({**UNREACHABLE, "fetch.min.bytes": 5}, log=log)
    c = consumer({**UNREACHABLE, "linger.ms": 5}, {"enable.auto.commit": False}, group_id="g", log=log)
    a = admin_client({**UNREACHABLE, "linger.ms": 5, "fetch.min.bytes": 5}, log=log)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and log.last_error is None:
        p.poll(0.1)
        c.poll(0.1)
        a.poll(0.1)
    assert log.last_error is not None and "127.0.0.1:1" in log.last_error  # error_cb is the client log's
    lines = [r.getMessage() for r in caplog.records]
    assert not [line for line in lines if "will be ignored by this" in line], lines
    c.close()
    p.flush(0)


def test_caller_callbacks_are_kept() -> None:
    seen: list[object] = []
    p = producer(UNREACHABLE, {"error_cb": seen.append}, log=ClientLog(quiet=True))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not seen:
        p.poll(0.1)
    assert seen
    p.flush(0)


def test_produce_blocking_gives_up_after_its_timeout() -> None:
    p = producer({**UNREACHABLE, "queue.buffering.max.messages": 1}, log=ClientLog(quiet=True))
    p.produce("t", b"first")
    started = time.monotonic()
    with pytest.raises(BufferError):
        produce_blocking(p, "t", b"second", timeout=0.5)
    assert time.monotonic() - started < 10  # bounded: did not hang
    p.purge()
    p.flush(0)


def test_produce_blocking_waits_for_room(kafka_broker: Broker) -> None:
    topic = f"kl-{uuid.uuid4().hex[:10]}"
    ensure_topics(kafka_broker.client_config(), topic, 1)
    delivered: list[object] = []
    p = producer(kafka_broker.client_config(), {"queue.buffering.max.messages": 2, "linger.ms": 0},
                 on_delivery=lambda err, msg: delivered.append(err))
    for i in range(20):
        produce_blocking(p, topic, str(i).encode(), partition=0, timeout=60)
    assert p.flush(60) == 0
    assert delivered == [None] * 20


def test_checkpoint_flush_waits_for_room_in_a_full_queue(kafka_broker: Broker) -> None:
    topic = f"kl-{uuid.uuid4().hex[:10]}"
    ensure_topics(kafka_broker.client_config(), topic, 1)
    w = CheckpointWriter(kafka_broker.client_config(**{"queue.buffering.max.messages": 2}), topic)
    positions = {vb: PublishPosition(vb, seqno=vb + 1, offset=vb) for vb in range(30)}
    w.write(positions)  # never waits: what the full queue refused stays pending
    assert w.pending
    assert w.flush(60) == 0 and not w.pending
    back = load_checkpoints(kafka_broker.client_config(), topic)
    assert {vb: p.seqno for vb, p in back.items()} == {vb: vb + 1 for vb in range(30)}
