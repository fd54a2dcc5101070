"""XDCR conflict resolution on the target side (kv_engine ``engines/ep/src/conflict_resolution.cc``).

The rules, the metadata type and the option bits are the shared wire contract in schemas/with_meta.py
(re-exported here); this module adds the engine's side: the typed errors, the per-bucket counters, the metadata
checks and the storage key recording the mode.

A write with meta (SET / ADD / DEL_WITH_META, docs/xdcr.md "Target side") carries the source's metadata; the
target keeps it only if it wins against the metadata of the document it holds (a live document or a tombstone).
The bucket's mode is fixed when it is created (``BucketConfig.conflict_resolution``, recorded in the data
directory):

* ``seqno`` (kv_engine ``RevisionSeqnoResolution``, the default): revision seqno, then CAS, then expiry, then
  flags, then "incoming has xattrs and the local document does not";
* ``lww`` (kv_engine ``LastWriteWinsResolution``): the HLC CAS first, then revision seqno, expiry, flags, xattrs.

The first field where they differ decides: a larger incoming value wins. When revision seqno and CAS are equal,
an incoming deletion loses (kv_engine compares expiry only for mutations), and a full tie keeps the local
document -- which is what stops a bidirectional A <-> B replication from looping: the echo of a write carries
exactly the metadata the other side already holds. Such a loss is counted ``rejected_identical``, every other
loss ``rejected_behind``.

Options (kv_engine ``protocol_binary.h``, the 4-byte options word of the extras): SKIP_CONFLICT_RESOLUTION_FLAG
accepts without resolution (the forced acceptance the replicator uses to undo a rolled-back branch),
REGENERATE_CAS (only with SKIP_CONFLICT_RESOLUTION_FLAG) stores a fresh local CAS, FORCE_ACCEPT_WITH_META_OPS is
what an LWW source sends (valid on an ``lww`` bucket only, EINVAL on ``seqno`` as in kv_engine), IS_EXPIRATION
makes a DEL_WITH_META an expiration.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from engine.exceptions import InvalidArgument, KeyExists
from schemas.with_meta import (
    FORCE_ACCEPT_WITH_META_OPS,
    FORCE_WITH_META_OP,
    IS_EXPIRATION,
    KNOWN_OPTIONS,
    REGENERATE_CAS,
    SKIP_CONFLICT_RESOLUTION_FLAG,
    U64_MAX,
    ConflictResolutionMode,
    ItemMeta,
    Resolution,
    WithMetaOptions,
    parse_options,
    resolve,
)

#: the storage meta key recording the bucket's mode (engine/kv/storage.py ``set_meta``)
MODE_META_KEY: Final = "conflict_resolution"


class ConflictResolutionMismatch(InvalidArgument):
    """EINVAL: a bucket is reopened with a conflict-resolution mode other than the one it was created with
    (the mode is fixed at creation, as Couchbase fixes it)."""

    def __init__(self, bucket: str, stored: str, requested: str) -> None:
        super().__init__(
            f"bucket {bucket!r} was created with conflict resolution {stored!r}; it cannot be opened as "
            f"{requested!r} (the mode is fixed when the bucket is created)")
        self.bucket = bucket
        self.stored = stored
        self.requested = requested


class ConflictRejected(KeyExists):
    """KEY_EEXISTS: a write with meta lost conflict resolution (kv_engine answers KEY_EEXISTS).
    ``identical``: the incoming metadata equals the document's (an echo), else it is behind."""

    def __init__(self, message: str, *, identical: bool) -> None:
        super().__init__(message)
        self.identical = identical


@dataclass(slots=True)
class ConflictCounters:
    """Per-bucket counters of writes with meta (Bucket.stats(), STAT, /stats, Prometheus)."""

    accepted: int = 0
    rejected_behind: int = 0
    rejected_identical: int = 0

    def count(self, r: Resolution) -> None:
        if r is Resolution.ACCEPT:
            self.accepted += 1
        elif r is Resolution.BEHIND:
            self.rejected_behind += 1
        else:
            self.rejected_identical += 1

    @classmethod
    def total(cls, counters: Iterable[ConflictCounters]) -> ConflictCounters:
        """The sum over several buckets (the nodes of a cluster)."""
        out = cls()
        for c in counters:
            out.accepted += c.accepted
            out.rejected_behind += c.rejected_behind
            out.rejected_identical += c.rejected_identical
        return out

    def as_dict(self) -> dict[str, int]:
        return {"accepted": self.accepted, "rejected_behind": self.rejected_behind,
                "rejected_identical": self.rejected_identical}


def check_meta(meta: ItemMeta, *, regenerate_cas: bool) -> None:
    """Range checks of incoming metadata. A CAS of 0 or all ones is refused with KEY_EEXISTS, as kv_engine
    answers it (unless the target regenerates the CAS)."""
    if type(meta.rev_seqno) is not int or not 0 <= meta.rev_seqno <= U64_MAX:
        raise InvalidArgument(f"invalid rev seqno {meta.rev_seqno!r}")
    if type(meta.cas) is not int or not 0 <= meta.cas <= U64_MAX:
        raise InvalidArgument(f"invalid cas {meta.cas!r}")
    if type(meta.flags) is not int or not 0 <= meta.flags <= 0xFFFFFFFF:
        raise InvalidArgument(f"invalid flags {meta.flags!r}: must fit in 32 bits")
    if type(meta.expiry) is not int or not 0 <= meta.expiry <= 0xFFFFFFFF:
        raise InvalidArgument(f"invalid expiry {meta.expiry!r}: must fit in 32 bits")
    if type(meta.datatype) is not int or not 0 <= meta.datatype <= 0xFF:
        raise InvalidArgument(f"invalid datatype {meta.datatype!r}")
    if not regenerate_cas and (meta.cas == 0 or meta.cas == U64_MAX):
        raise KeyExists(f"invalid cas {meta.cas} in the metadata of a write with meta")


__all__ = [
    "FORCE_ACCEPT_WITH_META_OPS",
    "FORCE_WITH_META_OP",
    "IS_EXPIRATION",
    "KNOWN_OPTIONS",
    "MODE_META_KEY",
    "REGENERATE_CAS",
    "SKIP_CONFLICT_RESOLUTION_FLAG",
    "ConflictCounters",
    "ConflictRejected",
    "ConflictResolutionMismatch",
    "ConflictResolutionMode",
    "ItemMeta",
    "Resolution",
    "WithMetaOptions",
    "check_meta",
    "parse_options",
    "resolve",
]
