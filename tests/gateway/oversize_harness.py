"""Helpers of the large-document tests (test_oversize*.py, docs/reliability.md "Large documents"): the service
they run, keys of a vbucket, the topic's checks, waiting until everything is published."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from engine import Bucket
from gateway.broker import Broker
from gateway.invariants import check_partition, data_positions
from gateway.publisher import Publisher
from gateway.service import GatewayService
from schemas.records import DecodedRecord, RecordType
from tests.gateway.api_harness import Scenario, run_service
from tests.gateway.kafka_util import read_topic

NVB = 4
MIB = 1024 * 1024
#: a producer limited on purpose (kafka.extra): Kafka refuses records above it (docs/kafka-compat.md: the
#: embedded Tansu broker enforces no record size limit of its own, so the producer's is the one that bites)
SMALL_LIMIT = 200_000


def key_in(bucket: Bucket, vb: int, prefix: str) -> str:
    """A key of vbucket ``vb``."""
    for i in range(100_000):
        k = f"{prefix}{i}"
        if bucket.vbucket_of(k) == vb:
            return k
    raise AssertionError("no key found")


def latest_records(records: list[tuple[int, int, DecodedRecord]]) -> dict[bytes, DecodedRecord]:
    """key -> the last data or oversize record of it in the topic (rollbacks aside: none in these tests)."""
    out: dict[bytes, DecodedRecord] = {}
    for _p, _o, r in records:
        if (r.is_data or r.type is RecordType.OVERSIZE) and r.key is not None:
            out[r.key] = r
    return out


def check_topic(bootstrap: str, topic: str) -> list[tuple[int, int, DecodedRecord]]:
    records = read_topic(bootstrap, topic)
    for p in {p for p, _o, _r in records}:
        check_partition([(o, r) for q, o, r in records if q == p])
    dup = [k for k, n in data_positions(records).items() if n > 1]
    assert not dup, f"duplicate (vbucket, vbuuid, seqno): {dup[:5]}"
    return records


# ------------------------------------------------------------------------------------------ the service
def run(broker: Broker, tmp: Path, bucket: str, scenario: Scenario, **overrides: Any) -> None:
    run_service(broker, tmp, scenario, bucket=bucket, num_vbuckets=NVB, **overrides)


async def settled(svc: GatewayService, timeout: float = 60.0) -> None:
    """Wait until every engine item is acknowledged by Kafka (a generous bound: proves "did not wedge")."""
    pub = svc.publisher
    assert pub is not None
    deadline = time.monotonic() + timeout
    while True:
        if pub.lag()[0] == 0 and pub.inflight == 0:
            return
        assert pub.error is None, pub.error
        assert time.monotonic() < deadline, f"publishing wedged: lag {pub.lag()}, in flight {pub.inflight}"
        await asyncio.sleep(0.05)


def lag_of(pub: Publisher, vb: int) -> int:
    return int(pub.status(vb)["lag"])


async def put(http: aiohttp.ClientSession, url: str, key: str, body: bytes) -> None:
    async with http.put(f"{url}/docs/{key}", data=body) as r:
        assert r.status == 200, await r.text()
