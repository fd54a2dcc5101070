"""Readiness when the broker is gone (docs/reliability.md "Stalled broker and health", reason
``broker_unreachable``): a private embedded Tansu broker under a running `dcpgw up` process is killed (not
paused: every connection is refused, librdkafka reports all brokers down), then a new broker is started on the
same port.

Checked: ``/health/ready`` answers 503 with ``broker_unreachable`` within a bounded time and 200 again after
the new broker answers; ``/health/live``, reads and ``/stats`` answer throughout; the repeat counts of
librdkafka's connection errors are logged when the gateway stops (gateway.kafka.client_log). Tansu keeps nothing
across a restart (docs/kafka-compat.md), so the topic's contents are not checked here."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.broker import EmbeddedTansuBroker
from tests.gateway.processes import GatewayProc, answer

pytestmark = pytest.mark.slow

#: "did not hang": every request answered within this
ANSWER_BOUND_S = 3.0
#: readiness follows the broker within this (librdkafka reports all brokers down after its first failed
#: reconnects, about a second; the probe that clears it runs every second)
READINESS_BOUND_S = 30.0


@pytest.fixture
def brokers() -> Iterator[list[EmbeddedTansuBroker]]:
    started: list[EmbeddedTansuBroker] = [EmbeddedTansuBroker().start()]
    try:
        yield started
    finally:
        for b in started:
            b.stop()


def call(url: str) -> tuple[int, Any]:
    status, _headers, raw, _took = answer(url, bound_s=ANSWER_BOUND_S)
    return status, json.loads(raw)


def probe(url: str) -> tuple[int, list[str]]:
    """One round of the API while the broker is gone or back: liveness, a read and stats answer; returns
    the readiness answer."""
    assert call(url + "/health/live") == (200, {"status": "ok"})
    status, body = call(url + "/docs/doc1")
    assert status == 200 and body["n"] == 1, body
    assert call(url + "/stats")[0] == 200
    status, body = call(url + "/health/ready")
    assert status in (200, 503), body
    assert (status == 200) == (body["status"] == "ok") and (status == 200) == (body["reasons"] == []), body
    return status, list(body["reasons"])


def test_broker_killed_then_restarted_on_the_same_port(brokers: list[EmbeddedTansuBroker], tmp_path: Path) -> None:
    broker = brokers[0]
    data = tmp_path / "data"
    data.mkdir()
    gw = GatewayProc(broker, data, f"bd{uuid.uuid4().hex[:8]}",
                     # only the broker's reachability may make it unready here
                     DCPGW_HEALTH_DELIVERY_STALL_S="1000", DCPGW_HEALTH_VBUCKET_STALL_S="1000")
    gw.start()
    try:
        url = gw.url
        gw.bulk([{"key": f"doc{i}", "value": {"n": i}} for i in range(50)])
        gw.wait_caught_up()
        assert probe(url) == (200, [])

        port = broker.port
        os.kill(broker.pid, signal.SIGKILL)  # killed: the port refuses connections from now on
        broker.stop()
        killed = time.monotonic()
        reasons: list[str] = []
        while not any(r.startswith("broker_unreachable") for r in reasons):
            assert time.monotonic() - killed < READINESS_BOUND_S, f"never broker_unreachable: {reasons}"
            status, reasons = probe(url)
            time.sleep(0.1)
        assert status == 503
        # it stays unready while the broker is gone, and the API keeps answering
        until = time.monotonic() + 3
        while time.monotonic() < until:
            status, reasons = probe(url)
            assert status == 503 and any(r.startswith("broker_unreachable") for r in reasons), reasons
            time.sleep(0.1)

        brokers.append(EmbeddedTansuBroker(port=port).start())  # a new, empty broker on the same address
        back = time.monotonic()
        while True:
            status, reasons = probe(url)
            if status == 200:
                break
            assert time.monotonic() - back < READINESS_BOUND_S, f"still not ready: {reasons}"
            time.sleep(0.1)
        assert not any(r.startswith("broker_unreachable") for r in reasons)
    finally:
        gw.stop()
    # the counts of librdkafka's repeated connection errors are logged at the stop (they were only logged
    # when the message recurred after its 30 s window, i.e. never for a shorter outage)
    log = (tmp_path / "gw.log").read_text()
    assert "gateway.kafka" in log and "(repeated " in log, log[-3000:]
