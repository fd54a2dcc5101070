"""Synchronous replication on the wire (engine/network/protocol.py, docs/durability.md "Node processes"): alt requests (magic 0x08) with the durability frame info, and
the DCP sync-replication messages (kv_engine opcodes 0x60-0x63): round trips (hypothesis) and bad input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.exceptions import DurabilityInvalidLevel, Status, error_for_status
from engine.kv.durability import Durability, Level
from engine.kv.item import Item, Op
from engine.network.protocol import (
    ALT_REQ_MAGIC,
    Frame,
    FrameBuffer,
    Opcode,
    ProtocolError,
    decode_dcp_message,
    decode_frame,
    decode_framing,
    encode_dcp_message,
    encode_durability_frame,
    request,
)

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)
durabilities = st.builds(Durability, st.sampled_from([Level.MAJORITY, Level.MAJORITY_AND_PERSIST_TO_ACTIVE,
                                                      Level.PERSIST_TO_MAJORITY]), u16)


def test_sync_opcode_numbers_are_kv_engines() -> None:
    assert (Opcode.DCP_PREPARE, Opcode.DCP_SEQNO_ACKNOWLEDGED, Opcode.DCP_COMMIT, Opcode.DCP_ABORT) == (
        0x60, 0x61, 0x62, 0x63)
    assert ALT_REQ_MAGIC == 0x08


@given(d=durabilities, key=st.binary(min_size=1, max_size=250), value=st.binary(max_size=500), vb=u16,
       opaque=u32, cas=u64, chunk=st.integers(1, 64))
def test_alt_request_with_durability_round_trips_over_any_split(
        d: Durability, key: bytes, value: bytes, vb: int, opaque: int, cas: int, chunk: int) -> None:
    data = request(Opcode.SET, key=key, extras=b"\0" * 8, value=value, vbucket=vb, opaque=opaque, cas=cas,
                   framing=encode_durability_frame(d))
    assert data[0] == ALT_REQ_MAGIC
    buf = FrameBuffer()
    got: list[Frame] = []
    for i in range(0, len(data), chunk):
        buf.feed(data[i:i + chunk])
        got.extend(buf.frames())
    (f,) = got
    assert f == decode_frame(data)
    assert (f.key, f.value, f.extras, f.vbucket, f.opaque, f.cas) == (key, value, b"\0" * 8, vb, opaque, cas)
    assert f.is_request and decode_framing(f.framing) == d
    assert f.encode() == data


def test_framing_without_durability_and_bad_frames() -> None:
    assert decode_framing(b"") is None
    assert decode_framing(bytes([0x11, 1])) == Durability(Level.MAJORITY)
    assert decode_framing(bytes([0x13, 3, 0x05, 0xDC])) == Durability(Level.PERSIST_TO_MAJORITY, 1500)
    for bad_level in (0, 4, 0xFF):
        with pytest.raises(DurabilityInvalidLevel) as e:
            decode_framing(bytes([0x11, bad_level]))
        assert e.value.status == Status.DURABILITY_INVALID_LEVEL
        assert "must be 1..3" in str(e.value)  # 0 (none) is not sent in a frame: the message says what is valid
    for bad in (bytes([0x12, 1, 0]),        # length 2: not 1 or 3
                bytes([0x11]),              # truncated
                bytes([0x21, 1]),           # unknown frame id
                bytes([0xF1, 1])):          # escaped id
        with pytest.raises(ProtocolError):
            decode_framing(bad)
    # repeated (the official SDK resends a retried request with the frame appended again): the last one counts
    assert decode_framing(bytes([0x13, 1, 0x23, 0x28, 0x13, 1, 0x23, 0x28])) == Durability(Level.MAJORITY, 9000)
    assert decode_framing(bytes([0x11, 1, 0x11, 3])) == Durability(Level.PERSIST_TO_MAJORITY)
    with pytest.raises(DurabilityInvalidLevel):
        decode_framing(bytes([0x11, 1, 0x11, 0]))
    with pytest.raises(DurabilityInvalidLevel):
        encode_durability_frame(Durability(Level.NONE))
    with pytest.raises(ProtocolError):
        request(Opcode.SET, key=b"k" * 256, framing=bytes([0x11, 1]))  # alt keys are 8-bit
    assert type(error_for_status(0xA0)) is DurabilityInvalidLevel


sync_items = st.one_of(
    st.builds(lambda k, v, vb, s, r, c, fl, ex, dt, lv: Item(k, v, vb, s, r, c, fl, ex, dt, Op.PREPARE, 0, lv),
              st.binary(min_size=1, max_size=40), st.binary(max_size=100), u16, u64, u64, u64, u32, u32, u8,
              st.integers(1, 3)),
    st.builds(lambda k, vb, s, r, c, fl, ex, lv: Item(k, None, vb, s, r, c, fl, ex, 0, Op.PREPARE_DELETION, 0,
                                                      lv),
              st.binary(min_size=1, max_size=40), u16, u64, u64, u64, u32, u32, st.integers(1, 3)),
    st.builds(lambda k, vb, s, p: Item(k, None, vb, s, 0, 0, 0, 0, 0, Op.ABORT, 0, 0, p),
              st.binary(min_size=1, max_size=40), u16, u64, st.integers(1, 2**64 - 1)),
    st.builds(lambda k, vb, s, p: Item(k, None, vb, s, 0, 0, 0, 0, 0, Op.MUTATION, 0, 0, p),
              st.binary(min_size=1, max_size=40), u16, u64, st.integers(1, 2**64 - 1)),
)


@given(m=sync_items, opaque=u32)
def test_dcp_sync_messages_round_trip_with_equal_flow_control_size(m: Item, opaque: int) -> None:
    data = encode_dcp_message(m, opaque, sync=True)
    f = decode_frame(data)
    assert f.opaque == opaque and f.vbucket == m.vbucket
    got = decode_dcp_message(f)
    assert isinstance(got, Item)
    assert got == m
    assert got.dcp_size == m.dcp_size  # both ends count the same bytes


def test_commit_is_a_plain_mutation_without_sync_writes() -> None:
    commit = Item(b"k", b"v", 3, 9, 2, 77, 5, 0, 0, Op.MUTATION, 0, 0, 8)
    f = decode_frame(encode_dcp_message(commit, 1))
    assert f.opcode == Opcode.DCP_MUTATION
    got = decode_dcp_message(f)
    assert isinstance(got, Item) and (got.value, got.seqno, got.prepared) == (b"v", 9, 0)
    f = decode_frame(encode_dcp_message(commit, 1, sync=True))
    assert f.opcode == Opcode.DCP_COMMIT and f.value == b""


def test_bad_sync_messages_raise_protocol_error() -> None:
    for op, extras in ((Opcode.DCP_PREPARE, b"\0" * 30), (Opcode.DCP_COMMIT, b"\0" * 15),
                       (Opcode.DCP_ABORT, b"")):
        with pytest.raises(ProtocolError):
            decode_dcp_message(decode_frame(request(op, key=b"k", extras=extras)))
    bad_level = bytes(28) + bytes([0, 0, 9])
    with pytest.raises(ProtocolError):
        decode_dcp_message(decode_frame(request(Opcode.DCP_PREPARE, key=b"k", extras=bad_level)))
