"""The HTTP routes of authentication and user administration (docs/security.md "HTTP API").

* ``POST /auth/token`` (Basic credentials) -> ``{"token", "expires_at", "expires_in", "user"}``: a bearer token
  valid ``token_ttl_s`` seconds; ``DELETE /auth/token`` revokes the bearer token the request presents.
* ``GET /users`` -> ``[{"name", "roles"}]``; ``PUT /users/{name}`` ``{"password", "roles"}`` creates a user or
  updates it (``password`` optional for an existing user); ``DELETE /users/{name}``. Admin only (gateway/auth.py).
  An admin cannot change or delete the user it is authenticated as over the API (no lock-out by accident:
  ``dcpgw user passwd`` on the data directory does it). Deleting a user or changing its password revokes its
  tokens.

The user store blocks (scrypt, fsync): every call to it runs in a worker thread.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from aiohttp import web

from engine.exceptions import InvalidArgument
from engine.security import Role, User, parse_role
from gateway.api import MAX_ADMIN_BODY, ApiError, _read_json
from gateway.auth import CHALLENGE, PRINCIPAL, TOKENS, USERS, run_blocking

__all__ = ["add_routes"]

_USER_FIELDS = frozenset({"password", "roles"})


def _user_json(u: User) -> dict[str, Any]:
    return {"name": u.name, "roles": sorted(r.value for r in u.roles)}


async def issue_token(request: web.Request) -> web.Response:
    principal = request[PRINCIPAL]
    if principal.token is not None:
        raise web.HTTPUnauthorized(text="a token is issued for a user name and password (Basic), not for "
                                        "another token", headers={"WWW-Authenticate": CHALLENGE})
    users = request.app[USERS]
    credential_id = users.credential_id(principal.user.name)
    if credential_id is None:  # deleted in between
        raise web.HTTPUnauthorized(text="authentication failed: unknown user or wrong password",
                                   headers={"WWW-Authenticate": CHALLENGE})
    tokens = request.app[TOKENS]
    token, expires = tokens.issue(principal.user.name, credential_id)
    when = dt.datetime.fromtimestamp(expires, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return web.json_response({"token": token, "expires_at": when, "expires_in": int(tokens.ttl_s),
                              "user": principal.user.name},
                             headers={"Cache-Control": "no-store"})


async def revoke_token(request: web.Request) -> web.Response:
    principal = request[PRINCIPAL]
    if principal.token is None:
        raise ApiError(400, "no_token", "DELETE /auth/token revokes the bearer token sent in "
                                        "'Authorization: Bearer <token>'; this request sent Basic credentials")
    request.app[TOKENS].revoke(principal.token)
    return web.json_response({"revoked": True})


async def list_users(request: web.Request) -> web.Response:
    users = await run_blocking(request, request.app[USERS].list)
    return web.json_response([_user_json(u) for u in users])


def _not_self(request: web.Request, name: str, what: str) -> None:
    if request[PRINCIPAL].user.name == name:
        raise ApiError(409, "cannot_modify_self", f"the user you are authenticated as cannot be {what} over the "
                                                  f"API (no lock-out by accident): use `dcpgw user ...` or "
                                                  f"another admin user")


async def put_user(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    body = await _read_json(request, MAX_ADMIN_BODY, "object")
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_argument", 'body must be a JSON object {"password": ..., "roles": [...]}')
    unknown = sorted(set(body) - _USER_FIELDS)
    if unknown:
        raise ApiError(400, "invalid_argument", f"unknown fields {unknown}: expected password, roles")
    roles_raw = body.get("roles")
    if not isinstance(roles_raw, list) or not roles_raw or not all(isinstance(r, str) for r in roles_raw):
        raise ApiError(400, "invalid_argument", '"roles" must be a non-empty list of role names: '
                                                + ", ".join(r.value for r in Role))
    roles = [parse_role(r) for r in roles_raw]  # InvalidArgument (400) naming the valid roles
    password = body.get("password")
    if password is not None and (not isinstance(password, str) or not password):
        raise ApiError(400, "invalid_argument", '"password" must be a non-empty string')
    _not_self(request, name, "changed")
    store = request.app[USERS]

    def apply() -> tuple[User, bool]:
        if store.get(name) is None:
            if password is None:
                raise InvalidArgument(f'user {name!r} does not exist: "password" is required to create it')
            return store.add(name, password, roles), True
        if password is not None:
            store.passwd(name, password)
        return store.set_roles(name, roles), False

    user, created = await run_blocking(request, apply)
    if password is not None:
        request.app[TOKENS].revoke_user(name)
    return web.json_response(_user_json(user), status=201 if created else 200)


async def delete_user(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    _not_self(request, name, "deleted")
    store = request.app[USERS]

    def apply() -> bool:
        if store.get(name) is None:
            return False
        store.delete(name)
        return True

    if not await run_blocking(request, apply):
        raise ApiError(404, "not_found", f"no user {name!r}")
    request.app[TOKENS].revoke_user(name)
    return web.json_response({"deleted": name})


def add_routes(app: web.Application) -> None:
    """Register the routes of this module on ``app`` (gateway.api.build_app)."""
    app.router.add_post("/auth/token", issue_token)
    app.router.add_delete("/auth/token", revoke_token)
    app.router.add_get("/users", list_users)
    app.router.add_put("/users/{name}", put_user)
    app.router.add_delete("/users/{name}", delete_user)
