"""Large documents in cluster mode (docs/reliability.md "Large documents"): with ``--nodes 2/3`` the publisher
streams every vbucket from its active node, and rollback mitigation holds each vbucket's DCP messages until
they are persisted on every replica (gateway/publisher.py ``_pump_cluster`` / ``_release``). A document over
1 MB, and one Kafka refuses as too large (the producer limited via ``kafka.extra`` as in test_oversize.py),
must behave as in single-bucket mode: published; ``skip`` -> an oversize record in its place while the others
flow; ``fail`` -> only that vbucket stops and ``/health/ready`` says so. On the suite's broker, with restarts."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.broker import Broker
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

pytestmark = pytest.mark.slow

#: the cluster shapes: 2 nodes / 1 replica and 3 nodes / 2 replicas, rollback mitigation on (the default)
SHAPES = [pytest.param({"cluster_nodes": 2, "cluster_replicas": 1}, id="2nodes"),
          pytest.param({"cluster_nodes": 3, "cluster_replicas": 2}, id="3nodes")]
LIMITED = {"kafka": {"extra": {"message.max.bytes": SMALL_LIMIT}}}


async def seqno_of(svc: GatewayService, key: str) -> int:
    assert svc.cluster is not None
    return int(svc.cluster.get(key).seqno)


@pytest.mark.parametrize("shape", SHAPES)
def test_large_document_is_published_in_cluster_mode(kafka_broker: Broker, tmp_path: Path,
                                                     shape: dict[str, Any]) -> None:
    bucket = f"cbig{uuid.uuid4().hex[:8]}"
    big = bytes([0x61 + i % 26 for i in range(1_500_000)])

    async def first(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.cluster is not None
        await put(http, url, "big", big)
        vb = svc.cluster.vbucket_of("big")
        for i in range(5):
            await put(http, url, key_in(svc.cluster, vb, f"same{i}-"), b'{"n":1}')  # type: ignore[arg-type]
            await put(http, url, key_in(svc.cluster, (vb + 1) % NVB, f"other{i}-"), b'{"n":2}')  # type: ignore[arg-type]
        await settled(svc)
        assert svc.publisher.oversize_records == 0 and not svc.publisher.failed_vbuckets

    async def after_restart(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.cluster is not None
        await put(http, url, "big", big[::-1])
        for vb in range(NVB):
            await put(http, url, key_in(svc.cluster, vb, f"after{vb}-"), b'{"n":3}')  # type: ignore[arg-type]
        await settled(svc)
        async with http.get(f"{url}/health/ready") as r:
            assert r.status == 200, await r.text()

    run(kafka_broker, tmp_path, bucket, first, **shape)
    run(kafka_broker, tmp_path, bucket, after_restart, **shape)
    latest = latest_records(check_topic(kafka_broker.bootstrap_servers, f"dcp.{bucket}"))
    assert latest[b"big"].type is RecordType.MUTATION and latest[b"big"].value == big[::-1]
    assert len([k for k in latest if k.startswith((b"same", b"other", b"after"))]) == 10 + NVB


@pytest.mark.parametrize("shape", SHAPES)
def test_skip_in_cluster_mode_publishes_the_oversize_record_in_place(kafka_broker: Broker, tmp_path: Path,
                                                                     shape: dict[str, Any]) -> None:
    bucket = f"cskp{uuid.uuid4().hex[:8]}"
    big = b"x" * 1_000_200
    state: dict[str, int] = {}

    async def first(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.cluster is not None
        await put(http, url, "doc", b'{"v":"small"}')
        await put(http, url, "doc", big)
        vb = svc.cluster.vbucket_of("doc")
        state["vb"], state["seqno"] = vb, await seqno_of(svc, "doc")
        for i in range(5):
            await put(http, url, key_in(svc.cluster, vb, f"same{i}-"), b'{"n":1}')  # type: ignore[arg-type]
            await put(http, url, key_in(svc.cluster, (vb + 1) % NVB, f"other{i}-"), b'{"n":2}')  # type: ignore[arg-type]
        await settled(svc)
        assert svc.publisher.oversize_records == 1 and not svc.publisher.failed_vbuckets
        assert svc.publisher.held == 0
        async with http.get(f"{url}/health/ready") as r:
            assert r.status == 200, await r.text()

    async def after_restart(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.publisher is not None and svc.cluster is not None
        for vb in range(NVB):
            await put(http, url, key_in(svc.cluster, vb, f"after{vb}-"), b'{"n":3}')  # type: ignore[arg-type]
        await settled(svc)
        assert svc.publisher.oversize_records == 0  # in Kafka already: not published again

    run(kafka_broker, tmp_path, bucket, first, **shape, **LIMITED)
    run(kafka_broker, tmp_path, bucket, after_restart, **shape, **LIMITED)
    records = check_topic(kafka_broker.bootstrap_servers, f"dcp.{bucket}")
    over = [r for _p, _o, r in records if r.type is RecordType.OVERSIZE]
    assert len(over) == 1
    o = over[0]
    assert (o.key, o.vbucket, o.seqno, o.size) == (b"doc", state["vb"], state["seqno"], len(big))
    # in place: the vbucket's seqnos stay in order with the oversize record among them
    seqnos = [r.seqno for _p, _o, r in records if r.vbucket == o.vbucket and (r.is_data or r is o)]
    assert seqnos == sorted(seqnos) and o.seqno in seqnos
    latest = latest_records(records)
    assert latest[b"doc"].type is RecordType.OVERSIZE
    assert len([k for k in latest if k.startswith((b"same", b"other", b"after"))]) == 10 + NVB


@pytest.mark.parametrize("shape", SHAPES)
def test_fail_in_cluster_mode_stops_only_that_vbucket_and_readiness_says_so(
        kafka_broker: Broker, tmp_path: Path, shape: dict[str, Any]) -> None:
    bucket = f"cfal{uuid.uuid4().hex[:8]}"

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        pub = svc.publisher
        assert pub is not None and svc.cluster is not None
        await put(http, url, "doc", b"y" * 1_000_200)
        vb = svc.cluster.vbucket_of("doc")
        seqno = await seqno_of(svc, "doc")
        for i in range(5):
            await put(http, url, key_in(svc.cluster, vb, f"same{i}-"), b'{"n":1}')  # type: ignore[arg-type]
        others = [key_in(svc.cluster, (vb + d) % NVB, f"other{d}-") for d in range(1, NVB)]  # type: ignore[arg-type]
        for k in others:
            await put(http, url, k, b'{"n":2}')
        deadline = time.monotonic() + 60
        while vb not in pub.failed_vbuckets or any(lag_of(pub, v) for v in range(NVB) if v != vb):
            assert pub.error is None, pub.error
            assert time.monotonic() < deadline, "the other vbuckets did not publish"
            await asyncio.sleep(0.05)
        assert set(pub.failed_vbuckets) == {vb}
        assert pub.acked[vb].seqno < seqno  # nothing of the stopped vbucket after the refused record
        async with http.get(f"{url}/health/ready") as r:
            assert r.status == 503
            body = await r.json()
            assert any(x.startswith(f"vbucket_failed: vbucket {vb}:") for x in body["reasons"]), body
        # the other vbuckets keep publishing, through the held-message path
        for k in others:
            await put(http, url, k + "b", b'{"n":3}')
        deadline = time.monotonic() + 60
        while any(lag_of(pub, v) for v in range(NVB) if v != vb):
            assert time.monotonic() < deadline, "the other vbuckets stopped"
            await asyncio.sleep(0.05)
        assert pub.oversize_records == 0 and set(pub.failed_vbuckets) == {vb}

    run(kafka_broker, tmp_path, bucket, scenario, oversize_policy="fail", **shape, **LIMITED)
    # a restart streams the vbucket again and stops at the same record
    run(kafka_broker, tmp_path, bucket, _stops_again, oversize_policy="fail", **shape, **LIMITED)
    records = check_topic(kafka_broker.bootstrap_servers, f"dcp.{bucket}")
    assert not [r for _p, _o, r in records if r.type is RecordType.OVERSIZE]
    assert b"doc" not in latest_records(records)


async def _stops_again(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
    pub = svc.publisher
    assert pub is not None and svc.cluster is not None
    vb = svc.cluster.vbucket_of("doc")
    deadline = time.monotonic() + 60
    while vb not in pub.failed_vbuckets:
        assert time.monotonic() < deadline, "the refused record was not met again after the restart"
        await asyncio.sleep(0.05)
    async with http.get(f"{url}/health/ready") as r:
        assert r.status == 503
