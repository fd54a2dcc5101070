"""The credentials every test talks to a gateway with (docs/security.md): the first admin user, whose password
tests/conftest.py puts in ``DCPGW_ADMIN_PASSWORD`` for the whole session, so in-process services and ``dcpgw up``
subprocesses create ``Administrator`` with it, and the CLI run by tests falls back to it. Authentication stays
on; the tests send these credentials."""

from __future__ import annotations

import base64

ADMIN_USER = "Administrator"
ADMIN_PASSWORD = "test-admin-Pa55word"
ADMIN_PASSWORD_ENV = "DCPGW_ADMIN_PASSWORD"


def basic(user: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> str:
    """The ``Authorization`` header value of Basic ``user:password``."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def auth_headers(user: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> dict[str, str]:
    return {"Authorization": basic(user, password)}
