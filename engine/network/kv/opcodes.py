"""Client opcodes and statuses of the KV port (kv_engine ``cb::mcbp::ClientOpcode`` / ``cb::mcbp::Status``
numbers; docs/kv-protocol.md "Opcodes" and "Statuses").

The node protocol's opcodes (engine/network/protocol.py ``Opcode``) stay there; these are the ones an SDK sends.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final


class ClientOpcode(IntEnum):
    GET = 0x00
    SET = 0x01
    ADD = 0x02
    REPLACE = 0x03
    DELETE = 0x04
    INCREMENT = 0x05
    DECREMENT = 0x06
    NOOP = 0x0A
    APPEND = 0x0E
    PREPEND = 0x0F
    TOUCH = 0x1C
    GAT = 0x1D
    HELLO = 0x1F
    SASL_LIST_MECHS = 0x20
    SASL_AUTH = 0x21
    SASL_STEP = 0x22
    GET_REPLICA = 0x83
    SELECT_BUCKET = 0x89
    OBSERVE_SEQNO = 0x91
    GET_LOCKED = 0x94
    UNLOCK_KEY = 0x95
    GET_META = 0xA0
    SET_WITH_META = 0xA2
    ADD_WITH_META = 0xA4
    DEL_WITH_META = 0xA8
    GET_CLUSTER_CONFIG = 0xB5
    GET_ERROR_MAP = 0xFE


class KVStatus(IntEnum):
    """Statuses the port answers beyond the engine's (``schemas.errors.Status``)."""

    SUCCESS = 0x00
    KEY_ENOENT = 0x01
    KEY_EEXISTS = 0x02
    E2BIG = 0x03
    EINVAL = 0x04
    NOT_STORED = 0x05
    DELTA_BADVAL = 0x06
    NOT_MY_VBUCKET = 0x07
    NO_BUCKET = 0x08
    LOCKED = 0x09
    NOT_LOCKED = 0x0E
    AUTH_ERROR = 0x20
    AUTH_CONTINUE = 0x21
    ERANGE = 0x22
    EACCESS = 0x24
    UNKNOWN_COMMAND = 0x81
    ENOMEM = 0x82
    NOT_SUPPORTED = 0x83
    EINTERNAL = 0x84
    EBUSY = 0x85
    TMPFAIL = 0x86
    DURABILITY_INVALID_LEVEL = 0xA0
    DURABILITY_IMPOSSIBLE = 0xA1
    SYNC_WRITE_IN_PROGRESS = 0xA2
    SYNC_WRITE_AMBIGUOUS = 0xA3
    SYNC_WRITE_RE_COMMIT_IN_PROGRESS = 0xA4


#: kv_engine ``cb::mcbp::Magic::ServerRequest``: a request the server pushes (cluster map change notification)
SERVER_REQ_MAGIC: Final = 0x82
#: kv_engine ``cb::mcbp::ServerOpcode::ClustermapChangeNotification``
CLUSTERMAP_CHANGE_NOTIFICATION: Final = 0x01
#: Couchbase's largest document value (20 MiB): larger is E2BIG
MAX_VALUE: Final = 20 * 1024 * 1024
