"""A full disk under the data directory must not stop publishing for good (found by bench.chaos, fault
``disk_full``): the engine's flush fails while no file there can grow, and once space is back every document
written meanwhile reaches Kafka. Real process, real fault: RLIMIT_FSIZE of the running ``dcpgw up`` lowered
with prlimit(2) to the size of its largest data file, then lifted."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gateway.broker import Broker
from tests.gateway.kafka_util import TopicReplica, read_topic

pytestmark = pytest.mark.slow


def _call(url: str, method: str = "GET", body: bytes | None = None) -> Any:
    req = urllib.request.Request(url, data=body, method=method)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_publishing_resumes_after_the_disk_was_full(kafka_broker: Broker, tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DCPGW_")},
           "KAFKA_BOOTSTRAP_SERVERS": kafka_broker.bootstrap_servers, "DCPGW_DATA_DIR": str(data),
           "DCPGW_BUCKET": "diskfull", "DCPGW_NUM_VBUCKETS": "4", "DCPGW_HTTP_PORT": "0"}
    log = open(tmp_path / "gw.log", "wb")  # noqa: SIM115 -- closed below; stderr of the child
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "up", "--no-progress"], env=env,
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        state = data / "dcpgw-state.json"
        deadline = time.monotonic() + 60
        url = ""
        while not url:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "gw.log").read_text()
            try:
                url = json.loads(state.read_text())["http_url"]
                _call(url + "/health")
            except (OSError, ValueError, KeyError):
                url = ""
                time.sleep(0.1)
        _call(url + "/docs/before", "PUT", b'{"n": 0}')
        while _call(url + "/stats")["lag"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        # The disk is full: no file of the data directory can grow.
        largest = max(f.stat().st_size for f in data.rglob("*") if f.is_file())
        hard = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (largest, hard))
        pad = "x" * 2000
        for i in range(200):
            _call(url + f"/docs/during{i}", "PUT", json.dumps({"n": i, "pad": pad}).encode())
        time.sleep(0.5)
        # readiness tells the truth while the flush fails (docs/reliability.md "Stalled broker and health")
        deadline = time.monotonic() + 10
        while True:
            try:
                _call(url + "/health/ready")
            except urllib.error.HTTPError as e:
                body = json.loads(e.read())
                if e.code == 503 and any(r.startswith("storage_failed") for r in body["reasons"]):
                    break
            assert time.monotonic() < deadline, "/health/ready never reported the failing storage"
            time.sleep(0.1)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (hard, hard))

        # Space is back: everything reaches Kafka (on main the publishing task had died: lag stayed > 0).
        deadline = time.monotonic() + 30
        while (stats := _call(url + "/stats"))["lag"] or stats["inflight"]:
            assert time.monotonic() < deadline, f"publishing never resumed: {stats}"
            time.sleep(0.1)
        replica = TopicReplica()
        replica.apply_all(read_topic(kafka_broker.bootstrap_servers, "dcp.diskfull"))
        keys = set(replica.state())
        assert {b"before", *(f"during{i}".encode() for i in range(200))} <= keys
        assert "pump failed" in (tmp_path / "gw.log").read_text()
    finally:
        proc.kill()
        proc.wait()
        log.close()
