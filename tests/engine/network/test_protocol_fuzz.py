"""Fuzz of the memcached binary protocol (engine/network/protocol.py) and of a running node process (engine/network/server.py):
random, truncated and garbage frames give a typed engine error (a protocol error status on the wire) or a clean
close -- never another exception, never a crash, never a hang; the node keeps answering other connections.
Bounded for CI (example counts, socket timeouts)."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.exceptions import EngineError, Status
from engine.network.process_cluster import NodeProcess
from engine.network.protocol import (
    ALT_REQ_MAGIC,
    HEADER,
    HEADER_LEN,
    REQ_MAGIC,
    RES_MAGIC,
    Frame,
    FrameBuffer,
    Opcode,
    ProtocolError,
    decode_dcp_message,
    decode_failover_log,
    decode_frame,
    decode_framing,
    error_from,
    request,
)

NVB = 4
u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)
opcodes = st.one_of(st.sampled_from([int(o) for o in Opcode]), u8)
magics = st.one_of(st.sampled_from([REQ_MAGIC, RES_MAGIC, ALT_REQ_MAGIC]), u8)
#: extras of the sizes the opcodes use, or anything
extras = st.one_of(st.sampled_from([0, 1, 4, 8, 16, 20, 21, 31, 48]).flatmap(lambda n: st.binary(min_size=n,
                                                                                               max_size=n)),
                   st.binary(max_size=64))


@st.composite
def raw_frames(draw: st.DrawFn) -> bytes:
    """One frame's bytes: usually consistent lengths with random fields, sometimes with a lying header,
    truncated, or bit-flipped."""
    magic = draw(magics)
    framing = draw(st.binary(max_size=8)) if magic == ALT_REQ_MAGIC else b""
    key = draw(st.binary(max_size=40))
    ex = draw(extras)
    value = draw(st.binary(max_size=200))
    body = framing + ex + key + value
    keylen = (len(framing) << 8 | len(key)) if magic == ALT_REQ_MAGIC else len(key)
    fields = [magic, draw(opcodes), keylen & 0xFFFF, len(ex) & 0xFF, draw(u8),
              draw(st.one_of(st.integers(0, NVB - 1), u16)), len(body), draw(u32), draw(u64)]
    how = draw(st.sampled_from(["ok", "ok", "ok", "lie", "truncate", "flip"]))
    if how == "lie":
        i = draw(st.sampled_from([2, 3, 6]))
        fields[i] = draw({2: u16, 3: u8, 6: st.integers(0, len(body) + 64)}[i])
    data = HEADER.pack(*fields) + body
    if how == "truncate":
        data = data[:draw(st.integers(0, len(data)))]
    elif how == "flip" and data:
        pos = draw(st.integers(0, len(data) - 1))
        data = data[:pos] + bytes([data[pos] ^ draw(st.integers(1, 255))]) + data[pos + 1:]
    return data


small = st.integers(0, 8)
keys = st.sampled_from([b"a", b"b", b"k1", b"", b"\xff\x00", b"x" * 250, b"x" * 251])
stat_groups = st.sampled_from([b"", b"vbucket-details 0", b"vbucket-details 99", b"vbucket-details x",
                               b"dcp-vbtakeover 0 fz", b"dcp-vbtakeover 1", b"replication", b"?"])
controls = st.sampled_from([b"enable_sync_writes", b"consumer_name", b"connection_buffer_size", b"nope"])


@st.composite
def commands(draw: st.DrawFn) -> bytes:
    """A well-formed request (or a consumer's response) of an opcode the node serves, with field values from
    small ranges so that sequences reach the success paths (DCP_OPEN, then stream requests, acks ...)."""
    op = draw(st.sampled_from([
        Opcode.GET, Opcode.SET, Opcode.DELETE, Opcode.STAT, Opcode.SET_VBUCKET_STATE, Opcode.GET_VBUCKET_STATE,
        Opcode.DCP_OPEN, Opcode.DCP_STREAM_REQ, Opcode.DCP_CONTROL, Opcode.DCP_BUFFER_ACKNOWLEDGEMENT,
        Opcode.DCP_SEQNO_ACKNOWLEDGED, Opcode.DCP_CLOSE_STREAM, Opcode.OBSERVE_SEQNO, Opcode.DCP_GET_FAILOVER_LOG,
        Opcode.DCP_NOOP, Opcode.DCP_ADD_STREAM, Opcode.FLUSH_NOW, Opcode.DCP_SNAPSHOT_MARKER,
        Opcode.DCP_SET_VBUCKET_STATE]))
    vb = draw(st.one_of(st.integers(0, NVB - 1), st.just(0xFFFF)))
    opaque = draw(st.integers(0, 4))
    key, ex, value, framing, magic = draw(keys), b"", b"", b"", REQ_MAGIC
    if op in (Opcode.SET, Opcode.DELETE):
        ex = struct.pack(">II", draw(u32), draw(st.sampled_from([0, 1, 2**31]))) if op == Opcode.SET else b""
        value = draw(st.binary(max_size=32))
        if draw(st.booleans()):
            magic, framing = ALT_REQ_MAGIC, bytes([0x11, draw(st.integers(0, 5))])
    elif op == Opcode.STAT:
        key = draw(stat_groups)
    elif op == Opcode.SET_VBUCKET_STATE:
        ex = bytes([draw(st.integers(0, 5))])
        value = draw(st.sampled_from([b"", b"{}", b'{"transfer": true}', b'{"topology": [["fz"]]}',
                                      b'{"topology": 5}', b"[", b"null"]))
    elif op == Opcode.DCP_OPEN:
        ex = struct.pack(">II", 0, draw(st.sampled_from([0, 1, 3])))
        key = draw(st.sampled_from([b"fz", b"c1", b""]))
    elif op == Opcode.DCP_STREAM_REQ:
        ex = struct.pack(">IIQQQQQ", draw(st.sampled_from([0, 1, 4, 0xFFFFFFFF])), 0, draw(small),
                         draw(st.sampled_from([0, 5, 2**64 - 1])), draw(st.sampled_from([0, 1, 2**64 - 1])),
                         draw(small), draw(small))
        value = draw(st.sampled_from([b"", b"\0" * 16, b"\0" * 15]))
    elif op == Opcode.DCP_CONTROL:
        key = draw(controls)
        value = draw(st.sampled_from([b"true", b"-1", b"10", b"x", b"\xff"]))
    elif op == Opcode.DCP_BUFFER_ACKNOWLEDGEMENT:
        ex = struct.pack(">I", draw(u32))
    elif op == Opcode.DCP_SEQNO_ACKNOWLEDGED:
        ex = struct.pack(">Q", draw(st.sampled_from([0, 1, 2**64 - 1])))
    elif op == Opcode.OBSERVE_SEQNO:
        value = struct.pack(">Q", draw(u64)) if draw(st.booleans()) else b"\0" * 7
    elif op == Opcode.DCP_ADD_STREAM:
        ex = struct.pack(">I", draw(st.sampled_from([0, 1])))
        key = draw(st.sampled_from([b"fz", b"other"]))
    elif op in (Opcode.DCP_SNAPSHOT_MARKER, Opcode.DCP_SET_VBUCKET_STATE):
        magic = RES_MAGIC  # a consumer's ack of a marker / takeover state change
    keylen = (len(framing) << 8 | len(key)) if magic == ALT_REQ_MAGIC else len(key)
    if keylen > 0xFFFF or (magic == ALT_REQ_MAGIC and len(key) > 255):
        key, keylen = b"k", (len(framing) << 8 | 1) if magic == ALT_REQ_MAGIC else 1
    body = framing + ex + key + value
    status_or_vb = draw(st.sampled_from([0, 1])) if magic == RES_MAGIC else vb
    return HEADER.pack(magic, int(op), keylen, len(ex), 0, status_or_vb, len(body), opaque, draw(
        st.sampled_from([0, 1, 2**64 - 1]))) + body


# ----------------------------------------------------------------------------------------------- parser
@settings(max_examples=500, deadline=None)
@given(st.lists(raw_frames(), min_size=1, max_size=5), st.integers(1, 64))
def test_parser_random_frames_raise_only_protocol_error(chunks: list[bytes], split: int) -> None:
    data = b"".join(chunks)
    buf = FrameBuffer()
    got: list[Frame] = []
    try:
        for i in range(0, len(data), split):
            buf.feed(data[i:i + split])
            got.extend(buf.frames())
    except ProtocolError:
        return
    for f in got:  # every frame the buffer yields decodes the same on its own, and re-encodes
        assert decode_frame(f.encode()) == f


@settings(max_examples=500, deadline=None)
@given(opcodes, extras, st.binary(max_size=40), st.binary(max_size=64), u8, u16, u64)
def test_dcp_message_decoder_raises_only_protocol_error(op: int, ex: bytes, key: bytes, value: bytes, dt: int,
                                                         vb: int, cas: int) -> None:
    f = Frame(REQ_MAGIC, op, key, ex, value, dt, vb, 0, cas)
    with contextlib.suppress(ProtocolError):
        decode_dcp_message(f)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=24))
def test_framing_extras_decoder_raises_only_typed_errors(framing: bytes) -> None:
    try:
        decode_framing(framing)
    except EngineError as e:
        assert e.status in (Status.EINVAL, Status.DURABILITY_INVALID_LEVEL), e


@settings(max_examples=300, deadline=None)
@given(u8, u16, st.binary(max_size=48))
def test_error_answers_and_failover_logs_decode_to_typed_errors(op: int, status: int, value: bytes) -> None:
    f = Frame(RES_MAGIC, op, b"", b"", value, 0, status, 0, 0)
    with contextlib.suppress(ProtocolError):
        assert isinstance(error_from(f), EngineError)
    with contextlib.suppress(ProtocolError):
        decode_failover_log(value)


# ----------------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp = tmp_path_factory.mktemp("fuzznode")
    n = NodeProcess("fz", tmp / "fz", NVB, {"seed": 5})
    n.start()
    try:
        yield n
    finally:
        n.kill()


def _log(n: NodeProcess) -> str:
    path = Path(n.data_dir).parent / f"{n.name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _read_all(s: socket.socket, budget: float) -> bytes:
    """Whatever the node answers until it closes the connection or ``budget`` seconds pass."""
    out = b""
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        except ConnectionError:
            break
        if not chunk:
            break
        out += chunk
    return out


def _answers_noop(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request(Opcode.DCP_NOOP, opaque=0xABCD))
        data = b""
        while len(data) < HEADER_LEN:
            chunk = s.recv(HEADER_LEN - len(data))
            if not chunk:
                return False
            data += chunk
        fields = struct.unpack(">BBHBBHIIQ", data)
        return bool(fields[0] == RES_MAGIC and fields[5] == Status.SUCCESS and fields[7] == 0xABCD)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          database=None)
@given(frames=st.lists(st.one_of(commands(), commands(), raw_frames()), min_size=1, max_size=10))
def test_node_process_survives_random_frames(node: NodeProcess, frames: list[bytes]) -> None:
    assert node.port is not None
    # every vbucket active first (the random frames may change that), so writes and streams can succeed
    activate = b"".join(request(Opcode.SET_VBUCKET_STATE, extras=b"\x01", vbucket=v) for v in range(NVB))
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:
        for data in (activate, *frames):
            try:
                s.sendall(data)
            except ConnectionError:
                break  # the node dropped a connection it cannot resynchronise: a clean close
        answers = _read_all(s, 0.05)
    buf = FrameBuffer()
    buf.feed(answers)
    for f in buf.frames():  # what the node answers is well-formed, and never "internal error" (a bug)
        assert f.is_request or f.status != Status.EINTERNAL, (f, _log(node)[-3000:])
    assert node.up, _log(node)[-3000:]
    assert _answers_noop(node.port), "the node stopped answering other connections"


def test_node_log_has_no_unhandled_exception_after_the_fuzz(node: NodeProcess) -> None:
    # runs after the fuzz in this module (same module-scoped node)
    text = _log(node)
    assert "Traceback" not in text and "Unhandled exception" not in text, text[-5000:]
