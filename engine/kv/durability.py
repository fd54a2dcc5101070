"""Synchronous replication (docs/durability.md, kv_engine ``engines/ep/src/durability/``): durability levels, the
active durability monitor and the passive (replica) side.

A sync write is a **prepare** (``Op.PREPARE`` / ``Op.PREPARE_DELETION``) queued in the vbucket's checkpoint and
kept in ``VBucket.prepares`` -- never in the hash table readers see -- until it is **committed** (a
MUTATION / DELETION item whose ``prepared`` is the prepare's seqno, at a seqno of its own) or **aborted** (an
``Op.ABORT`` item). The rules (kv_engine ``active_durability_monitor.cc`` / ``passive_durability_monitor.cc``; docs/durability.md):

* levels none 0, majority 1, majority-and-persist-on-master 2, persist-to-majority 3; anything else is
  DURABILITY_INVALID_LEVEL (0xa0);
* majority = chain slots / 2 + 1 (configured nodes = replicas + 1, empty slots counted); DURABILITY_IMPOSSIBLE
  (0xa1) when the chain has fewer defined nodes than that (kv_engine ``ReplicationChain::isDurabilityPossible``;
  with 0 replicas majority is 1 and the active alone satisfies it -- the RFC says impossible, kv_engine allows
  it, we follow kv_engine);
* a prepare is satisfied when the active itself has acked it (its high prepared seqno covers it; for levels 2
  and 3 only once persisted -- a persist-level prepare is a fence for every later one) and acks >= majority,
  counting the active and every chain replica whose seqno-ack covers it; prepares are committed in seqno order;
* replicas seqno-ack only the end of a complete snapshot, and for persist-to-majority prepares only once the
  snapshot is persisted (:func:`replica_ack_seqno`);
* timeout -> abort + SYNC_WRITE_AMBIGUOUS (0xa3) to the waiter; the vbucket stopping being active -> ambiguous
  to every waiter (the prepares stay, now on the passive side); a write to a key with a prepare in flight ->
  SYNC_WRITE_IN_PROGRESS (0xa2);
* prepares the vbucket holds without a waiter (loaded at warmup or held by a replica that is promoted) have an
  infinite timeout: they are re-committed once durable on the current topology, never aborted by timeout
  (kv_engine "maybe visible" prepares after failover).

The engine is synchronous: a sync write returns a :class:`SyncWrite` handle that completes when seqno-acks
arrive (``Bucket.seqno_acknowledged``), when the flusher persists (persist levels), or on
``Bucket.process_durability_timeouts`` with the bucket's (injectable) clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Final

from engine.exceptions import (
    DurabilityImpossible,
    DurabilityInvalidLevel,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    NotStored,
    SyncWriteAmbiguous,
    SyncWriteInProgress,
    TemporaryFailure,
    ValueTooLarge,
)
from engine.kv.item import Datatype, Item, Op, detect_datatype
from engine.kv.locks import check_lock, release

if TYPE_CHECKING:
    from engine.kv.vbucket import MutationResult, StoreMode, VBucket

#: kv_engine ``cb::durability::Timeout``: 0 = the bucket default, 0xffff = infinity; the frame carries 16 bits
BUCKET_DEFAULT_TIMEOUT: Final = 0
INFINITE_TIMEOUT: Final = 0xFFFF
#: the most chain slots a vbucket has (active + 3 replicas)
MAX_CHAIN: Final = 4


class Level(IntEnum):
    """Durability levels (docs/durability.md "Levels and timeouts", kv_engine ``cb::durability::Level``)."""

    NONE = 0
    MAJORITY = 1
    MAJORITY_AND_PERSIST_TO_ACTIVE = 2
    PERSIST_TO_MAJORITY = 3


_LEVEL_NAMES: Final = {
    "none": Level.NONE,
    "majority": Level.MAJORITY,
    "majority_and_persist_to_active": Level.MAJORITY_AND_PERSIST_TO_ACTIVE,
    "majority_and_persist_on_master": Level.MAJORITY_AND_PERSIST_TO_ACTIVE,
    "majorityandpersistactive": Level.MAJORITY_AND_PERSIST_TO_ACTIVE,
    "persist_to_majority": Level.PERSIST_TO_MAJORITY,
    "persisttomajority": Level.PERSIST_TO_MAJORITY,
}


def parse_level(level: Level | int | str) -> Level:
    """A level from its number (0-3) or name (``majority``, ``majority_and_persist_to_active``,
    ``persist_to_majority``, ``none``; case-insensitive). Anything else: :class:`DurabilityInvalidLevel`."""
    if isinstance(level, Level):
        return level
    if type(level) is int:
        if 0 <= level <= 3:
            return Level(level)
        raise DurabilityInvalidLevel(f"invalid durability level {level!r}: must be 0..3")
    if isinstance(level, str):
        lv = _LEVEL_NAMES.get(level.strip().lower().replace("-", "_"))
        if lv is None and level.strip().isdigit():
            return parse_level(int(level.strip()))
        if lv is not None:
            return lv
    raise DurabilityInvalidLevel(
        f"invalid durability level {level!r}: one of none, majority, majority_and_persist_to_active, "
        "persist_to_majority (or 0..3)")


@dataclass(frozen=True, slots=True)
class Durability:
    """What a client asks of a write: a level and a timeout in ms (0 = the bucket default, 0xffff = infinite,
    otherwise at least the floor: a smaller value is raised to it, as the RFC's SDKs coerce it)."""

    level: Level
    timeout_ms: int = BUCKET_DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", parse_level(self.level))
        t = self.timeout_ms
        if type(t) is not int or not 0 <= t <= INFINITE_TIMEOUT:
            raise InvalidArgument(f"invalid durability timeout {t!r}: must be 0..65535 ms (16 bits)")

    @classmethod
    def of(cls, level: Level | int | str, timeout_ms: int | None = None) -> Durability:
        return cls(parse_level(level), BUCKET_DEFAULT_TIMEOUT if timeout_ms is None else timeout_ms)

    def effective_timeout_ms(self, default_ms: int, floor_ms: int) -> int | None:
        """The timeout the active applies: None = infinite."""
        t = self.timeout_ms
        if t == INFINITE_TIMEOUT:
            return None
        if t == BUCKET_DEFAULT_TIMEOUT:
            t = default_ms
        return max(t, floor_ms)


class ManualClock:
    """An injectable clock (seconds) for deterministic tests and the in-process cluster: moves only on
    :meth:`advance`."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise InvalidArgument("a clock does not go backwards")
        self.now += seconds


class SyncWriteState(Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    #: timed out and aborted by the active
    ABORTED = "aborted"
    #: the vbucket stopped being active while the write was pending (the prepare may still commit)
    AMBIGUOUS = "ambiguous"


class SyncWrite:
    """The handle of one pending sync write (kv_engine's blocked client cookie)."""

    __slots__ = ("commit", "deadline", "key", "level", "prepare_seqno", "reason", "state", "vbucket", "vbuuid")

    def __init__(self, key: bytes, vbucket: int, vbuuid: int, prepare_seqno: int, level: Level,
                 deadline: float | None) -> None:
        self.key = key
        self.vbucket = vbucket
        self.vbuuid = vbuuid
        self.prepare_seqno = prepare_seqno
        self.level = level
        self.deadline = deadline
        self.state = SyncWriteState.PENDING
        self.commit: MutationResult | None = None
        self.reason = ""

    def __repr__(self) -> str:
        return f"SyncWrite({self.key!r} vb={self.vbucket} prepare={self.prepare_seqno} {self.state.value})"

    @property
    def done(self) -> bool:
        return self.state is not SyncWriteState.PENDING

    @property
    def committed(self) -> bool:
        return self.state is SyncWriteState.COMMITTED

    def result(self) -> MutationResult:
        """The commit's mutation result (its seqno and the prepare's CAS); :class:`SyncWriteAmbiguous` when the
        write timed out or its vbucket stopped being active; :class:`TemporaryFailure` while still pending."""
        if self.state is SyncWriteState.COMMITTED:
            assert self.commit is not None
            return self.commit
        if self.state is SyncWriteState.PENDING:
            raise TemporaryFailure(f"sync write of {self.key!r} is still pending")
        raise SyncWriteAmbiguous(f"sync write of {self.key!r} (prepare {self.prepare_seqno}): {self.reason}")


def majority(chain: Sequence[str | None]) -> int:
    """kv_engine ``ReplicationChain``: majority = slots / 2 + 1, empty (undefined) slots counted."""
    return len(chain) // 2 + 1


def durability_possible(chain: Sequence[str | None]) -> bool:
    """Enough defined nodes in the chain for a majority (kv_engine ``isDurabilityPossible``)."""
    return sum(1 for n in chain if n is not None) >= majority(chain)


def _ordered(vb: VBucket) -> list[Item]:
    return sorted(vb.prepares.values(), key=lambda p: p.seqno)


class ActiveDurabilityMonitor:
    """Per active vbucket: the replication chain, the replicas' seqno-acks and the waiting clients
    (kv_engine ``ActiveDurabilityMonitor``). The prepares themselves are ``VBucket.prepares``."""

    def __init__(self, vb: VBucket) -> None:
        self.vb = vb
        #: chain[0] is this node (the active), then the replica slots; None = an empty slot. Until a cluster
        #: manager sets a topology the vbucket is a single-node bucket with no replicas.
        self.chain: tuple[str | None, ...] = ("",)
        #: kv_engine's second replication chain: during the later stages of a rebalance ns_server also sends the
        #: post-rebalance chain, and a prepare is satisfied only once durable on **both** (a majority of each)
        self.second_chain: tuple[str | None, ...] | None = None
        self.acks: dict[str, int] = {}
        self.waiters: dict[int, SyncWrite] = {}
        self.commits = 0
        self.aborts = 0

    @property
    def majority(self) -> int:
        return majority(self.chain)

    @property
    def possible(self) -> bool:
        return durability_possible(self.chain) and (
            self.second_chain is None or durability_possible(self.second_chain))

    def set_topology(self, chain: Sequence[str | None], second: Sequence[str | None] | None = None) -> None:
        """The replication chain from the cluster manager (kv_engine ``setReplicationTopology``): the active
        first (never empty), then 0-3 replica slots; ``second`` the post-rebalance chain during a vbucket move
        (kv_engine: a topology holds up to two chains; its first node is the future active)."""
        chain = tuple(chain)
        sec = None if second is None else tuple(second)
        for ch in (chain, sec):
            if ch is not None and (not 1 <= len(ch) <= MAX_CHAIN or ch[0] is None):
                raise InvalidArgument(f"bad replication chain {list(ch)!r}: 1..4 slots, the active defined")
        if chain == self.chain and sec == self.second_chain:
            return
        self.chain = chain
        self.second_chain = sec
        keep = set(chain[1:]) | set(sec or ())
        self.acks = {n: s for n, s in self.acks.items() if n in keep}
        self.check()

    def seqno_ack(self, node: str, seqno: int) -> int:
        """A replica's seqno-ack (kv_engine ``seqnoAckReceived``); returns how many prepares committed."""
        if type(seqno) is not int or seqno < 0:
            raise InvalidArgument(f"invalid seqno ack {seqno!r}")
        if seqno > self.acks.get(node, -1):
            self.acks[node] = seqno
        return self.check()

    # ------------------------------------------------------------------ the active's own ack
    def active_ack(self, ordered: list[Item]) -> int:
        """The active's high prepared seqno: every prepare up to it is locally satisfied; a prepare of a
        persist level not yet persisted is a fence (kv_engine: HPS does not move past it)."""
        persisted = self.vb.persisted_seqno
        for p in ordered:
            if p.level >= Level.MAJORITY_AND_PERSIST_TO_ACTIVE and p.seqno > persisted:
                return p.seqno - 1
        return self.vb.high_seqno

    def acked_by(self, seqno: int, active_ack: int, chain: Sequence[str | None] | None = None) -> int:
        """Acks of ``seqno`` among the nodes of ``chain`` (default: the first chain). This node counts with its
        own ack (it is the first chain's active; in a second chain it may be a replica or absent)."""
        me = self.chain[0]
        nodes = self.chain if chain is None else chain
        n = 0
        for i, r in enumerate(nodes):
            if r is None:
                continue
            if (i == 0 and chain is None) or r == me:
                n += 1 if active_ack >= seqno else 0
            elif self.acks.get(r, -1) >= seqno:
                n += 1
        return n

    def satisfied(self, seqno: int, active_ack: int) -> bool:
        """Durable on the first chain and, during a move, on the second (kv_engine ``isSatisfied`` of both
        chains)."""
        if active_ack < seqno or self.acked_by(seqno, active_ack) < self.majority:
            return False
        sec = self.second_chain
        return sec is None or self.acked_by(seqno, active_ack, sec) >= majority(sec)

    def check(self) -> int:
        """Commit, in seqno order, every prepare now satisfied; returns how many."""
        vb = self.vb
        if not vb.prepares or vb.state.value != "active" or not self.possible:
            return 0
        ordered = _ordered(vb)
        a = self.active_ack(ordered)
        n = 0
        for p in ordered:
            if not self.satisfied(p.seqno, a):
                break
            self._commit(p)
            n += 1
        return n

    def _commit(self, p: Item) -> None:
        vb = self.vb
        res = commit_prepare(vb, p, vb.high_seqno + 1)
        self.commits += 1
        sw = self.waiters.pop(p.seqno, None)
        if sw is not None:
            sw.state = SyncWriteState.COMMITTED
            sw.commit = res

    def abort(self, p: Item, reason: str) -> None:
        vb = self.vb
        del vb.prepares[p.key]
        now = vb.clock()
        item = Item(p.key, None, vb.id, vb.high_seqno + 1, p.rev_seqno, p.cas, 0, int(now), Datatype.RAW,
                    Op.ABORT, 0, 0, p.seqno)
        vb.enqueue(item)
        self.aborts += 1
        sw = self.waiters.pop(p.seqno, None)
        if sw is not None:
            sw.state = SyncWriteState.ABORTED
            sw.reason = reason

    def process_timeouts(self, now: float) -> int:
        """Abort every waiting prepare whose deadline passed (kv_engine ``processTimeout``): the waiter gets
        SYNC_WRITE_AMBIGUOUS. Prepares without a waiter (infinite timeout) are never aborted here."""
        if not self.waiters or self.vb.state.value != "active":
            return 0
        n = 0
        for seqno in sorted(self.waiters):
            sw = self.waiters[seqno]
            if sw.deadline is None or sw.deadline > now:
                continue
            p = self.vb.prepares.get(sw.key)
            if p is None or p.seqno != seqno:  # completed meanwhile (cannot happen: completion pops the waiter)
                del self.waiters[seqno]
                continue
            self.abort(p, "timed out before its durability requirements were met; aborted")
            n += 1
        if n:
            self.check()  # an aborted fence may unblock later prepares
        return n

    def state_changed(self) -> None:
        """The vbucket stopped being active: every waiter gets SYNC_WRITE_AMBIGUOUS (the prepares stay and
        may still be committed by a new active); acks are forgotten."""
        for sw in self.waiters.values():
            sw.state = SyncWriteState.AMBIGUOUS
            sw.reason = "the vbucket stopped being active before the write completed"
        self.waiters.clear()
        self.acks.clear()

    # ------------------------------------------------------------------ new sync writes
    def add_sync_write(
        self, key: bytes, value: bytes | None, mode: StoreMode | None, cas: int, flags: int, expiry: int,
        datatype: int | None, level: Level, timeout_ms: int | None,
    ) -> SyncWrite:
        """Queue the prepare of a durable set (``value`` bytes, ``mode``) or delete (``value`` None) and
        return its handle. Checks the vbucket is active, the key has no prepare in flight, durability is
        possible, then the same document rules as a plain write (CAS, add / replace, value size...)."""
        from engine.kv.vbucket import U32, StoreMode, absolute_expiry

        vb = self.vb
        vb.check_active()
        if level is Level.NONE:
            raise InvalidArgument("a sync write needs a durability level above none")
        if key in vb.prepares:
            raise SyncWriteInProgress(f"key {key!r} has a sync write in progress")
        if not self.possible:
            raise DurabilityImpossible(
                f"vbucket {vb.id}: chain {list(self.chain)} has fewer defined nodes than a majority "
                f"({self.majority})")
        if vb.locks:  # a locked document takes a write only with the lock's CAS (engine/kv/locks.py)
            cas = check_lock(vb, key, cas)
        now = vb.clock()
        old = vb.ht.get(key)
        live = old
        if old is not None and (old.op is not Op.MUTATION or (old.expiry and old.expiry <= now)):
            live = None
        if value is None:  # durable delete
            if live is None:
                raise KeyNotFound(f"key {key!r} not found in vbucket {vb.id}")
            if cas and live.cas != cas:
                raise KeyExists(f"cas mismatch for key {key!r}")
            op = Op.PREPARE_DELETION
            flags = live.flags
            exp = int(now)
            dt = Datatype.RAW
        else:
            if len(value) > vb.max_value_size:
                raise ValueTooLarge(f"value of {len(value)} bytes exceeds the maximum of {vb.max_value_size}")
            if flags and (flags < 0 or flags > U32):
                raise InvalidArgument(f"invalid flags {flags!r}: must fit in 32 bits")
            exp = absolute_expiry(expiry, now) if expiry else 0
            if mode is StoreMode.ADD:
                if live is not None:
                    raise KeyExists(f"key {key!r} already exists")
            elif live is None:
                if mode is StoreMode.REPLACE:
                    raise NotStored(f"key {key!r} does not exist (replace)")
                if cas:
                    raise KeyNotFound(f"key {key!r} not found (cas {cas})")
            elif cas and live.cas != cas:
                raise KeyExists(f"cas mismatch for key {key!r}")
            op = Op.PREPARE
            dt = detect_datatype(value) if datatype is None else datatype
        rev = old.rev_seqno + 1 if old is not None else vb.max_deleted_rev + 1
        seqno = vb.high_seqno + 1
        item = Item(key, value, vb.id, seqno, rev, vb.next_cas(), flags, exp, dt, op, 0, int(level))
        vb.prepares[key] = item
        vb.sync_seen = True
        if vb.locks:
            release(vb, key)
        vb.enqueue(item)
        deadline = None if timeout_ms is None else now + timeout_ms / 1000.0
        sw = SyncWrite(key, vb.id, vb.failover.latest.vbuuid, seqno, level, deadline)
        self.waiters[seqno] = sw
        self.check()
        return sw


def monitor(vb: VBucket) -> ActiveDurabilityMonitor:
    """The vbucket's active durability monitor (created on first use)."""
    m = vb.durability
    if m is None:
        m = vb.durability = ActiveDurabilityMonitor(vb)
    return m


def commit_prepare(vb: VBucket, p: Item, seqno: int) -> MutationResult:
    """Make prepare ``p`` visible at ``seqno``: a MUTATION (or DELETION for a durable delete) with the
    prepare's value, rev seqno, CAS, flags and expiry, ``prepared`` = the prepare's seqno (kv_engine
    ``VBucket::commit``). Used by the active; a replica applies the active's commit item instead."""
    from engine.kv.vbucket import MutationResult

    del vb.prepares[p.key]
    old = vb.ht.get(p.key)
    op = Op.MUTATION if p.op is Op.PREPARE else Op.DELETION
    item = Item(p.key, p.value, vb.id, seqno, p.rev_seqno, p.cas, p.flags, p.expiry, p.datatype, op,
                old.seqno if old is not None else 0, 0, p.seqno)
    if old is not None and old.op is Op.MUTATION:
        vb.num_items -= 1
    if op is Op.MUTATION:
        vb.num_items += 1
        if item.expiry:
            vb.expiring.add(item.key)
        else:
            vb.expiring.discard(item.key)
    else:
        vb.expiring.discard(item.key)
        if item.rev_seqno > vb.max_deleted_rev:
            vb.max_deleted_rev = item.rev_seqno
    vb.queue_item(item)
    return MutationResult(vb.id, vb.failover.latest.vbuuid, seqno, p.cas)


# ---------------------------------------------------------------------- passive side (replicas)
def passive_apply(vb: VBucket, item: Item, end: int) -> Item:
    """Apply a PREPARE / PREPARE_DELETION / ABORT from the active on a replica (kv_engine ``PassiveStream``
    -> ``PassiveDurabilityMonitor``), with the producer's seqno; ``end`` is the open snapshot's end (the
    caller checked the seqno lies in it)."""
    key = item.key
    if item.op is Op.ABORT:
        prepared = item.prepared
        p = vb.prepares.get(key)
        if p is not None and p.seqno < item.seqno:
            # kv_engine PassiveDurabilityMonitor: the abort completes the prepare this replica tracks for the
            # key. Recorded as the abort's prepared seqno so the flusher supersedes that prepare on disk (else
            # warmup reloads an aborted prepare): an abort from a disk backfill carries none (storage keeps
            # no prepared seqno for an abort; docs/durability.md "Storage, warmup, rollback, failover"), like
            # a backfilled commit (engine/kv/vbucket.py replica_apply).
            del vb.prepares[key]
            prepared = p.seqno
        it = Item(key, None, vb.id, item.seqno, item.rev_seqno, item.cas, 0, item.expiry, item.datatype,
                  Op.ABORT, 0, 0, prepared)
    else:
        it = Item(key, item.value, vb.id, item.seqno, item.rev_seqno, item.cas, item.flags, item.expiry,
                  item.datatype, item.op, 0, item.level)
        vb.prepares[key] = it
    if it.cas > vb.max_cas:
        vb.max_cas = it.cas
    vb.sync_seen = True
    vb.enqueue(it)
    if it.seqno == end:
        vb.snapshot_complete = end
    return it


def replica_ack_seqno(vb: VBucket) -> int:
    """What a replica seqno-acks (kv_engine PassiveDM high prepared seqno): the end of the last complete
    snapshot received, held back below the first persist-to-majority prepare not yet in a complete persisted
    snapshot. The active compares it with prepare seqnos only, so it is equivalent to acking the HPS."""
    ack = vb.snapshot_complete
    for p in vb.prepares.values():
        if p.level == Level.PERSIST_TO_MAJORITY and p.seqno > vb.snapshot_persisted and p.seqno - 1 < ack:
            ack = p.seqno - 1
    return ack


def is_sync_item(item: Item) -> bool:
    """A prepare or an abort: what DCP clients without sync writes never see."""
    return item.op >= Op.PREPARE


__all__ = [
    "ActiveDurabilityMonitor",
    "Durability",
    "Level",
    "ManualClock",
    "SyncWrite",
    "SyncWriteState",
    "commit_prepare",
    "durability_possible",
    "is_sync_item",
    "majority",
    "monitor",
    "parse_level",
    "passive_apply",
    "replica_ack_seqno",
]
