"""Latency benchmark: ``python -m bench.latency [--docs N] [--vbuckets V] [--cluster-rate W]``.

Issue 17 "Latency": the steady-state lag from a write's acknowledgement to the Kafka delivery report of its
record, at **half the maximum ingest rate**, with rollback mitigation on (the default), single node; and the
cluster figure.

Single node (one process, the service's loop order, gateway/service.py ``_pump_loop``): an engine bucket and a
gateway publisher on the broker the product would use (KAFKA_BOOTSTRAP_SERVERS, else the embedded Tansu) with
the product's producer settings.

1. *Saturation*: writes in batches of 1000 as fast as the loop takes them, each batch followed by one
   ``Publisher.pump()`` (with mitigation: flush to SQLite, DCP step, encode, produce) and a delivery-report
   poll, for N documents; the sustained ingest rate is N / (time until the last record is acknowledged).
2. *Steady state* at half that rate: writes arrive every 1 ms tick (``rate / 1000`` per tick), the loop pumps
   between ticks; the latency of a write = from ``Bucket.set`` returning to the gateway's acknowledged position
   (the delivery report of the record ending its snapshot: ``Publisher.take_checkpoints``) passing its seqno.
   Run with mitigation on (the figure), with mitigation off, and -- the baseline -- the raw confluent-kafka
   producer sending one record per write (same size, 11 headers, same producer settings, same partitions) at the
   same rate, latency from ``produce`` to its delivery report: the floor the broker sets. Alternating, two
   rounds each, in the order raw, off, on, on, off, raw (the embedded broker slows down per request as runs go
   by, so no side always runs last), each run on a topic of its own that is deleted after it.

The info line adds ``max_ingest_mid_run`` (the saturation run's acknowledgement rate between its 10th and 90th
percentile of acknowledgement times: without the start and the drain), the raw producer's records per
ProduceRequest (librdkafka statistics) and, with the embedded broker, its CPU milliseconds per ProduceRequest
during the raw runs -- what sets the floor (docs/performance.md "Latency").

The cluster figure: the same steady-state loop on three in-process nodes with one replica
(``bench.cluster.run``: mitigation waits for the replica and both flushes), at ``--cluster-rate``.

Figures:
* ``gateway.lag_p50_ms``          median write -> delivery, mitigation on, single node (baseline: the raw producer)
* ``gateway.lag_p99_ms``          99th percentile, the same (target: < 100 ms)
* ``gateway.lag_unpersisted_p50_ms`` / ``_p99_ms``  mitigation off (baseline: the raw producer), information
* ``gateway.cluster_lag_p50_ms``  median, 3 nodes / 1 replica, mitigation on (baseline: off), information
* ``gateway.cluster_lag_p99_ms``  99th percentile, the same, information
* ``gateway.max_ingest``          the saturation rate the steady state halves (information)

``series()`` also returns the per-100-ms time series (acknowledged docs/s, RSS, latency percentiles) that
``python -m bench.report`` draws.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.processes import cpu_seconds

NVB = 1024
VALUE = b'{"name": "' + b"x" * 244 + b'"}'
TICK_S = 0.001
SAMPLE_S = 0.1


def _rss_mib() -> float:
    """Current resident set size of this process (MiB), from /proc (peak RSS never goes down)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / (1 << 20)


@dataclass
class Series:
    """One run's samples every SAMPLE_S: time since start (s), acknowledged docs/s in the interval, RSS MiB,
    and the write -> delivery latencies (ms) completed in the interval."""

    t: list[float] = field(default_factory=list)
    docs_per_s: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    latencies_ms: list[list[float]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"t": self.t, "docs_per_s": self.docs_per_s, "rss_mib": self.rss_mib,
                "latencies_ms": self.latencies_ms}


@dataclass
class Run:
    rate: float  # documents acknowledged per second over the run
    latencies_ms: list[float]
    series: Series
    #: documents acknowledged per second between the 10th and the 90th percentile of acknowledgement times
    #: (the saturation run's rate without its start and its drain; None when not measured, or when a short run's
    #: acknowledgements all came in one delivery report batch)
    mid_rate: float | None = None
    #: the raw producer's ProduceRequests over the run (librdkafka statistics; 0 when not counted)
    produce_requests: int = 0


class _Gateway:
    """A bucket and its publisher, driven the way the service's pump loop drives them."""

    def __init__(self, conf: dict[str, Any], client: dict[str, Any], base: Path, nvb: int,
                 mitigation: bool) -> None:
        from engine import Bucket, BucketConfig
        from gateway.publisher import Publisher
        from gateway.resume import PublishPosition, ensure_topics
        from schemas.codec import RecordEncoder
        from schemas.records import ValueFormat

        self.bucket = Bucket(BucketConfig(data_dir=base / f"lat-{uuid.uuid4().hex[:6]}", num_vbuckets=nvb))
        self.client = client
        self.topic = topic = f"bench-lat-{uuid.uuid4().hex[:8]}"
        parts = ensure_topics(client, topic, nvb)
        self.pub = Publisher(self.bucket, conf, topic, parts, RecordEncoder(ValueFormat.AVRO),
                             {vb: PublishPosition(vb) for vb in range(nvb)}, rollback_mitigation=mitigation)
        self.pub.open()
        self.mitigation = mitigation
        while self.pub.inflight:  # warm up: the failover-log records delivered (leaders known)
            self.pub.pump()
            self.pub.kafka.poll(0.01)
        self.pending: dict[int, deque[tuple[int, float]]] = {vb: deque() for vb in range(nvb)}

    def write(self, i: int, now: float) -> None:
        r = self.bucket.set(f"user::{i:010d}".encode(), VALUE)
        self.pending[r.vbucket].append((r.seqno, now))

    def step(self, done: list[float], clock: Any, acked_at: list[float] | None = None) -> int:
        """One loop round; appends the latencies of the writes it saw acknowledged (and, with ``acked_at``,
        the time of each acknowledgement); returns DCP messages."""
        n = self.pub.pump()
        if not n:
            self.pub.kafka.poll(0.0002)
        acked = self.pub.take_checkpoints()
        if acked:
            t = clock()
            for vb, pos in acked.items():
                q = self.pending[vb]
                while q and q[0][0] <= pos.seqno:
                    done.append((t - q.popleft()[1]) * 1000.0)
                    if acked_at is not None:
                        acked_at.append(t)
        return n

    def idle(self) -> bool:
        return self.pub.inflight == 0 and not (self.mitigation and self.bucket.dirty_vbuckets)

    def close(self) -> None:
        self.pub.close()
        self.bucket.close(clean=False)
        drop_topic(self.client, self.topic)


def drop_topic(client: dict[str, Any], topic: str) -> None:
    """Delete a run's topic, so the next run does not share the broker with its partitions and records (the
    embedded Tansu's cost per produce request grows with what it holds: docs/performance.md "Latency")."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(client)
    for fut in admin.delete_topics([topic], operation_timeout=10).values():
        # a broker that cannot delete topics: the run's figures stand, the topic stays
        with contextlib.suppress(Exception):
            fut.result(15)


def _sampler(series: Series, clock: Any, t0: float) -> Any:
    state: dict[str, Any] = {"next": t0 + SAMPLE_S, "count": 0, "lat": 0}

    def sample(done: list[float], force: bool = False) -> None:
        now = clock()
        if now < state["next"] and not force:
            return
        span = max(1e-9, now - (state["next"] - SAMPLE_S))
        series.t.append(round(now - t0, 3))
        series.docs_per_s.append(round((len(done) - state["count"]) / span, 1))
        series.rss_mib.append(round(_rss_mib(), 1))
        series.latencies_ms.append([round(x, 3) for x in done[state["lat"]:]])
        state["count"] = state["lat"] = len(done)
        state["next"] = now + SAMPLE_S

    return sample


def saturated(conf: dict[str, Any], client: dict[str, Any], base: Path, n: int, nvb: int = NVB,
              mitigation: bool = True) -> Run:
    """Writes as fast as the loop takes them; the sustained ingest rate (write -> acknowledged)."""
    g = _Gateway(conf, client, base, nvb, mitigation)
    clock = time.perf_counter
    done: list[float] = []
    series = Series()
    t0 = clock()
    sample = _sampler(series, clock, t0)
    written = 0
    acked_at: list[float] = []
    while written < n or len(done) < n or not g.idle():
        if written < n:
            now = clock()
            for _ in range(min(1000, n - written)):
                g.write(written, now)
                written += 1
        g.step(done, clock, acked_at)
        sample(done)
    el = clock() - t0
    sample(done, force=True)
    g.close()
    lo, hi = pct(acked_at, 10), pct(acked_at, 90)
    return Run(n / el, done, series, 0.8 * n / (hi - lo) if hi > lo else None)


def bulk(conf: dict[str, Any], client: dict[str, Any], base: Path, n: int, nvb: int = NVB,
         mitigation: bool = True) -> Run:
    """``bench.gateway``'s publish run, sampled: N documents already in the engine, published until the last
    one is acknowledged (throughput and RSS over time for ``bench.report``)."""
    g = _Gateway(conf, client, base, nvb, mitigation)
    for i in range(n):
        g.write(i, 0.0)
    clock = time.perf_counter
    done: list[float] = []
    series = Series()
    t0 = clock()
    sample = _sampler(series, clock, t0)
    while len(done) < n or not g.idle():
        g.step(done, clock)
        sample(done)
    el = clock() - t0
    sample(done, force=True)
    g.close()
    return Run(n / el, [], series)


def _paced(n: int, rate: float, write: Callable[[int, float], None], step: Callable[[], object], done: list[float],
           what: str) -> Run:
    """Drive N writes at ``rate``/s: before every loop round the writes due by the clock, then ``step()`` (one
    round of the side measured), until ``done`` holds N latencies."""
    clock = time.perf_counter
    series = Series()
    t0 = clock()
    sample = _sampler(series, clock, t0)
    deadline = t0 + n / rate + 120
    written = 0
    while len(done) < n:
        now = clock()
        if now > deadline:
            raise SystemExit(f"{what}: only {len(done)}/{n} writes delivered in time")
        due = min(n, int((now - t0) * rate))
        while written < due:
            write(written, now)
            written += 1
        step()
        sample(done)
    el = clock() - t0
    sample(done, force=True)
    return Run(n / el, done, series)


def steady(conf: dict[str, Any], client: dict[str, Any], base: Path, n: int, rate: float, nvb: int = NVB,
           mitigation: bool = True) -> Run:
    """N writes at ``rate``/s, the gateway's loop pumping between them."""
    g = _Gateway(conf, client, base, nvb, mitigation)
    done: list[float] = []
    try:
        return _paced(n, rate, g.write, lambda: g.step(done, time.perf_counter), done,
                      f"gateway (mitigation={mitigation})")
    finally:
        g.close()


def raw_steady(conf: dict[str, Any], client: dict[str, Any], n: int, rate: float, nvb: int = NVB) -> Run:
    """The raw producer at ``rate``: one record per write, round-robin over the partitions; produce -> delivery."""
    from confluent_kafka import Producer

    from gateway.resume import ensure_topics

    topic = f"bench-lat-raw-{uuid.uuid4().hex[:8]}"
    ensure_topics(client, topic, nvb)
    clock = time.perf_counter
    done: list[float] = []
    headers: list[tuple[str, str | bytes | None]] = [(f"dcp.h{i}", b"1234567890") for i in range(11)]
    sent: dict[bytes, float] = {}

    def delivered(err: Any, msg: Any) -> None:
        if err is None:
            done.append((clock() - sent.pop(msg.key())) * 1000.0)

    def stats(js: str) -> None:
        brokers = json.loads(js).get("brokers", {}).values()
        requests[0] = sum(b.get("req", {}).get("Produce", 0) for b in brokers)

    requests = [0]
    p = Producer({**conf, "on_delivery": delivered, "statistics.interval.ms": 200, "stats_cb": stats})

    def write(i: int, now: float) -> None:
        key = b"user::%010d" % i
        sent[key] = now
        p.produce(topic, VALUE, key, partition=i % nvb, headers=headers)

    try:
        run = _paced(n, rate, write, lambda: p.poll(0.0002), done, "raw producer")
        time.sleep(0.3)  # one more statistics report: the produce requests of the whole run
        p.poll(0)
        run.produce_requests = requests[0]
        return run
    finally:
        p.flush(10)
        drop_topic(client, topic)


def broker_cpu_s(broker: Any) -> float | None:
    """CPU seconds the embedded broker's process used so far (None: not a local process we started)."""
    pid = getattr(broker, "pid", None)
    if pid is None or not os.path.exists(f"/proc/{pid}"):
        return None
    return cpu_seconds(pid)


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100.0 * len(s)))] if s else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=50_000,
                    help="documents of the saturation run and of each steady-state run")
    ap.add_argument("--vbuckets", type=int, default=NVB)
    ap.add_argument("--cluster-docs", type=int, default=5_000, help="writes per cluster run (0: skip)")
    ap.add_argument("--cluster-rate", type=int, default=1_000, help="cluster writes per second")
    args = ap.parse_args()
    if args.docs < 100 or args.vbuckets < 1 or args.cluster_docs < 0 or args.cluster_rate < 1:
        ap.error("--docs must be at least 100, --vbuckets and --cluster-rate at least 1")

    from bench.report import figure
    from gateway.broker import select_broker
    from gateway.config import load_settings

    with select_broker() as broker, tempfile.TemporaryDirectory() as td:
        settings = load_settings(None)
        conf = {**settings.producer_config(), "bootstrap.servers": broker.bootstrap_servers}
        client = {"bootstrap.servers": broker.bootstrap_servers}
        base = Path(td)
        sat = saturated(conf, client, base, args.docs, args.vbuckets)
        half = sat.rate / 2
        on: list[float] = []
        off: list[float] = []
        raw: list[float] = []
        raw_requests = 0
        raw_broker_cpu = 0.0

        def raw_round() -> None:
            nonlocal raw_requests, raw_broker_cpu
            c0 = broker_cpu_s(broker)
            r = raw_steady(conf, client, args.docs, half, args.vbuckets)
            c1 = broker_cpu_s(broker)
            raw.extend(r.latencies_ms)
            raw_requests += r.produce_requests
            if c0 is not None and c1 is not None:
                raw_broker_cpu += c1 - c0

        sides: list[Callable[[], object]] = [
            raw_round,
            lambda: off.extend(steady(conf, client, base, args.docs, half, args.vbuckets,
                                      mitigation=False).latencies_ms),
            lambda: on.extend(steady(conf, client, base, args.docs, half, args.vbuckets,
                                     mitigation=True).latencies_ms),
        ]
        # Alternate, so machine noise hits every side alike, in the order raw, off, on then on, off, raw: a
        # long-lived broker gets slower per request as runs go by (docs/performance.md "Latency"), so no
        # side may always run last.
        for side in sides + sides[::-1]:
            side()
        figure("gateway.max_ingest", sat.rate, "docs/s", sat.rate, None, "higher")
        figure("gateway.lag_p50_ms", pct(on, 50), "ms", pct(raw, 50), None, "lower")
        figure("gateway.lag_p99_ms", pct(on, 99), "ms", pct(raw, 99), 100.0, "lower")
        figure("gateway.lag_unpersisted_p50_ms", pct(off, 50), "ms", pct(raw, 50), None, "lower")
        figure("gateway.lag_unpersisted_p99_ms", pct(off, 99), "ms", pct(raw, 99), None, "lower")
        if args.cluster_docs:
            from bench.cluster import run as cluster_run

            con: list[float] = []
            coff: list[float] = []
            for _round in range(2):
                coff += cluster_run(conf, client, args.cluster_docs, args.cluster_rate, 64, base, False)
                con += cluster_run(conf, client, args.cluster_docs, args.cluster_rate, 64, base, True)
            figure("gateway.cluster_lag_p50_ms", pct(con, 50), "ms", pct(coff, 50), None, "lower")
            figure("gateway.cluster_lag_p99_ms", pct(con, 99), "ms", pct(coff, 99), None, "lower")
        print(json.dumps({"info": "latency", "docs": args.docs, "vbuckets": args.vbuckets,
                          "steady_rate": round(half, 1), "writes_per_mode": len(on),
                          "max_ingest_mid_run": None if sat.mid_rate is None else round(sat.mid_rate, 1),
                          "raw_records_per_produce_request": round(len(raw) / raw_requests, 2)
                          if raw_requests else None,
                          "broker_cpu_ms_per_produce_request": round(raw_broker_cpu * 1000 / raw_requests, 3)
                          if raw_requests and raw_broker_cpu else None,
                          "cluster": {"docs": args.cluster_docs, "rate": args.cluster_rate, "nodes": 3,
                                      "replicas": 1, "vbuckets": 64},
                          "linger_ms": conf.get("linger.ms")}), flush=True)


if __name__ == "__main__":
    main()
