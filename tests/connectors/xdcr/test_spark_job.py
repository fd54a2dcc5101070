"""The XDCR Spark job (connectors/xdcr/spark_job.py) on local[2] -- as its one command in a process of its own,
and (later runs) its same ``main`` on the tests' shared SparkSession, which spares a JVM start per run: the target
equals the source -- documents and metadata -- across a source rollback and across a target that lost writes; the GET_META
pre-check, the filters, a write the target refuses for size (dead letter, the job goes on), a refused filter
change and bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from connectors.xdcr import spark_job
from engine import vbucket_of
from gateway.broker import Broker
from tests.connectors.spark_jobs import run_in_session
from tests.connectors.xdcr.harness import diverging, source_docs, target_docs, target_node
from tests.harness import Harness, write

pytest.importorskip("pyspark")
pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.xdist_group("spark")]

ROOT = Path(__file__).resolve().parents[3]


def _argv(h: Harness, port: int, checkpoint: Path, *extra: str) -> list[str]:
    return ["--bootstrap", h.broker.bootstrap_servers, "--topic", h.topic, "--target", f"couchbase://127.0.0.1:{port}",
            "--checkpoint", str(checkpoint), "--available-now", *extra]


def run_job(h: Harness, port: int, checkpoint: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The job's command in a process of its own (its own SparkSession)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "connectors.xdcr.spark_job", *_argv(h, port, checkpoint, *extra)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def job(h: Harness, port: int, checkpoint: Path, *extra: str, spark: Any = None) -> dict[str, Any]:
    """One run of the job; its JSON summary. With ``spark`` (the tests' shared session) the same ``main`` runs
    in this process -- the command's code without a JVM start per run (the suite's time); without, the command
    itself."""
    if spark is not None:
        return run_in_session(spark_job.main, _argv(h, port, checkpoint, *extra), spark)
    p = run_job(h, port, checkpoint, *extra)
    assert p.returncode == 0, p.stderr[-3000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def test_spark_job_converges_across_a_rollback(kafka_broker: Broker, tmp_path: Path, spark: Any) -> None:
    h = Harness(kafka_broker, tmp_path / "h", rollback_mitigation=False)
    node: Any = target_node(tmp_path)
    try:
        write(h.bucket, 80)
        h.bucket.flush_all()
        h.settle()
        write(h.bucket, 30, start=40)  # the lost branch: published, applied by the job, never persisted
        h.publish_unpersisted()
        first = job(h, node.port, tmp_path / "chk")
        assert first["written"] > 0 and first["get_meta"] == 0, first  # small documents: optimistic
        h.crash_engine()
        write(h.bucket, 10, start=900)
        h.bucket.flush_all()
        h.settle()
        out = job(h, node.port, tmp_path / "chk", spark=spark)  # the same checkpoint, in this process
        assert out["restored"] > 0 and out["rollbacks"] > 0, out
        src = source_docs(h.bucket)
        tgt = target_docs(node, {k: vbucket_of(k, h.nvb) for k in src} | {
            f"k{i}".encode(): vbucket_of(f"k{i}".encode(), h.nvb) for i in range(40, 70)})
        assert not diverging(src, tgt)
    finally:
        node.kill()
        h.close()


def _large(i: int, gen: int) -> bytes:
    return json.dumps({"n": i, "gen": gen, "pad": "x" * 400}).encode()


def test_spark_job_filters_precheck_too_big_and_a_target_that_lost_writes(kafka_broker: Broker,
                                                                           tmp_path: Path, spark: Any) -> None:
    """One job run with filters (key regex, skip binary), documents above the optimistic threshold (GET_META
    first) and one the target refuses for size; a second run whose writes the target never persists; the target
    is killed and warms up without them (a new failover entry); a third run with nothing new in the topic
    writes them again from the job's record. Then a changed filter is refused, as bad input is."""
    h = Harness(kafka_broker, tmp_path / "h", rollback_mitigation=False)
    node: Any = target_node(tmp_path, "lossy", max_value_size=1000)
    chk = tmp_path / "chk"
    filters = ["--filter-key", "^k", "--filter-skip-binary"]
    try:
        write(h.bucket, 60)
        for i in range(10):
            h.bucket.set(f"klarge{i}", _large(i, 0))
        h.bucket.set("kbig", json.dumps({"pad": "y" * 2000}).encode())  # above the target's max_value_size
        h.bucket.set("kbin0", b"\x00\x01\x02binary")
        write(h.bucket, 10, prefix="skip")
        h.bucket.flush_all()
        h.settle()
        first = job(h, node.port, chk, *filters, spark=spark)
        assert first["dead_letters"] == 1 and first["rejected"].get("too_big") == 1, first
        assert first["get_meta"] >= 11 and first["filtered"] >= 11, first  # 10 skip* keys, kbin0
        dead = [json.loads(line) for line in (chk / "xdcr" / "dead-letter.jsonl").read_text().splitlines()]
        assert [(d["reason"], d["key"]) for d in dead] == [("too_big", "kbig")]

        node.require().stop_persistence()
        write(h.bucket, 40, start=1000)
        for i in range(5):
            h.bucket.set(f"klarge{i}", _large(i, 1))
        h.bucket.flush_all()
        h.settle()
        second = job(h, node.port, chk, *filters, spark=spark)
        assert second["written"] > 0, second
        node.kill()
        node.start()  # unclean warmup: the unpersisted writes are gone, a new failover entry

        src = {k: v for k, v in source_docs(h.bucket).items() if k.startswith(b"k") and k not in (b"kbig", b"kbin0")}
        keys = {k: vbucket_of(k, h.nvb) for k in src}
        assert diverging(src, target_docs(node, keys))  # the target lost writes
        third = job(h, node.port, chk, *filters, spark=spark)
        assert third["resent"] > 0 and third["written"] > 0, third
        assert not diverging(src, target_docs(node, keys))
        filtered = {k: vbucket_of(k, h.nvb) for k in (b"kbig", b"kbin0", *(f"skip{i}".encode() for i in range(10)))}
        assert target_docs(node, filtered) == {}

        # a changed filter over the same checkpoint location: refused before Spark starts
        p = run_job(h, node.port, chk, "--filter-key", "^klarge")
        assert p.returncode == 2 and "--restream" in p.stderr and "--no-restream" in p.stderr, p.stderr[-2000:]
        # bad input: a bad regex, an unreachable target (one line each, before Spark starts)
        p = run_job(h, node.port, tmp_path / "other", "--filter-key", "k(")
        assert p.returncode == 2 and "not a valid regular expression" in p.stderr, p.stderr[-2000:]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead_port = s.getsockname()[1]
        p = run_job(h, dead_port, tmp_path / "other", "--give-up-after", "0")
        assert p.returncode == 3 and p.stderr.strip().splitlines()[-1].startswith("error: target "), p.stderr[-2000:]
    finally:
        node.kill()
        h.close()


def test_spark_job_dead_letters_a_corrupt_record_and_replicates_the_rest(kafka_broker: Broker,
                                                                         tmp_path: Path) -> None:
    """A record that is no gateway record (no headers) in partition 3: the job's command (before: exit 1 with
    RecordFormatError "record has no headers" from the source's offset planning, nothing written, every rerun the
    same) dead-letters it as the standalone replicator does, counts it and replicates everything else; a rerun
    over the same checkpoint finds nothing new."""
    h = Harness(kafka_broker, tmp_path / "h", rollback_mitigation=False)
    node: Any = target_node(tmp_path)
    chk = tmp_path / "chk"
    try:
        write(h.bucket, 60)
        h.bucket.flush_all()
        h.settle()
        p = Producer({"bootstrap.servers": h.broker.bootstrap_servers})
        offsets: list[int] = []
        p.produce(h.topic, value=b"not a gateway record", key=b"junk", partition=3,
                  on_delivery=lambda err, m: offsets.append(m.offset() or 0))
        p.flush(10)
        write(h.bucket, 60, start=1000)
        h.bucket.flush_all()
        h.settle()
        out = job(h, node.port, chk)
        assert out["corrupt_records"] == 1 and out["dead_letters"] == 1, out
        src = source_docs(h.bucket)
        assert not diverging(src, target_docs(node, {k: vbucket_of(k, h.nvb) for k in src}))
        dead = [json.loads(line) for line in (chk / "xdcr" / "dead-letter.jsonl").read_text().splitlines()]
        assert len(dead) == 1 and set(dead[0]) == {"reason", "partition", "offset", "detail", "at"}, dead
        assert (dead[0]["reason"], dead[0]["partition"], dead[0]["offset"]) == ("corrupt_record", 3, offsets[0])
        assert "no headers" in dead[0]["detail"]
        again = job(h, node.port, chk)
        assert again["written"] == 0 and again["corrupt_records"] == 0, again
    finally:
        node.kill()
        h.close()
