"""DCP producer connections (kv_engine ``dcp/producer.cc``): stream requests, stepping, flow control.

The engine is synchronous: the consumer drives a connection by calling :meth:`DcpProducer.step`, which returns
the next messages of its streams in round-robin order -- what kv_engine's front-end thread does when the
connection's socket is writable. Flow control: with a ``buffer_size``, ``step`` hands out messages only while
the bytes not yet acknowledged with :meth:`buffer_acknowledge` are below it (one message may overshoot).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from engine.dcp.backfill import BackfillManager
from engine.dcp.stream import (
    MAX_SEQNO,
    ActiveStream,
    Message,
    StreamEnd,
    StreamEndReason,
    StreamFlags,
    StreamState,
)
from engine.dcp.takeover import TakeoverStream
from engine.exceptions import (
    EngineClosed,
    InvalidArgument,
    KeyExists,
    NotMyVBucket,
    RangeError,
    RollbackRequired,
)
from engine.kv.item import Item
from engine.kv.vbucket import VBucketState
from schemas.failover_log import FailoverEntry

if TYPE_CHECKING:
    from engine.config import BucketConfig
    from engine.dcp.conn_map import DcpConnMap
    from engine.kv.storage import Storage
    from engine.kv.vbucket import VBucket


class ProducerBucket(Protocol):
    """What a producer connection needs of its bucket (an :class:`~engine.bucket.Bucket`; kv_engine's
    ``DcpProducer`` holds its ``EventuallyPersistentEngine``)."""

    @property
    def config(self) -> BucketConfig: ...

    @property
    def storage(self) -> Storage: ...

    @property
    def connections(self) -> DcpConnMap: ...

    def vbucket(self, vbid: int) -> VBucket: ...

    def seqno_acknowledged(self, vbucket: int, node: str, seqno: int) -> int: ...

    def set_vbucket_state(self, vbucket: int, state: VBucketState, *, cas: int | None = None) -> int: ...


class DcpProducer:
    """A named DCP connection to one bucket."""

    def __init__(self, bucket: ProducerBucket, name: str, *, buffer_size: int = 0) -> None:
        if not name:
            raise InvalidArgument("a DCP connection needs a name")
        if buffer_size < 0:
            raise InvalidArgument("buffer_size must be >= 0 (0 disables flow control)")
        self.bucket = bucket
        self.name = name
        self.buffer_size = buffer_size
        self.unacked_bytes = 0
        self.streams: dict[int, ActiveStream] = {}
        #: the disk backfills of this connection's streams (engine/dcp/backfill.py)
        self.backfills = BackfillManager(bucket.storage, bucket.config.backfill_chunk_items)
        self._ready: deque[ActiveStream] = deque()
        self.closed = False
        self.paused = False
        self.bytes_sent = 0
        self.items_sent = 0
        #: DCP control ``enable_sync_writes`` (docs/durability.md "DCP"): prepares / commits / aborts are sent as such; without
        #: it they are hidden and a commit arrives as a plain mutation. ``consumer_name`` (kv_engine DCP control
        #: of the same name) names the replica node whose seqno-acks this connection carries.
        self.sync_writes = False
        self.consumer_name: str | None = None

    def __repr__(self) -> str:
        return f"DcpProducer({self.name!r} streams={len(self.streams)} unacked={self.unacked_bytes})"

    # ------------------------------------------------------------------ stream requests
    def stream_request(
        self,
        vbucket: int,
        start_seqno: int,
        end_seqno: int = MAX_SEQNO,
        vbuuid: int = 0,
        snap_start: int | None = None,
        snap_end: int | None = None,
        *,
        flags: StreamFlags | int = StreamFlags.NONE,
        opaque: int = 0,
        failover_log: Sequence[FailoverEntry] | None = None,
    ) -> list[FailoverEntry]:
        """Open a stream; returns the vbucket's failover log (newest first) on OK.

        Checks in the order of kv_engine ``DcpProducer::streamRequest`` (docs/rollback.md for the rollback check): NOT_MY_VBUCKET, FROM_LATEST,
        start > end, snapshot range, duplicate stream, rollback, TO_LATEST / DISK_ONLY, start > high.
        ``failover_log`` (the client's whole log, newest first) enables the product's common-ancestor
        rollback decision instead of kv_engine's newest-vbuuid-only rule (docs/rollback.md).
        """
        if self.closed:
            raise EngineClosed(f"connection {self.name!r} is closed")
        flags = StreamFlags(flags)
        for name, v in (("start_seqno", start_seqno), ("end_seqno", end_seqno), ("vbuuid", vbuuid)):
            if type(v) is not int or v < 0 or v > MAX_SEQNO:
                raise InvalidArgument(f"{name} must be an unsigned 64-bit integer, got {v!r}")
        snap_start = start_seqno if snap_start is None else snap_start
        snap_end = start_seqno if snap_end is None else snap_end
        vb = self.bucket.vbucket(vbucket)
        allowed = (VBucketState.ACTIVE,) if flags & StreamFlags.ACTIVE_VB_ONLY else (
            VBucketState.ACTIVE, VBucketState.REPLICA)
        if vb.state not in allowed:
            raise NotMyVBucket(f"vbucket {vbucket} is {vb.state.value}")
        high = vb.high_seqno
        if flags & StreamFlags.FROM_LATEST:
            # kv_engine also takes the vbucket's current uuid: the client is asking for "now".
            start_seqno = snap_start = snap_end = high
            vbuuid = vb.failover.latest.vbuuid
            failover_log = None
        if start_seqno > end_seqno:
            raise RangeError(f"start seqno {start_seqno} > end seqno {end_seqno}")
        if not snap_start <= start_seqno <= snap_end:
            raise RangeError(
                f"start seqno {start_seqno} outside snapshot [{snap_start}, {snap_end}]")
        existing = self.streams.get(vbucket)
        if existing is not None and existing.state is not StreamState.DEAD:
            raise KeyExists(f"a stream for vbucket {vbucket} is already open on {self.name!r}")
        purge = 0 if flags & StreamFlags.IGNORE_PURGED_TOMBSTONES else vb.purge_seqno
        rollback = vb.failover.stream_rollback(
            start_seqno, high, vbuuid, snap_start, snap_end, purge,
            client_log=list(failover_log) if failover_log else None,
            strict_vbuuid=bool(flags & StreamFlags.STRICT_VBUUID))
        if rollback is not None:
            raise RollbackRequired(vbucket, rollback)
        if flags & StreamFlags.TO_LATEST:
            end_seqno = high
        elif flags & StreamFlags.DISK_ONLY:
            end_seqno = vb.persisted_seqno
        if start_seqno > high:
            raise RangeError(f"start seqno {start_seqno} > high seqno {high}")
        if flags & StreamFlags.TAKEOVER:
            # kv_engine: a takeover stream has no end; it ends OK after the consumer became active.
            end_seqno = MAX_SEQNO
        cls = TakeoverStream if flags & StreamFlags.TAKEOVER else ActiveStream
        stream = cls(
            self, vb, self.backfills, opaque=opaque, flags=flags, start=start_seqno, end=end_seqno,
            vbuuid=vbuuid, snap_start=snap_start, snap_end=snap_end)
        self.streams[vbucket] = stream
        self.notify(stream)
        return list(vb.failover.entries)

    def close_stream(self, vbucket: int) -> None:
        """Close a stream at the consumer's request; a stream-end(CLOSED) follows in :meth:`step`."""
        s = self.streams.get(vbucket)
        if s is None or s.state is StreamState.DEAD:
            raise NotMyVBucket(f"no open stream for vbucket {vbucket} on {self.name!r}")
        s.end_stream(StreamEndReason.CLOSED)

    def discard_stream(self, vbucket: int) -> None:
        """Forget a stream the consumer closed without delivering its stream-end: kv_engine sends none for
        a close the consumer asked for (unless send_stream_end_on_client_close_stream was enabled)."""
        old = self.streams.pop(vbucket, None)
        if old is not None:
            old.ready.clear()

    # ------------------------------------------------------------------ takeover (engine/dcp/takeover.py)
    def _takeover_stream(self, vbucket: int) -> TakeoverStream:
        s = self.streams.get(vbucket)
        if not isinstance(s, TakeoverStream) or s.state is StreamState.DEAD:
            raise NotMyVBucket(f"no takeover stream for vbucket {vbucket} on {self.name!r}")
        return s

    def snapshot_marker_ack(self, vbucket: int) -> None:
        """The consumer's response to a marker sent with the ACK flag (kv_engine
        ``DcpProducer::handleResponse`` -> ``snapshotMarkerAckReceived``)."""
        self._takeover_stream(vbucket).marker_acked()

    def set_vbucket_state_ack(self, vbucket: int) -> None:
        """The consumer's response to a DCP SET_VBUCKET_STATE (``setVBucketStateAckRecieved``)."""
        self._takeover_stream(vbucket).set_state_acked()

    def takeover_stats(self, vbucket: int) -> dict[str, int | str]:
        """kv_engine ``stats dcp-vbtakeover <vb> <connection>``: ``status`` and ``estimate`` (items left to
        send). Without a stream on this connection: ``does_not_exist`` with every item of the vbucket."""
        s = self.streams.get(vbucket)
        if s is None or s.state is StreamState.DEAD:
            vb = self.bucket.vbucket(vbucket)
            return {"name": self.name, "status": "does_not_exist", "estimate": vb.high_seqno,
                    "vb_state": vb.state.value}
        if isinstance(s, TakeoverStream):
            estimate = s.items_remaining()
            status = s.phase.value if s.state is StreamState.IN_MEMORY else s.state.value
        else:
            estimate = max(0, s.vb.high_seqno - s.last_read) + sum(1 for m in s.ready if type(m) is Item)
            status = s.state.value
        return {"name": self.name, "status": status, "estimate": estimate, "vb_state": s.vb.state.value,
                "last_sent": s.last_sent}

    def get_failover_log(self, vbucket: int) -> list[FailoverEntry]:
        return list(self.bucket.vbucket(vbucket).failover.entries)

    # ------------------------------------------------------------------ sync replication (docs/durability.md)
    def control(self, key: str, value: str) -> None:
        """DCP control (kv_engine ``DcpProducer::control``): ``enable_sync_writes`` = ``true``/``false`` and
        ``consumer_name``; unknown keys: :class:`InvalidArgument`. Sync writes must be enabled before the
        streams that should carry them are opened (kv_engine negotiates them on connection setup)."""
        if key == "enable_sync_writes":
            if value not in ("true", "false"):
                raise InvalidArgument(f"enable_sync_writes must be true or false, got {value!r}")
            self.sync_writes = value == "true"
        elif key == "consumer_name":
            if not value:
                raise InvalidArgument("consumer_name must not be empty")
            self.consumer_name = value
        else:
            raise InvalidArgument(f"unknown DCP control key {key!r}")

    def seqno_acknowledged(self, vbucket: int, seqno: int) -> int:
        """DCP_SEQNO_ACKNOWLEDGED from the consumer: its replica's high prepared seqno for ``vbucket``
        (kv_engine: only with sync writes enabled and a consumer name). Returns prepares committed."""
        if self.closed:
            raise EngineClosed(f"connection {self.name!r} is closed")
        if not self.sync_writes or not self.consumer_name:
            raise InvalidArgument(f"{self.name!r}: seqno ack without enable_sync_writes and consumer_name")
        return self.bucket.seqno_acknowledged(vbucket, self.consumer_name, seqno)

    # ------------------------------------------------------------------ stepping
    def notify(self, stream: ActiveStream) -> None:
        if not stream.queued and self.streams.get(stream.vbid) is stream:
            stream.queued = True
            self._ready.append(stream)

    def step(self, max_messages: int = 4096) -> list[Message]:
        """The next messages of this connection's streams, round robin, within flow control."""
        out: list[Message] = []
        if self.closed:
            return out
        ready = self._ready
        budget = self.buffer_size - self.unacked_bytes if self.buffer_size else 1 << 62
        self.paused = False
        per_stream = max(64, max_messages // 8)
        while ready and len(out) < max_messages:
            if budget <= 0:
                self.paused = True
                break
            s = ready.popleft()
            s.queued = False
            taken = s.take(min(per_stream, max_messages - len(out)), budget, out)
            budget -= taken
            self.bytes_sent += taken
            if self.buffer_size:
                self.unacked_bytes += taken
            if s.state is StreamState.DEAD and not s.ready:
                if self.streams.get(s.vbid) is s:
                    del self.streams[s.vbid]
            elif s.has_work():
                s.queued = True
                ready.append(s)
        return out

    def buffer_acknowledge(self, nbytes: int) -> None:
        """The consumer processed ``nbytes`` of messages (DCP buffer-ack)."""
        if nbytes < 0:
            raise InvalidArgument("cannot acknowledge a negative number of bytes")
        self.unacked_bytes = max(0, self.unacked_bytes - nbytes)

    @property
    def has_work(self) -> bool:
        return bool(self._ready)

    def stream_stats(self) -> list[dict[str, int | str]]:
        return [
            {"vbucket": s.vbid, "state": s.state.value, "last_read": s.last_read, "last_sent": s.last_sent,
             "end": s.end, "backfills": s.backfills, "ready": len(s.ready)}
            for s in self.streams.values()
        ]

    def close(self) -> None:
        """Disconnect: every stream ends (DISCONNECTED) and its cursor is removed."""
        if self.closed:
            return
        for s in list(self.streams.values()):
            s.end_stream(StreamEndReason.DISCONNECTED)
        self.streams.clear()
        for s in self._ready:
            s.queued = False
        self._ready.clear()
        self.closed = True
        self.bucket.connections.disconnected(self)  # kv_engine: a disconnected connection leaves the bucket


__all__ = ["DcpProducer", "ProducerBucket", "StreamEnd"]
