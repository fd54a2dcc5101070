"""What plain memcached clients (libmemcached's ``memcslap``, Cyrus SASL) need from the KV port: SCRAM under its
IANA names with an authzid equal to the user, the bucket named as the user selected at authentication, and the
classic GETQ / GETK / GETKQ / SETQ opcodes with their roles -- plus a real ``memcslap --binary`` run when Debian's
libmemcached-tools are installed."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.kv.vbucket import vbucket_of
from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.opcodes import KVStatus
from engine.network.protocol import SET_EXTRAS, request
from engine.security.roles import Role
from tests.engine.network.kv.harness import PASSWORD, KVNode, RawClient


def _scram_with_authzid(c: RawClient, user: str, authzid: str, mechanism: str = "SCRAM-SHA-256") -> int:
    """A SCRAM exchange as Cyrus SASL makes it (IANA mechanism name, ``n,a=<authzid>,`` gs2 header); the status."""
    h = {"SCRAM-SHA-512": "sha512", "SCRAM-SHA-256": "sha256", "SCRAM-SHA-1": "sha1"}[mechanism]
    gs2 = f"n,a={authzid},"
    bare = f"n={user},r={base64.b64encode(os.urandom(12)).decode()}"
    f = c.call(Op.SASL_AUTH, key=mechanism.encode(), value=(gs2 + bare).encode())
    if f.status != KVStatus.AUTH_CONTINUE:
        return f.status
    server_first = f.value.decode()
    a = dict(p.split("=", 1) for p in server_first.split(","))
    salted = hashlib.pbkdf2_hmac(h, PASSWORD.encode(), base64.b64decode(a["s"]), int(a["i"]))
    client_key = hmac.new(salted, b"Client Key", h).digest()
    without_proof = f"c={base64.b64encode(gs2.encode()).decode()},r={a['r']}"
    sig = hmac.new(hashlib.new(h, client_key).digest(), f"{bare},{server_first},{without_proof}".encode(),
                   h).digest()
    proof = base64.b64encode(bytes(x ^ y for x, y in zip(client_key, sig, strict=True))).decode()
    return c.call(Op.SASL_STEP, key=mechanism.encode(), value=f"{without_proof},p={proof}".encode()).status


def test_iana_names_and_an_authzid_equal_to_the_user(connect: Callable[..., RawClient]) -> None:
    for mech in ("SCRAM-SHA-512", "SCRAM-SHA-256", "SCRAM-SHA-1"):
        c = connect()
        c.hello()
        assert _scram_with_authzid(c, "app", "app", mech) == 0, mech
        assert c.call(Op.SELECT_BUCKET, key=b"default").status == 0
    c = connect()
    c.hello()
    assert _scram_with_authzid(c, "app", "admin") == KVStatus.AUTH_ERROR  # acting as another user: refused
    assert _scram_with_authzid(c, "app", "") == KVStatus.AUTH_ERROR  # "a=" with nothing
    f = c.call(Op.SASL_AUTH, key=b"SCRAM-SHA-256", value=b"n,x=app,n=app,r=abc")  # not an authzid attribute
    assert f.status == KVStatus.AUTH_ERROR
    assert c.call(Op.NOOP).status == 0  # the connection stays


def test_a_user_named_as_the_bucket_gets_it_selected(node: KVNode, connect: Callable[..., RawClient]) -> None:
    node.users.add("default", PASSWORD, [Role.DATA_READER, Role.DATA_WRITER])
    c = connect()
    c.hello()
    assert c.scram("default", PASSWORD).status == 0
    f = c.doc(Op.SET, b"k", extras=SET_EXTRAS.pack(0, 0), value=b"v")  # no SELECT_BUCKET
    assert f.status == 0, f
    other = connect()
    other.hello()
    assert other.scram("app", PASSWORD).status == 0
    assert other.doc(Op.GET, b"k").status == KVStatus.NO_BUCKET  # any other user still selects one


def test_quiet_and_key_returning_variants(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    assert c.doc(Op.SET, b"here", extras=SET_EXTRAS.pack(7, 0), value=b"v1").status == 0
    f = c.doc(Op.GETK, b"here")
    assert (f.status, f.key, f.value, f.extras) == (0, b"here", b"v1", b"\0\0\0\x07")
    f = c.doc(Op.GETQ, b"here")
    assert (f.status, f.opcode, f.key, f.value) == (0, Op.GETQ, b"", b"v1")
    assert c.doc(Op.GETK, b"gone").status == KVStatus.KEY_ENOENT
    # the quiet ones answer nothing for a miss (GETQ / GETKQ) or a success (SETQ): a NOOP closes the pipeline
    c.opaque += 1
    quiet: list[tuple[Op, bytes, dict[str, Any]]] = [
        (Op.GETQ, b"gone", {}), (Op.GETKQ, b"gone", {}),
        (Op.SETQ, b"q1", {"extras": SET_EXTRAS.pack(0, 0), "value": b"x"}),
        (Op.GETKQ, b"q1", {})]
    pipeline = b"".join(request(op, key=k, vbucket=vbucket_of(k, c.nvb), opaque=c.opaque, **kw)
                        for op, k, kw in quiet)
    c.send(pipeline + request(Op.NOOP, opaque=c.opaque + 1))
    f = c.recv()
    assert (f.opcode, f.key, f.value) == (Op.GETKQ, b"q1", b"x")
    assert c.recv().opcode == Op.NOOP
    c.opaque += 1
    f = c.doc(Op.SETQ, b"bad", extras=b"\0")  # a failure is answered, with the quiet opcode
    assert (f.status, f.opcode) == (KVStatus.EINVAL, Op.SETQ)
    reader = connect().login("reader")
    assert reader.doc(Op.GETK, b"here").status == 0
    assert reader.doc(Op.SETQ, b"q2", extras=SET_EXTRAS.pack(0, 0), value=b"x").status == KVStatus.EACCESS
    writer = connect().login("writer")
    assert writer.doc(Op.GETKQ, b"here").status == KVStatus.EACCESS


@pytest.mark.skipif(shutil.which("memcslap") is None, reason="memcslap (libmemcached-tools) is not installed")
def test_memcslap_sets_and_gets(tmp_path: Path) -> None:
    node = KVNode(tmp_path / "one", num_vbuckets=1)  # a plain memcached client sends vbucket 0
    try:
        node.users.add("default", PASSWORD, [Role.DATA_READER, Role.DATA_WRITER])
        for test in ("set", "get"):
            out = subprocess.run(["memcslap", f"--servers=127.0.0.1:{node.port}", "--binary", f"--test={test}",
                                  "--concurrency=1", "--execute-number=50", "--username=default",
                                  f"--password={PASSWORD}"], capture_output=True, text=True, timeout=60)
            assert f"Time to {test}" in out.stdout and "Fatal" not in out.stderr, (out.stdout, out.stderr)
            assert f"Time to {test}               0 keys" not in out.stdout
    finally:
        node.close()


def test_a_run_of_quiet_sets_stops_at_what_it_cannot_take(node: KVNode, connect: Callable[..., RawClient]) -> None:
    """The SETQ lane (memcached_ops.SetqLane) takes well-formed quiet SETs straight from the buffer; any other
    frame in the run -- wrong vbucket, a CAS, a datatype not negotiated, bad extras -- is answered by the general
    path, in order, and the frames after it go on."""
    c = connect().login(features=[0x07, 0x08, 0x10, 0x11])  # XERROR, SELECT_BUCKET, ALT_REQUEST, SYNC_REPL: no JSON

    def setq(key: bytes, *, vbucket: int | None = None, opaque: int = 0, **kw: object) -> bytes:
        kw.setdefault("extras", SET_EXTRAS.pack(3, 0))
        kw.setdefault("value", b"v-" + key)
        vb = vbucket_of(key, c.nvb) if vbucket is None else vbucket
        return request(Op.SETQ, key=key, vbucket=vb, opaque=opaque, **kw)  # type: ignore[arg-type]

    frames = [setq(b"a1"), setq(b"a2"),
              setq(b"wrong-vb", vbucket=(vbucket_of(b"wrong-vb", c.nvb) + 1) % c.nvb, opaque=11),
              setq(b"a3"),
              setq(b"with-cas", cas=12345, opaque=12),          # the general path: no such document with that CAS
              setq(b"json", datatype=0x01, opaque=13),           # JSON not negotiated: EINVAL
              setq(b"short", extras=b"\0\0\0\0", opaque=14),     # 4 bytes of extras: EINVAL
              setq(b"a4")]
    c.send(b"".join(frames) + request(Op.NOOP, opaque=99))
    answers = []
    while True:
        f = c.recv()
        answers.append((f.opaque, f.opcode, f.status))
        if f.opcode == Op.NOOP:
            break
    assert answers == [(11, Op.SETQ, KVStatus.NOT_MY_VBUCKET), (12, Op.SETQ, KVStatus.KEY_ENOENT),
                       (13, Op.SETQ, KVStatus.EINVAL), (14, Op.SETQ, KVStatus.EINVAL), (99, Op.NOOP, 0)]
    for k in (b"a1", b"a2", b"a3", b"a4"):
        f = c.doc(Op.GET, k)
        assert (f.status, f.value, f.extras) == (0, b"v-" + k, b"\0\0\0\x03"), k
    for k in (b"wrong-vb", b"with-cas", b"json", b"short"):
        assert c.doc(Op.GET, k).status == KVStatus.KEY_ENOENT, k
    # no write role: every quiet SET is answered EACCESS (nothing taken by the lane), unauthenticated likewise
    r = connect().login("reader")
    r.send(setq(b"r1", opaque=21) + setq(b"r2", opaque=22) + request(Op.NOOP, opaque=23))
    assert [(f.opaque, f.status) for f in (r.recv(), r.recv(), r.recv())] == [
        (21, KVStatus.EACCESS), (22, KVStatus.EACCESS), (23, 0)]
    u = connect()
    u.send(setq(b"u1", opaque=31) + request(Op.NOOP, opaque=32))
    assert [(f.opaque, f.status) for f in (u.recv(), u.recv())] == [(31, KVStatus.EACCESS), (32, 0)]
    assert c.doc(Op.GET, b"r1").status == KVStatus.KEY_ENOENT and c.doc(Op.GET, b"u1").status == KVStatus.KEY_ENOENT
