"""A full disk under the data directory must not stop publishing for good (found by bench.chaos, fault
``disk_full``): the engine's flush fails while no file there can grow, and once space is back every document
written meanwhile reaches Kafka. Real process, real fault: RLIMIT_FSIZE of the running ``dcpgw up`` and its
storage writer process lowered with prlimit(2) to the size of its largest data file, then lifted."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.chaos import cap_file_size
from gateway.broker import Broker
from tests.gateway.kafka_util import TopicReplica, read_topic
from tests.gateway.processes import CLEAN_ENV, GatewayProc, call, request

pytestmark = pytest.mark.slow


def _metrics(url: str) -> dict[str, float]:
    """GET /metrics: the unlabelled samples by name."""
    out = {}
    for line in request(url + "/metrics").decode().splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            out[name] = float(value)
    return out


def test_publishing_resumes_after_the_disk_was_full(kafka_broker: Broker, tmp_path: Path) -> None:
    data = tmp_path / "data"
    gw = GatewayProc(kafka_broker, data, "diskfull", nvb=4, base_env=CLEAN_ENV,
                     checkpoint_interval_s=None)
    gw.start()
    assert gw.proc is not None
    proc, url = gw.proc, gw.url
    try:
        deadline = time.monotonic() + 60
        call(url + "/docs/before", "PUT", b'{"n": 0}')
        while call(url + "/stats")["lag"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        # The disk is full: no file of the data directory can grow.
        largest = max(f.stat().st_size for f in data.rglob("*") if f.is_file())
        cap_file_size(proc.pid, largest)  # the process and its storage writer process
        pad = "x" * 2000
        for i in range(200):
            call(url + f"/docs/during{i}", "PUT", json.dumps({"n": i, "pad": pad}).encode())
        time.sleep(0.5)
        # readiness tells the truth while the flush fails (docs/reliability.md "Stalled broker and health")
        deadline = time.monotonic() + 10
        while True:
            try:
                call(url + "/health/ready")
            except urllib.error.HTTPError as e:
                body = json.loads(e.read())
                if e.code == 503 and any(r.startswith("storage_failed") for r in body["reasons"]):
                    break
            assert time.monotonic() < deadline, "/health/ready never reported the failing storage"
            time.sleep(0.1)
        # ... and so do the engine's stats and the metrics (docs/reliability.md "Full disk on a node")
        stats = call(url + "/stats")
        assert stats["flush_failures"] >= 1 and stats["flush_error"], stats
        metrics = _metrics(url)
        assert metrics["dcpgw_engine_flush_failing"] == 1 and metrics["dcpgw_engine_flush_failures"] >= 1, metrics
        # the flushes of rollback mitigation run in the storage's writer process (docs/engine.md)
        assert metrics["dcpgw_engine_storage_writer_starts"] >= 1 and stats["storage_writer_pid"] > 0, metrics
        cap_file_size(proc.pid, None)

        # Space is back: everything reaches Kafka (on main the publishing task had died: lag stayed > 0).
        deadline = time.monotonic() + 30
        while (stats := call(url + "/stats"))["lag"] or stats["inflight"]:
            assert time.monotonic() < deadline, f"publishing never resumed: {stats}"
            time.sleep(0.1)
        replica = TopicReplica()
        replica.apply_all(read_topic(kafka_broker.bootstrap_servers, "dcp.diskfull"))
        keys = set(replica.state())
        assert {b"before", *(f"during{i}".encode() for i in range(200))} <= keys
        assert "pump failed" in (tmp_path / "gw.log").read_text()
        assert call(url + "/stats")["flush_error"] == ""
        metrics = _metrics(url)
        assert metrics["dcpgw_engine_flush_failing"] == 0 and metrics["dcpgw_engine_flush_failures"] >= 1, metrics
    finally:
        gw.close()
