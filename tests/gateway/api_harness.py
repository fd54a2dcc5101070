"""The one in-process HTTP API harness: a GatewayService (real broker, real engine) started on a free port
for the length of one async scenario, single-bucket or cluster mode; and the checks the API tests share."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from gateway.broker import Broker
from gateway.config import load_settings
from gateway.service import GatewayService
from tests.credentials import auth_headers

#: vbuckets of the services of ``run`` and ``run_cluster``
NVB = 8

Scenario = Callable[[GatewayService, str, aiohttp.ClientSession], Awaitable[None]]


def run_service(broker: Broker, tmp: Path, scenario: Scenario, *, bucket: str, num_vbuckets: int,
                **overrides: Any) -> None:
    """Start a GatewayService with data under ``tmp / "data"``, run ``scenario(service, url, http)``, stop it.
    ``http`` authenticates as the admin user (tests/credentials.py)."""
    async def main() -> None:
        settings = load_settings(None, data_dir=tmp / "data", bucket=bucket, num_vbuckets=num_vbuckets,
                                 http_port=0, **overrides)
        svc = GatewayService(settings, broker.bootstrap_servers)
        await svc.start()
        try:
            async with aiohttp.ClientSession(headers=auth_headers()) as http:
                await scenario(svc, f"http://127.0.0.1:{svc.http_port}", http)
        finally:
            await svc.stop()

    asyncio.run(main())


def run(broker: Broker, tmp: Path, scenario: Scenario, **overrides: Any) -> None:
    """A single-bucket service of ``NVB`` vbuckets in a fresh bucket."""
    run_service(broker, tmp, scenario, bucket=f"api{uuid.uuid4().hex[:8]}", num_vbuckets=NVB, **overrides)


def run_cluster(broker: Broker, tmp: Path, scenario: Scenario, **overrides: Any) -> None:
    """A cluster-mode service (3 nodes, 1 replica unless overridden) of ``NVB`` vbuckets in a fresh bucket."""
    opts: dict[str, Any] = {"cluster_nodes": 3, "cluster_replicas": 1, **overrides}
    run_service(broker, tmp, scenario, bucket=f"cl{uuid.uuid4().hex[:8]}", num_vbuckets=NVB, **opts)


def engine_state(svc: GatewayService) -> list[tuple[str, int, int]]:
    """(node, vbucket, high seqno) of every live copy: any write changes it."""
    buckets = ([("bucket", svc.bucket)] if svc.bucket is not None else
               [(name, n.bucket) for name, n in sorted(svc.cluster.nodes.items()) if n.bucket is not None])  # type: ignore[union-attr]
    return [(name, vb, b.vbucket_info(vb).high_seqno) for name, b in buckets for vb in range(svc.settings.num_vbuckets)]


async def expect_error(resp: aiohttp.ClientResponse, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body: dict[str, Any] = await resp.json()
    assert set(body) >= {"error", "message"} and body["message"]
    if code is not None:
        assert body["error"] == code, body
    return body


async def caught_up(http: aiohttp.ClientSession, url: str, tries: int = 400) -> dict[str, Any]:
    """Wait until a cluster-mode gateway has published everything and follows every vbucket with an active."""
    for _ in range(tries):
        st = await (await http.get(f"{url}/cluster")).json()
        stats = await (await http.get(f"{url}/stats")).json()
        if stats["lag"] == 0 and stats["inflight"] == 0 and st["gateway"]["following_map"] == NVB - len(
                st["vbuckets_without_active"]):
            return dict(st)
        await asyncio.sleep(0.05)
    raise AssertionError(f"the gateway never caught up: {st} {stats}")
