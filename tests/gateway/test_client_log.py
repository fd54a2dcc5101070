"""gateway.client_log: librdkafka's repeated log lines are rate-limited (first occurrence, then a count per
interval), for a real client against an address where nothing listens."""

from __future__ import annotations

import logging
import time

import pytest
from confluent_kafka import Producer
from hypothesis import given
from hypothesis import strategies as st

from gateway.kafka.client_log import ClientLog, with_client_log


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
