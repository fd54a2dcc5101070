"""Bad and hostile input on the HTTP API (issue 16, items 5 and 6; docs/gateway.md "POST /docs/_bulk", "Limits"):
a `_bulk` batch is validated completely before its first write (a 4xx wrote nothing) and answers per-item results
for what fails at run time; deep JSON, oversized bodies and aiohttp's own parser errors are JSON 4xx; the admin
routes bound their inputs and open a rebalance's new nodes off the event loop; /openapi.json describes every route.
Real broker, real engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import gateway.api
from gateway.broker import Broker
from gateway.openapi import described, document
from gateway.service import GatewayService
from tests.credentials import auth_headers, basic
from tests.gateway.api_harness import engine_state, expect_error, run_cluster
from tests.gateway.api_harness import run as run_single


async def raw_http(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as is on a new connection; the response's status, headers and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout=10)
    writer.close()
    return int(lines[0].split()[1]), headers, body


def assert_json_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict[str, Any]:
    assert status == expected, (status, body[:300])
    assert headers["content-type"].startswith("application/json"), headers
    doc = json.loads(body)
    assert set(doc) >= {"error", "message"} and doc["message"], doc
    return dict(doc)


# ---------------------------------------------------------------------- item 5: _bulk all-or-nothing
BAD_ENTRIES: list[tuple[Any, int]] = [
    ({"key": "x", "value": 1, "expiry": 4294967296}, 400),  # the case: refused by the engine mid-batch
    ({"key": "x", "value": 1, "expiry": True}, 400),
    ({"key": "x", "value": 1, "flags": 2**32}, 400),
    ({"key": "x", "value": 1, "cas": -1}, 400),
    ({"key": "x", "value": 1, "op": "insert", "cas": 5}, 400),
    ({"key": "x", "value": 1, "op": "merge"}, 400),
    ({"key": "x", "value": 1, "expiri": 5}, 400),  # a misspelt field is not silently ignored
    ({"key": "x", "value": 1, "encoding": "hex"}, 400),
    ({"key": "x", "op": "delete", "value": 1}, 400),
    ({"key": "\ud800", "value": 1}, 400),  # a lone surrogate: was a 500 (UnicodeEncodeError)
    ({"key": "x", "value": "\ud800"}, 400),
    ({"key": "x", "value": "v" * (20 * 1024 * 1024 + 1)}, 413),  # was written up to this entry, then 413
]


def test_a_bulk_batch_with_a_bad_entry_writes_nothing(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        before = engine_state(svc)
        for bad, status in BAD_ENTRIES:
            body = json.dumps([{"key": "first", "value": {"a": 1}}, bad]).encode()
            await expect_error(await http.post(f"{url}/docs/_bulk", data=body), status)
            await expect_error(await http.get(f"{url}/docs/first"), 404, "not_found")
            assert engine_state(svc) == before, bad
        # the valid batch goes through, answered per item; the fields `dcpgw load` reads are there
        r = await http.post(f"{url}/docs/_bulk", json=[{"key": "first", "value": {"a": 1}},
                                                        {"key": "x", "value": "s", "expiry": 4294967295}])
        assert r.status == 200, await r.text()
        res = await r.json()
        assert res["written"] == 2 and res["failed"] == 0 and res["errors"] is False
        assert [(i["key"], i["status"]) for i in res["items"]] == [("first", 200), ("x", 200)]
        assert all(set(i) >= {"vbucket", "vbuuid", "seqno", "cas"} for i in res["items"])

    run_single(kafka_broker, tmp_path, scenario)


def test_bulk_runtime_failures_are_answered_per_item(kafka_broker: Broker, tmp_path: Path) -> None:
    """What cannot be validated up front (CAS mismatch, exists, not found) fails alone; the rest is written."""

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        cas = (await (await http.put(f"{url}/docs/a", data=b"1")).json())["cas"]
        r = await http.post(f"{url}/docs/_bulk", json=[
            {"key": "a", "value": 2, "op": "insert"},             # exists
            {"key": "a", "value": 3, "cas": cas + 1},             # CAS mismatch
            {"key": "nope", "value": 1, "op": "replace"},         # not found
            {"key": "nope", "op": "delete"},                      # not found
            {"key": "a", "value": "4", "cas": cas, "flags": 7},   # written
            {"key": "b", "value": 5, "op": "insert"},             # written (201)
            {"key": "b", "op": "delete"},                         # written
        ])
        assert r.status == 200, await r.text()
        res = await r.json()
        got = [(i["key"], i["status"], i.get("error")) for i in res["items"]]
        assert got == [("a", 412, "exists"), ("a", 412, "cas_mismatch"), ("nope", 404, "not_found"),
                       ("nope", 404, "not_found"), ("a", 200, None), ("b", 201, None), ("b", 200, None)]
        assert all(i["message"] for i in res["items"] if "error" in i)
        assert res["written"] == 3 and res["failed"] == 4 and res["errors"] is True
        r = await http.get(f"{url}/docs/a")
        assert await r.read() == b"4" and r.headers["X-DCP-Flags"] == "7"
        await expect_error(await http.get(f"{url}/docs/b"), 404)

    run_single(kafka_broker, tmp_path, scenario)


def test_bulk_on_a_cluster_with_a_node_down_answers_per_item(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        assert svc.cluster is not None
        svc.cluster.kill("n0")
        r = await http.post(f"{url}/docs/_bulk", json=[{"key": f"k{i}", "value": i} for i in range(40)])
        assert r.status == 200, await r.text()
        res = await r.json()
        down = {i["key"] for i in res["items"] if i["status"] == 503}
        assert down and res["failed"] == len(down) and res["written"] == 40 - len(down)
        assert {i.get("error") for i in res["items"] if i["status"] == 503} == {"temporary_failure"}
        for i in range(40):
            r = await http.get(f"{url}/docs/k{i}")
            assert r.status == (503 if f"k{i}" in down else 200)

    run_cluster(kafka_broker, tmp_path, scenario)


# ---------------------------------------------------------------------- item 5: every error is a JSON 4xx
def test_deep_json_and_oversized_bodies_are_json_4xx(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        before = engine_state(svc)
        for path, limit in [("/docs/_bulk", None), ("/cluster/rebalance", 64 * 1024),
                            ("/cluster/failover", 64 * 1024)]:
            # 200k '[': a RecursionError answered as a plain-text 500 on main
            deep = b"[" * 200_000
            await expect_error(await http.post(url + path, data=deep), 400 if limit is None else 413)
            await expect_error(await http.post(url + path, data=b"[" * 20_000 + b"]" * 20_000), 400, "invalid_json")
            await expect_error(await http.post(url + path, data=b'{"a": "\xff"}'), 400, "invalid_json")
        # the admin routes take a small body: 100 KB is refused before it is parsed
        names = json.dumps({"add": ["n" * 60] * 1700}).encode()
        assert len(names) > 100_000
        await expect_error(await http.post(f"{url}/cluster/rebalance", data=names), 413, "request_entity_too_large")
        # a body larger than the API's limit (64 MiB), announced by Content-Length, is refused without reading it
        port = svc.http_port
        st, hd, body = await raw_http(port, b"POST /docs/_bulk HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                            b"\r\nAuthorization: " + basic().encode()
                                            + b"\r\nContent-Length: 70000000\r\n\r\n[")
        assert_json_error(st, hd, body, 413)
        assert engine_state(svc) == before
        assert (await (await http.get(f"{url}/cluster/map")).json())["revision"] == 1

    run_cluster(kafka_broker, tmp_path, scenario)


def test_aiohttp_own_errors_are_json(kafka_broker: Broker, tmp_path: Path) -> None:
    """Errors raised before any handler runs: the HTTP parser's (bad request line, a 100 KB header, a bad
    chunk) answered in text/plain on main; the router's 404 / 405."""

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        port = svc.http_port
        assert_json_error(*await raw_http(port, b"GARBAGE\r\n\r\n"), 400)
        assert_json_error(*await raw_http(port, b"GET /health HTTP/9.9.9\r\n\r\n"), 400)
        st, hd, body = await raw_http(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000
                                      + b"\r\n\r\n")
        assert 400 <= st < 500
        assert_json_error(st, hd, body, st)
        assert_json_error(*await raw_http(port, b"POST /docs/_bulk HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                                                b"\r\n\r\nzz\r\n"), 400)
        await expect_error(await http.get(f"{url}/nope"), 404, "not_found")
        await expect_error(await http.post(f"{url}/health"), 405, "method_not_allowed")
        await expect_error(await http.put(f"{url}/stats"), 405)
        # the service still serves
        assert (await http.get(f"{url}/stats")).status == 200

    run_single(kafka_broker, tmp_path, scenario)


# ---------------------------------------------------------------------- item 6: bounded admin input
def test_rebalance_and_failover_inputs_are_bounded(kafka_broker: Broker, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        data_dir = svc.settings.data_dir
        dirs = sorted(p.name for p in data_dir.iterdir())
        t0 = time.monotonic()
        # the request: 2000 new nodes (was: 930 node directories, 3.5 GB, a blocked event loop)
        r = await http.post(f"{url}/cluster/rebalance", json={"add": [f"x{i}" for i in range(2000)]})
        await expect_error(r, 400, "invalid_argument")
        assert time.monotonic() - t0 < 10  # generous: it is refused before any work
        await expect_error(await http.post(f"{url}/cluster/rebalance",
                                           json={"add": [f"x{i}" for i in range(9)]}), 400, "invalid_argument")
        for bad in ["../evil", "a/b", "x" * 65, " n3", "n3\n", "é"]:
            await expect_error(await http.post(f"{url}/cluster/rebalance", json={"add": [bad]}), 400)
            await expect_error(await http.post(f"{url}/cluster/rebalance", json={"remove": [bad]}), 400)
            await expect_error(await http.post(f"{url}/cluster/failover", json={"node": bad}), 400)
        # the documented maximum cluster size (64), here lowered to 4 to test it cheaply
        monkeypatch.setattr(gateway.api, "MAX_CLUSTER_NODES", 4)
        await expect_error(await http.post(f"{url}/cluster/rebalance", json={"add": ["n3", "n4"]}), 400)
        assert sorted(p.name for p in data_dir.iterdir()) == dirs
        assert (await (await http.get(f"{url}/cluster/map")).json())["revision"] == 1
        r = await http.post(f"{url}/cluster/rebalance", json={"add": ["n3"]})
        assert r.status == 202, await r.text()

    run_cluster(kafka_broker, tmp_path, scenario)


def test_rebalance_opens_new_nodes_off_the_event_loop(kafka_broker: Broker, tmp_path: Path) -> None:
    """While the new nodes' engines are being opened (here held on the worker threads) the API keeps answering,
    a second rebalance is refused with 409, and the first one starts once they are open. On main the engines were
    opened on the event loop's thread inside the request."""

    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        gate = threading.Event()
        # occupy every thread of the default executor so the nodes' opening waits for the gate
        blockers = [loop.run_in_executor(None, gate.wait) for _ in range(64)]
        first = asyncio.create_task(http.post(f"{url}/cluster/rebalance", json={"add": ["n3", "n4"]}))
        try:
            for _ in range(100):
                if svc.rebalance_preparing:
                    break
                await asyncio.sleep(0.02)
            assert svc.rebalance_preparing
            assert (await http.get(f"{url}/health")).status == 200
            assert (await http.put(f"{url}/docs/during", data=b"1")).status == 200
            await expect_error(await http.post(f"{url}/cluster/rebalance", json={"add": ["n5"]}), 409,
                               "rebalance_running")
            assert not first.done()
        finally:
            gate.set()
            await asyncio.gather(*blockers)
        r = await first
        assert r.status == 202, await r.text()
        assert {"n3", "n4"} <= set((await r.json())["nodes"])

    run_cluster(kafka_broker, tmp_path, scenario)


# ---------------------------------------------------------------------- /openapi.json
def test_openapi_document_describes_every_route(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, http: aiohttp.ClientSession) -> None:
        r = await http.get(f"{url}/openapi.json")
        assert r.status == 200 and r.content_type == "application/json"
        doc = await r.json()
        assert doc["openapi"].startswith("3.")
        app = svc.runner.app  # type: ignore[union-attr]
        routes = gateway.api.app_routes(app)
        served = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
        assert routes <= described(), routes - described()  # every route the app serves is described
        assert served == routes  # and the served document holds exactly the app's routes
        for (method, path) in routes:
            op = doc["paths"][path][method.lower()]
            assert op["responses"] and op["summary"]
            for seg in path.split("/"):
                if seg.startswith("{"):
                    assert seg[1:-1] in {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
        assert {("GET", "/health/live"), ("GET", "/health/ready")} <= described()
        assert document()["paths"].keys() >= {"/health/live", "/health/ready"}

    run_single(kafka_broker, tmp_path, scenario)


@pytest.mark.slow
def test_sigint_stops_dcpgw_up_during_a_rebalance(kafka_broker: Broker, tmp_path: Path) -> None:
    """`dcpgw up --nodes 3` with the largest rebalance one request may start (8 new nodes): SIGINT right after
    the 202 stops the process cleanly (on main a large rebalance request held the event loop and SIGINT waited)."""
    import signal
    import urllib.request

    from tests.gateway.processes import GatewayProc

    data = tmp_path / "data"
    data.mkdir()
    gw = GatewayProc(kafka_broker, data, f"sig{uuid.uuid4().hex[:8]}", DCPGW_CLUSTER_NODES="3",
                     DCPGW_CLUSTER_REPLICAS="1")
    gw.start()
    try:
        gw.bulk([{"key": f"d{i}", "value": {"i": i, "pad": "x" * 200}} for i in range(3000)])
        req = urllib.request.Request(gw.url + "/cluster/rebalance", method="POST", headers=auth_headers(),
                                     data=json.dumps({"add": [f"a{i}" for i in range(8)]}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 202
            assert json.loads(r.read())["status"] in ("running", "done")
        assert gw.proc is not None
        gw.proc.send_signal(signal.SIGINT)
        assert gw.proc.wait(60) == 0  # generous: "did not hang"
    finally:
        if gw.proc is not None and gw.proc.poll() is None:
            gw.proc.kill()
            gw.proc.wait(10)
