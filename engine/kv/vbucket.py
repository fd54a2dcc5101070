"""A vbucket: hash table with CAS and revision seqnos, checkpoint manager, failover log, seqno counters.

Key -> vbucket mapping is the one every Couchbase client uses (libcouchbase ``vbucket.c``): CRC32 of the
key, ``(crc >> 16) & 0x7fff``, modulo the number of vbuckets.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Final, NamedTuple

from engine.exceptions import (
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    NotMyVBucket,
    NotStored,
    ValueTooLarge,
)
from engine.kv.checkpoint import CheckpointManager, MemoryCounter
from engine.kv.item import Datatype, Item, Op, detect_datatype
from engine.kv.locks import check_lock, release
from engine.kv.stored_value import HashTable, unpack
from schemas.failover_log import FailoverLog

if TYPE_CHECKING:
    from engine.dcp.stream import ActiveStream
    from engine.kv.durability import ActiveDurabilityMonitor

#: memcached: an expiry up to 30 days is relative to now, larger values are an absolute epoch time.
RELATIVE_EXPIRY_LIMIT: Final = 30 * 24 * 3600
MAX_KEY_LEN: Final = 250
U32: Final = 0xFFFFFFFF


def vbucket_of(key: bytes, num_vbuckets: int) -> int:
    """Couchbase's key -> vbucket mapping: ``((crc32(key) >> 16) & 0x7fff) % num_vbuckets``."""
    return ((zlib.crc32(key) >> 16) & 0x7FFF) % num_vbuckets


class VBucketState(StrEnum):
    """vbucket states (DCP set-vbucket-state: 1 active, 2 replica, 3 pending, 4 dead)."""

    ACTIVE = "active"
    REPLICA = "replica"
    PENDING = "pending"
    DEAD = "dead"


class StoreMode(Enum):
    SET = "set"
    ADD = "add"
    REPLACE = "replace"


_ADD: Final = StoreMode.ADD
_REPLACE: Final = StoreMode.REPLACE
_MUTATION: Final = Op.MUTATION
_ACTIVE: Final = VBucketState.ACTIVE
_new_tuple: Final = tuple.__new__


class MutationToken(NamedTuple):
    """(vbucket, vbuuid, seqno): where a change sits in its vbucket's history."""

    vbucket: int
    vbuuid: int
    seqno: int


class MutationResult(NamedTuple):
    """What every accepted mutation returns: where it sits (vbucket, vbuuid, seqno) and the new CAS.

    One flat tuple (cheaper to build on the ingest path than two objects); ``token`` gives the mutation token.
    """

    vbucket: int
    vbuuid: int
    seqno: int
    cas: int

    @property
    def token(self) -> MutationToken:
        return MutationToken(self.vbucket, self.vbuuid, self.seqno)


@dataclass(frozen=True, slots=True)
class GetResult:
    key: bytes
    value: bytes
    cas: int
    flags: int
    expiry: int
    datatype: int
    rev_seqno: int
    seqno: int
    vbucket: int


@dataclass(frozen=True, slots=True)
class VBucketInfo:
    """What a cluster manager reads of one vbucket copy (kv_engine ``stats vbucket-details``): its state and
    partition-state CAS, seqnos, the last complete snapshot received / persisted (replicas) and the failover
    log, newest first."""

    vbucket: int
    state: VBucketState
    state_cas: int
    high_seqno: int
    persisted_seqno: int
    snapshot_complete: int
    snapshot_persisted: int
    failover: tuple[tuple[int, int], ...]

    @property
    def vbuuid(self) -> int:
        return self.failover[0][0]


def absolute_expiry(expiry: int, now: float) -> int:
    """memcached expiry rule: 0 = never, <= 30 days = relative seconds, else absolute epoch seconds."""
    if type(expiry) is not int or expiry < 0 or expiry > U32:
        raise InvalidArgument(f"invalid expiry {expiry!r}: must be an integer in [0, 2^32)")
    if expiry == 0:
        return 0
    if expiry <= RELATIVE_EXPIRY_LIMIT:
        return int(now) + expiry
    return expiry


def hlc_source(clock: Callable[[], float]) -> Callable[[], int]:
    """The hybrid logical clock's time source (ns) for a bucket whose clock is ``clock`` (seconds): the wall
    clock's own nanoseconds for :func:`time.time`, else ``clock`` scaled -- a fake clock (``ManualClock``)
    then drives the CAS values as it drives expiry and durability timeouts (docs/engine.md "Clocks and
    randomness")."""
    if clock is time.time:
        return time.time_ns
    return lambda: int(clock() * 1_000_000_000)


class VBucket:
    """One vbucket. Driven synchronously by its bucket."""

    def __init__(
        self,
        vbid: int,
        state: VBucketState,
        failover: FailoverLog,
        counter: MemoryCounter,
        clock: Callable[[], float],
        *,
        hlc_clock: Callable[[], int],
        high_seqno: int = 0,
        max_value_size: int = 20 * 1024 * 1024,
        checkpoint_max_items: int = 10_000,
        checkpoint_max_bytes: int = 10 * 1024 * 1024,
        on_dirty: Callable[[int], None] | None = None,
    ) -> None:
        self.id = vbid
        self.state = state
        self.failover = failover
        self.clock = clock
        #: the hybrid logical clock's time source in ns (kv_engine ``HLC`` reads a clock source); the bucket
        #: derives it from its injected clock (:func:`hlc_source`), see docs/engine.md "Clocks and randomness"
        self.hlc_clock = hlc_clock
        #: key -> current version: an Item while a checkpoint queues it, then its packed stored value
        #: (engine/kv/stored_value.py, docs/engine.md "Item layout and memory")
        self.ht = HashTable(vbid)
        self.high_seqno = high_seqno
        self.persisted_seqno = high_seqno
        self.persisted_snap = (high_seqno, high_seqno)
        self.purge_seqno = 0
        self.history_start = 0
        self.max_cas = 0
        self.num_items = 0
        self.max_deleted_rev = 0
        self.max_value_size = max_value_size
        self.ckpt = CheckpointManager(
            vbid, high_seqno, counter, max_items=checkpoint_max_items, max_bytes=checkpoint_max_bytes
        )
        self.ckpt.table = self.ht
        self.streams: list[ActiveStream] = []
        self.expiring: set[bytes] = set()
        self._on_dirty = on_dirty
        self.dirty = False  # has items the flusher has not read; set here, cleared by the flusher
        self.expirations = 0
        # Replica side (engine/dcp/replication.py). Snapshot markers received and not yet wholly persisted, as
        # [base, start, end]: the marker's items are those with seqno > base (base = high seqno when it arrived).
        self.replica_snaps: deque[list[int]] = deque()
        #: end of the last complete snapshot received / received and persisted (docs/cluster.md "Observe by
        #: seqno": a replica holds a write once a complete snapshot ending at or above its seqno arrived)
        self.snapshot_complete = high_seqno
        self.snapshot_persisted = high_seqno
        #: partition-state CAS (docs/cluster.md "Partition-state CAS"); set by the bucket
        self.state_cas = 0
        #: synchronous replication (docs/durability.md, engine/kv/durability.py): the prepares in flight by key (never in
        #: ``ht``: invisible to readers), the active durability monitor, and whether this vbucket ever queued
        #: a prepare / abort (streams without sync writes then filter them)
        self.prepares: dict[bytes, Item] = {}
        self.durability: ActiveDurabilityMonitor | None = None
        self.sync_seen = False
        #: document locks (GET_LOCKED, engine/kv/locks.py): key -> (lock CAS, deadline); memory only
        self.locks: dict[bytes, tuple[int, float]] = {}
        #: the high seqno when this copy last stopped being active (None: not since it was loaded): every seqno
        #: it wrote as an active is a consistent rollback point (engine/bucket.py ``rollback_vbucket``)
        self.active_through: int | None = None

    # ------------------------------------------------------------------ helpers
    def __repr__(self) -> str:
        return f"VBucket({self.id} {self.state.value} high={self.high_seqno} persisted={self.persisted_seqno})"

    def next_cas(self) -> int:
        """The CAS of the next item this vbucket writes (kv_engine ``HLC::nextHLC``): the hybrid logical
        clock's time in ns (from the injected ``hlc_clock``) with the low 16 bits free for a counter, never
        going backwards. Used by the durability monitor for prepares (engine/kv/durability.py)."""
        now = self.hlc_clock() & ~0xFFFF
        cas = self.max_cas + 1 if now <= self.max_cas else now
        self.max_cas = cas
        return cas

    def check_active(self) -> None:
        """NotMyVBucket unless this vbucket is active (front-end writes and sync writes)."""
        if self.state is not VBucketState.ACTIVE:
            raise NotMyVBucket(f"vbucket {self.id} is {self.state.value}, not active")

    def _live(self, key: bytes, now: float) -> Item | None:
        """The live (not deleted, not expired) item of ``key``; an expired one is expired here."""
        it = self.ht.get(key)
        if it is None or it.op is not Op.MUTATION:
            return None
        if it.expiry and it.expiry <= now:
            self._expire(it, now)
            return None
        return it

    def queue_item(self, item: Item) -> None:
        """Make ``item`` the key's current item (hash table) and queue it in the checkpoint (a commit of a
        prepare goes here, engine/kv/durability.py ``commit_prepare``)."""
        self.ht[item.key] = item
        self.enqueue(item)

    def enqueue(self, item: Item) -> None:
        """Queue ``item`` in the checkpoint without touching the hash table (prepares and aborts live
        outside it)."""
        self.ckpt.queue(item)
        self.high_seqno = item.seqno
        if not self.dirty:
            self.dirty = True
            if self._on_dirty is not None:
                self._on_dirty(self.id)
        if self.streams:
            for s in self.streams:
                if not s.queued:
                    s.producer.notify(s)

    def _expire(self, it: Item, now: float) -> Item:
        """Turn an expired item into an expiration (a tombstone with a new seqno)."""
        exp = Item(
            it.key,
            None,
            self.id,
            self.high_seqno + 1,
            it.rev_seqno + 1,
            self.next_cas(),
            it.flags,
            int(now),
            Datatype.RAW,
            Op.EXPIRATION,
            it.seqno,
        )
        self.num_items -= 1
        self.expiring.discard(it.key)
        self.expirations += 1
        self.queue_item(exp)
        return exp

    # ------------------------------------------------------------------ KV operations
    def get(self, key: bytes) -> GetResult:
        self.check_active()
        it = self._live(key, self.clock())
        if it is None:
            raise KeyNotFound(f"key {key!r} not found in vbucket {self.id}")
        assert it.value is not None
        return GetResult(
            it.key, it.value, it.cas, it.flags, it.expiry, it.datatype, it.rev_seqno, it.seqno, self.id
        )

    def get_replica(self, key: bytes) -> GetResult:
        """A replica read (kv_engine GET_REPLICA): the committed item this replica holds; NotMyVBucket unless the
        vbucket is a replica. An expired item reads as not found but is not expired here: a replica never
        creates mutations, its active does."""
        if self.state is not VBucketState.REPLICA:
            raise NotMyVBucket(f"vbucket {self.id} is {self.state.value}, not a replica")
        it = self.ht.get(key)
        if it is None or it.op is not Op.MUTATION or (it.expiry and it.expiry <= self.clock()):
            raise KeyNotFound(f"key {key!r} not found in replica vbucket {self.id}")
        assert it.value is not None
        return GetResult(
            it.key, it.value, it.cas, it.flags, it.expiry, it.datatype, it.rev_seqno, it.seqno, self.id
        )

    def store(
        self,
        key: bytes,
        value: bytes,
        mode: StoreMode,
        cas: int,
        flags: int,
        expiry: int,
        datatype: int | None,
    ) -> MutationResult:
        if self.state is not _ACTIVE:
            self.check_active()
        if len(value) > self.max_value_size:
            raise ValueTooLarge(f"value of {len(value)} bytes exceeds the maximum of {self.max_value_size}")
        if flags and (flags < 0 or flags > U32):
            raise InvalidArgument(f"invalid flags {flags!r}: must fit in 32 bits")
        exp = absolute_expiry(expiry, self.clock()) if expiry else 0
        if self.prepares and key in self.prepares:
            self._sync_write_in_progress(key)
        if self.locks:
            cas = check_lock(self, key, cas)
        ht = self.ht.raw
        entry = ht.get(key)
        # a stored value: its item (engine/kv/stored_value.py)
        old = unpack(key, entry, self.id) if isinstance(entry, bytes) else entry
        live = old
        if old is not None and (old.op is not _MUTATION or (old.expiry and old.expiry <= self.clock())):
            live = None
        if mode is _ADD:
            if live is not None:
                raise KeyExists(f"key {key!r} already exists")
        elif live is None:
            if mode is _REPLACE:
                raise NotStored(f"key {key!r} does not exist (replace)")
            if cas:
                raise KeyNotFound(f"key {key!r} not found (cas {cas})")
        elif cas and live.cas != cas:
            raise KeyExists(f"cas mismatch for key {key!r}")
        if old is None:
            rev = self.max_deleted_rev + 1
            prev = 0
        else:
            rev = old.rev_seqno + 1
            prev = old.seqno
            if live is None and old.op is _MUTATION:  # expired in place: it was counted live
                self.num_items -= 1
                self.expiring.discard(key)
        if datatype is None:
            datatype = detect_datatype(value)
        seqno = self.high_seqno + 1
        # HLC CAS (see next_cas), inlined on the ingest path.
        new_cas = self.hlc_clock() & ~0xFFFF
        if new_cas <= self.max_cas:
            new_cas = self.max_cas + 1
        self.max_cas = new_cas
        if live is None:
            self.num_items += 1
        if exp:
            self.expiring.add(key)
        elif live is not None and live.expiry:
            self.expiring.discard(key)
        if self.locks:
            release(self, key)
        # queue_item, inlined on the ingest path: one stored value, queued and held by the hash table
        # (engine/kv/stored_value.py; docs/engine.md "Item layout and memory")
        ht[key] = self.ckpt.queue_mutation(key, value, seqno, new_cas, rev, prev, flags, exp, datatype)
        self.high_seqno = seqno
        if not self.dirty:
            self.dirty = True
            if self._on_dirty is not None:
                self._on_dirty(self.id)
        if self.streams:
            for s in self.streams:
                if not s.queued:
                    s.producer.notify(s)
        # MutationResult(...) without the Python frame of a NamedTuple's __new__ (the ingest path)
        return _new_tuple(MutationResult, (self.id, self.failover.vbuuid, seqno, new_cas))

    def _sync_write_in_progress(self, key: bytes) -> None:
        from engine.exceptions import SyncWriteInProgress

        # kv_engine (docs/durability.md): a write to a key with a prepare in flight answers SYNC_WRITE_IN_PROGRESS.
        raise SyncWriteInProgress(f"key {key!r} has a sync write in progress")

    def _live_to_change(self, key: bytes, cas: int, now: float) -> Item:
        """The live version a delete / touch replaces: KEY_ENOENT without one; a lock (GET_LOCKED) is checked
        against ``cas`` and released; then the CAS compare (KEY_EEXISTS)."""
        live = self._live(key, now)
        if live is None:
            raise KeyNotFound(f"key {key!r} not found in vbucket {self.id}")
        if self.locks:
            cas = check_lock(self, key, cas)
            release(self, key)
        if cas and live.cas != cas:
            raise KeyExists(f"cas mismatch for key {key!r}")
        return live

    def delete(self, key: bytes, cas: int = 0) -> MutationResult:
        self.check_active()
        if key in self.prepares:
            self._sync_write_in_progress(key)
        now = self.clock()
        live = self._live_to_change(key, cas, now)
        seqno = self.high_seqno + 1
        new_cas = self.next_cas()
        item = Item(
            key, None, self.id, seqno, live.rev_seqno + 1, new_cas, live.flags, int(now), Datatype.RAW,
            Op.DELETION, live.seqno,
        )
        self.num_items -= 1
        self.expiring.discard(key)
        self.queue_item(item)
        return MutationResult(self.id, self.failover.latest.vbuuid, seqno, new_cas)

    def restore_version(self, item: Item, since: int) -> MutationResult | None:
        """Rollback repair (docs/cluster.md "Rollback repair"): write ``item`` -- a document version a
        recovering copy holds above the branch point ``since`` -- as a normal write of this active vbucket:
        a new seqno and a new CAS, its value, flags, expiry, datatype and revision kept (the revision is raised
        only if this copy's version of the key already has a higher one). A deletion / expiration writes a
        tombstone over a live document. ``None`` when the key was changed here above ``since`` (a document,
        tombstone or prepare with a higher seqno: the active's version wins) or when a deletion finds nothing
        to delete."""
        self.check_active()
        key = item.key
        p = self.prepares.get(key)
        cur = self.ht.get(key)
        if (p is not None and p.seqno > since) or (cur is not None and cur.seqno > since):
            return None
        if p is not None:
            self._sync_write_in_progress(key)  # a prepare from before the branch point: decided by durability
        live = cur is not None and cur.op is _MUTATION
        if item.op is not _MUTATION and not live:
            return None
        rev = item.rev_seqno
        floor = cur.rev_seqno + 1 if cur is not None else self.max_deleted_rev + 1
        rev = max(rev, floor)
        seqno = self.high_seqno + 1
        new_cas = self.next_cas()
        if item.op is _MUTATION:
            new = Item(key, item.value, self.id, seqno, rev, new_cas, item.flags, item.expiry, item.datatype,
                       _MUTATION, 0 if cur is None else cur.seqno)
            if not live:
                self.num_items += 1
            if item.expiry:
                self.expiring.add(key)
            else:
                self.expiring.discard(key)
        else:
            assert cur is not None
            new = Item(key, None, self.id, seqno, rev, new_cas, item.flags, item.expiry, Datatype.RAW, item.op,
                       cur.seqno)
            self.num_items -= 1
            self.expiring.discard(key)
        self.queue_item(new)
        return MutationResult(self.id, self.failover.latest.vbuuid, seqno, new_cas)

    def touch(self, key: bytes, expiry: int, cas: int = 0) -> MutationResult:
        self.check_active()
        if key in self.prepares:
            self._sync_write_in_progress(key)
        now = self.clock()
        exp = absolute_expiry(expiry, now)
        live = self._live_to_change(key, cas, now)
        seqno = self.high_seqno + 1
        new_cas = self.next_cas()
        item = Item(
            key, live.value, self.id, seqno, live.rev_seqno + 1, new_cas, live.flags, exp, live.datatype,
            Op.MUTATION, live.seqno,
        )
        if exp:
            self.expiring.add(key)
        else:
            self.expiring.discard(key)
        self.queue_item(item)
        return MutationResult(self.id, self.failover.latest.vbuuid, seqno, new_cas)

    def expire_items(self, now: float) -> int:
        """The expiry pager's pass over this vbucket: expired items become expirations."""
        if self.state is not VBucketState.ACTIVE or not self.expiring:
            return 0
        n = 0
        for key in sorted(self.expiring):
            if key in self.prepares:
                continue  # kv_engine: a key with a sync write in flight is not expired under it
            it = self.ht.get(key)
            if it is None or it.op is not Op.MUTATION or not it.expiry:
                self.expiring.discard(key)
                continue
            if it.expiry <= now:
                self._expire(it, now)
                n += 1
        return n

    # ------------------------------------------------------------------ loading
    def load(self, item: Item) -> None:
        """Warmup: put a persisted current version back in the hash table (an outstanding prepare goes back
        to ``prepares``: kv_engine warmup / rollback reload prepares from disk; an abort is no document)."""
        if item.op >= Op.PREPARE:
            self.sync_seen = True
            if item.op is not Op.ABORT:
                self.prepares[item.key] = item
            return
        self.ht.store_packed(item)
        if item.op is Op.MUTATION:
            self.num_items += 1
            if item.expiry:
                self.expiring.add(item.key)
        elif item.rev_seqno > self.max_deleted_rev:
            self.max_deleted_rev = item.rev_seqno
        if item.cas > self.max_cas:
            self.max_cas = item.cas

    # ------------------------------------------------------------------ replica side
    def check_replica(self) -> None:
        """kv_engine PassiveStream: only a replica (or pending) vbucket accepts DCP data from a producer
        (NotMyVBucket otherwise)."""
        if self.state is not VBucketState.REPLICA and self.state is not VBucketState.PENDING:
            raise NotMyVBucket(f"vbucket {self.id} is {self.state.value}, not replica: cannot apply DCP data")

    def replica_marker(self, start: int, end: int) -> None:
        """A snapshot marker from the active: opens the replica's snapshot range ``[start, end]``.

        kv_engine: a replica checkpoint holds one snapshot (a marker opens a new checkpoint), so nothing is
        de-duplicated across snapshots and the replica persists every item it received, in seqno order. A
        marker arriving while the previous snapshot is incomplete (the stream was re-requested from inside it)
        supersedes it: the new first marker starts at or below the old start (``min(snap_start, start)``).
        """
        self.check_replica()
        if type(start) is not int or type(end) is not int or not 0 <= start <= end:
            raise InvalidArgument(f"vbucket {self.id}: bad snapshot marker [{start!r}, {end!r}]")
        if end <= self.high_seqno:
            raise InvalidArgument(
                f"vbucket {self.id}: snapshot marker [{start}, {end}] ends at or below high seqno {self.high_seqno}")
        snaps = self.replica_snaps
        base = self.high_seqno
        if snaps and snaps[-1][2] > self.high_seqno:
            base = snaps.pop()[0]
        snaps.append([base, start, end])
        self.ckpt.create_checkpoint()

    def replica_apply(self, item: Item) -> Item:
        """Apply a mutation / deletion / expiration from the active with its seqno, rev seqno, CAS, flags and
        expiry (kv_engine ``setWithMeta`` / ``deleteWithMeta`` on a replica: no seqno or CAS is generated;
        ``max_cas`` follows the producer). Returns the replica's own copy of the item."""
        self.check_replica()
        snaps = self.replica_snaps
        if not snaps or snaps[-1][2] <= self.high_seqno:
            raise InvalidArgument(f"vbucket {self.id}: {item!r} outside any open snapshot")
        end = snaps[-1][2]
        if item.vbucket != self.id or not self.high_seqno < item.seqno <= end:
            raise InvalidArgument(
                f"vbucket {self.id}: {item!r} not in ({self.high_seqno}, {end}] of the open snapshot")
        key = item.key
        if item.op >= Op.PREPARE:  # a prepare or an abort (synchronous replication, docs/durability.md)
            from engine.kv.durability import passive_apply

            return passive_apply(self, item, end)
        prepared = item.prepared
        if prepared and item.value is None and item.op is Op.MUTATION:
            # kv_engine DCP_COMMIT (key, prepared seqno, commit seqno; no value): the committed document is
            # the prepare this replica holds, made visible at the commit's seqno.
            p = self.prepares.get(key)
            if p is None or p.seqno != prepared:
                raise InvalidArgument(f"vbucket {self.id}: commit of prepare {prepared} of {key!r}, not held here")
            op = Op.MUTATION if p.op is Op.PREPARE else Op.DELETION
            item = Item(key, p.value, self.id, item.seqno, p.rev_seqno, p.cas, p.flags, p.expiry, p.datatype, op,
                        0, 0, prepared)
        if self.prepares:
            p = self.prepares.get(key)
            if p is not None and p.seqno < item.seqno:
                # The commit of the prepare (or, in a disk snapshot, the mutation that replaced it: kv_engine
                # completes a replica's prepare on any later committed item of its key). Recorded as its
                # commit so the flusher supersedes the prepare on disk (else warmup would reload it).
                del self.prepares[key]
                prepared = prepared or p.seqno
        old = self.ht.get(key)
        # A copy: the producer's item is shared with its own checkpoint, and prev_seqno is per vbucket copy.
        it = Item(key, item.value, self.id, item.seqno, item.rev_seqno, item.cas, item.flags, item.expiry,
                  item.datatype, item.op, old.seqno if old is not None else 0, 0, prepared)
        self.account_replacement(old, it)
        if it.cas > self.max_cas:
            self.max_cas = it.cas
        self.queue_item(it)
        if it.seqno == end:
            self.snapshot_complete = end
        return it

    def account_replacement(self, old: Item | None, it: Item) -> None:
        """Item count, expiry index and highest deleted revision when ``it`` replaces ``old`` (None: the key
        had nothing) -- a replica applying a stream item, and a write with meta (engine/kv/with_meta.py)."""
        if old is not None and old.op is Op.MUTATION:
            self.num_items -= 1
        key = it.key
        if it.op is Op.MUTATION:
            self.num_items += 1
            if it.expiry:
                self.expiring.add(key)
            else:
                self.expiring.discard(key)
        else:
            self.expiring.discard(key)
            if it.rev_seqno > self.max_deleted_rev:
                self.max_deleted_rev = it.rev_seqno

    def replica_position(self) -> tuple[int, int, int]:
        """``(start, snap_start, snap_end)`` for this replica's stream request (docs/cluster.md
        "Replication": start = last seqno, snapshot = the current, possibly partial, snapshot's marker range)."""
        high = self.high_seqno
        snaps = self.replica_snaps
        if snaps and snaps[-1][1] <= high < snaps[-1][2]:
            return high, snaps[-1][1], snaps[-1][2]
        return high, high, high

    def replica_persisted(self, last: int) -> tuple[tuple[int, int], list[int]]:
        """After the flusher persisted up to ``last``: the snapshot range to record with it and the ends of
        the snapshots now wholly persisted (their boundaries)."""
        snap = (last, last)
        ends: list[int] = []
        for base, start, end in self.replica_snaps:
            if base < last:
                snap = (start, end)
            if end <= last:
                ends.append(end)
        return snap, ends

    def replica_flushed(self, last: int) -> None:
        """Forget the markers wholly persisted up to ``last``."""
        snaps = self.replica_snaps
        while snaps and snaps[0][2] <= last:
            self.snapshot_persisted = snaps.popleft()[2]

    def reset(self, high_seqno: int, items: Iterable[Item]) -> None:
        """Rollback: reload the hash table from storage at ``high_seqno``; checkpoints and DCP cursors are
        dropped (kv_engine rollback resets the checkpoint manager and reloads the vbucket from disk)."""
        self.ht.raw = {}
        self.prepares = {}
        self.locks = {}
        self.num_items = 0
        # max_deleted_rev is a high-water mark (the purged tombstones' revisions are gone from storage too):
        # kept, so a key created again after the rollback still continues its revisions
        self.max_cas = 0
        self.expiring = set()
        self.high_seqno = self.persisted_seqno = high_seqno
        self.persisted_snap = (high_seqno, high_seqno)
        self.snapshot_complete = self.snapshot_persisted = high_seqno
        self.replica_snaps.clear()
        self.ckpt.clear(high_seqno)
        for it in items:
            self.load(it)

    def end_streams(self, reason: int) -> None:
        for s in list(self.streams):
            s.end_stream(reason)

    def info(self) -> VBucketInfo:
        return VBucketInfo(
            self.id, self.state, self.state_cas, self.high_seqno, self.persisted_seqno, self.snapshot_complete,
            self.snapshot_persisted, tuple((e.vbuuid, e.seqno) for e in self.failover.entries))

    def stats(self) -> dict[str, int | str]:
        ck = self.ckpt
        return {
            "vbucket": self.id,
            "state": self.state.value,
            "vbuuid": self.failover.latest.vbuuid,
            "high_seqno": self.high_seqno,
            "persisted_seqno": self.persisted_seqno,
            "purge_seqno": self.purge_seqno,
            "items": self.num_items,
            "checkpoint_memory": ck.mem,
            "checkpoints": len(ck.checkpoints),
            "cursors": len(ck.cursors),
            "streams": len(self.streams),
            "failover_entries": len(self.failover),
        }
