"""The one user store of every interface (HTTP API, KV port): users, roles, password and SCRAM credentials, TLS.

docs/security.md. :mod:`engine.security.roles` holds the Couchbase-style roles, :mod:`engine.security.users` the
user store under the data directory, :mod:`engine.security.tls` the server-side TLS context.
"""

from engine.security.roles import Role, allows, parse_role
from engine.security.tls import client_context, server_context
from engine.security.users import (
    ADMIN_PASSWORD_FILE,
    ADMIN_USER,
    SCRAM_MECHANISMS,
    USERS_FILE,
    ScramCredential,
    User,
    UserStore,
    read_admin_password,
)

__all__ = [
    "ADMIN_PASSWORD_FILE", "ADMIN_USER", "SCRAM_MECHANISMS", "USERS_FILE", "Role", "ScramCredential", "User",
    "UserStore", "allows", "client_context", "parse_role", "read_admin_password", "server_context",
]
