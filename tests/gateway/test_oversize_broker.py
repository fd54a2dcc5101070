"""Records the *broker* refuses as too large (docs/reliability.md "Large documents", docs/kafka-compat.md
"noida-db"): the embedded Tansu broker enforces no record size limit, so the delivery-report refusal path of
``oversize_policy`` (``MSG_SIZE_TOO_LARGE`` in the produce response, for a topic whose ``max.message.bytes``
is below the record) is exercised here against noida-db (PyPI ``noida-db``, pinned in the dev extra), a small
server speaking the Kafka API that does enforce the topic's ``max.message.bytes`` and a ~1 MB broker default.

The producer is *not* limited here (its ``message.max.bytes`` is the gateway's, 21 MB): the refusal comes from
the broker, in the delivery report of a record produced alone on its partition. Skipped, with the reason,
where noida-db is not installed or cannot run on this machine."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.broker import Broker
from gateway.resume import ensure_topics
from gateway.service import GatewayService
from schemas.records import RecordType
from tests.gateway.oversize_harness import (
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
from tests.gateway.processes import noida_broker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def noida() -> Iterator[Broker]:
    """A noida-db server with only its Kafka service (tests/gateway/processes.py)."""
    with noida_broker() as broker:
        yield broker


def _small_topic(broker: Broker, bucket: str) -> None:
    """The bucket's topic, existing before the gateway starts, with a record limit of SMALL_LIMIT."""
    ensure_topics({"bootstrap.servers": broker.bootstrap_servers}, f"dcp.{bucket}", NVB,
                  max_message_bytes=SMALL_LIMIT)


def test_created_topic_takes_a_large_document(noida: Broker, tmp_path: Path) -> None:
    """The topic the gateway creates is sized for the engine's largest value: a broker that enforces
    ``max.message.bytes`` (default about 1 MB) takes a 1.5 MB record."""
    bucket = f"nbig{uuid.uuid4().hex[:8]}"
    big = os.urandom(1_500_000)  # incompressible: Kafka checks the compressed batch (lz4)

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.bucket is not None
        await put(http, url, "big", big)
        await put(http, url, key_in(svc.bucket, 0, "small-"), b'{"n":1}')
        await settled(svc)
        assert svc.publisher.oversize_records == 0 and not svc.publisher.failed_vbuckets

    run(noida, tmp_path, bucket, scenario)
    latest = latest_records(check_topic(noida.bootstrap_servers, f"dcp.{bucket}"))
    assert latest[b"big"].type is RecordType.MUTATION and latest[b"big"].value == big


def test_skip_when_the_broker_refuses_the_record_in_its_delivery_report(noida: Broker, tmp_path: Path) -> None:
    bucket = f"nskp{uuid.uuid4().hex[:8]}"
    _small_topic(noida, bucket)
    big = os.urandom(SMALL_LIMIT * 2)  # incompressible: Kafka checks the compressed batch (lz4)
    state: dict[str, int] = {}

    async def first(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.bucket is not None
        assert svc.publisher.large_record_bytes < SMALL_LIMIT  # the topic's limit was read at start
        await put(http, url, "doc", b'{"v":"small"}')
        await put(http, url, "doc", big)
        vb = svc.bucket.vbucket_of("doc")
        state["vb"], state["seqno"] = vb, svc.bucket.get("doc").seqno
        for i in range(5):
            await put(http, url, key_in(svc.bucket, vb, f"same{i}-"), b'{"n":1}')
            await put(http, url, key_in(svc.bucket, (vb + 1) % NVB, f"other{i}-"), b'{"n":2}')
        await settled(svc)
        assert svc.publisher.oversize_records == 1 and not svc.publisher.failed_vbuckets

    async def after_restart(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.bucket is not None
        for vb in range(NVB):
            await put(http, url, key_in(svc.bucket, vb, f"after{vb}-"), b'{"n":3}')
        await settled(svc)
        assert svc.publisher.oversize_records == 0

    run(noida, tmp_path, bucket, first)
    run(noida, tmp_path, bucket, after_restart)
    records = check_topic(noida.bootstrap_servers, f"dcp.{bucket}")
    over = [r for _p, _o, r in records if r.type is RecordType.OVERSIZE]
    assert len(over) == 1
    o = over[0]
    assert (o.key, o.vbucket, o.seqno) == (b"doc", state["vb"], state["seqno"])
    assert o.size is not None and o.size >= len(big)  # the record's size: the value plus its framing
    # the broker's answer in the delivery report, not the producer's refusal in produce()
    assert "MSG_SIZE_TOO_LARGE" in (o.reason or "") and "Broker:" in (o.reason or ""), o.reason
    seqnos = [r.seqno for _p, _o, r in records if r.vbucket == o.vbucket and (r.is_data or r is o)]
    assert seqnos == sorted(seqnos) and o.seqno in seqnos
    latest = latest_records(records)
    assert len([k for k in latest if k.startswith((b"same", b"other", b"after"))]) == 10 + NVB


def test_fail_when_the_broker_refuses_the_record_in_its_delivery_report(noida: Broker, tmp_path: Path) -> None:
    bucket = f"nfal{uuid.uuid4().hex[:8]}"
    _small_topic(noida, bucket)

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        pub = svc.publisher
        assert pub is not None and svc.bucket is not None
        await put(http, url, "doc", os.urandom(SMALL_LIMIT * 2))
        vb = svc.bucket.vbucket_of("doc")
        seqno = svc.bucket.get("doc").seqno
        for i in range(5):
            await put(http, url, key_in(svc.bucket, vb, f"same{i}-"), b'{"n":1}')
        others = [key_in(svc.bucket, (vb + d) % NVB, f"other{d}-") for d in range(1, NVB)]
        for k in others:
            await put(http, url, k, b'{"n":2}')
        deadline = time.monotonic() + 60
        while vb not in pub.failed_vbuckets or any(lag_of(pub, v) for v in range(NVB) if v != vb):
            assert pub.error is None, pub.error
            assert time.monotonic() < deadline, "the other vbuckets did not publish"
            await asyncio.sleep(0.05)
        assert set(pub.failed_vbuckets) == {vb}
        assert "MSG_SIZE_TOO_LARGE" in pub.failed_vbuckets[vb] and "Broker:" in pub.failed_vbuckets[vb]
        assert pub.acked[vb].seqno < seqno
        async with http.get(f"{url}/health/ready") as r:
            assert r.status == 503
            assert any(x.startswith(f"vbucket_failed: vbucket {vb}:") for x in (await r.json())["reasons"])

    run(noida, tmp_path, bucket, scenario, oversize_policy="fail")
