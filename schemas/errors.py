"""The exceptions of the record contract, and the product-wide root every other exception derives from.

Shared by the engine (which answers with memcached status codes), the gateway and the connectors, as kv_engine
shares ``include/memcached`` between the engine and its clients: :class:`DcpGatewayError` is the root of every
exception of dcp-gateway; :class:`Status` the memcached binary-protocol status codes; :class:`EngineError` an
error carrying one; :class:`InvalidArgument` a value outside its range (a vbuuid or seqno that is not an
unsigned 64-bit integer, an empty failover log, a bad topic name); :class:`RecordFormatError` a Kafka record
that does not follow docs/record-format.md, the error a consumer catches. ``engine.exceptions`` and
``gateway.exceptions`` re-export these very classes, so ``except`` clauses written against either keep working.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["DcpGatewayError", "EngineError", "InvalidArgument", "RecordFormatError", "Status", "UnknownSchemaError"]


class Status(IntEnum):
    """memcached binary-protocol status codes used by the engine (kv_engine ``cb::mcbp::Status``)."""

    SUCCESS = 0x00
    KEY_ENOENT = 0x01
    KEY_EEXISTS = 0x02
    E2BIG = 0x03
    EINVAL = 0x04
    NOT_STORED = 0x05
    NOT_MY_VBUCKET = 0x07
    AUTH_ERROR = 0x20
    EACCESS = 0x24
    ERANGE = 0x22
    ROLLBACK = 0x23
    UNKNOWN_COMMAND = 0x81
    ENOMEM = 0x82
    EINTERNAL = 0x84
    TMPFAIL = 0x86
    DURABILITY_INVALID_LEVEL = 0xA0
    DURABILITY_IMPOSSIBLE = 0xA1
    SYNC_WRITE_IN_PROGRESS = 0xA2
    SYNC_WRITE_AMBIGUOUS = 0xA3
    # the KV port (docs/kv-protocol.md "Statuses")
    DELTA_BADVAL = 0x06
    LOCKED = 0x09
    NOT_LOCKED = 0x0E
    SYNC_WRITE_RE_COMMIT_IN_PROGRESS = 0xA4


class DcpGatewayError(Exception):
    """Root of every exception raised by dcp-gateway (engine, gateway, connectors, schemas)."""

    retriable: bool = False


class EngineError(DcpGatewayError):
    """An error answered by the engine; ``status`` is the memcached status code it maps to."""

    status: Status = Status.EINVAL


class InvalidArgument(EngineError):
    """EINVAL: malformed input (bad key, bad expiry, bad stream-request fields, bad config, a failover entry or
    record field out of range, a bad topic name)."""

    status = Status.EINVAL


class RecordFormatError(DcpGatewayError):
    """A Kafka record does not follow the record format (docs/record-format.md): a missing or non-decimal
    ``dcp.*`` header, an unknown ``dcp.type`` / ``dcp.format``, a corrupt or truncated Avro value, a value whose
    fields disagree with the headers -- or a value the encoder cannot represent (out-of-range field)."""


class UnknownSchemaError(RecordFormatError):
    """An Avro single-object encoded value names a schema fingerprint this version does not know."""

    def __init__(self, message: str, fingerprint: bytes = b"") -> None:
        super().__init__(message)
        #: the 8-byte little-endian CRC-64-AVRO fingerprint found in the value
        self.fingerprint = fingerprint
