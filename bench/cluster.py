"""Cluster benchmark: ``python -m bench.cluster [--docs N] [--rate W] [--vbuckets V]``.

The latency cost of cluster-mode rollback mitigation (docs/gateway-cluster.md; the Couchbase Kafka connector's
"publish only what is persisted on the active and every replica"). Three in-process nodes, one replica, one
gateway publisher following the map, on the broker the product would use (KAFKA_BOOTSTRAP_SERVERS, else the
embedded Tansu) with the product's producer settings. Writes arrive at a steady rate W (batches every 10 ms);
the loop drives replication (``Cluster.pump``, which flushes every node) and the publisher exactly the same way
in both modes. Latency of a write = from ``Cluster.write`` returning to the gateway's acknowledged position
(Kafka delivery report of the record ending its snapshot) passing its seqno. Mitigation off and on alternate
(two rounds each) in the same run; the baseline of every figure is the same percentile without mitigation.

``--linger-ms 0`` takes the producer's batching delay out, so the mitigation's own cost shows.

Figures:
* ``cluster.latency_p50``  write -> Kafka delivery, median, mitigation on (baseline: mitigation off)
* ``cluster.latency_p99``  the same, 99th percentile
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from bench.report import figure
from engine.cluster.local import Cluster
from gateway.broker import select_broker
from gateway.config import load_settings
from gateway.publisher import Publisher
from gateway.resume import PublishPosition, ensure_topics
from schemas.codec import RecordEncoder
from schemas.records import ValueFormat

TICK_S = 0.01


def run(conf: dict[str, Any], client: dict[str, Any], n: int, rate: int, nvb: int, base: Path,
        mitigation: bool) -> list[float]:
    """One run: ``n`` writes at ``rate``/s; returns the write -> delivery latencies in milliseconds."""
    cluster = Cluster.create(base / f"c{uuid.uuid4().hex[:6]}", nodes=3, replicas=1, num_vbuckets=nvb, seed=None)
    topic = f"bench-cl-{uuid.uuid4().hex[:8]}"
    parts = ensure_topics(client, topic, nvb)
    pub = Publisher(cluster, conf, topic, parts, RecordEncoder(ValueFormat.AVRO),
                    {vb: PublishPosition(vb) for vb in range(nvb)}, rollback_mitigation=mitigation)
    pub.open()
    # warm up: the failover-log records delivered (producer connected, partition leaders known)
    while pub.inflight:
        pub.pump()
        pub.kafka.poll(0.01)
    value = b'{"name": "' + b"x" * 244 + b'"}'
    pending: dict[int, deque[tuple[int, float]]] = {vb: deque() for vb in range(nvb)}
    lat: list[float] = []
    per_tick = max(1, int(rate * TICK_S))
    written = 0
    clock = time.perf_counter
    t0 = clock()
    deadline = t0 + n / rate + 120
    while len(lat) < n:
        now = clock()
        if now > deadline:
            raise SystemExit(f"only {len(lat)}/{n} writes delivered in time (mitigation={mitigation})")
        due = min(n, int((now - t0) / TICK_S + 1) * per_tick)
        while written < due:
            res = cluster.write(f"user::{written:010d}", value)
            pending[res.vbucket].append((res.seqno, clock()))
            written += 1
        # the service's loop order (gateway/service.py): publisher first, then replication + every node
        # flushed -- the gateway sees a write before its replica does; identical in both modes
        pub.pump()
        cluster.pump(rounds=1, flush=True)
        pub.kafka.poll(0.0005)
        acked = pub.take_checkpoints()
        if acked:
            t = clock()
            for vb, pos in acked.items():
                q = pending[vb]
                while q and q[0][0] <= pos.seqno:
                    lat.append((t - q.popleft()[1]) * 1000.0)
    pub.close()
    cluster.close()
    return lat


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100.0 * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=10_000, help="writes per run (4 runs)")
    ap.add_argument("--rate", type=int, default=1_000, help="writes per second (below saturation)")
    ap.add_argument("--vbuckets", type=int, default=64)
    ap.add_argument("--linger-ms", type=int, default=None, help="override the producer's linger.ms "
                    "(default: the product setting, 20)")
    args = ap.parse_args()
    with select_broker() as broker, tempfile.TemporaryDirectory() as td:
        settings = load_settings(None)
        conf = {**settings.producer_config(), "bootstrap.servers": broker.bootstrap_servers}
        if args.linger_ms is not None:
            conf["linger.ms"] = args.linger_ms
        client = {"bootstrap.servers": broker.bootstrap_servers}
        off: list[float] = []
        on: list[float] = []
        for _round in range(2):  # alternate, so machine noise hits both modes alike
            off += run(conf, client, args.docs, args.rate, args.vbuckets, Path(td), False)
            on += run(conf, client, args.docs, args.rate, args.vbuckets, Path(td), True)
        figure("cluster.latency_p50", pct(on, 50), "ms", pct(off, 50), 3.0, "lower")
        figure("cluster.latency_p99", pct(on, 99), "ms", pct(off, 99), 3.0, "lower")
        print(json.dumps({"info": "cluster_latency", "writes_per_mode": len(on), "rate": args.rate,
                          "vbuckets": args.vbuckets, "nodes": 3, "replicas": 1,
                          "unmitigated_ms": {"p50": round(pct(off, 50), 2), "p99": round(pct(off, 99), 2)},
                          "mitigated_ms": {"p50": round(pct(on, 50), 2), "p99": round(pct(on, 99), 2)},
                          "linger_ms": conf.get("linger.ms")}), flush=True)


if __name__ == "__main__":
    main()
