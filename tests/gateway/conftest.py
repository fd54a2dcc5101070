"""Fixtures of the gateway tests (the whole suite's are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.broker import Broker
from tests.harness import ClusterHarness, harnesses


@pytest.fixture
def cluster_harness(kafka_broker: Broker, tmp_path: Path) -> Iterator[Callable[..., ClusterHarness]]:
    """``cluster_harness(nodes=3, replicas=1, **publisher_options)``: an in-process cluster published by a gateway
    publisher following its map into a fresh topic (tests/harness.py); everything is closed after the test."""
    with harnesses(kafka_broker, tmp_path, ClusterHarness, prefix="c") as make:
        yield make
