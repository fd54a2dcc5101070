"""A failing index backend (a search cluster unreachable, a full disk): commits are retried with backoff, /health
and /status say so, nothing is lost (docs/search.md "Backend failures")."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from connectors.exceptions import ConnectorError
from connectors.search.backend import Checkpoint
from connectors.search.indexer import SearchIndexer
from connectors.search.mapping import DocumentMapping
from connectors.search.server import build_app
from connectors.search.tantivy_backend import TantivyBackend
from tests.connectors.search.helpers import expected_index, index_contents
from tests.harness import Harness, write


class UnreachableFirst(TantivyBackend):
    """The real tantivy backend behind a link that refuses the first ``failures`` commits (fault injection)."""

    def __init__(self, path: Path, failures: int) -> None:
        super().__init__(path, DocumentMapping.dynamic_default())
        self.failures = failures
        self.attempts = 0

    def commit(self, checkpoint: Checkpoint) -> None:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise OSError("search cluster unreachable")
        super().commit(checkpoint)


def test_failing_backend_is_retried_and_nothing_is_lost(harness: Any, tmp_path: Path) -> None:
    h: Harness = harness(nvb=4)
    write(h.bucket, 120)
    h.settle()
    backend = UnreachableFirst(tmp_path / "ix" / "tantivy", failures=3)
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, tmp_path / "ix", backend=backend) as ix:
        seen: dict[str, Any] = {}

        async def health_while_failing() -> None:
            async with TestClient(TestServer(build_app(ix))) as c:
                for _ in range(400):
                    r = await c.get("/health")
                    if r.status == 503:
                        seen["health"] = await r.json()
                        seen["status"] = await (await c.get("/status")).json()
                        seen["metrics"] = await (await c.get("/metrics")).text()
                        return
                    await asyncio.sleep(0.01)

        t = threading.Thread(target=lambda: asyncio.run(health_while_failing()))
        t.start()
        started = time.monotonic()
        ix.catch_up()  # retries until the backend takes the commit
        t.join(30)
        assert time.monotonic() - started < 60  # did not hang
        assert backend.attempts == 4 and ix.stats.sync_failures == 3 and ix.backend_error is None
        assert "search cluster unreachable" in seen["health"]["reasons"][0]
        assert seen["status"]["backend_error"] == "OSError: search cluster unreachable"
        assert "dcpgw_search_sync_failures_total" in seen["metrics"]
        assert index_contents(ix) == expected_index(h.bucket.state_snapshot(), ix.mapping)


def test_backend_down_at_stop_keeps_the_changes_for_the_next_start(harness: Any, tmp_path: Path) -> None:
    h: Harness = harness(nvb=4)
    write(h.bucket, 60)
    h.settle()
    d = tmp_path / "ix"
    backend = UnreachableFirst(d / "tantivy", failures=10**6)
    ix = SearchIndexer(h.broker.bootstrap_servers, h.topic, d, backend=backend)
    threading.Timer(1.0, ix.stop).start()
    with pytest.raises(ConnectorError, match=r"kept in .*store\.sqlite"):
        ix.catch_up()
    ix.close()
    backend.close()
    with SearchIndexer(h.broker.bootstrap_servers, h.topic, d) as ix2:
        ix2.catch_up()
        assert index_contents(ix2) == expected_index(h.bucket.state_snapshot(), ix2.mapping)
