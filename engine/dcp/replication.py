"""The replica side of DCP: a consumer connection feeding replica vbuckets from an active node's producer.

kv_engine counterparts: ``dcp/consumer.cc`` (``DcpConsumer``) and ``dcp/passive_stream.cc`` (``PassiveStream``).
The replica keeps the active's seqnos and persists in seqno order. The rules applied (docs/cluster.md
"Replication (the replica side of DCP)"; kv_engine's DCP client rules):

* **Stream request from the replica's own position**: start = the replica's high seqno,
  vbuuid = its newest failover entry, snapshot = the current, possibly partial, snapshot's marker range.
  The request also carries the replica's whole failover log (the product's common-ancestor extension,
  docs/rollback.md), so a replica whose newest branch the producer never saw need not go back to 0.
* **OK**: the replica replaces its whole failover log with the producer's and persists it (kv_engine
  ``replaceFailoverLog``).
* **ROLLBACK(s)**: the replica vbucket is rolled back to its newest complete-snapshot boundary <= s from storage
  history (rebuilt from zero when the history was purged), its failover entries above that are pruned and the
  request is repeated -- rollbacks can repeat.
* **Data**: markers open the replica's snapshot; mutations, deletions and expirations are applied with the
  producer's seqno, rev seqno, CAS, flags and expiry (``Bucket.apply_replica_message``).
* **Flow control**: the consumer acknowledges the bytes of every message it applied (DCP buffer-ack).

Everything is synchronous: :meth:`DcpConsumer.step` pulls one batch from the producer and applies it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

from engine.dcp.producer import DcpProducer
from engine.dcp.stream import (
    MAX_SEQNO,
    Message,
    SetVBucketStateMessage,
    SnapshotFlags,
    SnapshotMarker,
    StreamEnd,
    StreamEndReason,
    StreamFlags,
)
from engine.exceptions import InvalidArgument, NotMyVBucket, RollbackRequired
from engine.kv.item import Item
from engine.kv.vbucket import VBucketState
from schemas.failover_log import FailoverEntry

#: a stream request that keeps being answered ROLLBACK this many times is an engine bug, not a history
MAX_ROLLBACKS_PER_REQUEST = 64


class PassiveState(Enum):
    READING = "reading"
    DEAD = "dead"


@dataclass(slots=True)
class PassiveStream:
    """One replica vbucket's stream on a consumer connection (kv_engine ``PassiveStream``)."""

    vbucket: int
    state: PassiveState = PassiveState.READING
    end_reason: StreamEndReason | None = None
    items: int = 0
    markers: int = 0
    rollbacks: int = 0


class ProducerConnection(Protocol):
    """What a consumer needs of its producer connection: :class:`~engine.dcp.producer.DcpProducer` in process,
    :class:`engine.network.remote.RemoteDcpProducer` over the network."""

    @property
    def closed(self) -> bool: ...

    def stream_request(
        self, vbucket: int, start_seqno: int, end_seqno: int = ..., vbuuid: int = ...,
        snap_start: int | None = ..., snap_end: int | None = ..., *, flags: StreamFlags | int = ...,
        opaque: int = ..., failover_log: Sequence[FailoverEntry] | None = ...,
    ) -> list[FailoverEntry]: ...

    def step(self, max_messages: int = ...) -> Sequence[Message]: ...

    def buffer_acknowledge(self, nbytes: int) -> None: ...

    def close_stream(self, vbucket: int) -> None: ...

    def discard_stream(self, vbucket: int) -> None: ...

    def close(self) -> None: ...


class ReplicaTarget(Protocol):
    """What a consumer needs of the bucket holding the replica vbuckets (a :class:`~engine.bucket.Bucket`, or the node
    server's proxy that runs each call on the bucket's own thread)."""

    @property
    def closed(self) -> bool: ...

    def replica_position(self, vbucket: int) -> tuple[int, int, int]: ...

    def failover_log(self, vbucket: int) -> list[FailoverEntry]: ...

    def rollback_vbucket(self, vbucket: int, seqno: int) -> int: ...

    def replace_failover_log(self, vbucket: int, entries: list[FailoverEntry]) -> None: ...

    def apply_replica_message(self, message: SnapshotMarker | Item) -> None: ...


@runtime_checkable
class TakeoverAcks(Protocol):
    """The producer side of a takeover stream: the consumer's responses to markers sent with ACK and to
    SET_VBUCKET_STATE (engine/dcp/takeover.py)."""

    def snapshot_marker_ack(self, vbucket: int) -> None: ...

    def set_vbucket_state_ack(self, vbucket: int) -> None: ...


@runtime_checkable
class TakeoverTarget(Protocol):
    """The consumer side of a takeover: the state changes a SET_VBUCKET_STATE message asks for."""

    def set_vbucket_state(self, vbucket: int, state: VBucketState, *, cas: int | None = None) -> int: ...

    def promote(self, vbucket: int, *, takeover: bool = False, cas: int | None = None) -> FailoverEntry | None: ...


class DcpConsumer:
    """A replication connection: one active node's producer -> replica vbuckets of another bucket.

    ``replica`` is the bucket holding the replica vbuckets; ``producer`` is a DCP connection opened on the
    active node's bucket (``active_bucket.dcp_producer(name)``). Streams are added per vbucket with
    :meth:`add_stream`; :meth:`step` moves one batch.
    """

    def __init__(
        self, name: str, replica: ReplicaTarget, producer: DcpProducer | ProducerConnection, *,
        use_client_log: bool = True, consumer_name: str | None = None,
    ) -> None:
        if not name:
            raise InvalidArgument("a DCP consumer needs a name")
        self.name = name
        self.replica = replica
        self.producer = producer
        self.use_client_log = use_client_log
        self.streams: dict[int, PassiveStream] = {}
        self.rollbacks = 0
        self.messages = 0
        self.takeover_states = 0
        #: synchronous replication (docs/durability.md "Life of a sync write"): with a consumer name (the replica node) the connection enables
        #: sync writes (kv_engine DCP controls ``enable_sync_writes`` and ``consumer_name``), receives prepares,
        #: commits and aborts, and seqno-acks its replica's high prepared seqno back on the connection.
        self.consumer_name = consumer_name
        self._acked: dict[int, int] = {}
        self.seqno_acks = 0
        #: who executes a ROLLBACK answer (default: ``replica.rollback_vbucket``); delta recovery installs the
        #: rollback repair here (engine/cluster/recovery.py, docs/cluster.md "Rollback repair")
        self.rollback_handler: Callable[[int, int], int] | None = None
        if consumer_name is not None:
            control = getattr(producer, "control", None)
            if control is None:
                raise InvalidArgument(f"{name}: the producer connection does not support sync writes")
            control("enable_sync_writes", "true")
            control("consumer_name", consumer_name)

    def __repr__(self) -> str:
        return f"DcpConsumer({self.name!r} streams={sorted(self.streams)})"

    @property
    def closed(self) -> bool:
        return self.producer.closed or self.replica.closed

    def is_open(self, vbucket: int) -> bool:
        s = self.streams.get(vbucket)
        return s is not None and s.state is PassiveState.READING

    # ------------------------------------------------------------------ stream requests
    def add_stream(self, vbucket: int) -> list[FailoverEntry]:
        """Request vbucket ``vbucket`` from the producer at the replica's own position.

        Handles ROLLBACK (roll the replica back, re-request; repeated as often as the producer asks) and, on
        OK, replaces the replica's failover log with the producer's. Returns that log. Raises
        :class:`NotMyVBucket` when the replica vbucket is not a replica (or unknown) or the producer's vbucket
        is not active; other stream-request errors propagate.
        """
        if self.is_open(vbucket):
            raise InvalidArgument(f"{self.name}: a stream for vbucket {vbucket} is already open")
        stream = self.streams.get(vbucket) or PassiveStream(vbucket)
        for _ in range(MAX_ROLLBACKS_PER_REQUEST):
            start, snap_start, snap_end = self.replica.replica_position(vbucket)
            log = self.replica.failover_log(vbucket)
            try:
                # A replication stream reads an active vbucket only (ACTIVE_VB_ONLY).
                entries = self.producer.stream_request(
                    vbucket, start, MAX_SEQNO, log[0].vbuuid, snap_start, snap_end,
                    flags=StreamFlags.ACTIVE_VB_ONLY, failover_log=log if self.use_client_log else None)
            except RollbackRequired as rb:
                self._rollback(vbucket, rb.seqno)
                stream.rollbacks += 1
                self.rollbacks += 1
                continue
            self.replica.replace_failover_log(vbucket, entries)
            stream.state = PassiveState.READING
            stream.end_reason = None
            self.streams[vbucket] = stream
            # kv_engine PassiveStream::acceptStream: a sync-replication stream seqno-acks its high prepared
            # seqno right away (a new active needs the acks of replicas that already hold its prepares).
            self._acked.pop(vbucket, None)
            self._seqno_ack(vbucket)
            return entries
        raise InvalidArgument(f"{self.name}: vbucket {vbucket} still asked to roll back after "
                              f"{MAX_ROLLBACKS_PER_REQUEST} rollbacks")

    def request_stream(self, vbucket: int, *, takeover: bool = False) -> list[FailoverEntry] | None:
        """One stream request from the replica's own position (docs/rebalance.md "The mover",
        handshake step 3):
        the producer's failover log on OK (replaced into the replica, step 6), ``None`` after a ROLLBACK the
        replica executed (step 5: request again). ``takeover`` sets the TAKEOVER flag (docs/rebalance.md
        "The takeover stream (engine side)"). The rebalance mover (engine/cluster/rebalance.py) drives the loop itself so its add-stream
        requests complete out of order."""
        if self.is_open(vbucket):
            raise InvalidArgument(f"{self.name}: a stream for vbucket {vbucket} is already open")
        stream = self.streams.get(vbucket) or PassiveStream(vbucket)
        start, snap_start, snap_end = self.replica.replica_position(vbucket)
        log = self.replica.failover_log(vbucket)
        flags = StreamFlags.ACTIVE_VB_ONLY | (StreamFlags.TAKEOVER if takeover else StreamFlags.NONE)
        try:
            entries = self.producer.stream_request(
                vbucket, start, MAX_SEQNO, log[0].vbuuid, snap_start, snap_end, flags=flags,
                failover_log=log if self.use_client_log else None)
        except RollbackRequired as rb:
            self._rollback(vbucket, rb.seqno)
            stream.rollbacks += 1
            self.rollbacks += 1
            self.streams.setdefault(vbucket, stream)
            stream.state = PassiveState.DEAD
            return None
        self.replica.replace_failover_log(vbucket, entries)
        stream.state = PassiveState.READING
        stream.end_reason = None
        self.streams[vbucket] = stream
        return entries

    def _rollback(self, vbucket: int, seqno: int) -> int:
        if self.rollback_handler is not None:
            return self.rollback_handler(vbucket, seqno)
        return self.replica.rollback_vbucket(vbucket, seqno)

    def close_stream(self, vbucket: int) -> None:
        """Stop replicating ``vbucket`` on this connection (no error if it is not open)."""
        s = self.streams.pop(vbucket, None)
        p = self.producer
        if s is not None and s.state is PassiveState.READING and not p.closed:
            with contextlib.suppress(NotMyVBucket):
                p.close_stream(vbucket)
            p.discard_stream(vbucket)

    # ------------------------------------------------------------------ data
    def step(self, max_messages: int = 4096) -> int:
        """Pull one batch of messages from the producer and apply them; returns how many were handled."""
        if self.closed:
            return 0
        msgs = self.producer.step(max_messages)
        if not msgs:
            return 0
        nbytes = 0
        for m in msgs:
            nbytes += m.dcp_size
            self._handle(m)
        self.producer.buffer_acknowledge(nbytes)
        self.messages += len(msgs)
        if self.consumer_name is not None:
            for vb in sorted({m.vbucket for m in msgs}):
                self._seqno_ack(vb)
        return len(msgs)

    # ------------------------------------------------------------------ seqno acks (docs/durability.md)
    def _seqno_ack(self, vbucket: int) -> bool:
        if self.consumer_name is None or not self.is_open(vbucket) or self.producer.closed:
            return False
        ack = getattr(self.replica, "durability_ack_seqno", None)
        if ack is None:
            return False
        try:
            seqno = ack(vbucket)
        except NotMyVBucket:
            return False
        return self._send_ack(vbucket, seqno)

    def _send_ack(self, vbucket: int, seqno: int) -> bool:
        """Seqno-ack ``seqno`` of ``vbucket`` when it is above what was acked last; whether it was sent."""
        if seqno > self._acked.get(vbucket, -1):
            self._acked[vbucket] = seqno
            self.producer.seqno_acknowledged(vbucket, seqno)  # type: ignore[union-attr,attr-defined,unused-ignore]
            self.seqno_acks += 1
            return True
        return False

    def acknowledge_seqnos(self) -> int:
        """Seqno-ack every open stream whose replica moved (e.g. after the flusher persisted: persist levels
        are acked only once persisted); returns how many acks were sent. The replica answers for every open
        stream in one ``durability_ack_seqnos`` call when it has one (a node process: one hop to its loop)."""
        if self.consumer_name is None or self.producer.closed:
            return 0
        many = getattr(self.replica, "durability_ack_seqnos", None)
        if many is None:
            return sum(self._seqno_ack(vb) for vb in sorted(self.streams))
        reading = PassiveState.READING
        current: dict[int, int] = many([vb for vb, s in self.streams.items() if s.state is reading])
        return sum(self._send_ack(vb, current[vb]) for vb in sorted(current))

    def drain(self, max_steps: int = 1_000_000) -> int:
        """Step until the producer has nothing more to send; returns messages handled."""
        n = 0
        for _ in range(max_steps):
            k = self.step()
            if not k:
                return n
            n += k
        return n

    def _handle(self, m: Message) -> None:
        s = self.streams.get(m.vbucket)
        if isinstance(m, StreamEnd):
            if s is not None:
                s.state = PassiveState.DEAD
                s.end_reason = m.reason
            return
        if s is None or s.state is not PassiveState.READING:
            raise InvalidArgument(f"{self.name}: {m!r} for vbucket {m.vbucket} without an open stream")
        if isinstance(m, SetVBucketStateMessage):
            self._takeover_state(m)
            return
        self.replica.apply_replica_message(m)
        if type(m) is SnapshotMarker:
            s.markers += 1
            if m.flags & SnapshotFlags.ACK:
                self._takeover_acks().snapshot_marker_ack(m.vbucket)
        else:
            s.items += 1

    def _takeover_acks(self) -> TakeoverAcks:
        p = self.producer
        if not isinstance(p, TakeoverAcks):
            raise InvalidArgument(f"{self.name}: the producer connection cannot take takeover acks")
        return p

    def _takeover_state(self, m: SetVBucketStateMessage) -> None:
        """kv_engine ``DcpConsumer::setVBucketState`` of a takeover: pending first, then active with
        ``transfer`` (no failover entry); each is acknowledged once executed (docs/rebalance.md "The takeover stream
        (engine side)")."""
        target = self.replica
        if not isinstance(target, TakeoverTarget):
            raise InvalidArgument(f"{self.name}: the replica side cannot change vbucket states")
        if m.state is VBucketState.ACTIVE:
            target.promote(m.vbucket, takeover=True)
        elif m.state is VBucketState.PENDING:
            target.set_vbucket_state(m.vbucket, VBucketState.PENDING)
        else:
            raise InvalidArgument(f"{self.name}: unexpected takeover state {m.state.value}")
        self._takeover_acks().set_vbucket_state_ack(m.vbucket)
        self.takeover_states += 1

    def close(self) -> None:
        """Disconnect: the producer side ends every stream."""
        self.streams.clear()
        if not self.producer.closed:
            self.producer.close()  # a local producer also leaves its bucket's connection table


__all__ = ["DcpConsumer", "PassiveState", "PassiveStream", "ProducerConnection", "ReplicaTarget"]
