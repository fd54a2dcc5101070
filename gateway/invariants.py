"""The ordering / snapshot invariants a partition's records keep (docs/record-format.md "Invariants").

:func:`check_partition` checks them on decoded records (the gateway's own tests, ``dcpgw`` diagnostics);
:func:`data_positions` counts data records by (vbucket, vbuuid, seqno) for exactly-once checks.

Per vbucket (a partition may hold several: records are demultiplexed by ``dcp.vbucket``):

* data records come after a snapshot record, lie inside its range (``start <= seqno <= end``) and carry its
  range in ``dcp.snap.start/end``; a stream (re)start (failover-log or rollback record) closes the current
  snapshot, so data after it needs a new snapshot record (which may repeat the start of an incomplete one);
* data seqnos strictly increase, except that a rollback record to R with restart point B
  (its ``dcp.snap.end``, B <= R) resets the order: the next data seqno must be > B;
* ``dcp.vbuuid`` of snapshot, data and stream-end records is the branch of the last failover-log or rollback
  record (the newest entry of the log it carries); the vbuuid changes only there;
* every record's ``dcp.snap.start/end`` is the current range: the last snapshot record's range, or the
  restart point of the last rollback record;
* no data record between a stream-end record and the next stream (re)start; a stream-end record's seqno is
  at least the last data seqno.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gateway.exceptions import InvariantViolation
from schemas.records import DecodedRecord, RecordType

__all__ = ["PartitionRecords", "check_partition", "data_positions"]

#: what the checks accept: records, (offset, record) pairs, or (partition, offset, record) triples as
#: ``tests/gateway/kafka_util.read_topic`` returns them
PartitionRecords = Iterable[DecodedRecord | tuple[int, DecodedRecord] | tuple[int, int, DecodedRecord]]


def _with_offsets(records: PartitionRecords) -> Iterator[tuple[int | None, DecodedRecord]]:
    for r in records:
        if isinstance(r, DecodedRecord):
            yield None, r
        elif len(r) == 2:
            yield r[0], r[1]
        else:
            yield r[1], r[2]


@dataclass(slots=True)
class _VBucket:
    #: branch of the last failover-log / rollback record (None: none seen yet)
    vbuuid: int | None = None
    #: data seqnos must be above this (last data seqno, or a rollback's restart point)
    floor: int | None = None
    #: the rollback (R, B) the floor comes from, while no data followed it
    rollback: tuple[int, int] | None = None
    #: range of the last snapshot record, None before any / after a stream (re)start
    snap: tuple[int, int] | None = None
    #: a snapshot record of this vbucket was seen
    seen_snapshot: bool = False
    #: what every record's dcp.snap headers must say (None: not known yet)
    current: tuple[int, int] | None = None
    #: a stream-end record was the last stream event
    ended: bool = False


def check_partition(records: PartitionRecords) -> None:
    """Raise :class:`InvariantViolation` at the first record that breaks an invariant of the record format.

    ``records`` are one partition's records in offset order (a whole partition, from offset 0, or from a
    failover-log record on). The message names the vbucket, the seqno and, when given, the offset.
    """
    state: dict[int, _VBucket] = {}
    for offset, r in _with_offsets(records):
        vb = r.vbucket
        st = state.get(vb)
        if st is None:
            st = state[vb] = _VBucket()

        def fail(what: str, r: DecodedRecord = r, offset: int | None = offset) -> InvariantViolation:
            at = f" at offset {offset}" if offset is not None else ""
            return InvariantViolation(
                f"vbucket {r.vbucket}, seqno {r.seqno}{at}: {r.type.value} record {what}",
                r.vbucket, r.seqno, offset,
            )

        rng = (r.snap_start, r.snap_end)
        if r.snap_start > r.snap_end:
            raise fail(f"has dcp.snap.start {r.snap_start} > dcp.snap.end {r.snap_end}")
        t = r.type
        if r.is_data or t is RecordType.OVERSIZE:
            # an oversize record takes the place of the data record Kafka refused (same seqno, snapshot)
            if st.ended:
                raise fail("follows a stream-end record without a stream restart (failover-log record)")
            if st.snap is None:
                raise fail(
                    "follows a stream (re)start without a new snapshot record"
                    if st.seen_snapshot
                    else "comes before any snapshot record"
                )
            if rng != st.snap:
                raise fail(f"carries snapshot range {list(rng)} but the last snapshot record is {list(st.snap)}")
            if not st.snap[0] <= r.seqno <= st.snap[1]:
                raise fail(f"lies outside its snapshot [{st.snap[0]}, {st.snap[1]}]")
            if st.floor is not None and r.seqno <= st.floor:
                if st.rollback is not None:
                    rb, restart = st.rollback
                    raise fail(f"follows a rollback to {rb} (restart at {restart}): its seqno must be > {restart}")
                raise fail(f"is not after the previous data record's seqno {st.floor} (duplicate or out of order)")
            if st.vbuuid is not None and r.vbuuid != st.vbuuid:
                raise fail(f"carries vbuuid {r.vbuuid} but the stream's branch is {st.vbuuid}")
            st.floor = r.seqno
            st.rollback = None
            continue
        if t is RecordType.SNAPSHOT:
            if r.seqno != r.snap_start:
                raise fail(f"has dcp.seqno {r.seqno} != its start {r.snap_start}")
            if st.vbuuid is not None and r.vbuuid != st.vbuuid:
                raise fail(f"carries vbuuid {r.vbuuid} but the stream's branch is {st.vbuuid}")
            if st.ended:
                raise fail("follows a stream-end record without a stream restart (failover-log record)")
            if st.floor is not None and r.snap_end < st.floor:
                raise fail(f"ends ({r.snap_end}) before data already published (seqno {st.floor})")
            st.snap = st.current = rng
            st.seen_snapshot = True
            continue
        if t is not RecordType.ROLLBACK and st.current is not None and rng != st.current:
            raise fail(f"carries snapshot range {list(rng)} but the current range is {list(st.current)}")
        if t is RecordType.STREAM_END:
            if st.vbuuid is not None and r.vbuuid != st.vbuuid:
                raise fail(f"carries vbuuid {r.vbuuid} but the stream's branch is {st.vbuuid}")
            if st.floor is not None and r.seqno < st.floor:
                raise fail(f"reports last seqno {r.seqno} below the last data record's seqno {st.floor}")
            st.ended = True
            st.current = rng
            continue
        # failover-log or rollback: a stream (re)start, possibly on a new branch
        log = r.failover_log
        if not log:
            raise fail("carries no failover log")
        if r.vbuuid != log[0].vbuuid:
            raise fail(f"carries vbuuid {r.vbuuid} but its log's newest entry is {log[0].vbuuid}")
        if t is RecordType.ROLLBACK:
            if r.rollback_seqno is not None and r.rollback_seqno != r.seqno:
                raise fail(f"has rollback seqno {r.rollback_seqno} != dcp.seqno")
            if r.snap_end > r.seqno:
                raise fail(f"restarts at {r.snap_end}, above the rollback seqno")
            st.floor = r.snap_end
            st.rollback = (r.seqno, r.snap_end)
        st.vbuuid = r.vbuuid
        st.snap = None
        st.current = rng
        st.ended = False


def data_positions(records: PartitionRecords) -> Counter[tuple[int, int, int]]:
    """How many data records each (vbucket, vbuuid, seqno) has (exactly once: every count is 1); an oversize
    record counts for the data record it replaces."""
    return Counter((r.vbucket, r.vbuuid, r.seqno) for _, r in _with_offsets(records)
                   if r.is_data or r.type is RecordType.OVERSIZE)
