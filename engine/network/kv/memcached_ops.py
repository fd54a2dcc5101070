"""The classic memcached variants of GET and SET the SDKs never send but plain memcached clients do
(docs/kv-protocol.md "Opcodes"): GETQ / GETK / GETKQ (kv_engine ``GetQ`` / ``GetK`` / ``GetKQ``: the K ones echo
the key, the Q ones answer nothing on a miss) and SETQ (a SET answered only when it fails) -- what libmemcached
(``memcslap``) uses for its gets and what a pipelining loader uses for its writes.

Each one is its base operation (engine/network/kv/documents.py), with the same checks, roles and statuses.
"""

from __future__ import annotations

from dataclasses import replace

from engine.exceptions import KeyNotFound
from engine.kv.locks import LOCKED_CAS
from engine.kv.vbucket import MAX_KEY_LEN, vbucket_of
from engine.network.kv.documents import DocumentOps, _need
from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.session import Session
from engine.network.protocol import GET_EXTRAS, SET_EXTRAS, Frame, response


def _as(out: bytes, opcode: int) -> bytes:
    """A response of the base opcode re-labelled with the client's opcode (byte 1 of the header)."""
    return out[:1] + bytes([opcode]) + out[2:]


def register_memcached_ops(docs: DocumentOps) -> None:
    """Add GETQ, GETK, GETKQ and SETQ to ``docs``."""

    async def get_key(s: Session, f: Frame, quiet: bool) -> bytes:
        _need(f, 0, value=False)  # GET's checks
        b = docs.provider.bucket_for(f.vbucket)
        docs._readable(b, f)
        try:
            g = b.get(f.key, vbucket=f.vbucket)
        except KeyNotFound:
            if quiet:
                return b""
            raise
        cas = LOCKED_CAS if b.is_locked(f.key, vbucket=f.vbucket) else g.cas
        return response(f.opcode, key=f.key, extras=GET_EXTRAS.pack(g.flags), value=g.value,
                        datatype=docs._dt(s, g.datatype), opaque=f.opaque, cas=cas)

    async def getq(s: Session, f: Frame) -> bytes:
        try:
            return _as(await docs._get(s, replace(f, opcode=Op.GET)), f.opcode)
        except KeyNotFound:
            return b""

    async def getk(s: Session, f: Frame) -> bytes:
        return await get_key(s, f, quiet=False)

    async def getkq(s: Session, f: Frame) -> bytes:
        return await get_key(s, f, quiet=True)

    async def setq(s: Session, f: Frame) -> bytes:
        # A SET answered only when it fails: the ingest lane of pipelining loaders (bench/kv.py). The common case
        # -- no CAS, no durability, the key in the request's vbucket -- goes straight to Bucket.set's ingest path
        # with SET's checks; anything else is SET itself (documents.py maps SETQ to its store mode), whose errors
        # are answered.
        if f.framing or f.cas:
            await docs._store(s, f)
            return b""
        _need(f, 8)
        value = docs._value(s, f)
        b = docs._write_target(f)
        key = f.key
        if len(key) > MAX_KEY_LEN or vbucket_of(key, b.num_vbuckets) != f.vbucket:
            await docs._store(s, f)  # NOT_MY_VBUCKET / EINVAL, as a SET answers them
            return b""
        flags, expiry = SET_EXTRAS.unpack(f.extras)
        r = b.set(key, value, flags=flags, expiry=expiry, datatype=f.datatype or None)
        docs.hooks.wrote(r, len(key) + len(value))
        return b""

    docs.register(Op.GETQ, getq)
    docs.register(Op.GETK, getk)
    docs.register(Op.GETKQ, getkq)
    docs.register(Op.SETQ, setq)


__all__ = ["register_memcached_ops"]
