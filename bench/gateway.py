"""Gateway benchmark: ``python -m bench.gateway [--docs N]``.

Publishes N documents (256-byte JSON, 1024 vbuckets) from the engine into Kafka through the gateway, on the
broker the product would use (KAFKA_BOOTSTRAP_SERVERS, else the embedded Tansu), and compares with the raw
confluent-kafka producer sending the same number of records of the same size, with the same producer settings
and the same 11 headers, to a topic with the same partitions, in the same run.

Figures:
* ``gateway.publish``            items/s DCP -> Kafka (acknowledged), rollback mitigation on (the default): the
                                 engine holds N unpublished documents; timed from the first pump to the last ack
* ``gateway.publish_unpersisted`` the same with mitigation off (publishing from memory)
* ``gateway.rss``                peak RSS of the run in MiB (informational)
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from bench.report import figure
from engine import Bucket, BucketConfig
from gateway.broker import select_broker
from gateway.config import load_settings
from gateway.publisher import Publisher
from gateway.resume import PublishPosition, ensure_topics
from schemas.codec import RecordEncoder
from schemas.records import ValueFormat

NVB = 1024


def raw_baseline(conf: dict[str, Any], client: dict[str, Any], n: int, value: bytes) -> float:
    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    ensure_topics(client, topic, NVB)
    delivered = 0

    def cb(err: Any, msg: Any) -> None:
        nonlocal delivered
        if err is None:
            delivered += 1

    p = Producer({**conf, "on_delivery": cb})
    headers: list[tuple[str, str | bytes | None]] = [(f"dcp.h{i}", b"1234567890") for i in range(11)]
    t = time.perf_counter()
    for i in range(n):
        key = f"user::{i:010d}".encode()
        while True:
            try:
                p.produce(topic, value, key, partition=i % NVB, headers=headers)
                break
            except BufferError:
                p.poll(0.05)
        if i % 1000 == 0:
            p.poll(0)
    p.flush(120)
    el = time.perf_counter() - t
    assert delivered == n, (delivered, n)
    return n / el


def gateway_run(conf: dict[str, Any], client: dict[str, Any], n: int, value: bytes, tmp: Path,
                mitigation: bool) -> float:
    b = Bucket(BucketConfig(data_dir=tmp / f"g{mitigation}", num_vbuckets=NVB, checkpoint_quota_bytes=2 << 30))
    topic = f"bench-gw-{uuid.uuid4().hex[:8]}"
    parts = ensure_topics(client, topic, NVB)
    pub = Publisher(b, conf, topic, parts, RecordEncoder(ValueFormat.AVRO),
                    {vb: PublishPosition(vb) for vb in range(NVB)}, rollback_mitigation=mitigation)
    pub.open()
    for i in range(n):
        b.set(f"user::{i:010d}".encode(), value)
    # Timed: everything from the engine's checkpoints (and, with mitigation, the flush to disk) through DCP,
    # encoding and produce, until Kafka acknowledged the last record.
    t = time.perf_counter()
    while True:
        moved = pub.pump()
        if not moved:
            if pub.inflight == 0 and not (mitigation and b.dirty_vbuckets):
                break
            pub.kafka.poll(0.005)
    el = time.perf_counter() - t
    pub.close()
    b.close(clean=False)
    return n / el


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=200_000)
    args = ap.parse_args()
    n = args.docs
    value = b'{"name": "' + b"x" * 244 + b'"}'
    with select_broker() as broker, tempfile.TemporaryDirectory() as td:
        settings = load_settings(None)
        conf = {**settings.producer_config(), "bootstrap.servers": broker.bootstrap_servers}
        client = {"bootstrap.servers": broker.bootstrap_servers}
        base = raw_baseline(conf, client, n, value)
        on = gateway_run(conf, client, n, value, Path(td), True)
        figure("gateway.publish", on, "items/s", base, 0.3, "higher")
        off = gateway_run(conf, client, n, value, Path(td), False)
        figure("gateway.publish_unpersisted", off, "items/s", base, 0.3, "higher")
        print(json.dumps({"info": "producer_config", "settings": {k: v for k, v in conf.items()
                                                                  if "password" not in k}}), flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figure("gateway.rss", rss, "MiB", n * 280 / 2**20, None, "lower")


if __name__ == "__main__":
    main()
