"""Warmup (kv_engine ``Warmup``): build a bucket's vbuckets from its storage when the bucket opens.

Every vbucket state record becomes a :class:`VBucket` with its failover log, persisted seqnos and snapshot
bookkeeping; then the current version of every key is loaded into the hash tables (no value eviction: every
document is resident, docs/engine.md).

The failover log (kv_engine ``Warmup`` and ``FailoverTable``; docs/rollback.md "The failover log"): a new vbucket gets an entry at 0; opening after an
**unclean** shutdown (no clean-shutdown marker) adds an entry to every active vbucket at the last persisted
snapshot end if the persisted high seqno equals it, else at its start. A clean close adds none.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from engine.config import BucketConfig
from engine.exceptions import InvalidArgument
from engine.kv.checkpoint import MemoryCounter
from engine.kv.storage import Storage, VBucketRecord, item_from_row, vbucket_record
from engine.kv.vbucket import VBucket, VBucketState
from schemas.failover_log import FailoverLog

#: the storage meta key of the clean-shutdown marker ("1" after a clean close, "0" while open)
CLEAN_SHUTDOWN = "clean_shutdown"


class Warmup:
    """Loads one bucket's vbuckets from ``storage`` (:meth:`run`, once, when the bucket opens).

    ``was_clean`` / ``first_open`` are read at construction: whether the last close was clean, and whether
    the storage is new. The vbuckets get the bucket's memory ``counter``, ``clock`` and ``on_dirty`` (the
    flusher's dirty set); ``new_state_cas`` draws each vbucket's partition-state CAS.
    """

    def __init__(
        self, storage: Storage, config: BucketConfig, *, counter: MemoryCounter, clock: Callable[[], float],
        hlc_clock: Callable[[], int], rng: random.Random, on_dirty: Callable[[int], None],
        new_state_cas: Callable[[], int],
    ) -> None:
        self.storage = storage
        self.config = config
        self.counter = counter
        self.clock = clock
        self.hlc_clock = hlc_clock
        self.rng = rng
        self.on_dirty = on_dirty
        self.new_state_cas = new_state_cas
        self.was_clean = storage.get_meta(CLEAN_SHUTDOWN) == "1"
        self.first_open = storage.get_meta("created") is None

    def _new_vbucket(self, vbid: int, state: VBucketState, failover: FailoverLog, high: int) -> VBucket:
        c = self.config
        return VBucket(
            vbid, state, failover, self.counter, self.clock, hlc_clock=self.hlc_clock, high_seqno=high,
            max_value_size=c.max_value_size, checkpoint_max_items=c.checkpoint_max_items,
            checkpoint_max_bytes=c.checkpoint_max_bytes, on_dirty=self.on_dirty,
        )

    def _failover_log(self, pairs: list[tuple[int, int]] | None = None) -> FailoverLog:
        m = self.config.failover_log_max_entries
        if pairs is None:
            return FailoverLog.new(max_entries=m, rng=self.rng)
        return FailoverLog.from_pairs(pairs, max_entries=m, rng=self.rng)

    def run(self) -> list[VBucket]:
        """The bucket's vbuckets, ``0 .. num_vbuckets - 1``, warmed up; new and changed state records saved."""
        storage = self.storage
        records = storage.load_states()
        new_records: list[VBucketRecord] = []
        vbs: list[VBucket] = []
        for vbid in range(self.config.num_vbuckets):
            rec = records.get(vbid)
            if rec is None:
                vb = self._new_vbucket(vbid, VBucketState.ACTIVE, self._failover_log(), 0)
                new_records.append(vbucket_record(vb))
            else:
                fo = self._failover_log(rec.failover)
                vb = self._new_vbucket(vbid, VBucketState(rec.state), fo, rec.high_seqno)
                vb.purge_seqno = rec.purge_seqno
                vb.history_start = rec.history_start
                vb.max_cas = rec.max_cas
                vb.max_deleted_rev = rec.max_deleted_rev
                vb.persisted_snap = (rec.snap_start, rec.snap_end)
                if vb.state is not VBucketState.ACTIVE:
                    # Replica warmup: the last complete snapshot persisted, and a partial one to resume inside.
                    b = storage.snapshot_boundary(vbid, rec.high_seqno)
                    if rec.snap_start <= rec.high_seqno < rec.snap_end:
                        vb.replica_snaps.append([rec.high_seqno, rec.snap_start, rec.snap_end])
                    else:
                        # The persisted state ends at a snapshot end: complete there. (A copy that was active
                        # before -- a rebalance keeps the old active as a replica -- has no boundary rows for what
                        # it wrote as the active; kv_engine: a replica's last complete snapshot is its high seqno
                        # when no snapshot is partially received.)
                        b = max(b, rec.high_seqno)
                    vb.snapshot_complete = vb.snapshot_persisted = b
                if not self.was_clean and vb.state is VBucketState.ACTIVE:
                    # kv_engine warmup: entry at the last snapshot end if the high seqno equals it, else start.
                    at = rec.snap_end if rec.high_seqno == rec.snap_end else rec.snap_start
                    fo.create_entry(at)
                    new_records.append(vbucket_record(vb))
            # docs/cluster.md "Partition-state CAS": generated afresh on every startup.
            vb.state_cas = self.new_state_cas()
            vbs.append(vb)
        for row in storage.current_all():
            vbs[row[0]].load(item_from_row(row))
        if len(records) > self.config.num_vbuckets:
            raise InvalidArgument(
                f"storage holds {len(records)} vbuckets but num_vbuckets is {self.config.num_vbuckets}")
        if new_records:
            storage.save_states(new_records)
        if self.first_open:
            storage.set_meta("created", str(int(self.clock())))
        return vbs


__all__ = ["CLEAN_SHUTDOWN", "Warmup"]
