"""``python -m bench.xdcr --docs N [--rounds R]``: XDCR throughput (docs/xdcr.md "Performance").

N documents (256-byte JSON, 64 vbuckets) are written into an in-process engine and published into a topic of the
broker the product would use (gateway.broker.select_broker). Then, in *paired rounds* (as bench.gateway and
bench.client run theirs), each side in a fresh process of its own (``python -m bench.xdcr --run ...``, timed
inside it; process start, imports and loading are not timed) writing into a fresh target node process
(``python -m engine.network.server``, the same vbucket count):

* the baseline: the same documents with the same metadata sent straight to the target with the same client
  (``connectors.xdcr.target.TargetCluster``: 500-document pipelined SET_WITH_META batches), timed from connect
  to the last answer;
* ``xdcr.throughput`` documents/s of the replicator (connectors.xdcr) from the topic to the target -- Kafka
  consume + decode + snapshot assembly + the changelog and state in SQLite + batched, pipelined
  SET_WITH_META -- timed from its construction until it is caught up.

Each round gives a ratio replicator / baseline; the figure printed is the round with the median ratio (the lower
median with an even count), its value and its own baseline, so ``ratio`` is the median of the paired ratios. An
``info`` line per round gives both rates, the CPU seconds of both timed processes (the replicator's writer process
not included) and the load average. Target (issue 12): ratio >= 0.7.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

NVB = 64


def publish(conf: dict[str, Any], client: dict[str, Any], n: int, tmp: Path) -> tuple[str, list[Any]]:
    """The topic, and each document's (vbucket, key, cas, rev seqno, flags, expiry, datatype, value)."""
    from bench.topic_fill import fill_topic

    def versions(b: Any) -> list[Any]:
        return [(vb.id, bytes(k), it.cas, it.rev_seqno, it.flags, it.expiry, it.datatype, bytes(it.value or b""))
                for vb in b.vbuckets() for k, it in vb.ht.items()]

    value = b'{"name": "' + b"x" * 244 + b'"}'
    topic, docs = fill_topic(conf, client, tmp, "xdcr", ((f"user::{i:010d}".encode(), value) for i in range(n)),
                             num_vbuckets=NVB, inspect=versions)
    return topic, docs or []


def raw_writes(port: int, docs_file: Path) -> float:
    from connectors.xdcr.connection import Credentials
    from connectors.xdcr.document import DocVersion
    from connectors.xdcr.target import TargetCluster, TargetSpec, WriteOp

    with docs_file.open("rb") as f:
        docs = [(vb, DocVersion(k, cas, rev, flags, exp, False, dt, v))
                for vb, k, cas, rev, flags, exp, dt, v in pickle.load(f)]
    t = time.perf_counter()
    tc = TargetCluster(TargetSpec.parse(f"couchbase://127.0.0.1:{port}"), Credentials())
    tc.connect()
    for i in range(0, len(docs), 500):
        res = tc.write([WriteOp(vb, v) for vb, v in docs[i:i + 500]])
        assert all(r.status == 0 for r in res)
    el = time.perf_counter() - t
    tc.close()
    return len(docs) / el


def xdcr(client: dict[str, Any], topic: str, port: int, state: Path, n: int) -> float:
    from connectors.xdcr.replicator import XdcrReplicator

    t = time.perf_counter()
    with XdcrReplicator(client, topic, f"couchbase://127.0.0.1:{port}", state) as r:
        r.run(until_caught_up=True)
        el = time.perf_counter() - t
        assert r.metrics.written == n, r.metrics.to_dict()
    return n / el


def in_own_process(kind: str, port: int, work: Path, args: list[str]) -> dict[str, float]:
    """One timed side in a fresh ``python -m bench.xdcr --run KIND`` process: its rate and CPU seconds."""
    from bench.report import child_result

    return child_result("bench.xdcr", ["--run", kind, "--port", str(port), "--work-dir", str(work), *args],
                        f"the {kind} run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (the baseline, then the replicator)")
    ap.add_argument("--run", choices=["raw", "xdcr"], help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", help=argparse.SUPPRESS)
    ap.add_argument("--kafka", help=argparse.SUPPRESS)
    ap.add_argument("--topic", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.docs < 1 or args.rounds < 1:
        ap.error("--docs and --rounds must be at least 1")
    if args.run is not None:
        work = Path(args.work_dir)
        cpu = time.process_time()
        if args.run == "raw":
            rate = raw_writes(args.port, work / "docs.pickle")
        else:
            rate = xdcr(json.loads(args.kafka), args.topic, args.port, work, args.docs)
        print(json.dumps({"rate": rate, "cpu_s": time.process_time() - cpu}), flush=True)
        return

    from bench.report import figure, median_round, paired_rate_ratio
    from engine.network.process_cluster import NodeProcess
    from gateway.broker import select_broker
    from gateway.config import load_settings

    n = args.docs
    with select_broker() as broker, tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        conf = {**load_settings(None).producer_config(), "bootstrap.servers": broker.bootstrap_servers}
        client = {"bootstrap.servers": broker.bootstrap_servers}
        topic, docs = publish(conf, client, n, tmp)
        with (tmp / "docs.pickle").open("wb") as f:
            pickle.dump(docs, f, protocol=pickle.HIGHEST_PROTOCOL)
        del docs
        shutil.rmtree(tmp / "engine", ignore_errors=True)
        rounds: list[tuple[dict[str, float], dict[str, float]]] = []
        for i in range(args.rounds):
            nodes = [NodeProcess(f"t{i}{s}", tmp / f"t{i}{s}", NVB) for s in "ab"]
            try:
                for node in nodes:
                    node.start()
                raw = in_own_process("raw", nodes[0].port, tmp, [])
                xd = in_own_process("xdcr", nodes[1].port, tmp / f"state{i}",
                                      ["--docs", str(n), "--kafka", json.dumps(client), "--topic", topic])
            finally:
                for node in nodes:
                    node.kill()
                    shutil.rmtree(tmp / node.name, ignore_errors=True)
                shutil.rmtree(tmp / f"state{i}", ignore_errors=True)
            rounds.append((xd, raw))
            print(json.dumps({"info": "round", "xdcr": round(xd["rate"], 1), "raw": round(raw["rate"], 1),
                              "ratio": round(xd["rate"] / raw["rate"], 3),
                              "cpu_s": {"xdcr": round(xd["cpu_s"], 2), "raw": round(raw["cpu_s"], 2)},
                              "loadavg": [round(x, 2) for x in os.getloadavg()]}), flush=True)
    xd, raw = median_round(rounds, paired_rate_ratio)
    figure("xdcr.throughput", xd["rate"], "docs/s", raw["rate"], 0.7, "higher")


if __name__ == "__main__":
    main()
