"""``dcpgw index --backend elasticsearch|opensearch`` as a process against noida-db (tests/connectors/noida_es.py):
bad flags fail in one line; the cluster's index equals the source; a cluster outage while running shows in
/status and /metrics, is retried, and loses nothing (docs/search.md "Elasticsearch / OpenSearch")."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from elasticsearch import Elasticsearch

from tests.connectors.noida_es import FLAVOR_PARAMS, NoidaElasticsearch
from tests.gateway.processes import CLEAN_ENV, call, dcpgw, dcpgw_background, request
from tests.harness import Harness, write


@pytest.mark.parametrize(("flags", "message"), [
    (["--backend", "solr"], "--backend 'solr': must be tantivy, elasticsearch or opensearch"),
    (["--backend", "elasticsearch"], "--backend elasticsearch needs --es-url URL"),
    (["--backend", "opensearch"], "--backend opensearch needs --es-url URL"),
    (["--backend", "opensearch", "--es-url", "localhost:9200"], "must be an http:// or https:// URL"),
    (["--backend", "opensearch", "--es-url", "http://x:9200", "--es-index", "_x"], "must not start with"),
    (["--backend", "elasticsearch", "--es-url", "localhost:9200"], "must be an http:// or https:// URL"),
    (["--backend", "elasticsearch", "--es-url", "http://x:9200", "--es-index", "Docs"], "must be lowercase"),
    (["--backend", "elasticsearch", "--es-url", "http://x:9200", "--es-index", "a,b"], "must not contain ','"),
    (["--backend", "elasticsearch", "--es-url", "http://x:9200", "--es-routing", "shard"],
     "must be 'key' or 'vbucket'"),
    # the --es-* options with the default tantivy backend are refused, not ignored
    (["--es-index", "foo"], "--es-index: only with --backend elasticsearch or opensearch (the backend is tantivy)"),
    (["--backend", "tantivy", "--es-url", "http://x:9200", "--es-batch-docs", "5"],
     "--es-url, --es-batch-docs: only with --backend elasticsearch or opensearch"),
])
def test_bad_elasticsearch_flags_fail_in_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    proc = dcpgw("index", "--topic", "t", "--index-dir", str(tmp_path / "ix"), *flags, env=CLEAN_ENV)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.fixture
def es() -> Iterator[NoidaElasticsearch]:
    server = NoidaElasticsearch().start()
    yield server
    server.close()


def expected(h: Harness) -> dict[str, Any]:
    out = {}
    for k, (v, _vb) in h.bucket.state_snapshot().items():
        try:
            doc = orjson.loads(v)
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            out[k.decode()] = doc
    return out


def es_docs(url: str, index: str) -> dict[str, Any]:
    c = Elasticsearch(url)
    c.indices.refresh(index=index)
    r = c.search(index=index, query={"match_all": {}}, size=10_000)
    c.close()
    return {h["_id"]: h["_source"] for h in r["hits"]["hits"]}


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.parametrize("backend", FLAVOR_PARAMS)
def test_cli_elasticsearch_backend_equal_to_source_across_a_cluster_outage(
        harness: Any, es: NoidaElasticsearch, backend: str, tmp_path: Path) -> None:
    h = harness(nvb=8, rollback_mitigation=False)
    write(h.bucket, 300)
    h.bucket.set("bin", bytes(range(256)))
    h.bucket.flush_all()
    h.settle()
    d = tmp_path / "ix"
    index = f"cli-{uuid.uuid4().hex[:8]}"
    flags = ["--topic", h.topic, "--index-dir", str(d), "--http-port", "0", "--bootstrap",
             h.broker.bootstrap_servers, "--backend", backend, "--es-url", es.url, "--es-index", index]
    proc = dcpgw("index", *flags, "--until-caught-up", env=CLEAN_ENV, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["docs"] == len(expected(h)) and out["binary_skipped"] == 1
    assert es_docs(es.url, index) == expected(h)

    p = dcpgw_background("index", *flags, "--commit-interval", "0.1")
    try:
        assert p.stderr is not None
        line = p.stderr.readline()
        assert "search API on http://" in line, line
        url = line.split(" on ")[1].split(" ")[0]
        es.stop()  # the cluster goes away while the indexer runs
        write(h.bucket, 100, start=1000)
        h.bucket.flush_all()
        h.settle()
        deadline = time.monotonic() + 60
        while True:
            try:
                st = call(f"{url}/status")
                if st["backend"]["reachable"] is False and st["backend"]["retries"] >= 2:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "the outage never showed in /status"
            time.sleep(0.1)
        assert st["backend"]["last_error"] and st["backend"]["backend"] == backend
        metrics = request(f"{url}/metrics").decode()
        assert "dcpgw_search_backend_reachable 0" in metrics
        with pytest.raises(urllib.error.HTTPError) as err:  # a query does not wait for the cluster
            request(f"{url}/search?q=n:1", timeout=30)
        assert err.value.code == 503 and json.loads(err.value.read())["error"] == "backend_unavailable"
        es.start()  # same port, same data
        highs = {vb: h.bucket.vbucket(vb).high_seqno for vb in range(8)}
        deadline = time.monotonic() + 90
        while True:
            st = call(f"{url}/status")
            seen = {v["vbucket"]: v["indexed_seqno"] for v in st["vbuckets"]}
            if st["backend"]["reachable"] and all(seen.get(vb) == s for vb, s in highs.items()):
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.1)
        assert "dcpgw_search_backend_reachable 1" in request(f"{url}/metrics").decode()
        p.send_signal(signal.SIGTERM)
        p.wait(30)
        assert p.returncode == 0, p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert es_docs(es.url, index) == expected(h)
