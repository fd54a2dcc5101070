"""The search indexer as a Spark structured-streaming job (connectors/search/spark_job.py, docs/search.md "The
Spark job"): the ``dcp`` source, ``foreachBatch`` into the tantivy index (or the Elasticsearch bulk API), on
``local[2]``; the Spark-built index equals the source, also after rollback records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[spark]')")

from connectors.search.backend import IndexBackend  # noqa: E402
from connectors.search.mapping import DocumentMapping  # noqa: E402
from connectors.search.spark_job import BatchIndexer, start_query  # noqa: E402
from connectors.search.tantivy_backend import TantivyBackend  # noqa: E402
from tests.connectors.search.helpers import expected_index  # noqa: E402
from tests.harness import Harness, write  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.kafka, pytest.mark.xdist_group("spark")]

MAPPING = DocumentMapping.dynamic_default()


def contents(b: IndexBackend) -> dict[str, tuple[int, Any]]:
    assert isinstance(b, TantivyBackend)  # the backend every test here indexes into
    return {k: (vb, fields) for k, (vb, _seq, fields) in b.keys().items()}


def run_job(spark: Any, h: Harness, d: Path) -> BatchIndexer:
    backend = TantivyBackend(d / "tantivy", MAPPING)
    sink = BatchIndexer(d, backend, mapping_id=MAPPING.id)
    q = start_query(spark, sink, bootstrap=h.broker.bootstrap_servers, topic=h.topic,
                    checkpoint_location=d / "spark-checkpoint", once=True)
    q.awaitTermination(180)
    assert q.exception() is None, q.exception()
    return sink


def close(sink: BatchIndexer) -> None:
    sink.close()
    sink.backend.close()


def test_spark_built_index_equals_source_also_after_rollback_records(
        spark: Any, harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=4, rollback_mitigation=False)
    write(h.bucket, 150)
    h.bucket.set("bin", b"\x00\x01")
    h.bucket.flush_all()
    h.settle()
    d = tmp_path / "ix"
    sink = run_job(spark, h, d)
    assert contents(sink.backend) == expected_index(h.bucket.state_snapshot(), MAPPING)
    assert sink.stats.binary_skipped == 1
    # Spark running a batch id again (after a failure) changes nothing
    last = sink.last_batch()
    assert last is not None and sink.apply_rows([], last) is False and sink.skipped_batches == 1
    close(sink)
    # published from memory, never persisted: indexed by the job, then lost by the engine's crash
    for i in range(0, 150, 4):
        h.bucket.set(f"k{i}", json.dumps({"lost": i}).encode())
    h.bucket.delete("k2")
    h.publish_unpersisted()
    sink = run_job(spark, h, d)
    assert contents(sink.backend)["k4"][1] == {"lost": 4}
    close(sink)
    h.crash_engine()
    write(h.bucket, 20, start=1000)
    h.bucket.flush_all()
    h.settle()
    sink = run_job(spark, h, d)
    assert sink.rollbacks > 0
    assert contents(sink.backend) == expected_index(h.bucket.state_snapshot(), MAPPING)
    cp = sink.backend.checkpoint()
    assert cp is not None and all(cp.positions[vb].seqno == h.bucket.vbucket(vb).high_seqno for vb in range(4))
    close(sink)


def test_backend_behind_the_store_catches_up_on_the_next_batch(spark: Any, harness: Any, tmp_path: Path) -> None:
    """A crash after the store committed a batch but before the backend did: the batch run again is skipped in
    the store, and the backend applies the missing generation."""
    h = harness(nvb=4)
    write(h.bucket, 60)
    h.settle()
    d = tmp_path / "ix"
    backend = TantivyBackend(d / "tantivy", MAPPING)
    sink = BatchIndexer(d, backend, mapping_id=MAPPING.id)
    rows = spark.read.format("dcp").option("bootstrap.servers", h.broker.bootstrap_servers) \
        .option("topic", h.topic).load().collect()

    class Killed(BaseException):
        pass

    def die(checkpoint: Any) -> None:
        raise Killed

    backend.commit = die  # type: ignore[method-assign]
    with pytest.raises(Killed):
        sink.apply_rows(rows, 0)
    close(sink)
    backend = TantivyBackend(d / "tantivy", MAPPING)
    sink = BatchIndexer(d, backend, mapping_id=MAPPING.id)
    assert backend.checkpoint() is None and sink.last_batch() == 0
    assert sink.apply_rows(rows, 0) is False  # skipped in the store, synced into the index
    assert contents(backend) == expected_index(h.bucket.state_snapshot(), MAPPING)
    close(sink)


def test_one_command_runs_the_job_on_local_2(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=4)
    write(h.bucket, 80)
    h.settle()
    d = tmp_path / "ix"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-m", "connectors.search.spark_job", "--topic", h.topic,
                           "--index-dir", str(d), "--bootstrap", h.broker.bootstrap_servers, "--once"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["batch_id"] == 0 and out["indexed"] == len(h.bucket.state_snapshot())
    b = TantivyBackend(d / "tantivy", MAPPING)
    assert contents(b) == expected_index(h.bucket.state_snapshot(), MAPPING)
    b.close()


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-m", "connectors.search.spark_job", "--topic", "t", "--index-dir",
                           str(tmp_path), "--backend", "elasticsearch", "--es-url", "nope"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "must be an http:// or https:// URL" in proc.stderr
    (tmp_path / "m.json").write_text('{"types": 3}')
    proc = subprocess.run([sys.executable, "-m", "connectors.search.spark_job", "--topic", "t", "--index-dir",
                           str(tmp_path / f"i{uuid.uuid4().hex[:4]}"), "--mapping", str(tmp_path / "m.json")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "mapping" in proc.stderr and "Traceback" not in proc.stderr
