"""Every KV request checked against the user's roles (docs/kv-protocol.md "Authorization"): each role against
each document opcode, EACCESS when none of its roles allows it, and role changes taking effect on open
connections."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

from engine.network.kv.access import BOTH, NEEDS, allowed
from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.opcodes import KVStatus
from engine.security.roles import Role
from schemas.with_meta import encode_with_meta_extras
from tests.engine.network.kv.harness import USERS, KVNode, RawClient

#: opcode -> a request body that is valid for it (key k exists when it runs)
REQUESTS: dict[int, dict[str, object]] = {
    Op.GET: {},
    Op.GET_LOCKED: {},
    Op.GAT: {"extras": struct.pack(">I", 0)},
    Op.SET: {"extras": b"\0" * 8, "value": b"v"},
    Op.REPLACE: {"extras": b"\0" * 8, "value": b"v"},
    Op.APPEND: {"value": b"v"},
    Op.PREPEND: {"value": b"v"},
    Op.INCREMENT: {"extras": struct.pack(">QQI", 1, 0, 0)},
    Op.TOUCH: {"extras": struct.pack(">I", 0)},
    Op.DELETE: {},
}


@pytest.mark.parametrize("user", sorted(USERS))
def test_each_role_against_each_document_opcode(node: KVNode, connect: Callable[..., RawClient], user: str) -> None:
    admin = connect().login("admin")
    roles = frozenset(USERS[user])
    c = connect().login(user)
    for op, body in REQUESTS.items():
        key = f"k-{int(op)}".encode()
        admin.doc(Op.SET, key, extras=b"\0" * 8, value=b"1")
        f = c.doc(op, key, **body)
        if allowed(roles, op):
            assert f.status == 0, (user, op, f)
        else:
            assert f.status == KVStatus.EACCESS, (user, op, f)
    # anyone authenticated may read the cluster config; the DCP-only user may observe seqnos
    assert c.call(Op.GET_CLUSTER_CONFIG).status == 0
    obs = c.call(Op.OBSERVE_SEQNO, value=b"\0" * 8)
    assert obs.status == 0


def test_the_role_table() -> None:
    writer, reader = frozenset({Role.DATA_WRITER}), frozenset({Role.DATA_READER})
    both = writer | reader
    assert allowed(writer, Op.SET) and not allowed(reader, Op.SET)
    assert allowed(reader, Op.GET) and not allowed(writer, Op.GET)
    # a write whose answer carries the value needs both (kv_engine: Read and Upsert)
    for op in BOTH:
        assert allowed(both, op) and not allowed(writer, op) and not allowed(reader, op)
    assert all(allowed(frozenset({Role.ADMIN}), op) for op in NEEDS)
    assert allowed(frozenset({Role.DCP_READER}), Op.OBSERVE_SEQNO)
    assert not allowed(frozenset({Role.DCP_READER}), Op.GET)


def test_with_meta_writes_need_replication_target(connect: Callable[..., RawClient]) -> None:
    # (test_with_meta.py: what the replication_target user's writes do)
    for rev, (user, ok) in enumerate((("app", False), ("writer", False), ("xdcr", True), ("admin", True)), 1):
        c = connect().login(user)
        f = c.doc(Op.SET_WITH_META, b"k", extras=encode_with_meta_extras(0, 0, rev, 1 << 40), value=b"v")
        assert (f.status == 0) if ok else (f.status == KVStatus.EACCESS), (user, f)


def test_a_role_change_reaches_an_open_connection(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login("app")
    assert c.doc(Op.SET, b"k", extras=b"\0" * 8, value=b"v").status == 0
    node.users.set_roles("app", [Role.DATA_READER])
    assert node.server is not None
    for conn in node.server.conns:  # the refresh interval passes
        conn.session._roles_at = -1e9
    assert c.doc(Op.SET, b"k", extras=b"\0" * 8, value=b"v").status == KVStatus.EACCESS
    assert c.doc(Op.GET, b"k").status == 0
    node.users.delete("app")
    for conn in node.server.conns:
        conn.session._roles_at = -1e9
    assert c.doc(Op.GET, b"k").status == KVStatus.EACCESS
