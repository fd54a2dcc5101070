"""Client benchmark: ``python -m bench.client [--docs N]``.

Publishes N documents (256-byte JSON, 1024 vbuckets) with the in-process gateway publisher to a topic on the
broker the product would use (gateway.broker.select_broker), then measures, in the same run:

* ``client.throughput``  records/s through the rollback-aware client (connectors.client): decode + per-vbucket
  snapshot buffering + duplicate checks + SQLite state per confirmed snapshot, callback API, until caught up --
  vs a raw confluent-kafka Consumer reading the same partitions from their start (their first offsets asked for
  in one request, as the client does) to EOF (no decoding)
  (target >= 0.7x), with the client's fetch settings (``FETCH_DEFAULTS``) and batch size
  (``DEFAULT_BATCH_SIZE``). Each reader runs as a process of its own (started by this one, timed inside it
  from the reader's construction until it is caught up; imports, closing and process start are not timed), as
  an application would run it; both run ``--rounds`` times, alternating, and each keeps its best round.

Why processes of their own: the in-process publisher's engine tunes CPython's cyclic GC for its millions of
items (``engine.bucket.tune_gc``: thresholds (50000, 20, 100) and ``gc.freeze()``), which a consumer process
does not have; with the interpreter's default GC the raw reader pays for its ``m.headers()`` lists, and the
client for its change tuples. The same rounds run inside this (engine-tuned) process too and are printed as the
``client.throughput.engine_gc`` info line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

# Only what the raw reader needs at module level: a reader process imports no more than an application would.
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from bench.topic_fill import fill_topic

NVB = 1024


def publish(conf: dict[str, Any], client: dict[str, Any], n: int, tmp: Path) -> str:
    value = b'{"name": "' + b"x" * 244 + b'"}'
    topic, _ = fill_topic(conf, client, tmp, "client", ((f"user::{i:010d}".encode(), value) for i in range(n)))
    return topic


def raw_consume(client: dict[str, Any], topic: str, batch: int = 2000) -> tuple[float, int]:
    """``client``: the Kafka config, the client's fetch settings included; ``batch``: records per consume()
    call (the client's ``DEFAULT_BATCH_SIZE``)."""
    t = time.perf_counter()  # from nothing to caught up, as the client is timed
    c = Consumer({**client, "group.id": f"bench-raw-{uuid.uuid4().hex}", "enable.auto.commit": False,
                  "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    parts = sorted(c.list_topics(topic, timeout=30).topics[topic].partitions)
    # from their start, as the client: at their first offsets, asked for in one request (the client's start,
    # ChangeStreamConsumer._earliest; OFFSET_BEGINNING, resolved by librdkafka partition by partition, comes
    # ~0.2 s later to the first record of 1024 partitions)
    got = c.offsets_for_times([TopicPartition(topic, p, 0) for p in parts], timeout=5)
    starts = {tp.partition: tp.offset for tp in got if tp.error is None and tp.offset >= 0}
    c.assign([TopicPartition(topic, p, starts.get(p, OFFSET_BEGINNING)) for p in parts])
    pending = set(parts)
    n = 0
    while pending:
        msgs = c.consume(batch, 0)  # what is fetched, without waiting for a full batch (as the client does)
        if not msgs:
            first = c.poll(0.2)
            msgs = [first, *c.consume(batch - 1, 0)] if first is not None else []
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
    from connectors.client.consumer import ChangeStreamConsumer, RollbackInstruction
    from connectors.client.replay import Snapshot

    changes = 0
    snapshots = 0

    def on_snapshot(s: Snapshot) -> None:
        nonlocal changes, snapshots
        changes += len(s.changes)
        snapshots += 1

    def on_rollback(r: RollbackInstruction) -> None:
        raise AssertionError("no rollback expected")

    t = time.perf_counter()  # from nothing to caught up, as the raw reader is timed
    with ChangeStreamConsumer(client, topic, state_path=tmp / f"state-{uuid.uuid4().hex[:6]}.sqlite") as c:
        c.run(on_snapshot, on_rollback, until_caught_up=True)
        el = time.perf_counter() - t
        records = c.records_consumed
    return records / el, records, changes


def in_process(reader: str, client: dict[str, Any], topic: str, tmp: Path) -> tuple[float, int, int]:
    if reader == "raw":
        rate, records = raw_consume({k: v for k, v in client.items() if k != "bench.batch"}, topic,
                                    int(client.get("bench.batch", 2000)))
        return rate, records, 0
    return client_consume(client, topic, tmp)


def in_own_process(reader: str, client: dict[str, Any], topic: str, tmp: Path) -> tuple[float, int, int]:
    """The reader in a fresh ``python -m bench.client --reader ...`` process; its JSON result."""
    from bench.report import child_result

    r = child_result("bench.client", ["--reader", reader, "--kafka", json.dumps(client), "--topic", topic,
                                      "--state-dir", str(tmp)], f"the {reader} reader")
    return float(r["rate"]), int(r["records"]), int(r["changes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both readers; best of each")
    ap.add_argument("--reader", choices=["raw", "client"], help=argparse.SUPPRESS)  # a reader process
    ap.add_argument("--kafka", help=argparse.SUPPRESS)
    ap.add_argument("--topic", help=argparse.SUPPRESS)
    ap.add_argument("--state-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader is not None:
        rate, records, changes = in_process(args.reader, json.loads(args.kafka), args.topic, Path(args.state_dir))
        print(json.dumps({"rate": rate, "records": records, "changes": changes}), flush=True)
        return

    from bench.report import figure
    from connectors.client.consumer import DEFAULT_BATCH_SIZE, FETCH_DEFAULTS
    from gateway.broker import select_broker
    from gateway.config import load_settings

    n = args.docs
    with select_broker() as broker, tempfile.TemporaryDirectory() as td:
        settings = load_settings(None)
        conf = {**settings.producer_config(), "bootstrap.servers": broker.bootstrap_servers}
        client = {"bootstrap.servers": broker.bootstrap_servers}
        topic = publish(conf, client, n, Path(td))
        # the raw reader gets the client's fetch settings and batch size, so the ratio measures the client's own
        # work ("bench.batch" is taken out of the config before it reaches librdkafka)
        raw_client = {**FETCH_DEFAULTS, **client, "bench.batch": DEFAULT_BATCH_SIZE}
        # Alternate the two readers and keep each one's best round: on a shared 2-core machine one round
        # can be slowed by anything else running; the broker serves the same records every round.
        best = {"own": [0.0, 0.0], "engine_gc": [0.0, 0.0]}
        for _ in range(args.rounds):
            for where, run in (("own", in_own_process), ("engine_gc", in_process)):
                b, raw_n, _ = run("raw", raw_client, topic, Path(td))
                r, records, changes = run("client", client, topic, Path(td))
                assert records == raw_n, (records, raw_n)
                assert changes == n, (changes, n)
                best[where] = [max(best[where][0], b), max(best[where][1], r)]
        base, rate = best["own"]
        figure("client.throughput", rate, "records/s", base, 0.7, "higher")
        e_base, e_rate = best["engine_gc"]
        print(json.dumps({"info": "client.throughput.engine_gc", "value": round(e_rate, 1),
                          "baseline": round(e_base, 1), "ratio": round(e_rate / e_base, 3)}), flush=True)
        print(json.dumps({"info": "client.records", "records": records, "changes": changes}), flush=True)


if __name__ == "__main__":
    main()
