"""The query API with consistency against a running GatewayService (real broker, engine, HTTP API): request_plus
right after acknowledged writes sees them, at_plus with a token sees its write, a rolled-back token is 409, a
wait that cannot finish is 504, bad queries are 400 (docs/search.md "Query API", "Consistency")."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from connectors.search.consistency import GatewaySource
from connectors.search.indexer import SearchIndexer
from connectors.search.server import build_app
from gateway.broker import Broker
from gateway.service import GatewayService
from tests.credentials import ADMIN_PASSWORD, ADMIN_USER
from tests.gateway.api_harness import expect_error, run


@asynccontextmanager
async def search_service(svc: GatewayService, gw_url: str, d: Path, *, source: bool = True,
                         **kw: Any) -> AsyncIterator[tuple[SearchIndexer, str]]:
    """An indexer on the service's topic, consuming in a thread, with its query API on a free port."""
    ix = SearchIndexer(svc.bootstrap_servers, svc.topic, d, **kw)
    t = threading.Thread(target=ix.run, daemon=True)
    t.start()
    app = build_app(ix, GatewaySource(gw_url, ADMIN_USER, ADMIN_PASSWORD) if source else None)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield ix, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        ix.stop()
        await asyncio.get_running_loop().run_in_executor(None, t.join, 30)
        ix.close()


def test_request_plus_and_at_plus_see_acknowledged_writes(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        # slow backend commits: only the consistency wait makes the writes visible in time
        async with search_service(svc, url, tmp_path / "ix", commit_interval=0.3) as (_ix, surl):
            for round_ in range(8):
                r = await http.put(f"{url}/docs/doc{round_}", json={"title": f"hello round{round_}", "n": round_})
                assert r.status == 200
                tok = (await r.json())["token"]
                # at_plus with the write's token
                r = await http.post(f"{surl}/search", json={"query": f"title:round{round_}", "tokens": [tok],
                                                             "timeout_ms": 20_000})
                assert r.status == 200, await r.text()
                body = await r.json()
                assert [h["key"] for h in body["hits"]] == [f"doc{round_}"] and body["total"] == 1
                assert body["hits"][0]["fields"] == {"title": f"hello round{round_}", "n": round_}
                assert body["seqnos"][str(tok["vbucket"])] >= tok["seqno"]
                # request_plus right after a write (and a delete) acknowledged by the HTTP API
                r = await http.post(f"{url}/docs/_bulk", json=[{"key": f"bulk{round_}", "value": {"title": "bulk"}}])
                assert (await r.json())["written"] == 1
                if round_:
                    assert (await http.delete(f"{url}/docs/doc{round_ - 1}")).status == 200
                r = await http.get(f"{surl}/search", params={"q": "title:bulk OR title:hello", "limit": "100",
                                                             "consistency": "request_plus", "timeout_ms": "20000"})
                assert r.status == 200, await r.text()
                keys = {h["key"] for h in (await r.json())["hits"]}
                assert keys == {f"bulk{i}" for i in range(round_ + 1)} | {f"doc{round_}"}
            st = await (await http.get(f"{surl}/status")).json()
            assert st["lag"] == 0 and st["indexed"] >= 16 and st["deleted"] >= 7
            m = await (await http.get(f"{surl}/metrics")).text()
            assert "dcpgw_search_indexed_total" in m and 'dcpgw_search_lag_seqnos{vbucket="0"} 0' in m
            assert "dcpgw_search_commit_seconds_count" in m

    run(kafka_broker, tmp_path, scenario)


def test_bad_queries_rolled_back_tokens_and_timeouts(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        async with search_service(svc, url, tmp_path / "ix") as (_ix, surl):
            r = await http.put(f"{url}/docs/a", json={"title": "x"})
            tok = (await r.json())["token"]
            # malformed query: 400 with tantivy's parser message
            body = await expect_error(await http.get(f"{surl}/search", params={"q": "title:("}), 400, "invalid_query")
            assert "Syntax Error" in body["message"]
            await expect_error(await http.get(f"{surl}/search", params={"q": "nosuchfield:1 AND"}), 400)
            await expect_error(await http.get(f"{surl}/search"), 400, "invalid_argument")
            await expect_error(await http.get(f"{surl}/search", params={"q": "*", "limit": "-1"}), 400)
            await expect_error(await http.get(f"{surl}/search", params={"q": "*", "offset": "1000000000"}), 400)
            r = await http.post(f"{surl}/search", json={"query": "*", "limit": 0, "tokens": [tok]})
            assert r.status == 200 and (await r.json())["hits"] == [] and (await r.json())["total"] == 1
            await expect_error(await http.get(f"{surl}/search", params={"q": "*", "consistency": "eventual"}), 400)
            await expect_error(await http.get(f"{surl}/search", params={"q": "*", "consistency": "at_plus"}), 400)
            await expect_error(await http.post(f"{surl}/search", data=b"{nope"), 400, "invalid_json")
            await expect_error(await http.post(f"{surl}/search", json={"query": "*", "tokens": [{"vbucket": -1}]}), 400)
            await expect_error(await http.post(f"{surl}/search", json={"query": "*", "bogus": 1}), 400)
            await expect_error(await http.post(f"{surl}/search", json={"query": 5}), 400)
            # a token of a branch the source never had: rolled back (409 with the rollback point)
            bad = {**tok, "vbuuid": tok["vbuuid"] ^ 0x5A5A5A}
            body = await expect_error(await http.post(f"{surl}/search", json={"query": "*", "tokens": [bad]}),
                                      409, "token_rolled_back")
            assert body["rollback_seqno"] == 0 and body["vbucket"] == tok["vbucket"]
            # a token of the current branch beyond anything written: the wait times out, 504 says what is missing
            ahead = {**tok, "seqno": tok["seqno"] + 1000}
            body = await expect_error(await http.post(f"{surl}/search", json={
                "query": "*", "tokens": [ahead], "timeout_ms": 300}), 504, "timeout")
            assert body["missing"] == [{"vbucket": tok["vbucket"], "wanted_seqno": tok["seqno"] + 1000,
                                        "indexed_seqno": body["missing"][0]["indexed_seqno"]}]
            assert body["missing"][0]["indexed_seqno"] <= tok["seqno"]
        # request_plus without a source: 400 naming the option
        async with search_service(svc, url, tmp_path / "ix2", source=False) as (_ix, surl):
            body = await expect_error(await http.get(f"{surl}/search", params={"q": "*", "consistency": "request_plus"}),
                                      400, "no_source")
            assert "--source-url" in body["message"]
        # an unreachable source: 503
        async with search_service(svc, "http://127.0.0.1:9", tmp_path / "ix3") as (_ix, surl):
            await expect_error(await http.get(f"{surl}/search", params={"q": "*", "consistency": "request_plus"}),
                               503, "source_unavailable")

    run(kafka_broker, tmp_path, scenario)


def test_at_plus_without_a_source_checks_the_indexers_failover_logs(kafka_broker: Broker, tmp_path: Path) -> None:
    """Without --source-url a token is covered only on a branch the indexer's own failover log has: a vbuuid it
    never saw is waited for (504), not answered as covered; a vbucket the topic does not have is a 400 at once."""
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        async with search_service(svc, url, tmp_path / "ix", source=False) as (ix, surl):
            r = await http.put(f"{url}/docs/a", json={"title": "hello"})
            tok = (await r.json())["token"]
            r = await http.post(f"{surl}/search", json={"query": "title:hello", "tokens": [tok], "timeout_ms": 20_000})
            assert r.status == 200, await r.text()
            assert [h["key"] for h in (await r.json())["hits"]] == ["a"]
            # a branch the indexer never saw, at a seqno it has long indexed: not covered
            odd = {"vbucket": tok["vbucket"], "vbuuid": 12345, "seqno": 1}
            body = await expect_error(await http.post(f"{surl}/search", json={
                "query": "*", "tokens": [odd], "timeout_ms": 300}), 504, "timeout")
            assert body["missing"] == [{"vbucket": tok["vbucket"], "vbuuid": 12345, "wanted_seqno": 1,
                                        "indexed_seqno": 0}]
            # a vbucket the topic does not have: 400 at once, not a wait
            assert ix.vbuckets is not None and ix.vbuckets > tok["vbucket"]
            t0 = asyncio.get_running_loop().time()
            body = await expect_error(await http.post(f"{surl}/search", json={
                "query": "*", "tokens": [{"vbucket": 5000, "vbuuid": 1, "seqno": 1}]}), 400, "invalid_argument")
            assert f"has {ix.vbuckets} vbuckets" in body["message"] and body["vbucket"] == 5000
            assert asyncio.get_running_loop().time() - t0 < 5
        async with search_service(svc, url, tmp_path / "ix2") as (ix, surl):  # with the source too
            await expect_error(await http.post(f"{surl}/search", json={
                "query": "*", "tokens": [{"vbucket": ix.vbuckets, "vbuuid": 1, "seqno": 1}]}), 400, "invalid_argument")

    run(kafka_broker, tmp_path, scenario)


def test_non_integer_numbers_and_empty_queries_are_refused(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        async with search_service(svc, url, tmp_path / "ix", source=False) as (_ix, surl):
            for member, bad in [("limit", "1"), ("limit", 1.5), ("limit", True), ("offset", "1"),
                                ("offset", 2.0), ("timeout_ms", "100"), ("timeout_ms", False)]:
                body = await expect_error(await http.post(f"{surl}/search", json={"query": "*", member: bad}),
                                          400, "invalid_argument")
                assert member in body["message"] and "integer" in body["message"], body
            r = await http.post(f"{surl}/search", json={"query": "*", "limit": 1, "offset": 0, "timeout_ms": 10})
            assert r.status == 200, await r.text()
            r = await http.get(f"{surl}/search", params={"q": "*", "limit": "1", "offset": "0"})
            assert r.status == 200, await r.text()
            for q in ("", "   "):
                body = await expect_error(await http.get(f"{surl}/search", params={"q": q}), 400, "invalid_argument")
                assert "*" in body["message"]
                await expect_error(await http.post(f"{surl}/search", json={"query": q}), 400, "invalid_argument")

    run(kafka_broker, tmp_path, scenario)
