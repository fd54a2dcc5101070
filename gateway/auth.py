"""Who may call which route of the HTTP API: the one route -> role table, and the middleware enforcing it
(docs/security.md "HTTP API").

Every route of :func:`gateway.api.build_app` is declared in :data:`ROUTE_ACCESS` with the role it needs (Couchbase
RBAC-like roles, :class:`engine.security.Role`; ``admin`` allows everything), :data:`AUTHENTICATED` (any user) or
:data:`PUBLIC` (no credentials: ``GET /health/live`` only). A route missing from the table is served to ``admin``
only (fail closed), and tests/gateway/test_auth.py, which walks ``app.router``, fails for it.

Credentials: ``Authorization: Basic`` (a user of the store, :class:`engine.security.UserStore`) or
``Authorization: Bearer <token>`` (issued by ``POST /auth/token``, :class:`gateway.tokens.TokenStore`). No or
bad credentials: 401 with ``WWW-Authenticate``; a user without the role: 403; both with the JSON body
``{"error", "message"}`` of every error. An unknown path also needs credentials (401 before 404), so routes cannot
be probed anonymously. Neither the header nor any secret is ever logged or echoed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from aiohttp import web

from engine.exceptions import AuthenticationFailed
from engine.security import Role, User, UserStore, allows
from gateway.tokens import TokenStore

__all__ = [
    "AUTHENTICATED", "CHALLENGE", "PRINCIPAL", "PUBLIC", "REALM", "ROUTE_ACCESS", "TOKENS", "USERS", "Access", "Principal",
    "access_of", "auth_middleware", "install", "run_blocking",
]

#: no credentials needed
PUBLIC: Final = "public"
#: any authenticated user, whatever its roles
AUTHENTICATED: Final = "authenticated"
Access = Role | str
REALM: Final = "dcp-gateway"
CHALLENGE: Final = f'Basic realm="{REALM}", Bearer realm="{REALM}"'

#: (METHOD, route path) -> what it needs. HEAD follows GET. docs/security.md has this table in prose.
ROUTE_ACCESS: dict[tuple[str, str], Access] = {
    # documents: Couchbase's Data Writer cannot read, Data Reader cannot write
    ("GET", "/docs/{key}"): Role.DATA_READER,
    ("PUT", "/docs/{key}"): Role.DATA_WRITER,
    ("DELETE", "/docs/{key}"): Role.DATA_WRITER,
    ("POST", "/docs/_bulk"): Role.DATA_WRITER,
    ("GET", "/buckets/{bucket}/docs/{key}"): Role.DATA_READER,
    ("PUT", "/buckets/{bucket}/docs/{key}"): Role.DATA_WRITER,
    ("DELETE", "/buckets/{bucket}/docs/{key}"): Role.DATA_WRITER,
    ("GET", "/buckets/{bucket}/stats"): Role.DCP_READER,
    # streams and status
    ("GET", "/streams"): Role.DCP_READER,
    ("GET", "/vbuckets"): Role.DCP_READER,
    ("GET", "/vbuckets/{vb}"): Role.DCP_READER,
    ("GET", "/vbuckets/{vb}/failover-log"): Role.DCP_READER,
    ("GET", "/stats"): Role.DCP_READER,
    ("GET", "/metrics"): Role.DCP_READER,
    ("GET", "/health"): Role.DCP_READER,
    ("GET", "/health/ready"): Role.DCP_READER,
    ("GET", "/health/live"): PUBLIC,
    ("GET", "/cluster"): Role.DCP_READER,
    ("GET", "/cluster/map"): Role.DCP_READER,
    ("GET", "/cluster/rebalance"): Role.DCP_READER,
    # cluster operations and users
    ("POST", "/cluster/failover"): Role.ADMIN,
    ("POST", "/cluster/rebalance"): Role.ADMIN,
    ("POST", "/cluster/recover"): Role.ADMIN,
    ("GET", "/users"): Role.ADMIN,
    ("PUT", "/users/{name}"): Role.ADMIN,
    ("DELETE", "/users/{name}"): Role.ADMIN,
    # any user
    ("GET", "/openapi.json"): AUTHENTICATED,
    ("POST", "/auth/token"): AUTHENTICATED,
    ("DELETE", "/auth/token"): AUTHENTICATED,
}

USERS: web.AppKey[UserStore] = web.AppKey("users", UserStore)
TOKENS: web.AppKey[TokenStore] = web.AppKey("tokens", TokenStore)
#: the threads that check passwords (scrypt) and change users: their own small pool, so a burst of wrong
#: passwords takes at most this many cores and never waits behind (or starves) the default executor
AUTH_THREADS: Final = 2
_POOL: web.AppKey[ThreadPoolExecutor] = web.AppKey("auth_pool", ThreadPoolExecutor)
T = TypeVar("T")


def install(app: web.Application, users: UserStore, token_ttl_s: float) -> None:
    """Give ``app`` its user store, token store and password-checking threads (gateway.api.build_app)."""
    app[USERS] = users
    app[TOKENS] = TokenStore(token_ttl_s)
    app[_POOL] = ThreadPoolExecutor(max_workers=AUTH_THREADS, thread_name_prefix="dcpgw-auth")

    async def pool_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        app[_POOL].shutdown(wait=False, cancel_futures=True)

    app.cleanup_ctx.append(pool_ctx)


async def run_blocking(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the app's password-checking threads (user store calls block: scrypt, fsync)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[_POOL], functools.partial(fn, *args))


@dataclass(frozen=True)
class Principal:
    """Who made the request: the user, and the bearer token when it came with one (never logged)."""

    user: User
    token: str | None = None

    def __repr__(self) -> str:
        return f"Principal(user={self.user.name!r}, bearer={self.token is not None})"


PRINCIPAL: web.RequestKey[Principal] = web.RequestKey("principal", Principal)


def access_of(method: str, path: str | None) -> Access:
    """What ``method path`` (a route path as registered) needs: the table's entry, ``admin`` for a route not in
    it (fail closed), any user for no route at all (the 404 / 405 comes after authentication)."""
    if path is None:
        return AUTHENTICATED
    if method == "HEAD":
        method = "GET"
    return ROUTE_ACCESS.get((method, path), Role.ADMIN)


def _route_path(request: web.Request) -> str | None:
    match = request.match_info
    if match.http_exception is not None:
        return None
    resource = match.route.resource
    return resource.canonical if resource is not None else None


def _unauthorized(message: str) -> web.HTTPUnauthorized:
    return web.HTTPUnauthorized(text=message, headers={"WWW-Authenticate": CHALLENGE})


async def authenticate(request: web.Request) -> Principal:
    """The principal of ``request`` from its ``Authorization`` header; HTTPUnauthorized otherwise."""
    header = request.headers.get("Authorization")
    if not header:
        raise _unauthorized("authentication required: send Basic credentials or a Bearer token "
                            "(POST /auth/token); see docs/security.md")
    scheme, _, value = header.strip().partition(" ")
    scheme, value = scheme.lower(), value.strip()
    users = request.app[USERS]
    if scheme == "basic":
        try:
            name, sep, password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, ValueError):
            raise _unauthorized("malformed Basic credentials (base64 of user:password expected)") from None
        if not sep:
            raise _unauthorized("malformed Basic credentials (base64 of user:password expected)")
        try:
            # a check remembered from an earlier request costs an HMAC; a new one a scrypt, off the loop
            user = users.remembered(name, password)
            if user is None:
                user = await run_blocking(request, users.authenticate, name, password)
        except AuthenticationFailed:
            raise _unauthorized("authentication failed: unknown user or wrong password") from None
        return Principal(user)
    if scheme == "bearer":
        grant = request.app[TOKENS].lookup(value) if value else None
        if grant is not None:
            name, credential_id = grant
            user_now = users.get(name)
            if user_now is not None and users.credential_id(name) == credential_id:
                return Principal(user_now, value)
            request.app[TOKENS].revoke(value)
        raise _unauthorized("the bearer token is unknown, expired or revoked: get a new one (POST /auth/token)")
    raise _unauthorized("unsupported authorization scheme: use Basic or Bearer")


@web.middleware
async def auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Authenticate, then authorize against :data:`ROUTE_ACCESS` (module doc)."""
    needed = access_of(request.method, _route_path(request))
    if needed == PUBLIC:
        return await handler(request)
    principal = await authenticate(request)
    if needed != AUTHENTICATED and not allows(principal.user.roles, Role(needed)):
        held = ", ".join(sorted(r.value for r in principal.user.roles)) or "none"
        raise web.HTTPForbidden(text=f"user {principal.user.name!r} (roles: {held}) may not "
                                     f"{request.method} {_route_path(request)}: it needs the role {needed}")
    request[PRINCIPAL] = principal
    return await handler(request)
