"""The one place that builds the gateway's Kafka clients (as quix-streams' ``kafka/`` package does).

Every producer, consumer and admin client of the gateway comes from :func:`producer`, :func:`consumer` or
:func:`admin_client`. Each takes the connection: a :class:`~gateway.config.KafkaConnection` (the typed settings)
or the librdkafka configuration built from it (``GatewaySettings.producer_config()`` and friends, with the
bootstrap address `dcpgw up` chose). The factory attaches the rate-limited :class:`ClientLog` as librdkafka's
``logger`` and ``error_cb`` (a caller's own are kept), and gives each client only the properties librdkafka
applies to it (gateway.kafka.properties).

:func:`produce_blocking` is the bounded ``BufferError`` retry for callers that may wait (checkpoints at
shutdown, tests, benchmarks). The publisher's hot path never waits: it keeps the records librdkafka's full
queue refuses in its own backlog (docs/reliability.md, "Stalled broker and health").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from gateway.kafka.client_log import ClientLog, with_client_log
from gateway.kafka.properties import consumer_only, producer_only

if TYPE_CHECKING:
    from gateway.config import KafkaConnection

__all__ = [
    "admin_client",
    "client_config",
    "consumer",
    "default_client_log",
    "produce_blocking",
    "producer",
]

_DEFAULT_LOG: ClientLog | None = None


def default_client_log() -> ClientLog:
    """The process-wide :class:`ClientLog` of clients built without one (rate limits span those clients)."""
    global _DEFAULT_LOG
    if _DEFAULT_LOG is None:
        _DEFAULT_LOG = ClientLog()
    return _DEFAULT_LOG


def client_config(connection: KafkaConnection | Mapping[str, Any], *,
                  bootstrap_servers: str | None = None) -> dict[str, Any]:
    """The librdkafka configuration of ``connection`` (``bootstrap_servers`` replaces its address)."""
    if isinstance(connection, Mapping):
        conf = dict(connection)
    else:
        conf = dict(connection.to_librdkafka())
    if bootstrap_servers is not None:
        conf["bootstrap.servers"] = bootstrap_servers
    return conf


def _with_log(conf: dict[str, Any], log: ClientLog | None) -> dict[str, Any]:
    return with_client_log(conf, log if log is not None else default_client_log())


def _without(conf: dict[str, Any], drop: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in conf.items() if k not in drop} if drop else conf


def admin_client(connection: KafkaConnection | Mapping[str, Any], *, log: ClientLog | None = None,
                 bootstrap_servers: str | None = None) -> AdminClient:
    """An AdminClient of ``connection`` (producer- and consumer-only properties left out)."""
    conf = client_config(connection, bootstrap_servers=bootstrap_servers)
    scalars = _scalars(conf)
    conf = _without(conf, producer_only(scalars) | consumer_only(scalars))
    return AdminClient(_with_log(conf, log))


def consumer(connection: KafkaConnection | Mapping[str, Any], properties: Mapping[str, Any] | None = None, *,
             group_id: str | None = None, log: ClientLog | None = None,
             bootstrap_servers: str | None = None) -> Consumer:
    """A Consumer of ``connection`` plus ``properties``; ``group_id`` sets ``group.id``. Producer-only
    properties of the connection are left out."""
    conf = client_config(connection, bootstrap_servers=bootstrap_servers)
    conf = _without(conf, producer_only(_scalars(conf)))
    conf.update(properties or {})
    if group_id is not None:
        conf["group.id"] = group_id
    return Consumer(_with_log(conf, log))


def producer(connection: KafkaConnection | Mapping[str, Any], properties: Mapping[str, Any] | None = None, *,
             log: ClientLog | None = None, on_delivery: Callable[[Any, Any], None] | None = None,
             bootstrap_servers: str | None = None) -> Producer:
    """A Producer of ``connection`` plus ``properties``; ``on_delivery`` is its delivery report callback.
    Consumer-only properties of the connection are left out."""
    conf = client_config(connection, bootstrap_servers=bootstrap_servers)
    conf = _without(conf, consumer_only(_scalars(conf)))
    conf.update(properties or {})
    if on_delivery is not None:
        conf["on_delivery"] = on_delivery
    return Producer(_with_log(conf, log))


def _scalars(conf: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """The librdkafka properties of a configuration (not confluent-kafka's callbacks and objects)."""
    return {k: v for k, v in conf.items() if isinstance(v, str | int | float | bool)}


def produce_blocking(
    p: Producer, topic: str, value: bytes | None, key: bytes | None = None, *, partition: int | None = None,
    headers: Sequence[tuple[str, bytes]] | None = None, timeout: float = 10.0,
) -> None:
    """``p.produce(...)``, waiting (serving delivery reports) while librdkafka's queue is full, for at most
    ``timeout`` seconds; then the ``BufferError`` is raised. For callers that may block: never the publisher."""
    kwargs: dict[str, Any] = {}
    if partition is not None:
        kwargs["partition"] = partition
    if headers is not None:
        kwargs["headers"] = list(headers)
    deadline = time.monotonic() + timeout
    while True:
        try:
            p.produce(topic, value, key, **kwargs)
            return
        except BufferError:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise
            p.poll(min(0.05, remaining))
