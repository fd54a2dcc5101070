"""The HTTP API on a running GatewayService (real broker, real engine): documents with CAS and expiry,
stream status, failover logs, health, metrics, and a 4xx JSON error for every kind of bad request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from gateway.broker import Broker
from gateway.service import GatewayService
from tests.engine.kv.disk_model import db_file, write_locked
from tests.gateway.api_harness import NVB, expect_error, run


def test_document_crud_with_cas_and_expiry(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        r = await http.put(f"{url}/docs/user1", data=b'{"name": "a"}')
        assert r.status == 200
        m = await r.json()
        assert set(m) == {"vbucket", "vbuuid", "seqno", "cas", "token"}
        # the mutation token (docs/search.md "Consistency"), in the body and the headers
        assert m["token"] == {"vbucket": m["vbucket"], "vbuuid": m["vbuuid"], "seqno": m["seqno"]}
        assert (r.headers["X-DCP-Vbucket"], r.headers["X-DCP-Vbuuid"], r.headers["X-DCP-Seqno"]) == (
            str(m["vbucket"]), str(m["vbuuid"]), str(m["seqno"]))
        r = await http.get(f"{url}/vbuckets")
        vbs = (await r.json())["vbuckets"]
        assert len(vbs) == NVB and vbs[m["vbucket"]]["high_seqno"] >= m["seqno"]
        assert vbs[m["vbucket"]]["vbuuid"] == m["vbuuid"] == vbs[m["vbucket"]]["failover_log"][0]["vbuuid"]
        r = await http.get(f"{url}/docs/user1")
        assert r.status == 200 and await r.read() == b'{"name": "a"}'
        assert r.content_type == "application/json"
        assert r.headers["ETag"] == f'"{m["cas"]}"'
        # conditional write with the wrong CAS is refused and changes nothing
        r = await http.put(f"{url}/docs/user1", data=b"x", headers={"If-Match": '"1"'})
        await expect_error(r, 412, "cas_mismatch")
        r = await http.put(f"{url}/docs/user1", data=b'{"name": "b"}', headers={"If-Match": f'"{m["cas"]}"'})
        assert r.status == 200
        # insert-only
        r = await http.put(f"{url}/docs/user1", data=b"x", headers={"If-None-Match": "*"})
        await expect_error(r, 412, "exists")
        r = await http.put(f"{url}/docs/new", data=b"x", headers={"If-None-Match": "*"})
        assert r.status == 201
        # expiry and flags
        r = await http.put(f"{url}/docs/tmp?expiry=100&flags=7", data=b"t")
        assert r.status == 200
        r = await http.get(f"{url}/docs/tmp")
        assert r.headers["X-DCP-Flags"] == "7" and int(r.headers["X-DCP-Expiry"]) > 0
        r = await http.delete(f"{url}/docs/user1")
        assert r.status == 200
        d = await r.json()
        assert d["token"]["seqno"] == d["seqno"] > m["seqno"] and r.headers["X-DCP-Seqno"] == str(d["seqno"])
        r = await http.get(f"{url}/docs/user1")
        await expect_error(r, 404, "not_found")
        # the writes reached Kafka
        for _ in range(200):
            st = await (await http.get(f"{url}/stats")).json()
            if st["lag"] == 0 and st["records_acknowledged"] > 0:
                break
            await asyncio.sleep(0.05)
        assert st["lag"] == 0

    run(kafka_broker, tmp_path, scenario)


def test_bad_requests_get_4xx_json(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        await expect_error(await http.get(f"{url}/docs/{'k' * 251}"), 400, "invalid_argument")
        await expect_error(await http.put(f"{url}/docs/k?expiry=-1", data=b"x"), 400, "invalid_argument")
        await expect_error(await http.put(f"{url}/docs/k?expiry=abc", data=b"x"), 400, "invalid_argument")
        await expect_error(await http.put(f"{url}/docs/k?flags=99999999999", data=b"x"), 400)
        await expect_error(await http.put(f"{url}/docs/k", data=b"x", headers={"If-Match": "nope"}), 400)
        await expect_error(await http.put(f"{url}/docs/k", data=b"x",
                                          headers={"If-Match": '"5"', "If-None-Match": "*"}), 400)
        await expect_error(await http.delete(f"{url}/docs/missing"), 404, "not_found")
        await expect_error(await http.put(f"{url}/docs/missing", data=b"x", headers={"If-Match": '"5"'}), 404)
        await expect_error(await http.post(f"{url}/docs/_bulk", data=b"{not json"), 400, "invalid_json")
        await expect_error(await http.post(f"{url}/docs/_bulk", data=b'{"a": 1}'), 400)
        await expect_error(await http.post(f"{url}/docs/_bulk", data=b'[{"key": "a"}]'), 400)
        await expect_error(await http.post(f"{url}/docs/_bulk", data=b'[{"key": "", "value": 1}]'), 400)
        await expect_error(await http.post(
            f"{url}/docs/_bulk", data=b'[{"key": "a", "value": "!!", "encoding": "base64"}]'), 400)
        await expect_error(await http.get(f"{url}/vbuckets/abc"), 400)
        await expect_error(await http.get(f"{url}/vbuckets/{NVB}"), 404)
        await expect_error(await http.get(f"{url}/vbuckets/-1/failover-log"), 404)
        await expect_error(await http.get(f"{url}/nope"), 404)
        await expect_error(await http.post(f"{url}/health"), 405)
        # a rejected bulk batch wrote nothing; accepted data is intact
        r = await http.put(f"{url}/docs/keep", data=b"ok")
        assert r.status == 200
        r = await http.post(f"{url}/docs/_bulk", data=b'[{"key": "b1", "value": 1}, {"key": 5, "value": 1}]')
        await expect_error(r, 400)
        await expect_error(await http.get(f"{url}/docs/b1"), 404)
        assert await (await http.get(f"{url}/docs/keep")).read() == b"ok"

    run(kafka_broker, tmp_path, scenario)


def test_value_too_large_is_413(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        big = b"x" * (svc.bucket.config.max_value_size + 1)  # type: ignore[union-attr]
        await expect_error(await http.put(f"{url}/docs/big", data=big), 413, "value_too_large")

    run(kafka_broker, tmp_path, scenario)


def test_status_failover_health_metrics(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        r = await http.post(f"{url}/docs/_bulk", json=[{"key": f"d{i}", "value": {"i": i}} for i in range(200)])
        b = await r.json()
        assert b["written"] == 200
        assert all(it["token"] == {"vbucket": it["vbucket"], "vbuuid": it["vbuuid"], "seqno": it["seqno"]}
                   for it in b["items"])
        for _ in range(200):
            streams = await (await http.get(f"{url}/streams")).json()
            if all(s["lag"] == 0 for s in streams):
                break
            await asyncio.sleep(0.05)
        assert len(streams) == NVB
        assert sum(s["acknowledged_seqno"] for s in streams) == 200
        vb = await (await http.get(f"{url}/vbuckets/3")).json()
        assert vb["engine_high_seqno"] == vb["acknowledged_seqno"] and vb["streaming"]
        fo = await (await http.get(f"{url}/vbuckets/3/failover-log")).json()
        assert fo["failover_log"][0]["vbuuid"] == svc.bucket.failover_log(3)[0].vbuuid  # type: ignore[union-attr]
        h = await http.get(f"{url}/health")
        assert h.status == 200 and (await h.json())["status"] == "ok"
        m = await (await http.get(f"{url}/metrics")).text()
        for name in ("dcpgw_records_published_total", "dcpgw_records_acknowledged_total", "dcpgw_lag_items",
                     "dcpgw_rollbacks_total", "dcpgw_errors_total", "dcpgw_events_per_second",
                     "dcpgw_bytes_published_total"):
            assert name in m
        published = [ln for ln in m.splitlines() if ln.startswith("dcpgw_records_acknowledged_total")]
        assert float(published[0].split()[-1]) >= 200

    run(kafka_broker, tmp_path, scenario)


def test_stats_and_metrics_count_the_snapshots_mitigation_merged(kafka_broker: Broker, tmp_path: Path) -> None:
    """Writes trickling in one by one while the engine's flush cannot commit (another connection holds the
    storage's write lock): every pump round of the service's loop steps them as snapshots of their own, held
    until persisted; once the lock goes, they are published merged (gateway/snapshot_merge.py), counted in
    ``/stats`` ``snapshots_merged`` and ``dcpgw_snapshots_merged_total``, and the topic is caught up."""
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.bucket is not None and svc.publisher is not None
        with write_locked(db_file(svc.bucket)):
            for i in range(30):
                r = await http.put(f"{url}/docs/t{i}", json={"i": i})
                assert r.status == 200, await r.text()
                await asyncio.sleep(0.01)  # the loop pumps in between: a DCP step per round
        for _ in range(400):
            stats = await (await http.get(f"{url}/stats")).json()
            if stats["lag"] == 0 and stats["inflight"] == 0:
                break
            await asyncio.sleep(0.05)
        assert stats["lag"] == 0
        merged = stats["snapshots_merged"]
        assert merged == svc.publisher.snapshots_merged > 0  # 30 writes over 8 vbuckets, one round each
        m = await (await http.get(f"{url}/metrics")).text()
        assert f"dcpgw_snapshots_merged_total {float(merged)}" in m

    run(kafka_broker, tmp_path, scenario)


def test_issue_3_spellings_of_the_document_and_stats_routes(kafka_broker: Broker, tmp_path: Path) -> None:
    """Issue 3's contract: ``GET /buckets/{bucket}/docs/{key}`` answers the body with ``X-DCP-CAS``,
    ``X-DCP-Seqno``, ``X-DCP-Vbucket``, ``X-DCP-Vbuuid`` (404 when absent or deleted); ``GET
    /buckets/{bucket}/stats`` has per vbucket ``high_seqno``, ``persisted_seqno``, ``published_seqno``,
    ``vbuuid``. Another bucket's name is 404 ``no_bucket``."""

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        b = svc.settings.bucket
        r = await http.put(f"{url}/buckets/{b}/docs/k1", data=b'{"a": 1}')
        assert r.status in (200, 201)
        token = (await r.json())["token"]
        r = await http.get(f"{url}/buckets/{b}/docs/k1")
        assert r.status == 200 and await r.read() == b'{"a": 1}'
        vb = int(r.headers["X-DCP-Vbucket"])
        assert vb == token["vbucket"] and int(r.headers["X-DCP-Seqno"]) == token["seqno"]
        assert int(r.headers["X-DCP-Vbuuid"]) == token["vbuuid"]
        assert r.headers["ETag"] == f'"{r.headers["X-DCP-CAS"]}"'
        same = await http.get(f"{url}/docs/k1")  # the same document, the same headers on the short route
        assert same.headers["X-DCP-CAS"] == r.headers["X-DCP-CAS"]
        await expect_error(await http.get(f"{url}/buckets/{b}/docs/absent"), 404)
        assert (await http.delete(f"{url}/buckets/{b}/docs/k1")).status == 200
        await expect_error(await http.get(f"{url}/buckets/{b}/docs/k1"), 404)
        await expect_error(await http.get(f"{url}/buckets/other/docs/k1"), 404, "no_bucket")
        await expect_error(await http.get(f"{url}/buckets/other/stats"), 404, "no_bucket")
        for _ in range(200):  # published
            st = await (await http.get(f"{url}/buckets/{b}/stats")).json()
            row = st["vbuckets"][vb]
            if row["published_seqno"] == row["high_seqno"]:
                break
            await asyncio.sleep(0.05)
        assert len(st["vbuckets"]) == NVB and st["bucket"] == b
        assert row["vbucket"] == vb and row["high_seqno"] >= token["seqno"] and row["vbuuid"] == token["vbuuid"]
        assert row["published_seqno"] == row["high_seqno"] and "persisted_seqno" in row
        assert "records_published" in st  # the totals of GET /stats as well

    run(kafka_broker, tmp_path, scenario)


def test_unknown_query_parameters_of_a_document_route_are_refused(kafka_broker: Broker, tmp_path: Path) -> None:
    """A misspelt ``?expiri=10`` must not write the document without its expiry: 400, nothing written (as
    ``_bulk`` refuses an unknown entry field)."""

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        await expect_error(await http.put(f"{url}/docs/kexp?expiri=10", data=b"{}"), 400, "invalid_argument")
        await expect_error(await http.get(f"{url}/docs/kexp"), 404)  # not written
        await expect_error(await http.get(f"{url}/docs/kexp?bogus=1"), 400, "invalid_argument")
        assert (await http.put(f"{url}/docs/kexp?expiry=100&flags=3", data=b"{}")).status in (200, 201)
        await expect_error(await http.delete(f"{url}/docs/kexp?expiry=1"), 400, "invalid_argument")
        assert (await http.delete(f"{url}/docs/kexp")).status == 200

    run(kafka_broker, tmp_path, scenario)
