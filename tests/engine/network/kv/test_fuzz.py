"""Random requests on an authenticated KV connection (docs/kv-protocol.md "Bad input"): every well-framed request
is answered -- with the opaque it carried -- and the connection stays usable; random bytes either get answers or
close the connection; the port keeps serving new connections either way and loses nothing acknowledged."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.protocol import ALT_REQ_MAGIC, REQ_MAGIC, encode
from tests.engine.network.kv.harness import KVNode, RawClient

frames = st.builds(
    lambda magic, op, key, extras, value, dt, vb, cas, framing: (magic, op, key, extras, value, dt, vb, cas,
                                                                  framing if magic == ALT_REQ_MAGIC else b""),
    st.sampled_from([REQ_MAGIC, ALT_REQ_MAGIC]),
    st.one_of(st.sampled_from([int(o) for o in Op]), st.integers(0, 255)),
    st.binary(max_size=40),
    st.binary(max_size=24),
    st.binary(max_size=64),
    st.integers(0, 255),
    st.integers(0, 0xFFFF),
    st.one_of(st.just(0), st.integers(0, 2**64 - 1)),
    st.binary(max_size=6),
)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVNode]:
    n = KVNode(tmp_path_factory.mktemp("kvfuzz") / "data")
    yield n
    n.close()


@pytest.fixture(scope="module")
def admin(shared: KVNode) -> Iterator[RawClient]:
    c = RawClient(shared.port).login("admin")
    yield c
    c.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(frames, min_size=1, max_size=8))
def test_well_framed_requests_are_all_answered(admin: RawClient, batch: list[tuple]) -> None:
    c = admin  # one connection for every example: it must stay usable
    c.doc(Op.SET, b"anchor", extras=b"\0" * 8, value=b"kept")
    for i, (magic, op, key, extras, value, dt, vb, cas, framing) in enumerate(batch):
        if op in (Op.SASL_AUTH, Op.SASL_STEP, Op.HELLO, Op.SELECT_BUCKET):
            continue  # they change the connection's identity / features / bucket: covered by test_handshake
        c.send(encode(magic, op, key, extras, value, dt, vb, 1000 + i, cas, framing))
        f = c.recv()
        assert f.opaque == 1000 + i and f.opcode == op
    assert c.doc(Op.GET, b"anchor").value == b"kept"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=200))
def test_random_bytes_never_take_the_port_down(shared: KVNode, admin: RawClient, junk: bytes) -> None:
    c = RawClient(shared.port, timeout=2)
    try:
        c.send(junk)
        c.sock.shutdown(socket.SHUT_WR)
        try:
            while c.sock.recv(65536):
                pass  # answers to whatever whole frames the junk held, then the close
        except OSError:
            pass
    finally:
        c.close()
    assert admin.call(Op.NOOP).status == 0  # the port, and a connection in it, still serve
    d = RawClient(shared.port)
    try:
        assert d.call(Op.NOOP).status == 0
    finally:
        d.close()
