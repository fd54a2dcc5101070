"""Bearer tokens of the HTTP API (``POST /auth/token``; docs/security.md "Tokens").

A token is 32 random bytes (``secrets.token_urlsafe``) handed out once; the store keeps only its SHA-256, the
user it was issued to, the user's credential id at that time (:meth:`engine.security.UserStore.credential_id`)
and its expiry. A token stops working when it expires, when it is revoked (``DELETE /auth/token``), or when its
user is deleted or changes password (the credential id no longer matches) -- also when that happens in another
process (``dcpgw user passwd``). Tokens live in the memory of the ``dcpgw up`` process: a restart revokes them
all. The clock is injected.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["MAX_TOKENS", "TokenStore"]

#: live tokens kept at most; issuing one more first drops expired ones, then the oldest
MAX_TOKENS = 10_000


@dataclass(frozen=True)
class _Grant:
    user: str
    credential_id: str
    expires_at: float


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class TokenStore:
    """Issued tokens, by their SHA-256 (module doc). Not thread-safe: used from the event loop only."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.time, max_tokens: int = MAX_TOKENS) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._max = max_tokens
        self._grants: dict[bytes, _Grant] = {}

    def __repr__(self) -> str:
        return f"TokenStore(ttl_s={self.ttl_s}, live={len(self._grants)})"

    def __len__(self) -> int:
        return len(self._grants)

    def issue(self, user: str, credential_id: str) -> tuple[str, float]:
        """A new token for ``user`` and its expiry (seconds since the epoch)."""
        now = self._clock()
        if len(self._grants) >= self._max:
            self._grants = {k: g for k, g in self._grants.items() if g.expires_at > now}
            while len(self._grants) >= self._max:  # insertion order: the oldest first
                del self._grants[next(iter(self._grants))]
        token = secrets.token_urlsafe(32)
        grant = _Grant(user, credential_id, now + self.ttl_s)
        self._grants[_digest(token)] = grant
        return token, grant.expires_at

    def lookup(self, token: str) -> tuple[str, str] | None:
        """``(user, credential id)`` of a live token; None when unknown, revoked or expired."""
        key = _digest(token)
        grant = self._grants.get(key)
        if grant is None:
            return None
        if grant.expires_at <= self._clock():
            del self._grants[key]
            return None
        return grant.user, grant.credential_id

    def revoke(self, token: str) -> bool:
        """Forget ``token``; whether it was live."""
        return self._grants.pop(_digest(token), None) is not None

    def revoke_user(self, user: str) -> int:
        """Forget every token of ``user`` (deleted, or its password changed); how many."""
        drop = [k for k, g in self._grants.items() if g.user == user]
        for k in drop:
            del self._grants[k]
        return len(drop)
