from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.network.kv.harness import KVNode, RawClient


@pytest.fixture
def node(tmp_path: Path) -> Iterator[KVNode]:
    n = KVNode(tmp_path / "data", durability_timeout_floor_ms=0)
    yield n
    n.close()


@pytest.fixture
def connect(node: KVNode) -> Iterator[Callable[..., RawClient]]:
    opened: list[RawClient] = []

    def make(**kw: Any) -> RawClient:
        c = RawClient(node.port, **kw)
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.close()
