"""The KV port over TLS (docs/kv-protocol.md "TLS"): the config advertises ``kvSSL``, PLAIN is offered and works
only here, SCRAM still works, and a plain-text client gets nothing."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import trustme

from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.opcodes import KVStatus
from engine.security.tls import server_context
from tests.engine.network.kv.harness import PASSWORD, KVNode, RawClient


@pytest.fixture
def tls_node(tmp_path: Path) -> Iterator[tuple[KVNode, ssl.SSLContext]]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(tmp_path / "key.pem")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    client = ssl.create_default_context()
    ca.configure_trust(client)
    n = KVNode(tmp_path / "data", ssl_context=server_context(tmp_path / "cert.pem", tmp_path / "key.pem"))
    yield n, client
    n.close()


def test_plain_and_scram_over_tls(tls_node: tuple[KVNode, ssl.SSLContext]) -> None:
    node, client = tls_node
    c = RawClient(node.port, tls=client)
    try:
        c.hello()
        assert b"PLAIN" in c.call(Op.SASL_LIST_MECHS).value.split()
        assert c.call(Op.SASL_AUTH, key=b"PLAIN", value=b"\0app\0wrong").status == KVStatus.AUTH_ERROR
        assert c.call(Op.SASL_AUTH, key=b"PLAIN", value=b"\0app").status == KVStatus.AUTH_ERROR  # malformed
        assert c.call(Op.SASL_AUTH, key=b"PLAIN", value=b"\0app\0" + PASSWORD.encode()).status == 0
        assert c.call(Op.SELECT_BUCKET, key=b"default").status == 0
        cfg = orjson.loads(c.call(Op.GET_CLUSTER_CONFIG).value)
        assert cfg["nodesExt"][0]["services"] == {"kvSSL": node.port}
        assert c.doc(Op.SET, b"k", extras=b"\0" * 8, value=b"v").status == 0
        assert c.scram("reader", PASSWORD).status == 0
    finally:
        c.close()


def test_plain_text_client_on_the_tls_port_gets_nothing(tls_node: tuple[KVNode, ssl.SSLContext]) -> None:
    node, _client = tls_node
    c = RawClient(node.port, timeout=5)
    try:
        c.send(b"\x80\x1f" + b"\0" * 22)
        with pytest.raises((ConnectionError, OSError)):
            c.recv()
    finally:
        c.close()
