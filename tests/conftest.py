"""Fixtures shared by the whole suite.

``kafka_broker`` is the Kafka-protocol broker of the test session, chosen by gateway.broker.select_broker:
``KAFKA_BOOTSTRAP_SERVERS`` if set, else a testcontainers Kafka when a Docker engine answers, else the
embedded Tansu broker. Under pytest-xdist each worker process gets its own (session scope is per process).
Nothing is skipped: if no broker can be started the tests that need one fail.
"""

from __future__ import annotations

import os
import resource
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from gateway.broker import Broker, select_broker
from gateway.exceptions import BrokerError
from tests.credentials import ADMIN_PASSWORD, ADMIN_PASSWORD_ENV
from tests.harness import Harness, harnesses

# Authentication is on in every test: services and `dcpgw up` processes create the user Administrator with this
# password, and the tests' HTTP clients send it (tests/credentials.py, docs/security.md).
os.environ[ADMIN_PASSWORD_ENV] = ADMIN_PASSWORD
# Every gateway a test starts picks a free KV port (docs/kv-protocol.md): the default 11210 would collide
# between tests and with other processes on the machine.
os.environ.setdefault("DCPGW_KV_PORT", "0")
# Every JVM a test starts (the shared SparkSession of tests/connectors/conftest.py, a Spark job's command run as a
# process) lives for seconds to minutes: C1 compilation only and the serial collector. On 2 cores the C2 compiler
# and the parallel collector's threads cost more CPU than they give back in a run that short (measured: a
# warm-up query and two more 66 -> 47 CPU seconds). Speed only: the jobs' results do not depend on it.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
# A long-lived xdist worker runs hundreds of tests that each start brokers' clients, node processes and servers;
# librdkafka releases a client's sockets and pipes only when its handle is destroyed, so tests that abandon a
# consumer to simulate a crash hold some descriptors for a while. A soft limit of 1024 (common on CI machines)
# is then too tight: raise it to the hard limit (at most 65536) for this process and its children.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
_want = 65536 if _hard == resource.RLIM_INFINITY else min(_hard, 65536)
if _soft != resource.RLIM_INFINITY and _soft < _want:
    resource.setrlimit(resource.RLIMIT_NOFILE, (_want, _hard))


#: the per-test timeout of the Spark tests (the others: pyproject's 300 s). A timeout interrupts a py4j call and
#: leaves the worker's one shared SparkSession unusable, so every later Spark test fails too; on a machine loaded
#: by other jobs a Spark test can need more than 300 s (README "Tests").
SPARK_TEST_TIMEOUT_S = 900


def pytest_report_header() -> str:
    """Which engine build the processes of this run import (engine/compiled.py, docs/performance.md "Compiled
    modules"): a stale build makes every process warn on stderr, which fails the tests that read a CLI's stderr
    until the engine is compiled again."""
    from engine import compiled

    reason = compiled.source_reason()
    if reason is None:
        return "engine build: compiled"
    hint = " -- tests reading a process's stderr will fail: pip install -e ." if "changed after" in reason else ""
    return f"engine build: source ({reason}){hint}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # Every test using the broker carries the `kafka` marker, so `-m "not kafka"` deselects them all.
        if "kafka_broker" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kafka)
        if item.get_closest_marker("spark") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SPARK_TEST_TIMEOUT_S))


def pytest_runtest_setup(item: pytest.Item) -> None:
    # `--dist loadgroup` keeps the xdist_group("spark") tests on one worker (one Spark JVM) only if pytest-xdist
    # could tag their node ids with "@spark"; pytest 9.2 stores node ids where pytest-xdist 3.8 no longer sets
    # them, and the group was silently spread over the workers (two JVMs at once, order-dependent failures).
    if (item.config.getoption("loadgroup", default=False) and item.get_closest_marker("xdist_group") is not None
            and "@" not in item.nodeid):
        pytest.fail(f"--dist loadgroup is not applied (pytest {pytest.__version__} with pytest-xdist): this test "
                    "lost its xdist_group; install the dev extra's pytest (pip install -e '.[dev,spark]')",
                    pytrace=False)


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[Broker]:
    try:
        broker = select_broker()
    except BrokerError as exc:
        pytest.fail(f"no Kafka-protocol broker could be selected: {exc}", pytrace=False)
    try:
        broker.start()
        # An external broker's start() is a no-op: prove it answers before any test relies on it.
        AdminClient(broker.client_config()).list_topics(timeout=30)
    except (BrokerError, KafkaException) as exc:
        broker.stop()
        pytest.fail(f"no Kafka-protocol broker could be started ({broker!r}): {exc}", pytrace=False)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def harness(kafka_broker: Broker, tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    """``harness(**publisher_options)``: an engine bucket published by the in-process gateway into a fresh
    topic (tests/harness.py); everything is closed after the test."""
    with harnesses(kafka_broker, tmp_path, Harness) as make:
        yield make


@pytest.fixture
def make_topic(kafka_broker: Broker) -> Callable[..., str]:
    """Create a fresh, uniquely named topic: ``make_topic(partitions=4)`` returns its name."""
    admin = AdminClient(kafka_broker.client_config())

    def create(partitions: int = 1, prefix: str = "test") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
        for future in futures.values():
            future.result(timeout=30)
        return name

    return create
