"""The consumer-side core: one vbucket's records in, complete snapshots and rollbacks out.

Pure and synchronous (no Kafka here): the Kafka client (``connectors.client.consumer``) and the Spark source
(``connectors.spark``) both run every record of a partition through a :class:`VBucketReplayer` per vbucket, so
both apply exactly the same rules (docs/record-format.md, "What consumers must do"):

* **snapshot-atomic** (docs/engine.md "Snapshots, de-duplication and consistency": never expose a partial snapshot): data records are buffered until the
  snapshot's end seqno arrives, or until a snapshot record starting after the current range shows the previous
  snapshot completed (its last items were filtered out by the gateway);
* a snapshot record that **repeats the start of an incomplete snapshot** (the gateway resumed mid-snapshot
  after a crash) keeps the buffer and only extends the range;
* **duplicates** (same vbuuid, seqno at or below what was applied) are skipped: exactly once even if the topic
  holds duplicates;
* a **rollback record** to R with restart point B (its ``snap_end``) discards the buffer and yields a
  :class:`Rollback` to B when the consumer applied anything above B;
* an **oversize record** (Kafka refused a change as too large; docs/record-format.md) takes the change's place:
  it counts for the snapshot's seqnos like a data record and is reported in :attr:`Snapshot.oversize`, never as
  a change;
* a **failover-log record** whose log diverges from the consumer's own (the engine's rollback rule run over the
  two logs, docs/rollback.md) yields a :class:`Rollback` to the common point.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self

from schemas.failover_log import FailoverEntry, rollback_point, sanitized
from schemas.position import VBucketPosition
from schemas.records import DecodedRecord, RecordType


class Change(NamedTuple):
    """One data record of a complete snapshot (a named tuple: built once per record on the hot path)."""

    type: RecordType  # MUTATION, DELETION or EXPIRATION
    key: bytes
    value: bytes | None
    vbucket: int
    vbuuid: int
    seqno: int
    rev_seqno: int
    cas: int
    flags: int
    expiry: int
    datatype: int
    offset: int

    @property
    def deleted(self) -> bool:
        return self.type is RecordType.DELETION or self.type is RecordType.EXPIRATION


@dataclass(frozen=True, slots=True)
class Oversize:
    """A change Kafka refused as too large (an oversize record, docs/record-format.md): the document ``key``
    changed at ``seqno`` but its new value is not in the topic. The application's copy of ``key`` is stale;
    read the document from the bucket if it needs it (``cas`` tells the version)."""

    vbucket: int
    vbuuid: int
    seqno: int
    key: bytes
    #: bytes of the document body, and why Kafka refused its record
    size: int
    reason: str
    rev_seqno: int
    cas: int
    offset: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A complete snapshot of one vbucket: applying all its changes gives a consistent state at ``end``."""

    vbucket: int
    vbuuid: int
    start: int
    end: int
    changes: tuple[Change, ...]
    #: Kafka offset of the last record belonging to this snapshot: resume from ``offset + 1``
    offset: int
    #: the consumer state right after this snapshot (what a state store persists when it is confirmed)
    state: ConsumerPosition | None = field(default=None, compare=False, repr=False)
    #: changes of this snapshot Kafka refused as too large (not in ``changes``), in seqno order
    oversize: tuple[Oversize, ...] = ()


@dataclass(frozen=True, slots=True)
class Rollback:
    """The application must return the vbucket to its state at ``restart_seqno`` (a snapshot boundary)."""

    vbucket: int
    rollback_seqno: int
    restart_seqno: int
    #: what was applied before the rollback (everything in (restart_seqno, applied_seqno] must be undone)
    applied_seqno: int
    failover_log: tuple[FailoverEntry, ...]
    offset: int
    reason: str  # "rollback-record" or "failover-log-divergence"
    #: the consumer state right after this rollback
    state: ConsumerPosition | None = field(default=None, compare=False, repr=False)


Event = Snapshot | Rollback


@dataclass(slots=True)
class ConsumerPosition(VBucketPosition):
    """What a consumer keeps per vbucket (persisted by the state stores): the contract's position at the end of
    the last complete snapshot applied (``seqno`` = ``applied_seqno``, the snapshot's range, the vbuuid and
    failover log) and the Kafka offset of that snapshot's last record."""

    #: Kafka offset of the last record of the last complete snapshot (-1: none)
    offset: int = -1

    @property
    def applied_seqno(self) -> int:
        """End of the last complete snapshot applied (the position's ``seqno``)."""
        return self.seqno

    @applied_seqno.setter
    def applied_seqno(self, value: int) -> None:
        self.seqno = value

    def to_dict(self) -> dict[str, Any]:
        d = VBucketPosition.to_dict(self)
        d["offset"] = self.offset
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        return cls(**cls.fields_from(d), offset=int(d["offset"]))

    def copy(self) -> Self:
        return self._copy_with(self.offset)


class VBucketReplayer:
    """Turns one vbucket's records (in partition order) into :class:`Snapshot` and :class:`Rollback` events.

    ``state`` only moves when an event is produced; feeding the same records again after restoring a saved
    state produces the same events (deterministic replay, which Spark's recovery relies on).
    """

    __slots__ = ("_last_offset", "_oversize", "_pending", "_range", "_vbuuid", "accepted", "last_change", "state")

    def __init__(self, state: ConsumerPosition) -> None:
        self.state = state
        self._pending: list[Change] = []
        #: seqno -> (size, reason) of the oversize records in ``_pending`` (held there as OVERSIZE changes)
        self._oversize: dict[int, tuple[int, str]] = {}
        self._range: tuple[int, int] | None = None
        self._vbuuid = state.vbuuid
        self._last_offset = state.offset
        #: data records accepted into the snapshot buffer so far (not skipped as duplicates)
        self.accepted = 0
        #: the data record accepted last (per-record consumers expose it before its snapshot completes)
        self.last_change: Change | None = None

    @property
    def has_partial(self) -> bool:
        return bool(self._pending)

    def feed(self, rec: DecodedRecord, offset: int) -> list[Event]:
        st = self.state
        t = rec.type
        out: list[Event] = []
        if t is RecordType.SNAPSHOT:
            rng = self._range
            if rng is not None and rec.snap_start > rng[1]:
                # The previous snapshot is complete even if its tail was filtered out.
                ev = self._complete(self._last_offset)
                if ev is not None:
                    out.append(ev)
                self._range = (rec.snap_start, rec.snap_end)
            elif rng is not None and self._pending:
                # Resumed mid-snapshot: keep buffering, the range grows.
                self._range = (min(rng[0], rec.snap_start), max(rng[1], rec.snap_end))
            else:
                self._range = (rec.snap_start, rec.snap_end)
            self._vbuuid = rec.vbuuid or self._vbuuid
        elif rec.is_data:
            assert rec.key is not None
            snap = self.feed_change(Change(
                rec.type, rec.key, rec.value, rec.vbucket, rec.vbuuid, rec.seqno, rec.rev_seqno or 0,
                rec.cas or 0, rec.flags or 0, rec.expiry or 0, rec.datatype or 0, offset))
            if snap is not None:
                out.append(snap)
        elif t is RecordType.OVERSIZE:
            # takes the refused change's place: buffered (and de-duplicated) like it, reported apart
            assert rec.key is not None
            known = rec.seqno in self._oversize
            self._oversize[rec.seqno] = (rec.size or 0, rec.reason or "")
            before = self.accepted
            snap = self.feed_change(Change(
                rec.type, rec.key, None, rec.vbucket, rec.vbuuid, rec.seqno, rec.rev_seqno or 0, rec.cas or 0,
                0, 0, 0, offset))
            if snap is None and self.accepted == before and not known:
                del self._oversize[rec.seqno]  # a duplicate: not buffered
            if snap is not None:
                out.append(snap)
        elif t is RecordType.ROLLBACK:
            restart = rec.snap_end
            rng = self._range
            if rng is not None and self._pending and rng[1] <= restart:
                # The gateway published this snapshot completely (its restart point B is a boundary at or
                # above its end): its tail was filtered out. It is complete, not discarded.
                ev = self._complete(self._last_offset)
                if ev is not None:
                    out.append(ev)
            self._pending.clear()
            self._oversize.clear()
            self._range = None
            log = list(rec.failover_log or ())
            rolled_back = st.seqno > restart
            applied = st.seqno
            st.rollback(rec.seqno, min(applied, restart))
            if not st.failover_log:
                st.failover_log = log
            st.vbuuid = self._vbuuid = rec.vbuuid
            st.offset = self._last_offset = offset
            if rolled_back:
                out.append(Rollback(st.vbucket, rec.seqno, restart, applied, tuple(log), offset,
                                    "rollback-record", st.copy()))
        elif t is RecordType.FAILOVER_LOG:
            log = list(rec.failover_log or ())
            rng = self._range
            pending = bool(self._pending) and rng is not None
            if st.failover_log and log and (st.seqno > 0 or pending):
                # Where the two logs' shared history ends (docs/rollback.md, "How clients roll back changes").
                server = sanitized(log)
                if pending:
                    # The gateway resumes an incomplete snapshot where it stopped (a repeated snapshot
                    # start follows), so the buffer stays -- unless it holds seqnos above the shared history.
                    seen = self._pending[-1].seqno
                    if rollback_point(server_log=server, client_log=st.failover_log, start_seqno=seen,
                                      high_seqno=rec.seqno, snap_start=seen, snap_end=seen,
                                      purge_seqno=0) is not None:
                        self._pending.clear()
                        self._oversize.clear()
                        self._range = None
                point = None
                if st.seqno > 0:
                    a = st.seqno
                    point = rollback_point(server_log=server, client_log=st.failover_log, start_seqno=a,
                                           high_seqno=rec.seqno, snap_start=a, snap_end=a, purge_seqno=0)
                if point is not None and point < st.seqno:
                    self._pending.clear()
                    self._oversize.clear()
                    self._range = None
                    applied = st.seqno
                    st.rollback(point, point)
                    st.on_failover_log(log)
                    self._vbuuid = st.vbuuid
                    st.offset = self._last_offset = offset
                    out.append(Rollback(st.vbucket, point, point, applied, tuple(log), offset,
                                        "failover-log-divergence", st.copy()))
                    return out
            st.on_failover_log(log)
            if log:
                self._vbuuid = st.vbuuid
            if not self._pending:
                st.offset = offset
        # stream-end: nothing to do (a later restart repeats the snapshot start if it was incomplete)
        return out

    def feed_change(self, ch: Change) -> Snapshot | None:
        """Feed one data record (as a :class:`Change` carrying its offset): the consumers' hot path, the same
        rules as :meth:`feed`. Returns the snapshot this record completes, if any."""
        rng = self._range
        if rng is None:
            return None  # data outside any snapshot cannot be applied (invariant violation upstream)
        # fields by index on this hot path: 4 vbuuid, 5 seqno, 11 offset (see Change)
        seqno = ch[5]
        st = self.state
        if seqno <= st.seqno and ch[4] == st.vbuuid:
            return None  # a duplicate of what was applied: exactly once
        pending = self._pending
        if pending and seqno <= pending[-1][5]:
            return None  # a duplicate inside the buffer
        pending.append(ch)
        self._vbuuid = ch[4]
        self._last_offset = ch[11]
        self.accepted += 1
        self.last_change = ch
        if seqno >= rng[1]:
            return self._complete(ch[11])
        return None

    def feed_changes(self, changes: Sequence[Change]) -> list[Snapshot]:
        """:meth:`feed_change` for each of ``changes`` in order -- a run of consecutive data records of this
        vbucket, as the Kafka client reads them -- with the same rules and the same resulting state, in one
        call (the client's hot path: no call and no attribute look-ups per record). Returns the snapshots they
        complete, in order."""
        out: list[Snapshot] = []
        rng = self._range
        if rng is None:
            return out  # data outside any snapshot cannot be applied (as feed_change)
        end = rng[1]
        st = self.state
        applied = st.seqno
        vbuuid = st.vbuuid
        pending = self._pending
        add = pending.append
        # seqno of the last buffered record (-1: none; seqnos are u64)
        last = pending[-1][5] if pending else -1
        accepted = 0
        ch_last: Change | None = None
        # fields by index: 4 vbuuid, 5 seqno, 11 offset (see Change)
        for ch in changes:
            seqno = ch[5]
            if seqno <= applied and ch[4] == vbuuid:
                continue  # a duplicate of what was applied: exactly once
            if seqno <= last:
                continue  # a duplicate inside the buffer
            add(ch)
            last = seqno
            accepted += 1
            ch_last = ch
            if seqno >= end:
                self._vbuuid = ch[4]
                self._last_offset = ch[11]
                snap = self._complete(ch[11])
                if snap is not None:
                    out.append(snap)
                applied = st.seqno
                vbuuid = st.vbuuid
                last = -1
        if ch_last is not None:
            self._vbuuid = ch_last[4]
            self._last_offset = ch_last[11]
            self.last_change = ch_last
            self.accepted += accepted
        return out

    def _complete(self, offset: int) -> Snapshot | None:
        rng = self._range
        if rng is None:
            return None
        st = self.state
        changes = tuple(self._pending)
        self._pending.clear()
        if rng[1] <= st.seqno and not changes:
            return None
        st.seqno = max(st.seqno, rng[1])
        st.snap_start, st.snap_end = rng
        st.vbuuid = self._vbuuid
        st.offset = offset
        snap = Snapshot(st.vbucket, self._vbuuid, rng[0], rng[1], changes, offset, st.copy())
        if self._oversize:
            info, self._oversize = self._oversize, {}
            snap = self._with_oversize(snap, info)
        return snap

    @staticmethod
    def _with_oversize(snap: Snapshot, info: dict[int, tuple[int, str]]) -> Snapshot:
        """``snap`` with its OVERSIZE changes moved from ``changes`` to ``oversize``."""
        changes = [c for c in snap.changes if c.type is not RecordType.OVERSIZE]
        if len(changes) == len(snap.changes):
            return snap
        over = tuple(
            Oversize(c.vbucket, c.vbuuid, c.seqno, c.key, *info.get(c.seqno, (0, "")), c.rev_seqno, c.cas, c.offset)
            for c in snap.changes if c.type is RecordType.OVERSIZE)
        return dataclasses.replace(snap, changes=tuple(changes), oversize=over)

