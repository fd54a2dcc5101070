"""The ``dcp.*`` Kafka record headers and the numeric limits of the record contract (docs/record-format.md).

Every record carries :data:`COMMON_HEADERS`; data records also carry :data:`DATA_HEADERS`. Header values are
ASCII decimal numbers (the unsigned values) or the names of :class:`~schemas.records.RecordType` and
:class:`~schemas.records.ValueFormat`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

__all__ = [
    "COMMON_HEADERS",
    "DATA_HEADERS",
    "H_CAS",
    "H_DATATYPE",
    "H_EXPIRY",
    "H_FLAGS",
    "H_FORMAT",
    "H_REV",
    "H_SEQNO",
    "H_SNAP_END",
    "H_SNAP_START",
    "H_TYPE",
    "H_VBUCKET",
    "H_VBUUID",
    "I32_MAX",
    "KNOWN_HEADERS",
    "U64_MAX",
    "VBUCKET_MAX",
    "Headers",
    "HeadersIn",
]

#: the list form of confluent-kafka's ``HeadersType`` so that ``Producer.produce(headers=...)`` takes it as is.
Headers = list[tuple[str, str | bytes | None]]
#: headers as :func:`decode` takes them: ``Message.headers()`` of confluent-kafka (list or dict), or None
HeadersIn = Sequence[tuple[str, str | bytes | None]] | Mapping[str, str | bytes | None] | None

H_TYPE: Final = "dcp.type"
H_FORMAT: Final = "dcp.format"
H_VBUCKET: Final = "dcp.vbucket"
H_VBUUID: Final = "dcp.vbuuid"
H_SEQNO: Final = "dcp.seqno"
H_SNAP_START: Final = "dcp.snap.start"
H_SNAP_END: Final = "dcp.snap.end"
H_REV: Final = "dcp.rev"
H_CAS: Final = "dcp.cas"
H_FLAGS: Final = "dcp.flags"
H_EXPIRY: Final = "dcp.expiry"
H_DATATYPE: Final = "dcp.datatype"

#: headers every record carries
COMMON_HEADERS: Final = (H_TYPE, H_FORMAT, H_VBUCKET, H_VBUUID, H_SEQNO, H_SNAP_START, H_SNAP_END)
#: headers data records (mutation / deletion / expiration) carry in addition
DATA_HEADERS: Final = (H_REV, H_CAS, H_FLAGS, H_EXPIRY, H_DATATYPE)
#: the headers a record may carry only once
KNOWN_HEADERS: Final = frozenset(COMMON_HEADERS + DATA_HEADERS)

#: the largest unsigned 64-bit value: vbuuids, seqnos, cas, flags and expiries are u64
U64_MAX: Final = (1 << 64) - 1
#: the largest value of an Avro ``int`` field (vbucket, datatype, snapshot flags, stream-end reason)
I32_MAX: Final = (1 << 31) - 1
#: the largest vbucket id (DCP vbucket ids are u16)
VBUCKET_MAX: Final = 0xFFFF
