"""The record types of the contract: what a record is (``dcp.type``), how its value is encoded (``dcp.format``),
a record to produce (:class:`KafkaRecord`) and a record read back (:class:`DecodedRecord`).

The encoder and the decoder of these records are :mod:`schemas.codec`; their headers :mod:`schemas.headers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from schemas.dcp import Op, SnapshotFlags, StreamEndReason
from schemas.failover_log import FailoverEntry
from schemas.headers import Headers

__all__ = [
    "DATA_TYPES",
    "OP_OF_TYPE",
    "DecodedRecord",
    "KafkaRecord",
    "RecordType",
    "ValueFormat",
    "snapshot_flag_names",
    "stream_end_reason_name",
]


class ValueFormat(StrEnum):
    """How a record's value is encoded (header ``dcp.format``)."""

    AVRO = "avro"
    RAW = "raw"


class RecordType(StrEnum):
    """The kind of a record (header ``dcp.type``)."""

    MUTATION = "mutation"
    DELETION = "deletion"
    EXPIRATION = "expiration"
    SNAPSHOT = "snapshot"
    FAILOVER_LOG = "failover-log"
    ROLLBACK = "rollback"
    STREAM_END = "stream-end"
    #: Kafka refused a data record as too large: this control record takes its place (docs/record-format.md)
    OVERSIZE = "oversize"



#: the types of data records (mutation, deletion, expiration), indexed by :class:`~schemas.dcp.Op`
DATA_TYPES: Final = (RecordType.MUTATION, RecordType.DELETION, RecordType.EXPIRATION)
#: data record type -> its :class:`~schemas.dcp.Op`
OP_OF_TYPE: Final = {RecordType.MUTATION: Op.MUTATION, RecordType.DELETION: Op.DELETION,
                     RecordType.EXPIRATION: Op.EXPIRATION}


@dataclass(slots=True)
class KafkaRecord:
    """One record for ``Producer.produce(topic, value=..., key=..., partition=..., headers=...)``.

    Immutable by convention (not ``frozen``: a frozen dataclass's ``__init__`` costs ~1.5 µs more per record,
    and one is built per published record; its headers list makes it unhashable either way).
    """

    key: bytes | None
    value: bytes | None
    headers: Headers


def snapshot_flag_names(flags: int) -> list[str]:
    """Names of the snapshot-marker flag bits set in ``flags`` (``["DISK", "CHK"]``), lowest bit first;
    unknown bits as ``"0x.."``."""
    names: list[str] = []
    for bit in SnapshotFlags:
        if flags & bit:
            names.append(str(bit.name))
    unknown = flags & ~sum(SnapshotFlags)
    if unknown:
        names.append(f"0x{unknown:x}")
    return names


def stream_end_reason_name(reason: int) -> str:
    """Name of a DCP stream-end reason code (``"OK"``, ``"CLOSED"``...; ``"UNKNOWN(n)"`` otherwise)."""
    try:
        return StreamEndReason(reason).name
    except ValueError:
        return f"UNKNOWN({reason})"


@dataclass(slots=True, unsafe_hash=True)
class DecodedRecord:
    """A record read back from Kafka (:func:`decode`). Unsigned values are Python ints (u64 restored).

    Immutable by convention (not ``frozen``: a frozen dataclass costs ~4 µs more per record to build, a third of
    the whole decode on the consumer's hot path); hashable by value.

    ``key``/``value``: the document key and body of a data record (``value`` None for deletions and
    expirations); None for control records. ``rev_seqno`` .. ``datatype``: data records only.
    ``snapshot_flags``: snapshot records; ``failover_log``: failover-log and rollback records (newest first);
    ``rollback_seqno``: rollback records; ``stream_end_reason``: stream-end records.
    """

    type: RecordType
    vbucket: int
    vbuuid: int
    seqno: int
    snap_start: int
    snap_end: int
    key: bytes | None
    value: bytes | None
    rev_seqno: int | None
    cas: int | None
    flags: int | None
    expiry: int | None
    datatype: int | None
    snapshot_flags: int | None
    failover_log: tuple[FailoverEntry, ...] | None
    rollback_seqno: int | None
    stream_end_reason: int | None
    value_format: ValueFormat
    #: oversize records: bytes of the document body, and why Kafka refused its data record
    size: int | None = None
    reason: str | None = None

    @property
    def is_data(self) -> bool:
        """True for mutations, deletions and expirations."""
        return self.type in OP_OF_TYPE

    @property
    def is_control(self) -> bool:
        """True for snapshot, failover-log, rollback, stream-end and oversize records."""
        return self.type not in OP_OF_TYPE

    @property
    def op(self) -> Op | None:
        """The :class:`~schemas.dcp.Op` of a data record; None for control records."""
        return OP_OF_TYPE.get(self.type)

    @property
    def snapshot_flag_names(self) -> list[str] | None:
        """Names of the snapshot flag bits (``["DISK", "CHK"]``) of a snapshot record; None otherwise."""
        return None if self.snapshot_flags is None else snapshot_flag_names(self.snapshot_flags)

    @property
    def stream_end_reason_name(self) -> str | None:
        """Name of the stream-end reason (``"OK"``, ``"CLOSED"``...) of a stream-end record; None otherwise."""
        return None if self.stream_end_reason is None else stream_end_reason_name(self.stream_end_reason)
