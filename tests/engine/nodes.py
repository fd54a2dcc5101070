"""Helpers of the tests of single node processes (engine/network/server.py) over TCP: the node shape, keys of a
vbucket, draining a remote DCP producer, waiting for a condition. The ``spawn`` fixture is in
tests/engine/conftest.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine import vbucket_of
from engine.network.remote import RemoteDcpProducer

#: vbuckets of a node started by ``spawn``
NVB = 4
#: engine settings of a node started by ``spawn`` (small checkpoints and backfill chunks: many snapshots)
CFG: dict[str, Any] = {"checkpoint_max_items": 3, "backfill_chunk_items": 2, "seed": 11}


def keys_on(vb: int, n: int, prefix: str = "k") -> list[str]:
    out: list[str] = []
    i = 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if vbucket_of(k.encode(), NVB) == vb:
            out.append(k)
        i += 1
    return out


def drain(p: RemoteDcpProducer, until: Callable[[list[Any]], bool], timeout: float = 10.0) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"timed out with {got[-5:]}"
        msgs = p.step()
        got.extend(msgs)
        p.buffer_acknowledge(sum(m.dcp_size for m in msgs))
    return got


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
