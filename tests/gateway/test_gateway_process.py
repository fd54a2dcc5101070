"""End to end with real processes: `dcpgw up` as a subprocess on the test broker, writes through its HTTP API,
kill -9 mid-backfill and mid-steady-state, restart; every engine item is in Kafka exactly once and a replica
built from the topic equals the engine."""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from engine import Bucket, BucketConfig
from gateway.broker import Broker
from tests.gateway.processes import NVB, GatewayProc, dcpgw, docs, verify

pytestmark = pytest.mark.slow


def test_kill9_mid_steady_state(kafka_broker: Broker, tmp_path: Path) -> None:
    bucket = f"s{uuid.uuid4().hex[:8]}"
    data = tmp_path / "data"
    gw = GatewayProc(kafka_broker, data, bucket)
    gw.start()
    try:
        for lo in range(0, 3000, 300):
            gw.bulk(docs(lo, lo + 300))
        gw.bulk(docs(0, 500))  # overwrites
        gw.kill9()  # while records are being published
        gw.start()
        gw.bulk(docs(2500, 4000))
        gw.wait_caught_up()
        gw.kill9()
        gw.start()
        gw.wait_caught_up()
    finally:
        gw.stop()
    verify(kafka_broker, data, bucket)


def test_kill9_mid_backfill(kafka_broker: Broker, tmp_path: Path) -> None:
    bucket = f"b{uuid.uuid4().hex[:8]}"
    data = tmp_path / "data"
    b = Bucket(BucketConfig(data_dir=data, name=bucket, num_vbuckets=NVB))
    for i in range(30_000):
        b.set(f"pre{i}", b'{"pre": true, "pad": "' + b"x" * 200 + b'"}')
    b.close()
    gw = GatewayProc(kafka_broker, data, bucket, DCPGW_FLOW_CONTROL_BUFFER_BYTES="65536")
    gw.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            st = gw.get("/stats")
            if st["records_acknowledged"] > 2000:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert st["lag"] > 0, "backfill finished before the kill: the test must kill mid-backfill"
        gw.kill9()
        gw.start()
        gw.wait_caught_up()
    finally:
        gw.stop()
    verify(kafka_broker, data, bucket)


def test_cli_load_status_tail_against_a_running_gateway(kafka_broker: Broker, tmp_path: Path) -> None:
    bucket = f"c{uuid.uuid4().hex[:8]}"
    data = tmp_path / "data"
    gw = GatewayProc(kafka_broker, data, bucket)
    gw.start()
    try:
        r = dcpgw("load", "--docs", "700", "--batch", "100", "--url", gw.url)
        assert r.returncode == 0, r.stderr
        assert "wrote 700 documents" in r.stdout
        gw.wait_caught_up()
        r = dcpgw("status", "--json", "--data-dir", str(data))  # URL found through the state file
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["stats"]["items"] == 700 and st["stats"]["lag"] == 0 and len(st["streams"]) == NVB
        assert st["ready"]["status"] == "ok" and st["ready"]["reasons"] == []
        r = dcpgw("status", "--url", gw.url, "--top", "3")
        assert r.returncode == 0 and "top 3 lagging vbuckets" in r.stdout
        r = dcpgw("tail", "3", "--max", "4", "--data-dir", str(data))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.strip().splitlines()
        assert len(lines) == 4 and "failover-log" in lines[0] and "vb=3" in lines[0]
        assert any(" mutation " in ln for ln in lines[1:])
        # issue 3: `dcpgw load` writes doc-0000000, doc-0000001, ...
        from tests.credentials import auth_headers

        for key in ("doc-0000000", "doc-0000699"):
            req = urllib.request.Request(f"{gw.url}/docs/{key}", headers=auth_headers())
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
    finally:
        gw.stop()


def test_cli_errors_are_clear_messages(tmp_path: Path) -> None:
    env = {**os.environ, "DCPGW_HTTP_PORT": "70000", "DCPGW_DATA_DIR": str(tmp_path)}
    r = dcpgw("up", env=env)
    assert r.returncode == 2
    assert "http_port" in r.stderr and "Traceback" not in r.stderr
    r = dcpgw("load", "--docs", "5", "--url", "http://127.0.0.1:9")
    assert r.returncode == 2 and "cannot reach the gateway" in r.stderr and "Traceback" not in r.stderr
    r = dcpgw("tail", "0", "--data-dir", str(tmp_path / "none"), env={
        k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"})
    assert r.returncode == 2 and "no running gateway" in r.stderr
