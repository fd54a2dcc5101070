"""The gateway's Kafka layer: the one place that builds producers, consumers and admin clients.

- :mod:`gateway.kafka.clients`: :func:`producer`, :func:`consumer`, :func:`admin_client` (with the rate-limited
  client log attached) and :func:`produce_blocking` (bounded ``BufferError`` retry for callers that may wait);
- :mod:`gateway.kafka.client_log`: librdkafka's log lines and client errors, rate-limited;
- :mod:`gateway.kafka.properties`: librdkafka properties checked by the installed librdkafka itself.
"""

from gateway.kafka.client_log import ClientLog, with_client_log
from gateway.kafka.clients import (
    admin_client,
    client_config,
    consumer,
    default_client_log,
    produce_blocking,
    producer,
)

__all__ = [
    "ClientLog",
    "admin_client",
    "client_config",
    "consumer",
    "default_client_log",
    "produce_blocking",
    "producer",
    "with_client_log",
]
