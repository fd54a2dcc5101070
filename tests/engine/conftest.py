from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import Bucket, BucketConfig
from engine.cluster.local import Cluster
from engine.network.process_cluster import NodeProcess, ProcessCluster
from tests.engine.nodes import CFG as NODE_CFG
from tests.engine.nodes import NVB as NODE_NVB


class FakeClock:
    """A settable wall clock for expiry tests (the engine takes its clock as a parameter)."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_bucket(tmp_path: Path) -> Iterator[Callable[..., Bucket]]:
    opened: list[Bucket] = []

    def make(clock: Callable[[], float] | None = None, **overrides: Any) -> Bucket:
        cfg: dict[str, Any] = {"data_dir": tmp_path / "data", "num_vbuckets": 8, "seed": 7}
        cfg.update(overrides)
        b = Bucket(BucketConfig(**cfg), clock=clock) if clock else Bucket(BucketConfig(**cfg))
        opened.append(b)
        return b

    yield make
    for b in opened:
        if not b.closed:
            b.close(clean=False)


@pytest.fixture
def make_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """The one cluster factory: ``make_cluster(**options)`` opens a cluster under ``tmp_path``; every cluster
    is closed (uncleanly: SIGKILL for node processes) after the test, also when it failed.

    The test module chooses the kind and its defaults: ``CLUSTER = ProcessCluster`` for node processes
    (default: the in-process :class:`~engine.cluster.local.Cluster`), ``CLUSTER_DEFAULTS = {...}`` for the options
    every cluster of the module gets unless the call overrides them (default: ``seed=3``)."""
    kind = getattr(request.module, "CLUSTER", Cluster)
    defaults: dict[str, Any] = dict(getattr(request.module, "CLUSTER_DEFAULTS", {"seed": 3}))
    made: list[Any] = []

    def make(**kw: Any) -> Any:
        path = tmp_path / f"c{len(made)}"
        options = {**defaults, **kw}
        c = ProcessCluster.start(path, **options) if kind is ProcessCluster else Cluster.create(path, **options)
        made.append(c)
        return c

    yield make
    for c in made:
        if isinstance(c, ProcessCluster):
            c.close(clean=False)
        else:
            for node in c.nodes.values():
                if node.up:
                    assert node.bucket is not None
                    node.bucket.close(clean=False)



@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """``spawn(name="n0", **engine_settings)``: a started node process of ``tests.engine.nodes.NVB`` vbuckets
    with ``tests.engine.nodes.CFG`` under ``tmp_path / name``; every one is killed after the test."""
    started: list[NodeProcess] = []

    def make(name: str = "n0", **cfg: Any) -> NodeProcess:
        node = NodeProcess(name, tmp_path / name, NODE_NVB, {**NODE_CFG, **cfg})
        started.append(node)
        node.start()
        return node

    yield make
    for node in started:
        node.kill()
