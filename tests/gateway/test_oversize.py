"""Large documents (docs/reliability.md "Large documents"): a document the engine accepts never stops
publishing. On the real embedded broker: the gateway sizes its producer and topic for the engine's largest
value; when Kafka still refuses a record as too large (a producer limited on purpose), ``oversize_policy=skip``
publishes an oversize control record in its place and ``fail`` stops that vbucket only."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.client.consumer import ChangeStreamConsumer
from connectors.client.replay import Oversize, Snapshot
from engine import Bucket, BucketConfig, KeyNotFound
from gateway.broker import Broker
from gateway.config import load_settings
from gateway.publisher import Publisher
from gateway.resume import ensure_topics, recover_positions
from gateway.service import GatewayService
from schemas.codec import RecordEncoder
from schemas.records import RecordType
from tests.gateway.oversize_harness import (
    MIB,
    NVB,
    SMALL_LIMIT,
    check_topic,
    key_in,
    lag_of,
    latest_records,
    put,
    run,
    settled,
)


@pytest.mark.slow
@pytest.mark.parametrize("size", [1_000_200, 1_500_000, 20 * MIB], ids=["1MB+200", "1.5MB", "20MiB"])
def test_large_document_is_published_and_publishing_continues_across_a_restart(
    kafka_broker: Broker, tmp_path: Path, size: int,
) -> None:
    """Issue 16: a 1,000,200-byte value wedged every vbucket for good (produce() raised MSG_SIZE_TOO_LARGE
    after the record's in-flight entry was queued; the pump task died silently). Now the producer and the
    topic take the engine's largest value: the document is published as a data record, the writes after it
    (same and other vbuckets) too, and again after a restart."""
    bucket = f"big{uuid.uuid4().hex[:8]}"
    big = bytes([0x61 + i % 26 for i in range(size)])
    topic = f"dcp.{bucket}"

    async def first(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.bucket is not None
        await put(http, url, "big", big)
        vb = svc.bucket.vbucket_of("big")
        for i in range(5):
            await put(http, url, key_in(svc.bucket, vb, f"same{i}-"), b'{"n":1}')
            await put(http, url, key_in(svc.bucket, (vb + 1) % NVB, f"other{i}-"), b'{"n":2}')
        await settled(svc)
        assert svc.publisher.oversize_records == 0 and not svc.publisher.failed_vbuckets

    async def after_restart(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.bucket is not None
        await put(http, url, "big", big[::-1])  # the large document again, then more writes
        for vb in range(NVB):
            await put(http, url, key_in(svc.bucket, vb, f"after{vb}-"), b'{"n":3}')
        await settled(svc)
        async with http.get(f"{url}/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"

    run(kafka_broker, tmp_path, bucket, first)
    run(kafka_broker, tmp_path, bucket, after_restart)
    records = check_topic(kafka_broker.bootstrap_servers, topic)
    latest = latest_records(records)
    assert latest[b"big"].type is RecordType.MUTATION and latest[b"big"].value == big[::-1]
    assert len([k for k in latest if k.startswith((b"same", b"other", b"after"))]) == 10 + NVB


def test_existing_topic_with_a_smaller_limit_warns_at_start(
    kafka_broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    bucket = f"lim{uuid.uuid4().hex[:8]}"
    ensure_topics({"bootstrap.servers": kafka_broker.bootstrap_servers}, f"dcp.{bucket}", NVB,
                  max_message_bytes=SMALL_LIMIT)

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None
        # records above the topic's limit are produced alone on their partition
        assert svc.publisher.large_record_bytes < SMALL_LIMIT

    with caplog.at_level("WARNING", logger="gateway.resume"):
        run(kafka_broker, tmp_path, bucket, scenario)
    needed = load_settings(None).max_record_bytes()
    assert any(f"max.message.bytes={SMALL_LIMIT}" in m and str(needed) in m for m in caplog.messages), caplog.messages


def test_created_topic_and_producer_are_sized_for_the_largest_value(kafka_broker: Broker, tmp_path: Path) -> None:
    from confluent_kafka.admin import AdminClient, ConfigResource

    bucket = f"sz{uuid.uuid4().hex[:8]}"
    s = load_settings(None)
    assert s.producer_config()["message.max.bytes"] == s.max_record_bytes() >= BucketConfig(data_dir=".").max_value_size

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        pass

    run(kafka_broker, tmp_path, bucket, scenario)
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers})
    fut = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, f"dcp.{bucket}")])
    cfg = next(iter(fut.values())).result(timeout=30)
    assert int(cfg["max.message.bytes"].value) == s.max_record_bytes()


def test_skip_publishes_an_oversize_record_in_place_and_the_client_surfaces_it(
    kafka_broker: Broker, tmp_path: Path,
) -> None:
    bucket = f"skp{uuid.uuid4().hex[:8]}"
    topic = f"dcp.{bucket}"
    big = b"x" * 1_000_200
    state: dict[str, Any] = {}

    async def first(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.bucket is not None
        await put(http, url, "doc", b'{"v":"small"}')
        await put(http, url, "doc", big)
        vb = svc.bucket.vbucket_of("doc")
        state["vb"] = vb
        state["seqno"] = svc.bucket.get("doc").seqno
        for i in range(5):
            await put(http, url, key_in(svc.bucket, vb, f"same{i}-"), b'{"n":1}')
            await put(http, url, key_in(svc.bucket, (vb + 1) % NVB, f"other{i}-"), b'{"n":2}')
        await settled(svc)
        assert svc.publisher.oversize_records == 1 and not svc.publisher.failed_vbuckets
        async with http.get(f"{url}/stats") as r:
            assert (await r.json())["oversize_records"] == 1
        async with http.get(f"{url}/metrics") as r:
            assert "dcpgw_oversize_records_total 1.0" in await r.text()

    async def after_restart(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.bucket is not None
        for vb in range(NVB):
            await put(http, url, key_in(svc.bucket, vb, f"after{vb}-"), b'{"n":3}')
        await settled(svc)
        assert svc.publisher.oversize_records == 0  # the oversize record is in Kafka: not published again

    limited = {"kafka": {"extra": {"message.max.bytes": SMALL_LIMIT}}}
    run(kafka_broker, tmp_path, bucket, first, **limited)
    run(kafka_broker, tmp_path, bucket, after_restart, **limited)
    records = check_topic(kafka_broker.bootstrap_servers, topic)
    over = [r for _p, _o, r in records if r.type is RecordType.OVERSIZE]
    assert len(over) == 1
    o = over[0]
    assert (o.key, o.vbucket, o.seqno, o.size) == (b"doc", state["vb"], state["seqno"], len(big))
    assert "MSG_SIZE_TOO_LARGE" in (o.reason or "")
    # in place: right after the data record before it in the vbucket's seqno order
    seqnos = [r.seqno for _p, _o, r in records if r.vbucket == o.vbucket and (r.is_data or r is o)]
    assert seqnos == sorted(seqnos) and o.seqno in seqnos

    # the rollback-aware client: no gap, the key keeps its previous value, the oversize change is reported
    seen: list[Oversize] = []
    docs: dict[bytes, bytes | None] = {}

    def on_snapshot(s: Snapshot) -> None:
        for c in s.changes:
            docs[c.key] = None if c.deleted else c.value

    with ChangeStreamConsumer(kafka_broker.bootstrap_servers, topic, dead_letter=None) as client:
        client.run(on_snapshot, lambda rb: None, on_oversize=seen.append)
        assert client.oversize_records == 1
    assert [(x.key, x.seqno, x.size) for x in seen] == [(b"doc", state["seqno"], len(big))]
    assert docs[b"doc"] == b'{"v":"small"}'
    assert len([k for k in docs if k.startswith((b"same", b"other", b"after"))]) == 10 + NVB

    # dcpgw replicate: counts and logs it, the table keeps the previous value
    from connectors.replicate import Replicator

    with Replicator(kafka_broker.bootstrap_servers, topic, tmp_path / "replica.db", dead_letter=None) as rep:
        rep.run()
        assert [x.key for x in rep.oversize] == [b"doc"]
        assert rep.docs()[b"doc"][0] == b'{"v":"small"}'


def test_fail_stops_only_that_vbucket_and_health_says_so(
    kafka_broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    bucket = f"fal{uuid.uuid4().hex[:8]}"

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        pub = svc.publisher
        assert pub is not None and svc.bucket is not None
        await put(http, url, "doc", b"y" * 1_000_200)
        vb = svc.bucket.vbucket_of("doc")
        seqno = svc.bucket.get("doc").seqno
        for i in range(5):
            await put(http, url, key_in(svc.bucket, vb, f"same{i}-"), b'{"n":1}')
        others = [key_in(svc.bucket, (vb + d) % NVB, f"other{d}-") for d in range(1, NVB)]
        for k in others:
            await put(http, url, k, b'{"n":2}')
        deadline = time.monotonic() + 60
        while vb not in pub.failed_vbuckets or any(lag_of(pub, v) for v in range(NVB) if v != vb):
            assert time.monotonic() < deadline, "the other vbuckets did not publish"
            await asyncio.sleep(0.05)
        assert set(pub.failed_vbuckets) == {vb}
        assert pub.acked[vb].seqno < seqno  # nothing of the stopped vbucket after the refused record
        async with http.get(f"{url}/health") as r:
            assert r.status == 503
            body = await r.json()
            assert body["status"] == "failing" and str(vb) in body["failed_vbuckets"]
        async with http.get(f"{url}/stats") as r:
            assert (await r.json())["failed_vbuckets"] == [vb]
        # the other vbuckets keep publishing
        for k in others:
            await put(http, url, k + "b", b'{"n":3}')
        deadline = time.monotonic() + 60
        while any(lag_of(pub, v) for v in range(NVB) if v != vb):
            assert time.monotonic() < deadline, "the other vbuckets stopped"
            await asyncio.sleep(0.05)

    with caplog.at_level("ERROR", logger="gateway.publisher"):
        run(kafka_broker, tmp_path, bucket, scenario, oversize_policy="fail",
            kafka={"extra": {"message.max.bytes": SMALL_LIMIT}})
    lines = [m for m in caplog.messages if "stopped" in m]
    assert len(lines) == 1 and "key b'doc'" in lines[0] and "seqno" in lines[0] and "1000" in lines[0]


# ------------------------------------------------------------------------------------------ property
class _Topic:
    """One bucket + publisher with a producer limited to SMALL_LIMIT, on a fresh topic per example."""

    def __init__(self, broker: Broker, tmp: Path) -> None:
        self.broker = broker
        self.topic = f"dcp.o{uuid.uuid4().hex[:10]}"
        self.client = {"bootstrap.servers": broker.bootstrap_servers}
        self.bucket = Bucket(BucketConfig(data_dir=tmp / uuid.uuid4().hex, num_vbuckets=NVB, seed=None))
        self.parts = ensure_topics(self.client, self.topic, NVB)
        self.old: list[Publisher] = []
        self.pub = self.publisher()

    def publisher(self) -> Publisher:
        conf = {**self.client, "enable.idempotence": True, "acks": "all", "linger.ms": 5,
                "message.max.bytes": SMALL_LIMIT}
        pos = recover_positions(self.client, self.topic, self.parts, NVB)
        p = Publisher(self.bucket, conf, self.topic, self.parts, RecordEncoder(), pos)
        p.open()
        return p

    def settle(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            n = self.pub.pump()
            if n == 0 and self.pub.inflight == 0 and not self.bucket.dirty_vbuckets:
                return
            assert time.monotonic() < deadline, "publisher never settled"
            if n == 0:
                self.pub.kafka.poll(0.01)

    def restart(self) -> None:
        """A gateway restart: positions recovered from Kafka."""
        self.pub.kafka.flush(10)
        self.old.append(self.pub)
        self.pub = self.publisher()

    def close(self) -> None:
        for p in self.old:
            p.kafka.flush(1)
        self.pub.close(timeout=5)
        self.bucket.close(clean=False)


OPS = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d", "e", "f"]),
              st.sampled_from(["small", "small", "small", "big", "delete"])),
    min_size=1, max_size=25,
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, restart_at=st.integers(0, 25))
def test_client_replay_equals_engine_except_exactly_the_oversize_keys(
    kafka_broker: Broker, tmp_path: Path, ops: list[tuple[str, str]], restart_at: int,
) -> None:
    t = _Topic(kafka_broker, tmp_path)
    try:
        refused: set[bytes] = set()  # keys whose newest change was refused
        for i, (key, what) in enumerate(ops):
            if what == "delete":
                with contextlib.suppress(KeyNotFound):
                    t.bucket.delete(key)
                refused.discard(key.encode())
            elif what == "big":
                t.bucket.set(key, json.dumps({"pad": "z" * (SMALL_LIMIT + 10 * i)}).encode())
                refused.add(key.encode())
            else:
                t.bucket.set(key, json.dumps({"i": i}).encode())
                refused.discard(key.encode())
            if i == restart_at:
                t.settle()
                t.restart()
        t.settle()
        engine = {k: v for k, (v, _vb) in t.bucket.state_snapshot().items()}
        records = check_topic(kafka_broker.bootstrap_servers, t.topic)
        docs: dict[bytes, bytes] = {}
        reported: list[Oversize] = []

        def on_snapshot(s: Snapshot) -> None:
            for c in s.changes:
                if c.deleted:
                    docs.pop(c.key, None)
                else:
                    assert c.value is not None
                    docs[c.key] = c.value
            for o in s.oversize:
                docs.pop(o.key, None)  # stale: dropped, so the comparison below sees exactly the rest
            reported.extend(s.oversize)

        with ChangeStreamConsumer(kafka_broker.bootstrap_servers, t.topic, dead_letter=None) as client:
            client.run(on_snapshot, lambda rb: None)
        # every change Kafka refused is reported once, and nothing else
        in_topic = sorted((r.key, r.seqno) for _p, _o, r in records if r.type is RecordType.OVERSIZE)
        assert sorted((o.key, o.seqno) for o in reported) == in_topic
        # the replay equals the engine for every key whose newest change is in the topic
        assert {k: v for k, v in docs.items() if k not in refused} == {
            k: v for k, v in engine.items() if k not in refused}
        # and the keys reported are exactly those whose newest change was refused (still live)
        assert {k for k in refused if k in engine} <= {o.key for o in reported}
    finally:
        t.close()
