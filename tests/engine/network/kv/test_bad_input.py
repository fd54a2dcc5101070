"""Malformed and hostile input on the KV port (docs/kv-protocol.md "Bad input"): the documented status and the
connection kept, or the connection closed when the stream cannot be resynchronised -- and nothing accepted
before is lost."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.opcodes import KVStatus
from engine.network.protocol import HEADER, request
from tests.engine.network.kv.harness import KVNode, RawClient


def _accepted(c: RawClient, n: int = 5) -> list[tuple[bytes, int]]:
    out = []
    for i in range(n):
        key = f"keep-{i}".encode()
        f = c.doc(Op.SET, key, extras=b"\0" * 8, value=b"v%d" % i)
        assert f.status == 0
        out.append((key, f.cas))
    return out


def _still_there(connect: Callable[..., RawClient], docs: list[tuple[bytes, int]]) -> None:
    d = connect().login()
    for key, cas in docs:
        g = d.doc(Op.GET, key)
        assert g.status == 0 and g.cas == cas


def test_bad_magic_closes_the_connection(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    docs = _accepted(c)
    c.send(HEADER.pack(0x42, 0, 0, 0, 0, 0, 0, 1, 0))
    assert c.closed_by_server()
    _still_there(connect, docs)
    assert node.server is not None and node.server.bad_frames == 1


def test_absurd_body_length_closes_the_connection(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    docs = _accepted(c)
    c.send(HEADER.pack(0x80, Op.SET, 1, 8, 0, 0, 0xFFFFFFF0, 1, 0))
    assert c.closed_by_server()
    _still_there(connect, docs)


def test_inconsistent_lengths_close_the_connection(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    c.send(HEADER.pack(0x80, Op.GET, 50, 0, 0, 0, 10, 1, 0) + b"x" * 10)  # key longer than the body
    assert c.closed_by_server()


def test_truncated_packet_is_never_executed(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    whole = request(Op.SET, key=b"half", extras=b"\0" * 8, value=b"v" * 100, opaque=9)
    c.send(whole[:60])
    c.close()  # the peer hangs up mid-packet
    d = connect().login()
    assert d.doc(Op.GET, b"half").status == KVStatus.KEY_ENOENT
    # the other connection's partial frame does not disturb this one
    assert d.doc(Op.SET, b"half", extras=b"\0" * 8, value=b"ok").status == 0


def test_value_over_20_mib_is_e2big_and_the_connection_kept(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    docs = _accepted(c)
    f = c.doc(Op.SET, b"big", extras=b"\0" * 8, value=b"x" * (20 * 1024 * 1024 + 1))
    assert f.status == KVStatus.E2BIG
    assert c.doc(Op.APPEND, docs[0][0], value=b"x" * (20 * 1024 * 1024 + 1)).status == KVStatus.E2BIG
    assert c.doc(Op.GET, b"big").status == KVStatus.KEY_ENOENT
    _still_there(connect, docs)


def test_unknown_opcode_is_unknown_command_and_the_connection_kept(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    for op in (0x3F, 0xEE, 0xB6):
        assert c.call(op, key=b"k").status == KVStatus.UNKNOWN_COMMAND
    assert c.call(Op.NOOP).status == 0
    # unknown before authentication too
    d = connect()
    assert d.call(0xEE).status == KVStatus.UNKNOWN_COMMAND


def test_malformed_requests_are_einval_and_the_connection_kept(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    docs = _accepted(c)
    bad: list[tuple[Op, dict[str, Any]]] = [
        (Op.SET, {"key": b"k", "extras": b"\0" * 3, "value": b"v"}),  # extras size
        (Op.SET, {"key": b"", "extras": b"\0" * 8, "value": b"v"}),  # no key
        (Op.GET, {"key": b"k", "extras": b"\0" * 4}),  # GET takes no extras
        (Op.GET, {"key": b"k", "value": b"v"}),  # GET takes no value
        (Op.GET, {"key": b"k" * 251}),  # key longer than 250
        (Op.SET, {"key": b"k", "extras": b"\0" * 8, "value": b"v", "datatype": 0x02}),  # snappy, not negotiated
        (Op.GET_LOCKED, {"key": b"k", "extras": b"\0" * 2}),
        (Op.HELLO, {"extras": b"\0"}),
    ]
    for op, kw in bad:
        f = c.doc(op, kw.pop("key", b"x"), **kw)
        assert f.status == KVStatus.EINVAL, (op, f)
    _still_there(connect, docs)


def test_pipelined_requests_are_all_answered_in_order(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    frames = b"".join(request(Op.SET, key=b"p%d" % i, extras=b"\0" * 8, value=b"v", opaque=100 + i,
                              vbucket=0) for i in range(50))
    c.send(frames + request(Op.NOOP, opaque=999))
    seen = [c.recv() for _ in range(51)]
    assert [f.opaque for f in seen] == [*range(100, 150), 999]
    assert all(f.status in (0, KVStatus.NOT_MY_VBUCKET) for f in seen)


def test_response_magic_from_a_client_is_ignored(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    c.send(HEADER.pack(0x81, 0x01, 0, 0, 0, 0, 0, 77, 0))
    assert c.call(Op.NOOP).status == 0
