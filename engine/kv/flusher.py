"""The flusher (kv_engine ``Flusher`` / ``EPBucket::flushVBucket``): persists what the vbuckets queued.

Each dirty vbucket's persistence cursor is read (whole checkpoint segments, up to a batch limit) and every
batch is one SQLite transaction: the new rows, "superseded" marks on the rows they replace, the vbucket state
records and, for replicas, the complete-snapshot boundaries (docs/engine.md "Data path"). On a storage error
nothing is lost: the cursors and persisted seqnos are restored and the vbuckets stay dirty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.exceptions import StorageError
from engine.kv.checkpoint import PERSISTENCE_CURSOR
from engine.kv.item import Item
from engine.kv.storage import Storage, VBucketRecord, vbucket_record
from engine.kv.vbucket import VBucket


@dataclass(slots=True)
class _Batch:
    """One flush's read: the rows' sources, and per touched vbucket its cursor position
    before the read (sync flush) or its pin (background flush), its first and last seqno read."""

    batches: list[tuple[int, list[bytes], list[Item | bytes]]]
    count: int
    #: (vbucket, saved persistence cursor (ckpt, pos, last_read), first seqno, last seqno)
    touched: list[tuple[VBucket, Any, int, int]]
    #: the snapshot range each touched vbucket's state record gets (:meth:`Flusher._records`)
    snaps: list[tuple[int, int]] = field(default_factory=list)


class Flusher:
    """Persists the queued items of ``vbuckets`` to ``storage``.

    ``dirty`` holds the ids of vbuckets with items the flusher has not read (each vbucket adds itself through
    its ``on_dirty`` callback); ``batch_items`` bounds one :meth:`flush`.

    A flush runs inline (:meth:`flush`) or in the background (:meth:`begin`, docs/engine.md "Background
    flush"): the batch is read here, its transaction runs on the storage's writer thread, and it *lands* when
    the storage hands its outcome back -- at :meth:`settle` or at the start of any storage call, whichever
    comes first. Only then do its vbuckets' persisted seqnos move (what rollback mitigation, OBSERVE_SEQNO and
    the persist durability levels read), and only at :meth:`settle` (the bucket's hook, never inside another
    storage call) its checkpoints are freed and persist-level sync writes checked. A failed background flush
    leaves its items queued (:meth:`CheckpointManager.pin_persistence`) and its vbuckets dirty, as a failed
    inline flush does, and :meth:`settle` raises its error.
    """

    def __init__(self, storage: Storage, vbuckets: Sequence[VBucket], batch_items: int) -> None:
        self.storage = storage
        self.vbuckets = vbuckets
        self.batch_items = batch_items
        self.dirty: set[int] = set()
        self.items_flushed = 0
        #: flushes whose transaction failed (kv_engine counts the items, ``ep_item_flush_failed``), and the error
        #: of the last flush if it failed -- None once a flush committed again (docs/reliability.md "Full disk on a node")
        self.failures = 0
        self.error: str | None = None
        #: the background flush whose outcome the storage has not handed back, if any
        self._inflight: _Batch | None = None
        #: vbuckets of landed background flushes awaiting settle()'s follow-up; the error of a failed one
        self._landed: list[VBucket] = []
        self._error: StorageError | None = None

    def _read(self, limit: int, pin: bool) -> _Batch | None:
        """Read up to ``limit`` queued items from the dirty vbuckets' persistence cursors (pinning where each
        was, for a background flush)."""
        batches: list[tuple[int, list[bytes], list[Item | bytes]]] = []
        count = 0
        touched: list[tuple[VBucket, Any, int, int]] = []
        dirty = self.dirty
        vbs = self.vbuckets
        while dirty and count < limit:
            vbid = dirty.pop()
            vb = vbs[vbid]
            vb.dirty = False
            ck = vb.ckpt
            cur = ck.cursors[PERSISTENCE_CURSOR]
            saved = ck.pin_persistence() if pin else (cur.ckpt, cur.pos, cur.last_read)
            segments = ck.read_entries(cur, limit - count)
            first = None
            for seg in segments:
                if seg.items:
                    batches.append((vbid, seg.keys, seg.items))
                    count += len(seg.items)
                    if first is None:
                        first = seg.start
            if first is None:
                if pin:
                    ck.unpin_persistence(restore=False)  # nothing read: the cursor only moved over holes
                continue
            touched.append((vb, saved, first, cur.last_read))
            if ck.has_items_for(cur):
                vb.dirty = True
                dirty.add(vbid)
        if not touched:
            return None
        return _Batch(batches, count, touched)

    def _records(self, batch: _Batch) -> tuple[list[VBucketRecord], list[tuple[int, int]]]:
        """The state records the batch persists (each vbucket's as of its last seqno read) and, for replicas,
        the complete-snapshot boundaries it reaches."""
        records = []
        boundaries: list[tuple[int, int]] = []
        batch.snaps = []
        for vb, _saved, first, last in batch.touched:
            if vb.replica_snaps:
                # A replica records the producer's marker range (possibly partial) and the complete
                # snapshots' ends (docs/cluster.md: a replica persists in sequence order).
                snap, ends = vb.replica_persisted(last)
                boundaries.extend((vb.id, e) for e in ends)
            else:
                snap = (first, last)
            batch.snaps.append(snap)
            records.append(vbucket_record(vb, last, snap))
        return records, boundaries

    def _persisted(self, batch: _Batch) -> None:
        """The batch is on disk: its vbuckets' persisted seqnos and snapshots move to what it wrote."""
        self.error = None
        for (vb, _saved, _first, last), snap in zip(batch.touched, batch.snaps, strict=True):
            vb.persisted_seqno = last
            vb.persisted_snap = snap
        self.items_flushed += batch.count

    def _after(self, vbs: Iterable[VBucket]) -> None:
        for vb in vbs:
            if vb.replica_snaps:
                vb.replica_flushed(vb.persisted_seqno)
            vb.ckpt.remove_unreferenced()
            if vb.prepares and vb.durability is not None:
                vb.durability.check()  # persist levels: the active's own ack moved (docs/durability.md)

    def flush(self, max_items: int | None = None) -> int:
        """Persist queued items from each dirty vbucket's persistence cursor (one transaction); returns how
        many were persisted. A background flush in flight lands first (:meth:`settle`)."""
        n, touched = self._flush_batch(max_items)
        self._after(touched)
        return n

    def _flush_batch(self, max_items: int | None) -> tuple[int, list[VBucket]]:
        """:meth:`flush` without its follow-ups (:meth:`_after`): the items persisted, and the vbuckets whose
        follow-ups are due."""
        self.settle()
        batch = self._read(max_items or self.batch_items, pin=False)
        if batch is None:
            return 0, []
        records, boundaries = self._records(batch)
        try:
            self.storage.flush_batches(batch.batches, records, boundaries)
        except Exception as e:
            self._failed(e)
            dirty = self.dirty
            for vb, saved, _first, _last in batch.touched:
                cur = vb.ckpt.cursors[PERSISTENCE_CURSOR]
                cur.ckpt, cur.pos, cur.last_read = saved
                vb.dirty = True
                dirty.add(vb.id)
            raise
        self._persisted(batch)
        return batch.count, [vb for vb, _s, _f, _l in batch.touched]

    def flush_all(self) -> int:
        """Flush until no vbucket is dirty; returns the items persisted."""
        n = self.flush()
        while self.dirty:
            n += self.flush()
        return n

    def flush_round(self) -> int:
        """Persist everything queued now, the follow-ups once after the last transaction: what they queue --
        the commits of persist-level sync writes whose prepares just became durable on this node -- waits
        for the next flush instead of a transaction of its own (docs/durability.md "Flushing"). Returns the
        items persisted. A failing transaction raises after the follow-ups of those that committed ran."""
        n = 0
        touched: list[VBucket] = []
        try:
            while True:
                k, more = self._flush_batch(None)
                n += k
                touched += more
                if not self.dirty:
                    return n
        finally:
            self._after(dict.fromkeys(touched))  # once per vbucket, however many transactions touched it

    # ------------------------------------------------------------------ background flush
    @property
    def pending(self) -> bool:
        """A background flush is in flight or landed without :meth:`settle` yet."""
        return self._inflight is not None or bool(self._landed) or self._error is not None

    @property
    def landed(self) -> bool:
        """:meth:`settle` would not wait (no background flush in flight, or its transaction ended)."""
        return self.storage.flush_done

    def begin(self, max_items: int | None = None) -> int:
        """Start persisting up to ``max_items`` queued items on the storage's writer thread; returns how many.
        A background flush already in flight lands first (:meth:`settle`, which may wait)."""
        self.settle()
        batch = self._read(max_items or self.batch_items, pin=True)
        if batch is None:
            return 0
        records, boundaries = self._records(batch)
        self._inflight = batch
        # the writer process makes the rows and the superseded marks (engine/kv/storage_writer.py)
        self.storage.submit_flush(batch.batches, records, boundaries, self._land)
        return batch.count

    def _land(self, err: StorageError | None) -> None:
        """The storage's callback: the background flush's transaction ended (committed when ``err`` is None).
        Bookkeeping only -- it may run inside any storage call."""
        batch = self._inflight
        self._inflight = None
        if batch is None:
            return
        # A vbucket reset meanwhile (rollback, state change to dead) dropped the pin with its checkpoints:
        # what it was persisted for is gone, the reset wrote its own state.
        keep = [t[0].ckpt.flush_pin is t[1] for t in batch.touched]
        if not all(keep):
            live_ids = {t[0].id for t, k in zip(batch.touched, keep, strict=True) if k}
            batch.count = sum(len(e) for vbid, _keys, e in batch.batches if vbid in live_ids)
            batch.snaps = [sn for sn, k in zip(batch.snaps, keep, strict=True) if k]
            batch.touched = [t for t, k in zip(batch.touched, keep, strict=True) if k]
        live = batch.touched
        if err is None:
            for vb, _pin, _first, _last in live:
                vb.ckpt.unpin_persistence(restore=False)
            self._persisted(batch)
            self._landed.extend(vb for vb, _p, _f, _l in live)
            return
        dirty = self.dirty
        for vb, _pin, _first, _last in live:
            vb.ckpt.unpin_persistence(restore=True)
            vb.dirty = True
            dirty.add(vb.id)
        self._failed(err)
        self._error = err

    def _failed(self, e: BaseException) -> None:
        self.failures += 1
        self.error = str(e) or type(e).__name__

    def settle(self, wait: bool = True) -> int:
        """Land the background flush (waiting for its transaction unless ``wait`` is False and it has not
        ended), free what it persisted and check persist-level sync writes; raises its
        :class:`StorageError` if it failed (its items stay queued, its vbuckets dirty). Returns the vbuckets
        whose persisted seqno moved."""
        if self._inflight is not None and (wait or self.storage.flush_done):
            self.storage.settle()
        landed, self._landed = self._landed, []
        self._after(landed)
        err, self._error = self._error, None
        if err is not None:
            raise err
        return len(landed)


__all__ = ["Flusher"]
