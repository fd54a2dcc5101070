"""Authentication and authorization of the HTTP API (gateway/auth.py, gateway/auth_api.py, docs/security.md).

The walk: every route of the running app (enumerated from ``app.router``, so a route added without a declared
role fails here) is called with no credentials, a wrong password, an expired and a revoked token, and as a user of
every role by Basic auth and by bearer token; each answer is 401 / 403 / "let through" exactly as
``ROUTE_ACCESS`` says. Then tokens, the admin API for users and its bad inputs, a change made by ``dcpgw user``
while the service runs, and that no secret reaches logs, ``/stats``, errors or ``repr``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine import compiled as engine_build
from engine.security import ADMIN_USER, Role, allows
from gateway.api import app_routes
from gateway.auth import AUTHENTICATED, PUBLIC, ROUTE_ACCESS, access_of
from gateway.broker import Broker
from gateway.config import load_settings
from gateway.service import GatewayService
from gateway.tokens import TokenStore
from tests.credentials import ADMIN_PASSWORD, basic
from tests.gateway.api_harness import expect_error, run

ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {role: f"pw-{role.value}-S3cret" for role in Role}
USERS = {role: f"u_{role.value}" for role in Role}

#: a request that reaches the handler of each route with something it accepts or refuses with a 4xx of its own
BODIES: dict[tuple[str, str], bytes] = {
    ("POST", "/docs/_bulk"): b'[{"key": "walk", "value": 1}]',
    ("PUT", "/docs/{key}"): b'{"a": 1}',
    ("POST", "/cluster/failover"): b'{"node": "n9"}',
    ("POST", "/cluster/rebalance"): b"{}",
    ("PUT", "/users/{name}"): b'{"password": "made-by-walk", "roles": ["dcp_reader"]}',
}


def concrete(path: str) -> str:
    return path.replace("{key}", "walk").replace("{vb}", "0").replace("{name}", "walk-made")


async def add_users(svc: GatewayService) -> None:
    assert svc.users is not None
    for role in Role:
        await asyncio.to_thread(svc.users.add, USERS[role], PASSWORDS[role], [role])


async def token_for(http: aiohttp.ClientSession, url: str, user: str, password: str) -> str:
    r = await http.post(f"{url}/auth/token", headers={"Authorization": basic(user, password)})
    assert r.status == 200, await r.text()
    body = await r.json()
    assert set(body) >= {"token", "expires_at"} and body["user"] == user
    return str(body["token"])


def test_every_route_declares_a_role_and_the_table_is_enforced(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, admin: aiohttp.ClientSession) -> None:
        assert svc.runner is not None
        routes = sorted(app_routes(svc.runner.app))
        undeclared = [r for r in routes if r not in ROUTE_ACCESS]
        assert not undeclared, f"routes without a role in gateway/auth.py ROUTE_ACCESS: {undeclared}"
        assert sorted(ROUTE_ACCESS) == routes  # and no stale entry
        await add_users(svc)
        async with aiohttp.ClientSession() as http:
            tokens = {role: await token_for(http, url, USERS[role], PASSWORDS[role]) for role in Role}
            revoked = await token_for(http, url, USERS[Role.ADMIN], PASSWORDS[Role.ADMIN])
            r = await http.delete(f"{url}/auth/token", headers={"Authorization": f"Bearer {revoked}"})
            assert r.status == 200
            bad: dict[str, dict[str, str]] = {
                "none": {},
                "wrong password": {"Authorization": basic(USERS[Role.ADMIN], "nope")},
                "unknown user": {"Authorization": basic("ghost", PASSWORDS[Role.ADMIN])},
                "revoked token": {"Authorization": f"Bearer {revoked}"},
                "made-up token": {"Authorization": "Bearer " + "A" * 43},
                "malformed basic": {"Authorization": "Basic !!!"},
                "other scheme": {"Authorization": "Digest x"},
            }
            checked = 0
            for method, path in routes:
                needed = ROUTE_ACCESS[(method, path)]
                target = url + concrete(path).replace("{bucket}", svc.settings.bucket)
                body = BODIES.get((method, path))
                for what, headers in bad.items():
                    r = await http.request(method, target, data=body, headers=headers)
                    if needed == PUBLIC:
                        assert r.status not in (401, 403), (method, path, what)
                    else:
                        await expect_error(r, 401, "unauthorized")
                        assert r.headers["WWW-Authenticate"].startswith("Basic realm="), r.headers
                    checked += 1
                for role in Role:
                    tok = tokens[role]
                    if (method, path) == ("DELETE", "/auth/token"):  # revokes the token it presents: a spare one
                        tok = await token_for(http, url, USERS[role], PASSWORDS[role])
                    principals = {"basic": basic(USERS[role], PASSWORDS[role]), "bearer": f"Bearer {tok}"}
                    for kind, authz in principals.items():
                        r = await http.request(method, target, data=body, headers={"Authorization": authz})
                        where = (method, path, role.value, kind, r.status)
                        if kind == "bearer" and (method, path) == ("POST", "/auth/token"):
                            await expect_error(r, 401)  # a token is not exchanged for another token
                        elif needed in (PUBLIC, AUTHENTICATED) or allows([role], Role(needed)):
                            assert r.status not in (401, 403), (where, await r.text())
                        else:
                            body_json = await expect_error(r, 403, "forbidden")
                            assert USERS[role] in body_json["message"] and str(needed) in body_json["message"]
                        checked += 1
            assert checked == len(routes) * (len(bad) + 2 * len(Role))
        # an unknown path needs credentials too (no anonymous probing), then it is a 404
        async with aiohttp.ClientSession() as http:
            await expect_error(await http.get(f"{url}/no/such/route"), 401)
        await expect_error(await admin.get(f"{url}/no/such/route"), 404, "not_found")

    run(kafka_broker, tmp_path, scenario)


def test_the_table_in_prose() -> None:
    """Roles the issue names: data_writer cannot read (as in Couchbase), dcp_reader sees streams and status,
    replication_target has no HTTP route, only admin operates the cluster and the users."""
    assert access_of("GET", "/docs/{key}") is Role.DATA_READER
    assert access_of("HEAD", "/docs/{key}") is Role.DATA_READER
    assert not allows([Role.DATA_WRITER], Role.DATA_READER)
    for route in [("GET", "/streams"), ("GET", "/stats"), ("GET", "/metrics"), ("GET", "/health")]:
        assert ROUTE_ACCESS[route] is Role.DCP_READER
    assert ROUTE_ACCESS[("GET", "/health/live")] == PUBLIC
    assert [r for r, need in ROUTE_ACCESS.items() if need == PUBLIC] == [("GET", "/health/live")]
    assert Role.REPLICATION_TARGET not in ROUTE_ACCESS.values()
    assert {r for r, need in ROUTE_ACCESS.items() if need is Role.ADMIN} == {
        ("POST", "/cluster/failover"), ("POST", "/cluster/rebalance"), ("POST", "/cluster/recover"), ("GET", "/users"),
        ("PUT", "/users/{name}"),
        ("DELETE", "/users/{name}")}
    assert access_of("POST", "/a/route/nobody/declared") is Role.ADMIN  # fail closed
    assert access_of("GET", None) == AUTHENTICATED  # no route: authenticate, then 404


def test_token_store_expiry_revocation_and_bound() -> None:
    now = [1000.0]
    store = TokenStore(60.0, clock=lambda: now[0], max_tokens=3)
    tok, expires = store.issue("alice", "c1")
    assert expires == 1060.0 and store.lookup(tok) == ("alice", "c1")
    assert tok not in repr(store)
    now[0] = 1059.9
    assert store.lookup(tok) is not None
    now[0] = 1060.0
    assert store.lookup(tok) is None and len(store) == 0  # expired, and forgotten
    a, _ = store.issue("alice", "c1")
    b, _ = store.issue("bob", "c2")
    assert store.revoke(a) and not store.revoke(a)
    c, _ = store.issue("alice", "c1")
    assert store.revoke_user("alice") == 1 and store.lookup(c) is None and store.lookup(b) is not None
    toks = [store.issue("x", "c")[0] for _ in range(5)]
    assert len(store) == 3 and store.lookup(toks[-1]) is not None and store.lookup(b) is None  # oldest dropped


def test_tokens_expire_and_die_with_the_password(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, admin: aiohttp.ClientSession) -> None:
        assert svc.users is not None
        await asyncio.to_thread(svc.users.add, "tok", "tok-pass", [Role.DCP_READER])
        async with aiohttp.ClientSession() as http:
            r = await http.post(f"{url}/auth/token", headers={"Authorization": basic("tok", "tok-pass")})
            body = await r.json()
            assert r.status == 200 and body["expires_in"] == 1 and body["expires_at"].endswith("Z")
            assert r.headers["Cache-Control"] == "no-store"
            bearer = {"Authorization": f"Bearer {body['token']}"}
            assert (await http.get(f"{url}/stats", headers=bearer)).status == 200
            await asyncio.sleep(1.3)
            await expect_error(await http.get(f"{url}/stats", headers=bearer), 401, "unauthorized")
            # a token of a user whose password changes -- here through the store, as `dcpgw user passwd` does
            # from another process -- or who is deleted, stops working at once
            t2 = await token_for(http, url, "tok", "tok-pass")
            bearer = {"Authorization": f"Bearer {t2}"}
            assert (await http.get(f"{url}/stats", headers=bearer)).status == 200
            await asyncio.to_thread(svc.users.passwd, "tok", "new-pass")
            await expect_error(await http.get(f"{url}/stats", headers=bearer), 401)
            await expect_error(await http.get(f"{url}/stats", headers={"Authorization": basic("tok", "tok-pass")}),
                               401)
            t3 = await token_for(http, url, "tok", "new-pass")
            r = await admin.delete(f"{url}/users/tok")
            assert r.status == 200
            await expect_error(await http.get(f"{url}/stats", headers={"Authorization": f"Bearer {t3}"}), 401)
            # DELETE /auth/token with Basic credentials: nothing to revoke
            await expect_error(await admin.delete(f"{url}/auth/token"), 400, "no_token")

    run(kafka_broker, tmp_path, scenario, token_ttl_s=1.0)


def test_users_admin_api_and_bad_input(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, admin: aiohttp.ClientSession) -> None:
        r = await admin.get(f"{url}/users")
        assert r.status == 200 and await r.json() == [{"name": ADMIN_USER, "roles": ["admin"]}]
        r = await admin.put(f"{url}/users/carol", json={"password": "carol-pw", "roles": ["data_reader"]})
        assert r.status == 201 and await r.json() == {"name": "carol", "roles": ["data_reader"]}
        r = await admin.put(f"{url}/users/carol", json={"roles": ["data_reader", "data_writer"]})
        assert r.status == 200 and (await r.json())["roles"] == ["data_reader", "data_writer"]
        async with aiohttp.ClientSession(headers={"Authorization": basic("carol", "carol-pw")}) as carol:
            assert (await carol.put(f"{url}/docs/c1", data=b'{"c": 1}')).status == 200
            assert (await carol.get(f"{url}/docs/c1")).status == 200
            await expect_error(await carol.get(f"{url}/users"), 403, "forbidden")
        r = await admin.put(f"{url}/users/carol", json={"password": "changed", "roles": ["data_reader"]})
        assert r.status == 200
        bad: list[tuple[str, Any, int, str]] = [
            ("dave", {"password": "x", "roles": ["bucket_admin"]}, 400, "valid roles are admin"),
            ("dave", {"password": "", "roles": ["admin"]}, 400, "password"),
            ("dave", {"password": 5, "roles": ["admin"]}, 400, "password"),
            ("dave", {"password": "x"}, 400, "roles"),
            ("dave", {"password": "x", "roles": []}, 400, "roles"),
            ("dave", {"password": "x", "roles": "admin"}, 400, "roles"),
            ("dave", {"password": "x", "roles": [1]}, 400, "roles"),
            ("dave", {"password": "x", "roles": ["admin"], "email": "d@x"}, 400, "unknown fields"),
            ("dave", ["admin"], 400, "JSON object"),
            ("dave", {"roles": ["admin"]}, 400, "password"),  # a new user needs one
            ("da:ve", {"password": "x", "roles": ["admin"]}, 400, "user name"),
            ("@dave", {"password": "x", "roles": ["admin"]}, 400, "user name"),
            (ADMIN_USER, {"password": "x", "roles": ["admin"]}, 409, "authenticated as"),
        ]
        for name, body, status, text in bad:
            r = await admin.put(f"{url}/users/{name}", json=body)
            err = await expect_error(r, status)
            assert text in err["message"], (name, body, err)
        await expect_error(await admin.put(f"{url}/users/dave", data=b"{nope"), 400, "invalid_json")
        await expect_error(await admin.put(f"{url}/users/dave", data=b"{" + b" " * 70_000 + b"}"), 413)
        await expect_error(await admin.delete(f"{url}/users/nobody"), 404, "not_found")
        await expect_error(await admin.delete(f"{url}/users/{ADMIN_USER}"), 409, "cannot_modify_self")
        r = await admin.get(f"{url}/users")
        listed = await r.json()
        assert [u["name"] for u in listed] == [ADMIN_USER, "carol"]
        assert "changed" not in json.dumps(listed) and "password" not in json.dumps(listed)
        assert (await admin.delete(f"{url}/users/carol")).status == 200

    run(kafka_broker, tmp_path, scenario)


def test_dcpgw_user_cli_while_the_service_runs(kafka_broker: Broker, tmp_path: Path) -> None:
    """`dcpgw user add|list|passwd|delete` on the data directory of a running service: it sees each change at
    the next request; bad input is one error line and exit 2."""

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gateway.cli", "user", *args,
                               "--data-dir", str(tmp_path / "data")],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)

    async def acli(*args: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(cli, *args)

    def one_error(res: subprocess.CompletedProcess[str], text: str) -> None:
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res
        assert text in lines[0] and "Traceback" not in res.stderr, res.stderr

    async def scenario(svc: GatewayService, url: str, admin: aiohttp.ClientSession) -> None:
        res = await acli("add", "erin", "--password", "erin-pw", "--role", "dcp_reader", "--role", "data_reader")
        assert res.returncode == 0 and "added user erin" in res.stdout, res
        async with aiohttp.ClientSession() as http:
            erin = {"Authorization": basic("erin", "erin-pw")}
            assert (await http.get(f"{url}/streams", headers=erin)).status == 200
            res = await acli("list", "--json")
            assert json.loads(res.stdout) == [{"name": ADMIN_USER, "roles": ["admin"]},
                                              {"name": "erin", "roles": ["data_reader", "dcp_reader"]}]
            res = await acli("list")
            assert res.stdout.splitlines() == [f"{ADMIN_USER}\tadmin", "erin\tdata_reader,dcp_reader"]
            assert (await acli("passwd", "erin", "--password", "erin-2")).returncode == 0
            await expect_error(await http.get(f"{url}/streams", headers=erin), 401)
            assert (await http.get(f"{url}/streams", headers={"Authorization": basic("erin", "erin-2")})).status \
                == 200
            assert (await acli("delete", "erin")).returncode == 0
            await expect_error(await http.get(f"{url}/streams", headers={"Authorization": basic("erin", "erin-2")}),
                               401)
        one_error(await acli("add", "x", "--password", "p", "--role", "root"), "unknown role 'root'")
        one_error(await acli("add", ADMIN_USER, "--password", "p", "--role", "admin"), "already exists")
        one_error(await acli("add", "x", "--password", "", "--role", "admin"), "password")
        one_error(await acli("add", "a b", "--password", "p", "--role", "admin"), "user name")
        one_error(await acli("delete", "nobody"), "no user 'nobody'")
        one_error(await acli("passwd", "nobody", "--password", "p"), "no user 'nobody'")
        res = await acli("add", "x", "--password", "p")  # --role is required: a usage error
        assert res.returncode == 2 and "--role" in res.stderr

    run(kafka_broker, tmp_path, scenario)


def test_openapi_document_declares_the_security(kafka_broker: Broker, tmp_path: Path) -> None:
    async def scenario(svc: GatewayService, url: str, admin: aiohttp.ClientSession) -> None:
        doc = await (await admin.get(f"{url}/openapi.json")).json()
        assert doc["components"]["securitySchemes"] == {"basic": {"type": "http", "scheme": "basic"},
                                                        "bearer": {"type": "http", "scheme": "bearer"}}
        assert doc["security"] == [{"basic": []}, {"bearer": []}]
        assert doc["paths"]["/health/live"]["get"]["security"] == []
        assert "401" in doc["paths"]["/docs/{key}"]["get"]["responses"]
        assert "403" in doc["paths"]["/users"]["get"]["responses"]
        async with aiohttp.ClientSession() as http:
            await expect_error(await http.get(f"{url}/openapi.json"), 401)
            assert (await http.get(f"{url}/health/live")).status == 200

    run(kafka_broker, tmp_path, scenario)


def test_no_secret_in_logs_stats_errors_or_repr(kafka_broker: Broker, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []

    async def scenario(svc: GatewayService, url: str, admin: aiohttp.ClientSession) -> None:
        assert svc.users is not None
        await asyncio.to_thread(svc.users.add, "frank", "frank-S3cret", [Role.DCP_READER])
        async with aiohttp.ClientSession() as http:
            token = await token_for(http, url, "frank", "frank-S3cret")
            seen.append(token)
            for headers in ({"Authorization": basic("frank", "frank-S3cret-wrong")},
                            {"Authorization": f"Bearer {token}x"}, {"Authorization": basic("frank", "frank-S3cret")},
                            {"Authorization": f"Bearer {token}"}):
                for path in ("/stats", "/health", "/metrics", "/users", "/streams", "/nope"):
                    r = await http.get(url + path, headers=headers)
                    seen.append(await r.text())
        seen.append(repr(svc.settings))
        seen.append(str(svc.settings.model_dump()))
        seen.append(repr(svc.users))
        seen.append(repr(svc.runner.app if svc.runner else None))

    run(kafka_broker, tmp_path, scenario, admin_password=ADMIN_PASSWORD)
    token = seen.pop(0)
    everything = "\n".join(seen) + "\n".join(r.getMessage() for r in caplog.records) + caplog.text
    for secret in ("frank-S3cret", ADMIN_PASSWORD, token):
        assert secret not in everything
    # the start line says which engine build runs (engine/compiled.py)
    up = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gateway up:")]
    assert up and up[0].endswith(f"; engine {engine_build.mode}"), up
    assert "**********" in repr(load_settings(None, admin_password="hidden-pw"))
    assert "hidden-pw" not in repr(load_settings(None, admin_password="hidden-pw"))
