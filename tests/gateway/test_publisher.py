"""The publisher against a real broker: record invariants, exactly once across restarts and crashes,
rollback records, key filters, backpressure (broker paused with SIGSTOP)."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import Bucket, vbucket_of
from gateway.broker import Broker
from gateway.invariants import check_partition
from gateway.publisher import DeliveryTimedOut, KeyFilter, Publisher
from gateway.resume import (
    CheckpointWriter,
    PublishPosition,
    ensure_topics,
    load_checkpoints,
    recover_positions,
)
from schemas.codec import RecordEncoder
from schemas.failover_log import FailoverEntry
from schemas.records import RecordType, ValueFormat
from tests.engine.kv.disk_model import db_file, write_locked
from tests.gateway.kafka_util import TopicReplica, read_topic
from tests.harness import Harness as BaseHarness
from tests.harness import harnesses, producer_conf, write

NVB = 8


class Harness(BaseHarness):
    """The shared harness plus reading the topic back and checking it."""

    def records(self) -> list:
        return read_topic(self.broker.bootstrap_servers, self.topic)

    def check(self, expect_rollbacks: bool = False) -> list:
        recs = self.records()
        by_part: dict[int, list] = {}
        for part, off, r in recs:
            by_part.setdefault(part, []).append((off, r))
        for part, items in by_part.items():
            check_partition([r for _o, r in items])
            assert all(r.vbucket % self.partitions == part for _o, r in items)
        replica = TopicReplica()
        replica.apply_all(recs)
        assert replica.state() == self.bucket.state_snapshot()
        if not expect_rollbacks:
            assert replica.rollbacks == 0
            # exactly once: no (vbucket, vbuuid, seqno) twice
            c = Counter((r.vbucket, r.vbuuid, r.seqno) for _p, _o, r in recs if r.is_data)
            assert not [k for k, n in c.items() if n > 1]
        return recs


def _rounds(h: Harness, **pump_kw: Any) -> Iterator[None]:
    """Pump until everything written is persisted, published and acknowledged, yielding after every round (the
    caller watches the publisher between rounds)."""
    for _ in range(20_000):
        n = h.pub.pump(**pump_kw)
        yield
        if n == 0 and h.pub.inflight == 0 and not h.bucket.dirty_vbuckets:
            return
        if n == 0:
            h.pub.kafka.poll(0.01)
    raise AssertionError("publisher never settled")


@pytest.fixture
def harness(kafka_broker: Broker, tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    with harnesses(kafka_broker, tmp_path, Harness) as make:
        yield make


def test_publishes_every_vbucket_into_its_partition(harness) -> None:
    h = harness()
    write(h.bucket, 300)
    h.settle()
    recs = h.check()
    types = Counter(r.type for _p, _o, r in recs)
    assert types[RecordType.FAILOVER_LOG] == NVB
    assert types[RecordType.SNAPSHOT] >= NVB
    live = sum(1 for i in range(300) if i % 5)
    assert len(h.bucket.state_snapshot()) == live
    # the hot path counts what it produced per batch (Publisher._publish): every record of the topic, and more
    # bytes than the data records' keys and document bodies (Avro adds its fields)
    assert h.pub.records_sent == h.pub.records_acked == len(recs)
    body = sum(len(r.key) + len(r.value or b"") for _p, _o, r in recs if r.is_data)
    assert body > 0 and h.pub.bytes_sent > body
    for vb in range(NVB):
        st = h.pub.status(vb)
        assert st["acknowledged_seqno"] == st["engine_high_seqno"] and st["lag"] == 0


def test_restart_resumes_exactly_after_the_last_record(harness) -> None:
    h = harness()
    write(h.bucket, 200)
    h.settle()
    CheckpointWriter(producer_conf(h.broker), h.topic).write(h.pub.take_checkpoints())
    h.pub.close()
    write(h.bucket, 100, start=200)
    h.pub = h.new_publisher()
    h.settle()
    h.check()


def test_crash_before_checkpoint_replays_tail_without_duplicates(harness) -> None:
    # Records reached Kafka but no checkpoint was ever written: the tail replay alone finds the position.
    h = harness()
    write(h.bucket, 150)
    h.settle()
    assert load_checkpoints(h.client, h.topic) == {}
    h.pub.kafka.flush(10)
    h.pub = h.new_publisher()  # the old one is simply abandoned, as after kill -9
    write(h.bucket, 50, start=150)
    h.settle()
    h.check()


def test_stale_checkpoint_plus_tail(harness) -> None:
    h = harness()
    write(h.bucket, 100)
    h.settle()
    CheckpointWriter(producer_conf(h.broker), h.topic).write(h.pub.take_checkpoints())
    write(h.bucket, 100, start=100)
    h.settle()  # published, never checkpointed
    h.pub.kafka.flush(10)
    h.pub = h.new_publisher()
    write(h.bucket, 10, start=500)
    h.settle()
    h.check()


def test_engine_crash_without_mitigation_publishes_rollback_records(harness, tmp_path: Path) -> None:
    h = harness(rollback_mitigation=False)
    write(h.bucket, 100)
    h.bucket.flush_all()
    h.settle()
    write(h.bucket, 60, start=100)  # published from memory, never persisted
    for _ in range(50):
        h.pub.pump()
    h.pub.flush(10)
    h.pub.kafka.flush(10)
    # crash the engine (and the gateway with it)
    h.bucket.close(clean=False)
    h.bucket = Bucket(h.cfg)
    h.pub = h.new_publisher()
    write(h.bucket, 30, start=1000)
    h.bucket.flush_all()
    h.settle()
    recs = h.check(expect_rollbacks=True)
    rb = [r for _p, _o, r in recs if r.type is RecordType.ROLLBACK]
    assert rb, "the engine lost published items: rollback records expected"
    for r in rb:
        assert r.seqno == h.bucket.failover_log(r.vbucket)[0].seqno  # rolled back to the new branch point
        assert r.failover_log and r.failover_log[0].vbuuid == h.bucket.failover_log(r.vbucket)[0].vbuuid


def test_lag_is_not_zero_until_the_rollback_records_owed_after_a_crash_are_acknowledged(harness) -> None:
    """docs/gateway.md "Lag": after a crash lost published writes the partition holds seqnos the engine does not
    (or as many seqnos of another branch): lag stays above 0 until the rollback records are in Kafka -- a
    caller waiting for lag 0 then reads the engine's own history (a reader stopping earlier kept the lost
    branch)."""
    h = harness(nvb=2, rollback_mitigation=False)
    write(h.bucket, 40)
    h.publish_unpersisted()
    lost = {vb: h.bucket.vbucket(vb).high_seqno for vb in range(2)}
    assert all(lost.values())
    h.bucket.close(clean=False)
    h.bucket = Bucket(h.cfg)
    # vbucket 1 gets as many new seqnos as it lost (another branch, the same high seqno); vbucket 0 none
    i = 1000
    while h.bucket.vbucket(1).high_seqno < lost[1]:
        if vbucket_of(f"k{i}".encode(), 2) == 1:
            h.bucket.set(f"k{i}", b"v")
        i += 1
    assert h.bucket.vbucket(0).high_seqno == 0 and h.bucket.vbucket(1).high_seqno == lost[1]
    unopened = Publisher(h.bucket, producer_conf(h.broker), h.topic, h.partitions, RecordEncoder(ValueFormat.AVRO),
                         recover_positions(h.client, h.topic, h.partitions, 2))
    try:
        assert unopened.status(1)["lag"] >= 1  # no stream yet: nothing vouches for the partition
    finally:
        unopened.close(timeout=5)
    h.pub = h.new_publisher()  # the stream requests produce the rollback records; none acknowledged yet
    assert h.pub.status(0)["lag"] == lost[0]
    assert h.pub.status(1)["lag"] >= 1
    assert h.pub.lag()[0] >= lost[0] + 1
    h.bucket.flush_all()
    h.settle()
    assert h.pub.lag() == (0, 0)
    h.check(expect_rollbacks=True)


def test_an_observed_position_on_a_branch_the_engine_lost_is_lag_even_at_the_same_seqno(harness) -> None:
    """docs/gateway.md "Lag", ``dcpgw up --gateways K``: the up process's publisher streams nothing and reports the
    members' checkpointed positions. A position at the engine's high seqno but on a branch the engine lost (a crash,
    then as many new writes) is not caught up; the engine's own position is."""
    h = harness(nvb=1, rollback_mitigation=False)
    write(h.bucket, 10)
    h.bucket.flush_all()
    h.settle()
    own = h.pub.acked[0].copy()
    assert own.seqno == h.bucket.vbucket(0).high_seqno > 0
    lost = own.copy()
    lost.on_failover_log([FailoverEntry(own.failover_log[0].vbuuid ^ 0x5A5A, 0)])  # a branch the engine never had
    parent = Publisher(h.bucket, producer_conf(h.broker), h.topic, h.partitions, RecordEncoder(ValueFormat.AVRO),
                       {}, vbuckets=[])
    try:
        parent.open()
        parent.observe_positions({0: lost})
        assert parent.lag() == (1, 1) and parent.status(0)["lag"] == 1
        parent.observe_positions({0: own})
        assert parent.lag() == (0, 0)
    finally:
        parent.close(timeout=5)


def test_with_mitigation_a_crash_needs_no_rollback(harness) -> None:
    h = harness()
    write(h.bucket, 120)
    for _ in range(20):
        h.pub.pump()
    h.pub.flush(10)
    h.bucket.close(clean=False)
    h.bucket = Bucket(h.cfg)
    h.pub = h.new_publisher()
    write(h.bucket, 40, start=2000)
    h.settle()
    h.check()


def test_pump_without_waiting_for_the_flush_returns_while_what_it_holds_is_not_persisted(harness) -> None:
    """The service's loop pumps with ``wait_for_flush=False`` (gateway/service.py ``_pump_loop``): with rollback
    mitigation a round that finds everything stepped held for the background flush in flight returns 0 at
    once (``waiting_for_flush``) instead of waiting for the flush on the event loop's thread. The flush here
    cannot commit while the test holds the database's write lock (another connection), so a round that waited
    would stay in pump() until the writer's busy timeout failed it."""
    h = harness()
    h.settle()
    sent = h.pub.records_sent
    write(h.bucket, 50)
    with write_locked(db_file(h.bucket)):
        stepped = sum(h.pub.pump(wait_for_flush=False) for _ in range(5))
        assert stepped >= 50  # the items (and their markers) were stepped ...
        assert h.pub.pump(wait_for_flush=False) == 0
        assert h.pub.waiting_for_flush  # ... and are held: the flush in flight cannot commit
        assert h.pub.records_sent == sent  # nothing unpersisted reached Kafka
        assert h.bucket.flush_pending
    h.settle()  # the flush commits, lands, and what was held is published
    assert not h.pub.waiting_for_flush
    h.check()


def test_key_filters(harness) -> None:
    h = harness(key_filter=KeyFilter(prefix="keep", regex=r"[02468]$"))
    for i in range(60):
        h.bucket.set(f"keep{i}", b"1")
        h.bucket.set(f"drop{i}", b"1")
    h.settle()
    recs = h.records()
    keys = {r.key for _p, _o, r in recs if r.is_data}
    assert keys == {f"keep{i}".encode() for i in range(60) if i % 2 == 0}
    for part in {p for p, _o, _r in recs}:
        check_partition([r for p, _o, r in recs if p == part])
    assert h.pub.items_filtered == 90
    assert h.pub.dcp is not None and h.pub.dcp.unacked_bytes == 0


def test_raw_values(harness) -> None:
    h = harness(value_format=ValueFormat.RAW)
    h.bucket.set("a", b'{"x": 1}')
    h.bucket.set("b", b"raw")
    h.bucket.delete("b")
    h.settle()
    recs = h.check()
    data = {(r.key, r.type): r.value for _p, _o, r in recs if r.is_data}
    assert data[(b"a", RecordType.MUTATION)] == b'{"x": 1}'
    assert data[(b"b", RecordType.DELETION)] is None


def test_paused_broker_stalls_with_bounded_memory_then_resumes(harness, kafka_broker: Broker) -> None:
    if kafka_broker.kind != "embedded":
        pytest.skip("pausing needs the embedded broker process")
    h = harness(flow_control_bytes=64 * 1024)
    write(h.bucket, 50)
    h.settle()
    kafka_broker.pause()  # type: ignore[attr-defined]
    try:
        write(h.bucket, 3000, prefix="p")
        max_unacked = 0
        for _ in range(300):
            h.pub.pump()
            assert h.pub.dcp is not None
            max_unacked = max(max_unacked, h.pub.dcp.unacked_bytes)
        assert h.pub.dcp.unacked_bytes <= 64 * 1024 + 4096  # DCP flow control holds the stream
        assert h.pub.records_acked < h.pub.records_sent or h.pub.records_sent < 3000
    finally:
        kafka_broker.resume()  # type: ignore[attr-defined]
    h.settle(100_000)
    h.check()
    assert max_unacked <= 64 * 1024 + 4096


def test_stream_from_now_skips_history_and_beginning_replays_with_rollback_to_zero(harness) -> None:
    h = harness()
    write(h.bucket, 40)
    h.settle()
    before = len([r for _p, _o, r in h.records() if r.is_data])
    h.pub.close()
    # "now": nothing already in the engine is published again, new writes are
    h.pub = h.new_publisher(stream_from="now")
    h.bucket.set("fresh", b"1")
    h.settle()
    data = [r for _p, _o, r in h.records() if r.is_data]
    assert (len(data) == before + 1 and data[-1].key == b"fresh") or b"fresh" in {r.key for r in data}
    h.pub.close()
    # "beginning": a deliberate replay, announced to consumers by a rollback record to 0 per vbucket
    h.pub = h.new_publisher(stream_from="beginning")
    h.settle()
    recs = h.records()
    rb = [r for _p, _o, r in recs if r.type is RecordType.ROLLBACK]
    assert len(rb) == NVB and all(r.seqno == 0 and r.snap_end == 0 for r in rb)
    h.check(expect_rollbacks=True)


def test_saved_offset_or_now_on_a_fresh_topic_starts_at_now(harness) -> None:
    h = harness()
    h.pub.close()
    h.topic = f"dcp.t{uuid.uuid4().hex[:10]}"  # a topic the gateway never wrote to
    h.partitions = ensure_topics(h.client, h.topic, NVB)
    write(h.bucket, 30)  # written before the gateway ever published: not wanted with "-or-now"
    h.pub = h.new_publisher(stream_from="saved-offset-or-now")
    h.bucket.set("after", b"1")
    h.settle()
    keys = [r.key for _p, _o, r in h.records() if r.is_data]
    assert keys == [b"after"]


def test_full_producer_queue_mid_batch_keeps_order_and_exactly_once(harness) -> None:
    """librdkafka's queue holds 40 records: the hot path's produce() meets BufferError in the middle of a DCP
    batch, that record and every later one wait in the backlog in order, and the topic is still exactly the
    engine's history (docs/gateway.md "Publishing path"); DCP buffer-acks sent per poll leave nothing unacked."""
    h = harness()
    h.pub.close()
    h.old.append(h.pub)
    h.pub = Publisher(h.bucket, {**producer_conf(h.broker), "queue.buffering.max.messages": 40}, h.topic,
                      h.partitions, RecordEncoder(), {vb: PublishPosition(vb) for vb in range(NVB)})
    h.pub.open()
    write(h.bucket, 1500)
    most = 0
    for _ in _rounds(h):
        most = max(most, h.pub.backlog)
    assert most > 0  # the queue really was full
    h.check()
    assert h.pub.dcp is not None and h.pub.dcp.unacked_bytes == 0
    assert h.pub.records_acked == h.pub.records_sent


def test_records_timed_out_in_librdkafka_renewed_producer_resumes_from_the_tail_exactly_once(
        harness, kafka_broker: Broker) -> None:
    """docs/scale-out.md "Delivery within the lease", the publisher's part: records that wait in librdkafka past
    ``message.timeout.ms`` (the broker frozen) make pump() raise DeliveryTimedOut; with every vbucket removed,
    renew_producer() drops them without waiting for the frozen broker -- their DCP bytes buffer-acknowledged, so
    the flow-control window is whole again -- and the vbuckets, added again from the partitions' tails once the
    broker is back, end with every change in the topic exactly once."""
    if kafka_broker.kind != "embedded":
        pytest.skip("pausing needs the embedded broker process")
    h = harness()
    write(h.bucket, 50)
    h.settle()
    conf = {**producer_conf(h.broker), "message.timeout.ms": 1000}
    h.old.append(h.pub)
    h.pub = pub = Publisher(h.bucket, conf, h.topic, h.partitions, RecordEncoder(ValueFormat.AVRO),
                            recover_positions(h.client, h.topic, h.partitions, NVB))
    pub.open()
    kafka_broker.pause()  # type: ignore[attr-defined]
    try:
        write(h.bucket, 400, prefix="p")
        deadline = time.monotonic() + 20
        with pytest.raises(DeliveryTimedOut, match="_MSG_TIMED_OUT"):
            while time.monotonic() < deadline:
                pub.pump()
                pub.kafka.poll(0.05)
        timed_out = pub.timed_out
        pub.remove_vbuckets(range(NVB))
        t = time.monotonic()
        dropped = pub.renew_producer()
        assert time.monotonic() - t < 2.0  # never waits for the frozen broker
        assert timed_out > 0 and dropped >= 0 and pub.inflight == 0 and pub.timed_out == 0 and pub.producer_renewals == 1
        # every timed-out or dropped record's DCP bytes went back to the flow-control window
        assert pub.dcp is not None and pub.dcp.unacked_bytes == 0
    finally:
        kafka_broker.resume()  # type: ignore[attr-defined]
    time.sleep(1.0)  # records that were in flight when they timed out may still land: the tail shows them
    pub.add_vbuckets(recover_positions(h.client, h.topic, h.partitions, NVB))
    write(h.bucket, 100, prefix="q")
    h.settle(100_000)
    h.check()  # invariants, replay equals the engine, no (vbucket, vbuuid, seqno) twice


def test_a_corrupt_checkpoint_record_is_skipped_with_a_warning(kafka_broker: Broker, caplog) -> None:
    """docs/reliability.md: a checkpoint-topic record that is not a position (garbage, a truncated JSON) is
    ignored with a warning naming its offset -- recovery and the ``up`` process's progress follower
    (``CheckpointFollower``) read the positions around it; a tombstone is skipped silently."""
    import logging

    from confluent_kafka import Producer

    from gateway.resume import CheckpointFollower, checkpoint_topic_name

    client = {"bootstrap.servers": kafka_broker.bootstrap_servers}
    topic = f"dcp.cp{uuid.uuid4().hex[:10]}"
    ensure_topics(client, topic, 4)
    good = PublishPosition(2)
    good.seqno, good.offset = 7, 3
    follower = CheckpointFollower(client, topic, poll_s=0.05)  # from the (empty) topic's end
    follower.start()
    p = Producer(client)
    for value in (good.to_json(), b"not json", good.to_json()[:-5], None):
        p.produce(checkpoint_topic_name(topic), key=b"2", value=value, partition=0)
    p.flush(10)
    with caplog.at_level(logging.WARNING, logger="gateway.resume"):
        got = load_checkpoints(client, topic)
    assert got == {2: good}
    warned = [r.getMessage() for r in caplog.records if "corrupt checkpoint" in r.getMessage()]
    assert len(warned) == 2 and "offset 1" in warned[0] and "offset 2" in warned[1], warned
    try:
        deadline = time.monotonic() + 30
        resend = time.monotonic() + 1
        while follower.positions != {2: good}:
            assert time.monotonic() < deadline, follower.positions
            if time.monotonic() > resend:  # written before its start offset was resolved: written again
                p.produce(checkpoint_topic_name(topic), key=b"2", value=good.to_json(), partition=0)
                p.flush(10)
                resend = time.monotonic() + 1
            time.sleep(0.05)
    finally:
        follower.close()


def test_checkpoint_follower_from_the_beginning_reads_what_was_written_before_it(kafka_broker: Broker) -> None:
    """bench.gateway's scale-out runs follow the members' progress with ``CheckpointFollower(from_beginning=
    True)``: positions checkpointed before the follower started count too, and later ones replace them."""
    from confluent_kafka import Producer

    from gateway.resume import CheckpointFollower, checkpoint_topic_name

    client = {"bootstrap.servers": kafka_broker.bootstrap_servers}
    topic = f"dcp.cpb{uuid.uuid4().hex[:10]}"
    ensure_topics(client, topic, 4)
    old = {vb: PublishPosition(vb) for vb in range(4)}
    for vb, pos in old.items():
        pos.seqno, pos.offset = 10 + vb, vb
    p = Producer(client)
    for pos in old.values():
        p.produce(checkpoint_topic_name(topic), key=str(pos.vbucket).encode(), value=pos.to_json(), partition=0)
    p.flush(10)
    follower = CheckpointFollower(client, topic, poll_s=0.05, from_beginning=True)
    follower.start()
    try:
        deadline = time.monotonic() + 30
        while follower.positions != old:
            assert time.monotonic() < deadline, follower.positions
            time.sleep(0.05)
        newer = PublishPosition(1)
        newer.seqno, newer.offset = 99, 9
        p.produce(checkpoint_topic_name(topic), key=b"1", value=newer.to_json(), partition=0)
        p.flush(10)
        while follower.positions.get(1) != newer:
            assert time.monotonic() < deadline, follower.positions
            time.sleep(0.05)
        assert follower.positions == {**old, 1: newer}
    finally:
        follower.close()


def _count_reports(pub: Publisher) -> list[int]:
    """Count the delivery reports the publisher's producer serves from now on (its callback, wrapped)."""
    served = [0]
    inner = pub._dr

    def counting(err, msg) -> None:
        served[0] += 1
        inner(err, msg)

    pub._dr = counting
    return served


def _publish_all(h: Harness) -> None:
    """Pump until everything the engine has was published and acknowledged (mitigation off: from memory)."""
    for _ in range(10_000):
        if h.pub.pump() == 0 and h.pub.inflight == 0:
            return
        h.pub.kafka.poll(0.01)
    raise AssertionError("publisher never settled")


def _last_offsets(h: Harness) -> dict[int, int]:
    """vbucket -> offset of its last record in the topic."""
    out: dict[int, int] = {}
    for _part, off, r in h.records():
        out[r.vbucket] = max(out.get(r.vbucket, -1), off)
    return out


def test_records_between_delivery_reports_are_acknowledged_by_the_next_report(harness) -> None:
    """docs/gateway.md "Publishing path": a data record followed by another of its partition in the same batch
    is produced without a delivery report; the next report acknowledges it, its offset proving every record in
    between was written. Positions still move to the exact offset of each vbucket's last record."""
    h = harness(rollback_mitigation=False)
    served = _count_reports(h.pub)
    write(h.bucket, 400)
    _publish_all(h)
    recs = h.check()
    assert h.pub.records_sent == h.pub.records_acked == len(recs)
    # one report per batch run of a partition, not per record: 8 vbuckets, a few batches
    assert 0 < served[0] <= len(recs) // 4
    last = _last_offsets(h)
    for vb in range(NVB):
        assert h.pub.acked[vb].offset == last[vb]
        assert h.pub.status(vb)["lag"] == 0


def test_a_run_of_unreported_records_is_one_entry_counting_them(harness) -> None:
    """Records of one vbucket produced without a report one after the other share one in-flight entry
    (``_Inflight.count``): ``inflight`` still counts records, the next report acknowledges them all, and the
    vbucket's position moves to the exact offset of its last record."""
    h = harness(nvb=1, rollback_mitigation=False)
    write(h.bucket, 60)
    sent = h.pub.pump(max_messages=1000)
    assert sent > 0
    fifo = list(h.pub._inflight[0])
    assert max(e.count for e in fifo) > 1 and all(e.count == 1 for e in fifo if e.reported)
    assert sum(e.count for e in fifo) == h.pub.inflight == h.pub.records_sent - h.pub.records_acked
    assert len(fifo) < h.pub.inflight
    _publish_all(h)
    recs = h.check()
    assert h.pub.records_sent == h.pub.records_acked == len(recs) and h.pub.inflight == 0 and h.pub._merged == 0
    assert h.pub.acked[0].offset == _last_offsets(h)[0]
    assert h.pub.dcp is not None and h.pub.dcp.unacked_bytes == 0  # every record's DCP bytes acknowledged


def _one_vbucket_in_two_batches(harness) -> tuple[Harness, int]:
    """One vbucket, 60 changes: the first pump publishes 10 DCP messages (its batch ends with a reported
    record), the rest waits for the next pump. Returns the harness and the offset of batch 1's last record."""
    h = harness(nvb=1, rollback_mitigation=False)
    write(h.bucket, 60)
    h.pub.pump(max_messages=10)
    assert h.pub.flush(10) == 0
    return h, h.pub._last_offset[0]


def test_another_producer_writing_in_between_makes_the_partition_report_every_record(harness, caplog) -> None:
    """More offsets than records between two reports: another producer wrote to the partition (a partition two
    group members share when the topic has fewer partitions than vbuckets). The count proves nothing there any
    more, so every later record of that partition is produced with a report of its own."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    h, first = _one_vbucket_in_two_batches(harness)
    c = Consumer({"bootstrap.servers": h.broker.bootstrap_servers, "group.id": f"g{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False})
    c.assign([TopicPartition(h.topic, 0, first)])
    msg = c.poll(10)
    c.close()
    assert msg is not None and msg.error() is None and msg.offset() == first
    other = Producer({"bootstrap.servers": h.broker.bootstrap_servers})
    # a copy of the gateway's last record: a valid record the checks below can read
    other.produce(h.topic, msg.value(), msg.key(), partition=0, headers=msg.headers())
    assert other.flush(10) == 0
    served = _count_reports(h.pub)
    with caplog.at_level("WARNING", logger="gateway.publisher"):
        _publish_all(h)
    assert "another producer writes to it" in caplog.text
    assert h.pub.error is None and h.pub.errors == 0
    assert h.pub.acked[0].offset == _last_offsets(h)[0]
    before, sent = served[0], h.pub.records_sent
    write(h.bucket, 20, start=60)
    _publish_all(h)
    assert served[0] - before == h.pub.records_sent - sent > 1  # one report per record now
    assert h.pub.acked[0].offset == _last_offsets(h)[0]


def test_fewer_offsets_than_records_between_two_reports_stops_as_after_a_delivery_timeout(harness) -> None:
    """Fewer offsets than records between two reports: a record produced without a report was not written
    (librdkafka failed it on its own and wrote the next). Nothing of that run is acknowledged and pump() raises
    DeliveryTimedOut, after which the publisher resumes from the partitions' tails (as for a timed-out record).
    Simulated by moving the publisher's last acknowledged offset one up, as if the broker had written one
    record of the run fewer."""
    h, first = _one_vbucket_in_two_batches(harness)
    h.pub._last_offset[0] += 1
    with pytest.raises(DeliveryTimedOut, match="not written"):
        for _ in range(1000):
            h.pub.pump()
            h.pub.kafka.poll(0.01)
    # nothing of the run acknowledged: the position stays at the snapshot before it
    assert h.pub.acked[0].offset < first and h.pub.records_acked == first + 1
    assert h.pub.dcp is not None and h.pub.dcp.unacked_bytes == 0  # its DCP bytes went back to the window


def test_a_pump_releases_at_most_max_messages_of_what_mitigation_held(harness) -> None:
    """A landed background flush releases every item it persisted at once (up to 16,384: ~0.25 s of the
    caller's thread, in `dcpgw up` the event loop that also serves the API and the KV port). pump(max_messages)
    publishes at most that many of them per call; a vbucket cut short goes to the back, and the topic is still
    exactly the engine's history."""
    h = harness()
    write(h.bucket, 600)
    most = 0
    sent = h.pub.records_sent
    for _ in _rounds(h, max_messages=16):
        most = max(most, h.pub.records_sent - sent)
        sent = h.pub.records_sent
    assert 0 < most <= 16
    h.check()


def test_mitigation_publishes_the_small_snapshots_of_many_steps_as_few(harness) -> None:
    """A trickle of writes: every pump round's DCP step takes one item per vbucket, a memory snapshot each. With
    rollback mitigation they wait for the same flush and are released together: published as one snapshot
    (gateway/snapshot_merge.py), split where a key comes again, and the merged markers' DCP bytes are
    buffer-acknowledged like the rest. The flush is held back here by another connection holding the write
    lock, so that every round's step is held."""
    h = harness(nvb=2)
    h.settle()
    sent = h.pub.records_sent  # the failover-log records
    rounds = 0
    with write_locked(db_file(h.bucket)):
        for i in range(40):
            for vb in range(2):
                # a key per round, except that round 20 writes round 5's key again
                key = next(f"k{j}-{i if i != 20 else 5}" for j in range(10_000)
                           if vbucket_of(f"k{j}-{i if i != 20 else 5}".encode(), 2) == vb)
                h.bucket.set(key, b'{"n": %d}' % i)
            h.pub.pump(wait_for_flush=False)
            rounds += 1
        assert h.pub.records_sent == sent  # held: the first flush cannot commit
    h.settle()
    recs = h.check()
    snaps = [r for _p, _o, r in recs if r.type is RecordType.SNAPSHOT]
    data = [r for _p, _o, r in recs if r.is_data]
    assert len(data) == 2 * rounds
    # a snapshot per vbucket for the first flush's round, one for the rest, one more where the key came again
    assert len(snaps) <= 2 * 4, [(r.vbucket, r.snap_start, r.snap_end) for r in snaps]
    assert h.pub.snapshots_merged == 2 * rounds - len(snaps)
    for r in snaps:  # no key twice inside a published snapshot
        keys = [d.key for d in data if d.vbucket == r.vbucket and r.snap_start <= d.seqno <= r.snap_end]
        assert len(keys) == len(set(keys))
    dcp = h.pub.dcp
    assert dcp is not None and dcp.unacked_bytes == 0  # every DCP byte buffer-acknowledged, merged markers too
