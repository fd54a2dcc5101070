"""Scale-out by Kafka group membership (docs/scale-out.md): gateway members sharing one engine's vbuckets.

Two :class:`~gateway.member.GroupMember` in this process (one engine, one loop thread driving both; each has its
membership thread): vbuckets move when a member joins and leaves while documents are written; every partition
passes the invariants checker and an independent replay of the topic equals the engine."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import Bucket, BucketConfig, KeyNotFound
from gateway.broker import Broker
from gateway.exceptions import GatewayError
from gateway.invariants import data_positions
from gateway.kafka.membership import (
    LEASE_FRACTION,
    Membership,
    VBucketHandoff,
    ensure_members_topic,
    fenced_producer_config,
    members_topic_name,
    vbuckets_of,
)
from gateway.member import GroupMember
from gateway.publisher import DeliveryBudget, Publisher
from gateway.resume import CheckpointWriter, PublishPosition, ensure_topics
from schemas.codec import RecordEncoder
from schemas.records import ValueFormat
from tests.gateway.kafka_util import TopicChecks
from tests.harness import producer_conf

NVB = 16


def test_vbuckets_of_partition_modulo() -> None:
    assert vbuckets_of([0], 4, 10) == [0, 4, 8]
    assert vbuckets_of([1, 3], 4, 10) == [1, 3, 5, 7, 9]
    assert vbuckets_of([], 4, 10) == []
    owned = [vbuckets_of([p], 4, 10) for p in range(4)]
    assert sorted(v for vs in owned for v in vs) == list(range(10))  # every vbucket exactly once


@given(nvb=st.integers(1, 300), t=st.integers(1, 80), members=st.integers(1, 6), data=st.data())
def test_any_assignment_gives_every_vbucket_to_exactly_one_member(nvb: int, t: int, members: int,
                                                                  data: st.DataObject) -> None:
    owner = data.draw(st.lists(st.integers(0, members - 1), min_size=t, max_size=t))  # partition -> member
    owned = [vbuckets_of([p for p in range(t) if owner[p] == m], t, nvb) for m in range(members)]
    flat = [vb for vbs in owned for vb in vbs]
    assert sorted(flat) == list(range(nvb))  # no vbucket twice, none missing


@given(session_ms=st.integers(1000, 300_000), given_ms=st.one_of(st.none(), st.integers(1, 600_000)),
       queue_kb=st.one_of(st.none(), st.integers(1, 1 << 21)))
def test_fenced_producer_never_keeps_a_record_past_the_lease(session_ms: int, given_ms: int | None,
                                                            queue_kb: int | None) -> None:
    conf: dict[str, Any] = {"bootstrap.servers": "x"}
    if given_ms is not None:
        conf["message.timeout.ms"] = given_ms
    if queue_kb is not None:
        conf["queue.buffering.max.kbytes"] = queue_kb
    out = fenced_producer_config(conf, session_ms)
    lease_ms = int(session_ms * LEASE_FRACTION)
    assert out["message.timeout.ms"] <= lease_ms  # docs/scale-out.md "Fencing"
    assert out["message.timeout.ms"] == (lease_ms if given_ms is None else min(given_ms, lease_ms))
    assert out["queue.buffering.max.kbytes"] <= 16 * 1024
    assert out["bootstrap.servers"] == "x" and conf.get("message.timeout.ms") == given_ms  # input untouched


def test_lease_expires_on_the_injected_clock_and_when_fenced() -> None:
    now = [100.0]
    m = Membership({"bootstrap.servers": "127.0.0.1:1"}, "t", "g", 16, VBucketHandoff(), lambda vbs: {},
                   session_timeout_ms=9000, fail_stop=True, clock=lambda: now[0])
    assert m.lease_expired()  # nothing confirmed yet
    m.lease_until = now[0] + m.lease_s
    assert m.lease_s == pytest.approx(3.0) and not m.lease_expired()
    now[0] += 2.9
    assert not m.lease_expired()
    now[0] += 0.2
    assert m.lease_expired()  # paused (or cut off) past the lease: publish nothing more
    m.lease_until = now[0] + m.lease_s
    m._fence("expelled")
    assert m.lease_expired() and m.fenced == "expelled" and m.owned == []


def test_join_timeout_on_the_injected_clock() -> None:
    """docs/scale-out.md "A join that never completes": by default the rebalance timeout plus the session
    timeout; a member waiting longer for an assignment raises an error naming the cause, one that has one never."""
    now = [50.0]
    m = Membership({"bootstrap.servers": "127.0.0.1:1"}, "t", "g", 16, VBucketHandoff(), lambda vbs: {},
                   session_timeout_ms=6000, clock=lambda: now[0])
    assert m.join_timeout_s == pytest.approx(306.0)
    m._check_join()  # not joining yet
    m.waiting_since = now[0]
    now[0] += 306.0
    m._check_join()
    now[0] += 0.1
    with pytest.raises(GatewayError, match="no assignment from the group coordinator in 306 s"):
        m._check_join()
    m.waiting_since = None  # an assignment arrived
    m._check_join()


def test_delivery_budget_follows_the_brokers_rate_on_the_injected_clock() -> None:
    """docs/scale-out.md "Delivery within the lease": the records a member leaves in librdkafka are its broker's
    measured delivery rate times the target, so that each is delivered within about the target."""
    now = [0.0]
    b = DeliveryBudget(0.5, floor=100, ceiling=10_000, interval_s=0.25, clock=lambda: now[0])
    assert b.limit == 400 and b.room(0, 0) == 400  # before any measurement: 4 x the floor
    assert b.room(0, 350) == 50  # librdkafka held 350 records
    now[0] += 0.25
    # 2000 records/s delivered: 1000 wanted; librdkafka ran empty in the interval: at most twice the 350 it held
    assert b.room(500, 300) == 700 - 300
    assert b.rate == pytest.approx(2000)
    now[0] += 0.25
    assert b.room(1000, 300) == 1000 - 300  # the same rate, always busy: 1000 (at most twice 700)
    now[0] += 0.25
    assert b.room(1100, 150) == 200 - 150  # the broker slowed to 400/s: down to 200 at once
    now[0] += 0.25
    assert b.room(1100, 150) == 100 - 150 and b.waits == 1  # nothing delivered: the floor; no room
    limits = []
    delivered = 1100
    for _ in range(8):  # 20,000/s, always busy: the limit at most doubles per interval, up to the ceiling
        now[0] += 0.25
        delivered += 5000
        b.room(delivered, 150)
        limits.append(b.limit)
    assert limits == [200, 400, 800, 1600, 3200, 6400, 10_000, 10_000]
    now[0] += 0.1
    b.room(delivered + 10, 0)  # librdkafka ran empty: the rate says how fast records came, not what the broker takes
    now[0] += 0.15
    assert b.room(delivered + 20, 0) == 10_000  # so the limit does not fall
    b.timed_out()
    assert b.limit == 100 and b.room(5620, 0) == 100  # records timed out: from the floor again
    with pytest.raises(GatewayError, match="positive"):
        DeliveryBudget(0)


def test_delivery_budget_does_not_grow_on_a_queue_that_never_filled() -> None:
    """docs/scale-out.md "Delivery within the lease": records that came slowly and were delivered at once (the
    queue never filled) say nothing of how many the broker delivers within the target; the limit grows no
    further than twice what librdkafka held, so a burst after a quiet spell (persisted items released at once)
    is handed over at most a doubling per interval -- not 17,000 records at once (bench run 2)."""
    now = [0.0]
    b = DeliveryBudget(0.83, floor=256, ceiling=100_000, interval_s=0.25, clock=lambda: now[0])
    assert b.room(0, 0) == 1024
    delivered = 0
    for _ in range(20):  # 5 s at 20,000 records/s delivered, librdkafka holding at most 100 at a time
        for q in (0, 100, 50):
            now[0] += 0.25 / 3
            delivered += 5000 // 3
            b.room(delivered, q)
    assert b.rate is not None and b.rate > 19_000
    assert b.limit == 1024  # 16,600 wanted (rate x target); never more than twice the 100 held
    assert b.room(delivered, 0) == 1024  # the burst: 1024 records handed over, not 16,600
    seen = []
    for _ in range(5):  # the burst fills librdkafka; the broker keeps up (always busy): a doubling per interval
        now[0] += 0.25
        delivered += 5000
        b.room(delivered, b.limit)
        seen.append(b.limit)
    assert seen == [2048, 4096, 8192, 16_384, 16_600]


class _IdlePublisher:
    """What GroupMember asks of a publisher with nothing in flight."""

    assigned: set[int] = set()

    def unacked(self, vbuckets: list[int]) -> int:
        return 0

    def take_checkpoints(self) -> dict[int, Any]:
        return {}


def test_delivery_recovery_waits_for_an_answer_sent_after_the_renewal_then_settle_s() -> None:
    """docs/scale-out.md "Delivery within the lease": after a delivery timeout the member resumes its vbuckets
    from the tails -- and lets a revoke complete -- only once the coordinator accepted a generation check sent
    after the producer was renewed, plus ``settle_s`` (records in flight when they timed out may still land)."""
    now = [10.0]
    conf = {"bootstrap.servers": "127.0.0.1:1"}
    m = GroupMember(lambda vbs: _IdlePublisher(), conf, conf, "t", 8, NVB, "g",  # type: ignore[arg-type,return-value]
                    session_timeout_ms=6000, clock=lambda: now[0])
    ms = m.membership
    assert m.settle_s == pytest.approx(1.0) and m._settled() and m._released([1])
    m._renewed_at = now[0]
    ms.lease_until = now[0] - 0.5 + ms.lease_s  # the last accepted check was sent before the renewal
    now[0] += 5.0
    assert not m._settled() and not m._released([1])  # the broker has not answered since: still stalled
    ms.lease_until = now[0] - 0.1 + ms.lease_s  # a check sent after the renewal was accepted
    assert not m._settled()
    now[0] += 0.95
    assert not m._released([1])
    now[0] += 0.1
    assert m._released([1]) and m._renewed_at is None and m._settled()


def test_checkpoint_not_delivered_is_written_again() -> None:
    """A member's checkpoint records time out with its lease (message.timeout.ms): a vbucket whose position does
    not move afterwards would keep an old checkpoint for good, so the newest position goes back to pending."""
    w = CheckpointWriter({"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 200}, "t")
    w.write({3: PublishPosition(3, seqno=7), 5: PublishPosition(5, seqno=9)})
    assert not w.pending and w.written == 2
    w.write({5: PublishPosition(5, seqno=10)})
    deadline = time.monotonic() + 10
    while w.failed < 3 and time.monotonic() < deadline:
        w._p.poll(0.1)  # nothing answers at 127.0.0.1:1: the records time out
    assert w.failed == 3
    assert {vb: p.seqno for vb, p in w.pending.items()} == {3: 7, 5: 10}  # the newest of each, once
    w._p.purge()


def test_members_topic_name() -> None:
    assert members_topic_name("dcp.default") == "dcp.default.members"


def test_handoff_revoke_returns_only_once_released() -> None:
    h = VBucketHandoff()
    log: list[Any] = []
    pending = {"left": 2}

    def released(vbs: list[int]) -> bool:
        pending["left"] -= 1
        return pending["left"] <= 0

    done = threading.Event()

    def revoke() -> None:
        h.revoke([1, 2], timeout=10)
        done.set()

    t = threading.Thread(target=revoke)
    t.start()
    deadline = time.monotonic() + 5
    while not h.pending:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    h.serve(lambda vbs: log.append(("stop", vbs)), released, lambda p: log.append(("add", p)))
    assert log == [("stop", [1, 2])] and not done.is_set()  # in flight: not released yet
    h.serve(lambda vbs: log.append(("stop", vbs)), released, lambda p: log.append(("add", p)))
    t.join(5)
    assert done.is_set() and log == [("stop", [1, 2])]


def test_handoff_hands_errors_to_the_waiting_thread_and_close_releases_waiters() -> None:
    h = VBucketHandoff()
    errors: list[BaseException] = []

    def assign() -> None:
        try:
            h.assign([3], {3: None}, timeout=10)
        except GatewayError as e:
            errors.append(e)

    t = threading.Thread(target=assign)
    t.start()
    while not h.pending:
        time.sleep(0.01)

    def boom(_p: Any) -> None:
        raise GatewayError("cannot resume")

    h.serve(lambda vbs: None, lambda vbs: True, boom)
    t.join(5)
    assert [str(e) for e in errors] == ["cannot resume"]
    # a closed handoff lets every waiter go (the process is stopping)
    t2 = threading.Thread(target=lambda: h.revoke([1], timeout=10))
    t2.start()
    while not h.pending:
        time.sleep(0.01)
    h.close()
    t2.join(5)
    assert not t2.is_alive()
    h.revoke([2], timeout=0.1)  # closed: returns at once


def test_timeout_when_the_loop_never_serves() -> None:
    with pytest.raises(GatewayError, match="did not revoke"):
        VBucketHandoff().revoke([1], timeout=0.05)


def test_empty_group_name_is_refused() -> None:
    with pytest.raises(GatewayError, match="group name"):
        Membership({}, "t", "", 4, VBucketHandoff(), lambda vbs: {})


class Members(TopicChecks):
    """One engine, members added at will, all stepped by the test's thread."""

    def __init__(self, broker: Broker, tmp: Path) -> None:
        self.broker = broker
        self.tmp = tmp
        self.client = {"bootstrap.servers": broker.bootstrap_servers, "fetch.wait.max.ms": 20}
        self.topic = f"dcp.m{uuid.uuid4().hex[:10]}"
        self.bucket = Bucket(BucketConfig(data_dir=tmp / "data", num_vbuckets=NVB, seed=None))
        self.partitions = ensure_topics(self.client, self.topic, 8)  # two vbuckets per partition
        self.group = f"g-{uuid.uuid4().hex[:8]}"
        ensure_members_topic(self.client, self.topic, 4)
        self.members: list[GroupMember] = []
        self.written = 0

    def add(self, name: str) -> GroupMember:
        def make(vbs: list[int]) -> Publisher:
            return Publisher(self.bucket, producer_conf(self.broker), self.topic, self.partitions,
                             RecordEncoder(ValueFormat.AVRO), {}, vbuckets=vbs, connection_name=f"dcpgw-{name}")

        m = GroupMember(make, self.client, producer_conf(self.broker), self.topic, self.partitions, NVB,
                        self.group, session_timeout_ms=6000, checkpoint_interval=0.2, member_name=name)
        m.start()
        self.members.append(m)
        return m

    def write(self, n: int) -> None:
        for i in range(self.written, self.written + n):
            self.bucket.set(f"k{i % 97}", f'{{"n": {i}}}'.encode())  # overwrites too: de-duplication
            if i % 7 == 0:
                with contextlib.suppress(KeyNotFound):
                    self.bucket.delete(f"k{(i * 3) % 97}")
        self.written += n

    def step_until(self, done: Callable[[], bool], timeout: float = 60.0, write: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, [(m.membership.owned, m.taken, m.released) for m in self.members]
            if write:
                self.write(write)
            for m in list(self.members):
                if not m.step():
                    m.finish()
                    self.members.remove(m)
            time.sleep(0.002)

    def owned(self) -> list[list[int]]:
        return [sorted(m.publisher.assigned) for m in self.members]

    def idle(self) -> bool:
        if self.bucket.dirty_vbuckets:
            return False
        return all(m.publisher.inflight == 0 and m.publisher.lag()[0] == 0 for m in self.members)

    def actives(self) -> dict[bytes, tuple[bytes, int]]:
        return self.bucket.state_snapshot()

    def close(self) -> None:
        for m in self.members:
            m.leave()
        try:
            self.step_until(lambda: not self.members, timeout=30)
        finally:
            for m in self.members:
                m.finish()
            self.bucket.close(clean=False)


@pytest.fixture
def members(kafka_broker: Broker, tmp_path: Path) -> Iterator[Members]:
    ms = Members(kafka_broker, tmp_path)
    try:
        yield ms
    finally:
        ms.close()


def test_two_members_share_and_hand_over_vbuckets_without_duplicate_or_gap(members: Members) -> None:
    a = members.add("a")
    members.step_until(lambda: members.owned() == [list(range(NVB))], write=3)
    b = members.add("b")
    # the join rebalances (eager: everything revoked, then split in two) while writes go on
    members.step_until(lambda: sorted(len(o) for o in members.owned()) == [8, 8] and b.taken == 8, write=3)
    assert set(members.owned()[0]).isdisjoint(members.owned()[1])
    assert a.released >= NVB and a.taken >= NVB
    members.step_until(lambda: members.written > 300, write=5)
    members.step_until(members.idle)
    # b leaves cleanly: its vbuckets are released (acknowledged, checkpointed) before a resumes them
    b.leave()
    members.step_until(lambda: members.owned() == [list(range(NVB))], write=3)
    members.write(100)
    members.step_until(members.idle)
    recs = members.check()  # invariants on every partition; replay == engine
    # no (vbucket, vbuuid, seqno) published twice, by either member
    for part in range(members.partitions):
        dup = [k for k, n in data_positions([(o, r) for p, o, r in recs if p == part]).items() if n > 1]
        assert not dup, dup[:5]


def test_a_member_whose_recovery_fails_stops_with_the_error(members: Members) -> None:
    m = members.add("a")

    def broken(vbs: list[int]) -> Any:
        raise KeyError("no checkpoint topic")  # anything: not a GatewayError

    m.membership.recover = broken
    with pytest.raises(GatewayError, match="membership failed: 'no checkpoint topic'"):
        members.step_until(lambda: False, timeout=60)
    assert not m.publisher.assigned
    members.members.remove(m)
    m.finish()  # closes cleanly after the error
    assert not m.membership.alive
