"""Document operations of the KV port against the engine (docs/kv-protocol.md "Opcodes").

Each handler validates the frame as kv_engine's packet validators do (extras / key / value sizes: EINVAL),
calls the bucket that serves the vbucket (the cluster config provider says which) with the request's vbucket
(a key that does not hash there is NOT_MY_VBUCKET), and builds the answer: GET-like answers carry the flags as
extras; mutations carry the new CAS and, with MUTATION_SEQNO, the mutation token (vbuuid, seqno) as extras.
Writes go through the bucket's normal front end (``Bucket.set`` / ``store`` / ``delete`` / ``append`` /
``arithmetic`` / ``touch``), so they reach the checkpoint, DCP and Kafka exactly as HTTP writes do. A
durability frame makes a write a sync write, answered once committed (or SYNC_WRITE_AMBIGUOUS).
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import Final, Protocol

from engine.bucket import Bucket
from engine.cluster.manager import branch_end
from engine.exceptions import KeyNotFound, NotMyVBucket, SyncWriteReCommitInProgress, ValueTooLarge
from engine.kv.durability import Durability, SyncWrite
from engine.kv.item import Datatype
from engine.kv.item import Op as ItemOp
from engine.kv.locks import LOCKED_CAS, locked
from engine.kv.vbucket import MAX_KEY_LEN, GetResult, MutationResult, StoreMode, VBucketState, vbucket_of
from engine.network.kv.cluster_config import ClusterConfigProvider
from engine.network.kv.opcodes import MAX_VALUE
from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.session import Session
from engine.network.protocol import (
    GET_EXTRAS,
    HEADER,
    OBSERVE0,
    OBSERVE1,
    RES_MAGIC,
    SET_EXTRAS,
    TOKEN_EXTRAS,
    U32,
    U64,
    Frame,
    ProtocolError,
    decode_framing,
    response,
)

ARITH_EXTRAS: Final = struct.Struct(">QQI")  # delta, initial, expiration
META_EXTRAS: Final = struct.Struct(">IIIQ")  # deleted, flags, expiry, rev seqno
_STORE_MODES: Final[dict[int, StoreMode]] = {Op.SET: StoreMode.SET, Op.ADD: StoreMode.ADD,
                                             Op.REPLACE: StoreMode.REPLACE}
#: opcodes that take a durability frame (kv_engine: the mutations)
DURABLE: Final = frozenset({Op.SET, Op.ADD, Op.REPLACE, Op.DELETE, Op.APPEND, Op.PREPEND, Op.INCREMENT,
                            Op.DECREMENT})


class WriteHooks(Protocol):
    """What the embedder does around writes (the gateway: backpressure, publishing, sync-write progress)."""

    def admit_write(self) -> None:
        """Raise TemporaryFailure when writes must wait (the gateway's backpressure)."""
        ...

    def wrote(self, res: MutationResult, nbytes: int) -> None:
        """A write the engine accepted (the gateway counts it until Kafka acknowledges, and wakes its pump)."""
        ...

    def completed(self, bucket: Bucket, sw: SyncWrite) -> Awaitable[MutationResult]:
        """Wait, without blocking the loop, until the sync write commits; SYNC_WRITE_AMBIGUOUS otherwise."""
        ...


def _need(f: Frame, extras: int | tuple[int, ...], *, key: bool = True, value: bool | None = None) -> None:
    sizes = (extras,) if isinstance(extras, int) else extras
    if len(f.extras) not in sizes:
        raise ProtocolError(f"opcode 0x{f.opcode:02x}: extras of {len(f.extras)} bytes, expected {sizes}")
    if key and not f.key:
        raise ProtocolError(f"opcode 0x{f.opcode:02x} needs a key")
    if not key and f.key:
        raise ProtocolError(f"opcode 0x{f.opcode:02x} takes no key")
    if value is False and f.value:
        raise ProtocolError(f"opcode 0x{f.opcode:02x} takes no value")


class DocumentOps:
    """The document opcodes, for one node's front end."""

    def __init__(self, provider: ClusterConfigProvider, hooks: WriteHooks) -> None:
        self.provider = provider
        self.hooks = hooks
        self._handlers: dict[int, Callable[[Session, Frame], Awaitable[bytes]]] = {
            Op.GET: self._get, Op.GET_REPLICA: self._get_replica, Op.GAT: self._gat,
            Op.GET_LOCKED: self._get_locked, Op.UNLOCK_KEY: self._unlock, Op.TOUCH: self._touch,
            Op.SET: self._store, Op.ADD: self._store, Op.REPLACE: self._store, Op.DELETE: self._delete,
            Op.APPEND: self._append, Op.PREPEND: self._append, Op.INCREMENT: self._arith,
            Op.DECREMENT: self._arith, Op.OBSERVE_SEQNO: self._observe, Op.GET_META: self._get_meta,
        }

    def handles(self, opcode: int) -> bool:
        return opcode in self._handlers

    def handler(self, opcode: int) -> Callable[[Session, Frame], Awaitable[bytes]] | None:
        return self._handlers.get(opcode)

    def register(self, opcode: int, handler: Callable[[Session, Frame], Awaitable[bytes]]) -> None:
        """Add an opcode (GET_META / *_WITH_META: engine/network/kv/access.py has their roles)."""
        self._handlers[opcode] = handler

    async def execute(self, s: Session, f: Frame) -> bytes:
        if f.framing and f.opcode not in DURABLE:
            raise ProtocolError(f"opcode 0x{f.opcode:02x} takes no framing extras")
        return await self._handlers[f.opcode](s, f)

    # ------------------------------------------------------------------ answers
    def _dt(self, s: Session, datatype: int) -> int:
        return datatype & Datatype.JSON if s.json else 0

    def _doc(self, s: Session, f: Frame, g: GetResult, cas: int | None = None) -> bytes:
        return response(f.opcode, extras=GET_EXTRAS.pack(g.flags), value=g.value, datatype=self._dt(s, g.datatype),
                        opaque=f.opaque, cas=g.cas if cas is None else cas)

    def _mutation(self, s: Session, f: Frame, r: MutationResult, value: bytes = b"") -> bytes:
        # a success answer, packed directly (the hot path of every write)
        if s.mutation_seqno:
            body = TOKEN_EXTRAS.pack(r.vbuuid, r.seqno) + value
            return HEADER.pack(RES_MAGIC, f.opcode, 0, 16, 0, 0, len(body), f.opaque, r.cas) + body
        return HEADER.pack(RES_MAGIC, f.opcode, 0, 0, 0, 0, len(value), f.opaque, r.cas) + value

    async def _settle(self, bucket: Bucket, r: MutationResult | SyncWrite, nbytes: int) -> MutationResult:
        if isinstance(r, SyncWrite):
            r = await self.hooks.completed(bucket, r)
        self.hooks.wrote(r, nbytes)
        return r

    def _durability(self, s: Session, f: Frame) -> Durability | None:
        if not f.framing:
            return None
        if not s.alt_requests:
            raise ProtocolError("framing extras without HELLO ALT_REQUEST_SUPPORT")
        return decode_framing(f.framing)

    def _value(self, s: Session, f: Frame) -> bytes:
        if len(f.value) > MAX_VALUE:
            raise ValueTooLarge(f"value of {len(f.value)} bytes exceeds the maximum of {MAX_VALUE}")
        if f.datatype & ~Datatype.JSON or (f.datatype and not s.json):
            raise ProtocolError(f"datatype 0x{f.datatype:02x} not negotiated")
        return f.value

    # ------------------------------------------------------------------ reads
    def _readable(self, b: Bucket, f: Frame) -> None:
        """SYNC_WRITE_RE_COMMIT_IN_PROGRESS for a key whose prepare has no waiter (loaded at warmup or kept
        across a failover, being re-committed): its value is not known until then (kv_engine)."""
        vb = b.vbucket(f.vbucket)
        if vb.prepares:
            p = vb.prepares.get(f.key)
            m = vb.durability
            if p is not None and vb.state is VBucketState.ACTIVE and (m is None or p.seqno not in m.waiters):
                raise SyncWriteReCommitInProgress(f"key {f.key!r}: a prepare is being re-committed")

    async def _get(self, s: Session, f: Frame) -> bytes:
        _need(f, 0, value=False)
        b = self.provider.bucket_for(f.vbucket)
        vb = b.vbucket(f.vbucket)
        if vb.prepares:
            self._readable(b, f)
        g = b.get(f.key, vbucket=f.vbucket)
        # the hot path of every read: the answer packed directly
        cas = LOCKED_CAS if vb.locks and locked(vb, f.key) else g.cas
        body = GET_EXTRAS.pack(g.flags) + g.value
        return HEADER.pack(RES_MAGIC, f.opcode, 0, 4, g.datatype & Datatype.JSON if s.json else 0, 0, len(body),
                           f.opaque, cas) + body

    async def _get_replica(self, s: Session, f: Frame) -> bytes:
        _need(f, 0, value=False)
        raise NotMyVBucket(f"vbucket {f.vbucket}: no replica on this node")

    async def _gat(self, s: Session, f: Frame) -> bytes:
        _need(f, 4, value=False)
        (expiry,) = U32.unpack(f.extras)
        self.hooks.admit_write()
        b = self.provider.bucket_for(f.vbucket)
        g = b.get_and_touch(f.key, expiry, vbucket=f.vbucket)
        self.hooks.wrote(MutationResult(g.vbucket, 0, g.seqno, g.cas), len(f.key) + len(g.value))
        return self._doc(s, f, g)

    async def _get_locked(self, s: Session, f: Frame) -> bytes:
        _need(f, (0, 4), value=False)
        lock_s = U32.unpack(f.extras)[0] if f.extras else 0
        b = self.provider.bucket_for(f.vbucket)
        return self._doc(s, f, b.get_locked(f.key, lock_s, vbucket=f.vbucket))

    async def _unlock(self, s: Session, f: Frame) -> bytes:
        _need(f, 0, value=False)
        self.provider.bucket_for(f.vbucket).unlock(f.key, f.cas, vbucket=f.vbucket)
        return response(f.opcode, opaque=f.opaque)

    async def _get_meta(self, s: Session, f: Frame) -> bytes:
        # kv_engine GET_META (the SDKs' ``exists``): deleted u32, flags u32, expiry u32, rev seqno u64 [,
        # datatype u8 when the request's 1-byte extras ask for version 2]; a tombstone answers deleted = 1
        _need(f, (0, 1), value=False)
        b = self.provider.bucket_for(f.vbucket)
        vb = b.vbucket(f.vbucket)
        vb.check_active()
        if b.vbucket_of(f.key) != f.vbucket:
            raise NotMyVBucket(f"key {f.key!r} does not map to vbucket {f.vbucket}")
        it = vb.ht.get(f.key)
        if it is None:
            raise KeyNotFound(f"key {f.key!r} not found in vbucket {f.vbucket}")
        deleted = it.op is not ItemOp.MUTATION or bool(it.expiry and it.expiry <= b.clock())
        extras = META_EXTRAS.pack(1 if deleted else 0, it.flags, it.expiry, it.rev_seqno)
        if f.extras == b"\x02":
            extras += bytes([self._dt(s, it.datatype)])
        return response(f.opcode, extras=extras, opaque=f.opaque, cas=it.cas)

    async def _observe(self, s: Session, f: Frame) -> bytes:
        # kv_engine OBSERVE_SEQNO (engine/network/server.py ``_observe`` answers the same for node processes)
        _need(f, 0, key=False)
        if len(f.value) != 8:
            raise ProtocolError("OBSERVE_SEQNO needs an 8-byte vbuuid body")
        (uuid,) = U64.unpack(f.value)
        v = self.provider.bucket_for(f.vbucket).vbucket(f.vbucket)
        if v.state is not VBucketState.ACTIVE:
            raise NotMyVBucket(f"vbucket {f.vbucket} is {v.state.value}")
        current, persisted = v.high_seqno, v.persisted_seqno
        entries = v.failover.entries
        latest = entries[0].vbuuid
        if uuid == latest:
            body = OBSERVE0.pack(0, f.vbucket, latest, persisted, current)
        else:
            body = OBSERVE1.pack(1, f.vbucket, latest, persisted, current, uuid, branch_end(entries, uuid, current))
        return response(f.opcode, value=body, opaque=f.opaque)

    # ------------------------------------------------------------------ writes
    async def _store(self, s: Session, f: Frame) -> bytes:
        _need(f, 8)
        flags, expiry = SET_EXTRAS.unpack(f.extras)
        value = self._value(s, f)
        durability = self._durability(s, f)
        self.hooks.admit_write()
        b = self.provider.bucket_for(f.vbucket)
        mode = _STORE_MODES[Op(f.opcode)]
        if f.cas and mode is StoreMode.ADD:
            raise ProtocolError("ADD with a CAS")
        dt = f.datatype or None
        if mode is StoreMode.SET and durability is None:
            if not f.cas and 0 < len(f.key) <= MAX_KEY_LEN and vbucket_of(f.key, b.num_vbuckets) == f.vbucket:
                # the ingest path of Bucket.set (it maps the key to the same vbucket)
                r: MutationResult | SyncWrite = b.set(f.key, value, flags=flags, expiry=expiry, datatype=dt)
            else:
                r = b.set(f.key, value, cas=f.cas, flags=flags, expiry=expiry, datatype=dt, vbucket=f.vbucket)
        else:
            r = b.store(f.key, value, mode, cas=f.cas, flags=flags, expiry=expiry, datatype=dt, vbucket=f.vbucket,
                        durability=durability)
        return self._mutation(s, f, await self._settle(b, r, len(f.key) + len(value)))

    async def _delete(self, s: Session, f: Frame) -> bytes:
        _need(f, 0, value=False)
        durability = self._durability(s, f)
        self.hooks.admit_write()
        b = self.provider.bucket_for(f.vbucket)
        if durability is not None:
            r: MutationResult | SyncWrite = b.delete(f.key, cas=f.cas, vbucket=f.vbucket, durability=durability)
        else:
            r = b.delete(f.key, cas=f.cas, vbucket=f.vbucket)
        return self._mutation(s, f, await self._settle(b, r, len(f.key)))

    async def _append(self, s: Session, f: Frame) -> bytes:
        _need(f, 0)
        value = self._value(s, f)
        durability = self._durability(s, f)
        self.hooks.admit_write()
        b = self.provider.bucket_for(f.vbucket)
        r = b.append(f.key, value, prepend=f.opcode == Op.PREPEND, cas=f.cas, vbucket=f.vbucket,
                     durability=durability)
        return self._mutation(s, f, await self._settle(b, r, len(f.key) + len(value)))

    async def _arith(self, s: Session, f: Frame) -> bytes:
        _need(f, ARITH_EXTRAS.size, value=False)
        delta, initial, expiry = ARITH_EXTRAS.unpack(f.extras)
        durability = self._durability(s, f)
        self.hooks.admit_write()
        b = self.provider.bucket_for(f.vbucket)
        r, n = b.arithmetic(f.key, delta, initial=initial, expiry=expiry, decrement=f.opcode == Op.DECREMENT,
                            cas=f.cas, vbucket=f.vbucket, durability=durability)
        return self._mutation(s, f, await self._settle(b, r, len(f.key) + 20), U64.pack(n))

    async def _touch(self, s: Session, f: Frame) -> bytes:
        _need(f, 4, value=False)
        (expiry,) = U32.unpack(f.extras)
        self.hooks.admit_write()
        b = self.provider.bucket_for(f.vbucket)
        r = b.touch(f.key, expiry, vbucket=f.vbucket)
        self.hooks.wrote(r, len(f.key))
        return response(f.opcode, opaque=f.opaque, cas=r.cas)

