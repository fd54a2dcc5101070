"""One KV connection's state (kv_engine ``Connection`` / ``Cookie``; docs/kv-protocol.md "Connections"):
the HELLO features, the authenticated user and its roles, the selected bucket, a SCRAM exchange in progress."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from engine.network.kv.features import Feature
from engine.network.kv.sasl import ScramServer, UserDirectory
from engine.security.roles import Role
from engine.security.users import User

#: how often a session re-reads its user's roles from the store (a role change or a deleted user takes
#: effect within this many seconds, as ns_server pushes RBAC updates to kv_engine)
ROLES_REFRESH_S: Final = 1.0


@dataclass
class Session:
    """A client connection's negotiated state."""

    #: this node's address as the client reached it (the cluster config's ``hostname``)
    host: str
    tls: bool
    peer: str = ""
    features: frozenset[int] = frozenset()
    agent: str = ""
    user: User | None = None
    bucket: str | None = None
    scram: ScramServer | None = None
    monotonic: Callable[[], float] = time.monotonic
    _roles_at: float = field(default=0.0, repr=False)

    # ---- features
    @property
    def xerror(self) -> bool:
        return Feature.XERROR in self.features

    @property
    def json(self) -> bool:
        return Feature.JSON in self.features

    @property
    def mutation_seqno(self) -> bool:
        return Feature.MUTATION_SEQNO in self.features

    @property
    def alt_requests(self) -> bool:
        return Feature.ALT_REQUEST_SUPPORT in self.features

    @property
    def duplex_notifications(self) -> bool:
        return Feature.DUPLEX in self.features and Feature.CLUSTERMAP_CHANGE_NOTIFICATION in self.features

    # ---- identity
    def authenticated(self, user: User) -> None:
        self.user = user
        self.scram = None
        self._roles_at = self.monotonic()

    def roles(self, users: UserDirectory) -> frozenset[Role]:
        """The user's current roles (re-read from the store at most every :data:`ROLES_REFRESH_S`; a deleted
        user has none)."""
        u = self.user
        if u is None:
            return frozenset()
        now = self.monotonic()
        if now - self._roles_at >= ROLES_REFRESH_S:
            self._roles_at = now
            fresh = users.get(u.name)
            self.user = u = fresh if fresh is not None else type(u)(name=u.name, roles=frozenset())
        return u.roles
