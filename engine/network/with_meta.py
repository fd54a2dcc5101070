"""The XDCR target's opcodes over the memcached binary protocol: GET_META, SET_WITH_META, ADD_WITH_META,
DEL_WITH_META (kv_engine numbers and extras, docs/xdcr.md "Target side").

Each handler takes the bucket and one decoded request :class:`~engine.network.protocol.Frame` and returns the
encoded response, so the node process (engine/network/server.py) and the SDK-facing KV port share them; the
caller checks the user's ``replication_target`` role first where a user store exists. Handlers raise the
engine's typed errors; :func:`answer` turns them into kv_engine's error responses too.

* GET_META: request extras none, or a version byte (1, or 2 to get the datatype too); answer extras deleted u32
  (0x01 = tombstone), flags u32, expiry u32 (a tombstone's delete time), rev seqno u64 [, datatype u8], header
  CAS = the document's CAS; KEY_ENOENT when the key has no document and no tombstone.
* SET / ADD / DEL_WITH_META: extras flags u32, expiration u32, rev seqno u64, cas u64 [, options u32]
  [, extended-meta length u16] (24 / 26 / 28 / 30 bytes); the header CAS, if non-zero, must match the stored
  document. Success: the stored CAS in the header and the mutation token (vbuuid, seqno) as extras, as SET
  answers here. A conflict loss is KEY_EEXISTS with the JSON error context naming the reason
  (``rejected_behind`` / ``rejected_identical``).

Not supported (EINVAL): durability frames, snappy-compressed values (datatype 0x02 is never negotiated here). Extended metadata (the trailing ``nmeta`` bytes of the
value) is accepted and ignored, as kv_engine ignores it since 6.x.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from engine.exceptions import EngineError, Status
from engine.kv.conflict_resolution import ConflictRejected, ItemMeta
from engine.kv.item import Datatype
from engine.network.protocol import (
    GET_META_V1,
    GET_META_V2,
    TOKEN_EXTRAS,
    WITH_META_OPCODES,
    Frame,
    Opcode,
    ProtocolError,
    decode_with_meta_extras,
    encode_get_meta_extras,
    error_response,
    response,
)

if TYPE_CHECKING:
    from engine.bucket import Bucket

def handle_get_meta(bucket: Bucket, f: Frame) -> bytes:
    """GET_META: the metadata of a document or tombstone."""
    if not f.key:
        raise ProtocolError("GET_META needs a key")
    if f.value or f.framing:
        raise ProtocolError("GET_META takes no value and no framing extras")
    if len(f.extras) > 1:
        raise ProtocolError(f"GET_META extras of {len(f.extras)} bytes, expected 0 or 1 (version)")
    version = f.extras[0] if f.extras else GET_META_V1
    if version not in (GET_META_V1, GET_META_V2):
        raise ProtocolError(f"GET_META version {version} (1 or 2 expected)")
    m = bucket.get_meta(f.key, vbucket=f.vbucket)
    extras = encode_get_meta_extras(m.deleted, m.flags, m.expiry, m.rev_seqno,
                                    m.datatype if version == GET_META_V2 else None)
    return response(f.opcode, extras=extras, opaque=f.opaque, cas=m.cas)


def handle_write_with_meta(bucket: Bucket, f: Frame) -> bytes:
    """SET_WITH_META / ADD_WITH_META / DEL_WITH_META."""
    op = f.opcode
    if not f.key:
        raise ProtocolError(f"opcode 0x{op:02x} needs a key")
    if f.framing:
        raise ProtocolError("framing extras (durability) are not supported with *_WITH_META")
    if f.datatype & Datatype.SNAPPY:
        raise ProtocolError("snappy-compressed values are not supported (datatype 0x02 was not negotiated)")
    flags, expiry, rev, cas, options, nmeta = decode_with_meta_extras(f.extras)
    value = f.value
    if nmeta:
        if nmeta > len(value):
            raise ProtocolError(f"extended meta length {nmeta} exceeds the value ({len(value)} bytes)")
        value = value[:len(value) - nmeta]
    meta = ItemMeta(cas, rev, flags, expiry, f.datatype)
    vb = f.vbucket
    if op == Opcode.SET_WITH_META:
        r = bucket.set_with_meta(f.key, value, meta, options, cas=f.cas, vbucket=vb)
    elif op == Opcode.ADD_WITH_META:
        r = bucket.add_with_meta(f.key, value, meta, options, cas=f.cas, vbucket=vb)
    else:
        r = bucket.del_with_meta(f.key, value or None, meta, options, cas=f.cas, vbucket=vb)
    return response(op, extras=TOKEN_EXTRAS.pack(r.vbuuid, r.seqno), opaque=f.opaque, cas=r.cas)


def handle(bucket: Bucket, f: Frame) -> bytes:
    """Serve one request of :data:`WITH_META_OPCODES`; raises the engine's typed errors."""
    if f.opcode == Opcode.GET_META:
        return handle_get_meta(bucket, f)
    if f.opcode in WITH_META_OPCODES:
        return handle_write_with_meta(bucket, f)
    raise ProtocolError(f"opcode 0x{f.opcode:02x} is not a with-meta opcode")


def answer(bucket: Bucket, f: Frame) -> bytes:
    """:func:`handle`, with an engine error turned into its kv_engine error response (a conflict loss:
    KEY_EEXISTS whose JSON context also carries ``"reason"``)."""
    try:
        return handle(bucket, f)
    except ConflictRejected as e:
        return conflict_response(f, e)
    except EngineError as e:
        return error_response(f.opcode, e, f.opaque)


def conflict_response(f: Frame, e: ConflictRejected) -> bytes:
    """KEY_EEXISTS for a conflict loss; the error context names the reason for the replicator's counters."""
    reason = "rejected_identical" if e.identical else "rejected_behind"
    body = orjson.dumps({"error": {"context": str(e), "reason": reason}})
    return response(f.opcode, Status.KEY_EEXISTS, value=body, datatype=Datatype.JSON, opaque=f.opaque)


__all__ = ["WITH_META_OPCODES", "answer", "conflict_response", "handle", "handle_get_meta",
           "handle_write_with_meta"]
