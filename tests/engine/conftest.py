from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import Bucket, BucketConfig


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
