"""A storage writer process that stops answering (SIGSTOP: a stalled disk, a frozen process) must not wedge
the gateway silently: its HTTP API keeps answering, /health/ready says why it is not ready, and once the
process runs again every document written meanwhile reaches Kafka. Real process, real signal."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
from pathlib import Path

import pytest

from gateway.broker import Broker
from tests.gateway.kafka_util import TopicReplica, read_topic
from tests.gateway.processes import CLEAN_ENV, GatewayProc, call

pytestmark = pytest.mark.slow


def _not_ready_reasons(url: str) -> list[str] | None:
    """/health/ready's reasons when it answers 503, None when ready (200)."""
    try:
        call(url + "/health/ready", timeout=5)
    except urllib.error.HTTPError as e:
        assert e.code == 503
        reasons: list[str] = json.loads(e.read())["reasons"]
        return reasons
    return None


def test_a_stopped_storage_writer_is_reported_and_publishing_resumes(kafka_broker: Broker, tmp_path: Path) -> None:
    data = tmp_path / "data"
    gw = GatewayProc(kafka_broker, data, "wstall", nvb=4, base_env=CLEAN_ENV, checkpoint_interval_s=None,
                     DCPGW_HEALTH_VBUCKET_STALL_S="2")
    gw.start()
    url = gw.url
    try:
        call(url + "/docs/before", "PUT", b'{"n": 0}')
        deadline = time.monotonic() + 60
        while call(url + "/stats")["lag"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        writer = int(call(url + "/stats")["storage_writer_pid"])
        assert writer > 0
        os.kill(writer, signal.SIGSTOP)
        try:
            for i in range(50):
                call(url + f"/docs/during{i}", "PUT", json.dumps({"n": i}).encode(), timeout=5)
            deadline = time.monotonic() + 30
            while True:
                t0 = time.monotonic()
                reasons = _not_ready_reasons(url)
                assert time.monotonic() - t0 < 5, "/health/ready took too long to answer"
                if reasons and any(r.startswith("vbuckets_stalled") for r in reasons):
                    break
                assert time.monotonic() < deadline, f"/health/ready never reported the stall: {reasons}"
                time.sleep(0.2)
            assert call(url + "/stats", timeout=5)["lag"] > 0
        finally:
            os.kill(writer, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while (stats := call(url + "/stats"))["lag"] or stats["inflight"]:
            assert time.monotonic() < deadline, f"publishing never resumed: {stats}"
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while (reasons := _not_ready_reasons(url)) is not None:
            assert time.monotonic() < deadline, f"never ready again: {reasons}"
            time.sleep(0.2)
        replica = TopicReplica()
        replica.apply_all(read_topic(kafka_broker.bootstrap_servers, "dcp.wstall"))
        assert {b"before", *(f"during{i}".encode() for i in range(50))} <= set(replica.state())
    finally:
        gw.close()
