"""The KV port's handshake as an SDK performs it (docs/kv-protocol.md): HELLO, SASL, GET_ERROR_MAP,
SELECT_BUCKET, GET_CLUSTER_CONFIG -- and every way it can be refused."""

from __future__ import annotations

import struct
from collections.abc import Callable

import orjson
import pytest

from engine.network.kv.features import Feature
from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.opcodes import KVStatus
from engine.network.protocol import HEADER, HEADER_LEN
from tests.engine.network.kv.harness import ALL_FEATURES, PASSWORD, KVNode, RawClient


def test_hello_enables_what_the_port_supports_in_request_order(connect: Callable[..., RawClient]) -> None:
    c = connect()
    asked = [Feature.COLLECTIONS, Feature.XATTR, Feature.SNAPPY, Feature.TRACING, Feature.UNORDERED_EXECUTION,
             *ALL_FEATURES, Feature.XERROR, 0x7777]
    got = c.hello(asked)
    assert got == ALL_FEATURES  # unsupported, unknown and repeated features are not answered
    # a feature that depends on another is enabled only with it
    assert c.hello([Feature.CLUSTERMAP_CHANGE_NOTIFICATION, Feature.SYNC_REPLICATION]) == []
    f = c.call(Op.HELLO, value=b"\x00\x07\x00")  # odd length
    assert f.status == KVStatus.EINVAL


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA512", "SCRAM-SHA256", "SCRAM-SHA1"])
def test_scram_mechanisms_authenticate(connect: Callable[..., RawClient], mechanism: str) -> None:
    c = connect()
    c.hello()
    f = c.scram("app", PASSWORD, mechanism)
    assert f.status == 0
    assert c.call(Op.SELECT_BUCKET, key=b"default").status == 0


def test_list_mechs_offers_scram_and_no_plain_without_tls(connect: Callable[..., RawClient]) -> None:
    c = connect()
    f = c.call(Op.SASL_LIST_MECHS)
    assert f.status == 0
    assert f.value.split() == [b"SCRAM-SHA512", b"SCRAM-SHA256", b"SCRAM-SHA1"]
    f = c.call(Op.SASL_AUTH, key=b"PLAIN", value=b"\x00app\x00" + PASSWORD.encode())
    assert f.status == KVStatus.AUTH_ERROR


def test_wrong_password_unknown_user_and_mechanism_are_auth_errors_and_keep_the_connection(
        connect: Callable[..., RawClient]) -> None:
    c = connect()
    c.hello()
    assert c.scram("app", "wrong").status == KVStatus.AUTH_ERROR
    assert c.scram("nobody", PASSWORD).status == KVStatus.AUTH_ERROR
    f = c.call(Op.SASL_AUTH, key=b"SCRAM-MD5", value=b"n,,n=app,r=abc")
    assert f.status == KVStatus.AUTH_ERROR
    assert orjson.loads(f.value)["error"]["context"] == "authentication failed"  # says nothing more
    f = c.call(Op.SASL_STEP, key=b"SCRAM-SHA512", value=b"c=biws,r=x,p=AAAA")  # a step without an auth
    assert f.status == KVStatus.AUTH_ERROR
    for bad in (b"", b"p=tls,,n=app,r=x", b"n,a=z,n=app,r=x", b"n,,r=x", b"\xff\xfe"):
        assert c.call(Op.SASL_AUTH, key=b"SCRAM-SHA512", value=bad).status == KVStatus.AUTH_ERROR
    # not authenticated: a document request is refused
    assert c.call(Op.GET, key=b"k").status == KVStatus.EACCESS
    # and the connection still works
    assert c.scram("app", PASSWORD).status == 0


def test_a_tampered_proof_fails(connect: Callable[..., RawClient]) -> None:
    c = connect()
    c.hello()
    f = c.call(Op.SASL_AUTH, key=b"SCRAM-SHA256", value=b"n,,n=app,r=clientnonce")
    assert f.status == KVStatus.AUTH_CONTINUE
    nonce = dict(p.split("=", 1) for p in f.value.decode().split(","))["r"]
    assert nonce.startswith("clientnonce")
    f = c.call(Op.SASL_STEP, key=b"SCRAM-SHA256", value=f"c=biws,r={nonce},p={'A' * 44}".encode())
    assert f.status == KVStatus.AUTH_ERROR


def test_unknown_user_gets_a_stable_made_up_salt(connect: Callable[..., RawClient]) -> None:
    def salt(user: str) -> str:
        c = connect()
        f = c.call(Op.SASL_AUTH, key=b"SCRAM-SHA512", value=f"n,,n={user},r=abc".encode())
        assert f.status == KVStatus.AUTH_CONTINUE
        return dict(p.split("=", 1) for p in f.value.decode().split(","))["s"]

    assert salt("ghost") == salt("ghost")
    assert salt("ghost") != salt("phantom")


def test_before_authentication_only_the_handshake_is_allowed(connect: Callable[..., RawClient]) -> None:
    c = connect()
    c.hello()
    assert c.call(Op.NOOP).status == 0
    f = c.call(Op.GET_ERROR_MAP, value=struct.pack(">H", 2))
    assert f.status == 0
    for op in (Op.SELECT_BUCKET, Op.GET_CLUSTER_CONFIG, Op.GET, Op.SET):
        assert c.call(op, key=b"default" if op == Op.SELECT_BUCKET else b"").status == KVStatus.EACCESS


def test_select_bucket_of_another_name_is_eaccess_and_documents_need_a_bucket(
        connect: Callable[..., RawClient]) -> None:
    c = connect().login(bucket="")
    assert c.call(Op.SELECT_BUCKET, key=b"travel-sample").status == KVStatus.EACCESS
    assert c.call(Op.GET, key=b"k").status == KVStatus.NO_BUCKET
    assert c.call(Op.SELECT_BUCKET, key=b"default").status == 0
    assert c.doc(Op.GET, b"k").status == KVStatus.KEY_ENOENT


@pytest.mark.parametrize("version", [1, 2, 9])
def test_error_map(connect: Callable[..., RawClient], version: int) -> None:
    c = connect()
    c.hello()
    f = c.call(Op.GET_ERROR_MAP, value=struct.pack(">H", version))
    assert f.status == 0
    m = orjson.loads(f.value)
    assert m["version"] == min(version, 2)
    assert m["errors"]["9"]["name"] == "LOCKED" and "item-locked" in m["errors"]["9"]["attrs"]
    assert {"a0", "a1", "a2", "a3", "a4", "24", "20", "7"} <= set(m["errors"])
    assert c.call(Op.GET_ERROR_MAP, value=b"\x00").status == KVStatus.EINVAL
    assert c.call(Op.GET_ERROR_MAP, value=struct.pack(">H", 0)).status == KVStatus.EINVAL


def test_cluster_config_cccp_and_gcccp(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login(bucket="")
    f = c.call(Op.GET_CLUSTER_CONFIG)
    assert f.status == 0 and f.datatype == 0x01
    g = orjson.loads(f.value)
    assert "vBucketServerMap" not in g and g["nodesExt"][0]["services"] == {"kv": node.port}
    assert c.call(Op.SELECT_BUCKET, key=b"default").status == 0
    cfg = orjson.loads(c.call(Op.GET_CLUSTER_CONFIG).value)
    assert cfg["name"] == "default" and cfg["rev"] >= 1 and cfg["revEpoch"] >= 1
    assert cfg["nodesExt"] == [{"services": {"kv": node.port}, "hostname": "127.0.0.1", "thisNode": True}]
    m = cfg["vBucketServerMap"]
    assert m["serverList"] == [f"127.0.0.1:{node.port}"] and m["numReplicas"] == 0
    assert m["vBucketMap"] == [[0]] * node.bucket.num_vbuckets
    assert "durableWrite" in cfg["bucketCapabilities"] and "collections" not in cfg["bucketCapabilities"]


def test_without_xerror_errors_carry_no_body_and_locked_is_remapped(connect: Callable[..., RawClient]) -> None:
    c = connect().login(features=[Feature.SELECT_BUCKET])
    f = c.doc(Op.GET, b"missing")
    assert f.status == KVStatus.KEY_ENOENT and f.value == b""
    assert c.doc(Op.SET, b"k", extras=b"\0" * 8, value=b"v").status == 0
    assert c.doc(Op.GET_LOCKED, b"k").status == 0
    assert c.doc(Op.GET_LOCKED, b"k").status == KVStatus.TMPFAIL
    assert c.doc(Op.SET, b"k", extras=b"\0" * 8, value=b"v").status == KVStatus.KEY_EEXISTS


def test_clustermap_change_notification_reaches_duplex_connections(node: KVNode,
                                                                   connect: Callable[..., RawClient]) -> None:
    c = connect().login()  # DUPLEX + CLUSTERMAP_CHANGE_NOTIFICATION
    d = connect().login(features=[Feature.XERROR, Feature.SELECT_BUCKET])
    assert node.server is not None
    server = node.server
    node.call(server.notify_config_change)
    magic, opcode, keylen, extlen, datatype, _vb, bodylen, _opaque, _cas = HEADER.unpack(c._exact(HEADER_LEN))
    body = c._exact(bodylen)
    assert (magic, opcode, datatype) == (0x82, 0x01, 0x01)
    assert int.from_bytes(body[:extlen], "big") == 1 and body[extlen:extlen + keylen] == b"default"
    assert b"vBucketServerMap" in body[extlen + keylen:]
    assert d.call(Op.NOOP).status == 0  # nothing was pushed to the connection that did not ask


def test_no_secret_in_a_session_repr(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect()
    c.hello()
    f = c.call(Op.SASL_AUTH, key=b"SCRAM-SHA512", value=b"n,,n=app,r=abc")
    assert f.status == KVStatus.AUTH_CONTINUE
    assert node.server is not None
    sessions = [repr(conn.session) for conn in node.server.conns]
    assert sessions and all("fake_secret" not in r and "_nonce" not in r and PASSWORD not in r for r in sessions)
    assert all("stored_key" not in r and "server_key" not in r for r in sessions)
