"""GET_ERROR_MAP (kv_engine ``etc/couchbase/kv/error_maps/error_map_v*.json``; docs/kv-protocol.md "Error map").

The request's body is the highest version the client understands (u16); the answer is the map of the highest
version <= it that the port has (1 or 2): every status the port answers, with its name, description and the
attributes an SDK acts on (``item-only``, ``temp``, ``auth``, ``retry-now`` ...). Version 2 adds nothing the
port uses, so both versions carry the same errors (``version`` differs).
"""

from __future__ import annotations

import struct
from typing import Any

import orjson

from engine.exceptions import InvalidArgument
from engine.network.kv.opcodes import KVStatus

#: status -> (description, attributes); kv_engine's attribute sets
_ERRORS: dict[int, tuple[str, list[str]]] = {
    KVStatus.SUCCESS: ("Success", ["success"]),
    KVStatus.KEY_ENOENT: ("Not Found", ["item-only"]),
    KVStatus.KEY_EEXISTS: ("key already exists, or CAS mismatch", ["item-only"]),
    KVStatus.E2BIG: ("Value is too big", ["item-only", "invalid-input"]),
    KVStatus.EINVAL: ("Invalid packet", ["internal", "invalid-input"]),
    KVStatus.NOT_STORED: ("Not Stored", ["item-only"]),
    KVStatus.DELTA_BADVAL: ("Existing document not a number", ["item-only", "invalid-input"]),
    KVStatus.NOT_MY_VBUCKET: ("Server does not know about this vBucket", ["fetch-config", "retry-now"]),
    KVStatus.NO_BUCKET: ("Not connected to a bucket", ["conn-state-invalidated"]),
    KVStatus.LOCKED: ("Requested resource is locked", ["item-locked", "item-only", "retry-later"]),
    KVStatus.NOT_LOCKED: ("Requested resource is not locked", ["item-only"]),
    KVStatus.AUTH_ERROR: ("Authentication failed", ["auth", "conn-state-invalidated"]),
    KVStatus.AUTH_CONTINUE: ("Continue authentication", ["auth", "special-handling"]),
    KVStatus.ERANGE: ("Invalid range", ["invalid-input"]),
    KVStatus.EACCESS: ("No access", ["support"]),
    KVStatus.UNKNOWN_COMMAND: ("Unknown command", ["support"]),
    KVStatus.ENOMEM: ("Out of memory", ["temp", "retry-later"]),
    KVStatus.NOT_SUPPORTED: ("Not supported", ["support"]),
    KVStatus.EINTERNAL: ("Internal error", ["internal"]),
    KVStatus.EBUSY: ("Server is busy", ["temp", "retry-later"]),
    KVStatus.TMPFAIL: ("Temporary failure", ["temp", "retry-later"]),
    KVStatus.DURABILITY_INVALID_LEVEL: ("Invalid durability level", ["invalid-input"]),
    KVStatus.DURABILITY_IMPOSSIBLE: ("Durability impossible", ["item-only"]),
    KVStatus.SYNC_WRITE_IN_PROGRESS: ("Synchronous write in progress", ["item-only", "retry-later"]),
    KVStatus.SYNC_WRITE_AMBIGUOUS: ("Synchronous write ambiguous", ["item-only"]),
    KVStatus.SYNC_WRITE_RE_COMMIT_IN_PROGRESS: ("Synchronous write re-commit in progress",
                                                ["item-only", "retry-later"]),
}
MAX_VERSION = 2


def error_map(version: int) -> dict[str, Any]:
    if version < 1:
        raise InvalidArgument("GET_ERROR_MAP version must be at least 1")
    v = min(version, MAX_VERSION)
    errors = {f"{code:x}": {"name": KVStatus(code).name, "desc": desc, "attrs": attrs}
              for code, (desc, attrs) in _ERRORS.items()}
    return {"version": v, "revision": 1, "errors": errors}


def error_map_response_body(request_value: bytes) -> bytes:
    """The JSON answered to a GET_ERROR_MAP whose body is ``request_value`` (u16 version)."""
    if len(request_value) != 2:
        raise InvalidArgument("GET_ERROR_MAP needs a 2-byte version body")
    (version,) = struct.unpack(">H", request_value)
    return orjson.dumps(error_map(version))
