"""The classic memcached variants of GET and SET the SDKs never send but plain memcached clients do
(docs/kv-protocol.md "Opcodes"): GETQ / GETK / GETKQ (kv_engine ``GetQ`` / ``GetK`` / ``GetKQ``: the K ones echo
the key, the Q ones answer nothing on a miss) and SETQ (a SET answered only when it fails) -- what libmemcached
(``memcslap``) uses for its gets and what a pipelining loader uses for its writes.

Each one is its base operation (engine/network/kv/documents.py), with the same checks, roles and statuses.
"""

from __future__ import annotations

import struct
from dataclasses import replace

from engine.exceptions import EngineError, KeyNotFound
from engine.kv.item import Datatype
from engine.kv.locks import LOCKED_CAS
from engine.kv.vbucket import MAX_KEY_LEN, vbucket_of
from engine.network.kv import access
from engine.network.kv.documents import DocumentOps, _need
from engine.network.kv.opcodes import MAX_VALUE
from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.sasl import UserDirectory
from engine.network.kv.session import Session
from engine.network.protocol import GET_EXTRAS, HEADER_LEN, SET_EXTRAS, Frame, response


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

    hooks = docs.hooks
    provider = docs.provider
    admit_vbucket = getattr(provider, "admit_write", None)  # a cluster's provider: TMPFAIL while a vbucket moves

    async def setq(s: Session, f: Frame) -> bytes:
        # A SET answered only when it fails: the ingest lane of pipelining loaders (bench/kv.py). The common case
        # -- no CAS, no durability, a well-formed request, the key in the request's vbucket -- goes straight to
        # Bucket.set's ingest path after SET's checks; anything else is SET itself (documents.py maps SETQ to its
        # store mode), which answers the errors.
        key, value, dt = f.key, f.value, f.datatype
        if (f.framing or f.cas or len(f.extras) != 8 or not 0 < len(key) <= MAX_KEY_LEN or len(value) > MAX_VALUE
                or (dt and (dt != Datatype.JSON or not s.json))):
            await docs._store(s, f)
            return b""
        b = provider.bucket_for(f.vbucket)
        hooks.admit_write()
        if admit_vbucket is not None:
            admit_vbucket(f.vbucket)
        if vbucket_of(key, b.num_vbuckets) != f.vbucket:
            await docs._store(s, f)  # NOT_MY_VBUCKET, as a SET answers it
            return b""
        flags, expiry = SET_EXTRAS.unpack(f.extras)
        hooks.wrote(b.set(key, value, flags=flags, expiry=expiry, datatype=dt or None), len(key) + len(value))
        return b""

    docs.register(Op.GETQ, getq)
    docs.register(Op.GETK, getk)
    docs.register(Op.GETKQ, getkq)
    docs.register(Op.SETQ, setq)


_HEADER = struct.Struct(">BBHBBHIIQ")
_SET_EXTRAS = struct.Struct(">II")
_REQ = 0x80


class SetqLane:
    """The front end's fast lane for a run of plain quiet SETs (kv_engine answers SETQ as SET, silently on
    success): frames read straight from the connection's buffer, no per-request coroutine or answer. It takes
    only what it can execute exactly as the general path would -- an authenticated session with its bucket and a
    role allowing SETQ; the classic magic (no framing extras); 8 bytes of extras, a key of 1..250 bytes, no CAS,
    a negotiated datatype, a value within the maximum; the key in the request's vbucket; the write admitted -- and
    stops at the first frame that is anything else, which the general path then answers (its error included)."""

    def __init__(self, docs: DocumentOps, users: UserDirectory) -> None:
        self.users = users
        self.hooks = docs.hooks
        self.provider = docs.provider
        self._admit_vbucket = getattr(docs.provider, "admit_write", None)

    def run(self, s: Session, buf: bytearray, pos: int) -> int:
        """Execute the SETQ frames from ``buf[pos:]`` on; the position after the last one taken."""
        if s.user is None or s.bucket is None or not access.allowed(s.roles(self.users), Op.SETQ):
            return pos
        n = len(buf)
        hooks, provider, admit_vbucket = self.hooks, self.provider, self._admit_vbucket
        json_ok = s.json
        while pos + HEADER_LEN <= n:
            magic, op, keylen, extlen, dt, vb, bodylen, _opaque, cas = _HEADER.unpack_from(buf, pos)
            end = pos + HEADER_LEN + bodylen
            vlen = bodylen - extlen - keylen
            if (magic != _REQ or op != Op.SETQ or extlen != 8 or cas or not 0 < keylen <= MAX_KEY_LEN
                    or end > n or not 0 <= vlen <= MAX_VALUE or (dt and (dt != Datatype.JSON or not json_ok))):
                break
            k0 = pos + HEADER_LEN + 8
            key = bytes(buf[k0:k0 + keylen])
            try:
                b = provider.bucket_for(vb)
                hooks.admit_write()
                if admit_vbucket is not None:
                    admit_vbucket(vb)
                if vbucket_of(key, b.num_vbuckets) != vb:
                    break
                flags, expiry = _SET_EXTRAS.unpack_from(buf, pos + HEADER_LEN)
                r = b.set(key, bytes(buf[k0 + keylen:end]), flags=flags, expiry=expiry, datatype=dt or None)
            except EngineError:
                break  # not executed: the general path runs it again and answers the error
            hooks.wrote(r, keylen + vlen)
            pos = end
        return pos


__all__ = ["SetqLane", "register_memcached_ops"]
