"""End to end with real processes: `dcpgw up` as a subprocess on the test broker, writes through its HTTP API,
kill -9 mid-backfill and mid-steady-state, restart; every engine item is in Kafka exactly once and a replica
built from the topic equals the engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engine import Bucket, BucketConfig
from gateway.broker import Broker
from gateway.invariants import check_partition
from tests.gateway.kafka_util import TopicReplica, read_topic

pytestmark = pytest.mark.slow
NVB = 16


class GatewayProc:
    def __init__(self, broker: Broker, data_dir: Path, bucket: str, **env: str) -> None:
        self.broker = broker
        self.data_dir = data_dir
        self.bucket = bucket
        self.env = {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap_servers,
            "DCPGW_DATA_DIR": str(data_dir),
            "DCPGW_BUCKET": bucket,
            "DCPGW_NUM_VBUCKETS": str(NVB),
            "DCPGW_HTTP_PORT": "0",
            "DCPGW_CHECKPOINT_INTERVAL_S": "0.2",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        state = self.data_dir / "dcpgw-state.json"
        state.unlink(missing_ok=True)
        with open(self.data_dir.parent / "gw.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "up", "--no-progress"],
                                         env=self.env, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.data_dir.parent / "gw.log").read_text()[-3000:]
            if state.exists():
                try:
                    self.url = json.loads(state.read_text())["http_url"]
                    if self.get("/health")["status"] == "ok":
                        return
                except (ValueError, OSError, KeyError):
                    pass
            time.sleep(0.1)
        raise AssertionError("gateway did not come up")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def bulk(self, docs: list[dict[str, Any]]) -> None:
        req = urllib.request.Request(self.url + "/docs/_bulk", data=json.dumps(docs).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["written"] == len(docs)

    def wait_caught_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.get("/stats")["lag"] == 0:
                return
            time.sleep(0.1)
        raise AssertionError(f"never caught up: {self.get('/stats')}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0


def verify(broker: Broker, data_dir: Path, bucket: str) -> None:
    topic = f"dcp.{bucket}"
    recs = read_topic(broker.bootstrap_servers, topic)
    parts: dict[int, list] = {}
    for p, _o, r in recs:
        parts.setdefault(p, []).append(r)
    for rs in parts.values():
        check_partition(rs)
    c = Counter((r.vbucket, r.seqno) for _p, _o, r in recs if r.is_data)
    dups = [k for k, n in c.items() if n > 1]
    assert not dups, f"published twice: {dups[:10]}"
    b = Bucket(BucketConfig(data_dir=data_dir, name=bucket, num_vbuckets=NVB))
    try:
        for vb in b.vbuckets():
            for it in vb.ht.values():
                assert (vb.id, it.seqno) in c, f"engine item vb={vb.id} seqno={it.seqno} not in Kafka"
        replica = TopicReplica()
        replica.apply_all(recs)
        assert replica.rollbacks == 0
        assert replica.state() == b.state_snapshot()
    finally:
        b.close()


def docs(lo: int, hi: int) -> list[dict[str, Any]]:
    return [{"key": f"doc{i}", "value": {"n": i, "v": lo}} for i in range(lo, hi)]


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


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or dict(os.environ))


def test_cli_load_status_tail_against_a_running_gateway(kafka_broker: Broker, tmp_path: Path) -> None:
    bucket = f"c{uuid.uuid4().hex[:8]}"
    data = tmp_path / "data"
    gw = GatewayProc(kafka_broker, data, bucket)
    gw.start()
    try:
        r = _cli("load", "--docs", "700", "--batch", "100", "--url", gw.url)
        assert r.returncode == 0, r.stderr
        assert "wrote 700 documents" in r.stdout
        gw.wait_caught_up()
        r = _cli("status", "--json", "--data-dir", str(data))  # URL found through the state file
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["stats"]["items"] == 700 and st["stats"]["lag"] == 0 and len(st["streams"]) == NVB
        assert st["ready"]["status"] == "ok" and st["ready"]["reasons"] == []
        r = _cli("status", "--url", gw.url, "--top", "3")
        assert r.returncode == 0 and "top 3 lagging vbuckets" in r.stdout
        r = _cli("tail", "3", "--max", "4", "--data-dir", str(data))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.strip().splitlines()
        assert len(lines) == 4 and "failover-log" in lines[0] and "vb=3" in lines[0]
        assert any(" mutation " in ln for ln in lines[1:])
    finally:
        gw.stop()


def test_cli_errors_are_clear_messages(tmp_path: Path) -> None:
    env = {**os.environ, "DCPGW_HTTP_PORT": "70000", "DCPGW_DATA_DIR": str(tmp_path)}
    r = _cli("up", env=env)
    assert r.returncode == 2
    assert "http_port" in r.stderr and "Traceback" not in r.stderr
    r = _cli("load", "--docs", "5", "--url", "http://127.0.0.1:9")
    assert r.returncode == 2 and "cannot reach the gateway" in r.stderr and "Traceback" not in r.stderr
    r = _cli("tail", "0", "--data-dir", str(tmp_path / "none"), env={
        k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"})
    assert r.returncode == 2 and "no running gateway" in r.stderr
