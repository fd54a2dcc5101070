"""The vbucket map: which node holds the active copy and the replicas of every vbucket (ns_server's map).

``chains[vb]`` is the replication chain of vbucket ``vb``: ``chain[0]`` is the active node, the rest are the
replicas in order; ``None`` is an empty slot (a failed-over node not yet replaced, as ns_server's
``undefined``). A node never holds two copies of one vbucket. Every change produces a new map with
``revision + 1`` (clients compare revisions to know whether their copy is stale).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.exceptions import InvalidArgument

#: kv_engine / ns_server: at most 3 replicas per vbucket.
MAX_REPLICAS = 3


class VBucketMap(BaseModel):
    """A revisioned vbucket map (immutable; ``with_chains`` makes the next revision)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    revision: int = Field(ge=0)
    nodes: list[str] = Field(min_length=1)
    chains: list[list[str | None]] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_shape(self) -> VBucketMap:
        if len(set(self.nodes)) != len(self.nodes) or any(not n for n in self.nodes):
            raise ValueError("node names must be unique and non-empty")
        width = len(self.chains[0])
        if not 1 <= width <= MAX_REPLICAS + 1:
            raise ValueError(f"a chain holds 1..{MAX_REPLICAS + 1} slots (active + 0..3 replicas), got {width}")
        known = set(self.nodes)
        for vb, chain in enumerate(self.chains):
            if len(chain) != width:
                raise ValueError(f"vbucket {vb}: chain {chain} has {len(chain)} slots, expected {width}")
            held = [n for n in chain if n is not None]
            if len(set(held)) != len(held):
                raise ValueError(f"vbucket {vb}: a node holds two copies in chain {chain}")
            unknown = [n for n in held if n not in known]
            if unknown:
                raise ValueError(f"vbucket {vb}: unknown nodes {unknown} in chain {chain}")
        return self

    # ------------------------------------------------------------------ construction
    @classmethod
    def generate(cls, nodes: Sequence[str], replicas: int, num_vbuckets: int) -> VBucketMap:
        """A deterministic balanced map: in every slot (active, replica 1, 2, 3) the nodes' counts differ by
        at most one; no node holds two copies of a vbucket. Raises :class:`InvalidArgument` for impossible
        shapes (more replicas than other nodes, more than 3 replicas, no vbuckets)."""
        names = list(nodes)
        n = len(names)
        if n == 0 or len(set(names)) != n:
            raise InvalidArgument(f"need unique node names, got {names}")
        if type(replicas) is not int or not 0 <= replicas <= MAX_REPLICAS:
            raise InvalidArgument(f"replicas must be 0..{MAX_REPLICAS}, got {replicas!r}")
        if replicas >= n:
            raise InvalidArgument(f"{replicas} replicas need at least {replicas + 1} nodes, got {n}")
        if type(num_vbuckets) is not int or num_vbuckets < 1:
            raise InvalidArgument(f"num_vbuckets must be >= 1, got {num_vbuckets!r}")
        chains: list[list[str | None]] = []
        for vb in range(num_vbuckets):
            # Block q of n consecutive vbuckets: actives round robin; replica slot j sits at ring offset
            # 1 + (q + j - 1) mod (n - 1) from the active. The offsets of one chain are distinct and non-zero
            # (no node holds two copies), every block puts each node exactly once in every slot, and the
            # rotation with q spreads each node's replicas over all the other nodes.
            active, q = vb % n, vb // n
            chain = [active] + [(active + 1 + (q + j - 1) % (n - 1)) % n for j in range(1, replicas + 1)]
            chains.append([names[i] for i in chain])
        return cls(revision=1, nodes=names, chains=chains)

    @classmethod
    def from_json(cls, data: str | bytes) -> VBucketMap:
        """Parse a map serialised by :meth:`to_json`; :class:`InvalidArgument` on a bad shape."""
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            raise InvalidArgument(f"invalid vbucket map: {e}") from e

    def to_json(self) -> str:
        return self.model_dump_json()

    def with_chains(self, chains: Sequence[Sequence[str | None]], nodes: Sequence[str] | None = None) -> VBucketMap:
        """The next revision of the map with new chains (and optionally a new node list)."""
        try:
            return VBucketMap(
                revision=self.revision + 1, nodes=list(self.nodes if nodes is None else nodes),
                chains=[list(c) for c in chains])
        except ValidationError as e:
            raise InvalidArgument(f"invalid vbucket map: {e}") from e

    # ------------------------------------------------------------------ queries
    @property
    def num_vbuckets(self) -> int:
        return len(self.chains)

    @property
    def num_replicas(self) -> int:
        return len(self.chains[0]) - 1

    def active(self, vbucket: int) -> str | None:
        return self.chains[vbucket][0]

    def replicas(self, vbucket: int) -> list[str]:
        """The replica nodes of ``vbucket`` (empty slots left out)."""
        return [n for n in self.chains[vbucket][1:] if n is not None]

    def vbuckets_of(self, node: str, slot: int | None = None) -> list[int]:
        """vbuckets whose chain holds ``node`` (in ``slot`` only, when given: 0 = active)."""
        return [vb for vb, c in enumerate(self.chains)
                if (node in c if slot is None else (slot < len(c) and c[slot] == node))]


__all__ = ["MAX_REPLICAS", "VBucketMap"]
