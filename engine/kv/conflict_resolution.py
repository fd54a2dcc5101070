"""XDCR conflict resolution on the target side (kv_engine ``engines/ep/src/conflict_resolution.cc``).

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

from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Final

from engine.exceptions import InvalidArgument, KeyExists
from engine.kv.item import Datatype

#: kv_engine ``FORCE_WITH_META_OP``: force onto a replica / pending vbucket as well -- not supported here (EINVAL)
FORCE_WITH_META_OP: Final = 0x01
#: kv_engine ``FORCE_ACCEPT_WITH_META_OPS``: sent by an LWW source; accepted on an ``lww`` bucket only
FORCE_ACCEPT_WITH_META_OPS: Final = 0x02
#: kv_engine ``REGENERATE_CAS``: the target generates the CAS (needs SKIP_CONFLICT_RESOLUTION_FLAG)
REGENERATE_CAS: Final = 0x04
#: kv_engine ``SKIP_CONFLICT_RESOLUTION_FLAG``: accept without conflict resolution
SKIP_CONFLICT_RESOLUTION_FLAG: Final = 0x08
#: kv_engine ``IS_EXPIRATION``: a DEL_WITH_META that is an expiration on the source
IS_EXPIRATION: Final = 0x10
KNOWN_OPTIONS: Final = FORCE_ACCEPT_WITH_META_OPS | REGENERATE_CAS | SKIP_CONFLICT_RESOLUTION_FLAG | IS_EXPIRATION
#: the storage meta key recording the bucket's mode (engine/kv/storage.py ``set_meta``)
MODE_META_KEY: Final = "conflict_resolution"
U64_MAX: Final = (1 << 64) - 1


class ConflictResolutionMode(StrEnum):
    """The bucket's conflict-resolution mode (kv_engine ``conflict_resolution_type``)."""

    SEQNO = "seqno"
    LWW = "lww"


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


@dataclass(frozen=True, slots=True)
class ItemMeta:
    """The metadata a write with meta carries and GET_META answers (kv_engine ``ItemMetaData`` + deleted +
    datatype). ``expiry`` is absolute epoch seconds; for a tombstone it is the delete time."""

    cas: int
    rev_seqno: int
    flags: int = 0
    expiry: int = 0
    datatype: int = 0
    deleted: bool = False


class Resolution(Enum):
    ACCEPT = "accept"
    BEHIND = "rejected_behind"
    IDENTICAL = "rejected_identical"


def _wins(mode: ConflictResolutionMode, local: ItemMeta, incoming: ItemMeta, is_delete: bool) -> bool:
    # kv_engine RevisionSeqnoResolution::resolve / LastWriteWinsResolution::resolve, field by field.
    if mode is ConflictResolutionMode.LWW:
        first = (local.cas, incoming.cas)
        second = (local.rev_seqno, incoming.rev_seqno)
    else:
        first = (local.rev_seqno, incoming.rev_seqno)
        second = (local.cas, incoming.cas)
    for lv, iv in (first, second):
        if lv != iv:
            return iv > lv
    if is_delete or local.expiry > incoming.expiry:
        return False
    if local.expiry != incoming.expiry:
        return True
    if local.flags != incoming.flags:
        return incoming.flags > local.flags
    return bool(incoming.datatype & Datatype.XATTR) and not local.datatype & Datatype.XATTR


def resolve(mode: ConflictResolutionMode, local: ItemMeta | None, incoming: ItemMeta, *,
            is_delete: bool) -> Resolution:
    """Whether ``incoming`` replaces ``local`` (None: the target holds nothing for the key: accepted)."""
    if local is None or _wins(mode, local, incoming, is_delete):
        return Resolution.ACCEPT
    same = (local.rev_seqno == incoming.rev_seqno and local.cas == incoming.cas and local.deleted == is_delete
            and (is_delete or (local.expiry == incoming.expiry and local.flags == incoming.flags)))
    return Resolution.IDENTICAL if same else Resolution.BEHIND


@dataclass(frozen=True, slots=True)
class WithMetaOptions:
    """The decoded options word of a write with meta."""

    check_conflicts: bool = True
    regenerate_cas: bool = False
    is_expiration: bool = False


def parse_options(options: int, mode: ConflictResolutionMode, *, deletion: bool) -> WithMetaOptions:
    """kv_engine ``decodeWithMetaOptions``: unknown bits, REGENERATE_CAS without SKIP_CONFLICT_RESOLUTION_FLAG,
    FORCE_ACCEPT_WITH_META_OPS on a ``seqno`` bucket and IS_EXPIRATION on a SET / ADD are EINVAL."""
    if type(options) is not int or not 0 <= options <= 0xFFFFFFFF:
        raise InvalidArgument(f"invalid with-meta options {options!r}")
    if options & ~KNOWN_OPTIONS:
        raise InvalidArgument(f"unsupported with-meta options 0x{options & ~KNOWN_OPTIONS:x}")
    skip = bool(options & SKIP_CONFLICT_RESOLUTION_FLAG)
    regen = bool(options & REGENERATE_CAS)
    if regen and not skip:
        raise InvalidArgument("REGENERATE_CAS needs SKIP_CONFLICT_RESOLUTION_FLAG")
    if options & FORCE_ACCEPT_WITH_META_OPS and mode is not ConflictResolutionMode.LWW:
        raise InvalidArgument("FORCE_ACCEPT_WITH_META_OPS is only valid on an lww bucket")
    expiration = bool(options & IS_EXPIRATION)
    if expiration and not deletion:
        raise InvalidArgument("IS_EXPIRATION is only valid with DEL_WITH_META")
    return WithMetaOptions(not skip, regen, expiration)


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
