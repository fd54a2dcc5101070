"""GatewaySource: reads GET /vbuckets with HTTP Basic credentials (the gateway's API may require them); a refusal
or an unreachable gateway is SourceUnavailable (503 from the query API)."""

from __future__ import annotations

import asyncio
import base64

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from connectors.search.consistency import GatewaySource, SourceUnavailable

BODY = {"vbuckets": [
    {"vbucket": 0, "high_seqno": 7, "vbuuid": 11, "failover_log": [{"vbuuid": 11, "seqno": 5}, {"vbuuid": 3, "seqno": 0}]},
    {"vbucket": 1, "available": False, "message": "node down"}]}


def _app() -> web.Application:
    async def vbuckets(request: web.Request) -> web.Response:
        want = "Basic " + base64.b64encode(b"admin:s3cret").decode()
        if request.headers.get("Authorization") != want:
            return web.json_response({"error": "unauthorized", "message": "credentials required"}, status=401)
        return web.json_response(BODY)

    app = web.Application()
    app.router.add_get("/vbuckets", vbuckets)
    return app


def test_basic_credentials_are_sent_and_refusals_reported() -> None:
    async def scenario() -> None:
        async with TestServer(_app()) as server:
            url = str(server.make_url(""))
            ok = GatewaySource(url, "admin", "s3cret")
            try:
                got = await ok.vbuckets()
            finally:
                await ok.close()
            assert list(got) == [0] and got[0].high_seqno == 7 and got[0].failover_log[0].vbuuid == 11
            for src in (GatewaySource(url), GatewaySource(url, "admin", "wrong")):
                try:
                    with pytest.raises(SourceUnavailable, match="answered 401"):
                        await src.vbuckets()
                finally:
                    await src.close()
        gone = GatewaySource("http://127.0.0.1:9", timeout=2)
        try:
            with pytest.raises(SourceUnavailable, match="cannot read"):
                await gone.vbuckets()
        finally:
            await gone.close()

    asyncio.run(scenario())
