"""``dcpgw replicate`` (connectors/replicate.py) as a subprocess against a topic of the in-process gateway."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.broker import Broker
from tests.gateway.processes import dcpgw
from tests.harness import Harness, write


@pytest.fixture
def harness(kafka_broker: Broker, tmp_path: Path) -> Iterator[Any]:
    h = Harness(kafka_broker, tmp_path / "h", rollback_mitigation=False)
    yield h
    h.close()


def run_cli(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = dcpgw("replicate", *args, env={**os.environ, **(env or {})}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def table(db: Path) -> dict[bytes, tuple[bytes, int]]:
    with sqlite3.connect(db) as conn:
        return {k.encode(): (bytes(v), vb) for k, v, vb in conn.execute("SELECT key, value, vbucket FROM docs")}


@pytest.mark.slow
def test_cli_replicate_until_caught_up_equals_engine_across_a_crash(harness: Harness, tmp_path: Path) -> None:
    h = harness
    write(h.bucket, 200)
    h.bucket.flush_all()
    h.settle()
    db = tmp_path / "replica.sqlite"
    out = run_cli("--topic", h.topic, "--db", str(db), "--until-caught-up",
                  "--bootstrap", h.broker.bootstrap_servers)
    assert out["docs"] == len(h.bucket.state_snapshot()) and out["rollbacks"] == 0
    assert table(db) == h.bucket.state_snapshot()
    write(h.bucket, 50, start=200)  # published unpersisted, applied by the replica, then lost
    h.publish_unpersisted()
    run_cli("--topic", h.topic, "--db", str(db), "--until-caught-up",
            env={"KAFKA_BOOTSTRAP_SERVERS": h.broker.bootstrap_servers})
    h.crash_engine()
    write(h.bucket, 20, start=5000)
    h.bucket.flush_all()
    h.settle()
    out = run_cli("--topic", h.topic, "--db", str(db), "--until-caught-up",
                  "--bootstrap", h.broker.bootstrap_servers)
    assert out["rollbacks"] > 0
    assert table(db) == h.bucket.state_snapshot()


def test_cli_replicate_without_a_broker_fails_cleanly(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    proc = dcpgw("replicate", "--db", str(tmp_path / "r.sqlite"), "--data-dir", str(tmp_path), env=env)
    assert proc.returncode == 2 and "no running gateway" in proc.stderr


def _dlq(bootstrap: str, topic: str) -> list[Any]:
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{os.getpid()}-{topic}", "enable.partition.eof": True,
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    out: list[Any] = []
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        while True:
            m = c.poll(10)
            assert m is not None, "the dead-letter topic never reached its end"
            err = m.error()
            if err is not None:
                assert err.code() == KafkaError._PARTITION_EOF, err
                return out
            out.append(m)
    finally:
        c.close()


@pytest.mark.slow
def test_cli_replicate_dead_letters_a_corrupt_record_once_and_goes_on(kafka_broker: Broker, tmp_path: Path) -> None:
    """Before: every run exited 2 at the corrupt record (`error: ...[0]@N: corrupt or truncated Avro body ...`)
    and added one more copy to the dead-letter topic. Now: dead-lettered once, counted, passed over."""
    from confluent_kafka import Producer

    h = Harness(kafka_broker, tmp_path / "h", nvb=4, partitions=2)  # partition 0: vbuckets 0 and 2
    try:
        write(h.bucket, 40)
        h.bucket.flush_all()
        h.settle()
        # a data record's headers and a truncated Avro body (single-object marker + a known fingerprint + junk)
        good = next(m.value() for m in _dlq_like_records(h, 0))
        p = Producer({"bootstrap.servers": h.broker.bootstrap_servers})
        hdrs: list[tuple[str, str | bytes | None]] = [
            ("dcp.type", b"mutation"), ("dcp.format", b"avro"), ("dcp.vbucket", b"0"), ("dcp.vbuuid", b"1"),
            ("dcp.seqno", b"999"), ("dcp.snap.start", b"999"), ("dcp.snap.end", b"999")]
        p.produce(h.topic, key=b"bad", value=good[:12], partition=0, headers=hdrs)
        assert p.flush(10) == 0
        # then changes of vbucket 0 only: vbucket 2 (same partition) stays behind the corrupt record, so the
        # partition's resume offset is below it and the second run reads it again
        keys = [k for k in (f"after{i}" for i in range(400)) if h.bucket.vbucket_of(k) in (0, 1)][:30]
        for k in keys:
            h.bucket.set(k, b'{"after": true}')
        h.bucket.flush_all()
        h.settle()
        db = tmp_path / "replica.sqlite"
        args = ("--topic", h.topic, "--db", str(db), "--until-caught-up", "--bootstrap", h.broker.bootstrap_servers)
        first = run_cli(*args)
        assert first["dead_letters"] == 1
        assert table(db) == h.bucket.state_snapshot()  # the changes after the corrupt record are applied
        second = run_cli(*args)
        assert second["dead_letters"] == 0  # met again, not copied again
        assert table(db) == h.bucket.state_snapshot()
        dlq = _dlq(h.broker.bootstrap_servers, f"{h.topic}.dlq")
        assert len(dlq) == 1 and dlq[0].key() == b"bad" and dlq[0].value() == good[:12]
        assert dict(dlq[0].headers())["dlq.partition"] == b"0"
    finally:
        h.close()


def _dlq_like_records(h: Harness, partition: int) -> list[Any]:
    """The data records of ``partition`` of the harness topic (a well-formed Avro value to cut short)."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    c = Consumer({"bootstrap.servers": h.broker.bootstrap_servers, "group.id": f"t-{os.getpid()}-src",
                  "enable.partition.eof": True, "auto.offset.reset": "earliest", "enable.auto.commit": False})
    out: list[Any] = []
    try:
        c.assign([TopicPartition(h.topic, partition, 0)])
        while True:
            m = c.poll(10)
            assert m is not None
            err = m.error()
            if err is not None:
                assert err.code() == KafkaError._PARTITION_EOF
                return out
            if m.key() is not None and m.value():
                out.append(m)
    finally:
        c.close()
