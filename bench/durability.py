"""Synchronous replication benchmark: ``python -m bench.durability [--docs N] [--window W] [--vbuckets V]``.

Seed 004 proof 4: sync-write latency per durability level against plain writes, in one run, on an in-process
cluster of 3 nodes with 1 replica driven by the pump loop (``Cluster.pump``: replication steps, every node
flushed, replicas' seqno-acks, timeouts). ``W`` sync writes are kept in flight (new ones submitted as others
complete); the latency of a sync write is from ``Cluster.submit`` to the pump round after which its handle
reports committed (what a client waiting for the response sees, at the pump loop's granularity). The plain
write latency is ``Cluster.write`` returning (the write acknowledged in the active's memory only).

Figures in microseconds (baseline of each: the same percentile of plain writes in the same run; lower is
better):
* ``durability.majority_p50`` / ``_p99``
* ``durability.majority_and_persist_to_active_p50`` / ``_p99``
* ``durability.persist_to_majority_p50`` / ``_p99``
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from collections import deque
from pathlib import Path

from bench.report import figure
from engine.cluster import Cluster
from engine.durability import Durability, Level, SyncWrite

#: targets (µs): an in-memory majority within a few pump rounds; persistence adds SQLite commits
TARGETS = {Level.MAJORITY: (5000.0, 20000.0), Level.MAJORITY_AND_PERSIST_TO_ACTIVE: (10000.0, 40000.0),
           Level.PERSIST_TO_MAJORITY: (15000.0, 60000.0)}


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def plain_latencies(cluster: Cluster, n: int, value: bytes, tag: str) -> list[float]:
    clock = time.perf_counter
    lat: list[float] = []
    for i in range(n):
        t0 = clock()
        cluster.write(f"{tag}-{i}", value)
        lat.append((clock() - t0) * 1e6)
        if i % 64 == 63:
            cluster.pump(rounds=1)
    cluster.settle()
    return lat


def sync_latencies(cluster: Cluster, level: Level, n: int, window: int, value: bytes, tag: str) -> list[float]:
    clock = time.perf_counter
    lat: list[float] = []
    outstanding: deque[tuple[SyncWrite, float]] = deque()
    d = Durability(level)
    i = 0
    while len(lat) < n:
        while i < n and len(outstanding) < window:
            t0 = clock()
            outstanding.append((cluster.submit(f"{tag}-{i}", value, durability=d), t0))
            i += 1
        cluster.pump(rounds=1)
        now = clock()
        still: deque[tuple[SyncWrite, float]] = deque()
        for sw, t0 in outstanding:
            if sw.done:
                sw.result()  # raises if it did not commit
                lat.append((now - t0) * 1e6)
            else:
                still.append((sw, t0))
        outstanding = still
    cluster.settle()
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=2000, help="writes per level")
    ap.add_argument("--window", type=int, default=16, help="sync writes in flight")
    ap.add_argument("--vbuckets", type=int, default=64)
    args = ap.parse_args()
    value = b'{"name": "' + b"x" * 244 + b'"}'
    with tempfile.TemporaryDirectory(prefix="bench-dur-") as tmp:
        cluster = Cluster.create(Path(tmp) / uuid.uuid4().hex[:6], nodes=3, replicas=1,
                                 num_vbuckets=args.vbuckets, seed=None)
        try:
            plain = plain_latencies(cluster, args.docs, value, "plain")
            results = {lv: sync_latencies(cluster, lv, args.docs, args.window, value, f"l{int(lv)}")
                       for lv in (Level.MAJORITY, Level.MAJORITY_AND_PERSIST_TO_ACTIVE, Level.PERSIST_TO_MAJORITY)}
        finally:
            cluster.close()
    for lv, lat in results.items():
        name = lv.name.lower()
        t50, t99 = TARGETS[lv]
        figure(f"durability.{name}_p50", percentile(lat, 0.5), "us", percentile(plain, 0.5), t50, "lower")
        figure(f"durability.{name}_p99", percentile(lat, 0.99), "us", percentile(plain, 0.99), t99, "lower")


if __name__ == "__main__":
    main()
