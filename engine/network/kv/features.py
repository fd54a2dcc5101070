"""HELLO feature negotiation (kv_engine ``cb::mcbp::Feature``; docs/kv-protocol.md "HELLO").

The client sends the features it wants (u16 each) and its agent name as the key; the server answers the subset
it enables, in the client's order. Features the port does not implement (XATTR, SNAPPY, COLLECTIONS, TRACING,
UNORDERED_EXECUTION, PRESERVE_TTL, ...) are never answered, so an SDK falls back to what it needs without them
(the default collection only; no compression; in-order execution).
"""

from __future__ import annotations

import struct
from enum import IntEnum

from engine.exceptions import InvalidArgument


class Feature(IntEnum):
    TLS = 0x02
    TCP_NODELAY = 0x03
    MUTATION_SEQNO = 0x04
    TCP_DELAY = 0x05
    XATTR = 0x06
    XERROR = 0x07
    SELECT_BUCKET = 0x08
    SNAPPY = 0x0A
    JSON = 0x0B
    DUPLEX = 0x0C
    CLUSTERMAP_CHANGE_NOTIFICATION = 0x0D
    UNORDERED_EXECUTION = 0x0E
    TRACING = 0x0F
    ALT_REQUEST_SUPPORT = 0x10
    SYNC_REPLICATION = 0x11
    COLLECTIONS = 0x12


#: what the port enables when asked
SUPPORTED: frozenset[int] = frozenset({
    Feature.TCP_NODELAY, Feature.MUTATION_SEQNO, Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON,
    Feature.DUPLEX, Feature.CLUSTERMAP_CHANGE_NOTIFICATION, Feature.ALT_REQUEST_SUPPORT, Feature.SYNC_REPLICATION,
})
#: kv_engine: a feature that needs another is enabled only with it
_NEEDS: dict[int, int] = {
    Feature.CLUSTERMAP_CHANGE_NOTIFICATION: Feature.DUPLEX,
    Feature.SYNC_REPLICATION: Feature.ALT_REQUEST_SUPPORT,
}


def parse_hello(value: bytes) -> list[int]:
    """The features a HELLO asks for (EINVAL for an odd-length body)."""
    if len(value) % 2:
        raise InvalidArgument(f"HELLO body of {len(value)} bytes is not a list of 16-bit features")
    return [f for (f,) in struct.iter_unpack(">H", value)]


def negotiate(requested: list[int]) -> list[int]:
    """The enabled subset, in request order, each once (kv_engine ignores duplicates and unknown features)."""
    asked = set(requested)
    out: list[int] = []
    for f in requested:
        if f in SUPPORTED and f not in out:
            need = _NEEDS.get(f)
            if need is None or need in asked:
                out.append(f)
    return out


def encode_features(features: list[int]) -> bytes:
    return b"".join(struct.pack(">H", f) for f in features)
