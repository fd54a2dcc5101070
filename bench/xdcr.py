"""``python -m bench.xdcr --docs N``: XDCR throughput (docs/xdcr.md "Performance").

One run: N documents (256-byte JSON) are written into an in-process engine and published into a topic of the
broker the product would use (gateway.broker.select_broker); then, each into a fresh target node process
(``python -m engine.network.server``, the same vbucket count):

* ``xdcr.throughput`` documents/s of the replicator (connectors.xdcr) from the topic to the target -- Kafka
  consume + decode + snapshot assembly + source mirror and mutation log in SQLite + batched, pipelined
  SET_WITH_META -- timed from its construction until it is caught up;
* the baseline: the same documents with the same metadata sent straight to the target with the same client
  (``connectors.xdcr.target.TargetCluster``: 500-document pipelined SET_WITH_META batches), timed from connect
  to the last answer.

Target (issue 12): ratio >= 0.7.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import figure
from bench.topic_fill import fill_topic

NVB = 64


def publish(conf: dict[str, Any], client: dict[str, Any], n: int, tmp: Path) -> tuple[str, list[Any]]:
    from connectors.xdcr.document import DocVersion

    def versions(b: Any) -> list[Any]:
        return [(vb.id, DocVersion(bytes(k), it.cas, it.rev_seqno, it.flags, it.expiry, False, it.datatype,
                                   bytes(it.value or b""))) for vb in b.vbuckets() for k, it in vb.ht.items()]

    value = b'{"name": "' + b"x" * 244 + b'"}'
    topic, docs = fill_topic(conf, client, tmp, "xdcr", ((f"user::{i:010d}".encode(), value) for i in range(n)),
                             num_vbuckets=NVB, inspect=versions)
    return topic, docs or []


def raw_writes(port: int, docs: list[Any]) -> float:
    from connectors.xdcr.connection import Credentials
    from connectors.xdcr.target import TargetCluster, TargetSpec, WriteOp

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=100_000)
    args = ap.parse_args()

    from engine.network.process_cluster import NodeProcess
    from gateway.broker import select_broker
    from gateway.config import load_settings

    n = args.docs
    with select_broker() as broker, tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        conf = {**load_settings(None).producer_config(), "bootstrap.servers": broker.bootstrap_servers}
        client = {"bootstrap.servers": broker.bootstrap_servers}
        topic, docs = publish(conf, client, n, tmp)
        nodes = [NodeProcess(f"t{i}", tmp / f"t{i}", NVB) for i in range(2)]
        try:
            for node in nodes:
                node.start()
            raw = raw_writes(nodes[0].port, docs)
            rate = xdcr(client, topic, nodes[1].port, tmp / "state", n)
        finally:
            for node in nodes:
                node.kill()
    figure("xdcr.throughput", rate, "docs/s", raw, 0.7, "higher")


if __name__ == "__main__":
    main()
