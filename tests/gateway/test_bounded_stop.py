"""SIGTERM stops `dcpgw up` within a bounded time whatever the broker does (docs/reliability.md "Fault
campaign", bounded stop): paused (SIGSTOP) or gone with records in flight, or not answering during start-up.
A real `dcpgw up` process on a private embedded Tansu broker (the suite's shared broker is never stalled)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.broker import EmbeddedTansuBroker
from tests.gateway.processes import GatewayProc
from tests.gateway.test_stall import bulk_body, call

pytestmark = pytest.mark.slow

#: shutdown_timeout_s (its default), and "did not hang": the process is gone within this
SHUTDOWN_S = 10.0
EXIT_BOUND_S = SHUTDOWN_S + 6.0


@pytest.fixture
def broker() -> Iterator[EmbeddedTansuBroker]:
    b = EmbeddedTansuBroker().start()
    try:
        yield b
    finally:
        if b.paused:
            b.resume()
        b.stop()


def _stop_and_time(gw: GatewayProc) -> tuple[float, int]:
    assert gw.proc is not None
    t = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    try:
        rc = gw.proc.wait(EXIT_BOUND_S + 30)
    except subprocess.TimeoutExpired:  # pragma: no cover - the defect this file is about
        gw.proc.kill()
        gw.proc.wait()
        raise AssertionError(f"dcpgw up still running {EXIT_BOUND_S + 30:.0f} s after SIGTERM") from None
    return time.monotonic() - t, rc


def _gateway_with_records_in_flight(broker: EmbeddedTansuBroker, tmp_path: Path) -> GatewayProc:
    data = tmp_path / "data"
    data.mkdir()
    gw = GatewayProc(broker, data, "stop")
    gw.start()
    assert call(gw.url + "/docs/_bulk", "POST", bulk_body(0, 100, "before"))[0] == 200
    gw.wait_caught_up()
    return gw


@pytest.mark.parametrize("fault", ["paused", "gone"])
def test_sigterm_stops_within_the_bound_with_the_broker_stalled(
        broker: EmbeddedTansuBroker, tmp_path: Path, fault: str) -> None:
    gw = _gateway_with_records_in_flight(broker, tmp_path)
    if fault == "paused":
        broker.pause()
    else:
        broker.stop()
    # accepted writes whose records cannot be delivered: the stop must not wait for them without bound
    assert call(gw.url + "/docs/_bulk", "POST", bulk_body(100, 300, "stalled"))[0] == 200
    time.sleep(0.5)
    took, rc = _stop_and_time(gw)
    assert took < EXIT_BOUND_S, f"dcpgw up took {took:.1f} s to stop on SIGTERM (broker {fault})"
    assert rc == 0, (tmp_path / "gw.log").read_text()[-2000:]
    if fault == "paused":
        broker.resume()
        # nothing acknowledged was lost: the restarted gateway publishes the rest
        gw.start()
        gw.wait_caught_up(60)
        assert gw.get("/docs/doc299")["tag"] == "stalled"
        took, rc = _stop_and_time(gw)
        assert took < EXIT_BOUND_S and rc == 0


def test_sigterm_during_start_up_with_the_broker_paused(broker: EmbeddedTansuBroker, tmp_path: Path) -> None:
    """Start-up waits for Kafka (metadata, topic creation, the checkpoints): SIGTERM ends it at once."""
    data = tmp_path / "data"
    data.mkdir()
    broker.pause()
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap_servers, "DCPGW_DATA_DIR": str(data),
           "DCPGW_HTTP_PORT": "0", "DCPGW_KAFKA_CONNECT_TIMEOUT_S": "120"}
    log = tmp_path / "gw.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "up", "--no-progress"], env=env,
                                stdout=subprocess.DEVNULL, stderr=f)
    # its user store is written after its signal handlers are in place, right before it waits for the broker (on
    # a loaded machine the imports alone can take longer than a fixed sleep)
    deadline = time.monotonic() + 120
    while not (data / "users.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)  # well into the wait for the broker
    assert proc.poll() is None, log.read_text()[-2000:]
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(EXIT_BOUND_S + 30)
    except subprocess.TimeoutExpired:  # pragma: no cover - the defect this file is about
        proc.kill()
        proc.wait()
        raise AssertionError("dcpgw up ignored SIGTERM during start-up") from None
    took = time.monotonic() - t
    assert took < EXIT_BOUND_S, f"dcpgw up took {took:.1f} s to stop on SIGTERM during start-up"
    assert rc == 0, log.read_text()[-2000:]
    assert "stopped during start-up" in log.read_text()
