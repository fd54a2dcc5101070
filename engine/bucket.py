"""The bucket: the engine's entry point (kv_engine ``EventuallyPersistentEngine`` + ``KVBucket``).

The front end (KV operations, sync writes, vbucket state changes, the replica side's calls) lives here; the
bucket owns the vbuckets, the storage and its background tasks, each a component of its own as in kv_engine:
warmup (engine/kv/warmup.py), the flusher (engine/kv/flusher.py), the expiry pager (engine/kv/pagers.py),
checkpoint memory recovery (engine/kv/memory_recovery.py), compaction (engine/kv/compaction.py) and the DCP
connections (engine/dcp/conn_map.py). Synchronous and single-threaded: whoever embeds it (the gateway's event
loop, a test) calls :meth:`Bucket.flush`, :meth:`Bucket.run_expiry_pager` and :meth:`Bucket.compact` when it
wants them to run.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Self, overload
from zlib import crc32

from engine.config import BucketConfig
from engine.dcp.conn_map import DcpConnMap
from engine.dcp.producer import DcpProducer
from engine.dcp.stream import SnapshotMarker, StreamEndReason
from engine.exceptions import (
    DeltaBadValue,
    EngineClosed,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    NotMyVBucket,
    NotStored,
    StateCasMismatch,
    TemporaryFailure,
)
from engine.kv.checkpoint import MemoryCounter
from engine.kv.compaction import Compactor
from engine.kv.conflict_resolution import (
    MODE_META_KEY,
    ConflictCounters,
    ConflictResolutionMismatch,
    ConflictResolutionMode,
    ItemMeta,
)
from engine.kv.durability import Durability, SyncWrite, monitor, replica_ack_seqno
from engine.kv.flusher import Flusher
from engine.kv.item import Datatype, Item, Op
from engine.kv.locks import check_lock, get_locked, locked, unlock
from engine.kv.memory_recovery import CheckpointMemRecovery
from engine.kv.pagers import ExpiryPager
from engine.kv.storage import Storage, VBucketRecord, item_from_row, vbucket_record
from engine.kv.vbucket import (
    MAX_KEY_LEN,
    GetResult,
    MutationResult,
    StoreMode,
    VBucket,
    VBucketInfo,
    VBucketState,
    hlc_source,
    vbucket_of,
)
from engine.kv.warmup import CLEAN_SHUTDOWN, Warmup
from engine.kv.with_meta import WithMetaOp, apply_with_meta, get_meta
from schemas.failover_log import FailoverEntry

_SET = StoreMode.SET

#: cyclic-GC thresholds for a process that holds millions of long-lived, acyclic items (see tune_gc)
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Make CPython's cyclic GC cheap for an engine process.

    Items, hash tables and checkpoints are millions of long-lived acyclic objects: refcounting frees them, but
    with the default thresholds (700, 10, 10) the cyclic collector rescans them over and over, which halves
    ingest throughput (measured in bench/engine.py). Raising the young-generation threshold and freezing what
    exists after warmup keeps collections rare and short. Process-wide: on by default
    (``BucketConfig.tune_gc``), off for embedders that manage GC themselves.
    """
    if gc.get_threshold()[0] < GC_THRESHOLDS[0]:
        gc.set_threshold(*GC_THRESHOLDS)


def _key(key: bytes | str) -> bytes:
    if type(key) is str:
        key = key.encode()
    elif type(key) is not bytes:
        if isinstance(key, bytes | bytearray | memoryview):
            key = bytes(key)
        else:
            raise InvalidArgument(f"key must be bytes or str, not {type(key).__name__}")
    n = len(key)
    if n == 0 or n > MAX_KEY_LEN:
        raise InvalidArgument(f"key length {n} out of range 1..{MAX_KEY_LEN}")
    return key


def _value(value: bytes | str) -> bytes:
    if type(value) is bytes:
        return value
    if type(value) is str:
        return value.encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise InvalidArgument(f"value must be bytes or str, not {type(value).__name__}")


class Bucket:
    """An embedded DCP engine bucket backed by SQLite."""

    def __init__(
        self, config: BucketConfig, *, clock: Callable[[], float] = time.time,
        hlc_clock: Callable[[], int] | None = None, state_cas_rng: random.Random | None = None,
    ) -> None:
        # The edge where the real clocks and RNGs are chosen (docs/engine.md "Clocks and randomness"):
        # ``clock`` (seconds) drives expiry, durability timeouts and -- through ``hlc_clock`` (ns, default
        # derived from ``clock``) -- the CAS values; ``config.seed`` seeds the vbuuids; ``state_cas_rng`` draws
        # the partition-state CASes (system randomness by default, see _new_state_cas).
        self.config = config
        self.clock = clock
        self.hlc_clock = hlc_clock if hlc_clock is not None else hlc_source(clock)
        self._state_cas_rng = state_cas_rng if state_cas_rng is not None else random.SystemRandom()
        self.closed = False
        self._rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self.counter = MemoryCounter()
        self.replica_rollbacks = 0
        self.replica_rebuilds = 0
        #: vbucket state records saved (a state, failover log or rollback changed): part of
        #: :attr:`persistence_revision`
        self._state_saves = 0
        data_dir = Path(config.data_dir)
        self.storage = Storage(data_dir / f"{config.name}.sqlite3", synchronous=config.sqlite_synchronous)
        #: XDCR target conflict resolution (docs/xdcr.md "Target side"): the mode is fixed at creation
        self.conflict_resolution = self._fixed_mode(config)
        self.conflict_counters = ConflictCounters()
        self._vbs: list[VBucket] = []
        self._nvb = config.num_vbuckets
        self._quota = config.checkpoint_quota_bytes
        #: the background tasks (kv_engine runs them on its executor pools; here the embedder calls them)
        self.flusher = Flusher(self.storage, self._vbs, config.flush_batch_items)
        self.expiry_pager = ExpiryPager(self._vbs, clock)
        self.memory_recovery = CheckpointMemRecovery(self._vbs, self.counter, config.checkpoint_quota_bytes)
        self.compactor = Compactor(
            self.storage, history_seqnos=config.history_seqnos,
            tombstone_purge_age_s=config.tombstone_purge_age_s, clock=clock)
        self.connections = DcpConnMap(self)
        self._dirty = self.flusher.dirty
        warmup = Warmup(
            self.storage, config, counter=self.counter, clock=clock, hlc_clock=self.hlc_clock, rng=self._rng,
            on_dirty=self._dirty.add, new_state_cas=self._new_state_cas)
        self.was_clean = warmup.was_clean
        self.first_open = warmup.first_open
        if config.tune_gc:
            tune_gc()
        self._vbs.extend(warmup.run())
        if config.tune_gc:
            gc.freeze()  # the warmed-up items are permanent residents: exclude them from cyclic GC scans
        # From now until a clean close, a crash counts as unclean.
        self.storage.set_meta(CLEAN_SHUTDOWN, "0")

    def _fixed_mode(self, config: BucketConfig) -> ConflictResolutionMode:
        # Recorded on creation; a data directory written before the mode existed adopts the configured one.
        stored = self.storage.get_meta(MODE_META_KEY)
        if stored is None:
            self.storage.set_meta(MODE_META_KEY, config.conflict_resolution)
        elif stored != config.conflict_resolution:
            self.storage.close()
            raise ConflictResolutionMismatch(config.name, stored, config.conflict_resolution)
        return ConflictResolutionMode(config.conflict_resolution)

    @property
    def producers(self) -> dict[str, DcpProducer]:
        """The open DCP producer connections by name (the connection map's)."""
        return self.connections.producers

    @property
    def items_flushed(self) -> int:
        return self.flusher.items_flushed

    @property
    def cursors_dropped(self) -> int:
        return self.memory_recovery.cursors_dropped

    def _new_state_cas(self) -> int:
        # System randomness even for seeded buckets: a restarted node must not hand out the CAS values of its
        # previous run (and the vbuuid sequence of a seeded bucket stays what it was).
        return self._state_cas_rng.getrandbits(48) or 1

    # ------------------------------------------------------------------ access
    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosed(f"bucket {self.config.name!r} is closed")

    @property
    def num_vbuckets(self) -> int:
        return self.config.num_vbuckets

    def vbucket_of(self, key: bytes | str) -> int:
        return vbucket_of(_key(key), self.config.num_vbuckets)

    def vbucket(self, vbid: int) -> VBucket:
        self._check_open()
        if type(vbid) is not int or not 0 <= vbid < self.config.num_vbuckets:
            raise NotMyVBucket(f"unknown vbucket {vbid!r} (bucket has {self.config.num_vbuckets})")
        return self._vbs[vbid]

    def vbuckets(self) -> Iterator[VBucket]:
        return iter(self._vbs)

    def _vb_for(self, key: bytes, vbucket: int | None) -> VBucket:
        if vbucket is None:
            return self._vbs[vbucket_of(key, self.config.num_vbuckets)]
        vb = self.vbucket(vbucket)
        if vbucket_of(key, self.config.num_vbuckets) != vbucket:
            raise NotMyVBucket(f"key {key!r} does not map to vbucket {vbucket}")
        return vb

    # ------------------------------------------------------------------ KV
    def get(self, key: bytes | str, *, vbucket: int | None = None) -> GetResult:
        self._check_open()
        k = _key(key)
        return self._vb_for(k, vbucket).get(k)

    def get_replica(self, key: bytes | str, *, vbucket: int | None = None) -> GetResult:
        """Read ``key`` from this node's replica of its vbucket (GET_REPLICA; NotMyVBucket unless a replica)."""
        self._check_open()
        k = _key(key)
        return self._vb_for(k, vbucket).get_replica(k)

    def _store(
        self, key: bytes | str, value: bytes | str, mode: StoreMode, cas: int, flags: int, expiry: int,
        datatype: int | None, vbucket: int | None,
    ) -> MutationResult:
        if self.closed:
            self._check_open()
        if self.counter.used > self._quota:
            self.recover_memory()
            if self.counter.used > self._quota:
                raise TemporaryFailure("checkpoint memory quota exhausted: the flusher is behind")
        # Fast path for the common types; _key/_value validate and convert everything else.
        k = key if type(key) is bytes and 0 < len(key) <= MAX_KEY_LEN else _key(key)
        v = value if type(value) is bytes else _value(value)
        if cas and (type(cas) is not int or cas < 0):
            raise InvalidArgument(f"invalid cas {cas!r}")
        if vbucket is None:
            vb = self._vbs[((crc32(k) >> 16) & 0x7FFF) % self._nvb]
        else:
            vb = self._vb_for(k, vbucket)
        return vb.store(k, v, mode, cas, flags, expiry, datatype)

    @overload
    def set(
        self, key: bytes | str, value: bytes | str, *, cas: int = 0, flags: int = 0, expiry: int = 0,
        datatype: int | None = None, vbucket: int | None = None, durability: None = None,
    ) -> MutationResult: ...

    @overload
    def set(
        self, key: bytes | str, value: bytes | str, *, cas: int = 0, flags: int = 0, expiry: int = 0,
        datatype: int | None = None, vbucket: int | None = None, durability: Durability,
    ) -> SyncWrite: ...

    def set(
        self, key: bytes | str, value: bytes | str, *, cas: int = 0, flags: int = 0, expiry: int = 0,
        datatype: int | None = None, vbucket: int | None = None, durability: Durability | None = None,
    ) -> MutationResult | SyncWrite:
        """Upsert (with ``cas``: only if the document's CAS still matches).

        With ``durability`` (level above none) it is a sync write (docs/durability.md): the prepare is queued and the
        pending :class:`~engine.kv.durability.SyncWrite` handle returned (engine/kv/durability.py)."""
        if durability is not None:
            return self._sync_store(key, value, _SET, cas, flags, expiry, datatype, vbucket, durability)
        # The ingest hot path: _store's checks inlined for the common case (bytes key and value, no CAS,
        # no explicit vbucket, quota not exceeded); everything else takes the general path.
        if (
            vbucket is None
            and not cas
            and type(key) is bytes
            and type(value) is bytes
            and 0 < len(key) <= MAX_KEY_LEN
            and self.counter.used <= self._quota
            and not self.closed
        ):
            vb = self._vbs[((crc32(key) >> 16) & 0x7FFF) % self._nvb]
            return vb.store(key, value, _SET, 0, flags, expiry, datatype)
        return self._store(key, value, _SET, cas, flags, expiry, datatype, vbucket)

    def add(
        self, key: bytes | str, value: bytes | str, *, flags: int = 0, expiry: int = 0,
        datatype: int | None = None, vbucket: int | None = None,
    ) -> MutationResult:
        """Insert; KEY_EEXISTS if the document exists."""
        return self._store(key, value, StoreMode.ADD, 0, flags, expiry, datatype, vbucket)

    def replace(
        self, key: bytes | str, value: bytes | str, *, cas: int = 0, flags: int = 0, expiry: int = 0,
        datatype: int | None = None, vbucket: int | None = None,
    ) -> MutationResult:
        """Update an existing document; NOT_STORED if it does not exist."""
        return self._store(key, value, StoreMode.REPLACE, cas, flags, expiry, datatype, vbucket)

    @overload
    def delete(
        self, key: bytes | str, *, cas: int = 0, vbucket: int | None = None, durability: None = None,
    ) -> MutationResult: ...

    @overload
    def delete(
        self, key: bytes | str, *, cas: int = 0, vbucket: int | None = None, durability: Durability,
    ) -> SyncWrite: ...

    def delete(
        self, key: bytes | str, *, cas: int = 0, vbucket: int | None = None, durability: Durability | None = None,
    ) -> MutationResult | SyncWrite:
        """Delete (a tombstone); with ``durability`` a durable delete: its pending handle (docs/durability.md)."""
        self._check_open()
        k = _key(key)
        if type(cas) is not int or cas < 0:
            raise InvalidArgument(f"invalid cas {cas!r}")
        if durability is not None:
            return self._sync_store(k, None, None, cas, 0, 0, None, vbucket, durability)
        return self._vb_for(k, vbucket).delete(k, cas)

    # ------------------------------------------------------------------ XDCR target (docs/xdcr.md "Target side")
    def get_meta(self, key: bytes | str, *, vbucket: int | None = None) -> ItemMeta:
        """kv_engine GET_META: deleted flag, flags, expiry (a tombstone's delete time), rev seqno, CAS and datatype
        of the document or tombstone; KEY_ENOENT when the key has neither."""
        self._check_open()
        k = _key(key)
        return get_meta(self._vb_for(k, vbucket), k)

    def _with_meta(
        self, op: WithMetaOp, key: bytes | str, value: bytes | str | None, meta: ItemMeta, options: int,
        cas: int, vbucket: int | None,
    ) -> MutationResult:
        self._check_open()
        if not isinstance(meta, ItemMeta):
            raise InvalidArgument(f"meta must be an ItemMeta, not {type(meta).__name__}")
        if type(cas) is not int or cas < 0:
            raise InvalidArgument(f"invalid cas {cas!r}")
        k = _key(key)
        v = None if value is None else _value(value)
        vb = self._vb_for(k, vbucket)
        if self.counter.used > self._quota:
            self.recover_memory()
            if self.counter.used > self._quota:
                raise TemporaryFailure("checkpoint memory quota exhausted: the flusher is behind")
        return apply_with_meta(vb, k, v, meta, op=op, options=options, cas=cas, mode=self.conflict_resolution,
                               counters=self.conflict_counters, now=self.clock())

    def set_with_meta(
        self, key: bytes | str, value: bytes | str, meta: ItemMeta, options: int = 0, *, cas: int = 0,
        vbucket: int | None = None,
    ) -> MutationResult:
        """kv_engine SET_WITH_META: store with the source's metadata if it wins conflict resolution
        (engine/kv/with_meta.py); :class:`~engine.kv.conflict_resolution.ConflictRejected` (KEY_EEXISTS) if not."""
        return self._with_meta(WithMetaOp.SET, key, value, meta, options, cas, vbucket)

    def add_with_meta(
        self, key: bytes | str, value: bytes | str, meta: ItemMeta, options: int = 0, *, cas: int = 0,
        vbucket: int | None = None,
    ) -> MutationResult:
        """kv_engine ADD_WITH_META: as :meth:`set_with_meta`, KEY_EEXISTS if a live document exists."""
        return self._with_meta(WithMetaOp.ADD, key, value, meta, options, cas, vbucket)

    def del_with_meta(
        self, key: bytes | str, value: bytes | str | None, meta: ItemMeta, options: int = 0, *, cas: int = 0,
        vbucket: int | None = None,
    ) -> MutationResult:
        """kv_engine DEL_WITH_META: a tombstone with the source's metadata (``value``: a tombstone body, usually
        None); an expiration with IS_EXPIRATION."""
        return self._with_meta(WithMetaOp.DEL, key, value, meta, options, cas, vbucket)

    # ------------------------------------------------------------------ synchronous replication (docs/durability.md)
    def _sync_store(
        self, key: bytes | str, value: bytes | str | None, mode: StoreMode | None, cas: int, flags: int,
        expiry: int, datatype: int | None, vbucket: int | None, durability: Durability,
    ) -> MutationResult | SyncWrite:
        self._check_open()
        if not isinstance(durability, Durability):
            raise InvalidArgument(f"durability must be a Durability, not {type(durability).__name__}")
        k = _key(key)
        v = None if value is None else _value(value)
        if cas and (type(cas) is not int or cas < 0):
            raise InvalidArgument(f"invalid cas {cas!r}")
        vb = self._vb_for(k, vbucket)
        level = durability.level
        if not level:  # level none: a plain write (kv_engine ignores a none durability frame)
            if v is None:
                return vb.delete(k, cas)
            assert mode is not None
            return vb.store(k, v, mode, cas, flags, expiry, datatype)
        if self.counter.used > self._quota:
            self.recover_memory()
            if self.counter.used > self._quota:
                raise TemporaryFailure("checkpoint memory quota exhausted: the flusher is behind")
        c = self.config
        timeout = durability.effective_timeout_ms(c.durability_timeout_ms, c.durability_timeout_floor_ms)
        return monitor(vb).add_sync_write(k, v, mode, cas, flags, expiry, datatype, level, timeout)

    def set_replication_topology(
        self, vbucket: int, chain: list[str | None], second: list[str | None] | None = None,
    ) -> None:
        """The vbucket's replication chain (the active node first, then the replica slots, None = empty), sent
        by the cluster manager (kv_engine: ns_server's ``setVBucketState`` topology), and during a rebalance
        move the post-move ``second`` chain (a prepare then needs a majority of both). Prepares now satisfied
        commit. Without one a vbucket is a single node with no replicas (majority 1)."""
        vb = self.vbucket(vbucket)
        monitor(vb).set_topology(chain, second)

    def seqno_acknowledged(self, vbucket: int, node: str, seqno: int) -> int:
        """A replica's seqno-ack for an active vbucket (DCP_SEQNO_ACKNOWLEDGED); returns commits made.
        Ignored (0) when the vbucket is not active (kv_engine drops acks racing a state change)."""
        vb = self.vbucket(vbucket)
        if vb.state is not VBucketState.ACTIVE:
            return 0
        return monitor(vb).seqno_ack(node, seqno)

    def durability_ack_seqno(self, vbucket: int) -> int:
        """What this replica vbucket seqno-acks now (engine.kv.durability.replica_ack_seqno)."""
        return replica_ack_seqno(self._replica(vbucket))

    def durability_ack_seqnos(self, vbuckets: Iterable[int]) -> dict[int, int]:
        """:meth:`durability_ack_seqno` of each of ``vbuckets`` that is a replica (or pending) vbucket now, the
        others left out: one call for a replication connection's every stream (a node process answers it in
        one hop to its event loop instead of one per stream)."""
        self._check_open()
        n = self.config.num_vbuckets
        out: dict[int, int] = {}
        for i in vbuckets:
            if type(i) is int and 0 <= i < n:
                vb = self._vbs[i]
                if vb.state is VBucketState.REPLICA or vb.state is VBucketState.PENDING:
                    out[i] = replica_ack_seqno(vb)
        return out

    def process_durability_timeouts(self) -> int:
        """Abort every sync write whose timeout passed by the bucket's clock (kv_engine's durability timeout
        task); their waiters get SYNC_WRITE_AMBIGUOUS. Returns how many were aborted."""
        self._check_open()
        now = self.clock()
        n = 0
        for vb in self._vbs:
            m = vb.durability
            if m is not None and m.waiters:
                n += m.process_timeouts(now)
        return n

    def pending_sync_writes(self) -> int:
        """Prepares in flight over all vbuckets (active and replica)."""
        return sum(len(vb.prepares) for vb in self._vbs)

    def touch(self, key: bytes | str, expiry: int, *, vbucket: int | None = None) -> MutationResult:
        self._check_open()
        k = _key(key)
        return self._vb_for(k, vbucket).touch(k, expiry)

    # ------------------------------------------------------------------ the KV port's operations (docs/kv-protocol.md)
    def store(
        self, key: bytes | str, value: bytes | str, mode: StoreMode, *, cas: int = 0, flags: int = 0,
        expiry: int = 0, datatype: int | None = None, vbucket: int | None = None,
        durability: Durability | None = None,
    ) -> MutationResult | SyncWrite:
        """SET / ADD / REPLACE in one call, durable with ``durability`` (the KV port's front end)."""
        if durability is not None:
            return self._sync_store(key, value, mode, cas, flags, expiry, datatype, vbucket, durability)
        return self._store(key, value, mode, cas, flags, expiry, datatype, vbucket)

    def get_and_touch(self, key: bytes | str, expiry: int, *, vbucket: int | None = None) -> GetResult:
        """GAT: set the document's expiry (a mutation, as kv_engine's touch) and read it."""
        self._check_open()
        k = _key(key)
        vb = self._vb_for(k, vbucket)
        vb.touch(k, expiry)
        return vb.get(k)

    def get_locked(self, key: bytes | str, lock_s: int = 0, *, vbucket: int | None = None) -> GetResult:
        """GET_LOCKED: read and lock (engine/kv/locks.py); the result's CAS is the lock's."""
        self._check_open()
        k = _key(key)
        return get_locked(self._vb_for(k, vbucket), k, lock_s)

    def unlock(self, key: bytes | str, cas: int, *, vbucket: int | None = None) -> None:
        self._check_open()
        k = _key(key)
        unlock(self._vb_for(k, vbucket), k, cas)

    def is_locked(self, key: bytes | str, *, vbucket: int | None = None) -> bool:
        self._check_open()
        k = _key(key)
        return locked(self._vb_for(k, vbucket), k)

    def _modify(
        self, k: bytes, vb: VBucket, cas: int, new: Callable[[Item], bytes], datatype: int | None,
        durability: Durability | None, missing: Exception,
    ) -> MutationResult | SyncWrite:
        """Read-modify-write of a live document, atomically (the engine is single-threaded): ``new(item)`` is
        the new value; flags and expiry are kept; the write goes through :meth:`_store` / :meth:`_sync_store`
        like any other, so it reaches the checkpoint, DCP and Kafka the same way."""
        vb.check_active()
        live = vb._live(k, self.clock())
        if live is None:
            raise missing
        eff = check_lock(vb, k, cas)
        if eff and eff != live.cas:
            raise KeyExists(f"cas mismatch for key {k!r}")
        store_cas = cas if eff != cas else live.cas
        value = new(live)
        if durability is not None:
            return self._sync_store(k, value, _SET, store_cas, live.flags, live.expiry, datatype, vb.id, durability)
        return self._store(k, value, _SET, store_cas, live.flags, live.expiry, datatype, vb.id)

    def append(
        self, key: bytes | str, value: bytes | str, *, prepend: bool = False, cas: int = 0,
        vbucket: int | None = None, durability: Durability | None = None,
    ) -> MutationResult | SyncWrite:
        """APPEND / PREPEND: NOT_STORED when the document does not exist (memcached)."""
        self._check_open()
        k = _key(key)
        v = _value(value)
        vb = self._vb_for(k, vbucket)

        def joined(it: Item) -> bytes:
            old = it.value or b""
            return v + old if prepend else old + v

        return self._modify(k, vb, cas, joined, None, durability, NotStored(f"key {k!r} does not exist"))

    def arithmetic(
        self, key: bytes | str, delta: int, *, initial: int = 0, expiry: int = 0, decrement: bool = False,
        cas: int = 0, vbucket: int | None = None, durability: Durability | None = None,
    ) -> tuple[MutationResult | SyncWrite, int]:
        """INCREMENT / DECREMENT (kv_engine arithmetic): the value is an unsigned 64-bit decimal (else
        DELTA_BADVAL); increment wraps at 2^64, decrement stops at 0. A missing document is created with
        ``initial`` and ``expiry``, unless ``expiry`` is 0xffffffff (then KEY_ENOENT). Returns the write and
        the new value."""
        self._check_open()
        k = _key(key)
        if type(delta) is not int or not 0 <= delta < 1 << 64 or type(initial) is not int or not 0 <= initial < 1 << 64:
            raise InvalidArgument("delta and initial must be unsigned 64-bit integers")
        vb = self._vb_for(k, vbucket)
        vb.check_active()
        if vb._live(k, self.clock()) is None:
            if expiry == 0xFFFFFFFF:
                raise KeyNotFound(f"key {k!r} not found (counter without initial value)")
            if cas:
                raise KeyNotFound(f"key {k!r} not found (cas {cas})")
            body = str(initial).encode()
            if durability is not None:
                return self._sync_store(k, body, StoreMode.ADD, 0, 0, expiry, Datatype.JSON, vb.id,
                                        durability), initial
            return self._store(k, body, StoreMode.ADD, 0, 0, expiry, Datatype.JSON, vb.id), initial
        result = [0]

        def counted(it: Item) -> bytes:
            raw = it.value or b""
            if not raw.isdigit() or len(raw) > 20 or int(raw) >= 1 << 64:
                raise DeltaBadValue(f"key {k!r}: value is not an unsigned 64-bit decimal")
            n = int(raw)
            n = max(0, n - delta) if decrement else (n + delta) & 0xFFFF_FFFF_FFFF_FFFF
            result[0] = n
            return str(n).encode()

        res = self._modify(k, vb, cas, counted, Datatype.JSON, durability, KeyNotFound(f"key {k!r} not found"))
        return res, result[0]

    # ------------------------------------------------------------------ background tasks
    def flush(self, max_items: int | None = None) -> int:
        """Persist queued items from each dirty vbucket's persistence cursor (one transaction; the flusher,
        engine/kv/flusher.py).

        Returns the number of items persisted. On a storage error nothing is lost: cursors are restored.
        """
        self._check_open()
        return self.flusher.flush(max_items)

    def flush_all(self) -> int:
        """Flush until no vbucket is dirty (a background flush in flight lands first)."""
        self._check_open()
        return self.flusher.flush_all()

    def flush_round(self) -> int:
        """Persist everything queued now; the commits the flush makes possible (persist-level sync writes)
        wait for the next flush rather than take a transaction of their own (engine/kv/flusher.py). A pump loop's
        flush: what it leaves is queued, the vbuckets dirty."""
        self._check_open()
        return self.flusher.flush_round()

    def start_flush(self, max_items: int | None = None) -> int:
        """Start persisting up to ``max_items`` queued items in the background (docs/engine.md "Background
        flush"): the transaction runs on the storage's writer thread while this thread goes on. Returns how
        many items it holds (0: nothing dirty). The items count as persisted -- persisted seqnos, OBSERVE_SEQNO,
        rollback mitigation, persist durability levels -- only once it landed (:meth:`complete_flush`, or any
        later flush or storage access). A background flush still in flight lands first (waiting for it)."""
        self._check_open()
        return self.flusher.begin(max_items)

    def start_flush_writer(self) -> None:
        """Start the storage's writer process now, in the background (docs/engine.md "Background flush"): for a
        bucket about to flush in the background, whose first flush would otherwise wait for it to start."""
        self._check_open()
        self.storage.start_writer()

    def complete_flush(self, wait: bool = False) -> int:
        """Land the background flush if its transaction ended (or, with ``wait``, once it has): free what it
        persisted and check persist-level sync writes. Raises its :class:`~engine.exceptions.StorageError` if
        it failed -- its items stay queued and their vbuckets dirty, as after a failed :meth:`flush`. Returns
        the vbuckets whose persisted seqno moved."""
        self._check_open()
        return self.flusher.settle(wait)

    @property
    def flush_pending(self) -> bool:
        """A background flush is in flight, or landed and not completed (:meth:`complete_flush`)."""
        return self.flusher.pending

    @property
    def flush_done(self) -> bool:
        """No background flush is in flight, or its transaction ended: :meth:`complete_flush` would not wait."""
        return self.flusher.landed

    @property
    def flush_failures(self) -> int:
        """Flushes (inline or background) whose transaction failed since the bucket was opened."""
        return self.flusher.failures

    @property
    def flush_error(self) -> str | None:
        """The error of the last flush if it failed; None once a flush committed (docs/reliability.md "Full disk
        on a node")."""
        return self.flusher.error

    @property
    def dirty_vbuckets(self) -> int:
        return len(self._dirty)

    def recover_memory(self) -> int:
        """Checkpoint memory recovery: above 90 % of the quota, free down to 60 % (engine/kv/memory_recovery.py).

        First close open checkpoints and free the ones every cursor passed, then drop the DCP cursors
        holding the oldest checkpoints; their streams go back to backfilling. Returns cursors dropped.
        """
        return self.memory_recovery.run()

    def run_expiry_pager(self) -> int:
        """Turn every expired item into an expiration (engine/kv/pagers.py). Returns how many expired."""
        self._check_open()
        return self.expiry_pager.run()

    def compact(self, vbucket: int | None = None) -> None:
        """Purge history older than the history window and tombstones older than the purge age
        (engine/kv/compaction.py).

        The highest seqno of a vbucket is never purged (a disk snapshot always ends on a present item), and
        nothing a running backfill may still read is purged.
        """
        self._check_open()
        self.compactor.compact(self._vbs if vbucket is None else [self.vbucket(vbucket)])

    # ------------------------------------------------------------------ vbucket state
    def state_cas(self, vbucket: int) -> int:
        """The vbucket's partition-state CAS (docs/cluster.md "Partition-state CAS": the manager discovers it,
        then sends it with every state command)."""
        return self.vbucket(vbucket).state_cas

    def _check_state_cas(self, vb: VBucket, cas: int | None) -> None:
        # docs/cluster.md "Partition-state CAS", steps 5/6: a stale CAS is rejected with the current one.
        if cas is not None and cas != vb.state_cas:
            raise StateCasMismatch(vb.id, vb.state_cas, cas)

    def _save_state(self, vb: VBucket) -> None:
        self.storage.settle()  # a background flush lands first: the record then includes what it persisted
        self.storage.save_states([vbucket_record(vb)])
        self._state_saves += 1

    @property
    def persistence_revision(self) -> int:
        """Grows whenever what OBSERVE_SEQNO answers may have changed for some vbucket: items were flushed, or
        a vbucket's state, failover log (vbuuid) or persisted position changed (a node server caches its
        ``stats vbucket-persisted`` answer under it, whoever flushed: engine/network/server.py)."""
        return self.flusher.items_flushed + self._state_saves

    def set_vbucket_state(self, vbucket: int, state: VBucketState | str, *, cas: int | None = None) -> int:
        """Change a vbucket's state; returns the new partition-state CAS.

        Streams of a vbucket that stops being active end with STATE_CHANGED. With ``cas``, the command is
        rejected with :class:`StateCasMismatch` unless it matches the current state CAS (docs/cluster.md
        "Partition-state CAS"); every accepted change
        draws a new CAS. Replica/pending -> active is a promotion (:meth:`promote`, kv_engine adds a failover
        entry).
        """
        vb = self.vbucket(vbucket)
        new = VBucketState(state)
        self._check_state_cas(vb, cas)
        if new is vb.state:
            return vb.state_cas
        old = vb.state
        if new is VBucketState.ACTIVE and old in (VBucketState.REPLICA, VBucketState.PENDING):
            self.promote(vbucket)
            return vb.state_cas
        vb.state = new
        vb.state_cas = self._new_state_cas()
        if old is VBucketState.ACTIVE:
            vb.active_through = vb.high_seqno  # its own writes: consistent points for a later rollback
            vb.end_streams(StreamEndReason.STATE_CHANGED)
            if vb.durability is not None:
                vb.durability.state_changed()  # waiters: SYNC_WRITE_AMBIGUOUS (docs/durability.md)
        if not vb.replica_snaps:
            # No partial snapshot (an active's history is complete at every seqno it wrote).
            vb.snapshot_complete = vb.high_seqno
            vb.snapshot_persisted = vb.persisted_seqno
        self._save_state(vb)
        return vb.state_cas

    def promote(self, vbucket: int, *, takeover: bool = False, cas: int | None = None) -> FailoverEntry | None:
        """Make a replica (or pending) vbucket active; returns the failover entry created (None on takeover).

        kv_engine ``setVBucketState(active)`` of a replica: the failover table gets ``createEntry`` at the last
        complete snapshot's end (kv_engine ``FailoverTable::createEntry``; docs/rollback.md "The failover log"); items of a partial snapshot above it are
        an inconsistent state and are rolled back first. A takeover (``takeover=True``: rebalance or graceful
        failover, the replica holds exactly the old active's history) adds no entry.
        """
        vb = self.vbucket(vbucket)
        self._check_state_cas(vb, cas)
        if vb.state is not VBucketState.REPLICA and vb.state is not VBucketState.PENDING:
            raise NotMyVBucket(f"vbucket {vbucket} is {vb.state.value}: only a replica can be promoted")
        if vb.high_seqno > vb.snapshot_complete:
            self.rollback_vbucket(vbucket, vb.snapshot_complete)
        vb.end_streams(StreamEndReason.STATE_CHANGED)  # replica-reading streams: the vbucket changes role
        vb.replica_snaps.clear()
        vb.ckpt.create_checkpoint()
        entry = None if takeover else vb.failover.create_entry(vb.high_seqno)
        # sync replication (docs/durability.md "Storage, warmup, rollback, failover"): the prepares this copy holds are now the active's, with an infinite timeout; until the
        # manager sends the new topology nothing commits and new sync writes are impossible (kv_engine: an ADM
        # without a chain)
        m = monitor(vb)
        m.state_changed()
        m.chain = ()
        m.second_chain = None
        vb.state = VBucketState.ACTIVE
        vb.state_cas = self._new_state_cas()
        self._save_state(vb)
        return entry

    # ------------------------------------------------------------------ replica side (engine/dcp/replication.py)
    def _replica(self, vbucket: int) -> VBucket:
        vb = self.vbucket(vbucket)
        vb.check_replica()
        return vb

    def replica_position(self, vbucket: int) -> tuple[int, int, int]:
        """``(start, snap_start, snap_end)`` a replica vbucket streams from (docs/cluster.md "Replication")."""
        return self._replica(vbucket).replica_position()

    def apply_replica_message(self, message: SnapshotMarker | Item) -> None:
        """Apply one DCP message from the active to a replica vbucket (kv_engine ``PassiveStream``).

        Prepares, commits (a mutation / deletion with ``prepared``) and aborts are applied too (docs/durability.md,
        engine/kv/durability.py).

        A snapshot marker opens the replica's snapshot range; a mutation / deletion / expiration is stored
        with the producer's seqno, rev seqno, CAS, flags and expiry (set-with-meta; no seqno or CAS is
        generated here) and queued in the replica's checkpoint, so the normal flusher persists it in seqno
        order. :class:`NotMyVBucket` for an unknown or non-replica vbucket, :class:`InvalidArgument` for a
        message outside the open snapshot.
        """
        self._check_open()
        if type(message) is SnapshotMarker:
            self._replica(message.vbucket).replica_marker(message.start, message.end)
        elif type(message) is Item:
            self._replica(message.vbucket).replica_apply(message)
        else:
            raise InvalidArgument(f"not a DCP data message: {message!r}")

    def replace_failover_log(self, vbucket: int, entries: list[FailoverEntry]) -> None:
        """A replica adopts the producer's whole failover log on stream-request OK and persists it
        (kv_engine ``replaceFailoverLog``)."""
        vb = self._replica(vbucket)
        vb.failover.replace(entries)
        self._save_state(vb)

    def rollback_vbucket(self, vbucket: int, seqno: int) -> int:
        """Roll a replica vbucket back to its newest complete-snapshot boundary <= ``seqno``; returns the
        seqno reached.

        kv_engine's DCP client rule (docs/cluster.md "Replication"): on ROLLBACK(s) discard what is above s back to a snapshot boundary
        <= s and prune failover entries above it. Storage restores the exact state at that boundary from its
        history of prior versions; when that history was purged the vbucket is rebuilt from zero (returns 0;
        counted in ``replica_rebuilds``). The hash table and checkpoints are reloaded from storage; streams
        reading the vbucket end with ROLLBACK. kv_engine rolls back replica (and pending) vbuckets only.

        A copy that was active until it became dead / replica (``active_through``, e.g. a failed-over node's
        copy rejoining by a delta recovery, docs/cluster.md "Delta recovery") has a consistent state at every
        seqno it wrote as an active (no de-duplicated snapshot there): a ``seqno`` between its newest
        complete-snapshot end below ``active_through`` and ``active_through`` is itself the boundary.
        """
        self._check_open()
        vb = self._replica(vbucket)
        if type(seqno) is not int or seqno < 0:
            raise InvalidArgument(f"invalid rollback seqno {seqno!r}")
        vb.end_streams(StreamEndReason.ROLLBACK)
        self.flush_all()  # everything received reaches disk first; storage then cuts it back exactly
        target = min(self.storage.snapshot_boundary(vbucket, seqno), vb.high_seqno)
        through = vb.active_through
        if through is not None and self.storage.snapshot_boundary(vbucket, through) <= seqno <= through:
            target = min(seqno, vb.high_seqno)
        vb.failover.prune_above(target)
        record = VBucketRecord(
            vb.id, vb.state.value, vb.failover.to_pairs(), target, target, target, vb.purge_seqno, vb.max_cas,
            vb.history_start, vb.max_deleted_rev)
        if target == 0 or not self.storage.rollback(vbucket, target, record):
            if target != 0:
                self.replica_rebuilds += 1
            target = 0
            vb.failover.prune_above(0)
            vb.purge_seqno = vb.history_start = 0
            record = VBucketRecord(vb.id, vb.state.value, vb.failover.to_pairs(), max_deleted_rev=vb.max_deleted_rev)
            self.storage.reset_vbucket(vbucket, record)
        vb.reset(target, map(item_from_row, self.storage.current(vbucket)))
        if through is not None:
            vb.active_through = min(through, target) or None
        self._dirty.discard(vbucket)
        vb.dirty = False
        self.replica_rollbacks += 1
        self._save_state(vb)
        return target

    def failover_log(self, vbucket: int) -> list[FailoverEntry]:
        return list(self.vbucket(vbucket).failover.entries)

    # ------------------------------------------------------------------ DCP
    def dcp_producer(self, name: str, *, buffer_size: int = 0) -> DcpProducer:
        """Open a named DCP producer connection; an existing connection of that name is closed first."""
        self._check_open()
        return self.connections.new_producer(name, buffer_size=buffer_size)

    def close_producer(self, name: str) -> None:
        self.connections.close(name)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int | str]:
        return {
            "bucket": self.config.name,
            "vbuckets": self.config.num_vbuckets,
            "items": sum(vb.num_items for vb in self._vbs),
            "checkpoint_memory": self.counter.used,
            "checkpoint_quota": self.config.checkpoint_quota_bytes,
            "dirty_vbuckets": len(self._dirty),
            "items_flushed": self.items_flushed,
            "flush_failures": self.flush_failures,
            "flush_error": self.flush_error or "",
            # the background flush's writer process (docs/engine.md "Background flush"): 0 when none runs
            "storage_writer_pid": self.storage.writer_pid or 0,
            "storage_writer_starts": self.storage.writer_starts,
            "cursors_dropped": self.cursors_dropped,
            "producers": len(self.producers),
            "replica_rollbacks": self.replica_rollbacks,
            "replica_rebuilds": self.replica_rebuilds,
            "clean_start": int(self.was_clean),
            "conflict_resolution": self.conflict_resolution.value,
            **self.conflict_counters.as_dict(),
        }

    def vbucket_info(self, vbucket: int) -> VBucketInfo:
        """State, state CAS, seqnos, snapshot bookkeeping and failover log of one vbucket (what a cluster
        manager reads; kv_engine ``stats vbucket-details``)."""
        return self.vbucket(vbucket).info()

    def vbucket_stats(self, vbucket: int) -> dict[str, int | str]:
        return self.vbucket(vbucket).stats()

    def state_snapshot(self) -> dict[bytes, tuple[bytes, int]]:
        """Every live document as ``key -> (value, vbucket)``: what a consumer must converge to."""
        now = self.clock()
        out: dict[bytes, tuple[bytes, int]] = {}
        for vb in self._vbs:
            if vb.state is not VBucketState.ACTIVE:
                continue
            for k, it in vb.ht.items():
                if it.op is Op.MUTATION and not (it.expiry and it.expiry <= now) and it.value is not None:
                    out[k] = (it.value, vb.id)
        return out

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, clean: bool = True) -> None:
        """Close the bucket. A clean close flushes everything and writes the clean-shutdown marker."""
        if self.closed:
            return
        self.connections.close_all()
        if clean:
            self.flush_all()
            self.storage.save_states([vbucket_record(vb) for vb in self._vbs])
            self.storage.set_meta(CLEAN_SHUTDOWN, "1")
        self.storage.close()
        self.closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_bucket(data_dir: Path | str, **overrides: Any) -> Bucket:
    """Convenience: open (or create) a bucket in ``data_dir`` with config overrides."""
    return Bucket(BucketConfig(data_dir=Path(data_dir), **overrides))


__all__ = ["Bucket", "BucketConfig", "Item", "open_bucket"]
