"""The user store: users, their roles, their password hash and SCRAM credentials (docs/security.md "Users").

One JSON file, ``<data dir>/users.json`` (mode 0600, replaced atomically with
:func:`engine.kv.durable_file.write_atomically`), shared by every interface of the process (HTTP API, KV port) and
by ``dcpgw user ...`` run from another process: a change made on disk is seen at the next call (the file's
identity -- inode, size, mtime -- is checked on every call and the file re-read when it changed). Writers take an
exclusive ``flock`` on ``users.json.lock`` and re-read the file before changing it, so two processes adding users
at once lose neither.

Secrets: the password is kept only as a salted scrypt hash (hashlib.scrypt, N=2^14, r=8, p=1, 16-byte random
salt) and as the RFC 5802 SCRAM credentials of SHA-512, SHA-256 and SHA-1 (PBKDF2-HMAC with a 16-byte random
salt and Couchbase Server's default of 15000 iterations; ``StoredKey`` and ``ServerKey`` only, from which the
password cannot be computed back), the way ns_server keeps them for memcached. Comparisons are constant-time
(``hmac.compare_digest``). No secret appears in a ``repr``, a log line or an error message.

Checking a password costs one scrypt (tens of milliseconds, on purpose). So that HTTP Basic auth on every request
stays cheap, a successful check is remembered in memory as an HMAC of ``name:password`` under a key random to the
process, valid only while the user's credential is unchanged (a ``passwd`` or ``delete`` -- here or from another
process -- invalidates it).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.exceptions import AuthenticationFailed, InvalidArgument, UnknownUser, UserExists
from engine.kv.durable_file import write_atomically
from engine.security.roles import Role, parse_role

__all__ = [
    "ADMIN_PASSWORD_FILE", "ADMIN_USER", "SCRAM_ITERATIONS", "SCRAM_MECHANISMS", "USERS_FILE", "ScramCredential",
    "User", "UserStore", "read_admin_password", "scram_credential",
]

#: the first user, created by :meth:`UserStore.ensure_admin` (Couchbase Server's conventional admin name)
ADMIN_USER = "Administrator"
#: the user store under the data directory
USERS_FILE = "users.json"
#: the generated first password of :data:`ADMIN_USER` (mode 0600), read by the CLI when no credentials are given
ADMIN_PASSWORD_FILE = "admin-password"
#: SASL mechanisms with stored credentials, strongest first (the order memcached lists them in)
SCRAM_MECHANISMS = ("SCRAM-SHA512", "SCRAM-SHA256", "SCRAM-SHA1")
#: PBKDF2 iterations of the SCRAM credentials (Couchbase Server's default)
SCRAM_ITERATIONS = 15000
_HASHES = {"SCRAM-SHA512": "sha512", "SCRAM-SHA256": "sha256", "SCRAM-SHA1": "sha1"}
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1}
_SALT_BYTES = 16
_FORMAT_VERSION = 1
#: characters Couchbase Server refuses in a user name (plus whitespace and control characters here)
_BAD_NAME_CHARS = set('()<>@,;:\\"/[]?={}')
_MAX_NAME = 128
_MAX_PASSWORD = 1024
_CACHE_LIMIT = 4096


@dataclass(frozen=True)
class User:
    """A user as the rest of the product sees it: name and roles, no secret."""

    name: str
    roles: frozenset[Role]


@dataclass(frozen=True, repr=False)
class ScramCredential:
    """RFC 5802 server-side credential of one mechanism: SaltedPassword = PBKDF2-HMAC-<hash>(password, salt,
    iterations); ClientKey = HMAC(SaltedPassword, "Client Key"); StoredKey = H(ClientKey); ServerKey =
    HMAC(SaltedPassword, "Server Key")."""

    mechanism: str
    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    def __repr__(self) -> str:
        return f"ScramCredential(mechanism={self.mechanism!r}, iterations={self.iterations})"

    @property
    def hash_name(self) -> str:
        """The hashlib name of the mechanism's hash (``sha512`` ...)."""
        return _HASHES[self.mechanism]


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode("ascii"), validate=True)


def scram_credential(mechanism: str, password: str, salt: bytes, iterations: int) -> ScramCredential:
    """The credential of ``mechanism`` for ``password`` (what a SCRAM client derives from the same inputs)."""
    h = _HASHES[mechanism]
    salted = hashlib.pbkdf2_hmac(h, password.encode("utf-8"), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", h).digest()
    return ScramCredential(mechanism=mechanism, salt=salt, iterations=iterations,
                           stored_key=hashlib.new(h, client_key).digest(),
                           server_key=hmac.new(salted, b"Server Key", h).digest())


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=n, r=r, p=p, dklen=32, maxmem=64 * 1024 * 1024)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgument("user name must be a non-empty string")
    if len(name) > _MAX_NAME:
        raise InvalidArgument(f"user name longer than {_MAX_NAME} characters")
    if name.startswith("@") or any(c in _BAD_NAME_CHARS or c.isspace() or not c.isprintable() for c in name):
        raise InvalidArgument(f"user name {name!r} has a character not allowed in a user name "
                              f"(whitespace, control characters or any of {''.join(sorted(_BAD_NAME_CHARS))})")
    return name


def _check_password(password: str) -> str:
    if not isinstance(password, str) or not password:
        raise InvalidArgument("password must be a non-empty string")
    if len(password) > _MAX_PASSWORD or "\x00" in password:
        raise InvalidArgument(f"password must be at most {_MAX_PASSWORD} characters without NUL")
    return password


def _check_roles(roles: Iterable[Role | str]) -> frozenset[Role]:
    if isinstance(roles, str):
        roles = [roles]
    out = frozenset(parse_role(str(r)) for r in roles)
    if not out:
        raise InvalidArgument("a user needs at least one role")
    return out


def _secret_record(password: str) -> dict[str, Any]:
    salt = secrets.token_bytes(_SALT_BYTES)
    scram = {}
    for mech in SCRAM_MECHANISMS:
        c = scram_credential(mech, password, secrets.token_bytes(_SALT_BYTES), SCRAM_ITERATIONS)
        scram[mech] = {"salt": _b64(c.salt), "iterations": c.iterations, "stored_key": _b64(c.stored_key),
                       "server_key": _b64(c.server_key)}
    return {"password": {"algorithm": "scrypt", **_SCRYPT, "salt": _b64(salt),
                         "hash": _b64(_scrypt(password, salt, **_SCRYPT))},
            "scram": scram}


class UserStore:
    """The users of one data directory (module doc). Thread-safe; every method may block (scrypt, fsync):
    call it from a worker thread in an event loop."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / USERS_FILE
        self._lock_path = self.data_dir / (USERS_FILE + ".lock")
        self._lock = threading.RLock()
        self._users: dict[str, dict[str, Any]] = {}
        self._signature: tuple[int, int, int] | None = None
        self._cache_key = secrets.token_bytes(32)
        self._verified: dict[bytes, str] = {}
        # a fixed record checked when the user does not exist, so both failures cost one scrypt
        salt = secrets.token_bytes(_SALT_BYTES)
        self._dummy: dict[str, Any] = {**_SCRYPT, "salt": _b64(salt), "hash": _b64(_scrypt(secrets.token_urlsafe(12), salt, **_SCRYPT))}

    def __repr__(self) -> str:
        return f"UserStore({str(self.path)!r})"

    @classmethod
    def open(cls, data_dir: Path) -> UserStore:
        """The store of ``data_dir`` (created if needed; the file appears at the first write)."""
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        store = cls(Path(data_dir))
        store._reload()
        return store

    # ---- reading -----------------------------------------------------------------------------------------
    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _reload(self, force: bool = False) -> None:
        with self._lock:
            sig = self._stat()
            if not force and sig == self._signature:
                return
            if sig is None:
                self._users, self._signature = {}, None
                return
            try:
                raw = json.loads(self.path.read_bytes())
                users = raw["users"]
                if raw.get("version") != _FORMAT_VERSION or not isinstance(users, dict):
                    raise ValueError("unknown format")
                for rec in users.values():
                    _check_roles(rec["roles"])
                    rec["password"]["hash"]
            except (OSError, ValueError, KeyError, TypeError, InvalidArgument) as e:
                raise InvalidArgument(f"user store {self.path} is unreadable or corrupt "
                                      f"({type(e).__name__}); fix or remove it") from None
            self._users, self._signature = users, sig

    def list(self) -> list[User]:
        """Every user, sorted by name."""
        with self._lock:
            self._reload()
            return [self._user(n) for n in sorted(self._users)]

    def get(self, name: str) -> User | None:
        """The user ``name``, or None."""
        with self._lock:
            self._reload()
            return self._user(name) if name in self._users else None

    def _user(self, name: str) -> User:
        return User(name=name, roles=frozenset(Role(r) for r in self._users[name]["roles"]))

    def credential_id(self, name: str) -> str | None:
        """An opaque id of the user's current password (changes with ``passwd``), None for an unknown user: what
        a bearer token is bound to, so changing the password or deleting the user revokes its tokens."""
        with self._lock:
            self._reload()
            rec = self._users.get(name)
            if rec is None:
                return None
            return hashlib.sha256(_unb64(rec["password"]["salt"])).hexdigest()[:32]

    def scram_credential(self, name: str, mechanism: str) -> ScramCredential | None:
        """The stored SCRAM credential of ``name`` for ``mechanism`` (one of :data:`SCRAM_MECHANISMS`), None for
        an unknown user or mechanism."""
        with self._lock:
            self._reload()
            rec = self._users.get(name)
            if rec is None or mechanism not in _HASHES:
                return None
            c = rec.get("scram", {}).get(mechanism)
            if c is None:
                return None
            return ScramCredential(mechanism=mechanism, salt=_unb64(c["salt"]), iterations=int(c["iterations"]),
                                   stored_key=_unb64(c["stored_key"]), server_key=_unb64(c["server_key"]))

    def _check_key(self, name: str, password: str) -> bytes:
        return hmac.new(self._cache_key, name.encode("utf-8", "surrogatepass") + b"\x00"
                        + password.encode("utf-8", "surrogatepass"), "sha256").digest()

    def remembered(self, name: str, password: str) -> User | None:
        """The user when this exact ``name``/``password`` was checked successfully before and the user's password
        has not changed since (no scrypt: cheap enough for an event loop); None when it needs
        :meth:`authenticate`."""
        if not isinstance(name, str) or not isinstance(password, str):
            return None
        key = self._check_key(name, password)
        with self._lock:
            self._reload()
            cred = self.credential_id(name)
            if cred is not None and hmac.compare_digest(self._verified.get(key, ""), cred):
                return self._user(name)
            return None

    def authenticate(self, name: str, password: str) -> User:
        """The user, when ``password`` is its password; :class:`AuthenticationFailed` otherwise (the same error,
        and the same cost, for an unknown user and a wrong password)."""
        if not isinstance(name, str) or not isinstance(password, str):
            raise AuthenticationFailed("authentication failed")
        key = self._check_key(name, password)
        with self._lock:
            self._reload()
            rec = self._users.get(name)
            cred = self.credential_id(name)
            if rec is not None and cred is not None and hmac.compare_digest(self._verified.get(key, ""), cred):
                return self._user(name)
            pw = rec["password"] if rec is not None else self._dummy
        try:
            got = _scrypt(password, _unb64(pw["salt"]), int(pw["n"]), int(pw["r"]), int(pw["p"]))
        except (ValueError, UnicodeEncodeError):
            raise AuthenticationFailed("authentication failed") from None
        if not hmac.compare_digest(got, _unb64(pw["hash"])) or rec is None:
            raise AuthenticationFailed("authentication failed")
        with self._lock:
            if len(self._verified) >= _CACHE_LIMIT:
                self._verified.clear()
            if cred is not None:
                self._verified[key] = cred
            return self._user(name)

    # ---- writing -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _writing(self) -> Iterator[dict[str, dict[str, Any]]]:
        """Exclusive access across processes: flock, re-read, let the caller change the dict, write it back."""
        with self._lock:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._reload(force=True)
                users = json.loads(json.dumps(self._users))  # a copy: a failed change leaves the store as it was
                yield users
                data = json.dumps({"version": _FORMAT_VERSION, "users": users}, indent=1, sort_keys=True)
                write_atomically(self.path, data.encode("utf-8"), mode=0o600)
                self._users, self._signature = users, self._stat()
            finally:
                os.close(fd)  # releases the flock

    def add(self, name: str, password: str, roles: Iterable[Role]) -> User:
        """Create user ``name``; :class:`UserExists` if it exists, :class:`InvalidArgument` for a bad name,
        empty password or unknown / no role."""
        _check_name(name)
        _check_password(password)
        role_set = _check_roles(roles)
        record = {"roles": sorted(r.value for r in role_set), **_secret_record(password)}
        with self._writing() as users:
            if name in users:
                raise UserExists(f"user {name!r} already exists")
            users[name] = record
        return User(name=name, roles=role_set)

    def delete(self, name: str) -> None:
        """Remove user ``name`` (:class:`UnknownUser` if absent); its tokens and cached checks stop working."""
        with self._writing() as users:
            if name not in users:
                raise UnknownUser(f"no user {name!r}")
            del users[name]
        if name == ADMIN_USER:
            self._forget_admin_password()

    def passwd(self, name: str, password: str) -> None:
        """Set the password of ``name`` (:class:`UnknownUser` if absent); its tokens stop working."""
        _check_password(password)
        secret = _secret_record(password)
        with self._writing() as users:
            if name not in users:
                raise UnknownUser(f"no user {name!r}")
            users[name].update(secret)
        if name == ADMIN_USER:
            self._forget_admin_password()

    def set_roles(self, name: str, roles: Iterable[Role]) -> User:
        """Replace the roles of ``name`` (:class:`UnknownUser` if absent)."""
        role_set = _check_roles(roles)
        with self._writing() as users:
            if name not in users:
                raise UnknownUser(f"no user {name!r}")
            users[name]["roles"] = sorted(r.value for r in role_set)
        return User(name=name, roles=role_set)

    def ensure_admin(self, password: str | None = None) -> str | None:
        """First start: when the store has no user, create :data:`ADMIN_USER` (role admin) with ``password``
        (``DCPGW_ADMIN_PASSWORD``) or a generated one, which is also written (mode 0600) to
        ``<data dir>/admin-password`` and returned so the caller prints it once. Returns None otherwise (the store
        already has users -- the password given is then ignored, as Couchbase ignores it after initialisation)."""
        if password is not None:
            _check_password(password)
        if self.list():
            return None
        generated = None
        if password is None:
            generated = password = secrets.token_urlsafe(18)
        record = {"roles": [Role.ADMIN.value], **_secret_record(password)}  # slow: outside the lock
        with self._writing() as users:
            if users:  # another process added a user meanwhile
                return None
            users[ADMIN_USER] = record
        if generated is not None:
            write_atomically(self.data_dir / ADMIN_PASSWORD_FILE, (generated + "\n").encode("utf-8"), mode=0o600)
        return generated

    def _forget_admin_password(self) -> None:
        """The generated first password no longer works once changed: drop the file the CLI would read."""
        with contextlib.suppress(FileNotFoundError):
            (self.data_dir / ADMIN_PASSWORD_FILE).unlink()


def read_admin_password(data_dir: Path) -> str | None:
    """The generated first password of :data:`ADMIN_USER` stored in ``data_dir``, or None."""
    try:
        return (Path(data_dir) / ADMIN_PASSWORD_FILE).read_text(encoding="utf-8").strip() or None
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
