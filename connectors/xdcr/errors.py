"""Exceptions of the XDCR replicator (docs/xdcr.md), under :class:`connectors.exceptions.ConnectorError`."""

from __future__ import annotations

from connectors.exceptions import ConnectorError

__all__ = ["ConflictModeMismatch", "FilterChanged", "KvError", "TargetAuthError", "TargetError",
           "TargetUnreachable", "XdcrError"]


class XdcrError(ConnectorError):
    """The replicator cannot go on (bad settings, refused target, state store)."""


class TargetError(XdcrError):
    """The target cluster answered something the replicator cannot use."""


class TargetUnreachable(TargetError):
    """No connection to the target (refused, timed out, closed, TLS failure): retried with backoff."""


class TargetAuthError(TargetError):
    """The target refused the credentials (SASL AUTH_ERROR) or the user may not use the bucket."""


class KvError(TargetError):
    """A memcached status the caller did not expect for a request."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class TargetHistoryLost(TargetError):
    """A write answered from a new branch of a target vbucket, or a new target map (a failover on the
    target), and the target no longer holds the position written before: it lost writes the replicator had
    sent. The replicator restarts from the newest checkpoint the target still holds (docs/xdcr.md
    "Checkpoints")."""

    def __init__(self, vbucket: int, position: tuple[int, int], token: tuple[int, int] | None = None) -> None:
        super().__init__(f"the target lost the history of vbucket {vbucket}: position {position} is not held by "
                         f"its new branch{f' {token}' if token else ''}")
        self.vbucket = vbucket


class ConflictModeMismatch(XdcrError):
    """The target bucket's conflict-resolution mode differs from the source's (Couchbase refuses such a
    replication at creation)."""


class FilterChanged(XdcrError):
    """The filters differ from those the state directory was replicated with and neither ``--restream`` nor
    ``--no-restream`` said what to do."""
