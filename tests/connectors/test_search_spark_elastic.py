"""The Spark job into the Elasticsearch / OpenSearch backend end to end (docs/search.md "The Spark job"):
``python -m connectors.search.spark_job --backend elasticsearch|opensearch --es-url ... --once`` as a process on
``local[2]`` against noida-db (tests/connectors/noida_es.py), its later runs through the same ``main`` on the
tests' shared SparkSession (no JVM start per run). The cluster's index equals the source's
JSON-object documents, also after the rollback records of an engine crash, and a batch id Spark runs again (its
commit lost, as after a driver crash) is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[spark]')")

from connectors.search import spark_job
from connectors.search.elastic import ElasticsearchBackend, ElasticsearchSettings
from tests.connectors.noida_es import FLAVOR_PARAMS, NoidaElasticsearch
from tests.connectors.spark_jobs import run_in_session
from tests.harness import Harness, write

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.kafka, pytest.mark.xdist_group("spark")]


@pytest.fixture(scope="module")
def es() -> Iterator[NoidaElasticsearch]:
    server = NoidaElasticsearch().start()
    yield server
    server.close()


def expected(h: Harness) -> dict[str, Any]:
    """The source's JSON-object documents: what the cluster's index must hold."""
    out = {}
    for k, (v, _vb) in h.bucket.state_snapshot().items():
        try:
            doc = orjson.loads(v)
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            out[k.decode()] = doc
    return out


def job(h: Harness, d: Path, es: NoidaElasticsearch, backend: str, index: str, spark: Any = None) -> dict[str, Any]:
    """One run of the job (``--once``); its JSON summary. Without ``spark`` the command in a process of its own;
    with it (the tests' shared session) the same ``main`` in this process, without a JVM start per run."""
    argv = ["--topic", h.topic, "--index-dir", str(d), "--bootstrap", h.broker.bootstrap_servers, "--once",
            "--backend", backend, "--es-url", es.url, "--es-index", index]
    if spark is not None:
        return run_in_session(spark_job.main, argv, spark)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-m", "connectors.search.spark_job", *argv],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.timeout(900)  # three Spark processes on 2 shared cores
@pytest.mark.parametrize("backend", FLAVOR_PARAMS[:1])  # elasticsearch (opensearch-py: the same backend code)
def test_spark_job_into_the_cluster_equals_source_after_rollbacks_and_reruns(
        harness: Any, es: NoidaElasticsearch, backend: str, tmp_path: Path, spark: Any) -> None:
    h = harness(nvb=4, rollback_mitigation=False)
    write(h.bucket, 120)
    h.bucket.set("bin", b"\x00\x01")
    h.bucket.set("arr", b"[1, 2]")  # JSON, not an object: no _source for it
    h.bucket.flush_all()
    h.settle()
    # published from memory, never persisted: indexed by the job, then lost in the engine's crash
    for i in range(0, 120, 4):
        h.bucket.set(f"k{i}", json.dumps({"lost": i}).encode())
    h.bucket.delete("k2")
    h.publish_unpersisted()
    d = tmp_path / "ix"
    index = f"spark-{uuid.uuid4().hex[:8]}"
    cluster = ElasticsearchBackend(ElasticsearchSettings(es.url, flavor=backend, index=index),  # type: ignore[arg-type]
                                   tmp_path / "reader")

    out = job(h, d, es, backend, index)
    assert out["batch_id"] == 0 and out["binary_skipped"] == 2 and out["rollbacks"] == 0
    assert cluster.docs() == expected(h) and cluster.docs()["k4"] == {"lost": 4} and "k2" not in cluster.docs()

    h.crash_engine()
    write(h.bucket, 20, start=1000)
    h.bucket.flush_all()
    h.settle()
    out = job(h, d, es, backend, index, spark=spark)  # the same index dir and checkpoint, in this process
    assert out["batch_id"] == 1 and out["rollbacks"] > 0
    docs = cluster.docs()
    assert docs == expected(h) and docs["k4"] == {"n": 4} and docs["k2"] == {"n": 2}
    cp = cluster.checkpoint()
    assert cp is not None and cp.generation == 2
    assert all(cp.positions[vb].seqno == h.bucket.vbucket(vb).high_seqno for vb in range(4))

    # Spark runs batch 1 again (its commit lost, as after a driver crash before the commit): skipped, the
    # cluster's index and checkpoint stay as they are
    commits = d / "spark-checkpoint" / "commits"
    (commits / "1").unlink()
    (commits / ".1.crc").unlink(missing_ok=True)  # its checksum: Spark refuses to write over one
    out = job(h, d, es, backend, index, spark=spark)
    assert out["batch_id"] == 1 and out["skipped_batches"] == 1 and out["batches"] == 0
    assert cluster.docs() == expected(h) and cluster.checkpoint() == cp
    cluster.close()


@pytest.mark.parametrize("backend", ["elasticsearch", "opensearch"])
def test_bad_cluster_arguments_are_one_line_errors(backend: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    base = [sys.executable, "-m", "connectors.search.spark_job", "--topic", "t", "--index-dir", str(tmp_path),
            "--backend", backend]
    proc = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0 and f"--backend {backend} needs --es-url URL" in proc.stderr
    proc = subprocess.run([*base, "--es-url", "http://x:9200", "--es-index", "Upper"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "must be lowercase" in proc.stderr and "Traceback" not in proc.stderr
