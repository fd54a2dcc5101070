"""Writes with meta on an active vbucket: the XDCR target's write path (kv_engine ``VBucket::setWithMeta`` /
``addWithMeta`` / ``deleteWithMeta``, docs/xdcr.md "Target side").

The write keeps the source's CAS, revision seqno, flags, expiry (a tombstone's delete time) and deletion state;
only the by-seqno is the target's own. The target runs conflict resolution itself
(engine/kv/conflict_resolution.py) against the document it holds -- a tombstone keeps its metadata, so a later,
older write is still rejected. An accepted write is queued in the checkpoint like any front-end write, so it
reaches storage, DCP and the gateway's Kafka records with the source's CAS and rev seqno. Accepting a CAS ahead
of the vbucket's hybrid logical clock moves the clock (kv_engine ``setMaxCasAndTrackDrift``): later local writes
get a larger CAS.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from engine.exceptions import KeyExists, KeyNotFound, SyncWriteInProgress, ValueTooLarge
from engine.kv.conflict_resolution import (
    ConflictCounters,
    ConflictRejected,
    ConflictResolutionMode,
    ItemMeta,
    Resolution,
    check_meta,
    parse_options,
    resolve,
)
from engine.kv.item import Datatype, Item, Op, detect_datatype
from engine.kv.vbucket import MutationResult

if TYPE_CHECKING:
    from engine.kv.vbucket import VBucket


class WithMetaOp(Enum):
    SET = "set_with_meta"
    ADD = "add_with_meta"
    DEL = "del_with_meta"


def item_meta(it: Item) -> ItemMeta:
    """The metadata of a stored item (live document or tombstone) as GET_META answers it."""
    return ItemMeta(it.cas, it.rev_seqno, it.flags, it.expiry, it.datatype, it.op is not Op.MUTATION)


def get_meta(vb: VBucket, key: bytes) -> ItemMeta:
    """kv_engine ``getMeta``: the metadata of the document or tombstone (KEY_ENOENT when neither exists)."""
    vb.check_active()
    it = vb.ht.get(key)
    if it is None:
        raise KeyNotFound(f"key {key!r} not found in vbucket {vb.id} (no document, no tombstone)")
    return item_meta(it)


def apply_with_meta(
    vb: VBucket, key: bytes, value: bytes | None, meta: ItemMeta, *, op: WithMetaOp, options: int,
    cas: int, mode: ConflictResolutionMode, counters: ConflictCounters, now: float,
) -> MutationResult:
    """Store ``value`` (a document, or a tombstone for DEL) with ``meta``; see the module docstring.

    ``cas`` (the request header's CAS, 0 = none) must match the stored document or tombstone. Errors:
    :class:`ConflictRejected` (KEY_EEXISTS) for a conflict loss, KEY_EEXISTS for an ADD over a live document or
    a CAS mismatch, KEY_ENOENT for a CAS on nothing, NOT_MY_VBUCKET unless active, E2BIG, EINVAL for bad
    options or metadata, SYNC_WRITE_IN_PROGRESS when the key has a prepare in flight.
    """
    vb.check_active()
    deletion = op is WithMetaOp.DEL
    opts = parse_options(options, mode, deletion=deletion)
    check_meta(meta, regenerate_cas=opts.regenerate_cas)
    if value is not None and len(value) > vb.max_value_size:
        raise ValueTooLarge(f"value of {len(value)} bytes exceeds the maximum of {vb.max_value_size}")
    if key in vb.prepares:
        raise SyncWriteInProgress(f"key {key!r} has a sync write in progress")
    old = vb.ht.get(key)
    if cas:
        if old is None:
            raise KeyNotFound(f"key {key!r} not found (cas {cas})")
        if old.cas != cas:
            raise KeyExists(f"cas mismatch for key {key!r}")
    if op is WithMetaOp.ADD and old is not None and old.op is Op.MUTATION and not (
            old.expiry and old.expiry <= now):
        raise KeyExists(f"key {key!r} already exists (add_with_meta)")
    if opts.check_conflicts:
        r = resolve(mode, None if old is None else item_meta(old), meta, is_delete=deletion)
        counters.count(r)
        if r is not Resolution.ACCEPT:
            raise ConflictRejected(
                f"{op.value} of {key!r} lost conflict resolution ({mode.value}): incoming rev {meta.rev_seqno} "
                f"cas {meta.cas}, local rev {old.rev_seqno if old else 0} cas {old.cas if old else 0}",
                identical=r is Resolution.IDENTICAL)
    else:
        counters.accepted += 1
    if opts.regenerate_cas:
        new_cas = vb.next_cas()
    else:
        new_cas = meta.cas
        if new_cas > vb.max_cas:
            vb.max_cas = new_cas  # kv_engine setMaxCasAndTrackDrift: the HLC never goes behind an accepted CAS
    seqno = vb.high_seqno + 1
    prev = 0 if old is None else old.seqno
    if deletion:
        body = value or None
        dt = (meta.datatype or detect_datatype(body)) if body else Datatype.RAW
        kind = Op.EXPIRATION if opts.is_expiration else Op.DELETION
        # a tombstone's expiry is its delete time (compaction purges by it): the source's, else now
        item = Item(key, body, vb.id, seqno, meta.rev_seqno, new_cas, meta.flags, meta.expiry or int(now), dt,
                    kind, prev)
    else:
        v = value or b""
        dt = meta.datatype if meta.datatype else detect_datatype(v)
        item = Item(key, v, vb.id, seqno, meta.rev_seqno, new_cas, meta.flags, meta.expiry, dt, Op.MUTATION,
                    prev)
    vb.account_replacement(old, item)  # the bookkeeping of a replica applying an item
    vb.queue_item(item)
    return MutationResult(vb.id, vb.failover.latest.vbuuid, seqno, new_cas)


__all__ = ["WithMetaOp", "apply_with_meta", "get_meta", "item_meta"]
