"""The XDCR wire contract shared by the target (the engine) and the replicator (connectors): the with-meta
opcodes, their extras layouts and option bits (kv_engine ``include/memcached/protocol_binary.h``), the metadata
they carry and the conflict-resolution rules (kv_engine ``engines/ep/src/conflict_resolution.cc``), as
kv_engine shares ``include/memcached`` with its clients (docs/xdcr.md "Target side").

The rules, per mode (a larger incoming value wins at the first field that differs):

* ``seqno`` (kv_engine ``RevisionSeqnoResolution``, the default): revision seqno, CAS, expiry, flags, xattrs;
* ``lww`` (kv_engine ``LastWriteWinsResolution``): CAS (the hybrid logical clock), revision seqno, expiry,
  flags, xattrs.

When the first two fields are equal an incoming deletion loses (kv_engine compares expiry only for mutations);
at a full tie the incoming version wins only if it has xattrs and the local one does not; otherwise a full tie
keeps the local document -- the echo of a write in a bidirectional replication is rejected. A loss whose
revision seqno, CAS and deletion state (and, for a mutation, expiry and flags) equal the local ones is
``rejected_identical``, every other loss ``rejected_behind``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import Enum, IntEnum, StrEnum
from typing import Final

from schemas.errors import InvalidArgument


class WithMetaOpcode(IntEnum):
    """kv_engine ``cb::mcbp::ClientOpcode`` numbers of the XDCR target's commands."""

    GET_META = 0xA0
    SET_WITH_META = 0xA2
    ADD_WITH_META = 0xA4
    DEL_WITH_META = 0xA8


#: kv_engine ``FORCE_WITH_META_OP``: once "also onto replica / pending vbuckets"; since MB-67207 kv_engine treats
#: it as SKIP_CONFLICT_RESOLUTION_FLAG only (active vbuckets only), and so does the engine here
FORCE_WITH_META_OP: Final = 0x01
#: kv_engine ``FORCE_ACCEPT_WITH_META_OPS``: sent by an LWW source; valid on an ``lww`` bucket only
FORCE_ACCEPT_WITH_META_OPS: Final = 0x02
#: kv_engine ``REGENERATE_CAS``: the target generates the CAS (needs a skip of conflict resolution)
REGENERATE_CAS: Final = 0x04
#: kv_engine ``SKIP_CONFLICT_RESOLUTION_FLAG``: accept without conflict resolution (forced acceptance)
SKIP_CONFLICT_RESOLUTION_FLAG: Final = 0x08
#: kv_engine ``IS_EXPIRATION``: a DEL_WITH_META that is an expiration on the source
IS_EXPIRATION: Final = 0x10
KNOWN_OPTIONS: Final = (FORCE_WITH_META_OP | FORCE_ACCEPT_WITH_META_OPS | REGENERATE_CAS
                        | SKIP_CONFLICT_RESOLUTION_FLAG | IS_EXPIRATION)
#: memcached datatype bit of extended attributes (the final tie-break of both modes)
DATATYPE_XATTR: Final = 0x04
U64_MAX: Final = (1 << 64) - 1

#: SET / ADD / DEL_WITH_META extras: flags u32, expiration u32, rev seqno u64, cas u64, then optionally
#: options u32 (28 / 30 bytes) and extended-meta length u16 (26 / 30 bytes)
WITH_META_EXTRAS: Final = struct.Struct(">IIQQ")
WITH_META_EXTRAS_SIZES: Final = (24, 26, 28, 30)
#: GET_META answer: deleted u32, flags u32, expiry u32, rev seqno u64 [, datatype u8 (version 2)]; header CAS
GET_META_EXTRAS: Final = struct.Struct(">IIIQ")
#: kv_engine ``GET_META_ITEM_DELETED_FLAG``
GET_META_DELETED: Final = 0x01
#: GET_META request extras: none or a version byte; version 2 asks for the datatype too
GET_META_V1: Final = 1
GET_META_V2: Final = 2
#: the ``reason`` of a KEY_EEXISTS answer's JSON error context when a write with meta lost conflict resolution
REJECTED_BEHIND: Final = "rejected_behind"
REJECTED_IDENTICAL: Final = "rejected_identical"


class ConflictResolutionMode(StrEnum):
    """A bucket's conflict-resolution mode (kv_engine ``conflict_resolution_type``), fixed at creation."""

    SEQNO = "seqno"
    LWW = "lww"


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
    BEHIND = REJECTED_BEHIND
    IDENTICAL = REJECTED_IDENTICAL


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
    return bool(incoming.datatype & DATATYPE_XATTR) and not local.datatype & DATATYPE_XATTR


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
    """kv_engine ``WithMetaOptions`` / ``decodeWithMetaOptions``: FORCE_WITH_META_OP skips conflict resolution as
    SKIP_CONFLICT_RESOLUTION_FLAG does; unknown bits, REGENERATE_CAS without a skip,
    FORCE_ACCEPT_WITH_META_OPS on a ``seqno`` bucket and IS_EXPIRATION on a SET / ADD are EINVAL."""
    if type(options) is not int or not 0 <= options <= 0xFFFFFFFF:
        raise InvalidArgument(f"invalid with-meta options {options!r}")
    if options & ~KNOWN_OPTIONS:
        raise InvalidArgument(f"unsupported with-meta options 0x{options & ~KNOWN_OPTIONS:x}")
    skip = bool(options & (SKIP_CONFLICT_RESOLUTION_FLAG | FORCE_WITH_META_OP))  # kv_engine WithMetaOptions
    regen = bool(options & REGENERATE_CAS)
    if regen and not skip:
        raise InvalidArgument("REGENERATE_CAS needs SKIP_CONFLICT_RESOLUTION_FLAG")
    if options & FORCE_ACCEPT_WITH_META_OPS and mode is not ConflictResolutionMode.LWW:
        raise InvalidArgument("FORCE_ACCEPT_WITH_META_OPS is only valid on an lww bucket")
    expiration = bool(options & IS_EXPIRATION)
    if expiration and not deletion:
        raise InvalidArgument("IS_EXPIRATION is only valid with DEL_WITH_META")
    return WithMetaOptions(not skip, regen, expiration)


# ---------------------------------------------------------------------- extras layouts
def encode_with_meta_extras(flags: int, expiry: int, rev_seqno: int, cas: int, options: int = 0) -> bytes:
    """Extras of a SET / ADD / DEL_WITH_META: 24 bytes, or 28 with a non-zero options word."""
    try:
        ex = WITH_META_EXTRAS.pack(flags, expiry, rev_seqno, cas)
        return ex + options.to_bytes(4, "big") if options else ex
    except (struct.error, OverflowError) as e:
        raise InvalidArgument(f"with-meta field out of range: {e}") from e


def decode_with_meta_extras(extras: bytes) -> tuple[int, int, int, int, int, int]:
    """(flags, expiry, rev seqno, cas, options, extended-meta length) of a write with meta's extras (24, 26,
    28 or 30 bytes, kv_engine's layouts); :class:`InvalidArgument` otherwise."""
    n = len(extras)
    if n not in WITH_META_EXTRAS_SIZES:
        raise InvalidArgument(f"with-meta extras of {n} bytes, expected one of {WITH_META_EXTRAS_SIZES}")
    flags, expiry, rev, cas = WITH_META_EXTRAS.unpack_from(extras)
    options = int.from_bytes(extras[24:28], "big") if n >= 28 else 0
    nmeta = int.from_bytes(extras[n - 2:], "big") if n in (26, 30) else 0
    return flags, expiry, rev, cas, options, nmeta


def encode_get_meta_extras(deleted: bool, flags: int, expiry: int, rev_seqno: int, datatype: int | None) -> bytes:
    """A GET_META answer's extras (``datatype`` None: version 1, 20 bytes; else 21 bytes)."""
    ex = GET_META_EXTRAS.pack(GET_META_DELETED if deleted else 0, flags, expiry, rev_seqno)
    return ex if datatype is None else ex + bytes([datatype])


def decode_get_meta_extras(extras: bytes) -> tuple[bool, int, int, int, int]:
    """(deleted, flags, expiry, rev seqno, datatype) of a GET_META answer (datatype 0 when absent)."""
    if len(extras) not in (GET_META_EXTRAS.size, GET_META_EXTRAS.size + 1):
        raise InvalidArgument(f"GET_META answer extras of {len(extras)} bytes, expected 20 or 21")
    deleted, flags, expiry, rev = GET_META_EXTRAS.unpack_from(extras)
    datatype = extras[20] if len(extras) == 21 else 0
    return bool(deleted & GET_META_DELETED), flags, expiry, rev, datatype


__all__ = [
    "DATATYPE_XATTR",
    "FORCE_ACCEPT_WITH_META_OPS",
    "FORCE_WITH_META_OP",
    "GET_META_DELETED",
    "GET_META_EXTRAS",
    "GET_META_V1",
    "GET_META_V2",
    "IS_EXPIRATION",
    "KNOWN_OPTIONS",
    "REGENERATE_CAS",
    "REJECTED_BEHIND",
    "REJECTED_IDENTICAL",
    "SKIP_CONFLICT_RESOLUTION_FLAG",
    "WITH_META_EXTRAS",
    "WITH_META_EXTRAS_SIZES",
    "ConflictResolutionMode",
    "ItemMeta",
    "Resolution",
    "WithMetaOpcode",
    "WithMetaOptions",
    "decode_get_meta_extras",
    "decode_with_meta_extras",
    "encode_get_meta_extras",
    "encode_with_meta_extras",
    "parse_options",
    "resolve",
]
