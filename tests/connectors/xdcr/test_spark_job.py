"""The XDCR Spark job (connectors/xdcr/spark_job.py) run as its one command on local[2]: the target equals the
source -- documents and metadata -- across a source rollback, and a second run writes nothing new."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine import vbucket_of
from gateway.broker import Broker
from tests.connectors.xdcr.harness import diverging, source_docs, target_docs, target_node
from tests.harness import Harness, write

pytest.importorskip("pyspark")
pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.xdist_group("spark")]

ROOT = Path(__file__).resolve().parents[3]


def job(h: Harness, port: int, checkpoint: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "connectors.xdcr.spark_job", "--bootstrap", h.broker.bootstrap_servers,
                        "--topic", h.topic, "--target", f"couchbase://127.0.0.1:{port}", "--checkpoint",
                        str(checkpoint), "--available-now"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def test_spark_job_converges_across_a_rollback(kafka_broker: Broker, tmp_path: Path) -> None:
    h = Harness(kafka_broker, tmp_path / "h", rollback_mitigation=False)
    node: Any = target_node(tmp_path)
    try:
        write(h.bucket, 80)
        h.bucket.flush_all()
        h.settle()
        write(h.bucket, 30, start=40)  # the lost branch: published, applied by the job, never persisted
        h.publish_unpersisted()
        job(h, node.port, tmp_path / "chk")
        h.crash_engine()
        write(h.bucket, 10, start=900)
        h.bucket.flush_all()
        h.settle()
        out = job(h, node.port, tmp_path / "chk")
        assert "'restored': 0" not in out and "'rollbacks': 0" not in out, out
        src = source_docs(h.bucket)
        tgt = target_docs(node, {k: vbucket_of(k, h.nvb) for k in src} | {
            f"k{i}".encode(): vbucket_of(f"k{i}".encode(), h.nvb) for i in range(40, 70)})
        assert not diverging(src, tgt)
    finally:
        node.kill()
        h.close()
