"""The user store (engine/security/users.py, docs/security.md "Users"): hashes, SCRAM credentials, roles, the
file (0600, atomic, reloaded when another process changes it), first admin, and no secret in repr or errors."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.exceptions import (
    AccessDenied,
    AuthenticationFailed,
    InvalidArgument,
    Status,
    UnknownUser,
    UserExists,
)
from engine.security import (
    ADMIN_PASSWORD_FILE,
    ADMIN_USER,
    SCRAM_MECHANISMS,
    USERS_FILE,
    Role,
    UserStore,
    allows,
    parse_role,
    read_admin_password,
)
from engine.security.users import scram_credential

ROOT = Path(__file__).resolve().parents[3]
SECRET = "s3cret-Pa55word!"


def test_roles_parse_and_allow() -> None:
    assert parse_role("data_reader") is Role.DATA_READER
    with pytest.raises(InvalidArgument, match="valid roles are admin, data_writer"):
        parse_role("bucket_admin")
    assert allows([Role.ADMIN], Role.DCP_READER)
    assert allows([Role.DATA_READER, Role.DCP_READER], Role.DCP_READER)
    assert not allows([Role.DATA_WRITER], Role.DATA_READER)  # as in Couchbase: a writer cannot read
    assert not allows([], Role.DATA_READER)


def test_statuses_of_the_errors() -> None:
    assert AuthenticationFailed.status is Status.AUTH_ERROR and int(Status.AUTH_ERROR) == 0x20
    assert AccessDenied.status is Status.EACCESS and int(Status.EACCESS) == 0x24
    assert issubclass(UserExists, InvalidArgument) and issubclass(UnknownUser, InvalidArgument)


def test_add_authenticate_and_file_mode(tmp_path: Path) -> None:
    store = UserStore.open(tmp_path)
    assert store.list() == []
    u = store.add("alice", SECRET, [Role.DATA_READER, Role.DCP_READER])
    assert u.roles == {Role.DATA_READER, Role.DCP_READER}
    assert store.authenticate("alice", SECRET) == u
    assert store.authenticate("alice", SECRET) == u  # the remembered check
    f = tmp_path / USERS_FILE
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    text = f.read_text()
    assert SECRET not in text
    rec = json.loads(text)["users"]["alice"]
    assert rec["password"]["algorithm"] == "scrypt" and len(rec["password"]["salt"]) > 0
    with pytest.raises(AuthenticationFailed) as wrong:
        store.authenticate("alice", SECRET + "x")
    with pytest.raises(AuthenticationFailed) as unknown:
        store.authenticate("bob", SECRET)
    assert str(wrong.value) == str(unknown.value)  # one error for both
    assert SECRET not in str(wrong.value)


def test_salts_differ_for_same_password(tmp_path: Path) -> None:
    store = UserStore.open(tmp_path)
    store.add("a", SECRET, [Role.ADMIN])
    store.add("b", SECRET, [Role.ADMIN])
    users = json.loads((tmp_path / USERS_FILE).read_text())["users"]
    assert users["a"]["password"]["hash"] != users["b"]["password"]["hash"]
    assert users["a"]["scram"]["SCRAM-SHA512"]["salt"] != users["b"]["scram"]["SCRAM-SHA512"]["salt"]


@pytest.mark.parametrize("mechanism", SCRAM_MECHANISMS)
def test_scram_credentials_follow_rfc5802(tmp_path: Path, mechanism: str) -> None:
    store = UserStore.open(tmp_path)
    store.add("alice", SECRET, [Role.DATA_WRITER])
    cred = store.scram_credential("alice", mechanism)
    assert cred is not None and cred.iterations == 15000 and len(cred.salt) == 16
    h = cred.hash_name
    salted = hashlib.pbkdf2_hmac(h, SECRET.encode(), cred.salt, cred.iterations)
    client_key = hmac.new(salted, b"Client Key", h).digest()
    assert cred.stored_key == hashlib.new(h, client_key).digest()
    assert cred.server_key == hmac.new(salted, b"Server Key", h).digest()
    assert scram_credential(mechanism, SECRET, cred.salt, cred.iterations) == cred
    assert store.scram_credential("alice", "PLAIN") is None
    assert store.scram_credential("nobody", mechanism) is None
    r = repr(cred)
    assert cred.stored_key.hex() not in r and repr(cred.salt) not in r and mechanism in r


def test_bad_inputs(tmp_path: Path) -> None:
    store = UserStore.open(tmp_path)
    store.add("alice", SECRET, [Role.ADMIN])
    with pytest.raises(UserExists):
        store.add("alice", "other", [Role.ADMIN])
    for bad_name in ["", "a:b", "with space", "@x", "x" * 129, "tab\t", "br{ace"]:
        with pytest.raises(InvalidArgument, match="user name"):
            store.add(bad_name, SECRET, [Role.ADMIN])
    with pytest.raises(InvalidArgument, match="password"):
        store.add("bob", "", [Role.ADMIN])
    with pytest.raises(InvalidArgument, match="password"):
        store.add("bob", "a\x00b", [Role.ADMIN])
    with pytest.raises(InvalidArgument, match="at least one role"):
        store.add("bob", SECRET, [])
    with pytest.raises(InvalidArgument, match="unknown role"):
        store.add("bob", SECRET, ["ro_admin"])  # type: ignore[list-item]
    with pytest.raises(UnknownUser):
        store.delete("bob")
    with pytest.raises(UnknownUser):
        store.passwd("bob", SECRET)
    with pytest.raises(UnknownUser):
        store.set_roles("bob", [Role.ADMIN])
    with pytest.raises(InvalidArgument):
        store.passwd("alice", "")
    assert [u.name for u in store.list()] == ["alice"]  # nothing half-applied


def test_passwd_delete_and_set_roles(tmp_path: Path) -> None:
    store = UserStore.open(tmp_path)
    store.add("alice", SECRET, [Role.DATA_READER])
    before = store.credential_id("alice")
    store.authenticate("alice", SECRET)
    store.passwd("alice", "new-one")
    assert store.credential_id("alice") != before
    with pytest.raises(AuthenticationFailed):
        store.authenticate("alice", SECRET)  # the remembered check is gone too
    store.authenticate("alice", "new-one")
    assert store.set_roles("alice", [Role.DCP_READER]).roles == {Role.DCP_READER}
    assert store.get("alice") is not None and store.get("alice").roles == {Role.DCP_READER}  # type: ignore[union-attr]
    store.delete("alice")
    assert store.get("alice") is None and store.credential_id("alice") is None
    with pytest.raises(AuthenticationFailed):
        store.authenticate("alice", "new-one")


def test_changes_from_another_process_are_seen(tmp_path: Path) -> None:
    """`dcpgw user add` runs in another process: the server's store sees the change at its next call."""
    store = UserStore.open(tmp_path)
    store.add("alice", SECRET, [Role.ADMIN])
    store.authenticate("alice", SECRET)
    code = textwrap.dedent(f"""
        from pathlib import Path
        from engine.security import UserStore, Role
        s = UserStore.open(Path({str(tmp_path)!r}))
        s.add("bob", "bob-pw", [Role.DATA_READER])
        s.passwd("alice", "changed")
    """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert store.authenticate("bob", "bob-pw").roles == {Role.DATA_READER}
    with pytest.raises(AuthenticationFailed):
        store.authenticate("alice", SECRET)
    assert store.authenticate("alice", "changed").name == "alice"


def test_two_stores_on_one_file_lose_no_user(tmp_path: Path) -> None:
    a, b = UserStore.open(tmp_path), UserStore.open(tmp_path)
    a.add("one", SECRET, [Role.ADMIN])
    b.add("two", SECRET, [Role.ADMIN])  # b re-reads under the lock before writing
    assert [u.name for u in UserStore.open(tmp_path).list()] == ["one", "two"]


def test_ensure_admin_generated_password(tmp_path: Path) -> None:
    store = UserStore.open(tmp_path)
    pw = store.ensure_admin()
    assert pw and len(pw) >= 20
    f = tmp_path / ADMIN_PASSWORD_FILE
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert read_admin_password(tmp_path) == pw
    assert store.authenticate(ADMIN_USER, pw).roles == {Role.ADMIN}
    assert store.ensure_admin() is None  # second start: nothing created, nothing printed
    assert store.ensure_admin("ignored") is None
    store.passwd(ADMIN_USER, "chosen")
    assert not f.exists() and read_admin_password(tmp_path) is None  # a stale password is not kept


def test_ensure_admin_given_password(tmp_path: Path) -> None:
    store = UserStore.open(tmp_path)
    assert store.ensure_admin("from-env") is None
    assert not (tmp_path / ADMIN_PASSWORD_FILE).exists()
    assert store.authenticate(ADMIN_USER, "from-env").roles == {Role.ADMIN}
    with pytest.raises(InvalidArgument):
        UserStore.open(tmp_path / "other").ensure_admin("")


def test_corrupt_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / USERS_FILE).write_text('{"version": 1, "users": {"x": {"roles": ["nope"]}}}')
    with pytest.raises(InvalidArgument, match="unreadable or corrupt"):
        UserStore.open(tmp_path)
    (tmp_path / USERS_FILE).write_text("not json")
    with pytest.raises(InvalidArgument, match="unreadable or corrupt"):
        UserStore.open(tmp_path)


def test_no_secret_in_repr(tmp_path: Path) -> None:
    store = UserStore.open(tmp_path)
    u = store.add("alice", SECRET, [Role.ADMIN])
    for obj in (store, u, store.scram_credential("alice", "SCRAM-SHA256")):
        assert SECRET not in repr(obj)
        assert "stored_key" not in repr(obj)
