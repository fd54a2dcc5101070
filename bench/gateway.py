"""Gateway benchmark: ``python -m bench.gateway [--docs N] [--rounds R] [--gateways K]``.

Publishes N documents (256-byte JSON, 1024 vbuckets) from the engine into Kafka through the gateway, on the
broker the product would use (KAFKA_BOOTSTRAP_SERVERS, else the embedded Tansu), and compares with the raw
confluent-kafka producer sending the same number of records of the same size, with the same producer settings
and the same 11 headers, to a topic with the same partitions, in the same run.

Methodology (issue 17 "Proof"): the raw producer and the gateway run in *paired rounds*, alternating, each in a
fresh process of its own (``python -m bench.gateway --run ...``, timed inside it; process start, engine load and
imports are not timed), so both sides of a round meet the same machine. Each round gives a ratio gateway / raw;
the figure printed is the round with the median ratio (with an even number of rounds the lower median), its
value and its own raw baseline -- so ``ratio`` is the median of the paired ratios.

Every run meets the same broker: with the embedded Tansu broker each run gets a fresh one (started in 0.15 s),
because Tansu keeps every record in memory and slows as it fills -- the raw producer alone, six runs of 100,000
records one after the other on one broker: 99k, 68k, 58k, 55k, 49k, 40k records/s -- so a fixed order would
charge the drift to whichever side runs later. On an external broker (``KAFKA_BOOTSTRAP_SERVERS``), which is
not restarted, the order within a round alternates instead (raw first in odd rounds, last in even ones).

Figures:
* ``gateway.publish``             docs/s DCP -> Kafka (acknowledged), rollback mitigation on (the default): the
                                  engine holds N unpublished documents; timed from the first pump to the last
                                  ack; ratio to the raw producer (target 0.8)
* ``gateway.publish_unpersisted`` the same with mitigation off (publishing from memory)
* ``gateway.wall_s``              wall seconds of that median mitigation-on round (target 8 s for 1,001,006
                                  docs, else null), baseline the raw producer's
* ``gateway.cpu_s``               CPU seconds of the timed part: all threads of the gateway process, and its
                                  storage writer process (engine/kv/storage_writer.py: it only runs flushes)
* ``gateway.rss_mib``             peak RSS of the gateway process (engine in the same process), baseline the raw
                                  producer process's (target 400 MB = 381.5 MiB); ``gateway.rss_mib.storage_writer``
                                  its storage writer process's (null); with ``--gateways K`` also
                                  ``gateway.rss_mib.gatewayJ`` per gateway process (same target) and
                                  ``gateway.rss_mib.engine``, the engine node process reported apart (null)
* ``gateway.scaleout``            with ``--gateways K`` (K > 1): docs/s of K gateway processes sharing the
                                  vbuckets of one engine node process (Kafka group membership,
                                  docs/scale-out.md) over one gateway process streaming the same node, in
                                  paired rounds (target 1.6)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.processes import peak_rss_mib
from bench.report import child_result, median_round, paired_rate_ratio

NVB = 1024
#: the issue's reference size (go-dcp-kafka's and the Couchbase Kafka connector's published runs)
REFERENCE_DOCS = 1_001_006
VALUE = b'{"name": "' + b"x" * 244 + b'"}'
#: one timed run's figures (rate, wall_s, cpu_s, rss_mib, ...)
Result = dict[str, Any]


def _usage() -> tuple[float, float]:
    """(CPU seconds of every thread of this process, peak RSS MiB)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024


def raw_run(conf: dict[str, Any], client: dict[str, Any], n: int) -> Result:
    from confluent_kafka import Producer

    from gateway.resume import ensure_topics

    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    ensure_topics(client, topic, NVB)
    delivered = 0

    def cb(err: Any, msg: Any) -> None:
        nonlocal delivered
        if err is None:
            delivered += 1

    p = Producer({**conf, "on_delivery": cb})
    headers: list[tuple[str, str | bytes | None]] = [(f"dcp.h{i}", b"1234567890") for i in range(11)]
    keys = [f"user::{i:010d}".encode() for i in range(n)]
    cpu0, _ = _usage()
    t = time.perf_counter()
    for i in range(n):
        while True:
            try:
                p.produce(topic, VALUE, keys[i], partition=i % NVB, headers=headers)
                break
            except BufferError:
                p.poll(0.05)
        if i % 1000 == 0:
            p.poll(0)
    p.flush(120)
    el = time.perf_counter() - t
    cpu1, rss = _usage()
    assert delivered == n, (delivered, n)
    return {"rate": n / el, "wall_s": el, "cpu_s": cpu1 - cpu0, "rss_mib": rss}


def gateway_run(conf: dict[str, Any], client: dict[str, Any], n: int, tmp: Path,
                mitigation: bool) -> Result:
    from engine import Bucket, BucketConfig
    from gateway.publisher import Publisher
    from gateway.resume import PublishPosition, ensure_topics
    from schemas.codec import RecordEncoder
    from schemas.records import ValueFormat

    b = Bucket(BucketConfig(data_dir=tmp / f"g-{uuid.uuid4().hex[:6]}", num_vbuckets=NVB,
                            checkpoint_quota_bytes=2 << 30))
    topic = f"bench-gw-{uuid.uuid4().hex[:8]}"
    parts = ensure_topics(client, topic, NVB)
    pub = Publisher(b, conf, topic, parts, RecordEncoder(ValueFormat.AVRO),
                    {vb: PublishPosition(vb) for vb in range(NVB)}, rollback_mitigation=mitigation)
    pub.open()
    for i in range(n):
        b.set(f"user::{i:010d}".encode(), VALUE)
    # Timed: everything from the engine's checkpoints (and, with mitigation, the flush to disk) through DCP,
    # encoding and produce, until Kafka acknowledged the last record.
    cpu0, _ = _usage()
    t = time.perf_counter()
    while True:
        moved = pub.pump()
        if not moved:
            if pub.inflight == 0 and not (mitigation and b.dirty_vbuckets):
                break
            pub.kafka.poll(0.005)
    el = time.perf_counter() - t
    cpu1, rss = _usage()
    acked = pub.records_acked
    pub.close()
    # the storage's writer process: its peak RSS from its own /proc (its rusage counts the fork's, this
    # process's, before its exec), its CPU once it ended (this process's children's)
    writer = b.storage.writer_pid
    writer_rss = peak_rss_mib(writer) if writer is not None else 0.0
    b.close(clean=False)
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    writer_cpu = child.ru_utime + child.ru_stime
    return {"rate": n / el, "wall_s": el, "cpu_s": cpu1 - cpu0 + writer_cpu, "rss_mib": rss, "records": acked,
            "writer_cpu_s": writer_cpu, "writer_rss_mib": writer_rss}


def in_own_process(kind: str, conf: dict[str, Any], client: dict[str, Any], n: int, tmp: Path,
                   extra: list[str] | None = None) -> Result:
    """One timed run in a fresh ``python -m bench.gateway --run KIND`` process; its JSON result."""
    # a failure: one line with the run's own error (e.g. bench/scaleout.py: a gateway member exited during the
    # timed part)
    return child_result("bench.gateway", ["--run", kind, "--docs", str(n), "--kafka",
                                          json.dumps({"producer": conf, "client": client}), "--work-dir", str(tmp),
                                          *(extra or [])], f"the {kind} run")


#: issue 17: peak RSS of a gateway process, MiB (400 MB)
RSS_TARGET_MIB = 400 * 1000 * 1000 / 2**20


def scaleout_cpu(one: Result, many: Result, cores: int) -> dict[str, Any]:
    """CPU seconds of the gateways and of the engine node process in the timed part of the one-gateway and
    the K-gateway run, and the best K-over-one ratio those costs allow on ``cores`` cores (docs/scale-out.md
    "Why 2 gateways are not 2x on 2 cores"): a run takes at least its busiest process's CPU time (one gateway
    is one thread; the engine serves every member on one event loop, its flush on a writer thread beside it) and
    at least the total over the cores."""
    g, e, k = float(one["cpu_s"]), float(one["engine_cpu_s"]), int(many["gateways"])

    def floor(members: int) -> float:
        return max(g / members, e, (g + e) / cores)

    return {"one": {"gateways": round(g, 2), "engine": round(e, 2)},
            "many": {"gateways": round(many["cpu_s"], 2), "engine": round(many["engine_cpu_s"], 2)},
            "cores": cores, "cpu_bound_ratio": round(floor(1) / floor(k), 2) if g > 0 else None}


def run_one(args: argparse.Namespace) -> None:
    """A child process: one timed run, its result as the last stdout line."""
    kafka = json.loads(args.kafka)
    conf, client = kafka["producer"], kafka["client"]
    tmp = Path(args.work_dir)
    if args.run == "raw":
        r = raw_run(conf, client, args.docs)
    elif args.run in ("on", "off"):
        r = gateway_run(conf, client, args.docs, tmp, args.run == "on")
    else:
        from bench.scaleout import scaleout_run  # the engine node process + K gateway processes

        r = scaleout_run(conf, client, args.docs, tmp, int(args.run.removeprefix("members")))
    print(json.dumps(r), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (raw producer, then the gateway)")
    ap.add_argument("--gateways", type=int, default=1,
                    help="with K > 1 also time K gateway processes sharing one engine node (gateway.scaleout)")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # a child: raw | on | off | membersK
    ap.add_argument("--kafka", help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.docs < 1 or args.rounds < 1 or args.gateways < 1:
        ap.error("--docs, --rounds and --gateways must be at least 1")
    if args.run is not None:
        run_one(args)
        return

    from bench.report import engine_build, figure
    from gateway.broker import EmbeddedTansuBroker, select_broker
    from gateway.config import load_settings

    n = args.docs
    engine_build()
    with tempfile.TemporaryDirectory() as td:
        producer_conf = load_settings(None).producer_config()
        tmp = Path(td)
        conf: dict[str, Any] = {}
        fresh = isinstance(select_broker(), EmbeddedTansuBroker)

        def run(kind: str) -> Result:
            """One timed run in its own process, on a broker of its own when it is the embedded one."""
            nonlocal conf
            with select_broker() as broker:
                conf = {**producer_conf, "bootstrap.servers": broker.bootstrap_servers}
                return in_own_process(kind, conf, {"bootstrap.servers": broker.bootstrap_servers}, n, tmp)

        on: list[tuple[Result, Result]] = []
        off: list[tuple[Result, Result]] = []
        scale: list[tuple[Result, Result]] = []
        for r in range(args.rounds):
            order = ("raw", "on", "off") if fresh or r % 2 == 0 else ("on", "off", "raw")
            got = {kind: run(kind) for kind in order}
            base = got["raw"]
            on.append((got["on"], base))
            off.append((got["off"], base))
            if args.gateways > 1:
                one = run("members1")
                many = run(f"members{args.gateways}")
                scale.append((many, one))
            print(json.dumps({"info": "round", "raw": base, "on": on[-1][0], "off": off[-1][0],
                              **({"scaleout": {"one": scale[-1][1], "many": scale[-1][0]}} if scale else {})}),
                  flush=True)
        g, b = median_round(on, paired_rate_ratio)
        figure("gateway.publish", g["rate"], "docs/s", b["rate"], 0.8, "higher")
        go, bo = median_round(off, paired_rate_ratio)
        figure("gateway.publish_unpersisted", go["rate"], "docs/s", bo["rate"], None, "higher")
        figure("gateway.wall_s", g["wall_s"], "s", b["wall_s"], 8.0 if n == REFERENCE_DOCS else None, "lower")
        figure("gateway.cpu_s", g["cpu_s"], "s", b["cpu_s"], None, "lower")
        # issue 17: the gateway process's peak RSS <= 400 MB -- here the engine runs in the same process, its
        # resident data included; with --gateways K the per-process figures below report the engine apart
        figure("gateway.rss_mib", g["rss_mib"], "MiB", b["rss_mib"], RSS_TARGET_MIB, "lower")
        if "writer_rss_mib" in g:
            figure("gateway.rss_mib.storage_writer", g["writer_rss_mib"], "MiB", b["rss_mib"], None, "lower")
        if scale:
            gm, g1 = median_round(scale, paired_rate_ratio)
            figure("gateway.scaleout", gm["rate"], "docs/s", g1["rate"], 1.6, "higher")
            print(json.dumps({"info": "gateway.scaleout.cpu_s", **scaleout_cpu(g1, gm, os.cpu_count() or 1)}),
                  flush=True)
            for name, mib in sorted(gm.get("rss_mib_per_process", {}).items()):
                # per process of the K-gateway run: each gateway against the target, the engine node's apart
                figure(f"gateway.rss_mib.{name}", mib, "MiB", b["rss_mib"],
                       None if name == "engine" else RSS_TARGET_MIB, "lower")
        print(json.dumps({"info": "producer_config", "settings": {k: v for k, v in conf.items()
                                                                  if "password" not in k}}), flush=True)


if __name__ == "__main__":
    main()
