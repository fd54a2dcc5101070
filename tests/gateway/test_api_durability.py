"""The HTTP API's durability parameter (docs/durability.md "HTTP API"): sync writes on PUT / DELETE with every level, and a JSON
error for every bad or failing one -- DURABILITY_INVALID_LEVEL 400, DURABILITY_IMPOSSIBLE 503,
SYNC_WRITE_IN_PROGRESS 409, SYNC_WRITE_AMBIGUOUS 504 (docs/durability.md "HTTP")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from gateway.broker import Broker
from gateway.service import GatewayService
from tests.gateway.api_harness import caught_up, expect_error, run, run_cluster


def test_durable_writes_and_their_errors_over_http(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        bucket = svc.bucket
        assert bucket is not None
        # a single bucket has no replicas: kv_engine's majority of one is the active alone
        for level in ("majority", "majority_and_persist_to_active", "persist_to_majority", "2"):
            r = await http.put(f"{url}/docs/d-{level}?durability={level}&timeout_ms=5000", data=b'{"v": 1}')
            assert r.status == 200, await r.text()
            m = await r.json()
            g = await http.get(f"{url}/docs/d-{level}")
            assert g.status == 200 and await g.read() == b'{"v": 1}'
            assert int(g.headers["X-DCP-Seqno"]) == m["seqno"]
        r = await http.put(f"{url}/docs/d-none?durability=none", data=b"plain")
        assert r.status == 200
        r = await http.delete(f"{url}/docs/d-majority?durability=majority")
        assert r.status == 200
        await expect_error(await http.get(f"{url}/docs/d-majority"), 404, "not_found")
        # bad input
        for bad in ("bogus", "4", "-1", ""):
            r = await http.put(f"{url}/docs/x?durability={bad}", data=b"v")
            await expect_error(r, 400, "durability_invalid_level")
        await expect_error(await http.delete(f"{url}/docs/x?durability=strong"), 400, "durability_invalid_level")
        await expect_error(await http.put(f"{url}/docs/x?timeout_ms=100", data=b"v"), 400, "invalid_argument")
        await expect_error(await http.put(f"{url}/docs/x?durability=majority&timeout_ms=70000", data=b"v"),
                           400, "invalid_argument")
        await expect_error(await http.put(f"{url}/docs/x?durability=majority&timeout_ms=abc", data=b"v"),
                           400, "invalid_argument")
        await expect_error(await http.get(f"{url}/docs/x"), 404, "not_found")  # nothing was written
        # a chain that cannot reach a majority: DURABILITY_IMPOSSIBLE
        vb_imp = bucket.vbucket_of("imp")
        bucket.set_replication_topology(vb_imp, ["self", None])
        await expect_error(await http.put(f"{url}/docs/imp?durability=majority", data=b"v"), 503,
                           "durability_impossible")
        # a replica that never acks: the write waits, a second write to the key is refused, then it times out
        vb = bucket.vbucket_of("slow")
        bucket.set_replication_topology(vb, ["self", "ghost"])
        await http.put(f"{url}/docs/slow", data=b"before")
        pending = asyncio.ensure_future(http.put(f"{url}/docs/slow?durability=majority&timeout_ms=1500",
                                                 data=b"after"))
        while not bucket.vbucket(vb).prepares:
            await asyncio.sleep(0.005)
        await expect_error(await http.put(f"{url}/docs/slow", data=b"x"), 409, "sync_write_in_progress")
        g = await http.get(f"{url}/docs/slow")
        assert await g.read() == b"before"  # the prepare is invisible
        await expect_error(await pending, 504, "sync_write_ambiguous")
        g = await http.get(f"{url}/docs/slow")
        assert await g.read() == b"before"  # timed out -> aborted: never visible
        bucket.set_replication_topology(vb, ["self"])
        r = await http.put(f"{url}/docs/slow?durability=majority", data=b"after")
        assert r.status == 200

    run(kafka_broker, tmp_path, scenario)


def test_durable_writes_over_http_in_cluster_mode_survive_failover(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        cluster = svc.cluster
        assert cluster is not None
        acked = {}
        for i, level in enumerate(("majority", "majority_and_persist_to_active", "persist_to_majority") * 4):
            r = await http.put(f"{url}/docs/c{i}?durability={level}&timeout_ms=10000", data=b'{"i": %d}' % i)
            assert r.status == 200, await r.text()
            acked[f"c{i}"] = b'{"i": %d}' % i
        victim = "n1"
        r = await http.post(f"{url}/cluster/failover", json={"node": victim, "graceful": False})
        assert r.status == 200, await r.text()
        await caught_up(http, url)
        for key, value in acked.items():
            g = await http.get(f"{url}/docs/{key}")
            assert g.status == 200 and await g.read() == value, key
        # chains [r, r', None] after the failover of one of 3 nodes with 2 replicas: still a majority
        r = await http.put(f"{url}/docs/after?durability=majority", data=b"x")
        assert r.status == 200, await r.text()

    run_cluster(kafka_broker, tmp_path, scenario, cluster_replicas=2)


def test_durable_write_whose_node_dies_is_ambiguous_over_http(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        cluster = svc.cluster
        assert cluster is not None
        key = "dies"
        vb = cluster.vbucket_of(key)
        active, *replicas = cluster.vbucket_map().chains[vb]
        assert active is not None
        for r in replicas:
            assert r is not None
            cluster.kill(r)  # nobody can ack: the write waits
        pending = asyncio.ensure_future(http.put(f"{url}/docs/{key}?durability=majority&timeout_ms=30000",
                                                 data=b"v"))
        bucket = cluster.node(active).require_bucket()
        while not bucket.vbucket(vb).prepares:
            await asyncio.sleep(0.005)
        cluster.kill(active)
        await expect_error(await pending, 504, "sync_write_ambiguous")

    run_cluster(kafka_broker, tmp_path, scenario, cluster_replicas=2)
