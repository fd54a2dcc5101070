"""The replicator's status and metrics (docs/xdcr.md "Status and metrics"): ``/status`` and ``dcpgw xdcr status``
are one document; the HTTP server answers JSON to every request; no placeholder samples; documents the GET_META
pre-check kept back are counted apart from the target's rejections; ``lag_seconds`` is the age of the oldest
change consumed but not yet applied; bad input leaves no state directory behind."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from connectors.xdcr.metrics import StatusServer, prometheus_text
from connectors.xdcr.replicator import XdcrReplicator, read_status
from engine.dcp.stream import SnapshotFlags, SnapshotMarker
from schemas.codec import RecordEncoder
from schemas.records import ValueFormat
from tests.gateway.processes import dcpgw
from tests.harness import Harness, write


def _loaded(h: Harness, n: int = 60) -> None:
    write(h.bucket, n)
    h.bucket.flush_all()
    h.settle()


def _request(url: str, method: str) -> tuple[int, str, dict[str, Any]]:
    req = urllib.request.Request(url, method=method, data=b"{}" if method in ("POST", "PUT") else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), json.loads(e.read())


def test_live_and_persisted_status_are_one_document(harness: Harness, target: Any, tmp_path: Path) -> None:
    """``GET /status`` has the ``filters`` and per-vbucket ``checkpoints`` of ``dcpgw xdcr status``, and
    ``dcpgw xdcr status`` the per-vbucket ``written`` of ``/status`` (before: always 0)."""
    h = harness
    _loaded(h)
    state = tmp_path / "state"
    with XdcrReplicator(h.client, h.topic, f"couchbase://127.0.0.1:{target.port}", state) as r:
        r.run(until_caught_up=True)
        srv = StatusServer(r.status)
        try:
            live = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/status", timeout=10).read())
        finally:
            srv.close()
    saved = read_status(state)
    assert set(live) == set(saved) == {"topic", "target", "filters", "counters", "vbuckets"}
    assert live["filters"] == saved["filters"] and live["filters"]["key_regex"] is None
    assert live["topic"] == saved["topic"] == h.topic and live["target"] == saved["target"]
    assert live["counters"]["written"] == saved["counters"]["written"] > 0
    assert live["counters"]["target"]["state"] == saved["counters"]["target"]["state"] == "ok"
    assert sum(v["written"] for v in saved["vbuckets"].values()) == saved["counters"]["written"]
    assert live["vbuckets"] == saved["vbuckets"]
    assert all(v["checkpoints"] >= 1 for v in live["vbuckets"].values())
    # the CLI prints the same document
    p = dcpgw("xdcr", "status", "--state-dir", str(state))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == json.loads(json.dumps(saved))


def test_status_server_answers_json_to_every_request(harness: Harness, target: Any, tmp_path: Path) -> None:
    """POST/PUT/DELETE on /status or /metrics: a JSON 405 (before: 501 with an HTML page); an unknown path: a
    JSON 404 whatever the method; and ``/metrics`` has no placeholder sample when nothing was rejected."""
    h = harness
    _loaded(h, 20)
    with XdcrReplicator(h.client, h.topic, f"couchbase://127.0.0.1:{target.port}", tmp_path / "state") as r:
        r.run(until_caught_up=True)
        assert r.metrics.rejected == {}
        srv = StatusServer(r.status)
        try:
            base = f"http://127.0.0.1:{srv.port}"
            for method in ("POST", "PUT", "DELETE", "PATCH"):
                for path in ("/status", "/metrics"):
                    code, ctype, body = _request(base + path, method)
                    assert (code, ctype, body["error"]) == (405, "application/json", "method_not_allowed"), \
                        (method, path)
                code, ctype, body = _request(base + "/nope", method)
                assert (code, ctype, body["error"]) == (404, "application/json", "not_found"), method
            text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        finally:
            srv.close()
    assert 'reason="none"' not in text
    assert "# TYPE dcpgw_xdcr_docs_rejected_total counter" in text  # the family, without samples
    assert "dcpgw_xdcr_docs_rejected_total{" not in text


def test_precheck_skips_are_counted_apart_from_the_targets_rejections(harness: Harness, target: Any,
                                                                      tmp_path: Path) -> None:
    """A second replicator (fresh state) over a target that holds everything: documents above the optimistic
    threshold are kept back by GET_META and counted ``skipped.identical`` (never sent); ``rejected_identical``
    is what the target itself rejected, equal to the target's own counter (before: both in
    ``rejected_identical``, e.g. 30,572 reported vs 369 counted by the target)."""
    h = harness
    for i in range(30):
        h.bucket.set(f"big{i}", json.dumps({"n": i, "pad": "x" * 400}).encode())
    _loaded(h, 40)
    url = f"couchbase://127.0.0.1:{target.port}"
    with XdcrReplicator(h.client, h.topic, url, tmp_path / "a") as r:
        r.run(until_caught_up=True)
    before = target.require().stats()
    with XdcrReplicator(h.client, h.topic, url, tmp_path / "b") as r:
        r.run(until_caught_up=True)
        m = r.metrics
    after = target.require().stats()
    by_target = int(after["rejected_identical"]) - int(before["rejected_identical"])
    assert m.skipped == {"identical": 30}, m.skipped
    assert m.written == 0 and m.rejected == {"rejected_identical": by_target} and by_target > 0, m.rejected
    saved = read_status(tmp_path / "b")
    assert saved["counters"]["skipped"] == {"identical": 30}
    text = prometheus_text(saved)
    assert 'dcpgw_xdcr_docs_skipped_total{reason="identical"} 30' in text
    assert f'dcpgw_xdcr_docs_rejected_total{{reason="rejected_identical"}} {by_target}' in text


def test_lag_seconds_is_the_age_of_the_oldest_change_not_yet_applied(harness: Harness, target: Any,
                                                                     tmp_path: Path) -> None:
    """A vbucket idle for 24 s, then a snapshot of it consumed (its marker read, its changes not yet applied):
    lag_seconds is 0 at once (before: 24, the time since the vbucket last applied a snapshot) and grows with
    the age of that snapshot; the other vbuckets, caught up, show 0."""
    h = harness
    _loaded(h, 40)
    now = [1000.0]
    with XdcrReplicator(h.client, h.topic, f"couchbase://127.0.0.1:{target.port}", tmp_path / "state",
                        clock=lambda: now[0]) as r:
        r.run(until_caught_up=True)
        vb0 = r.status()["vbuckets"]["0"]
        assert (vb0["lag_seqnos"], vb0["lag_seconds"]) == (0, 0)
        now[0] += 24.0  # idle
        # a snapshot of vbucket 0 whose changes have not arrived yet (partition 0: vbucket 0 of 8)
        applied = vb0["applied_seqno"]
        rec = RecordEncoder(ValueFormat.AVRO).snapshot(
            SnapshotMarker(0, applied + 1, applied + 5, SnapshotFlags.MEMORY), vb0["source_vbuuid"])
        p = Producer({"bootstrap.servers": h.broker.bootstrap_servers})
        p.produce(h.topic, value=rec.value, key=rec.key, partition=0, headers=rec.headers)
        p.flush(10)
        t = threading.Thread(target=r.run)  # the same replicator goes on consuming
        t.start()
        try:
            deadline = time.monotonic() + 30
            while r.status()["vbuckets"]["0"]["lag_seqnos"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            st = r.status()["vbuckets"]
            assert st["0"]["lag_seqnos"] == 5, st["0"]
            assert st["0"]["lag_seconds"] == 0.0, st["0"]
            now[0] += 2.5
            st = r.status()["vbuckets"]
            assert st["0"]["lag_seconds"] == 2.5, st["0"]
            assert all(v["lag_seconds"] == 0 for vb, v in st.items() if vb != "0")
        finally:
            r.stop()
            t.join(30)


def test_bad_input_leaves_no_state_directory(harness: Harness, tmp_path: Path) -> None:
    """Every exit-2 bad input of ``dcpgw xdcr`` is refused before the state directory is created."""
    h = harness
    state = tmp_path / "s"
    base = ["xdcr", "--topic", h.topic, "--state-dir", str(state), "--bootstrap", h.broker.bootstrap_servers]
    for bad in (["--target", "http://x:1"], ["--target", "couchbase://127.0.0.1:notaport"],
                ["--target", "couchbase://127.0.0.1:1", "--filter-key", "("],
                ["--target", "couchbase://127.0.0.1:1", "--conflict-resolution", "other"]):
        p = dcpgw(*base, *bad)
        assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: "), (bad, p.stderr)
        assert not state.exists(), bad
