"""DCP frames in batches: the node's encoder of a pushed batch and the client's decoder of what it received.

Byte for byte the frames of :func:`engine.network.protocol.encode_dcp_message` and the messages of
:func:`engine.network.protocol.decode_dcp_message` (kv_engine ``cb::mcbp`` DCP layouts, docs/cluster.md "Node
processes"), at a fraction of the CPU per item: the hot shapes -- a mutation, a deletion, an expiration and a
snapshot marker -- are packed with one struct call for header and extras together into one growing buffer
(one transport write per batch) and unpacked with one ``unpack_from`` at an offset of the received bytes (no
per-frame header or body copies, no :class:`~engine.network.protocol.Frame`). Every other message (sync-write
messages, stream ends, takeover state changes) and every frame of an unusual shape (alt magic, unexpected
extras length) takes the general functions, so errors are those of the protocol module. Why it matters:
docs/scale-out.md "Why 2 gateways are not 2x on 2 cores".
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

from engine.dcp.stream import Message, SnapshotMarker
from engine.kv.item import Item, Op
from engine.network.protocol import (
    HEADER_LEN,
    MAX_BODY,
    REQ_MAGIC,
    Frame,
    FrameBuffer,
    Opcode,
    ProtocolError,
    decode_dcp_message,
    encode_dcp_message,
    frame_from,
    parse_header,
)
from schemas.dcp import SnapshotFlags

#: header + extras of the hot frames (protocol.HEADER followed by MUTATION / DELETION / EXPIRATION / MARKER extras)
MUTATION_FRAME: Final = struct.Struct(">BBHBBHIIQQQIIIHB")
DELETION_FRAME: Final = struct.Struct(">BBHBBHIIQQQIB")
EXPIRATION_FRAME: Final = struct.Struct(">BBHBBHIIQQQI")
MARKER_FRAME: Final = struct.Struct(">BBHBBHIIQQQI")
_MUT_EXT: Final = MUTATION_FRAME.size - HEADER_LEN  # 31
_DEL_EXT: Final = DELETION_FRAME.size - HEADER_LEN  # 21
_EXP_EXT: Final = EXPIRATION_FRAME.size - HEADER_LEN  # 20
_MARKER_EXT: Final = MARKER_FRAME.size - HEADER_LEN  # 20
_MUT_SIZE: Final = MUTATION_FRAME.size
_MARKER_SIZE: Final = MARKER_FRAME.size
_MUTATION: Final = int(Opcode.DCP_MUTATION)
_DELETION: Final = int(Opcode.DCP_DELETION)
_EXPIRATION: Final = int(Opcode.DCP_EXPIRATION)
_MARKER: Final = int(Opcode.DCP_SNAPSHOT_MARKER)
_NOOP: Final = int(Opcode.DCP_NOOP)


def encode_dcp_batch(msgs: Iterable[Message], opaques: Mapping[int, int], *, sync: bool = False) -> bytearray:
    """The frames of ``msgs`` back to back, each exactly :func:`encode_dcp_message`'s (the opaque of a message
    is ``opaques[vbucket]``, 0 when absent). :class:`ProtocolError` for a field that does not fit the header."""
    buf = bytearray()
    get = opaques.get
    mutation = MUTATION_FRAME.pack
    try:
        for m in msgs:
            if type(m) is Item:
                op = m.op
                if op is Op.MUTATION and not (sync and m.prepared):
                    k = m.key
                    v = m.value or b""
                    body = _MUT_EXT + len(k) + len(v)
                    if body > MAX_BODY:
                        raise ProtocolError("body, opaque or cas out of range")
                    vb = m.vbucket
                    buf += mutation(REQ_MAGIC, _MUTATION, len(k), _MUT_EXT, m.datatype, vb, body, get(vb, 0), m.cas,
                                    m.seqno, m.rev_seqno, m.flags, m.expiry, 0, 0, 0)
                    buf += k
                    buf += v
                    continue
                if (op is Op.DELETION or op is Op.EXPIRATION) and not (sync and m.prepared):
                    k = m.key
                    v = m.value or b""
                    vb = m.vbucket
                    if op is Op.DELETION:
                        body = _DEL_EXT + len(k) + len(v)
                        head = DELETION_FRAME.pack(REQ_MAGIC, _DELETION, len(k), _DEL_EXT, m.datatype, vb, body,
                                                   get(vb, 0), m.cas, m.seqno, m.rev_seqno, m.expiry, 0)
                    else:
                        body = _EXP_EXT + len(k) + len(v)
                        head = EXPIRATION_FRAME.pack(REQ_MAGIC, _EXPIRATION, len(k), _EXP_EXT, m.datatype, vb,
                                                     body, get(vb, 0), m.cas, m.seqno, m.rev_seqno, m.expiry)
                    if body > MAX_BODY:
                        raise ProtocolError("body, opaque or cas out of range")
                    buf += head
                    buf += k
                    buf += v
                    continue
            elif type(m) is SnapshotMarker:
                vb = m.vbucket
                buf += MARKER_FRAME.pack(REQ_MAGIC, _MARKER, 0, _MARKER_EXT, 0, vb, _MARKER_EXT, get(vb, 0), 0,
                                         m.start, m.end, int(m.flags))
                continue
            # prepares, commits, aborts, stream ends, takeover state changes: the general encoder
            buf += encode_dcp_message(m, get(m.vbucket, 0), sync=sync)
    except struct.error as e:
        raise ProtocolError(f"a DCP message field out of range: {e}") from e
    return buf


def decode_dcp_frames(data: bytes, opaques: Mapping[int, int], out: list[Message]) -> tuple[int, int, Frame | None]:
    """Decode the whole frames at the start of ``data`` as a DCP client receives them: pushed DCP messages of
    the streams in ``opaques`` (vbucket -> the opaque of its current stream request) are appended to ``out``
    as :func:`decode_dcp_message` returns them; requests of other streams (a closed stream's tail) and DCP
    noops are skipped. Returns (bytes consumed, frames consumed, the last response frame among them or None).
    :class:`ProtocolError` for a malformed frame (the connection cannot be resynchronised)."""
    n = len(data)
    pos = 0
    frames = 0
    answer: Frame | None = None
    append = out.append
    unpack_mutation = MUTATION_FRAME.unpack_from
    get = opaques.get
    mutation = Op.MUTATION
    while n - pos >= HEADER_LEN:
        op = data[pos + 1]
        left = n - pos
        if op == _MUTATION and data[pos] == REQ_MAGIC and data[pos + 4] == _MUT_EXT and left >= _MUT_SIZE:
            (_m, _o, kl, _e, dt, vb, bl, opaque, cas,
             by, rev, flags, expiry, _lock, _nmeta, _nru) = unpack_mutation(data, pos)
            end = pos + HEADER_LEN + bl
            if bl <= MAX_BODY and kl + _MUT_EXT <= bl:
                if end > n:
                    break
                if get(vb) == opaque:
                    k = pos + HEADER_LEN + _MUT_EXT
                    append(Item(data[k:k + kl], data[k + kl:end], vb, by, rev, cas, flags, expiry, dt, mutation))
                pos = end
                frames += 1
                continue
        elif op == _MARKER and data[pos] == REQ_MAGIC and data[pos + 4] == _MARKER_EXT and left >= _MARKER_SIZE:
            (_m, _o, kl, _e, _dt, vb, bl, opaque, _cas, start, snap_end, flags) = MARKER_FRAME.unpack_from(data, pos)
            if bl == _MARKER_EXT and kl == 0:
                end = pos + HEADER_LEN + bl
                if end > n:
                    break
                if get(vb) == opaque:
                    append(SnapshotMarker(vb, start, snap_end, SnapshotFlags(flags)))
                pos = end
                frames += 1
                continue
        # any other frame: the general decoder (validation and errors of protocol.parse_header / frame_from)
        h = parse_header(data[pos:pos + HEADER_LEN])
        end = pos + HEADER_LEN + h[6]
        if end > n:
            break
        f = frame_from(h, data[pos + HEADER_LEN:end])
        pos = end
        frames += 1
        if f.is_request:
            if f.opcode == _NOOP or get(f.vbucket) != f.opaque:
                continue  # a noop, or the tail of a stream this connection no longer has
            append(decode_dcp_message(f))
        else:
            answer = f
    return pos, frames, answer


class DcpFrameBuffer(FrameBuffer):
    """A :class:`FrameBuffer` that also decodes a DCP client's frames in one pass (:meth:`take_dcp`). Received
    chunks are kept as they arrive and joined once per decode: the decoder slices keys and values out of
    one ``bytes`` object."""

    def __init__(self) -> None:
        super().__init__()
        self._chunks: list[bytes] = []
        self._size = 0

    def feed(self, data: bytes) -> None:
        self._chunks.append(bytes(data))
        self._size += len(data)

    def __len__(self) -> int:
        return self._size

    def _joined(self) -> bytes:
        chunks = self._chunks
        if len(chunks) == 1:
            return chunks[0]
        data = b"".join(chunks)
        self._chunks = [data] if data else []
        return data

    def _consume(self, nbytes: int) -> None:
        if not nbytes:
            return
        data = self._joined()
        rest = data[nbytes:]
        self._chunks = [rest] if rest else []
        self._size = len(rest)

    def frames(self) -> Iterator[Frame]:
        data = self._joined()
        pos = 0
        try:
            while len(data) - pos >= HEADER_LEN:
                h = parse_header(data[pos:pos + HEADER_LEN])
                end = pos + HEADER_LEN + h[6]
                if end > len(data):
                    return
                f = frame_from(h, data[pos + HEADER_LEN:end])
                pos = end
                yield f
        finally:
            self._consume(pos)

    def take_dcp(self, opaques: Mapping[int, int], out: list[Message]) -> tuple[int, Frame | None]:
        """:func:`decode_dcp_frames` over the buffered bytes, dropping what it consumed: (frames consumed, the
        last response among them)."""
        data = self._joined()
        nbytes, frames, answer = decode_dcp_frames(data, opaques, out)
        self._consume(nbytes)
        return frames, answer


__all__ = ["DcpFrameBuffer", "decode_dcp_frames", "encode_dcp_batch"]
