"""Fuzz of the HTTP API, bounded for CI (issue 16 "Fuzz"; docs/reliability.md "HTTP API input"):

* schemathesis drives every operation of the document the service serves at ``/openapi.json`` (valid and invalid
  requests) against a running gateway on the embedded broker, single bucket and a 2-node cluster: never a 5xx,
  every error a JSON ``{"error", "message"}``, status codes and content types as documented, no hang;
* hypothesis POSTs random, nested and garbage bodies to ``/docs/_bulk`` and ``/cluster/rebalance``: always a JSON
  4xx or a success, and a 4xx changed nothing in the engine.

The service runs on its own event loop in a thread; the tests speak plain HTTP to it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import content_type_conformance, status_code_conformance

from gateway.broker import Broker
from gateway.config import load_settings
from gateway.service import GatewayService
from tests.credentials import auth_headers
from tests.gateway.api_harness import engine_state

NVB = 8
FUZZ = settings(max_examples=200, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


class LiveGateway:
    """A GatewayService on its own event loop in a thread."""

    def __init__(self, broker: Broker, tmp: Path, **overrides: Any) -> None:
        self.settings = load_settings(None, data_dir=tmp / "data", bucket=f"fz{uuid.uuid4().hex[:8]}",
                                      num_vbuckets=NVB, http_port=0, **overrides)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)
        self.thread.start()
        self.svc = GatewayService(self.settings, broker.bootstrap_servers)
        self.call(self.svc.start)
        self.url = f"http://127.0.0.1:{self.svc.http_port}"

    def call(self, fn: Callable[[], Any], timeout: float = 60) -> Any:
        """``fn()`` on the service's loop (a coroutine function is awaited there)."""
        async def run() -> Any:
            res = fn()
            return await res if asyncio.iscoroutine(res) else res
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def state(self) -> Any:
        """Everything a write or a rebalance changes: engine seqnos, the map, the data directory."""
        def read() -> Any:
            c = self.svc.cluster
            vbmap = None if c is None else c.vbucket_map().to_json()
            return engine_state(self.svc), vbmap, sorted(p.name for p in self.settings.data_dir.iterdir())
        return self.call(read)

    def settled_state(self, timeout: float = 30) -> Any:
        """:meth:`state` once every copy of each vbucket holds the same high seqno: a write accepted by an
        earlier example reaches the replicas asynchronously, which must not be taken for a change made by a
        refused request."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            highs: dict[int, set[int]] = {}
            for _node, vb, high in st[0]:
                highs.setdefault(vb, set()).add(high)
            if all(len(h) == 1 for h in highs.values()) or time.monotonic() > deadline:
                return st
            time.sleep(0.02)

    def close(self) -> None:
        try:
            self.call(self.svc.stop)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


@pytest.fixture(params=[1, 2], ids=["single", "nodes2"])
def live(request: pytest.FixtureRequest, kafka_broker: Broker, tmp_path: Path) -> Iterator[LiveGateway]:
    opts: dict[str, Any] = {} if request.param == 1 else {"cluster_nodes": 2, "cluster_replicas": 1}
    gw = LiveGateway(kafka_broker, tmp_path, **opts)
    try:
        yield gw
    finally:
        gw.close()


def assert_answer(resp: requests.Response | Any, ok: set[int], what: str = "") -> None:
    """A success in ``ok`` or a JSON 4xx error; never a 5xx (``resp``: requests' or schemathesis' response)."""
    status = resp.status_code
    assert status < 500, (status, resp.content[:500], what)
    if status >= 400:
        ctype = {k.lower(): v for k, v in resp.headers.items()}.get("content-type", "")
        ctype = ctype[0] if isinstance(ctype, list) else ctype
        assert ctype.startswith("application/json"), (resp.headers, what)
        body = json.loads(resp.content)
        assert set(body) >= {"error", "message"} and body["message"], (body, what)
    else:
        assert status in ok, (status, resp.content[:500], what)


def test_schemathesis_fuzz_of_the_openapi_document(live: LiveGateway) -> None:
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json", timeout=10, headers=auth_headers())
    strategy = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    session = requests.Session()
    session.headers.update(auth_headers())  # as the admin user (tests/credentials.py)

    @FUZZ
    @given(case=strategy)
    def fuzz(case: schemathesis.Case) -> None:
        resp = case.call(base_url=live.url, session=session, timeout=20)
        assert_answer(resp, set(range(200, 300)), case.as_curl_command())
        if resp.status_code < 500:
            case.validate_response(resp, checks=[status_code_conformance, content_type_conformance])

    fuzz()
    assert session.get(f"{live.url}/stats", timeout=10).status_code == 200  # still serving


# ---------------------------------------------------------------------- hypothesis: garbage bodies
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                      st.floats(allow_nan=False), st.text(max_size=20))
JSON_ANY = st.recursive(JSON_LEAF, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                        max_leaves=20)
BULK_ENTRY = st.fixed_dictionaries(
    {"key": st.one_of(st.text(min_size=1, max_size=12), JSON_LEAF)},
    optional={"value": JSON_ANY, "op": st.sampled_from(["upsert", "insert", "replace", "delete", "x", 1]),
              "expiry": st.one_of(st.integers(-1, 2**33), JSON_LEAF), "flags": st.integers(-1, 2**33),
              "cas": st.one_of(st.integers(-1, 2**65), JSON_LEAF), "encoding": st.sampled_from(["base64", "hex"]),
              "extra": JSON_LEAF})
NODE = st.one_of(st.from_regex(r"[A-Za-z0-9_.-]{1,10}", fullmatch=True), st.text(max_size=70), JSON_LEAF)
REBALANCE = st.fixed_dictionaries({}, optional={"add": st.one_of(st.lists(NODE, max_size=12), JSON_LEAF),
                                                "remove": st.one_of(st.lists(NODE, max_size=4), JSON_LEAF),
                                                "other": JSON_LEAF})


def nested(depth: int, ch: bytes) -> bytes:
    close = {b"[": b"]", b"{": b"}"}[ch]
    return (ch * depth + close * depth) if ch == b"[" else (b'{"a":' * depth + b"1" + close * depth)


def bodies(structured: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        structured.map(lambda v: json.dumps(v).encode()),
        JSON_ANY.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=200),
        st.tuples(st.integers(1, 300_000), st.sampled_from([b"[", b"{"])).map(lambda t: t[1] * t[0]),
        st.tuples(st.integers(1, 30_000), st.sampled_from([b"[", b"{"])).map(lambda t: nested(*t)),
        structured.map(lambda v: json.dumps(v).encode()[:-1]),  # truncated
    )


@pytest.mark.parametrize("path, structured, ok", [
    ("/docs/_bulk", st.lists(BULK_ENTRY, max_size=6), {200}),
    ("/cluster/rebalance", REBALANCE, {202}),
], ids=["bulk", "rebalance"])
def test_garbage_bodies_answer_json_4xx_and_change_nothing(live: LiveGateway, path: str,
                                                           structured: st.SearchStrategy[Any], ok: set[int]) -> None:
    session = requests.Session()
    session.headers.update(auth_headers())  # as the admin user (tests/credentials.py)

    @FUZZ
    @given(body=bodies(structured))
    def fuzz(body: bytes) -> None:
        before = live.settled_state()
        resp = session.post(live.url + path, data=body, timeout=20)
        assert_answer(resp, ok)
        if 400 <= resp.status_code < 500:
            assert live.state() == before, body[:200]
        elif resp.status_code == 202:
            # an accepted rebalance commits its map when it ends: wait for that before the next example, or its
            # commit would be taken for a change made by the next (refused) request
            deadline = time.monotonic() + 30
            while session.get(live.url + "/cluster/rebalance", timeout=20).json()["status"] == "running":
                assert time.monotonic() < deadline, "the rebalance never ended"
                time.sleep(0.02)
        elif path == "/docs/_bulk":
            res = resp.json()
            assert len(res["items"]) == len(json.loads(body)) == res["written"] + res["failed"]

    fuzz()
