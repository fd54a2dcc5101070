"""Spark source benchmark: ``python -m bench.spark [--docs N] [--vbuckets V]`` (needs the ``spark`` extra).

Publishes N documents (256-byte JSON) from the engine into Kafka with the in-process gateway (on
KAFKA_BOOTSTRAP_SERVERS, else the embedded Tansu), then, in the same run and the same SparkSession (local[2]):

* ``spark.source``: rows/s of ``spark.read.format("dcp")...load().count()`` -- boundary scan on the driver,
  replay + decode + Arrow batches on the executors; the second of two reads (the first, reported as
  ``cold_rows_per_s``, also starts Spark's Python workers);
* baseline: a raw confluent-kafka consumer reading the same topic to its end into a pandas DataFrame (key, value,
  partition, offset), turned into a Spark DataFrame and counted.
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
from engine import Bucket, BucketConfig
from gateway.broker import select_broker
from gateway.config import load_settings
from gateway.publisher import Publisher
from gateway.resume import PublishPosition, ensure_topics
from schemas.codec import RecordEncoder
from schemas.records import ValueFormat


def publish(conf: dict[str, Any], client: dict[str, Any], n: int, nvb: int, tmp: Path) -> str:
    b = Bucket(BucketConfig(data_dir=tmp / "engine", num_vbuckets=nvb, checkpoint_quota_bytes=2 << 30))
    topic = f"bench-spark-{uuid.uuid4().hex[:8]}"
    parts = ensure_topics(client, topic, nvb)
    pub = Publisher(b, conf, topic, parts, RecordEncoder(ValueFormat.AVRO),
                    {vb: PublishPosition(vb) for vb in range(nvb)})
    pub.open()
    value = b'{"name": "' + b"x" * 244 + b'"}'
    for i in range(n):
        b.set(f"user::{i:010d}".encode(), value)
    while True:
        if not pub.pump():
            if pub.inflight == 0 and not b.dirty_vbuckets:
                break
            pub.kafka.poll(0.005)
    pub.close()
    b.close(clean=False)
    return topic


def raw_read(spark: Any, bootstrap: str, topic: str, parts: int) -> int:
    import pandas as pd

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"b-{uuid.uuid4()}", "enable.auto.commit": False,
                  "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    cols: dict[str, list[Any]] = {"key": [], "value": [], "partition": [], "offset": []}
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(parts)])
        pending = set(range(parts))
        while pending:
            msgs = c.consume(10_000, 0)  # what is fetched, without waiting for a full batch
            if not msgs:
                first = c.poll(0.5)
                msgs = [first, *c.consume(9_999, 0)] if first is not None else []
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(m.partition())
                    continue
                cols["key"].append(m.key())
                cols["value"].append(m.value())
                cols["partition"].append(m.partition())
                cols["offset"].append(m.offset())
    finally:
        c.close()
    df = spark.createDataFrame(pd.DataFrame(cols), "key binary, value binary, partition int, offset bigint")
    return int(df.count())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--vbuckets", type=int, default=64)
    args = ap.parse_args()
    from pyspark.sql import SparkSession

    from connectors.spark import DcpDataSource

    spark = (SparkSession.builder.master("local[2]").appName("bench-spark")
             .config("spark.sql.shuffle.partitions", "2").config("spark.ui.enabled", "false")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(DcpDataSource)
    with select_broker() as broker, tempfile.TemporaryDirectory() as td:
        settings = load_settings(None)
        conf = {**settings.producer_config(), "bootstrap.servers": broker.bootstrap_servers}
        client = {"bootstrap.servers": broker.bootstrap_servers}
        topic = publish(conf, client, args.docs, args.vbuckets, Path(td))
        def dcp_count() -> tuple[int, float]:
            t = time.perf_counter()
            n = (spark.read.format("dcp").option("bootstrap.servers", broker.bootstrap_servers)
                 .option("topic", topic).load().count())
            return n, n / (time.perf_counter() - t)

        # the first read also starts the Python workers and imports (reported as info); the figure is warm
        _rows, cold = dcp_count()
        rows, dcp = dcp_count()
        assert rows == args.docs, (rows, args.docs)
        t = time.perf_counter()
        records = raw_read(spark, broker.bootstrap_servers, topic, args.vbuckets)
        base = records / (time.perf_counter() - t)
        figure("spark.source", dcp, "rows/s", base, 0.5, "higher")
        print(json.dumps({"info": "spark.source", "rows": rows, "kafka_records": records, "cold_rows_per_s":
                          round(cold, 1),
                          "vbuckets": args.vbuckets}), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
