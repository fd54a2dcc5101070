"""DCP takeover streams (engine/dcp/takeover.py, kv_engine takeover-send / takeover-wait; docs/rebalance.md
"The takeover stream (engine side)"): markers with ACK, SET_VBUCKET_STATE pending -> old vbucket dead and drained -> active -> stream end
OK; no failover entry; the consumer side (engine/dcp/replication.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Bucket, BucketConfig, NotMyVBucket, VBucketState
from engine.dcp.replication import DcpConsumer
from engine.dcp.stream import (
    SetVBucketStateMessage,
    SnapshotFlags,
    SnapshotMarker,
    StreamEnd,
    StreamEndReason,
)
from engine.dcp.takeover import TakeoverPhase, TakeoverStream
from engine.exceptions import InvalidArgument
from engine.kv.item import Item

VB = 3


@pytest.fixture
def pair(tmp_path: Path):
    a = Bucket(BucketConfig(data_dir=tmp_path / "a", num_vbuckets=8, seed=1, checkpoint_max_items=5))
    b = Bucket(BucketConfig(data_dir=tmp_path / "b", num_vbuckets=8, seed=2, checkpoint_max_items=5))
    for vb in range(8):
        b.set_vbucket_state(vb, VBucketState.REPLICA)
    yield a, b
    a.close()
    b.close()


def _keys(bucket: Bucket, n: int, prefix: str = "k") -> list[str]:
    out: list[str] = []
    i = 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if bucket.vbucket_of(k) == VB:
            out.append(k)
        i += 1
    return out


def test_takeover_moves_the_active_role_without_a_failover_entry(pair) -> None:
    a, b = pair
    keys = _keys(a, 40)
    for k in keys[:30]:
        a.set(k, f"v-{k}")
    a.flush_all()
    log_before = a.failover_log(VB)
    name = "rebalance:a->b"
    conn = DcpConsumer(name, b, a.dcp_producer(name))
    assert conn.request_stream(VB) == log_before
    conn.drain()
    assert b.vbucket(VB).high_seqno == a.vbucket(VB).high_seqno
    # A client stream reading the old active (the gateway) ends STATE_CHANGED when it goes dead.
    client = a.dcp_producer("client")
    client.stream_request(VB, 0)
    # Convert to a takeover stream; more writes arrive meanwhile.
    conn.close_stream(VB)
    for k in keys[30:]:
        a.set(k, f"w-{k}")
    assert conn.request_stream(VB, takeover=True) is not None
    p = a.producers[name]
    stream = p.streams[VB]
    assert isinstance(stream, TakeoverStream)
    assert p.takeover_stats(VB)["estimate"] == 10
    conn.drain()
    # Both sides: old dead, new active, the same history and failover log (no new entry: kv_engine's
    # FailoverTable gets none on a takeover, docs/rebalance.md).
    assert a.vbucket(VB).state is VBucketState.DEAD
    assert b.vbucket(VB).state is VBucketState.ACTIVE
    assert b.failover_log(VB) == log_before == a.failover_log(VB)
    assert b.vbucket(VB).high_seqno == a.vbucket(VB).high_seqno == 40
    assert conn.streams[VB].end_reason is StreamEndReason.OK
    assert conn.takeover_states == 2
    assert stream.marker_acks >= 1 and stream.waiting_marker_acks == 0
    assert VB not in p.streams
    assert p.takeover_stats(VB)["status"] == "does_not_exist"
    for k in keys:
        assert b.get(k).value.startswith(b"w-" if k in keys[30:] else b"v-")
    with pytest.raises(NotMyVBucket):
        a.set(keys[0], "late")
    r = b.set(keys[0], "on-new-active")
    assert r.vbuuid == log_before[0].vbuuid and r.seqno == 41
    ends = [m for m in client.step() if isinstance(m, StreamEnd)]
    assert ends == [StreamEnd(VB, StreamEndReason.STATE_CHANGED)]


def test_takeover_protocol_order_markers_ack_and_drain(pair) -> None:
    """Drive the producer by hand: every marker carries ACK and gates the SET_VBUCKET_STATE; the pending
    ack marks the old vbucket dead; what was written before that is drained before the active message."""
    a, b = pair
    keys = _keys(a, 12)
    for k in keys[:6]:
        a.set(k, "x")
    name = "rebalance:a->b"
    conn = DcpConsumer(name, b, a.dcp_producer(name))
    p = a.producers[name]
    assert conn.request_stream(VB, takeover=True) is not None
    msgs = p.step()
    markers = [m for m in msgs if isinstance(m, SnapshotMarker)]
    assert markers and all(m.flags & SnapshotFlags.ACK for m in markers)
    assert not any(isinstance(m, SetVBucketStateMessage) for m in msgs)
    # Not acknowledged yet: nothing more to send, and no set-state.
    assert p.step() == []
    for m in msgs:
        conn._handle(m)  # applies, acks the markers
    out = p.step()
    assert out == [SetVBucketStateMessage(VB, VBucketState.PENDING)]
    assert p.streams[VB].phase is TakeoverPhase.WAIT
    # A write that slipped in before the pending ack: drained after the old vbucket turned dead.
    a.set(keys[6], "tail")
    conn._handle(out[0])
    assert b.vbucket(VB).state is VBucketState.PENDING
    assert a.vbucket(VB).state is VBucketState.DEAD
    tail = p.step()
    assert [m.key for m in tail if isinstance(m, Item)] == [keys[6].encode()]
    for m in tail:
        conn._handle(m)
    last = p.step()
    assert last == [SetVBucketStateMessage(VB, VBucketState.ACTIVE)]
    conn._handle(last[0])
    assert b.vbucket(VB).state is VBucketState.ACTIVE
    assert p.step() == [StreamEnd(VB, StreamEndReason.OK)]


def test_bad_takeover_acks_are_refused(pair) -> None:
    a, _b = pair
    p = a.dcp_producer("c")
    with pytest.raises(NotMyVBucket):
        p.snapshot_marker_ack(VB)
    p.stream_request(VB, 0)
    with pytest.raises(NotMyVBucket):  # not a takeover stream
        p.set_vbucket_state_ack(VB)
    p.close_stream(VB)
    p.discard_stream(VB)
    a.set(_keys(a, 1)[0], "x")
    p.stream_request(VB, 0, flags=0x01)
    with pytest.raises(InvalidArgument):  # no set-state sent yet
        p.set_vbucket_state_ack(VB)
    with pytest.raises(InvalidArgument):  # no marker sent yet
        p.snapshot_marker_ack(VB)


@pytest.mark.parametrize("state", [VBucketState.PENDING, VBucketState.ACTIVE])
def test_set_vbucket_state_message_on_the_wire(state: VBucketState) -> None:
    """DCP_SET_VBUCKET_STATE (0x5b): one byte of extras, the state code; bad extras are a ProtocolError."""
    from engine.network.protocol import (
        HEADER_LEN,
        Opcode,
        ProtocolError,
        decode_dcp_message,
        encode_dcp_message,
        frame_from,
        parse_header,
        request,
    )

    raw = encode_dcp_message(SetVBucketStateMessage(VB, state), 77)
    f = frame_from(parse_header(raw[:HEADER_LEN]), raw[HEADER_LEN:])
    assert f.opcode == Opcode.DCP_SET_VBUCKET_STATE and f.opaque == 77 and len(f.extras) == 1
    assert decode_dcp_message(f) == SetVBucketStateMessage(VB, state)
    bad = request(Opcode.DCP_SET_VBUCKET_STATE, extras=b"\x09", vbucket=VB)
    with pytest.raises(ProtocolError):
        decode_dcp_message(frame_from(parse_header(bad[:HEADER_LEN]), bad[HEADER_LEN:]))
