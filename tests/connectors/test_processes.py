"""Issue 4, proof 1 with real processes: `dcpgw up` (rollback mitigation off, so it publishes items the engine has
not persisted) is SIGKILLed; restarted, the engine answers ROLLBACK and the gateway publishes rollback records;
`dcpgw replicate --until-caught-up` (a second process, also killed once mid-way) ends equal to the engine."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import pytest

from engine import Bucket, BucketConfig
from gateway.broker import Broker
from schemas.records import RecordType
from tests.gateway.kafka_util import read_topic
from tests.gateway.processes import NVB, GatewayProc, docs, replicate_process

pytestmark = pytest.mark.slow


def test_engine_sigkill_with_unpersisted_published_items_replica_converges(kafka_broker: Broker,
                                                                          tmp_path: Path) -> None:
    bucket = f"p{uuid.uuid4().hex[:8]}"
    topic = f"dcp.{bucket}"
    data = tmp_path / "data"
    db = tmp_path / "replica.sqlite"
    # The engine flushes only every 60 s: what the gateway publishes now is not persisted yet.
    gw = GatewayProc(kafka_broker, data, bucket, DCPGW_ROLLBACK_MITIGATION="false", DCPGW_FLUSH_INTERVAL_S="60")
    gw.start()
    try:
        gw.bulk(docs(0, 400))
        gw.wait_caught_up()  # published and acknowledged by Kafka, never flushed by the engine
        first = replicate_process(kafka_broker, topic, db, "--until-caught-up")
        assert first.returncode == 0, first.stderr
        gw.kill9()
        gw.env["DCPGW_FLUSH_INTERVAL_S"] = "0.05"
        gw.start()
        gw.bulk(docs(300, 500))
        gw.wait_caught_up()
    finally:
        gw.stop()
    recs = read_topic(kafka_broker.bootstrap_servers, topic)
    assert any(r.type is RecordType.ROLLBACK for _p, _o, r in recs), "the engine lost published items"
    second = replicate_process(kafka_broker, topic, db, "--until-caught-up")
    assert second.returncode == 0, second.stderr
    b = Bucket(BucketConfig(data_dir=data, name=bucket, num_vbuckets=NVB))
    try:
        expected = {k.decode(): (v, vb) for k, (v, vb) in b.state_snapshot().items()}
    finally:
        b.close()
    with sqlite3.connect(db) as conn:
        got = {k: (bytes(v), vb) for k, v, vb in conn.execute("SELECT key, value, vbucket FROM docs")}
    assert got == expected
    assert len(expected) == 200  # docs 300..499 survived; 0..399 were lost with the engine's memory
