"""A document version with its metadata, and the conflict-resolution comparison the replicator runs
*before* a write to skip what the target would reject (docs/xdcr.md "Optimistic replication").

The target runs conflict resolution itself; this copy only decides what not to send. It skips a write only
when the target's version strictly wins, or is identical (same metadata and deletion state) -- never on a
tie the target breaks by other rules -- so a difference between the two copies can cost a write, never a
document.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

__all__ = ["ConflictMode", "DocVersion", "compare"]


class ConflictMode(StrEnum):
    """A bucket's conflict-resolution mode (``dcpgw up --conflict-resolution``, docs/xdcr.md)."""

    SEQNO = "seqno"
    LWW = "lww"


@dataclass(frozen=True, slots=True)
class DocVersion:
    """One version of a document as the target stores it (``value`` None for a deletion)."""

    key: bytes
    cas: int
    rev_seqno: int
    flags: int
    expiry: int
    deleted: bool
    datatype: int = 0
    value: bytes | None = None

    def order(self, mode: ConflictMode) -> tuple[int, int, int, int]:
        """kv_engine's comparison order: seqno mode rev seqno, CAS, expiry, flags; lww CAS first."""
        if mode is ConflictMode.LWW:
            return (self.cas, self.rev_seqno, self.expiry, self.flags)
        return (self.rev_seqno, self.cas, self.expiry, self.flags)

    def same_meta(self, other: DocVersion) -> bool:
        return (self.cas, self.rev_seqno, self.flags, self.expiry, self.deleted) == \
            (other.cas, other.rev_seqno, other.flags, other.expiry, other.deleted)

    # persisted form of a version (the replicator's source mirror and mutation log)
    _PACK: ClassVar[struct.Struct] = struct.Struct(">QQIIBB")

    def pack(self) -> bytes:
        return self._PACK.pack(self.cas, self.rev_seqno, self.flags, self.expiry, int(self.deleted),
                               self.datatype) + (self.value or b"")

    @classmethod
    def unpack(cls, key: bytes, data: bytes) -> DocVersion:
        cas, rev, flags, expiry, deleted, dt = cls._PACK.unpack_from(data)
        body = data[cls._PACK.size:]
        return cls(key, cas, rev, flags, expiry, bool(deleted), dt, None if deleted else body)


def compare(incoming: DocVersion, existing: DocVersion | None, mode: ConflictMode) -> str | None:
    """None when ``incoming`` should be sent; else why the target would reject it: ``"identical"`` or
    ``"behind"``."""
    if existing is None:
        return None
    if incoming.same_meta(existing):
        return "identical"
    if incoming.order(mode) < existing.order(mode):
        return "behind"
    return None
