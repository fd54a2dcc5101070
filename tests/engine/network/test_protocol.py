"""The memcached binary protocol subset (engine/network/protocol.py): round trips (hypothesis) and malformed frames."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import (
    FailoverEntry,
    Item,
    KeyNotFound,
    NotMyVBucket,
    Op,
    RollbackRequired,
    SnapshotFlags,
    SnapshotMarker,
    Status,
    StreamEnd,
    StreamEndReason,
    TemporaryFailure,
)
from engine.exceptions import InvalidArgument, UnknownCommand
from engine.network.protocol import (
    HEADER_LEN,
    MAX_BODY,
    REQ_MAGIC,
    RES_MAGIC,
    STREAM_REQ_EXTRAS,
    Frame,
    FrameBuffer,
    Opcode,
    ProtocolError,
    decode_dcp_message,
    decode_failover_log,
    decode_frame,
    encode_dcp_message,
    encode_failover_log,
    encode_stream_request,
    error_from,
    error_response,
    request,
    response,
)

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)

frames = st.builds(
    Frame, st.sampled_from([REQ_MAGIC, RES_MAGIC]), u8, st.binary(max_size=300), st.binary(max_size=255),
    st.binary(max_size=2000), u8, u16, u32, u64)


def test_opcode_numbers_are_kv_engines() -> None:
    assert (Opcode.GET, Opcode.SET, Opcode.DELETE, Opcode.STAT) == (0x00, 0x01, 0x04, 0x10)
    assert (Opcode.SET_VBUCKET_STATE, Opcode.GET_VBUCKET_STATE) == (0x3D, 0x3E)
    assert (Opcode.DCP_OPEN, Opcode.DCP_STREAM_REQ, Opcode.DCP_GET_FAILOVER_LOG, Opcode.DCP_STREAM_END) == (
        0x50, 0x53, 0x54, 0x55)
    assert (Opcode.DCP_SNAPSHOT_MARKER, Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION) == (
        0x56, 0x57, 0x58, 0x59)
    assert (Opcode.DCP_BUFFER_ACKNOWLEDGEMENT, Opcode.OBSERVE_SEQNO) == (0x5D, 0x91)
    assert STREAM_REQ_EXTRAS.size == 48
    assert int(Status.ROLLBACK) == 0x23


@settings(max_examples=300, deadline=None)
@given(frames)
def test_frame_round_trip(f: Frame) -> None:
    data = f.encode()
    assert len(data) == HEADER_LEN + len(f.key) + len(f.extras) + len(f.value)
    assert decode_frame(data) == f


@settings(max_examples=100, deadline=None)
@given(st.lists(frames, min_size=1, max_size=6), st.integers(1, 97))
def test_incremental_decoder_any_split(fs: list[Frame], chunk: int) -> None:
    data = b"".join(f.encode() for f in fs)
    buf = FrameBuffer()
    got: list[Frame] = []
    for i in range(0, len(data), chunk):
        buf.feed(data[i:i + chunk])
        got.extend(buf.frames())
    assert got == fs and len(buf) == 0


items = st.builds(
    Item, st.binary(min_size=1, max_size=250), st.binary(max_size=500), u16, u64, u64, u64, u32, u32, u8,
    st.just(Op.MUTATION))
tombstones = st.builds(
    Item, st.binary(min_size=1, max_size=250), st.none(), u16, u64, u64, u64, st.just(0), u32, u8,
    st.sampled_from([Op.DELETION, Op.EXPIRATION]))
markers = st.builds(SnapshotMarker, u16, u64, u64, st.integers(0, 0x3F).map(SnapshotFlags))
ends = st.builds(StreamEnd, u16, st.sampled_from(list(StreamEndReason)))


@settings(max_examples=300, deadline=None)
@given(st.one_of(items, tombstones, markers, ends), u32)
def test_dcp_message_round_trip(m: SnapshotMarker | Item | StreamEnd, opaque: int) -> None:
    data = encode_dcp_message(m, opaque)
    f = decode_frame(data)
    assert f.is_request and f.opaque == opaque and f.vbucket == m.vbucket
    back = decode_dcp_message(f)
    assert back == m
    # the flow-control size both ends account is the encoded size (expirations carry 20-byte extras in
    # kv_engine, one byte less than the engine charges: both ends charge dcp_size, so acks stay consistent)
    if not (isinstance(m, Item) and m.op is Op.EXPIRATION):
        assert len(data) == m.dcp_size


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2**64 - 1), u64), max_size=25))
def test_failover_log_round_trip(pairs: list[tuple[int, int]]) -> None:
    entries = [FailoverEntry(u, s) for u, s in pairs]
    assert decode_failover_log(encode_failover_log(entries)) == entries


@given(u32, u64, u64, u64, u64, u64)
def test_stream_request_extras_layout(flags: int, start: int, end: int, uuid: int, ss: int, se: int) -> None:
    ex, val = encode_stream_request(start, end, uuid, ss, se, flags, [FailoverEntry(7, 3)])
    assert struct.unpack(">IIQQQQQ", ex) == (flags, 0, start, end, uuid, ss, se)
    assert val == struct.pack(">QQ", 7, 3)


def test_errors_map_to_typed_exceptions() -> None:
    for err in (NotMyVBucket("x"), KeyNotFound("y"), TemporaryFailure("z"), InvalidArgument("w"),
                UnknownCommand("u")):
        f = decode_frame(error_response(Opcode.GET, err, opaque=9))
        assert f.status == err.status and f.opaque == 9
        back = error_from(f)
        assert type(back) is type(err) and str(err) in str(back)
    f = decode_frame(error_response(Opcode.DCP_STREAM_REQ, RollbackRequired(3, 42)))
    assert f.status == Status.ROLLBACK and f.value == struct.pack(">Q", 42)
    rb = error_from(f, 3)
    assert isinstance(rb, RollbackRequired) and rb.seqno == 42 and rb.vbucket == 3
    with pytest.raises(ProtocolError):
        error_from(decode_frame(response(Opcode.DCP_STREAM_REQ, Status.ROLLBACK, value=b"abc")))


def test_malformed_frames_raise_protocol_error() -> None:
    good = request(Opcode.SET, key=b"k", extras=b"\0" * 8, value=b"v")
    with pytest.raises(ProtocolError):
        decode_frame(good[:10])  # truncated header
    with pytest.raises(ProtocolError):
        decode_frame(b"\x42" + good[1:])  # bad magic
    with pytest.raises(ProtocolError):
        decode_frame(good[:-1])  # body shorter than the header says
    bad_lengths = bytearray(good)
    bad_lengths[2:4] = (500).to_bytes(2, "big")  # key longer than the body
    with pytest.raises(ProtocolError):
        decode_frame(bytes(bad_lengths))
    huge = bytearray(good[:HEADER_LEN])
    huge[8:12] = (MAX_BODY + 1).to_bytes(4, "big")
    with pytest.raises(ProtocolError):
        FrameBuffer().feed(bytes(huge))  # returns None: then the frames are read too
        list(_frames(bytes(huge)))
    with pytest.raises(ProtocolError):
        decode_dcp_message(decode_frame(request(Opcode.DCP_MUTATION, key=b"k", extras=b"\0" * 5)))
    with pytest.raises(ProtocolError):
        decode_dcp_message(decode_frame(request(Opcode.GET, key=b"k")))
    with pytest.raises(ProtocolError):
        decode_failover_log(b"\0" * 15)
    with pytest.raises(ProtocolError):
        request(Opcode.GET, vbucket=70000)
    assert issubclass(ProtocolError, InvalidArgument) and ProtocolError("x").status is Status.EINVAL


def _frames(data: bytes) -> list[Frame]:
    buf = FrameBuffer()
    buf.feed(data)
    return list(buf.frames())


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=HEADER_LEN, max_size=200))
def test_garbage_never_escapes_as_another_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        _frames(data)
