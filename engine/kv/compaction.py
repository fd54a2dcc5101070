"""Compaction (kv_engine ``CompactTask`` / ``EPBucket::compactInternal``): purge history older than the
history window and tombstones older than the purge age (docs/engine.md "Compaction", "Rollback history").

The highest seqno of a vbucket is never purged (a disk snapshot always ends on a present item), and nothing a
running backfill may still read is purged (couchstore's file snapshot gives this for free; here a
backfilling stream's read position pins the purge).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.kv.item import Op
from engine.kv.storage import Storage, VBucketRecord, vbucket_record
from engine.kv.vbucket import VBucket


class Compactor:
    """Compacts vbuckets' storage; ``history_seqnos`` and ``tombstone_purge_age_s`` are the bucket's
    settings, ``clock`` its clock."""

    def __init__(
        self, storage: Storage, *, history_seqnos: int, tombstone_purge_age_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.storage = storage
        self.history_seqnos = history_seqnos
        self.tombstone_purge_age_s = tombstone_purge_age_s
        self.clock = clock

    def compact(self, vbuckets: Iterable[VBucket]) -> None:
        cutoff = self.clock() - self.tombstone_purge_age_s
        records: list[VBucketRecord] = []
        for vb in vbuckets:
            pin = vb.persisted_seqno
            for s in vb.streams:
                if s.state.value == "backfilling":
                    pin = min(pin, s.last_read)
            history_upto = min(vb.persisted_seqno - self.history_seqnos, pin)
            tomb_upto = min(vb.persisted_seqno - 1, pin)
            hmax, tmax = self.storage.compact(vb.id, history_upto, tomb_upto, int(cutoff))
            changed = False
            if hmax > vb.history_start:
                vb.history_start = hmax
                changed = True
            if tmax > vb.purge_seqno:
                vb.purge_seqno = tmax
                changed = True
                for key, it in list(vb.ht.items()):
                    if it.op is not Op.MUTATION and it.seqno <= tmax and it.expiry < cutoff:
                        # kv_engine's compaction keeps the purged tombstones' highest rev seqno: a key
                        # created again continues its revisions (XDCR's seqno conflict resolution relies on it)
                        if it.rev_seqno > vb.max_deleted_rev:
                            vb.max_deleted_rev = it.rev_seqno
                        del vb.ht[key]
            if changed:
                records.append(vbucket_record(vb))
        if records:
            self.storage.save_states(records)


__all__ = ["Compactor"]
