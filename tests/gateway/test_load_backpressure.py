"""`dcpgw load` honours write backpressure (docs/reliability.md "Stalled broker and health"): a batch the
gateway refuses with 503 + Retry-After is sent again after the delay, so a load through a broker stall
completes once the broker is back; it gives up in one line after ``--max-wait`` seconds of refusals, and
says how many documents were acknowledged when interrupted while waiting.

Real processes: `dcpgw up` with a tiny ``max_unacked_bytes`` on a private embedded Tansu broker that is
paused with SIGSTOP (the rest of the suite's broker is never stalled), and `dcpgw load` processes."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.broker import EmbeddedTansuBroker
from tests.credentials import auth_headers
from tests.gateway import processes
from tests.gateway.processes import GatewayProc, dcpgw_background, request, verify

pytestmark = pytest.mark.slow

LIMIT = 64 * 1024  # max_unacked_bytes (its minimum): passed after a few batches of the loads below
DOCS = 2000
BATCH = 50


@pytest.fixture
def private_broker() -> Iterator[EmbeddedTansuBroker]:
    with processes.private_broker() as broker:
        yield broker


def load(url: str, prefix: str, *args: str) -> subprocess.Popen[str]:
    return dcpgw_background("load", "--url", url, "--docs", str(DOCS), "--batch", str(BATCH), "--size", "200",
                            "--prefix", prefix, *args)


def refused_503(url: str) -> float:
    """How many write requests the gateway answered 503 so far (its Prometheus counter)."""
    for line in request(url + "/metrics").decode().splitlines():
        if line.startswith('dcpgw_http_errors_total{status="503"}'):
            return float(line.split()[-1])
    return 0.0


def wait_for_refusals(url: str, more_than: float, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while refused_503(url) <= more_than:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the gateway never refused a write"
        time.sleep(0.1)


def last_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines, stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[-1]


def acknowledged(line: str) -> int:
    assert line.startswith("error: ") and f"of {DOCS} documents acknowledged" in line, line
    return int(line.split(": ")[-1].split(" of ")[0])


def test_load_retries_through_a_broker_stall_and_every_document_is_acknowledged(
        private_broker: EmbeddedTansuBroker, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    bucket = f"lb{uuid.uuid4().hex[:8]}"
    gw = GatewayProc(private_broker, data, bucket, DCPGW_MAX_UNACKED_BYTES=str(LIMIT),
                     DCPGW_HEALTH_DELIVERY_STALL_S="1000", DCPGW_HEALTH_VBUCKET_STALL_S="1000")
    gw.start()
    url = gw.url
    try:
        private_broker.pause()
        try:
            # 1. gives up in one line after --max-wait seconds of refusals, saying how many were acknowledged
            started = time.monotonic()
            give_up = load(url, "g:", "--max-wait", "1")
            _out, err = give_up.communicate(timeout=60)
            assert give_up.returncode == 1, err
            line = last_line(err)
            assert "gave up after 1s of 503 backpressure" in line and "--max-wait" in line, line
            assert 0 < acknowledged(line) < DOCS
            assert time.monotonic() - started < 30  # "did not hang"

            # 2. interrupted while waiting for the gateway: the count, exit 130
            before = refused_503(url)
            waiting = load(url, "i:")
            wait_for_refusals(url, before, waiting)
            waiting.send_signal(signal.SIGINT)
            _out, err = waiting.communicate(timeout=60)
            assert waiting.returncode == 130, err
            line = last_line(err)
            assert "interrupted (SIGINT)" in line and acknowledged(line) == 0, line

            # 3. a load started during the stall keeps retrying the refused batch ...
            before = refused_503(url)
            full = load(url, "f:")
            wait_for_refusals(url, before + 2, full)  # refused, retried after Retry-After, refused again
            assert full.poll() is None
        finally:
            private_broker.resume()
        # ... and completes once the broker is back
        out, err = full.communicate(timeout=180)
        assert full.returncode == 0, err[-3000:]
        assert f"wrote {DOCS} documents" in out, out
        assert "Traceback" not in err
        gw.wait_caught_up()
        for i in range(DOCS):  # every document acknowledged is readable
            with urllib.request.urlopen(urllib.request.Request(f"{url}/docs/f:{i:07d}", headers=auth_headers()),
                                        timeout=10) as r:
                assert json.loads(r.read())["n"] == i
    finally:
        if private_broker.paused:
            private_broker.resume()
        gw.stop()
    # and in Kafka exactly once (gateway.invariants), the topic replaying to the engine's state
    verify(private_broker, data, bucket)


def test_retry_after_parsing() -> None:
    from gateway.cli import _retry_after

    assert _retry_after("1") == 1.0
    assert _retry_after("0.5") == 0.5
    assert _retry_after("-3") == 0.0
    assert _retry_after(None) is None and _retry_after("soon") is None
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: now
