"""The index backend interface (docs/search.md "Backends").

The indexer (``connectors.search.indexer``) keeps the source's documents in its *document store* -- a SQLite
file written in the rollback-aware consumer's transaction together with the consumer state and the changelog,
exactly like ``connectors.replicate`` -- and every committed change of the store bumps a *generation*. A backend
is a projection of that store: the indexer hands it the documents changed since the generation the backend last
committed (:meth:`IndexBackend.apply`), then :meth:`IndexBackend.commit` with a :class:`Checkpoint` (that
generation and the per-vbucket positions it reflects). Rollback undo (restoring lost-branch documents to their
version at the rollback point, from the changelog) reaches the backend the same way: as upserts of the prior
versions and deletes of keys that did not exist.

Contract of an implementation:

* :meth:`apply` is idempotent per key (an upsert replaces the whole document of ``key``; a delete of a missing
  key is no error): after a crash the indexer applies again everything above the committed generation;
* :meth:`commit` makes the applied operations and the checkpoint durable *together*, or at least the operations
  before the checkpoint (so :meth:`checkpoint` never claims a generation whose operations are not in the index);
* :meth:`checkpoint` reads back the last committed checkpoint (None: an empty/new index, rebuilt from the
  store);
* :meth:`search` answers a query against the last committed state (backends that cannot search raise
  :class:`SearchUnsupported`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from connectors.exceptions import ConnectorError

__all__ = ["ApplyStats", "Checkpoint", "Delete", "Hit", "IndexBackend", "IndexOp", "Position", "SearchError",
           "SearchResult", "SearchUnsupported", "Upsert"]


@dataclass(frozen=True, slots=True)
class Position:
    """What the index reflects of one vbucket: every change up to ``seqno`` of history branch ``vbuuid``."""

    vbuuid: int
    seqno: int


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The document-store generation a backend commit reflects, with the per-vbucket positions of that
    generation (the seqnos a search answer reports)."""

    generation: int
    positions: Mapping[int, Position]
    #: fingerprint of the mapping the index was built with (a change rebuilds the index from the store)
    mapping_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "mapping_id": self.mapping_id,
                "positions": {str(vb): [p.vbuuid, p.seqno] for vb, p in sorted(self.positions.items())}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Checkpoint:
        return cls(int(d["generation"]), {int(vb): Position(int(u), int(s)) for vb, (u, s) in d["positions"].items()},
                   str(d.get("mapping_id", "")))


@dataclass(frozen=True, slots=True)
class Upsert:
    """Index ``key`` (replacing any previous version) from its source body ``value``."""

    key: str
    vbucket: int
    seqno: int
    value: bytes


@dataclass(frozen=True, slots=True)
class Delete:
    """Remove ``key`` from the index (deleted, expired, or absent at a rollback point)."""

    key: str
    vbucket: int
    seqno: int


IndexOp = Upsert | Delete


@dataclass(slots=True)
class ApplyStats:
    """What one :meth:`IndexBackend.apply` did (the indexer adds them up for /status and /metrics)."""

    indexed: int = 0
    deleted: int = 0
    #: documents skipped because their body is not JSON (binary documents: never indexed)
    binary_skipped: int = 0
    #: documents indexed without one or more fields whose JSON value has the wrong type for the mapping
    field_rejected: int = 0
    #: documents the backend refused (e.g. a search cluster's per-item error; see the backend's rejection log)
    rejected: int = 0

    def add(self, o: ApplyStats) -> None:
        self.indexed += o.indexed
        self.deleted += o.deleted
        self.binary_skipped += o.binary_skipped
        self.field_rejected += o.field_rejected
        self.rejected += o.rejected


@dataclass(frozen=True, slots=True)
class Hit:
    key: str
    score: float
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SearchResult:
    hits: list[Hit]
    total: int
    #: the checkpoint of the index state the answer was computed on
    checkpoint: Checkpoint | None = field(default=None)


class SearchError(ConnectorError):
    """A query the backend cannot parse (HTTP 400 with the parser's message)."""


class SearchUnsupported(ConnectorError):
    """This backend cannot answer queries (query the search cluster directly)."""


@runtime_checkable
class IndexBackend(Protocol):
    """Where the indexer's documents go (see the module docstring for the contract)."""

    def apply(self, ops: Sequence[IndexOp]) -> ApplyStats:
        """Stage upserts and deletes (in order; a later op on a key wins). Not visible before :meth:`commit`."""
        ...

    def commit(self, checkpoint: Checkpoint) -> None:
        """Make everything applied so far durable and visible, together with ``checkpoint``."""
        ...

    def checkpoint(self) -> Checkpoint | None:
        """The last committed checkpoint (None: nothing committed yet)."""
        ...

    def reset(self) -> None:
        """Remove every document and the checkpoint (the indexer then rebuilds the index from its store)."""
        ...

    def search(self, query: str, limit: int = 10, offset: int = 0) -> SearchResult:
        """Run ``query`` (the backend's query syntax) on the last committed state."""
        ...

    def close(self) -> None: ...
