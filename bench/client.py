"""Client benchmark: ``python -m bench.client [--docs N]``.

Publishes N documents (256-byte JSON, 1024 vbuckets) with the in-process gateway publisher to a topic on the
broker the product would use (gateway.broker.select_broker), then measures, in the same run:

* ``client.throughput``  records/s through the rollback-aware client (connectors.client): decode + per-vbucket
  snapshot buffering + duplicate checks + SQLite state per confirmed snapshot, callback API, until caught up --
  vs a raw confluent-kafka Consumer reading the same partitions to EOF (no decoding) (target >= 0.7x);
  both readers run ``--rounds`` times, alternating, and each keeps its best round
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from bench.report import figure
from connectors.client.consumer import FETCH_DEFAULTS, ChangeStreamConsumer, RollbackInstruction
from connectors.client.replay import Snapshot
from engine import Bucket, BucketConfig
from gateway.broker import select_broker
from gateway.config import load_settings
from gateway.position import PublishPosition
from gateway.publisher import Publisher
from gateway.records import RecordEncoder, ValueFormat
from gateway.resume import ensure_topics

NVB = 1024


def publish(conf: dict[str, Any], client: dict[str, Any], n: int, tmp: Path) -> str:
    value = b'{"name": "' + b"x" * 244 + b'"}'
    b = Bucket(BucketConfig(data_dir=tmp / "engine", num_vbuckets=NVB, checkpoint_quota_bytes=2 << 30))
    topic = f"bench-client-{uuid.uuid4().hex[:8]}"
    parts = ensure_topics(client, topic, NVB)
    pub = Publisher(b, conf, topic, parts, RecordEncoder(ValueFormat.AVRO),
                    {vb: PublishPosition(vb) for vb in range(NVB)}, rollback_mitigation=False)
    pub.open()
    for i in range(n):
        b.set(f"user::{i:010d}".encode(), value)
    while True:
        if not pub.pump():
            if pub.inflight == 0:
                break
            pub.kafka.poll(0.005)
    pub.close()
    b.close(clean=False)
    return topic


def raw_consume(client: dict[str, Any], topic: str) -> tuple[float, int]:
    t = time.perf_counter()  # from nothing to caught up, as the client is timed
    # the client's fetch settings (FETCH_DEFAULTS), so the ratio measures the client's own work
    c = Consumer({**FETCH_DEFAULTS, **client, "group.id": f"bench-raw-{uuid.uuid4().hex}", "enable.auto.commit": False,
                  "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    parts = sorted(c.list_topics(topic, timeout=30).topics[topic].partitions)
    c.assign([TopicPartition(topic, p, 0) for p in parts])
    pending = set(parts)
    n = 0
    while pending:
        msgs = c.consume(2000, 0)  # what is fetched, without waiting for a full batch (as the client does)
        if not msgs:
            first = c.poll(0.2)
            msgs = [first, *c.consume(1999, 0)] if first is not None else []
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(m.partition())
                continue
            m.value()
            m.headers()
            n += 1
    el = time.perf_counter() - t
    c.close()
    return n / el, n


def client_consume(client: dict[str, Any], topic: str, tmp: Path) -> tuple[float, int, int]:
    changes = 0
    snapshots = 0

    def on_snapshot(s: Snapshot) -> None:
        nonlocal changes, snapshots
        changes += len(s.changes)
        snapshots += 1

    def on_rollback(r: RollbackInstruction) -> None:
        raise AssertionError("no rollback expected")

    t = time.perf_counter()
    with ChangeStreamConsumer(client, topic, state_path=tmp / f"state-{uuid.uuid4().hex[:6]}.sqlite") as c:
        c.run(on_snapshot, on_rollback, until_caught_up=True)
        records = c.records_consumed
    el = time.perf_counter() - t
    return records / el, records, changes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both readers; best of each")
    args = ap.parse_args()
    n = args.docs
    with select_broker() as broker, tempfile.TemporaryDirectory() as td:
        settings = load_settings(None)
        conf = {**settings.producer_config(), "bootstrap.servers": broker.bootstrap_servers}
        client = {"bootstrap.servers": broker.bootstrap_servers}
        topic = publish(conf, client, n, Path(td))
        # Alternate the two readers and keep each one's best round: on a shared 2-core machine one round
        # can be slowed by anything else running; the broker serves the same records every round.
        base = rate = 0.0
        for _ in range(args.rounds):
            b, raw_n = raw_consume(client, topic)
            r, records, changes = client_consume(client, topic, Path(td))
            assert records == raw_n, (records, raw_n)
            assert changes == n, (changes, n)
            base, rate = max(base, b), max(rate, r)
        figure("client.throughput", rate, "records/s", base, 0.7, "higher")
        print(json.dumps({"info": "client.records", "records": records, "changes": changes}), flush=True)


if __name__ == "__main__":
    main()
