"""One KV connection's state (kv_engine ``Connection`` / ``Cookie``; docs/kv-protocol.md "Connections"):
the HELLO features, the authenticated user and its roles, the selected bucket, a SCRAM exchange in progress."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from engine.network.kv.access import allowed
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
    #: opcode -> allowed, for the current roles (cleared when they are re-read)
    _may: dict[int, bool] = field(default_factory=dict, repr=False)

    # ---- features (plain booleans: read on every request)
    xerror: bool = False
    json: bool = False
    mutation_seqno: bool = False
    alt_requests: bool = False
    duplex_notifications: bool = False

    def set_features(self, enabled: list[int]) -> None:
        f = self.features = frozenset(enabled)
        self.xerror = Feature.XERROR in f
        self.json = Feature.JSON in f
        self.mutation_seqno = Feature.MUTATION_SEQNO in f
        self.alt_requests = Feature.ALT_REQUEST_SUPPORT in f
        self.duplex_notifications = Feature.DUPLEX in f and Feature.CLUSTERMAP_CHANGE_NOTIFICATION in f

    # ---- identity
    def authenticated(self, user: User) -> None:
        self.user = user
        self.scram = None
        self._roles_at = self.monotonic()
        self._may.clear()

    def may(self, opcode: int, users: UserDirectory) -> bool:
        """Whether the user's current roles allow ``opcode`` (engine/network/kv/access.py), cached per opcode
        between two reads of the roles."""
        if self.monotonic() - self._roles_at >= ROLES_REFRESH_S:
            self.roles(users)
        ok = self._may.get(opcode)
        if ok is None:
            u = self.user
            ok = self._may[opcode] = u is not None and allowed(u.roles, opcode)
        return ok

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
            self._may.clear()
        return u.roles
