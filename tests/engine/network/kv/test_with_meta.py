"""XDCR's inbound writes on the KV port (docs/xdcr.md "Target side", docs/kv-protocol.md): SET / DEL_WITH_META
need the replication_target role (EACCESS for a data writer), keep the source's metadata, run the bucket's
conflict resolution (a loss is KEY_EEXISTS with its reason), and GET_META answers the engine's metadata."""

from __future__ import annotations

import json
from collections.abc import Callable

from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.opcodes import KVStatus
from schemas.with_meta import decode_get_meta_extras, encode_with_meta_extras
from tests.engine.network.kv.harness import KVNode, RawClient

SOURCE_CAS = 0x17A0_0000_0000_0000


def test_with_meta_writes_need_the_replication_target_role_and_keep_the_source_metadata(
        node: KVNode, connect: Callable[..., RawClient]) -> None:
    extras = encode_with_meta_extras(flags=7, expiry=0, rev_seqno=5, cas=SOURCE_CAS)
    writer = connect().login("writer")
    f = writer.doc(Op.SET_WITH_META, b"doc", extras=extras, value=b'{"v": 1}')
    assert f.status == KVStatus.EACCESS, f
    xdcr = connect().login("xdcr")
    f = xdcr.doc(Op.SET_WITH_META, b"doc", extras=extras, value=b'{"v": 1}')
    assert f.status == 0, f
    meta = xdcr.doc(Op.GET_META, b"doc", extras=b"\x02")
    assert meta.status == 0 and meta.cas == SOURCE_CAS
    deleted, flags, _expiry, rev, _dt = decode_get_meta_extras(meta.extras)
    assert (deleted, flags, rev) == (False, 7, 5)
    # the same version again loses the conflict: KEY_EEXISTS naming the reason, nothing written
    f = xdcr.doc(Op.SET_WITH_META, b"doc", extras=extras, value=b'{"v": 1}')
    assert f.status == KVStatus.KEY_EEXISTS
    assert json.loads(f.value)["error"]["reason"] == "rejected_identical"
    older = encode_with_meta_extras(flags=7, expiry=0, rev_seqno=4, cas=SOURCE_CAS + 1)
    f = xdcr.doc(Op.SET_WITH_META, b"doc", extras=older, value=b'{"v": 0}')
    assert f.status == KVStatus.KEY_EEXISTS and json.loads(f.value)["error"]["reason"] == "rejected_behind"
    # a newer deletion wins and leaves a tombstone with the source's metadata
    newer = encode_with_meta_extras(flags=7, expiry=0, rev_seqno=6, cas=SOURCE_CAS + 2)
    f = xdcr.doc(Op.DEL_WITH_META, b"doc", extras=newer)
    assert f.status == 0, f
    meta = xdcr.doc(Op.GET_META, b"doc")
    assert meta.status == 0 and meta.cas == SOURCE_CAS + 2 and decode_get_meta_extras(meta.extras)[0] is True
    app = connect().login("app")
    assert app.doc(Op.GET, b"doc").status == KVStatus.KEY_ENOENT
