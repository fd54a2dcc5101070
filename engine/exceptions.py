"""Exceptions of the engine, keyed by memcached / DCP status codes.

One root (:class:`DcpGatewayError`) for the whole product; it, the memcached :class:`Status` codes, :class:`EngineError`
and :class:`InvalidArgument` live in :mod:`schemas.errors` (shared with the record contract, as kv_engine shares
``include/memcached``) and are re-exported here. Every engine error carries the memcached status
code a real kv_engine would answer with (``include/memcached/protocol_binary.h``) and a ``retriable`` flag
in the manner of aiokafka's errors: a retriable error may succeed if the caller simply tries again later.
"""

from __future__ import annotations

from schemas.errors import DcpGatewayError as DcpGatewayError
from schemas.errors import EngineError as EngineError
from schemas.errors import InvalidArgument as InvalidArgument
from schemas.errors import Status as Status


class KeyNotFound(EngineError):
    """KEY_ENOENT: the document does not exist (or has expired / been deleted)."""

    status = Status.KEY_ENOENT


class KeyExists(EngineError):
    """KEY_EEXISTS: CAS mismatch, ``add`` of an existing key, or a duplicate DCP stream."""

    status = Status.KEY_EEXISTS


class StateCasMismatch(KeyExists):
    """KEY_EEXISTS: a vbucket state change carried a stale partition-state CAS.

    docs/cluster.md "Partition-state CAS": every state
    command carries the CAS the manager last saw; a mismatch is rejected with the current CAS so the manager
    records it and retries (step 6). Retriable for that reason.
    """

    retriable = True

    def __init__(self, vbucket: int, current_cas: int, given_cas: int) -> None:
        super().__init__(f"vbucket {vbucket}: stale state cas {given_cas} (current {current_cas})")
        self.vbucket = vbucket
        self.current_cas = current_cas
        self.given_cas = given_cas


class ValueTooLarge(EngineError):
    """E2BIG: the value exceeds the bucket's configured maximum."""

    status = Status.E2BIG


class NotStored(EngineError):
    """NOT_STORED: ``replace`` of a missing key."""

    status = Status.NOT_STORED


class NotMyVBucket(EngineError):
    """NOT_MY_VBUCKET: the vbucket does not exist here or is not in a state that serves the request.

    Retriable: the client reloads the vbucket map and retries (docs/gateway-cluster.md "Following the vbucket
    map").
    """

    status = Status.NOT_MY_VBUCKET
    retriable = True


class RangeError(EngineError):
    """ERANGE: a stream request whose seqno range is invalid (start > end, start outside the snapshot...)."""

    status = Status.ERANGE


class RollbackRequired(EngineError):
    """ROLLBACK: the stream request cannot be served from the client's position; roll back to ``seqno``."""

    status = Status.ROLLBACK
    retriable = True

    def __init__(self, vbucket: int, seqno: int) -> None:
        super().__init__(f"vbucket {vbucket}: rollback to seqno {seqno}")
        self.vbucket = vbucket
        self.seqno = seqno


class TemporaryFailure(EngineError):
    """TMPFAIL: the engine cannot serve the request now (e.g. warming up); try again."""

    status = Status.TMPFAIL
    retriable = True


class OutOfMemory(EngineError):
    """ENOMEM: a memory quota prevents accepting the request right now."""

    status = Status.ENOMEM
    retriable = True


class UnknownCommand(EngineError):
    """UNKNOWN_COMMAND: the node does not implement this opcode (memcached answers 0x81)."""

    status = Status.UNKNOWN_COMMAND


class DurabilityInvalidLevel(EngineError):
    """DURABILITY_INVALID_LEVEL (0xa0): the durability level is not one of majority (1),
    majority_and_persist_to_active (2), persist_to_majority (3) -- docs/durability.md "Errors (engine, HTTP)"."""

    status = Status.DURABILITY_INVALID_LEVEL


class DurabilityImpossible(EngineError):
    """DURABILITY_IMPOSSIBLE (0xa1): valid request, but the vbucket's replication chain has fewer defined nodes
    than a majority of its slots (kv_engine ``ReplicationChain::isDurabilityPossible``)."""

    status = Status.DURABILITY_IMPOSSIBLE


class SyncWriteInProgress(EngineError):
    """SYNC_WRITE_IN_PROGRESS (0xa2): the key has a sync write (prepare) in flight. Transient, like ELOCKED:
    retry, possibly with backoff (docs/durability.md "Errors (engine, HTTP)")."""

    status = Status.SYNC_WRITE_IN_PROGRESS
    retriable = True


class SyncWriteAmbiguous(EngineError):
    """SYNC_WRITE_AMBIGUOUS (0xa3): the sync write did not complete in time (timed out and aborted, or the
    vbucket stopped being active): it may have succeeded or failed. Not retriable blindly: retry only an
    idempotent write, or read the document first (docs/durability.md "Why sync writes")."""

    status = Status.SYNC_WRITE_AMBIGUOUS


class SyncWriteReCommitInProgress(EngineError):
    """SYNC_WRITE_RE_COMMIT_IN_PROGRESS (0xa4): a read of a key whose prepare the vbucket holds without a waiter
    (loaded at warmup or kept across a failover) and is re-committing: its value is not known yet. Retriable
    (kv_engine answers it while a "maybe visible" prepare is pending; docs/kv-protocol.md "Statuses")."""

    status = Status.SYNC_WRITE_RE_COMMIT_IN_PROGRESS
    retriable = True


class DocumentLocked(EngineError):
    """LOCKED (0x09): the document is locked by GET_LOCKED and the request did not carry the lock's CAS
    (kv_engine lock semantics, docs/kv-protocol.md "Locks"). Retriable: the lock expires."""

    status = Status.LOCKED
    retriable = True


class NotLocked(EngineError):
    """NOT_LOCKED (0x0e): UNLOCK of a document that is not locked (or whose lock expired)."""

    status = Status.NOT_LOCKED


class DeltaBadValue(EngineError):
    """DELTA_BADVAL (0x06): INCREMENT / DECREMENT of a document whose value is not an unsigned 64-bit decimal."""

    status = Status.DELTA_BADVAL


class StorageError(EngineError):
    """The durable store failed or is corrupt."""

    status = Status.TMPFAIL


class EngineClosed(EngineError):
    """The bucket was closed; no more requests are accepted."""

    status = Status.TMPFAIL


class AuthenticationFailed(EngineError):
    """AUTH_ERROR (0x20): unknown user or wrong password -- one error for both, so a caller cannot tell which
    users exist (docs/security.md). Never carries the password."""

    status = Status.AUTH_ERROR


class AccessDenied(EngineError):
    """EACCESS (0x24): the user is authenticated but none of its roles allows the request (docs/security.md
    "Roles")."""

    status = Status.EACCESS


class UserExists(InvalidArgument):
    """``add`` of a user name already in the user store (docs/security.md "Users")."""


class UnknownUser(InvalidArgument):
    """``delete`` / ``passwd`` / ``set_roles`` of a user name not in the user store."""


class TlsConfigError(InvalidArgument):
    """A TLS certificate, key or CA file is missing, unreadable or invalid (docs/security.md "TLS")."""


#: status code -> exception type, so a status received from elsewhere maps back to the same type.
STATUS_TO_EXCEPTION: dict[Status, type[EngineError]] = {
    Status.KEY_ENOENT: KeyNotFound,
    Status.KEY_EEXISTS: KeyExists,
    Status.E2BIG: ValueTooLarge,
    Status.EINVAL: InvalidArgument,
    Status.NOT_STORED: NotStored,
    Status.NOT_MY_VBUCKET: NotMyVBucket,
    Status.AUTH_ERROR: AuthenticationFailed,
    Status.EACCESS: AccessDenied,
    Status.ERANGE: RangeError,
    Status.ENOMEM: OutOfMemory,
    Status.UNKNOWN_COMMAND: UnknownCommand,
    Status.TMPFAIL: TemporaryFailure,
    Status.DURABILITY_INVALID_LEVEL: DurabilityInvalidLevel,
    Status.DURABILITY_IMPOSSIBLE: DurabilityImpossible,
    Status.SYNC_WRITE_IN_PROGRESS: SyncWriteInProgress,
    Status.SYNC_WRITE_AMBIGUOUS: SyncWriteAmbiguous,
    Status.SYNC_WRITE_RE_COMMIT_IN_PROGRESS: SyncWriteReCommitInProgress,
    Status.LOCKED: DocumentLocked,
    Status.NOT_LOCKED: NotLocked,
    Status.DELTA_BADVAL: DeltaBadValue,
}


def error_for_status(status: int, message: str = "") -> EngineError:
    """Build the typed exception for a memcached status code (unknown codes give a plain EngineError)."""
    try:
        st = Status(status)
    except ValueError:
        err = EngineError(message or f"status 0x{status:02x}")
        return err
    cls = STATUS_TO_EXCEPTION.get(st, EngineError)
    err = cls(message or st.name)
    return err
