"""DCP takeover streams (kv_engine ``dcp/active_stream.cc``: ``takeoverSendPhase`` / ``takeoverWaitPhase``).

A stream requested with the ``TAKEOVER`` flag (0x01) moves its vbucket's active role to the consumer without a
new failover entry (docs/rebalance.md "The takeover stream (engine side)"):

1. **takeover-send**: the stream sends what the vbucket holds, every snapshot marker carrying the ``ACK`` flag
   (0x08); the consumer acknowledges each marker once applied (kv_engine ``snapshotMarkerAckReceived``);
2. when caught up (nothing left in its cursor or ready queue) and every marker acknowledged, it sends a DCP
   ``SET_VBUCKET_STATE(pending)`` and goes to **takeover-wait**;
3. on the consumer's ack (``setVBucketStateAckRecieved``) the producer marks **its own vbucket dead** (writes now
   answer NOT_MY_VBUCKET; other streams of the vbucket end STATE_CHANGED, this one does not) and goes back to
   takeover-send to **drain the rest**;
4. caught up again -> ``SET_VBUCKET_STATE(active)`` -> takeover-wait; on that ack the stream ends **OK**.

The consumer (engine/dcp/replication.py) sets its vbucket pending on the first message and active with
``transfer`` (``promote(takeover=True)``: no failover entry) on the second.
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from engine.dcp.stream import (
    ActiveStream,
    SetVBucketStateMessage,
    SnapshotFlags,
    SnapshotMarker,
    StreamEndReason,
    StreamState,
)
from engine.exceptions import InvalidArgument
from engine.kv.vbucket import VBucketState

#: ns_server's vbucket mover (docs/rebalance.md "The mover", backfill phase): under this many items left the new vbucket is "almost up to date"
ALMOST_CAUGHT_UP_ITEMS: Final = 1000


class TakeoverPhase(Enum):
    SEND = "takeover-send"
    WAIT = "takeover-wait"


class TakeoverStream(ActiveStream):
    """An :class:`ActiveStream` with kv_engine's takeover-send / takeover-wait phases (module docstring)."""

    def _start(self) -> None:
        self.phase = TakeoverPhase.SEND
        #: the state the next SET_VBUCKET_STATE message asks for (kv_engine ``takeoverState``)
        self.takeover_state = VBucketState.PENDING
        #: markers sent with ACK and not acknowledged yet (kv_engine ``waitForSnapshot``)
        self.waiting_marker_acks = 0
        self.marker_acks = 0
        self._marking_dead = False
        super()._start()

    def __repr__(self) -> str:
        return (f"TakeoverStream(vb={self.vbid} {self.state.value}/{self.phase.value} "
                f"next={self.takeover_state.value} last_read={self.last_read})")

    # ------------------------------------------------------------------ producing
    def _caught_up(self) -> bool:
        if self.ready or self.state is not StreamState.IN_MEMORY:
            return False
        cur = self.cursor
        return cur is not None and not cur.dropped and not self.vb.ckpt.has_items_for(cur)

    def has_work(self) -> bool:
        if self.ready:
            return True
        if self.state is StreamState.DEAD or self.phase is TakeoverPhase.WAIT:
            return False
        if self.takeover_state is VBucketState.ACTIVE and self.vb.state is not VBucketState.DEAD:
            return True  # reverted: fill() ends the stream
        if self._caught_up():
            return self.waiting_marker_acks == 0  # the next SET_VBUCKET_STATE can go
        return super().has_work()

    def fill(self, max_items: int) -> None:
        if self.state is StreamState.DEAD or self.phase is TakeoverPhase.WAIT:
            return
        if self.takeover_state is VBucketState.ACTIVE and self.vb.state is not VBucketState.DEAD:
            # The mover reverted the takeover (original states back, docs/rebalance.md "The mover"): never hand the active role
            # over now -- the stream ends and the consumer's copy stays a replica.
            self.end_stream(StreamEndReason.STATE_CHANGED)
            return
        if self._caught_up():
            if self.waiting_marker_acks == 0:
                # kv_engine takeoverSendPhase: nothing queued and no marker awaiting its ack -> set state.
                self.ready.append(SetVBucketStateMessage(self.vbid, self.takeover_state))
                self.phase = TakeoverPhase.WAIT
            return
        before = len(self.ready)
        super().fill(max_items)
        if len(self.ready) == before:
            return
        # Every marker of a takeover stream asks the consumer for an ack (kv_engine ActiveStream::snapshot).
        out = list(self.ready)
        for i in range(before, len(out)):
            m = out[i]
            if type(m) is SnapshotMarker:
                out[i] = SnapshotMarker(m.vbucket, m.start, m.end, m.flags | SnapshotFlags.ACK)
                self.waiting_marker_acks += 1
        self.ready.clear()
        self.ready.extend(out)

    # ------------------------------------------------------------------ acks from the consumer
    def marker_acked(self) -> None:
        """The consumer applied a marker sent with ACK."""
        if self.waiting_marker_acks <= 0:
            raise InvalidArgument(f"vbucket {self.vbid}: unexpected snapshot-marker ack")
        self.waiting_marker_acks -= 1
        self.marker_acks += 1
        self.notify()

    def set_state_acked(self) -> None:
        """The consumer executed our last SET_VBUCKET_STATE (kv_engine ``setVBucketStateAckRecieved``)."""
        if self.state is StreamState.DEAD or self.phase is not TakeoverPhase.WAIT:
            raise InvalidArgument(f"vbucket {self.vbid}: unexpected set-vbucket-state ack")
        if self.takeover_state is VBucketState.PENDING:
            # The producer marks its own vbucket dead (front-end writes stop) and drains the rest.
            self._marking_dead = True
            try:
                self.producer.bucket.set_vbucket_state(self.vbid, VBucketState.DEAD)
            finally:
                self._marking_dead = False
            self.takeover_state = VBucketState.ACTIVE
            self.phase = TakeoverPhase.SEND
            self.notify()
        else:
            self._queue_end(StreamEndReason.OK)

    def end_stream(self, reason: StreamEndReason | int) -> None:
        if self._marking_dead and reason == StreamEndReason.STATE_CHANGED:
            return  # our own takeover turned the vbucket dead: this stream drains the rest
        super().end_stream(reason)

    # ------------------------------------------------------------------ stats
    def items_remaining(self) -> int:
        """Estimate of items still to send (kv_engine ``getItemsRemaining``, by seqno: an upper bound when the
        checkpoint de-duplicated some)."""
        queued = sum(1 for m in self.ready if not isinstance(m, (SnapshotMarker, SetVBucketStateMessage)))
        return max(0, self.vb.high_seqno - self.last_read) + queued


__all__ = [
    "ALMOST_CAUGHT_UP_ITEMS", "SetVBucketStateMessage", "TakeoverPhase", "TakeoverStream",
]
