"""ChangeStreamConsumer against a real broker and the real in-process gateway publisher."""

from __future__ import annotations

import asyncio
import gc
import sqlite3
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.client import consumer as consumer_module
from connectors.client.consumer import (
    GC_YOUNG_THRESHOLD,
    ChangeStreamConsumer,
    DeadLetter,
    PartialChange,
    RollbackInstruction,
)
from connectors.client.replay import Snapshot
from connectors.exceptions import ConnectorError, DecodeError
from connectors.replicate import Replicator
from gateway.broker import Broker
from gateway.resume import READ_TO_END_FETCH_WAIT_MS
from schemas.codec import read_change, read_change_value
from tests.harness import Harness, write


class CountingReplicator(Replicator):
    """Also counts every (vbucket, vbuuid, seqno) applied -- exactly once across restarts."""

    def __init__(self, *a: Any, applied: Counter[tuple[int, int]] | None = None, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.applied: Counter[tuple[int, int]] = Counter() if applied is None else applied

    def on_snapshot(self, snap: Snapshot) -> None:
        super().on_snapshot(snap)
        for c in snap.changes:
            self.applied[(c.vbucket, c.seqno)] += 1

    def on_rollback(self, rb: RollbackInstruction) -> None:
        super().on_rollback(rb)
        for k in [k for k in self.applied if k[0] == rb.vbucket and k[1] > rb.to_seqno]:
            del self.applied[k]


def replicate(h: Harness, db: Path, **kw: Any) -> Replicator:
    rep = Replicator(h.broker.bootstrap_servers, h.topic, db, **kw)
    rep.run(until_caught_up=True)
    return rep


def test_replica_equals_engine_after_writes_and_deletes(harness: Any, tmp_path: Path) -> None:
    h = harness()
    write(h.bucket, 300)
    h.settle()
    with replicate(h, tmp_path / "r.sqlite") as rep:
        assert rep.docs() == h.bucket.state_snapshot()
        assert rep.rollbacks == []
    # more writes, overwrites and deletes; a new process resumes from the stored state
    write(h.bucket, 200, start=250)
    for i in range(1, 100, 3):
        if i % 5:
            h.bucket.delete(f"k{i}")
    h.settle()
    with replicate(h, tmp_path / "r.sqlite") as rep:
        assert rep.docs() == h.bucket.state_snapshot()
        assert 0 < rep.changes <= 200 + 200 // 5 + 34


def test_vbuckets_sharing_partitions_apply_every_change_exactly_once(harness: Any, tmp_path: Path) -> None:
    """Eight vbuckets in three partitions: their records interleave in a partition, so the feed loop's
    per-partition and per-vbucket shortcuts switch at every record, and confirming one vbucket's snapshot also
    saves the partition's settled vbuckets. The replica equals the engine and every change is applied once,
    across a restart that resumes from the stored offsets."""
    h = harness(nvb=8, partitions=3)
    write(h.bucket, 400)
    h.settle()
    db = tmp_path / "r.sqlite"
    applied: Counter[tuple[int, int]] = Counter()
    with CountingReplicator(h.broker.bootstrap_servers, h.topic, db, applied=applied) as rep:
        rep.run(until_caught_up=True)
        assert rep.docs() == h.bucket.state_snapshot()
        assert len({vb for vb, _ in applied}) == 8
    write(h.bucket, 300, start=200)
    for i in range(1, 400, 7):
        if i % 5:
            h.bucket.delete(f"k{i}")
    h.settle()
    with CountingReplicator(h.broker.bootstrap_servers, h.topic, db, applied=applied) as rep:
        rep.run(until_caught_up=True)
        assert rep.docs() == h.bucket.state_snapshot()
    assert set(applied.values()) == {1}, "a change was applied twice"
    # the last change applied per vbucket is its high seqno (deduplicated seqnos are never published)
    assert {vb: max(q for v, q in applied if v == vb) for vb in range(8)} == {
        vb: h.bucket.vbucket(vb).high_seqno for vb in range(8)}


def test_sync_iterator_and_asyncio_apis(harness: Any) -> None:
    h = harness()
    write(h.bucket, 100)
    h.settle()
    expected = h.bucket.state_snapshot()

    def apply(docs: dict[bytes, tuple[bytes, int]], ev: Any) -> None:
        assert isinstance(ev, Snapshot)
        for c in ev.changes:
            if c.deleted:
                docs.pop(c.key, None)
            else:
                assert c.value is not None
                docs[c.key] = (c.value, c.vbucket)

    docs: dict[bytes, tuple[bytes, int]] = {}
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic) as c:
        it = c.events(until_caught_up=True)
        for ev in it:
            apply(docs, ev)
            c.commit(ev)
        assert c.caught_up()
    assert docs == expected

    async def main() -> dict[bytes, tuple[bytes, int]]:
        out: dict[bytes, tuple[bytes, int]] = {}
        with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic) as c:
            async for ev in c.aevents(until_caught_up=True):
                apply(out, ev)
                c.commit(ev)
        return out

    assert asyncio.run(main()) == expected


def test_commit_is_required_before_the_next_event(harness: Any) -> None:
    h = harness()
    write(h.bucket, 20)
    h.settle()
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic) as c:
        it = c.events()
        ev = next(it)
        with pytest.raises(ConnectorError):
            next(it)
        c.commit(ev)  # still open: confirming it works
        with pytest.raises(ConnectorError):
            c.commit(ev)  # but only once
        ev2 = next(c.events())  # a new iterator continues
        assert isinstance(ev2, Snapshot) and ev2 != ev
        c.commit(ev2)


def test_engine_crash_rollback_undoes_exactly_the_lost_keys(harness: Any, tmp_path: Path) -> None:
    h = harness(rollback_mitigation=False)
    write(h.bucket, 100)
    h.bucket.flush_all()
    h.settle()
    db = tmp_path / "r.sqlite"
    with replicate(h, db):
        pass
    write(h.bucket, 60, start=100)  # published from memory, never persisted
    h.publish_unpersisted()
    rep = CountingReplicator(h.broker.bootstrap_servers, h.topic, db)
    with rep:
        rep.run()
        lost = {k for (k, _v) in rep.docs().items()} - set(h.bucket.state_snapshot())
        lost_seqnos = set(rep.applied)
    assert lost_seqnos, "the replica applied unpersisted items"
    h.crash_engine()
    survivors = h.bucket.state_snapshot()
    assert not lost & set(survivors)
    write(h.bucket, 30, start=1000)
    h.bucket.flush_all()
    h.settle()
    rep = CountingReplicator(h.broker.bootstrap_servers, h.topic, db)
    with rep:
        rep.run()
        assert rep.docs() == h.bucket.state_snapshot()
        assert rep.rollbacks and not any(r.rebuild_from_zero for r in rep.rollbacks)
        undone = {u.key for r in rep.rollbacks for u in r.undo}
        # exactly the keys the lost writes touched (k100..k159 that were applied), all restored to absence
        assert lost <= undone <= {f"k{i}".encode() for i in range(100, 160)}
        assert all(u.prior_value is None for r in rep.rollbacks for u in r.undo)
        for r in rep.rollbacks:
            # back to a snapshot boundary at or below the engine's new branch point
            assert r.to_seqno <= r.rollback.rollback_seqno == h.bucket.failover_log(r.vbucket)[0].seqno


def test_rollback_beyond_a_short_mutation_log_rebuilds_from_zero(harness: Any, tmp_path: Path) -> None:
    h = harness(rollback_mitigation=False)
    write(h.bucket, 100)
    h.bucket.flush_all()
    h.settle()
    write(h.bucket, 60, start=100)
    h.publish_unpersisted()
    db = tmp_path / "r.sqlite"
    with replicate(h, db, mutation_log_max=1):
        pass
    h.crash_engine()
    write(h.bucket, 30, start=1000)
    h.bucket.flush_all()
    h.settle()
    applied: Counter[tuple[int, int]] = Counter()
    with CountingReplicator(h.broker.bootstrap_servers, h.topic, db, mutation_log_max=1,
                            applied=applied) as rep:
        rep.run()
        assert rep.rollbacks and any(r.rebuild_from_zero for r in rep.rollbacks)
        assert rep.docs() == h.bucket.state_snapshot()


def _apply_without_log(docs: dict[bytes, tuple[bytes, int]], ev: Any) -> None:
    """An application without undo information: a rollback can only wipe the vbucket (rebuild_from_zero)."""
    if isinstance(ev, RollbackInstruction):
        assert ev.rebuild_from_zero and not ev.undo
        for k in [k for k, (_v, vb) in docs.items() if vb == ev.vbucket]:
            del docs[k]
        return
    for c in ev.changes:
        if c.deleted:
            docs.pop(c.key, None)
        else:
            assert c.value is not None
            docs[c.key] = (c.value, c.vbucket)


def _consume_without_log(h: Harness, docs: dict[bytes, tuple[bytes, int]], state_path: Path | None,
                         max_events: int = 20_000) -> int:
    """Read to the end with no mutation log (``state_path`` None: a memory store, else SQLite without a
    prior lookup), applying into ``docs``; returns the rollbacks seen. Bounded: a rebuild that loops fails."""
    rollbacks = 0
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, state_path=state_path) as c:
        for n, ev in enumerate(c.events(until_caught_up=True)):
            assert n < max_events, f"{rollbacks} rollbacks and still not caught up: the rebuild loops"
            rollbacks += isinstance(ev, RollbackInstruction)
            _apply_without_log(docs, ev)
            c.commit(ev)
    return rollbacks


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_rollback_without_a_mutation_log_rebuilds_once_and_converges(harness: Any, tmp_path: Path,
                                                                    store: str) -> None:
    """Without a mutation log a rollback rebuilds the vbucket from its partition's start; the replay meets the
    same rollback record again, which must not ask for the rebuild again (it looped for ever before): the
    vbucket's history up to there is folded into one snapshot (connectors/client/rebuild.py)."""
    h = harness(rollback_mitigation=False)
    write(h.bucket, 100)
    h.bucket.flush_all()
    h.settle()
    write(h.bucket, 60, start=100)  # published from memory, never persisted: lost by the crash
    write(h.bucket, 20, start=0)    # overwrites too
    h.publish_unpersisted()
    h.crash_engine()
    write(h.bucket, 30, start=1000)
    for i in range(1, 100, 7):
        if i % 5:  # write() deleted the multiples of 5 already
            h.bucket.delete(f"k{i}")
    h.bucket.flush_all()
    h.settle()
    docs: dict[bytes, tuple[bytes, int]] = {}
    state = None if store == "memory" else tmp_path / "state.sqlite"
    rollbacks = _consume_without_log(h, docs, state)
    assert docs == h.bucket.state_snapshot()
    assert 0 < rollbacks <= h.bucket.num_vbuckets  # one rebuild per vbucket rolled back, not a loop


def test_consumer_killed_mid_snapshot_exposes_nothing_partial_and_converges(
        harness: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = harness(nvb=4)
    for r in range(4):
        write(h.bucket, 100, start=100 * r)
        h.settle()
    db = tmp_path / "r.sqlite"
    applied: Counter[tuple[int, int]] = Counter()
    # small fetches: snapshots are exposed before the 250th record is read, whatever the broker returns
    rep = CountingReplicator(h.broker.bootstrap_servers, h.topic, db, applied=applied, batch_size=100)
    c = rep.consumer
    handled = 0
    killed_at: Any = None

    class Killed(Exception):
        pass

    def read(value: bytes, offset: int, cls: Any) -> Any:
        nonlocal handled, killed_at
        handled += 1
        ch = read_change(value, offset, cls)
        fields = read_change_value(value)
        if handled >= 250 and killed_at is None and fields is not None and fields[5] < fields[12]:
            killed_at = ch
            raise Killed  # the process dies here, in the middle of a snapshot (its seqno < the snapshot's end)
        return ch

    monkeypatch.setattr(consumer_module, "read_change", read)
    exposed: list[Snapshot] = []
    with pytest.raises(Killed):
        for ev in c.events():
            assert isinstance(ev, Snapshot)
            exposed.append(ev)
            rep.on_snapshot(ev)
            c.commit(ev)
    assert exposed and killed_at is not None
    # every exposed snapshot was complete: its changes end at its end seqno
    assert all(ev.changes[-1].seqno == ev.end for ev in exposed if ev.changes)
    # one more event applied but never confirmed: rolled back with the dying process
    monkeypatch.setattr(consumer_module, "read_change", read_change)
    ev = next(c.events())
    assert isinstance(ev, Snapshot)
    rep.on_snapshot(ev)
    unconfirmed = {(ch.vbucket, ch.seqno) for ch in ev.changes}
    rep.close()  # dropped without committing
    for k in unconfirmed:
        applied[k] -= 1
    with CountingReplicator(h.broker.bootstrap_servers, h.topic, db, applied=applied) as rep2:
        rep2.run()
        assert rep2.docs() == h.bucket.state_snapshot()
    assert max(applied.values()) == 1, "a change was applied twice"
    assert min(applied.values()) == 1


def _dlq_records(bootstrap: str, topic: str) -> list[Any]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4()}", "enable.partition.eof": True,
                  "auto.offset.reset": "earliest", "fetch.wait.max.ms": READ_TO_END_FETCH_WAIT_MS})
    out = []
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        for _ in range(200):
            m = c.poll(0.5)
            if m is None:
                continue
            err = m.error()
            if err is not None:
                assert err.code() == KafkaError._PARTITION_EOF
                break
            out.append(m)
    finally:
        c.close()
    return out


def _produce_corrupt(h: Harness, value: bytes) -> None:
    """A record on partition 0 with a data record's headers and ``value`` as its (undecodable) body."""
    p = Producer({"bootstrap.servers": h.broker.bootstrap_servers})
    hdrs: list[tuple[str, str | bytes | None]] = [
        ("dcp.type", b"mutation"), ("dcp.format", b"avro"), ("dcp.vbucket", b"0"), ("dcp.vbuuid", b"1"),
        ("dcp.seqno", b"99"), ("dcp.snap.start", b"99"), ("dcp.snap.end", b"99")]
    p.produce(h.topic, key=b"bad", value=value, partition=0, headers=hdrs)
    p.flush(10)


@pytest.mark.parametrize("bad", [b"\xc3\x01garbage-not-avro", b"\xc3\x01" + b"\x00" * 8 + b"\x00"])
def test_corrupt_record_raises_and_lands_in_the_dead_letter_topic(harness: Any, tmp_path: Path,
                                                                   bad: bytes) -> None:
    h = harness(nvb=2)
    write(h.bucket, 10)
    h.settle()
    _produce_corrupt(h, bad)
    write(h.bucket, 10, start=10)
    h.settle()
    db = tmp_path / "r.sqlite"
    rep = Replicator(h.broker.bootstrap_servers, h.topic, db)
    with pytest.raises(DecodeError) as ei:
        rep.run()
    assert ei.value.partition == 0
    rep.run()  # the stream continues after the bad record
    assert rep.docs() == h.bucket.state_snapshot()
    rep.close()
    dlq = _dlq_records(h.broker.bootstrap_servers, f"{h.topic}.dlq")
    assert len(dlq) == 1 and dlq[0].value() == bad and dlq[0].key() == b"bad"
    hd = dict(dlq[0].headers())
    assert hd["dlq.topic"] == h.topic.encode() and hd["dlq.offset"] == str(ei.value.offset).encode()


def test_dead_letter_callback(harness: Any) -> None:
    h = harness(nvb=2)
    p = Producer({"bootstrap.servers": h.broker.bootstrap_servers})
    p.produce(h.topic, key=b"x", value=b"junk", partition=1, headers=[("dcp.type", b"nonsense")])
    p.flush(10)
    write(h.bucket, 10)
    h.settle()
    seen: list[DeadLetter] = []
    errors: list[DecodeError] = []
    docs: dict[bytes, bytes] = {}
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, dead_letter=seen.append) as c:
        c.run(lambda s: docs.update({ch.key: ch.value or b"" for ch in s.changes if not ch.deleted}),
              lambda r: None, on_error=errors.append)
    assert len(seen) == 1 and seen[0].value == b"junk" and seen[0].partition == 1 and len(errors) == 1
    assert {k: v for k, v in docs.items() if k in h.bucket.state_snapshot()} == {
        k: v for k, (v, _vb) in h.bucket.state_snapshot().items()}


def test_per_record_mode_exposes_partial_changes_then_boundaries(harness: Any) -> None:
    h = harness(nvb=2)
    write(h.bucket, 30)
    h.settle()
    kinds: list[str] = []
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, per_record=True) as c:
        for ev in c.events(until_caught_up=True):
            if isinstance(ev, PartialChange):
                kinds.append("c")
            else:
                assert isinstance(ev, Snapshot) and ev.changes == ()
                kinds.append("s")
            c.commit(ev)
    assert kinds.count("c") >= 24 and kinds[-1] == "s" and "s" in kinds


def test_consumer_group_resumes_from_stored_state(harness: Any, tmp_path: Path) -> None:
    h = harness(nvb=4)
    write(h.bucket, 80)
    h.settle()
    db = tmp_path / "r.sqlite"
    group = f"g-{uuid.uuid4().hex[:8]}"
    # the embedded broker lets a closed member go only at its session timeout: keep it short
    kafka = {"bootstrap.servers": h.broker.bootstrap_servers, "session.timeout.ms": 6000,
             "heartbeat.interval.ms": 500}
    applied: Counter[tuple[int, int]] = Counter()
    with CountingReplicator(kafka, h.topic, db, group_id=group, applied=applied) as rep:
        rep.run()
        assert rep.docs() == h.bucket.state_snapshot()
        assert rep.consumer.assignment == set(range(4))
    write(h.bucket, 40, start=80)
    h.settle()
    with CountingReplicator(kafka, h.topic, db, group_id=group, applied=applied) as rep:
        rep.run()
        assert rep.docs() == h.bucket.state_snapshot()
        assert 0 < rep.changes <= 48
    assert max(applied.values()) == 1  # the second process applied only new changes


def test_revoke_drops_partial_buffers(harness: Any) -> None:
    h = harness(nvb=2)
    write(h.bucket, 50)
    h.settle()
    c = ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, batch_size=1)
    try:
        ev = next(c.events())
        c.commit(ev)
        for _ in range(3):
            if c._fetch(1.0):
                c._feed_backlog()
        c._on_revoke(c.consumer, [TopicPartition(h.topic, p) for p in range(2)])
        assert not c._vbs and not c._queue and c.assignment == set()
    finally:
        c.close()


OPS = st.lists(st.sampled_from(["write", "write", "crash", "gateway", "consume"]), min_size=1, max_size=5)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, log_max=st.sampled_from([2, 10_000]))
def test_random_crashes_and_restarts_converge(kafka_broker: Broker, tmp_path_factory: Any, ops: list[str],
                                             log_max: int) -> None:
    tmp = tmp_path_factory.mktemp("hyp")
    h = Harness(kafka_broker, tmp, nvb=4, rollback_mitigation=False)
    db = tmp / "r.sqlite"

    def consume() -> None:
        with replicate(h, db, mutation_log_max=log_max):
            pass

    try:
        _play_history(h, ops, consume)
        with replicate(h, db, mutation_log_max=log_max) as rep:
            assert rep.docs() == h.bucket.state_snapshot()
    finally:
        h.close()


def _play_history(h: Harness, ops: list[str], consume: Callable[[], object]) -> None:
    """The random histories of the campaigns below: writes (half of them flushed, published from memory), engine
    crashes, gateway restarts and ``consume()`` rounds, in ``ops`` order; then 5 persisted writes, settled."""
    n = 0
    for op in ops:
        if op == "write":
            write(h.bucket, 15, start=n)
            n += 15
            if n % 2:
                h.bucket.flush_all()
            h.publish_unpersisted(20)
        elif op == "crash":
            h.crash_engine()
        elif op == "gateway":
            h.restart_gateway()
        else:
            h.pub.kafka.flush(10)
            consume()
    write(h.bucket, 5, start=10_000)
    h.bucket.flush_all()
    h.settle()


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS)
def test_random_crashes_converge_without_a_mutation_log(kafka_broker: Broker, tmp_path_factory: Any,
                                                        ops: list[str]) -> None:
    """The same random histories as above, consumed by an application with no undo information (a memory
    replica, consumer state in SQLite without a prior lookup): every rollback is a rebuild from zero, and the
    replica still converges to the engine."""
    tmp = tmp_path_factory.mktemp("hypnolog")
    h = Harness(kafka_broker, tmp, nvb=4, rollback_mitigation=False)
    docs: dict[bytes, tuple[bytes, int]] = {}
    try:
        _play_history(h, ops, lambda: _consume_without_log(h, docs, tmp / "state.sqlite"))
        _consume_without_log(h, docs, tmp / "state.sqlite")
        assert docs == h.bucket.state_snapshot()
    finally:
        h.close()


def test_group_commit_keeps_what_was_confirmed_when_the_application_fails(harness: Any, tmp_path: Path) -> None:
    """run() commits confirmed events in groups; a callback that fails mid-group loses only its own event:
    the events confirmed before it are committed, the failed one is redelivered, nothing twice."""
    h = harness(nvb=4)
    for r in range(6):
        write(h.bucket, 20, start=20 * r)
        h.settle()
    db = tmp_path / "r.sqlite"
    applied: Counter[tuple[int, int]] = Counter()

    class AppFailed(Exception):
        pass

    class Failing(CountingReplicator):
        snapshots = 0

        def on_snapshot(self, snap: Snapshot) -> None:
            Failing.snapshots += 1
            if Failing.snapshots == 7:
                self.conn.execute("INSERT OR REPLACE INTO docs VALUES ('half-applied', x'00', 0, 0)")
                raise AppFailed
            super().on_snapshot(snap)

    rep = Failing(h.broker.bootstrap_servers, h.topic, db, applied=applied)
    assert rep.consumer.group_commit == 64
    with pytest.raises(AppFailed):
        rep.run()
    rep.close()
    assert sum(applied.values()) > 0
    with CountingReplicator(h.broker.bootstrap_servers, h.topic, db, applied=applied) as rep2:
        rep2.run()
        assert rep2.docs() == h.bucket.state_snapshot()  # the failed event's own write rolled back
    assert set(applied.values()) == {1}, "a change was applied twice or never"


def test_group_commit_must_be_positive(harness: Any) -> None:
    h = harness(nvb=2)
    with pytest.raises(ConnectorError, match="group_commit"):
        ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, group_commit=0)


def test_two_group_members_rebalance_and_share_one_stored_state(harness: Any, tmp_path: Path) -> None:
    """Issue 4, "works across consumer-group rebalances": a second member joins a running group; the eager
    rebalance revokes and reassigns partitions; each member resumes an assigned partition from the stored state
    (one SQLite file shared by both, as two processes would share it). Every change is applied exactly once
    across both members and the shared replica ends equal to the engine."""
    h = harness(nvb=8)
    write(h.bucket, 160)
    h.settle()
    db = tmp_path / "shared.sqlite"
    group = f"g-{uuid.uuid4().hex[:8]}"
    kafka = {"bootstrap.servers": h.broker.bootstrap_servers, "session.timeout.ms": 6000,
             "heartbeat.interval.ms": 500}
    applied: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()
    assignments: dict[str, set[int]] = {"a": set(), "b": set()}

    class Member(CountingReplicator):
        def on_snapshot(self, snap: Snapshot) -> None:
            assert not snap.changes or snap.changes[-1].seqno == snap.end  # complete snapshots only
            with lock:
                super().on_snapshot(snap)

        def on_rollback(self, rb: RollbackInstruction) -> None:
            with lock:
                super().on_rollback(rb)

    stop = threading.Event()
    errors: list[BaseException] = []
    members: dict[str, Member] = {}

    def member(name: str) -> None:
        try:
            rep = Member(kafka, h.topic, db, group_id=group, applied=applied)
            with rep:
                members[name] = rep
                while not stop.is_set():
                    rep.run(until_caught_up=False)  # returns on stop()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    def watch(until: Any, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline and not errors:
            for name, rep in list(members.items()):
                assignments[name] |= rep.consumer.assignment
            time.sleep(0.1)

    threads = [threading.Thread(target=member, args=(n,), daemon=True) for n in ("a", "b")]
    threads[0].start()
    watch(lambda: sum(applied.values()) >= 160)
    threads[1].start()
    try:
        watch(lambda: bool(assignments["b"]))  # the rebalance gave the new member some partitions
        for r in range(4):  # writes continue while the group rebalances
            write(h.bucket, 60, start=160 + 60 * r)
            h.settle()
            time.sleep(0.3)
        expected: dict[bytes, tuple[bytes, int]] = h.bucket.state_snapshot()
        check = sqlite3.connect(str(db), timeout=30)

        def converged() -> bool:
            rows = {k.encode(): (bytes(v), int(vb)) for k, v, vb in check.execute("SELECT key, value, vbucket FROM docs")}
            return rows == expected

        watch(converged)
        check.close()
        final = [members[n].consumer.assignment for n in ("a", "b")]
        assert final[0] and final[1] and not final[0] & final[1], final
        assert final[0] | final[1] == set(range(8))
    finally:
        stop.set()
        for rep in members.values():
            rep.consumer.stop()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "stop() did not end run()"
    assert assignments["a"] and assignments["b"], assignments
    with Replicator(h.broker.bootstrap_servers, h.topic, db) as replica:
        assert replica.docs() == h.bucket.state_snapshot()
    assert set(applied.values()) == {1}, "a change was applied twice"


@pytest.mark.parametrize("app_threshold", [700, 0])
def test_run_raises_the_young_gc_threshold_only_while_it_runs(
        harness: Any, tmp_path: Path, app_threshold: int) -> None:
    """run() owns its loop: the young-generation GC threshold is at least GC_YOUNG_THRESHOLD while it runs
    (callbacks included) and the application's thresholds are back when it returns; an application that
    turned automatic collection off (threshold 0) keeps it off."""
    h = harness(nvb=2)
    write(h.bucket, 50)
    h.settle()
    before = gc.get_threshold()
    gc.set_threshold(app_threshold, 10, 10)
    seen: list[int] = []
    try:
        def fail(s: Snapshot) -> None:
            seen.append(gc.get_threshold()[0])
            raise RuntimeError("the application failed")

        with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, state_path=tmp_path / "s.sqlite") as c:
            with pytest.raises(RuntimeError):
                c.run(fail, lambda r: None)
            assert gc.get_threshold() == (app_threshold, 10, 10)  # restored when run() raises
        with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, state_path=tmp_path / "s.sqlite") as c:
            c.run(lambda s: seen.append(gc.get_threshold()[0]), lambda r: None, until_caught_up=True)
            assert gc.get_threshold() == (app_threshold, 10, 10)  # and when it returns
    finally:
        gc.set_threshold(*before)
    assert seen and set(seen) == {GC_YOUNG_THRESHOLD if app_threshold else 0}


def _snapshot_docs(c: ChangeStreamConsumer) -> dict[bytes, tuple[bytes, int]]:
    docs: dict[bytes, tuple[bytes, int]] = {}

    def on_snapshot(s: Snapshot) -> None:
        for ch in s.changes:
            if ch.deleted:
                docs.pop(ch.key, None)
            else:
                assert ch.value is not None
                docs[ch.key] = (ch.value, ch.vbucket)

    c.run(on_snapshot, lambda r: None, until_caught_up=True)
    return docs


def test_prefetch_decodes_without_applying_and_the_events_follow_unchanged(harness: Any, tmp_path: Path) -> None:
    """prefetch() fills the event queue -- no event opened, nothing saved -- and the events handed out after it
    are those without it; a consumer closed after prefetching resumes from where it was."""
    h = harness(nvb=4)
    write(h.bucket, 200)
    h.settle()
    db = tmp_path / "s.sqlite"
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, state_path=db) as c:
        deadline = time.monotonic() + 30
        while c.records_consumed == 0 and time.monotonic() < deadline:
            assert c.prefetch(0.1)
        assert c.records_consumed > 0 and c._queue and c._open is None
        assert c.store.partition_offsets() == {}  # nothing confirmed
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, state_path=db) as c:
        while c.records_consumed < 200 and c.prefetch(0.1):
            pass
        assert _snapshot_docs(c) == h.bucket.state_snapshot()


def test_a_decode_error_met_by_prefetch_is_raised_where_it_would_have_been(harness: Any) -> None:
    h = harness(nvb=2)
    write(h.bucket, 10)
    h.settle()
    p = Producer({"bootstrap.servers": h.broker.bootstrap_servers})
    p.produce(h.topic, key=b"x", value=b"junk", partition=1, headers=[("dcp.type", b"nonsense")])
    p.flush(10)
    write(h.bucket, 10, start=10)
    h.settle()
    seen: list[DeadLetter] = []
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, dead_letter=seen.append) as c:
        deadline = time.monotonic() + 30
        while c.prefetch(0.1) and time.monotonic() < deadline:
            pass
        assert len(seen) == 1  # met (and copied to the dead-letter destination) by the prefetch
        assert not c.caught_up()  # the error is still to come
        assert not c.prefetch(0.1)  # nothing more before it is raised
        with pytest.raises(DecodeError):
            next(c.events(until_caught_up=True))
        docs = _snapshot_docs(c)  # then the stream continues after the bad record
    assert len(seen) == 1
    assert docs == h.bucket.state_snapshot()


def test_a_fresh_manual_assignment_starts_at_the_partitions_first_offsets(harness: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The partitions read from their start are assigned at their first offsets (asked for in one request: the
    consumer's own offsets_for_times, no AdminClient), not at OFFSET_BEGINNING; when that request fails they
    keep OFFSET_BEGINNING. Either way every record is read."""
    h = harness(nvb=2)
    write(h.bucket, 20)
    h.settle()
    assigned: list[list[int]] = []
    real_assign = Consumer.assign

    class Recording(Consumer):  # (confluent_kafka's Consumer cannot be patched in place)
        def assign(self, partitions: list[TopicPartition]) -> None:
            assigned.append([tp.offset for tp in partitions])
            real_assign(self, partitions)

    monkeypatch.setattr(consumer_module, "Consumer", Recording)
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic) as c:
        assert _snapshot_docs(c) == h.bucket.state_snapshot()
    assert assigned == [[0, 0]]

    class Failing(Recording):  # the request fails (the broker away): librdkafka resolves OFFSET_BEGINNING
        def offsets_for_times(self, partitions: list[TopicPartition], timeout: float = -1) -> list[TopicPartition]:
            raise consumer_module.KafkaException(KafkaError(KafkaError._TRANSPORT))

    monkeypatch.setattr(consumer_module, "Consumer", Failing)
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic) as c:
        assert _snapshot_docs(c) == h.bucket.state_snapshot()
    assert assigned[1] == [consumer_module.OFFSET_BEGINNING] * 2


def test_consumer_tuning_properties_raise_no_librdkafka_warning_from_its_own_clients(
        harness: Any, capfd: pytest.CaptureFixture[str]) -> None:
    """The caller's consumer tuning (session.timeout.ms, fetch.max.bytes, ...) also reaches the consumer's own
    dead-letter producer and the AdminClient creating its topic, which librdkafka made say on stderr
    "Configuration property ... is a consumer property and will be ignored by this producer instance" -- noise
    about the caller's correct settings. Those clients log through Python logging, without that line."""
    h = harness(nvb=2)
    write(h.bucket, 10)
    h.settle()
    _produce_corrupt(h, b"\xc3\x01garbage-not-avro")
    capfd.readouterr()
    conf = {"bootstrap.servers": h.broker.bootstrap_servers, "session.timeout.ms": 12_000,
            "fetch.max.bytes": 2 << 20, "max.poll.interval.ms": 600_000}
    docs: dict[bytes, bytes] = {}
    with ChangeStreamConsumer(conf, h.topic) as c:
        deadline = time.monotonic() + 60
        while not c.caught_up():
            assert time.monotonic() < deadline
            try:
                for ev in c.events(until_caught_up=True):
                    assert isinstance(ev, Snapshot)
                    docs.update((ch.key, ch.value) for ch in ev.changes if ch.value is not None)
                    c.commit(ev)
            except DecodeError:
                continue  # the bad record: copied to the dead-letter topic, the stream goes on
    assert docs == {k: v for k, (v, _vb) in h.bucket.state_snapshot().items()}
    assert len(_dlq_records(h.broker.bootstrap_servers, f"{h.topic}.dlq")) == 1  # the producer did run
    err = capfd.readouterr().err
    assert "is a consumer property" not in err, err[-2000:]


@pytest.mark.parametrize(("kw", "match"), [
    ({"dead_letter": 42}, r"dead_letter must be a topic name .* got int 42"),
    ({"dead_letter": "{nope}.dlq"}, r"dead_letter must be a topic name .*'\{nope\}\.dlq' is not a valid pattern"),
    ({"dead_letter": ""}, r"dead_letter must be a topic name"),
    ({"mutation_log_max": -1}, r"mutation_log_max must be an integer >= 1 .*got -1"),
    ({"mutation_log_max": 0}, r"mutation_log_max must be an integer >= 1"),
    ({"mutation_log_max": 2.5}, r"mutation_log_max must be an integer >= 1"),
    ({"batch_size": 0}, r"batch_size must be an integer >= 1, got 0"),
    ({"poll_timeout": -1}, r"poll_timeout must be a positive number of seconds, got -1"),
    ({"state_store": "STORE", "state_path": "PATH"}, r"state_path and state_store are exclusive"),
])
def test_bad_constructor_arguments_are_connector_errors_naming_the_argument(
        harness: Any, tmp_path: Path, kw: dict[str, Any], match: str) -> None:
    from connectors.client.state import MemoryStateStore

    h = harness(nvb=2)
    kw = {k: MemoryStateStore() if v == "STORE" else tmp_path / "s.sqlite" if v == "PATH" else v
          for k, v in kw.items()}
    with pytest.raises(ConnectorError, match=match):
        ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, **kw)
    assert not (tmp_path / "s.sqlite").exists()  # refused before anything was opened


def test_decode_error_says_what_is_wrong_without_python_internals(harness: Any) -> None:
    """A truncated Avro body: the message was `...: corrupt or truncated Avro body of ChangeEvent: IndexError: string
    index out of range (copied ...)`; it now ends at what is wrong, the internal exception stays chained."""
    from schemas.errors import RecordFormatError

    h = harness(nvb=2)
    write(h.bucket, 10)
    h.settle()
    c0 = Consumer({"bootstrap.servers": h.broker.bootstrap_servers, "group.id": f"t-{uuid.uuid4()}",
                   "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    try:
        c0.assign([TopicPartition(h.topic, 0, 0)])
        good = None
        while good is None:
            m = c0.poll(10)
            assert m is not None and m.error() is None, "no data record in partition 0"
            if m.key() is not None:
                good = m
    finally:
        c0.close()
    p = Producer({"bootstrap.servers": h.broker.bootstrap_servers})
    v = good.value()
    assert isinstance(v, bytes)
    cuts = [v[:len(v) - 3], v[:12], v[:-1]]
    for cut in cuts:
        p.produce(h.topic, key=good.key(), value=cut, partition=0, headers=good.headers())
    assert p.flush(10) == 0
    errors: list[DecodeError] = []
    with ChangeStreamConsumer(h.broker.bootstrap_servers, h.topic, dead_letter=lambda dl: None) as c:
        c.run(lambda s: None, lambda r: None, on_error=errors.append)
    assert len(errors) == len(cuts)
    for e in errors:
        msg = str(e)
        assert f"{h.topic}[0]@{e.offset}: " in msg and msg.endswith("(copied to the dead-letter destination)")
        assert "Avro body" in msg, msg
        # no Python exception name or text from inside the decoder
        assert "Error" not in msg and "index out of range" not in msg and "Traceback" not in msg, msg
        assert isinstance(e.__cause__, RecordFormatError)
    # the internal cause stays on the chain for debugging
    assert any(e.__cause__ is not None and e.__cause__.__cause__ is not None for e in errors)
