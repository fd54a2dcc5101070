"""The flusher (kv_engine ``Flusher`` / ``EPBucket::flushVBucket``): persists what the vbuckets queued.

Each dirty vbucket's persistence cursor is read (whole checkpoint segments, up to a batch limit) and every
batch is one SQLite transaction: the new rows, "superseded" marks on the rows they replace, the vbucket state
records and, for replicas, the complete-snapshot boundaries (docs/engine.md "Data path"). On a storage error
nothing is lost: the cursors and persisted seqnos are restored and the vbuckets stay dirty.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from engine.kv.checkpoint import PERSISTENCE_CURSOR
from engine.kv.item import Item
from engine.kv.storage import Row, Storage, vbucket_record
from engine.kv.stored_value import HAS_SYNC, HEADER, HEADER_SIZE, NO_VALUE, unpack
from engine.kv.vbucket import VBucket


def _rows(batches: list[tuple[int, list[bytes], list[Item | bytes]]], superseded: list[tuple[int, int, int]]) -> Iterator[Row]:
    """The rows of ``batches`` (a vbucket and the entries read from its checkpoints), made as SQLite takes them
    -- a stored value straight from its header, no Item in between, so a batch of a quarter million items leaves
    no quarter million objects behind (docs/engine.md "Item layout and memory") -- and the "superseded" marks
    they imply, appended to ``superseded`` on the way."""
    head = HEADER.unpack_from
    h = HEADER_SIZE
    add = superseded.append
    for vbid, keys, entries in batches:
        for key, e in zip(keys, entries, strict=True):
            if type(e) is bytes:
                seqno, cas, rev, prev, flags, exp, dt, bits = head(e)
                if not bits & (HAS_SYNC | NO_VALUE):
                    yield (vbid, seqno, key, e[h:], flags, exp, cas, rev, dt, bits)
                    if prev:
                        add((seqno, vbid, prev))
                    continue
                it = unpack(key, e, vbid)
            else:
                it = e  # type: ignore[assignment]
            sync = it.sync  # prepared << 2 | level (engine/kv/item.py)
            yield (vbid, it.seqno, it.key, it.value, it.flags, it.expiry, it.cas, it.rev_seqno, it.datatype,
                   it.op.value | (sync & 3) << 4)
            if it.prev_seqno:
                add((it.seqno, vbid, it.prev_seqno))
            if sync > 3:  # a commit / abort supersedes its prepare on disk (docs/durability.md)
                add((it.seqno, vbid, sync >> 2))


class Flusher:
    """Persists the queued items of ``vbuckets`` to ``storage``.

    ``dirty`` holds the ids of vbuckets with items the flusher has not read (each vbucket adds itself through
    its ``on_dirty`` callback); ``batch_items`` bounds one :meth:`flush`.
    """

    def __init__(self, storage: Storage, vbuckets: Sequence[VBucket], batch_items: int) -> None:
        self.storage = storage
        self.vbuckets = vbuckets
        self.batch_items = batch_items
        self.dirty: set[int] = set()
        self.items_flushed = 0

    def flush(self, max_items: int | None = None) -> int:
        """Persist queued items from each dirty vbucket's persistence cursor (one transaction); returns how
        many were persisted."""
        limit = max_items or self.batch_items
        batches: list[tuple[int, list[bytes], list[Item | bytes]]] = []
        count = 0
        superseded: list[tuple[int, int, int]] = []
        touched: list[tuple[VBucket, Any, int, int, int]] = []
        dirty = self.dirty
        vbs = self.vbuckets
        while dirty and count < limit:
            vbid = dirty.pop()
            vb = vbs[vbid]
            vb.dirty = False
            ck = vb.ckpt
            cur = ck.cursors[PERSISTENCE_CURSOR]
            saved = (cur.ckpt, cur.pos, cur.last_read)
            segments = ck.read_entries(cur, limit - count)
            first = None
            for seg in segments:
                if seg.items:
                    batches.append((vbid, seg.keys, seg.items))
                    count += len(seg.items)
                    if first is None:
                        first = seg.start
            if first is None:
                continue
            touched.append((vb, saved, vb.persisted_seqno, first, cur.last_read))
            if ck.has_items_for(cur):
                vb.dirty = True
                dirty.add(vbid)
        if not touched:
            return 0
        records = []
        boundaries: list[tuple[int, int]] = []
        for vb, _saved, _old, first, last in touched:
            vb.persisted_seqno = last
            if vb.replica_snaps:
                # A replica records the producer's marker range (possibly partial) and the complete
                # snapshots' ends (docs/cluster.md: a replica persists in sequence order).
                snap, ends = vb.replica_persisted(last)
                vb.persisted_snap = snap
                boundaries.extend((vb.id, e) for e in ends)
            else:
                vb.persisted_snap = (first, last)
            records.append(vbucket_record(vb))
        try:
            self.storage.flush(_rows(batches, superseded), superseded, records, boundaries)
        except Exception:
            for vb, saved, old, _first, _last in touched:
                cur = vb.ckpt.cursors[PERSISTENCE_CURSOR]
                cur.ckpt, cur.pos, cur.last_read = saved
                vb.persisted_seqno = old
                vb.dirty = True
                dirty.add(vb.id)
            raise
        for vb, _saved, _old, _first, last in touched:
            if vb.replica_snaps:
                vb.replica_flushed(last)
            vb.ckpt.remove_unreferenced()
            if vb.prepares and vb.durability is not None:
                vb.durability.check()  # persist levels: the active's own ack moved (docs/durability.md)
        self.items_flushed += count
        return count

    def flush_all(self) -> int:
        """Flush until no vbucket is dirty; returns the items persisted."""
        n = 0
        while self.dirty:
            n += self.flush()
        return n


__all__ = ["Flusher"]
