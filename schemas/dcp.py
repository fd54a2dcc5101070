"""DCP message constants the records carry: the kind of a change, snapshot-marker flags, stream-end reasons.

The engine sends them (kv_engine ``queue_op``, ``DcpSnapshotMarkerFlag``, ``cb::mcbp::DcpStreamEndStatus``);
the records repeat their values (``ChangeEvent.op``, ``ControlEvent.snapshot_flags``,
``ControlEvent.stream_end_reason``; docs/record-format.md), so both read them from here.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag

__all__ = ["Op", "SnapshotFlags", "StreamEndReason"]


class Op(IntEnum):
    """The kind of change an item records (DCP opcode family)."""

    MUTATION = 0
    DELETION = 1
    EXPIRATION = 2
    #: synchronous replication (kv_engine ``queue_op`` pending_sync_write / abort_sync_write): a
    #: prepare of a durable set / durable delete, and the abort of a prepare. Never visible to readers, never
    #: sent to DCP clients that did not enable sync writes. A commit is a MUTATION / DELETION item whose
    #: ``prepared`` is the seqno of the prepare it commits.
    PREPARE = 3
    PREPARE_DELETION = 4
    ABORT = 5


class SnapshotFlags(IntFlag):
    """Snapshot-marker flag bits (kv_engine ``DcpSnapshotMarkerFlag``)."""

    MEMORY = 0x01
    DISK = 0x02
    CHK = 0x04
    ACK = 0x08
    HISTORY = 0x10
    MAY_CONTAIN_DUPLICATES = 0x20


class StreamEndReason(IntEnum):
    """Why a DCP stream ended (kv_engine ``cb::mcbp::DcpStreamEndStatus``)."""

    OK = 0
    CLOSED = 1
    STATE_CHANGED = 2
    DISCONNECTED = 3
    TOO_SLOW = 4
    BACKFILL_FAIL = 5
    ROLLBACK = 6
    FILTER_EMPTY = 7
    LOST_PRIVILEGES = 8
