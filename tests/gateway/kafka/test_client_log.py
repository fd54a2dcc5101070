"""gateway.kafka.client_log: librdkafka's repeated log lines are rate-limited (first occurrence, then a count per
interval), for a real client against an address where nothing listens."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer
from hypothesis import given
from hypothesis import strategies as st

from gateway.broker import Broker
from gateway.config import load_settings
from gateway.kafka.client_log import ClientLog, with_client_log
from gateway.service import GatewayService


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_first_occurrence_then_a_count_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = ClientLog(logging.getLogger("t.kafka"), interval_s=30, clock=clock)
    caplog.set_level(logging.INFO, "t.kafka")
    for i in range(100):
        clock.now = i * 0.5  # 50 s of reconnect errors, twice a second, with changing timings
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1",
                f"127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused "
                f"(after {i}ms in state CONNECT)")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "Connection refused" in lines[0] and "repeated 60 times in the last 30s" in lines[1]
    log.log(logging.WARNING, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "another message")
    assert len(caplog.records) == 3 and log.suppressed == 98


@given(st.lists(st.tuples(st.text(max_size=30), st.integers(0, 3)), max_size=200))
def test_any_message_is_logged_at_least_once_and_never_raises(msgs: list[tuple[str, int]]) -> None:
    clock = Clock()
    log = ClientLog(logging.getLogger("t.kafka.prop"), interval_s=5, clock=clock, quiet=True)
    for text, dt in msgs:
        clock.now += dt
        log.log(logging.ERROR, "%s [%s] %s", "FAC", "name", text)
        log.log(logging.ERROR, text)  # a format string that is not one ('%' signs) must not raise
    assert log.emitted + log.suppressed == 2 * len(msgs)
    assert log.emitted >= len({t for t, _ in msgs}) or not msgs


def test_real_client_reconnect_errors_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "t.kafka.real")
    log = ClientLog(logging.getLogger("t.kafka.real"), interval_s=60)
    p = Producer(with_client_log({"bootstrap.servers": "127.0.0.1:1", "reconnect.backoff.ms": 10,
                                  "reconnect.backoff.max.ms": 20}, log))
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        p.poll(0.1)
    assert log.suppressed >= 3, (log.emitted, log.suppressed)
    lines = [r.getMessage() for r in caplog.records]
    refused = [line for line in lines if "Connection refused" in line]
    assert 1 <= len(refused) <= 4, lines  # the log line and the error callback's, once each
    assert log.last_error is not None and "127.0.0.1:1" in log.last_error
    p.flush(0)


# ------------------------------------------------------------------ pending counts are flushed
def _connect_refused(log: ClientLog, i: int) -> None:
    log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1",
            f"127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after {i}ms in state "
            f"CONNECT)")


def test_final_count_is_flushed_when_the_message_stops(caplog: pytest.LogCaptureFixture) -> None:
    """Before: a count was only logged when the message occurred again after the window, so the repeats of an
    outage that ended (or of the last window before a stop) were never reported."""
    clock = Clock()
    log = ClientLog(logging.getLogger("t.kafka.flush"), interval_s=30, clock=clock)
    caplog.set_level(logging.INFO, "t.kafka.flush")
    for i in range(10):  # 5 s of errors, then the broker is back: the message never occurs again
        clock.now = i * 0.5
        _connect_refused(log, i)
    assert len(caplog.records) == 1
    clock.now = 20.0
    assert log.flush_due() == 0  # the window has not ended yet
    clock.now = 30.0
    assert log.flush_due() == 1  # the periodic flush logs the count once the window ended
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "repeated 9 times in the last 30s" in lines[1], lines
    assert caplog.records[1].levelno == logging.ERROR
    assert log.flush_due() == 0 and log.flush() == 0  # nothing pending any more
    # a stop flushes whatever is pending, window or not
    clock.now = 31.0
    _connect_refused(log, 99)
    _connect_refused(log, 100)
    assert len(caplog.records) == 2
    assert log.flush() == 1
    assert "repeated 2 times in the last 1s" in caplog.records[-1].getMessage()
    assert log.flush() == 0


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 20), st.booleans()), max_size=100))
def test_every_occurrence_is_accounted_for_once_flushed(msgs: list[tuple[str, int, bool]]) -> None:
    """Property: after a final flush(), the first lines plus the repeat counts logged equal the occurrences."""
    clock = Clock()
    lines: list[str] = []

    class Sink(logging.Logger):
        def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:
            lines.append(str(msg) % args)

    log = ClientLog(Sink("sink"), interval_s=10, clock=clock)
    for text, dt, periodic in msgs:
        clock.now += dt
        log.log(logging.WARNING, text)
        if periodic:
            log.flush_due()
    log.flush()
    counted = 0
    for line in lines:
        if "(repeated " in line:
            counted += int(line.split("(repeated ")[1].split(" ")[0])
        else:
            counted += 1
    assert counted == len(msgs)


def test_service_flushes_counts_periodically_and_on_stop(kafka_broker: Broker, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The running gateway logs a pending count from its periodic health task (no new thread) and the last
    counts when it stops."""
    caplog.set_level(logging.INFO, "gateway.kafka")

    def repeats() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "gateway.kafka" and "(repeated " in r.getMessage()]

    async def main() -> None:
        s = load_settings(None, data_dir=tmp_path / "d", bucket=f"cl{uuid.uuid4().hex[:8]}", num_vbuckets=2,
                          http_port=0)
        svc = GatewayService(s, kafka_broker.bootstrap_servers)
        await svc.start()
        try:
            svc.client_log.interval_s = 0.5  # the clients hold the same ClientLog: a short window for the test
            for i in range(5):  # as librdkafka's thread would, then the message stops
                _connect_refused(svc.client_log, i)
            deadline = asyncio.get_running_loop().time() + 10
            while not repeats():
                assert asyncio.get_running_loop().time() < deadline, "the pending count was never logged"
                await asyncio.sleep(0.1)
            assert "repeated 4 times" in repeats()[0]
            svc.client_log.interval_s = 3600.0
            _connect_refused(svc.client_log, 5)
            _connect_refused(svc.client_log, 6)
        finally:
            await svc.stop()
        assert len(repeats()) == 2 and "repeated 2 times" in repeats()[1], repeats()

    asyncio.run(main())
