"""Hypothesis over random histories: writes, partial publishing, gateway crashes (the publisher abandoned with
records in flight), engine crashes (unflushed data lost), stretches of writes and pump rounds while the engine's
flush cannot commit (so that mitigation releases the snapshots of many steps together, merged:
gateway/snapshot_merge.py), with and without rollback mitigation. After every
history: the topic obeys the record-format invariants, and a rollback-aware replica of the topic equals the
engine; with mitigation on, no rollback record and no (vbucket, seqno) twice."""

from __future__ import annotations

import contextlib
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Bucket, BucketConfig, KeyNotFound
from gateway.broker import Broker
from gateway.invariants import check_partition
from gateway.publisher import Publisher
from gateway.resume import ensure_topics, recover_positions
from schemas.codec import RecordEncoder
from schemas.records import ValueFormat
from tests.engine.kv.disk_model import db_file, write_locked
from tests.gateway.kafka_util import TopicReplica, read_topic

pytestmark = pytest.mark.slow
NVB = 4
KEYS = [f"k{i}" for i in range(10)]

step = st.one_of(
    st.tuples(st.just("write"), st.lists(st.tuples(st.sampled_from(KEYS), st.booleans()), min_size=1,
                                         max_size=12)),
    st.tuples(st.just("pump"), st.integers(1, 4)),
    # one key written per round, a pump round after each, while another connection holds the write lock
    st.tuples(st.just("flush_stalled"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=8)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("gateway_crash")),
    st.tuples(st.just("engine_crash")),
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, max_size=14), mitigation=st.booleans(), partitions=st.sampled_from([NVB, 2]))
def test_random_crash_histories_converge(kafka_broker: Broker, tmp_path_factory: Any, steps: list, mitigation: bool,
                                         partitions: int) -> None:
    """``partitions`` < NVB: two vbuckets share each partition (runs of records without a delivery report then
    hold several vbuckets' records, one in-flight entry per vbucket run: docs/gateway.md "Acknowledge")."""
    tmp: Path = tmp_path_factory.mktemp("hist")
    client = {"bootstrap.servers": kafka_broker.bootstrap_servers}
    conf = {**client, "enable.idempotence": True, "acks": "all", "linger.ms": 2}
    topic = f"dcp.h{uuid.uuid4().hex[:10]}"
    parts = ensure_topics(client, topic, partitions)
    assert parts == partitions
    cfg = BucketConfig(data_dir=tmp / "d", num_vbuckets=NVB, seed=None)
    bucket = Bucket(cfg)
    abandoned: list[Publisher] = []

    def publisher() -> Publisher:
        p = Publisher(bucket, conf, topic, parts, RecordEncoder(ValueFormat.AVRO),
                      recover_positions(client, topic, parts, NVB), rollback_mitigation=mitigation)
        p.open()
        return p

    pub = publisher()
    n = 0
    for s in steps:
        kind = s[0]
        if kind == "write":
            for key, delete in s[1]:
                n += 1
                if delete:
                    with contextlib.suppress(KeyNotFound):
                        bucket.delete(key)
                else:
                    bucket.set(key, f"v{n}".encode())
        elif kind == "pump":
            for _ in range(s[1]):
                pub.pump()
        elif kind == "flush_stalled":
            with write_locked(db_file(bucket)):
                for key in s[1]:
                    n += 1
                    bucket.set(key, f"v{n}".encode())
                    pub.pump(wait_for_flush=False)
        elif kind == "flush":
            bucket.flush()
        elif kind == "gateway_crash":
            pub.kafka.flush(10)  # what was produced may or may not have been acknowledged
            abandoned.append(pub)
            pub = publisher()
        elif kind == "engine_crash":
            pub.kafka.flush(10)
            abandoned.append(pub)
            bucket.close(clean=False)
            bucket = Bucket(cfg)
            pub = publisher()
    for _ in range(10_000):
        if not pub.pump() and pub.inflight == 0 and not (mitigation and bucket.dirty_vbuckets):
            break
        pub.kafka.poll(0.005)
    recs = read_topic(kafka_broker.bootstrap_servers, topic)
    for part in {p for p, _o, _r in recs}:
        check_partition([r for p, _o, r in recs if p == part])
    replica = TopicReplica()
    replica.apply_all(recs)
    assert replica.state() == bucket.state_snapshot()
    if mitigation:
        assert replica.rollbacks == 0
        c = Counter((r.vbucket, r.seqno) for _p, _o, r in recs if r.is_data)
        assert all(v == 1 for v in c.values())
    pub.close(timeout=5)
    for old in abandoned:
        old.kafka.flush(1)
    abandoned.clear()
    bucket.close(clean=False)
