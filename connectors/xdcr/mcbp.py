"""The client side of the memcached binary protocol, framing only what the replicator sends (docs/xdcr.md
"Target client").

Not the engine's codec (``engine.network.protocol``): ``connectors`` may not import ``engine`` (import-linter,
docs/architecture.md), and a replicator talks to any Couchbase-compatible target, so it carries its own small
client framing: request encoding, response decoding, kv_engine's opcodes, statuses and extras layouts.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

__all__ = ["HEADER", "HEADER_LEN", "Datatype", "Feature", "Op", "Response", "Status", "encode_request",
           "response_from"]

REQ_MAGIC: Final = 0x80
RES_MAGIC: Final = 0x81
#: server-initiated request (clustermap change notification) and alt response with framing extras
SERVER_REQ_MAGIC: Final = 0x82
ALT_RES_MAGIC: Final = 0x18
HEADER: Final = struct.Struct(">BBHBBHIIQ")
HEADER_LEN: Final = 24


class Op(IntEnum):
    """kv_engine ``cb::mcbp::ClientOpcode`` values the replicator uses."""

    GET = 0x00
    SET = 0x01
    DELETE = 0x04
    NOOP = 0x0A
    STAT = 0x10
    HELLO = 0x1F
    SASL_LIST_MECHS = 0x20
    SASL_AUTH = 0x21
    SASL_STEP = 0x22
    DCP_GET_FAILOVER_LOG = 0x54
    OBSERVE_SEQNO = 0x91
    SELECT_BUCKET = 0x89
    GET_META = 0xA0
    SET_WITH_META = 0xA2
    ADD_WITH_META = 0xA4
    DEL_WITH_META = 0xA8
    GET_CLUSTER_CONFIG = 0xB5
    GET_ERROR_MAP = 0xFE


class Status(IntEnum):
    """kv_engine ``cb::mcbp::Status`` values the replicator reacts to."""

    SUCCESS = 0x00
    KEY_ENOENT = 0x01
    KEY_EEXISTS = 0x02
    E2BIG = 0x03
    EINVAL = 0x04
    NOT_STORED = 0x05
    NOT_MY_VBUCKET = 0x07
    NO_BUCKET = 0x08
    LOCKED = 0x09
    AUTH_ERROR = 0x20
    AUTH_CONTINUE = 0x21
    ERANGE = 0x22
    ROLLBACK = 0x23
    EACCESS = 0x24
    NOT_INITIALIZED = 0x25
    UNKNOWN_COMMAND = 0x81
    ENOMEM = 0x82
    NOT_SUPPORTED = 0x83
    EINTERNAL = 0x84
    EBUSY = 0x85
    ETMPFAIL = 0x86


#: statuses after which the same write may succeed later (kv_engine: temporary failures)
RETRYABLE: Final = frozenset({Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM, Status.LOCKED,
                              Status.NOT_INITIALIZED})


class Feature(IntEnum):
    """HELLO features (kv_engine ``cb::mcbp::Feature``)."""

    DATATYPE = 0x01
    TLS = 0x02
    TCPNODELAY = 0x03
    MUTATION_SEQNO = 0x04
    XATTR = 0x06
    XERROR = 0x07
    SELECT_BUCKET = 0x08
    SNAPPY = 0x0A
    JSON = 0x0B
    DUPLEX = 0x0C
    CLUSTERMAP_CHANGE_NOTIFICATION = 0x0D
    ALT_REQUEST_SUPPORT = 0x10


class Datatype(IntEnum):
    RAW = 0x00
    JSON = 0x01
    SNAPPY = 0x02
    XATTR = 0x04


# Extras layouts (kv_engine).
#: SET/ADD/DEL_WITH_META: flags, expiration (delete time for deletions), rev seqno, cas, options
WITH_META_EXTRAS: Final = struct.Struct(">IIQQI")
#: GET_META request extras: version (2: the answer carries the datatype)
GET_META_VERSION_2: Final = b"\x02"
#: GET_META answer: deleted, flags, expiration, rev seqno [, datatype (version 2)]
GET_META_EXTRAS: Final = struct.Struct(">IIIQ")
#: mutation token extras of a write answer (HELLO MutationSeqno): vbuuid, seqno
TOKEN_EXTRAS: Final = struct.Struct(">QQ")
PAIR: Final = struct.Struct(">QQ")
#: OBSERVE_SEQNO answer, format 0 (the vbuuid asked is the current one): format, vbucket, vbuuid, persisted
#: seqno, current seqno; format 1 (an older or unknown vbuuid) adds the old vbuuid and the last seqno of its
#: branch the vbucket still holds (0: unknown)
OBSERVE_SEQNO_0: Final = struct.Struct(">BHQQQ")
OBSERVE_SEQNO_1: Final = struct.Struct(">BHQQQQQ")

#: with-meta options (kv_engine protocol_binary.h)
FORCE_ACCEPT_WITH_META_OPS: Final = 0x02
REGENERATE_CAS: Final = 0x04
SKIP_CONFLICT_RESOLUTION_FLAG: Final = 0x08
IS_EXPIRATION: Final = 0x10
#: GET_META answer's ``deleted`` field
GET_META_ITEM_DELETED_FLAG: Final = 0x01


def encode_request(op: int, *, key: bytes = b"", extras: bytes = b"", value: bytes = b"", datatype: int = 0,
                   vbucket: int = 0, opaque: int = 0, cas: int = 0) -> bytes:
    """One request frame (magic 0x80)."""
    body = len(extras) + len(key) + len(value)
    return HEADER.pack(REQ_MAGIC, op, len(key), len(extras), datatype, vbucket, body, opaque, cas) \
        + extras + key + value


@dataclass(frozen=True, slots=True)
class Response:
    """A decoded response (or a server-initiated request, ``magic`` 0x82)."""

    magic: int
    opcode: int
    status: int
    opaque: int
    cas: int
    datatype: int
    extras: bytes
    key: bytes
    value: bytes

    @property
    def ok(self) -> bool:
        return self.status == Status.SUCCESS

    def status_name(self) -> str:
        try:
            return Status(self.status).name
        except ValueError:
            return f"0x{self.status:02x}"


def response_from(header: bytes, body: bytes) -> Response:
    magic, op, keylen, extlen, dt, status, bodylen, opaque, cas = HEADER.unpack(header)
    framing = 0
    if magic == ALT_RES_MAGIC:
        framing, keylen = keylen >> 8, keylen & 0xFF
    elif magic not in (RES_MAGIC, SERVER_REQ_MAGIC):
        raise ValueError(f"bad magic 0x{magic:02x} in a response")
    if framing + extlen + keylen > bodylen or len(body) != bodylen:
        raise ValueError("inconsistent response lengths")
    e = framing + extlen
    return Response(magic, op, status, opaque, cas, dt, body[framing:e], body[e:e + keylen], body[e + keylen:])
