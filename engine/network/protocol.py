"""The memcached binary protocol subset the engine's node processes speak (kv_engine ``cb::mcbp``).

Every frame has a 24-byte big-endian header (``include/memcached/protocol_binary.h``)::

    magic u8 | opcode u8 | key length u16 | extras length u8 | datatype u8 | vbucket (request) / status
    (response) u16 | body length u32 | opaque u32 | cas u64

followed by extras, key and value. Requests have magic 0x80, responses 0x81. A request with flexible framing
extras (durability, docs/durability.md "Node processes") has magic 0x08: the key length field is then framing-extras length u8 | key
length u8, and the framing extras come first in the body. DCP messages the producer pushes
(snapshot marker, mutation, deletion, expiration, stream end) are *requests* sent by the server, as in kv_engine.
Extras layouts are kv_engine's; see docs/cluster.md "Node processes" for the subset and the private opcodes.

Malformed input raises :class:`ProtocolError` (EINVAL), a typed engine error.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

import orjson

from engine.dcp.stream import (
    Message,
    SetVBucketStateMessage,
    SnapshotFlags,
    SnapshotMarker,
    StreamEnd,
    StreamEndReason,
)
from engine.exceptions import (
    DurabilityInvalidLevel,
    EngineError,
    InvalidArgument,
    RollbackRequired,
    Status,
    error_for_status,
)
from engine.kv.conflict_resolution import ConflictRejected
from engine.kv.durability import Durability, Level, parse_level
from engine.kv.item import Item, Op
from engine.kv.vbucket import VBucketState
from schemas.failover_log import FailoverEntry
from schemas.with_meta import (
    GET_META_V1,
    GET_META_V2,
    REJECTED_BEHIND,
    REJECTED_IDENTICAL,
    WithMetaOpcode,
    decode_get_meta_extras,
    decode_with_meta_extras,
    encode_get_meta_extras,
    encode_with_meta_extras,
)

HEADER: Final = struct.Struct(">BBHBBHIIQ")
HEADER_LEN: Final = 24
REQ_MAGIC: Final = 0x80
RES_MAGIC: Final = 0x81
#: kv_engine ``cb::mcbp::Magic::AltClientRequest``: a request with flexible framing extras
ALT_REQ_MAGIC: Final = 0x08
#: flexible frame info id of durability requirements (level u8 [+ timeout u16]), docs/durability.md
FRAME_DURABILITY: Final = 0x01
#: a frame larger than this is refused (kv_engine's max packet size is 30 MiB + header)
MAX_BODY: Final = 32 * 1024 * 1024


class Opcode(IntEnum):
    """Opcodes with kv_engine's numbers (``cb::mcbp::ClientOpcode``), plus a private range (0xe0..)."""

    GET = 0x00
    SET = 0x01
    DELETE = 0x04
    STAT = 0x10
    SET_VBUCKET_STATE = 0x3D
    GET_VBUCKET_STATE = 0x3E
    DCP_OPEN = 0x50
    DCP_ADD_STREAM = 0x51
    DCP_CLOSE_STREAM = 0x52
    DCP_STREAM_REQ = 0x53
    DCP_GET_FAILOVER_LOG = 0x54
    DCP_STREAM_END = 0x55
    DCP_SNAPSHOT_MARKER = 0x56
    DCP_MUTATION = 0x57
    DCP_DELETION = 0x58
    DCP_EXPIRATION = 0x59
    DCP_SET_VBUCKET_STATE = 0x5B
    DCP_NOOP = 0x5C
    DCP_BUFFER_ACKNOWLEDGEMENT = 0x5D
    DCP_CONTROL = 0x5E
    # synchronous replication (docs/durability.md; kv_engine numbers)
    DCP_PREPARE = 0x60
    DCP_SEQNO_ACKNOWLEDGED = 0x61
    DCP_COMMIT = 0x62
    DCP_ABORT = 0x63
    STOP_PERSISTENCE = 0x80
    START_PERSISTENCE = 0x81
    OBSERVE_SEQNO = 0x91
    # XDCR target (docs/xdcr.md "Target side"; kv_engine numbers)
    GET_META = WithMetaOpcode.GET_META
    SET_WITH_META = WithMetaOpcode.SET_WITH_META
    ADD_WITH_META = WithMetaOpcode.ADD_WITH_META
    DEL_WITH_META = WithMetaOpcode.DEL_WITH_META
    # Private to this project (no kv_engine counterpart: ns_server drives replication itself):
    #: value = JSON {"sources": {name: {"host", "port", "vbuckets"}}}: the replication streams this node pulls
    SET_REPLICATION = 0xE0
    #: force a flush of everything queued now (tests; kv_engine's flusher has no such command)
    FLUSH_NOW = 0xE1


#: DCP_OPEN flags (kv_engine ``cb::mcbp::request::DcpOpenPayload``)
DCP_OPEN_PRODUCER: Final = 0x01

#: vbucket states on the wire (kv_engine ``vbucket_state_t``: 1 active, 2 replica, 3 pending, 4 dead)
STATE_CODES: Final = {"active": 1, "replica": 2, "pending": 3, "dead": 4}
CODE_STATES: Final = {v: k for k, v in STATE_CODES.items()}

# Extras layouts (kv_engine).
SET_EXTRAS: Final = struct.Struct(">II")  # flags, expiration
GET_EXTRAS: Final = struct.Struct(">I")  # flags
TOKEN_EXTRAS: Final = struct.Struct(">QQ")  # mutation seqno extras: vbuuid, seqno (HELLO MutationSeqno)
STREAM_REQ_EXTRAS: Final = struct.Struct(">IIQQQQQ")  # flags, reserved, start, end, vbuuid, snap start, end
MARKER_EXTRAS: Final = struct.Struct(">QQI")  # start, end, flags (marker v1)
MUTATION_EXTRAS: Final = struct.Struct(">QQIIIHB")  # by seqno, rev seqno, flags, expiry, lock, nmeta, nru
DELETION_EXTRAS: Final = struct.Struct(">QQIB")  # deletion v2: by seqno, rev seqno, delete time, unused
EXPIRATION_EXTRAS: Final = struct.Struct(">QQI")  # by seqno, rev seqno, delete time
#: DCP_PREPARE: by seqno, rev seqno, flags, expiry, lock time, nru, deleted, durability level
PREPARE_EXTRAS: Final = struct.Struct(">QQIIIBBB")
#: DCP_COMMIT / DCP_ABORT: prepared seqno, commit (abort) seqno
COMPLETION_EXTRAS: Final = struct.Struct(">QQ")
U32: Final = struct.Struct(">I")
U64: Final = struct.Struct(">Q")
OPEN_EXTRAS: Final = struct.Struct(">II")  # seqno, flags
PAIR: Final = struct.Struct(">QQ")
#: OBSERVE_SEQNO answer, format 0: format u8, vbucket u16, vbuuid u64, persisted u64, current u64
OBSERVE0: Final = struct.Struct(">BHQQQ")
#: format 1 (failover happened) adds old vbuuid u64, last seqno received on that branch u64
OBSERVE1: Final = struct.Struct(">BHQQQQQ")


class ProtocolError(InvalidArgument):
    """A malformed frame (bad magic, inconsistent lengths, truncated or oversized body, bad extras)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame. ``vbucket`` is the header's vbucket (requests) and ``status`` its status
    (responses): the same 16 bits."""

    magic: int
    opcode: int
    key: bytes = b""
    extras: bytes = b""
    value: bytes = b""
    datatype: int = 0
    vbucket: int = 0
    opaque: int = 0
    cas: int = 0
    #: flexible framing extras (magic 0x08 requests only)
    framing: bytes = b""

    @property
    def is_request(self) -> bool:
        return self.magic == REQ_MAGIC or self.magic == ALT_REQ_MAGIC

    @property
    def status(self) -> int:
        return self.vbucket

    def encode(self) -> bytes:
        """The frame's bytes (the inverse of :func:`decode_frame`)."""
        return encode(self.magic, self.opcode, self.key, self.extras, self.value, self.datatype,
                      self.vbucket, self.opaque, self.cas, self.framing)


def encode(
    magic: int, opcode: int, key: bytes = b"", extras: bytes = b"", value: bytes = b"", datatype: int = 0,
    vbucket_or_status: int = 0, opaque: int = 0, cas: int = 0, framing: bytes = b"",
) -> bytes:
    """Encode one frame; :class:`ProtocolError` for fields that do not fit the header. With ``framing`` the
    frame is an alt request (magic 0x08, 8-bit framing-extras and key lengths)."""
    if magic not in (REQ_MAGIC, RES_MAGIC, ALT_REQ_MAGIC):
        raise ProtocolError(f"bad magic 0x{magic:02x}")
    if framing and magic == REQ_MAGIC:
        magic = ALT_REQ_MAGIC
    if not 0 <= opcode <= 0xFF or not 0 <= datatype <= 0xFF or not 0 <= vbucket_or_status <= 0xFFFF:
        raise ProtocolError("opcode, datatype or vbucket/status out of range")
    if len(key) > 0xFFFF or len(extras) > 0xFF:
        raise ProtocolError("key or extras too long")
    keyfield = len(key)
    if magic == ALT_REQ_MAGIC:
        if len(key) > 0xFF or len(framing) > 0xFF:
            raise ProtocolError("an alt request's key and framing extras are at most 255 bytes each")
        keyfield = len(framing) << 8 | len(key)
    elif framing:
        raise ProtocolError("only requests carry framing extras")
    body = len(framing) + len(extras) + len(key) + len(value)
    if body > MAX_BODY or not 0 <= opaque <= 0xFFFFFFFF or not 0 <= cas < 1 << 64:
        raise ProtocolError("body, opaque or cas out of range")
    return HEADER.pack(magic, opcode, keyfield, len(extras), datatype, vbucket_or_status, body, opaque,
                       cas) + framing + extras + key + value


def request(opcode: int, *, key: bytes = b"", extras: bytes = b"", value: bytes = b"", datatype: int = 0,
            vbucket: int = 0, opaque: int = 0, cas: int = 0, framing: bytes = b"") -> bytes:
    return encode(REQ_MAGIC, opcode, key, extras, value, datatype, vbucket, opaque, cas, framing)


def response(opcode: int, status: int = Status.SUCCESS, *, key: bytes = b"", extras: bytes = b"",
             value: bytes = b"", datatype: int = 0, opaque: int = 0, cas: int = 0) -> bytes:
    return encode(RES_MAGIC, opcode, key, extras, value, datatype, status, opaque, cas)


def parse_header(header: bytes) -> tuple[int, int, int, int, int, int, int, int, int]:
    """Validate and unpack a 24-byte header: (magic, opcode, keylen, extlen, datatype, vb/status, bodylen,
    opaque, cas)."""
    if len(header) != HEADER_LEN:
        raise ProtocolError(f"header is {len(header)} bytes, expected {HEADER_LEN}")
    fields = HEADER.unpack(header)
    magic, _op, keylen, extlen, _dt, _vb, bodylen, _opaque, _cas = fields
    if magic not in (REQ_MAGIC, RES_MAGIC, ALT_REQ_MAGIC):
        raise ProtocolError(f"bad magic 0x{magic:02x}")
    if bodylen > MAX_BODY:
        raise ProtocolError(f"body of {bodylen} bytes exceeds {MAX_BODY}")
    if magic == ALT_REQ_MAGIC:
        keylen = (keylen >> 8) + (keylen & 0xFF)  # framing extras + key
    if keylen + extlen > bodylen:
        raise ProtocolError(f"key ({keylen}) + extras ({extlen}) exceed the body ({bodylen})")
    return fields


def frame_from(header: tuple[int, int, int, int, int, int, int, int, int], body: bytes) -> Frame:
    magic, op, keylen, extlen, dt, vb, bodylen, opaque, cas = header
    if len(body) != bodylen:
        raise ProtocolError(f"body is {len(body)} bytes, header says {bodylen}")
    if magic == ALT_REQ_MAGIC:
        fl, keylen = keylen >> 8, keylen & 0xFF
        return Frame(magic, op, body[fl + extlen:fl + extlen + keylen], body[fl:fl + extlen],
                     body[fl + extlen + keylen:], dt, vb, opaque, cas, body[:fl])
    return Frame(magic, op, body[extlen:extlen + keylen], body[:extlen], body[extlen + keylen:], dt, vb,
                 opaque, cas)


# ---------------------------------------------------------------------- flexible framing (docs/durability.md)
def encode_durability_frame(durability: Durability) -> bytes:
    """The durability frame info (id 0x01): level, plus the 16-bit timeout when not the bucket default."""
    level = int(durability.level)
    if level == Level.NONE:
        raise DurabilityInvalidLevel("durability level none is not sent in a frame")
    if durability.timeout_ms:
        return bytes([FRAME_DURABILITY << 4 | 3, level]) + durability.timeout_ms.to_bytes(2, "big")
    return bytes([FRAME_DURABILITY << 4 | 1, level])


def decode_framing(framing: bytes) -> Durability | None:
    """The durability requirements among a request's framing extras (None: none). kv_engine rules: frame
    info = id (high nibble) | length (low nibble); durability has length 1 (level) or 3 (level, timeout u16);
    the last one counts when it is repeated; an invalid level is DURABILITY_INVALID_LEVEL, any other malformation
    EINVAL."""
    out: Durability | None = None
    i = 0
    n = len(framing)
    while i < n:
        b = framing[i]
        fid, flen = b >> 4, b & 0x0F
        i += 1
        if fid == 0x0F or flen == 0x0F:
            raise ProtocolError("escaped frame info ids / lengths are not supported")
        if i + flen > n:
            raise ProtocolError("truncated frame info")
        data = framing[i:i + flen]
        i += flen
        if fid != FRAME_DURABILITY:
            raise ProtocolError(f"unsupported frame info id 0x{fid:x}")
        if flen not in (1, 3):
            raise ProtocolError(f"durability frame info of {flen} bytes (1 or 3 expected)")
        # A repeated durability frame info replaces the earlier one, as kv_engine's request parsing does: the
        # official SDK's C++ core appends it again each time it resends a request (a retry after
        # NOT_MY_VBUCKET or TMPFAIL), docs/kv-protocol.md "What differs".
        if not 1 <= data[0] <= 3:  # 0 (none) is expressed by leaving the frame out
            raise DurabilityInvalidLevel(f"invalid durability level {data[0]} in a durability frame: must be 1..3 "
                                         f"(majority, majority_and_persist_to_active, persist_to_majority)")
        level = parse_level(data[0])
        out = Durability(level, int.from_bytes(data[1:3], "big") if flen == 3 else 0)
    return out


def decode_frame(data: bytes) -> Frame:
    """Decode exactly one whole frame."""
    if len(data) < HEADER_LEN:
        raise ProtocolError(f"truncated frame: {len(data)} bytes")
    h = parse_header(data[:HEADER_LEN])
    return frame_from(h, data[HEADER_LEN:])


class FrameBuffer:
    """Incremental decoder: :meth:`feed` bytes as they arrive, iterate the whole frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def __len__(self) -> int:
        return len(self._buf)

    def frames(self) -> Iterator[Frame]:
        buf = self._buf
        while len(buf) >= HEADER_LEN:
            h = parse_header(bytes(buf[:HEADER_LEN]))
            total = HEADER_LEN + h[6]
            if len(buf) < total:
                return
            f = frame_from(h, bytes(buf[HEADER_LEN:total]))
            del buf[:total]
            yield f


# ---------------------------------------------------------------------- payloads
def encode_failover_log(entries: Sequence[FailoverEntry]) -> bytes:
    """kv_engine's failover-log body: (vbuuid u64, seqno u64) pairs, newest first."""
    return b"".join(PAIR.pack(e.vbuuid, e.seqno) for e in entries)


def decode_failover_log(data: bytes) -> list[FailoverEntry]:
    if len(data) % PAIR.size:
        raise ProtocolError(f"failover log body of {len(data)} bytes is not a multiple of 16")
    return [FailoverEntry(u, s) for u, s in PAIR.iter_unpack(data)]


def error_response(opcode: int, err: EngineError, opaque: int = 0, cas: int = 0) -> bytes:
    """An error answer: the status code of ``err``, and kv_engine's JSON error context as the value (a
    ROLLBACK carries the 8-byte rollback seqno instead)."""
    if isinstance(err, RollbackRequired):
        return response(opcode, Status.ROLLBACK, value=U64.pack(err.seqno), opaque=opaque)
    body = orjson.dumps({"error": {"context": str(err)}})
    return response(opcode, int(err.status), value=body, datatype=0x01, opaque=opaque, cas=cas)


def error_from(frame: Frame, vbucket: int = 0) -> EngineError:
    """The typed engine error for an error response (kv_engine status -> ``engine.exceptions``);
    ``vbucket`` is the request's (a response header holds the status there)."""
    if frame.status == Status.ROLLBACK:
        if len(frame.value) != 8:
            raise ProtocolError("ROLLBACK answer without an 8-byte seqno body")
        return RollbackRequired(vbucket, U64.unpack(frame.value)[0])
    message = ""
    if frame.value:
        try:
            message = str(orjson.loads(frame.value)["error"]["context"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            message = frame.value.decode(errors="replace")
    return error_for_status(frame.status, message)


# ---------------------------------------------------------------------- DCP messages
def encode_dcp_message(m: Message, opaque: int, *, sync: bool = False) -> bytes:
    """A DCP message the producer pushes, as kv_engine encodes it (server -> client request). ``sync``: the
    connection enabled sync writes (docs/durability.md "DCP"): a commit is DCP_COMMIT (key, prepared and commit seqnos, no
    value), prepares DCP_PREPARE, aborts DCP_ABORT; without it a commit is a plain mutation / deletion."""
    if type(m) is Item:
        v = m.value or b""
        if m.op >= Op.PREPARE or (sync and m.prepared):
            return _encode_sync_message(m, opaque)
        if m.op is Op.MUTATION:
            ex = MUTATION_EXTRAS.pack(m.seqno, m.rev_seqno, m.flags, m.expiry, 0, 0, 0)
            op = Opcode.DCP_MUTATION
        elif m.op is Op.DELETION:
            ex = DELETION_EXTRAS.pack(m.seqno, m.rev_seqno, m.expiry, 0)
            op = Opcode.DCP_DELETION
        else:
            ex = EXPIRATION_EXTRAS.pack(m.seqno, m.rev_seqno, m.expiry)
            op = Opcode.DCP_EXPIRATION
        return request(op, key=m.key, extras=ex, value=v, datatype=m.datatype, vbucket=m.vbucket,
                       opaque=opaque, cas=m.cas)
    if type(m) is SnapshotMarker:
        return request(Opcode.DCP_SNAPSHOT_MARKER, extras=MARKER_EXTRAS.pack(m.start, m.end, int(m.flags)),
                       vbucket=m.vbucket, opaque=opaque)
    if type(m) is StreamEnd:
        return request(Opcode.DCP_STREAM_END, extras=U32.pack(int(m.reason)), vbucket=m.vbucket, opaque=opaque)
    if type(m) is SetVBucketStateMessage:
        # kv_engine DCP_SET_VBUCKET_STATE: 1 byte of extras, the state code (takeover: pending, active)
        return request(Opcode.DCP_SET_VBUCKET_STATE, extras=bytes([STATE_CODES[m.state.value]]),
                       vbucket=m.vbucket, opaque=opaque)
    raise ProtocolError(f"not a DCP message: {m!r}")


def _encode_sync_message(m: Item, opaque: int) -> bytes:
    if m.op is Op.PREPARE or m.op is Op.PREPARE_DELETION:
        deleted = 1 if m.op is Op.PREPARE_DELETION else 0
        ex = PREPARE_EXTRAS.pack(m.seqno, m.rev_seqno, m.flags, m.expiry, 0, 0, deleted, m.level)
        return request(Opcode.DCP_PREPARE, key=m.key, extras=ex, value=m.value or b"", datatype=m.datatype,
                       vbucket=m.vbucket, opaque=opaque, cas=m.cas)
    ex = COMPLETION_EXTRAS.pack(m.prepared, m.seqno)
    op = Opcode.DCP_ABORT if m.op is Op.ABORT else Opcode.DCP_COMMIT
    return request(op, key=m.key, extras=ex, vbucket=m.vbucket, opaque=opaque)


def decode_dcp_message(f: Frame) -> Message:
    """The engine message of a pushed DCP frame; :class:`ProtocolError` when the extras do not fit. A
    DCP_COMMIT becomes a MUTATION item without value whose ``prepared`` names the prepare (the replica makes
    its prepare visible, engine/kv/vbucket.py ``replica_apply``); DCP_ABORT an ABORT item."""
    op = f.opcode
    try:
        if op == Opcode.DCP_PREPARE:
            by, rev, flags, expiry, _lock, _nru, deleted, level = PREPARE_EXTRAS.unpack(f.extras)
            if not 1 <= level <= 3:
                raise ProtocolError(f"DCP_PREPARE with durability level {level}")
            pop = Op.PREPARE_DELETION if deleted else Op.PREPARE
            return Item(f.key, None if deleted else f.value, f.vbucket, by, rev, f.cas, flags, expiry,
                        f.datatype, pop, 0, level)
        if op == Opcode.DCP_COMMIT or op == Opcode.DCP_ABORT:
            prepared, seqno = COMPLETION_EXTRAS.unpack(f.extras)
            if op == Opcode.DCP_COMMIT:
                return Item(f.key, None, f.vbucket, seqno, 0, 0, 0, 0, 0, Op.MUTATION, 0, 0, prepared)
            return Item(f.key, None, f.vbucket, seqno, 0, 0, 0, 0, 0, Op.ABORT, 0, 0, prepared)
        if op == Opcode.DCP_MUTATION:
            by, rev, flags, expiry, _lock, _nmeta, _nru = MUTATION_EXTRAS.unpack(f.extras)
            return Item(f.key, f.value, f.vbucket, by, rev, f.cas, flags, expiry, f.datatype, Op.MUTATION)
        if op == Opcode.DCP_DELETION:
            by, rev, dtime, _unused = DELETION_EXTRAS.unpack(f.extras)
            return Item(f.key, f.value or None, f.vbucket, by, rev, f.cas, 0, dtime, f.datatype, Op.DELETION)
        if op == Opcode.DCP_EXPIRATION:
            by, rev, dtime = EXPIRATION_EXTRAS.unpack(f.extras)
            return Item(f.key, f.value or None, f.vbucket, by, rev, f.cas, 0, dtime, f.datatype, Op.EXPIRATION)
        if op == Opcode.DCP_SNAPSHOT_MARKER:
            start, end, flags = MARKER_EXTRAS.unpack(f.extras)
            return SnapshotMarker(f.vbucket, start, end, SnapshotFlags(flags))
        if op == Opcode.DCP_STREAM_END:
            (reason,) = U32.unpack(f.extras)
            return StreamEnd(f.vbucket, StreamEndReason(reason))
        if op == Opcode.DCP_SET_VBUCKET_STATE:
            if len(f.extras) != 1 or f.extras[0] not in CODE_STATES:
                raise ValueError(f"bad vbucket state extras {f.extras!r}")
            return SetVBucketStateMessage(f.vbucket, VBucketState(CODE_STATES[f.extras[0]]))
    except (struct.error, ValueError) as e:
        raise ProtocolError(f"bad extras for opcode 0x{op:02x}: {e}") from e
    raise ProtocolError(f"opcode 0x{op:02x} is not a DCP data message")


# ---------------------------------------------------------------------- writes with meta (docs/xdcr.md "Target side")
#: the XDCR target's opcodes (engine/network/with_meta.py)
WITH_META_OPCODES: Final = frozenset(
    {Opcode.GET_META, Opcode.SET_WITH_META, Opcode.ADD_WITH_META, Opcode.DEL_WITH_META})


def conflict_error(f: Frame) -> ConflictRejected | None:
    """The :class:`ConflictRejected` of a KEY_EEXISTS answer to a write with meta whose error context names a
    conflict-resolution reason (None for any other KEY_EEXISTS, e.g. an ADD over a live document)."""
    if f.status != Status.KEY_EEXISTS or not f.value:
        return None
    try:
        err = orjson.loads(f.value)["error"]
        reason, context = err["reason"], str(err["context"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if reason not in (REJECTED_BEHIND, REJECTED_IDENTICAL):
        return None
    return ConflictRejected(context, identical=reason == REJECTED_IDENTICAL)


def encode_stream_request(
    start: int, end: int, vbuuid: int, snap_start: int, snap_end: int, flags: int,
    failover_log: Sequence[FailoverEntry] | None = None,
) -> tuple[bytes, bytes]:
    """(extras, value) of a DCP_STREAM_REQ. The value carries the client's whole failover log as
    (vbuuid, seqno) pairs -- the product's common-ancestor extension (docs/rollback.md); kv_engine puts a
    collections filter there, and an empty value means kv_engine's newest-vbuuid-only rule."""
    try:
        ex = STREAM_REQ_EXTRAS.pack(flags, 0, start, end, vbuuid, snap_start, snap_end)
    except struct.error as e:
        raise InvalidArgument(f"stream request field out of range: {e}") from e
    return ex, encode_failover_log(failover_log or ())


__all__ = [
    "ALT_REQ_MAGIC",
    "CODE_STATES",
    "DCP_OPEN_PRODUCER",
    "GET_META_V1",
    "GET_META_V2",
    "HEADER_LEN",
    "REQ_MAGIC",
    "RES_MAGIC",
    "STATE_CODES",
    "WITH_META_OPCODES",
    "Frame",
    "FrameBuffer",
    "Opcode",
    "ProtocolError",
    "conflict_error",
    "decode_dcp_message",
    "decode_failover_log",
    "decode_frame",
    "decode_framing",
    "decode_get_meta_extras",
    "decode_with_meta_extras",
    "encode",
    "encode_dcp_message",
    "encode_durability_frame",
    "encode_failover_log",
    "encode_get_meta_extras",
    "encode_stream_request",
    "encode_with_meta_extras",
    "error_from",
    "error_response",
    "parse_header",
    "request",
    "response",
]
