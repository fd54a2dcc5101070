"""A token of a write lost in a hard failover is answered 409 with the rollback point (the branch point of the
source's new failover entry), not silently; after the indexer applied the rollback, the lost document is gone
from the index (docs/search.md "Consistency")."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from connectors.search.consistency import SourceVBucket
from connectors.search.indexer import SearchIndexer
from connectors.search.server import build_app
from tests.harness import Harness


class BucketPositions:
    """The source's positions read straight from the in-process bucket (what GET /vbuckets answers)."""

    def __init__(self, h: Harness) -> None:
        self.h = h

    async def vbuckets(self) -> dict[int, SourceVBucket]:
        b = self.h.bucket
        return {vb: SourceVBucket(vb, b.vbucket(vb).high_seqno, tuple(b.failover_log(vb))) for vb in range(self.h.nvb)}

    async def close(self) -> None:
        pass


async def _post(app: web.Application, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with TestClient(TestServer(app)) as c:
        r = await c.post("/search", json=body)
        return r.status, await r.json()


def test_token_of_a_write_lost_in_a_failover_is_409(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=2, rollback_mitigation=False)
    h.bucket.set("kept", b'{"t": "kept"}')
    h.bucket.flush_all()
    h.settle()
    lost = h.bucket.set("lost", b'{"t": "lost"}')  # never persisted
    token = {"vbucket": lost.vbucket, "vbuuid": lost.vbuuid, "seqno": lost.seqno}
    h.publish_unpersisted()
    d = tmp_path / "ix"
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:
        ix.catch_up()
        # before the failover the token is fine and the index sees its write
        status, body = asyncio.run(_post(build_app(ix, BucketPositions(h)), {"query": "t:lost", "tokens": [token]}))
        assert status == 200 and [x["key"] for x in body["hits"]] == ["lost"]
    h.crash_engine()  # the engine restarts from disk: a new branch at the persisted seqno
    branch_point = h.bucket.failover_log(lost.vbucket)[0].seqno
    assert branch_point < lost.seqno
    h.bucket.set("after", json.dumps({"t": "after"}).encode())
    h.bucket.flush_all()
    h.settle()
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:
        app = build_app(ix, BucketPositions(h))
        status, body = asyncio.run(_post(app, {"query": "*", "tokens": [token], "timeout_ms": 100}))
        assert status == 409 and body["error"] == "token_rolled_back"
        assert body["rollback_seqno"] == branch_point and body["seqno"] == lost.seqno
        ix.catch_up()
        assert ix.stats.rollbacks > 0
        status, body = asyncio.run(_post(build_app(ix, BucketPositions(h)),
                                         {"query": "*", "consistency": "request_plus", "limit": 50}))
        assert status == 200 and {x["key"] for x in body["hits"]} == {"kept", "after"}
