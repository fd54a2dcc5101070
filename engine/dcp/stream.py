"""DCP active streams: snapshot markers, items, stream end (kv_engine ``dcp/active_stream.cc``).

A stream moves through the kv_engine states: backfilling (disk snapshot, read in bounded chunks by its
backfill, engine/dcp/backfill.py) -> in-memory (point-in-time snapshots read from its checkpoint cursor) ->
dead. A stream whose cursor was dropped under memory pressure goes back to backfilling from ``last_read + 1``;
it does not end.

Snapshot rules (kv_engine ``ActiveStream`` / ``CheckpointManager``; docs/engine.md "Snapshots, de-duplication and
consistency"):

* disk marker = DISK|CHK, start = min(requested snap start, backfill start) on the first marker, end = the
  backfill end (the persisted seqno when the backfill was scheduled); the disk snapshot is the consistent state
  as of that seqno, de-duplicated;
* memory marker = MEMORY, plus CHK at a checkpoint boundary or after a phase change; the first marker's start
  is min(requested snap start, first seqno);
* every marker precedes its items; items are in seqno order; the snapshot that contains the end seqno is sent
  whole, then the stream ends with OK (kv_engine ``ActiveStream::endStream``; docs/engine.md "Terms").

A stream buffers one batch of whole snapshots in its ready queue (as kv_engine's readyQ does), so a snapshot
stays consistent even if the consumer pauses it through flow control mid-snapshot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum, IntFlag
from typing import TYPE_CHECKING, Final

from engine.dcp.backfill import BackfillManager, DiskBackfill
from engine.kv.checkpoint import Cursor
from engine.kv.item import Item
from schemas.dcp import SnapshotFlags, StreamEndReason

if TYPE_CHECKING:
    from engine.dcp.producer import DcpProducer
    from engine.kv.vbucket import VBucket, VBucketState


class StreamFlags(IntFlag):
    """Stream-request flags (kv_engine ``DCP_ADD_STREAM_FLAG_*``)."""

    NONE = 0
    TAKEOVER = 0x01
    DISK_ONLY = 0x02
    TO_LATEST = 0x04
    ACTIVE_VB_ONLY = 0x10
    STRICT_VBUUID = 0x20
    FROM_LATEST = 0x40
    IGNORE_PURGED_TOMBSTONES = 0x80


class StreamState(Enum):
    BACKFILLING = "backfilling"
    IN_MEMORY = "in-memory"
    DEAD = "dead"


MARKER_SIZE: Final = 24 + 20
STREAM_END_SIZE: Final = 24 + 4
MAX_SEQNO: Final = 2**64 - 1
#: a byte budget at or above this means "no flow control"
_UNLIMITED: Final = 1 << 62
#: a memory snapshot's flags when it starts a checkpoint (``IntFlag.__or__`` is Python code: ~1 µs per marker)
_MEMORY_CHK: Final = SnapshotFlags.MEMORY | SnapshotFlags.CHK


@dataclass(frozen=True, slots=True)
class SnapshotMarker:
    vbucket: int
    start: int
    end: int
    flags: SnapshotFlags

    @property
    def dcp_size(self) -> int:
        return MARKER_SIZE

    @property
    def is_disk(self) -> bool:
        return bool(self.flags & SnapshotFlags.DISK)


@dataclass(frozen=True, slots=True)
class StreamEnd:
    vbucket: int
    reason: StreamEndReason

    @property
    def dcp_size(self) -> int:
        return STREAM_END_SIZE


SET_VBUCKET_STATE_SIZE: Final = 24 + 1


@dataclass(frozen=True, slots=True)
class SetVBucketStateMessage:
    """DCP ``SET_VBUCKET_STATE`` sent by a takeover stream, pending then active (engine/dcp/takeover.py)."""

    vbucket: int
    state: VBucketState

    @property
    def dcp_size(self) -> int:
        return SET_VBUCKET_STATE_SIZE


#: what a producer hands its consumer: markers, data items (op = mutation / deletion / expiration), ends,
#: and the takeover stream's set-vbucket-state messages.
Message = SnapshotMarker | Item | StreamEnd | SetVBucketStateMessage


class ActiveStream:
    """One vbucket's stream on a producer connection; ``backfill_manager`` (the producer's) reads
    what is no longer in memory from disk."""

    def __init__(
        self,
        producer: DcpProducer,
        vb: VBucket,
        backfill_manager: BackfillManager,
        *,
        opaque: int,
        flags: StreamFlags,
        start: int,
        end: int,
        vbuuid: int,
        snap_start: int,
        snap_end: int,
    ) -> None:
        self.producer = producer
        self.vb = vb
        self.vbid = vb.id
        self.backfill_manager = backfill_manager
        self.opaque = opaque
        self.flags = flags
        self.start = start
        self.end = end
        self.vbuuid = vbuuid
        self.snap_start = snap_start
        self.snap_end = snap_end
        self.last_read = start
        self.last_sent = start
        self.ready: deque[Message] = deque()
        self.cursor_name = f"dcp:{producer.name}:{vb.id}"
        self.state = StreamState.BACKFILLING
        #: the running disk backfill (state backfilling), None otherwise
        self.backfill: DiskBackfill | None = None
        self._first_marker = True
        self._next_chk = False
        self.backfills = 0
        self.items_sent = 0
        self.cursor: Cursor | None = None
        self.queued = False  # in its producer's ready queue
        self._start()

    def __repr__(self) -> str:
        return f"ActiveStream(vb={self.vbid} {self.state.value} last_read={self.last_read} end={self.end})"

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        if self.start >= self.end:
            self._queue_end(StreamEndReason.OK)
            return
        self.vb.streams.append(self)
        self._schedule(self.last_read)

    def _schedule(self, last_read: int) -> None:
        """Continue from ``last_read``: from memory if it is still there, else backfill from disk first."""
        ck = self.vb.ckpt
        cur = ck.register_cursor(self.cursor_name, last_read)
        if cur is not None and not (self.flags & StreamFlags.DISK_ONLY):
            self.cursor = cur
            self.state = StreamState.IN_MEMORY
            return
        upto = self.vb.persisted_seqno
        if self.flags & StreamFlags.DISK_ONLY:
            upto = min(upto, self.end)
        if upto <= last_read:  # nothing on disk to read: everything after last_read is in memory
            cur = ck.register_cursor(self.cursor_name, last_read)
            assert cur is not None, "unpersisted items are always in memory"
            self.cursor = cur
            self.state = StreamState.IN_MEMORY
            return
        # kv_engine registers the cursor when scheduling the backfill so the memory items after the backfill
        # end are retained while the backfill runs.
        if not (self.flags & StreamFlags.DISK_ONLY):
            self.cursor = ck.register_cursor(self.cursor_name, upto)
        self.state = StreamState.BACKFILLING
        self.backfill = self.backfill_manager.schedule(self, last_read, upto)
        self.backfills += 1

    def end_stream(self, reason: StreamEndReason | int) -> None:
        """End the stream: drop what is not sent yet and queue a stream-end message."""
        if self.state is StreamState.DEAD:
            return
        self.ready.clear()
        self._queue_end(StreamEndReason(reason))

    def _queue_end(self, reason: StreamEndReason) -> None:
        self.state = StreamState.DEAD
        if self.backfill is not None:
            self.backfill_manager.cancel(self.backfill)
            self.backfill = None
        self.vb.ckpt.remove_cursor(self.cursor_name)
        if self in self.vb.streams:
            self.vb.streams.remove(self)
        self.ready.append(StreamEnd(self.vbid, reason))
        self.producer.notify(self)

    def notify(self) -> None:
        self.producer.notify(self)

    # ------------------------------------------------------------------ producing
    def has_work(self) -> bool:
        if self.ready:
            return True
        if self.state is StreamState.IN_MEMORY:
            cur = self.cursor
            return cur is not None and (cur.dropped or self.vb.ckpt.has_items_for(cur))
        return self.state is StreamState.BACKFILLING

    def fill(self, max_items: int) -> None:
        """Move the next batch of whole snapshots into the ready queue."""
        if self.state is StreamState.BACKFILLING:
            self._fill_backfill()
        elif self.state is StreamState.IN_MEMORY:
            cur = self.cursor
            if cur is None or cur.dropped:
                # Cursor dropped: back to backfilling from what we have read (kv_engine: does not end).
                self._next_chk = True
                self._schedule(self.last_read)
                now: StreamState = self.state
                if now is StreamState.BACKFILLING:
                    self._fill_backfill()
                    return
            self._fill_memory(max_items)

    def _fill_backfill(self) -> None:
        backfill = self.backfill
        assert backfill is not None
        self.backfill_manager.run(backfill)

    # ------------------------------------------------------------------ fed by the backfill
    @property
    def sync_writes(self) -> bool:
        """Whether the connection enabled sync writes (prepares and aborts are sent)."""
        return self.producer.sync_writes

    def mark_disk_snapshot(self, start: int, end: int) -> None:
        """The backfill's disk snapshot marker (kv_engine ``ActiveStream::markDiskSnapshot``)."""
        if self._first_marker:
            start = min(self.snap_start, start)
            self._first_marker = False
        self.ready.append(SnapshotMarker(self.vbid, start, end, SnapshotFlags.DISK | SnapshotFlags.CHK))

    def backfill_received(self, items: Iterable[Item], last_seqno: int) -> None:
        """A chunk of the disk snapshot read up to ``last_seqno`` (``backfillReceived``)."""
        self.last_read = last_seqno
        self.ready.extend(items)

    def complete_backfill(self, upto: int) -> None:
        """The disk snapshot was read up to ``upto`` (``completeBackfill``): end, or continue from memory."""
        self.backfill = None
        self.last_read = upto
        self._next_chk = True
        if upto >= self.end:
            self._queue_end(StreamEndReason.OK)
            return
        if self.flags & StreamFlags.DISK_ONLY:
            self._queue_end(StreamEndReason.OK)
            return
        cur = self.cursor
        if cur is None or cur.dropped:
            self._schedule(upto)
        else:
            self.state = StreamState.IN_MEMORY

    def _fill_memory(self, max_items: int) -> None:
        cur = self.cursor
        assert cur is not None
        segments = self.vb.ckpt.read(cur, max_items)
        ready = self.ready
        vbid = self.vbid
        end = self.end
        hide = self.vb.sync_seen and not self.producer.sync_writes
        for seg in segments:
            if not seg.items:
                continue
            items = seg.items
            send_end = seg.end
            if hide:
                # kv_engine (docs/durability.md "DCP"): a client that did not enable sync writes never sees prepares or
                # aborts; the commit reaches it as a plain mutation at the commit's seqno. Its marker ends at
                # the last visible seqno (max visible seqno); a snapshot with nothing visible is not sent.
                items = [it for it in items if it.op < 3]
                if not items:
                    self._next_chk = self._next_chk or seg.new_checkpoint
                    self.last_read = seg.end
                    if seg.end >= end:
                        self._queue_end(StreamEndReason.OK)
                        return
                    continue
                send_end = items[-1].seqno
            flags = SnapshotFlags.MEMORY
            if seg.new_checkpoint or self._next_chk:
                flags = _MEMORY_CHK
                self._next_chk = False
            start = seg.start
            if self._first_marker:
                start = min(self.snap_start, start)
                self._first_marker = False
            ready.append(SnapshotMarker(vbid, start, send_end, flags))
            ready.extend(items)
            self.last_read = seg.end
            if seg.end >= end:
                # The snapshot containing the end seqno was sent whole.
                self._queue_end(StreamEndReason.OK)
                return

    def take(self, max_messages: int, byte_budget: int, out: list[Message]) -> int:
        """Pop up to ``max_messages`` ready messages into ``out`` while under ``byte_budget``.

        Returns the bytes taken. The last message may overshoot the budget (as kv_engine lets one large item
        overshoot the flow-control buffer).
        """
        ready = self.ready
        if not ready and self.state is not StreamState.DEAD:
            self.fill(max_messages)
        taken = 0
        n = 0
        if byte_budget >= _UNLIMITED:
            # No flow control: move whole messages without per-message size accounting.
            k = min(len(ready), max_messages)
            pop = ready.popleft
            last_item = None
            for _ in range(k):
                m = pop()
                out.append(m)
                if type(m) is Item:
                    last_item = m
                    n += 1
            if last_item is not None:
                self.last_sent = last_item.seqno
                self.items_sent += n
            return 0
        pop = ready.popleft
        append = out.append
        last_item = None
        items = 0
        while ready and n < max_messages and taken < byte_budget:
            m = pop()
            append(m)
            taken += m.dcp_size
            n += 1
            if type(m) is Item:
                last_item = m
                items += 1
        if last_item is not None:  # once per batch, not per item (the gateway's hot path)
            self.last_sent = last_item.seqno
            self.items_sent += items
        return taken
