"""A hard failover of an in-process cluster node whose replicas lag (writes published, indexed, then lost): the
indexer applies the rollbacks and ends equal to the cluster's documents; a token of a lost write is 409, a token
of a surviving write is answered (docs/search.md "Exactness", "Consistency")."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from connectors.search.consistency import SourceVBucket
from connectors.search.indexer import SearchIndexer
from connectors.search.server import build_app
from gateway.broker import Broker
from tests.connectors.search.helpers import expected_index, index_contents
from tests.harness import CLUSTER_NVB, ClusterHarness, harnesses


class ClusterPositions:
    """What the gateway's GET /vbuckets answers, read from each vbucket's active node."""

    def __init__(self, h: ClusterHarness) -> None:
        self.h = h

    async def vbuckets(self) -> dict[int, SourceVBucket]:
        c = self.h.cluster
        out = {}
        for vb in range(CLUSTER_NVB):
            b = c.active_bucket(vb)
            out[vb] = SourceVBucket(vb, b.vbucket(vb).high_seqno, tuple(b.failover_log(vb)))
        return out

    async def close(self) -> None:
        pass


def _post(ix: SearchIndexer, h: ClusterHarness, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async def go() -> tuple[int, dict[str, Any]]:
        async with TestClient(TestServer(build_app(ix, ClusterPositions(h)))) as c:
            r = await c.post("/search", json=body)
            return r.status, await r.json()

    return asyncio.run(go())


def test_hard_failover_with_lagging_replicas(kafka_broker: Broker, tmp_path: Path) -> None:
    with harnesses(kafka_broker, tmp_path, ClusterHarness, prefix="c") as make:
        h = make(rollback_mitigation=False)
        c = h.cluster
        h.write(300)
        h.settle()
        d = tmp_path / "ix"
        victim = "n1"
        mine = set(c.vbucket_map().vbuckets_of(victim, slot=0))
        # the newest writes: on the victim's actives, published from memory, only partly replicated
        tokens = {}
        for i in range(200):
            r = c.write(f"new{i}", json.dumps({"t": "new", "i": i}).encode())
            tokens[f"new{i}"] = {"vbucket": r.vbucket, "vbuuid": r.vbuuid, "seqno": r.seqno}
        c.pump(rounds=1, max_messages=3)
        h.publish()
        with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:
            ix.catch_up()
        c.kill(victim)
        report = c.failover(victim)
        assert set(report.promoted) == mine and not report.lost
        h.write(100)
        h.settle()
        source = h.actives()
        lost = [k for k in tokens if k.encode() not in source and tokens[k]["vbucket"] in mine]
        kept = [k for k in tokens if k.encode() in source]
        assert lost and kept
        with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix:
            status, body = _post(ix, h, {"query": "*", "tokens": [tokens[lost[0]]], "timeout_ms": 100})
            assert status == 409 and body["error"] == "token_rolled_back", body
            vb = tokens[lost[0]]["vbucket"]
            assert body["rollback_seqno"] == report.entries[vb].seqno  # type: ignore[union-attr]
            ix.catch_up()
            assert ix.stats.rollbacks > 0
            assert index_contents(ix) == expected_index(source, ix.mapping)
            status, body = _post(ix, h, {"query": f"i:{kept[0][3:]} AND t:new", "tokens": [tokens[kept[0]]]})
            assert status == 200 and [x["key"] for x in body["hits"]] == [kept[0]], body
            status, body = _post(ix, h, {"query": "t:new", "consistency": "request_plus", "limit": 500})
            assert status == 200 and {x["key"] for x in body["hits"]} == set(kept)
