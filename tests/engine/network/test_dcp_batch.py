"""DCP frames in batches (engine/network/dcp_batch.py): the batch encoder gives exactly the bytes of the
per-message encoder, the client's one-pass decoder exactly what the frame-by-frame path (FrameBuffer, then
decode_dcp_message for the open streams' requests) gives, for any split of the received bytes; malformed
frames raise ProtocolError on both."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Item, Op, SnapshotFlags, SnapshotMarker, StreamEnd, StreamEndReason
from engine.dcp.stream import Message, SetVBucketStateMessage
from engine.exceptions import TemporaryFailure
from engine.kv.vbucket import VBucketState
from engine.network.dcp_batch import MUTATION_FRAME, DcpFrameBuffer, decode_dcp_frames, encode_dcp_batch
from engine.network.protocol import (
    HEADER_LEN,
    MAX_BODY,
    REQ_MAGIC,
    Frame,
    FrameBuffer,
    Opcode,
    ProtocolError,
    decode_dcp_message,
    encode,
    encode_dcp_message,
    request,
    response,
)
from engine.network.remote import RemoteDcpProducer

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)
vbs = st.integers(0, 7)  # few vbuckets: opaque maps hit and miss

mutations = st.builds(
    Item, st.binary(min_size=1, max_size=60), st.one_of(st.binary(max_size=200), st.none()), vbs, u64, u64, u64,
    u32, u32, u8, st.just(Op.MUTATION), st.just(0), st.just(0), st.sampled_from([0, 0, 5]))
tombstones = st.builds(
    Item, st.binary(min_size=1, max_size=60), st.one_of(st.none(), st.binary(max_size=40)), vbs, u64, u64, u64,
    st.just(0), u32, u8, st.sampled_from([Op.DELETION, Op.EXPIRATION]), st.just(0), st.just(0),
    st.sampled_from([0, 0, 9]))
prepares = st.builds(
    Item, st.binary(min_size=1, max_size=60), st.binary(max_size=100), vbs, u64, u64, u64, u32, u32, u8,
    st.just(Op.PREPARE), st.just(0), st.integers(1, 3))
completions = st.builds(
    Item, st.binary(min_size=1, max_size=60), st.none(), vbs, u64, st.just(0), st.just(0), st.just(0), st.just(0),
    st.just(0), st.sampled_from([Op.MUTATION, Op.ABORT]), st.just(0), st.just(0), st.integers(1, 2**40))
markers = st.builds(SnapshotMarker, vbs, u64, u64, st.integers(0, 0x3F).map(SnapshotFlags))
ends = st.builds(StreamEnd, vbs, st.sampled_from(list(StreamEndReason)))
states = st.builds(SetVBucketStateMessage, vbs, st.sampled_from([VBucketState.PENDING, VBucketState.ACTIVE]))
messages = st.one_of(mutations, mutations, markers, tombstones, prepares, completions, ends, states)
opaque_maps = st.dictionaries(vbs, u32, max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(messages, max_size=30), opaque_maps, st.booleans())
def test_batch_encoder_gives_the_per_message_bytes(msgs: list[Message], opaques: dict[int, int], sync: bool) -> None:
    want = b"".join(encode_dcp_message(m, opaques.get(m.vbucket, 0), sync=sync) for m in msgs)
    assert bytes(encode_dcp_batch(msgs, opaques, sync=sync)) == want


def _reference(data: bytes, opaques: dict[int, int]) -> tuple[list[Message], Frame | None]:
    """What a DCP client did frame by frame: the open streams' pushed messages, the last response."""
    buf = FrameBuffer()
    buf.feed(data)
    out: list[Message] = []
    answer = None
    for f in buf.frames():
        if not f.is_request:
            answer = f
        elif f.opcode != Opcode.DCP_NOOP and opaques.get(f.vbucket) == f.opaque:
            out.append(decode_dcp_message(f))
    return out, answer


# what a node sends a DCP client: pushed messages (of streams open or not), noops, responses
pushed = st.tuples(messages, u32).map(lambda t: encode_dcp_message(t[0], t[1], sync=True))
others = st.one_of(
    st.just(request(Opcode.DCP_NOOP, opaque=3)),
    st.builds(lambda op, v, o: response(op, value=v, opaque=o),
              st.sampled_from([Opcode.DCP_STREAM_REQ, Opcode.DCP_CONTROL]), st.binary(max_size=40), u32))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(pushed, pushed, others), max_size=30), opaque_maps, st.integers(1, 400), st.data())
def test_decoder_matches_the_frame_by_frame_path_for_any_split(
    frames: list[bytes], opaques: dict[int, int], chunk: int, data: st.DataObject,
) -> None:
    # the open streams' opaques are mostly those of the pushed frames (hits), plus random ones (misses)
    for raw in frames:
        if raw[0] == REQ_MAGIC and data.draw(st.booleans()):
            vb, opaque = struct.unpack_from(">H", raw, 6)[0], struct.unpack_from(">I", raw, 12)[0]
            opaques[vb] = opaque
    stream = b"".join(frames)
    want, want_answer = _reference(stream, opaques)
    buf = DcpFrameBuffer()
    got: list[Message] = []
    answer = None
    total = 0
    for i in range(0, len(stream), chunk):
        buf.feed(stream[i:i + chunk])
        n, a = buf.take_dcp(opaques, got)
        total += n
        answer = a or answer
    assert got == want
    assert answer == want_answer
    assert total == len(frames) and len(buf) == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(pushed, others), min_size=1, max_size=8), st.integers(1, 97))
def test_dcp_frame_buffer_is_a_frame_buffer(frames: list[bytes], chunk: int) -> None:
    stream = b"".join(frames)
    buf = DcpFrameBuffer()
    got: list[Frame] = []
    for i in range(0, len(stream), chunk):
        buf.feed(stream[i:i + chunk])
        got.extend(buf.frames())
    ref = FrameBuffer()
    ref.feed(stream)
    assert got == list(ref.frames()) and len(buf) == 0


def test_a_partial_frame_waits_for_the_rest() -> None:
    m = Item(b"k", b"v" * 100, 3, 7, 1, 99, op=Op.MUTATION)
    data = bytes(encode_dcp_batch([m, m], {3: 5}))
    out: list[Message] = []
    for cut in (10, HEADER_LEN, MUTATION_FRAME.size + 2, len(data) // 2 + 5):
        out.clear()
        consumed, frames, answer = decode_dcp_frames(data[:cut], {3: 5}, out)
        assert frames == (1 if cut >= len(data) // 2 else 0) and answer is None
        assert consumed == (len(data) // 2 if frames else 0) and len(out) == frames


# ---------------------------------------------------------------------- bad input
def _mutation_frame(**fields: int) -> bytes:
    f = {"magic": REQ_MAGIC, "keylen": 1, "extlen": 31, "bodylen": 31 + 1 + 2}
    f.update(fields)
    return (MUTATION_FRAME.pack(f["magic"], Opcode.DCP_MUTATION, f["keylen"], f["extlen"], 0, 1, f["bodylen"], 9, 0,
                                1, 1, 0, 0, 0, 0, 0) + b"kvv")


@pytest.mark.parametrize("frame", [
    _mutation_frame(magic=0x42),  # bad magic
    _mutation_frame(bodylen=MAX_BODY + 1),  # oversized body
    _mutation_frame(keylen=40),  # key + extras beyond the body
    encode(REQ_MAGIC, Opcode.DCP_MUTATION, b"k", b"\0" * 30, b"v", vbucket_or_status=1, opaque=9),  # 30-byte extras
    encode(REQ_MAGIC, Opcode.DCP_SNAPSHOT_MARKER, b"", b"\0" * 19, vbucket_or_status=1, opaque=9),  # short marker
    encode(REQ_MAGIC, 0x42, b"k", vbucket_or_status=1, opaque=9),  # not a DCP data message
])
def test_malformed_frames_raise_protocol_error_as_the_frame_by_frame_path(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        _reference(frame, {1: 9})
    with pytest.raises(ProtocolError):
        decode_dcp_frames(frame, {1: 9}, [])


def test_a_marker_with_a_key_decodes_as_the_frame_by_frame_path() -> None:
    frame = encode(REQ_MAGIC, Opcode.DCP_SNAPSHOT_MARKER, b"odd", struct.pack(">QQI", 1, 5, 1), vbucket_or_status=1,
                   opaque=9)
    out: list[Message] = []
    decode_dcp_frames(frame, {1: 9}, out)
    assert out == _reference(frame, {1: 9})[0] == [SnapshotMarker(1, 1, 5, SnapshotFlags(1))]


@pytest.mark.parametrize("m", [
    Item(b"k" * 0x10000, b"", 1, 1, 1, 1),  # key longer than the header's 16 bits
    Item(b"k", b"v", 1, 1, 1, 2**64),  # cas beyond 64 bits
    Item(b"k", b"v", 0x10000, 1, 1, 1),  # vbucket beyond 16 bits
    Item(b"k", None, 1, 1, 1, 1, op=Op.DELETION, datatype=0x100),  # datatype beyond 8 bits
    SnapshotMarker(1, 2**64, 1, SnapshotFlags.MEMORY),  # seqno beyond 64 bits
])
def test_batch_encoder_refuses_fields_out_of_range(m: Message) -> None:
    with pytest.raises(ProtocolError):
        encode_dcp_batch([m], {1: 1})
    with contextlib.suppress(ProtocolError, struct.error), pytest.raises((ProtocolError, struct.error)):
        encode_dcp_message(m, 1)


def test_batch_encoder_refuses_a_body_over_the_maximum() -> None:
    with pytest.raises(ProtocolError):
        encode_dcp_batch([Item(b"k", b"v" * MAX_BODY, 1, 1, 1, 1)], {})


def test_remote_producer_drops_the_connection_on_a_malformed_pushed_frame() -> None:
    """A node that pushes a frame the client cannot decode: ProtocolError, and the connection is closed (the
    stream of frames cannot be resynchronised)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def node() -> None:
        conn, _ = srv.accept()
        with conn:
            head = conn.recv(HEADER_LEN)
            body_len = struct.unpack_from(">I", head, 8)[0]
            while body_len > 0:
                body_len -= len(conn.recv(body_len))
            opaque = struct.unpack_from(">I", head, 12)[0]
            conn.sendall(response(Opcode.DCP_OPEN, opaque=opaque))  # DCP_OPEN answered
            opened.wait(5)
            conn.sendall(_mutation_frame(keylen=40))  # then garbage
            conn.recv(1)

    opened = threading.Event()
    t = threading.Thread(target=node, daemon=True)
    t.start()
    try:
        p = RemoteDcpProducer("127.0.0.1", srv.getsockname()[1], "bad", poll_timeout=2.0, timeout=5.0)
        opened.set()
        with pytest.raises(ProtocolError):
            for _ in range(20):
                p.step()
        assert p.closed
        assert p.step() == []
        with pytest.raises(TemporaryFailure):
            p.stream_request(1, 0)
    finally:
        srv.close()
        t.join(5)
