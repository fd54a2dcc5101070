"""Roles modeled on Couchbase RBAC (docs/security.md "Roles").

Couchbase Server's roles are many and parameterised by bucket / scope / collection; this engine serves one bucket
(``default``), so a role here is Couchbase's role on that bucket without parameters: ``admin`` (Couchbase's Full
Admin), ``data_writer`` / ``data_reader`` (Data Writer / Data Reader), ``dcp_reader`` (Data DCP Reader, plus the
gateway's stream and status routes) and ``replication_target`` (XDCR Inbound: writes with metadata).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from engine.exceptions import InvalidArgument

__all__ = ["Role", "allows", "parse_role"]


class Role(StrEnum):
    """One role of a user (its value is the name used in users.json, the CLI and the admin API)."""

    ADMIN = "admin"
    DATA_WRITER = "data_writer"
    DATA_READER = "data_reader"
    DCP_READER = "dcp_reader"
    REPLICATION_TARGET = "replication_target"


def parse_role(s: str) -> Role:
    """The role named ``s``; :class:`InvalidArgument` naming the valid roles otherwise."""
    try:
        return Role(s)
    except ValueError:
        valid = ", ".join(r.value for r in Role)
        raise InvalidArgument(f"unknown role {s!r}: valid roles are {valid}") from None


def allows(roles: Iterable[Role], needed: Role) -> bool:
    """Whether a user holding ``roles`` may do what needs ``needed``: ``admin`` allows everything (Couchbase's
    Full Admin), any other role only itself -- ``data_writer`` does not imply reading (as in Couchbase)."""
    held = set(roles)
    return Role.ADMIN in held or needed in held
