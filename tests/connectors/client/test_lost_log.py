"""The broker loses the topic's log under a consumer (docs/client.md "The topic lost its log"): the topic is
lost (a private embedded Tansu broker restarted: it keeps nothing) and recreated, and the gateway republishes every vbucket from seqno 0 behind a rollback record to 0 --
at offsets that start again at 0, below the offsets the consumer stored. The consumer must notice, read the
partitions again from their start and converge to the bucket (the deletions made meanwhile included), whether
it kept running or starts again over its state file."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from connectors.replicate import Replicator
from gateway.broker import EmbeddedTansuBroker
from gateway.resume import ensure_topics
from tests.harness import Harness, write


@pytest.fixture
def lost(tmp_path: Path) -> Iterator[tuple[Harness, Callable[[], None]]]:
    """A harness on a private embedded broker, and ``lose()``: restart the broker (Tansu keeps nothing, the
    topic's log is gone), recreate the topic and republish the bucket from seqno 0 behind rollback records to
    0 -- what the gateway does (gateway.publisher.TopicLost). (Deleting the topic under librdkafka clients
    instead crashes librdkafka's metadata cache on Tansu.)"""
    brokers = [EmbeddedTansuBroker().start()]
    h = Harness(brokers[0], tmp_path / "h", nvb=8, partitions=4)

    def lose() -> None:
        port = brokers[-1].port
        brokers[-1].stop()
        for _ in range(50):
            try:
                brokers.append(EmbeddedTansuBroker(port=port).start())
                break
            except Exception:
                time.sleep(0.1)
        else:
            raise AssertionError("the broker did not restart")
        h.broker = brokers[-1]
        _lose_the_topic(h)

    try:
        yield h, lose
    finally:
        h.close()
        brokers[-1].stop()


def _lose_the_topic(h: Harness) -> None:
    ensure_topics(h.client, h.topic, h.partitions)
    h.pub.kafka.flush(5)
    h.pub = h.new_publisher(rollback_to_zero=True)


def _write_history(h: Harness) -> None:
    """A long history (every key written three times): the republished log -- the bucket's current state --
    is shorter than it, so every recreated partition ends below the offset the consumer resumes from (a
    recreated log that already grew past it is not detected, docs/client.md "The topic lost its log")."""
    for _ in range(3):
        write(h.bucket, 150)
        h.settle()  # published before the next round (DCP would de-duplicate the overwrites)


def _change_more(h: Harness) -> None:
    """Writes and deletions after the loss: the republished history differs from what the consumer applied."""
    write(h.bucket, 10, start=150)
    for i in range(1, 120, 4):
        if i % 5:  # write() deleted every fifth key already
            h.bucket.delete(f"k{i}")


def _converge(rep: Replicator, h: Harness, bound_s: float = 60) -> None:
    """Run the consumer until its replica equals the bucket (``until_caught_up`` would return on the ends of
    partition it saw before the last writes); ``bound_s`` proves "did not hang"."""
    deadline = time.monotonic() + bound_s
    while rep.docs() != h.bucket.state_snapshot() and time.monotonic() < deadline:
        timer = threading.Timer(0.5, rep.consumer.stop)
        timer.start()
        try:
            rep.run(until_caught_up=False)
        finally:
            timer.cancel()


def _run(rep: Replicator, bound_s: float = 60) -> None:
    """``run(until_caught_up=True)``, stopped after ``bound_s`` (a consumer reading beyond a partition's end on
    Tansu never reaches partition EOF: this proves "did not hang" instead of hanging)."""
    timer = threading.Timer(bound_s, rep.consumer.stop)
    timer.start()
    try:
        rep.run(until_caught_up=True)
    finally:
        timer.cancel()


def test_running_consumer_converges_after_the_topic_lost_its_log(
        lost: tuple[Harness, Callable[[], None]], tmp_path: Path) -> None:
    h, lose = lost
    _write_history(h)
    h.settle()
    with Replicator(h.broker.bootstrap_servers, h.topic, tmp_path / "r.sqlite", dead_letter=None) as rep:
        _run(rep)
        assert rep.docs() == h.bucket.state_snapshot()
        lose()
        _change_more(h)
        h.settle()
        _converge(rep, h)
        assert rep.docs() == h.bucket.state_snapshot()
        assert rep.consumer.lost_logs == h.partitions
        assert {rb.vbucket for rb in rep.rollbacks if rb.to_seqno == 0} == set(range(h.nvb))
        # a write after the rebuild arrives as usual
        h.bucket.set("after", b'{"n": 1}')
        h.settle()
        _converge(rep, h)
        assert rep.docs() == h.bucket.state_snapshot()
    # what the consumer stored is the new log's: a new process resumes from it without finding a loss
    with Replicator(h.broker.bootstrap_servers, h.topic, tmp_path / "r.sqlite", dead_letter=None) as rep:
        _run(rep)
        assert rep.docs() == h.bucket.state_snapshot()
        assert rep.consumer.lost_logs == 0 and rep.rollbacks == [] and rep.changes == 0


def test_restarted_consumer_converges_after_the_topic_lost_its_log(
        lost: tuple[Harness, Callable[[], None]], tmp_path: Path) -> None:
    """The loss happens while no consumer runs: the offsets of the state file are beyond the recreated
    partitions' ends."""
    h, lose = lost
    _write_history(h)
    h.settle()
    with Replicator(h.broker.bootstrap_servers, h.topic, tmp_path / "r.sqlite", dead_letter=None) as rep:
        _run(rep)
        assert rep.docs() == h.bucket.state_snapshot()
    lose()
    _change_more(h)
    h.settle()
    with Replicator(h.broker.bootstrap_servers, h.topic, tmp_path / "r.sqlite", dead_letter=None) as rep:
        _converge(rep, h)
        assert rep.docs() == h.bucket.state_snapshot()
        assert rep.consumer.lost_logs == h.partitions


def test_running_consumer_finds_a_lost_log_that_grew_past_its_offset(
        lost: tuple[Harness, Callable[[], None]], tmp_path: Path) -> None:
    """The recreated partitions already hold more than the consumer read before it fetches again: no partition
    ends below its offset and no record arrives below it. After the lost broker connection the consumer reads
    the last record it fed from each partition again; another record there is the sign (docs/client.md)."""
    h, lose = lost
    write(h.bucket, 40)
    h.settle()
    with Replicator(h.broker.bootstrap_servers, h.topic, tmp_path / "r.sqlite", dead_letter=None) as rep:
        _run(rep)
        assert rep.docs() == h.bucket.state_snapshot()
        lose()
        for i in range(40):  # deletions the consumer can only learn from the rollback records at 0
            if i % 5:
                h.bucket.delete(f"k{i}")
        write(h.bucket, 400, start=1000)  # the republished log grows far past the offsets read before
        h.settle()
        _converge(rep, h)
        assert rep.docs() == h.bucket.state_snapshot()
        assert rep.consumer.lost_logs >= 1
        assert {rb.vbucket for rb in rep.rollbacks if rb.to_seqno == 0} == set(range(h.nvb))
