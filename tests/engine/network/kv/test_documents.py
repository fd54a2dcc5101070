"""Document opcodes of the KV port over raw sockets (docs/kv-protocol.md "Opcodes"): answers, CAS, mutation
tokens, locks, counters, durability frames and the statuses 0xa0-0xa4."""

from __future__ import annotations

import struct
from collections.abc import Callable

import orjson

from engine.exceptions import Status
from engine.kv.durability import Durability, Level, monitor
from engine.kv.locks import LOCKED_CAS
from engine.kv.vbucket import vbucket_of
from engine.network.kv.features import Feature
from engine.network.kv.opcodes import ClientOpcode as Op
from engine.network.kv.opcodes import KVStatus
from engine.network.protocol import ALT_REQ_MAGIC, TOKEN_EXTRAS, Frame, encode, encode_durability_frame
from tests.engine.network.kv.harness import KVNode, RawClient

SET0 = struct.pack(">II", 0, 0)


def _set(c: RawClient, key: bytes, value: bytes, *, flags: int = 0, expiry: int = 0, cas: int = 0,
         opcode: int = Op.SET) -> Frame:
    return c.doc(opcode, key, extras=struct.pack(">II", flags, expiry), value=value, cas=cas)


def _durable(c: RawClient, opcode: int, key: bytes, level: int, *, value: bytes = b"", extras: bytes = b"",
             timeout_ms: int = 0, cas: int = 0) -> bytes:
    frame = bytes([0x10 | (3 if timeout_ms else 1), level]) + (timeout_ms.to_bytes(2, "big") if timeout_ms else b"")
    c.opaque += 1
    return encode(ALT_REQ_MAGIC, opcode, key, extras, value, 0, vbucket_of(key, c.nvb), c.opaque, cas, frame)


def test_set_get_with_flags_cas_and_mutation_token(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    f = _set(c, b"k1", b'{"a":1}', flags=0x02000006)
    assert f.status == 0 and len(f.extras) == 16
    vbuuid, seqno = TOKEN_EXTRAS.unpack(f.extras)
    vb = vbucket_of(b"k1", 16)
    assert vbuuid == node.call(lambda: node.bucket.vbucket(vb).failover.latest.vbuuid) and seqno == 1
    g = c.doc(Op.GET, b"k1")
    assert g.status == 0 and g.value == b'{"a":1}' and g.cas == f.cas and g.datatype == 0x01
    assert struct.unpack(">I", g.extras)[0] == 0x02000006
    # without MUTATION_SEQNO no token; without JSON no datatype
    d = connect().login(features=[Feature.XERROR, Feature.SELECT_BUCKET])
    f2 = _set(d, b"k1", b'{"a":2}')
    assert f2.status == 0 and f2.extras == b""
    assert d.doc(Op.GET, b"k1").datatype == 0


def test_add_replace_cas_delete(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    assert _set(c, b"k", b"v1", opcode=Op.ADD).status == 0
    assert _set(c, b"k", b"v1", opcode=Op.ADD).status == KVStatus.KEY_EEXISTS
    assert _set(c, b"nope", b"v", opcode=Op.REPLACE).status == KVStatus.NOT_STORED
    cas = c.doc(Op.GET, b"k").cas
    assert _set(c, b"k", b"v2", opcode=Op.REPLACE, cas=cas + 1).status == KVStatus.KEY_EEXISTS
    r = _set(c, b"k", b"v2", opcode=Op.REPLACE, cas=cas)
    assert r.status == 0 and r.cas != cas
    assert c.doc(Op.DELETE, b"k", cas=cas).status == KVStatus.KEY_EEXISTS
    d = c.doc(Op.DELETE, b"k", cas=r.cas)
    assert d.status == 0 and len(d.extras) == 16
    assert c.doc(Op.GET, b"k").status == KVStatus.KEY_ENOENT
    assert c.doc(Op.DELETE, b"k").status == KVStatus.KEY_ENOENT
    assert _set(c, b"k", b"x", opcode=Op.ADD, cas=5).status == KVStatus.EINVAL


def test_append_prepend(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    assert c.doc(Op.APPEND, b"s", value=b"x").status == KVStatus.NOT_STORED
    _set(c, b"s", b"mid", flags=7)
    assert c.doc(Op.APPEND, b"s", value=b"-end").status == 0
    assert c.doc(Op.PREPEND, b"s", value=b"start-").status == 0
    g = c.doc(Op.GET, b"s")
    assert g.value == b"start-mid-end" and struct.unpack(">I", g.extras)[0] == 7
    assert c.doc(Op.APPEND, b"s", value=b"z", cas=g.cas + 1).status == KVStatus.KEY_EEXISTS


def test_counters(connect: Callable[..., RawClient]) -> None:
    c = connect().login()

    def arith(op: int, key: bytes, delta: int, initial: int = 0, expiry: int = 0) -> Frame:
        return c.doc(op, key, extras=struct.pack(">QQI", delta, initial, expiry))

    assert arith(Op.INCREMENT, b"n", 1, 0, 0xFFFFFFFF).status == KVStatus.KEY_ENOENT
    f = arith(Op.INCREMENT, b"n", 5, 10)
    assert f.status == 0 and struct.unpack(">Q", f.value)[0] == 10 and len(f.extras) == 16
    assert struct.unpack(">Q", arith(Op.INCREMENT, b"n", 5).value)[0] == 15
    assert struct.unpack(">Q", arith(Op.DECREMENT, b"n", 100).value)[0] == 0  # stops at zero
    _set(c, b"n", str(2**64 - 1).encode())
    assert struct.unpack(">Q", arith(Op.INCREMENT, b"n", 2).value)[0] == 1  # wraps
    _set(c, b"t", b"text")
    assert arith(Op.INCREMENT, b"t", 1).status == KVStatus.DELTA_BADVAL
    assert c.doc(Op.GET, b"n").value == b"1"
    # a counter created with an expiry has it; an existing counter keeps its own
    assert arith(Op.INCREMENT, b"e", 1, 7, 3600).status == 0
    meta = c.doc(Op.GET_META, b"e")
    expiry = struct.unpack(">IIIQ", meta.extras)[2]
    assert expiry > 3600
    assert arith(Op.INCREMENT, b"e", 1, 0, 60).status == 0
    assert struct.unpack(">IIIQ", c.doc(Op.GET_META, b"e").extras)[2] == expiry
    assert c.doc(Op.GET, b"e").value == b"8"
    assert c.doc(Op.INCREMENT, b"n", extras=b"\0" * 8).status == KVStatus.EINVAL


def test_touch_gat_and_expiry_extras(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    assert c.doc(Op.TOUCH, b"k", extras=struct.pack(">I", 100)).status == KVStatus.KEY_ENOENT
    w = _set(c, b"k", b"v")
    t = c.doc(Op.TOUCH, b"k", extras=struct.pack(">I", 100))
    assert t.status == 0 and t.cas != w.cas
    g = c.doc(Op.GAT, b"k", extras=struct.pack(">I", 200))
    assert g.status == 0 and g.value == b"v" and g.cas != t.cas
    assert c.doc(Op.TOUCH, b"k").status == KVStatus.EINVAL  # no expiry extras


def test_locks(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    _set(c, b"k", b"v")
    assert c.doc(Op.GET_LOCKED, b"missing").status == KVStatus.KEY_ENOENT
    lk = c.doc(Op.GET_LOCKED, b"k", extras=struct.pack(">I", 10))
    assert lk.status == 0 and lk.value == b"v"
    assert c.doc(Op.GET, b"k").cas == LOCKED_CAS  # readers do not see the lock CAS
    assert c.doc(Op.GET_LOCKED, b"k").status == KVStatus.LOCKED
    assert _set(c, b"k", b"w").status == KVStatus.LOCKED
    assert c.doc(Op.DELETE, b"k").status == KVStatus.LOCKED
    assert c.doc(Op.TOUCH, b"k", extras=struct.pack(">I", 5)).status == KVStatus.LOCKED
    assert c.doc(Op.APPEND, b"k", value=b"x").status == KVStatus.LOCKED
    assert c.doc(Op.UNLOCK_KEY, b"k", cas=lk.cas + 1).status == KVStatus.LOCKED
    # a write with the lock's CAS succeeds and unlocks
    w = _set(c, b"k", b"w", cas=lk.cas)
    assert w.status == 0
    assert c.doc(Op.GET, b"k").cas == w.cas
    assert c.doc(Op.UNLOCK_KEY, b"k", cas=w.cas).status == KVStatus.NOT_LOCKED
    lk2 = c.doc(Op.GET_LOCKED, b"k")
    assert c.doc(Op.UNLOCK_KEY, b"k", cas=lk2.cas).status == 0
    assert _set(c, b"k", b"after").status == 0
    # the lock is memory only: no mutation was queued by locking / unlocking
    vb = vbucket_of(b"k", 16)
    assert node.call(lambda: node.bucket.vbucket(vb).high_seqno) == 3


def test_lock_expires_by_the_bucket_clock(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    _set(c, b"k", b"v")
    lk = c.doc(Op.GET_LOCKED, b"k", extras=struct.pack(">I", 1))
    assert lk.status == 0
    vb = vbucket_of(b"k", 16)
    # the lock's deadline moved into the past (as if its time passed)
    node.call(lambda: node.bucket.vbucket(vb).locks.update({b"k": (lk.cas, 0.0)}))
    assert _set(c, b"k", b"w").status == 0


def test_get_replica_on_a_single_node_is_not_my_vbucket_with_the_map(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    _set(c, b"k", b"v")
    f = c.doc(Op.GET_REPLICA, b"k")
    assert f.status == KVStatus.NOT_MY_VBUCKET
    assert orjson.loads(f.value)["vBucketServerMap"]["numReplicas"] == 0
    # a key sent to a vbucket it does not hash to: NOT_MY_VBUCKET with the config
    f = c.call(Op.GET, key=b"k", vbucket=(vbucket_of(b"k", 16) + 1) % 16)
    assert f.status == KVStatus.NOT_MY_VBUCKET and b"vBucketServerMap" in f.value
    assert c.call(Op.GET, key=b"k", vbucket=999).status == KVStatus.NOT_MY_VBUCKET


def test_observe_seqno(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    w = _set(c, b"k", b"v")
    vbuuid, seqno = TOKEN_EXTRAS.unpack(w.extras)
    vb = vbucket_of(b"k", 16)
    f = c.call(Op.OBSERVE_SEQNO, vbucket=vb, value=struct.pack(">Q", vbuuid))
    fmt, vbid, uuid, persisted, current = struct.unpack(">BHQQQ", f.value)
    assert (fmt, vbid, uuid, current) == (0, vb, vbuuid, seqno) and persisted == 0
    node.call(node.bucket.flush_all)
    f = c.call(Op.OBSERVE_SEQNO, vbucket=vb, value=struct.pack(">Q", vbuuid))
    assert struct.unpack(">BHQQQ", f.value)[3] == seqno
    f = c.call(Op.OBSERVE_SEQNO, vbucket=vb, value=struct.pack(">Q", 12345))
    assert f.value[0] == 1 and len(f.value) == 43
    assert c.call(Op.OBSERVE_SEQNO, vbucket=vb, value=b"\0").status == KVStatus.EINVAL


def test_durable_writes_at_each_level_commit_on_one_node(node: KVNode, connect: Callable[..., RawClient]) -> None:
    # one node, no replicas: majority is 1, so every level is possible (kv_engine); persist levels commit once
    # the write is on disk
    c = connect().login()
    for level in (Level.MAJORITY, Level.MAJORITY_AND_PERSIST_TO_ACTIVE, Level.PERSIST_TO_MAJORITY):
        key = f"d{int(level)}".encode()
        c.send(_durable(c, Op.SET, key, level, value=b"v", extras=SET0))
        f = c.recv()
        assert f.status == 0, f
        vb = vbucket_of(key, 16)
        assert TOKEN_EXTRAS.unpack(f.extras)[1] == 2  # prepare 1, commit 2
        if level != Level.MAJORITY:
            def persisted(vb: int = vb) -> int:
                return node.bucket.vbucket(vb).persisted_seqno

            assert node.call(persisted) >= 1
        assert c.doc(Op.GET, key).value == b"v"
        for op, extras in ((Op.APPEND, b""), (Op.INCREMENT, None)):
            if extras is None:
                c.send(_durable(c, op, b"n" + key, level, extras=struct.pack(">QQI", 1, 5, 0)))
            else:
                c.send(_durable(c, op, key, level, value=b"+", extras=extras))
            assert c.recv().status == 0
        c.send(_durable(c, Op.DELETE, key, level))
        assert c.recv().status == 0
        assert c.doc(Op.GET, key).status == KVStatus.KEY_ENOENT


def test_durability_statuses(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    # 0xa0: a level that does not exist
    c.send(_durable(c, Op.SET, b"k", 7, value=b"v", extras=SET0))
    assert c.recv().status == KVStatus.DURABILITY_INVALID_LEVEL
    # EINVAL: a frame on an opcode that takes none, or without ALT_REQUEST_SUPPORT
    c.send(_durable(c, Op.GET, b"k", 1))
    assert c.recv().status == KVStatus.EINVAL
    d = connect().login(features=[Feature.XERROR, Feature.SELECT_BUCKET])
    d.send(_durable(d, Op.SET, b"k", 1, value=b"v", extras=SET0))
    assert d.recv().status == KVStatus.EINVAL
    # 0xa1: the vbucket's chain has a replica slot with no node (a majority of 2 is impossible)
    vb = vbucket_of(b"k", 16)
    node.call(lambda: node.bucket.set_replication_topology(vb, ["self", None]))
    c.send(_durable(c, Op.SET, b"k", 1, value=b"v", extras=SET0))
    assert c.recv().status == KVStatus.DURABILITY_IMPOSSIBLE
    # 0xa2 / 0xa3: with a replica that never acknowledges, a sync write stays pending; a write to its key is
    # SYNC_WRITE_IN_PROGRESS; at its timeout it is aborted and answered SYNC_WRITE_AMBIGUOUS
    node.call(lambda: node.bucket.set_replication_topology(vb, ["self", "replica"]))
    c.send(_durable(c, Op.SET, b"k", 1, value=b"v", extras=SET0, timeout_ms=300))
    e = connect().login()
    while not node.call(lambda: bool(node.bucket.vbucket(vb).prepares)):
        pass
    assert _set(e, b"k", b"other").status == KVStatus.SYNC_WRITE_IN_PROGRESS
    assert e.doc(Op.GET, b"k").status == KVStatus.KEY_ENOENT  # the prepare is invisible to readers
    f = c.recv()
    assert f.status == KVStatus.SYNC_WRITE_AMBIGUOUS
    assert e.doc(Op.GET, b"k").status == KVStatus.KEY_ENOENT  # aborted


def test_read_of_a_prepare_being_recommitted(node: KVNode, connect: Callable[..., RawClient]) -> None:
    # a prepare the vbucket holds without a waiter (as after warmup or a failover) blocks reads of its key with
    # SYNC_WRITE_RE_COMMIT_IN_PROGRESS until it is committed
    c = connect().login()
    _set(c, b"k", b"old")
    vb = vbucket_of(b"k", 16)

    def orphan_prepare() -> None:
        b = node.bucket
        b.set_replication_topology(vb, ["self", "replica"])
        sw = b.set(b"k", b"new", durability=Durability(Level.MAJORITY))
        monitor(b.vbucket(vb)).waiters.pop(sw.prepare_seqno)

    node.call(orphan_prepare)
    assert c.doc(Op.GET, b"k").status == KVStatus.SYNC_WRITE_RE_COMMIT_IN_PROGRESS
    d = connect().login(features=[Feature.SELECT_BUCKET])
    assert d.doc(Op.GET, b"k").status == KVStatus.TMPFAIL  # without XERROR
    node.call(lambda: node.bucket.set_replication_topology(vb, ["self"]))  # now durable: committed
    assert c.doc(Op.GET, b"k").value == b"new"


def test_error_bodies_with_xerror(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    f = c.doc(Op.GET, b"missing")
    assert f.status == Status.KEY_ENOENT and f.datatype == 0x01
    assert "not found" in orjson.loads(f.value)["error"]["context"]
    assert encode_durability_frame(Durability(Level.MAJORITY)) == b"\x11\x01"


def test_get_meta_of_a_document_and_a_tombstone(connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    assert c.doc(Op.GET_META, b"k").status == KVStatus.KEY_ENOENT
    w = _set(c, b"k", b'{"a":1}', flags=9)
    f = c.doc(Op.GET_META, b"k", extras=b"\x02")
    assert f.status == 0 and f.cas == w.cas
    assert struct.unpack(">IIIQB", f.extras) == (0, 9, 0, 1, 0x01)
    c.doc(Op.DELETE, b"k")
    f = c.doc(Op.GET_META, b"k")
    assert f.status == 0 and struct.unpack(">IIIQ", f.extras)[0] == 1


def test_lock_times_follow_kv_engine() -> None:
    from engine.kv.locks import DEFAULT_LOCK_S, MAX_LOCK_S, lock_time

    assert (DEFAULT_LOCK_S, MAX_LOCK_S) == (15, 30)
    assert lock_time(0) == 15 and lock_time(1) == 1 and lock_time(30) == 30 and lock_time(31) == 15


def test_get_locked_without_a_time_locks_for_the_default(node: KVNode, connect: Callable[..., RawClient]) -> None:
    c = connect().login()
    _set(c, b"k", b"v")
    lk = c.doc(Op.GET_LOCKED, b"k")
    vb = vbucket_of(b"k", 16)
    lock_cas, deadline = node.call(lambda: node.bucket.vbucket(vb).locks[b"k"])
    now = node.call(node.bucket.clock)
    assert lock_cas == lk.cas and 14 <= deadline - now <= 15
    c.doc(Op.UNLOCK_KEY, b"k", cas=lk.cas)
    c.doc(Op.GET_LOCKED, b"k", extras=struct.pack(">I", 3600))  # above the maximum: the default
    _cas, deadline = node.call(lambda: node.bucket.vbucket(vb).locks[b"k"])
    assert 14 <= deadline - node.call(node.bucket.clock) <= 15
