"""Disk backfills (kv_engine ``dcp/backfill_manager.cc``, ``dcp/backfill_disk.cc``, ``DCPBackfillBySeqnoDisk``).

A stream whose next seqno is no longer in memory is fed from disk first: its backfill reads the consistent
state of the vbucket as of the backfill end (the persisted seqno when it was scheduled) with seqnos after the
stream's last read, de-duplicated (docs/engine.md "Disk snapshots are exact as-of snapshots"). The backfill
hands the stream what it reads and the stream queues it in its ready queue, as kv_engine's
``ActiveStream::markDiskSnapshot`` / ``backfillReceived`` / ``completeBackfill`` do.

Bounded steps: each :meth:`BackfillManager.run` of a backfill reads at most ``scan_items`` rows (kv_engine's
scan buffer). The engine is synchronous, so a step runs when the producer asks the stream for more messages
and its ready queue is empty: a paused consumer stops the scan (kv_engine's backfill snoozes on a full
buffer).

States (kv_engine ``backfill_state_t``): create (the disk snapshot marker) -> scan (chunks) -> done.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from engine.kv.item import Item
from engine.kv.storage import Storage, item_from_row

if TYPE_CHECKING:
    from engine.kv.storage import Row


class BackfillStream(Protocol):
    """What a backfill needs of the stream it feeds (kv_engine ``ActiveStream``'s backfill callbacks)."""

    @property
    def vbid(self) -> int: ...

    @property
    def sync_writes(self) -> bool: ...

    def mark_disk_snapshot(self, start: int, end: int) -> None: ...

    def backfill_received(self, items: Iterable[Item], last_seqno: int) -> None: ...

    def complete_backfill(self, upto: int) -> None: ...


class BackfillState(Enum):
    CREATE = "create"
    SCAN = "scan"
    DONE = "done"


class DiskBackfill:
    """One stream's disk backfill: seqnos in ``(after, upto]`` of the state as of ``upto``."""

    def __init__(self, stream: BackfillStream, storage: Storage, after: int, upto: int, scan_items: int) -> None:
        self.stream = stream
        self.storage = storage
        self.vbid = stream.vbid
        self.start = after + 1
        self.upto = upto
        #: the last seqno read (the next chunk starts after it)
        self.position = after
        self.scan_items = scan_items
        self.state = BackfillState.CREATE
        self.items_scanned = 0

    def __repr__(self) -> str:
        return f"DiskBackfill(vb={self.vbid} {self.state.value} ({self.position}, {self.upto}])"

    def run(self) -> BackfillState:
        """One bounded step: the marker (first step) and the next chunk; returns the state after it."""
        if self.state is BackfillState.CREATE:
            self._create()
        if self.state is BackfillState.SCAN:
            self._scan()
        return self.state

    def cancel(self) -> None:
        """The stream ended (or went elsewhere): nothing more is read."""
        self.state = BackfillState.DONE

    def _create(self) -> None:
        # kv_engine / docs/durability.md: a client without sync writes gets the disk snapshot up to its max
        # visible seqno (prepares and aborts are not sent); none visible: no marker at all.
        self.state = BackfillState.SCAN
        end = self.upto
        if not self.stream.sync_writes:
            end = self.storage.max_visible_seqno(self.vbid, self.position, self.upto)
        if end:
            self.stream.mark_disk_snapshot(self.start, end)

    def _scan(self) -> None:
        upto = self.upto
        rows: list[Row] = self.storage.scan(self.vbid, self.position, upto, self.scan_items)
        if rows:
            self.position = rows[-1][1]
            self.items_scanned += len(rows)
            visible = rows if self.stream.sync_writes else [r for r in rows if r[9] < 3]
            self.stream.backfill_received(map(item_from_row, visible), self.position)
        if not rows or len(rows) < self.scan_items or self.position >= upto:
            self.state = BackfillState.DONE
            self.stream.complete_backfill(upto)


class BackfillManager:
    """The disk backfills of one producer connection (kv_engine ``BackfillManager``, one per ``DcpProducer``).

    :meth:`schedule` creates a stream's backfill; :meth:`run` moves it one bounded step (``scan_items`` rows
    at most); a finished or cancelled backfill leaves the manager.
    """

    def __init__(self, storage: Storage, scan_items: int) -> None:
        self.storage = storage
        self.scan_items = scan_items
        self.active: list[DiskBackfill] = []
        self.scheduled = 0
        self.items_scanned = 0

    def schedule(self, stream: BackfillStream, after: int, upto: int) -> DiskBackfill:
        """A backfill of ``stream``'s vbucket for seqnos in ``(after, upto]``."""
        backfill = DiskBackfill(stream, self.storage, after, upto, self.scan_items)
        self.active.append(backfill)
        self.scheduled += 1
        return backfill

    def run(self, backfill: DiskBackfill) -> BackfillState:
        """One bounded step of ``backfill``; returns its state after it."""
        if backfill.state is BackfillState.DONE:
            self._remove(backfill)
            return BackfillState.DONE
        before = backfill.items_scanned
        state = backfill.run()
        self.items_scanned += backfill.items_scanned - before
        if state is BackfillState.DONE:
            self._remove(backfill)
        return state

    def cancel(self, backfill: DiskBackfill) -> None:
        backfill.cancel()
        self._remove(backfill)

    def _remove(self, backfill: DiskBackfill) -> None:
        for i, b in enumerate(self.active):
            if b is backfill:
                del self.active[i]
                return


__all__ = ["BackfillManager", "BackfillState", "BackfillStream", "DiskBackfill"]
