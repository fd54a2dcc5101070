"""`dcpgw up` and `dcpgw index` as real processes: request_plus right after acknowledged HTTP writes sees them,
across kill -9 of the gateway and of the indexer; at the end the index holds exactly the gateway's documents."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import pytest

from gateway.broker import Broker
from tests.gateway.processes import GatewayProc, call, dcpgw_background


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def _start_indexer(data: Path, d: Path) -> tuple[subprocess.Popen[str], str]:
    p = dcpgw_background("index", "--data-dir", str(data), "--index-dir", str(d), "--http-port", "0",
                         "--commit-interval", "1.0")
    assert p.stderr is not None
    line = p.stderr.readline()
    assert "search API on http://" in line, line + (p.stderr.read() if p.poll() is not None else "")
    return p, line.split(" on ")[1].split(" ")[0]


def _search(url: str, **params: Any) -> dict[str, Any]:
    return dict(call(f"{url}/search?{urllib.parse.urlencode(params)}", timeout=60))


@pytest.mark.slow
def test_request_plus_across_kill9_of_gateway_and_indexer(kafka_broker: Broker, tmp_path: Path) -> None:
    data = tmp_path / "data"
    gw = GatewayProc(kafka_broker, data, f"s{uuid.uuid4().hex[:8]}", DCPGW_HTTP_PORT=str(_free_port()))
    gw.start()
    d = tmp_path / "ix"
    ix, url = _start_indexer(data, d)
    written: set[str] = set()
    try:
        for rnd in range(6):
            batch: list[dict[str, Any]] = [{"key": f"doc{rnd}-{i}", "value": {"title": f"round{rnd}", "i": i}}
                                           for i in range(50)]
            gw.bulk(batch)
            written |= {b["key"] for b in batch}
            # right after the acknowledged writes: request_plus sees every one of this round
            r = _search(url, q=f"title:round{rnd}", limit=100, consistency="request_plus", timeout_ms=30_000)
            assert r["total"] == 50, r
            if rnd == 2:  # kill -9 of the gateway: the indexer's source is gone until it restarts
                gw.kill9()
                try:
                    call(f"{url}/search?q=*&consistency=request_plus", timeout=30)
                    raise AssertionError("request_plus answered without a source")
                except urllib.error.HTTPError as e:
                    assert e.code == 503 and json.loads(e.read())["error"] == "source_unavailable"
                gw.start()
            if rnd == 4:  # kill -9 of the indexer, restarted on the same index directory
                os.kill(ix.pid, signal.SIGKILL)
                ix.wait(30)
                ix, url = _start_indexer(data, d)
        # the end: exactly the gateway's documents (acknowledged writes a kill -9 of `dcpgw up` lost are in
        # neither), with their bodies as stored fields
        source = {}
        for k in sorted(written):
            try:
                source[k] = call(f"{gw.url}/docs/{k}")
            except urllib.error.HTTPError as e:
                assert e.code == 404
        r = _search(url, q="*", limit=1000, consistency="request_plus", timeout_ms=60_000)
        assert {h["key"]: h["fields"] for h in r["hits"]} == source and r["total"] == len(source)
        st = call(f"{url}/status")
        assert st["lag"] == 0 and st["backend_error"] is None
    finally:
        if ix.poll() is None:
            ix.send_signal(signal.SIGTERM)
            try:
                ix.wait(30)
            except subprocess.TimeoutExpired:
                ix.kill()
        gw.close()
