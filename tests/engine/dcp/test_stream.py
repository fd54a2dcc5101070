"""DCP streams: request checks, disk and memory snapshots, stream end, flow control, cursor dropping."""

from __future__ import annotations

import pytest

from engine import (
    MAX_SEQNO,
    Item,
    KeyExists,
    Message,
    NotMyVBucket,
    Op,
    RangeError,
    RollbackRequired,
    SnapshotFlags,
    SnapshotMarker,
    StreamEnd,
    StreamEndReason,
    StreamFlags,
    VBucketState,
)
from engine.exceptions import Status
from tests.engine.dcp_model import SnapshotConsumer, sync


def _one_vb(make_bucket, **kw):
    return make_bucket(num_vbuckets=1, **kw)


def _drain(p, ack=True):
    out: list[Message] = []
    while True:
        msgs = p.step()
        if not msgs:
            return out
        out.extend(msgs)
        if ack:
            p.buffer_acknowledge(sum(m.dcp_size for m in msgs))


def test_memory_stream_sends_marker_then_deduplicated_items(make_bucket) -> None:
    b = _one_vb(make_bucket)
    b.set("A", b"1")
    b.set("B", b"1")
    b.set("A", b"2")
    p = b.dcp_producer("c")
    log = p.stream_request(0, 0)
    assert log == b.failover_log(0)
    msgs = _drain(p)
    assert msgs[0] == SnapshotMarker(0, 0, 3, SnapshotFlags.MEMORY | SnapshotFlags.CHK)
    assert [(m.seqno, m.key, m.value) for m in msgs[1:]] == [(2, b"B", b"1"), (3, b"A", b"2")]
    b.delete("B")
    msgs = _drain(p)
    assert msgs[0] == SnapshotMarker(0, 4, 4, SnapshotFlags.MEMORY)
    assert msgs[1].op is Op.DELETION and msgs[1].seqno == 4 and msgs[1].value is None


def test_disk_backfill_then_memory(make_bucket) -> None:
    b = _one_vb(make_bucket, checkpoint_max_items=5)
    for i in range(1, 21):
        b.set(f"k{i % 7}", str(i))
    b.flush()
    b.vbucket(0).ckpt.remove_unreferenced()
    assert b.vbucket(0).ckpt.first_seqno > 1
    b.set("k1", b"mem")  # 21, in memory only
    p = b.dcp_producer("c")
    p.stream_request(0, 0)
    msgs = _drain(p)
    m0 = msgs[0]
    assert isinstance(m0, SnapshotMarker) and m0.is_disk
    assert (m0.start, m0.end, m0.flags) == (0, 20, SnapshotFlags.DISK | SnapshotFlags.CHK)
    disk = [m for m in msgs[1:] if isinstance(m, Item) and m.seqno <= 20]
    # de-duplicated on disk: the latest version of each of the 7 keys as of seqno 20
    assert len(disk) == 7 and len({m.key for m in disk}) == 7
    assert [m.seqno for m in disk] == sorted(m.seqno for m in disk)
    mem_markers = [m for m in msgs if isinstance(m, SnapshotMarker) and not m.is_disk]
    assert mem_markers and mem_markers[0].flags & SnapshotFlags.CHK and mem_markers[0].start == 21
    assert msgs[-1].seqno == 21


def test_stream_end_after_snapshot_containing_end(make_bucket) -> None:
    b = _one_vb(make_bucket)
    for i in range(5):
        b.set(f"k{i}", b"v")
    p = b.dcp_producer("c")
    p.stream_request(0, 0, 3)
    msgs = _drain(p)
    assert isinstance(msgs[-1], StreamEnd) and msgs[-1].reason is StreamEndReason.OK
    # the whole snapshot [0,5] containing seqno 3 was sent
    assert [m.seqno for m in msgs if isinstance(m, Item)] == [1, 2, 3, 4, 5]
    assert 0 not in p.streams
    # start == end ends at once
    p.stream_request(0, 5, 5, b.failover_log(0)[0].vbuuid)
    assert _drain(p) == [StreamEnd(0, StreamEndReason.OK)]


def test_stream_request_errors(make_bucket) -> None:
    b = make_bucket(num_vbuckets=2)
    b.set("x", b"1", vbucket=b.vbucket_of("x"))
    vb = b.vbucket_of("x")
    p = b.dcp_producer("c")
    with pytest.raises(NotMyVBucket):
        p.stream_request(5, 0)
    with pytest.raises(RangeError) as ei:
        p.stream_request(vb, 5, 2)
    assert ei.value.status is Status.ERANGE
    with pytest.raises(RangeError):
        p.stream_request(vb, 1, MAX_SEQNO, b.failover_log(vb)[0].vbuuid, 2, 3)  # start outside snapshot
    uuid = b.failover_log(vb)[0].vbuuid
    with pytest.raises(RollbackRequired) as rb:
        p.stream_request(vb, 9, MAX_SEQNO, uuid, 9, 9)  # ahead of high with the current uuid
    assert rb.value.seqno == 1 and rb.value.status is Status.ROLLBACK
    with pytest.raises(RollbackRequired) as rb:
        p.stream_request(vb, 1, MAX_SEQNO, 0xDEAD, 1, 1)  # unknown uuid
    assert rb.value.seqno == 0
    p.stream_request(vb, 0)
    with pytest.raises(KeyExists):
        p.stream_request(vb, 0)
    with pytest.raises(Exception) as bad:
        p.stream_request(vb, -1)
    assert type(bad.value).__name__ == "InvalidArgument"
    b.set_vbucket_state(1 - vb, VBucketState.DEAD)
    with pytest.raises(NotMyVBucket):
        p.stream_request(1 - vb, 0)


def test_flags_from_latest_to_latest_disk_only(make_bucket) -> None:
    b = _one_vb(make_bucket)
    for i in range(4):
        b.set(f"k{i}", b"v")
    b.flush()
    b.set("k9", b"v")
    p = b.dcp_producer("c")
    p.stream_request(0, 0, flags=StreamFlags.DISK_ONLY)
    msgs = _drain(p)
    assert msgs[0].flags & SnapshotFlags.DISK
    assert [m.seqno for m in msgs if isinstance(m, Item)] == [1, 2, 3, 4]
    assert msgs[-1] == StreamEnd(0, StreamEndReason.OK)
    p.stream_request(0, 0, flags=StreamFlags.TO_LATEST)
    assert [m.seqno for m in _drain(p) if isinstance(m, Item)] == [1, 2, 3, 4, 5]
    p.stream_request(0, 0, flags=StreamFlags.FROM_LATEST)
    assert _drain(p) == []
    b.set("new", b"v")
    assert [m.seqno for m in _drain(p) if isinstance(m, Item)] == [6]


def test_flow_control_pauses_until_acknowledged(make_bucket) -> None:
    b = _one_vb(make_bucket)
    for i in range(100):
        b.set(f"k{i}", b"x" * 100)
    p = b.dcp_producer("c", buffer_size=1000)
    p.stream_request(0, 0)
    first = p.step()
    sent = sum(m.dcp_size for m in first)
    assert 1000 <= sent < 1000 + 200  # one message may overshoot
    assert p.step() == [] and p.paused
    p.buffer_acknowledge(sent)
    second = p.step()
    assert second and second[0].seqno == first[-1].seqno + 1
    with pytest.raises(Exception) as e:
        p.buffer_acknowledge(-1)
    assert type(e.value).__name__ == "InvalidArgument"


def test_named_connection_replaces_old(make_bucket) -> None:
    b = _one_vb(make_bucket)
    p1 = b.dcp_producer("same")
    p1.stream_request(0, 0)
    p2 = b.dcp_producer("same")
    assert p1.closed and p2.streams == {}
    assert len(b.vbucket(0).ckpt.cursors) == 1  # only persistence
    p2.stream_request(0, 0)


def test_close_stream_and_state_change_end_streams(make_bucket) -> None:
    b = make_bucket(num_vbuckets=2)
    p = b.dcp_producer("c")
    p.stream_request(0, 0)
    p.stream_request(1, 0)
    p.close_stream(0)
    b.set_vbucket_state(1, VBucketState.REPLICA)
    ends = [m for m in _drain(p) if isinstance(m, StreamEnd)]
    assert sorted((e.vbucket, e.reason) for e in ends) == [
        (0, StreamEndReason.CLOSED), (1, StreamEndReason.STATE_CHANGED)]
    with pytest.raises(NotMyVBucket):
        p.close_stream(0)


def test_snapshot_stays_consistent_when_paused_mid_snapshot(make_bucket) -> None:
    # Flow control pauses the stream inside a snapshot; writes that de-duplicate unsent items must not
    # change the snapshot being sent (it was materialised in the ready queue).
    b = _one_vb(make_bucket)
    for i in range(20):
        b.set(f"k{i}", b"old")
    p = b.dcp_producer("c", buffer_size=300)
    p.stream_request(0, 0)
    c = SnapshotConsumer([0])
    c.vbs[0].open = True
    first = p.step()
    for m in first:
        c.handle(m)
    assert c.vbs[0].pending, "paused inside the first snapshot"
    for i in range(20):
        b.set(f"k{i}", b"new")
    p.buffer_acknowledge(sum(m.dcp_size for m in first))
    c.drain(p)
    assert c.state() == b.state_snapshot()


def test_cursor_dropped_stream_continues_by_backfill(make_bucket) -> None:
    b = _one_vb(make_bucket, checkpoint_max_items=50, checkpoint_quota_bytes=64 * 1024)
    p = b.dcp_producer("slow")
    c = SnapshotConsumer([0])
    c.open_streams(p)
    for i in range(2000):
        b.set(f"k{i % 300}", b"v" * 100)
        if i % 100 == 0:
            b.flush()
            b.recover_memory()
    b.flush()
    assert b.cursors_dropped >= 1
    assert b.counter.used <= b.config.checkpoint_quota_bytes
    c.drain(p)
    assert c.state() == b.state_snapshot()
    assert p.streams[0].backfills >= 1  # none was needed at first; the drop forced one
    assert not any(isinstance(m, StreamEnd) for m in c.markers_seen)


def test_model_consumer_resumes_without_duplicates(make_bucket) -> None:
    b = make_bucket(num_vbuckets=4)
    c = SnapshotConsumer(list(range(4)))
    for i in range(100):
        b.set(f"k{i}", str(i))
    sync(b, c)
    seen = c.items_seen
    for i in range(50):
        b.set(f"k{i}", "again")
    b.flush()
    c.disconnect()
    sync(b, c, "model-2")
    assert c.items_seen == seen + 50
    assert c.state() == b.state_snapshot()


def test_expirations_are_streamed(make_bucket, clock) -> None:
    b = make_bucket(clock=clock, num_vbuckets=1)
    b.set("e", b"v", expiry=5)
    p = b.dcp_producer("c")
    p.stream_request(0, 0)
    _drain(p)
    clock.now += 10
    assert b.run_expiry_pager() == 1
    msgs = [m for m in _drain(p) if isinstance(m, Item)]
    assert [(m.op, m.key, m.seqno, m.value) for m in msgs] == [(Op.EXPIRATION, b"e", 2, None)]


def test_purge_seqno_forces_rollback_to_zero_unless_ignored(make_bucket, clock) -> None:
    b = make_bucket(clock=clock, num_vbuckets=1, tombstone_purge_age_s=1)
    b.set("a", b"1")
    b.set("b", b"1")
    b.delete("a")  # 3
    b.set("c", b"1")  # 4
    b.flush()
    clock.now += 5
    b.compact()
    assert b.vbucket(0).purge_seqno == 3
    uuid = b.failover_log(0)[0].vbuuid
    p = b.dcp_producer("c")
    with pytest.raises(RollbackRequired) as rb:
        p.stream_request(0, 2, MAX_SEQNO, uuid, 2, 2)  # a client at 2 could miss the purged deletion
    assert rb.value.seqno == 0
    p.stream_request(0, 2, MAX_SEQNO, uuid, 2, 2, flags=StreamFlags.IGNORE_PURGED_TOMBSTONES)
    # a fresh client from 0, served from disk, gets the state without the purged tombstone
    p.close_stream(0)
    _drain(p)
    for c in b.vbuckets():
        c.ckpt.create_checkpoint()
        c.ckpt.remove_unreferenced()
    p2 = b.dcp_producer("fresh")
    p2.stream_request(0, 0)
    assert [m.seqno for m in _drain(p2) if isinstance(m, Item)] == [2, 4]


def test_compaction_does_not_purge_what_a_running_backfill_reads(make_bucket, clock) -> None:
    b = make_bucket(clock=clock, num_vbuckets=1, history_seqnos=0, tombstone_purge_age_s=0,
                    backfill_chunk_items=2, checkpoint_max_items=2)
    for i in range(10):
        b.set(f"k{i}", b"v1")
    b.flush()
    for c in b.vbuckets():
        c.ckpt.create_checkpoint()
        c.ckpt.remove_unreferenced()
    c = SnapshotConsumer([0])
    p = b.dcp_producer("c")
    c.open_streams(p)
    first = p.step(max_messages=3)  # the backfill has started (disk snapshot up to 10)
    for m in first:
        c.handle(m)
    for i in range(10):
        b.set(f"k{i}", b"v2")  # supersedes every backfilled row
    b.delete("k9")
    b.flush()
    clock.now += 10
    b.compact()
    c.drain(p)
    assert c.state() == b.state_snapshot()


def test_unclean_restart_failover_entry_and_strict_vbuuid(make_bucket) -> None:
    b = make_bucket(num_vbuckets=1)
    for i in range(5):
        b.set(f"k{i}", b"v")
    b.flush()
    old = b.failover_log(0)
    b.close(clean=False)
    b2 = make_bucket(num_vbuckets=1)
    log = b2.failover_log(0)
    assert len(log) == len(old) + 1 and log[0].seqno == 5 and log[1:] == old
    p = b2.dcp_producer("c")
    with pytest.raises(RollbackRequired) as rb:
        p.stream_request(0, 0, MAX_SEQNO, 0xABCDEF, 0, 0, flags=StreamFlags.STRICT_VBUUID)
    assert rb.value.seqno == 0
    p.stream_request(0, 5, MAX_SEQNO, old[0].vbuuid, 5, 5)  # shared history up to the branch point: OK
