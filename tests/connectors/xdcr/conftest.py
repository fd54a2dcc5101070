"""Fixtures of the XDCR tests: ``harness`` here is one source (an engine bucket published by the in-process
gateway, rollback mitigation off so that tests can make the source roll back) -- not the suite-wide factory of
tests/conftest.py -- and ``target`` one target node process (tests/connectors/xdcr/harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.broker import Broker
from tests.connectors.xdcr.harness import target_node
from tests.harness import Harness


@pytest.fixture
def harness(kafka_broker: Broker, tmp_path: Path) -> Iterator[Harness]:
    h = Harness(kafka_broker, tmp_path / "h", rollback_mitigation=False)
    yield h
    h.close()


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Any]:
    node = target_node(tmp_path)
    yield node
    node.kill()
