"""The ingest fast path (``Bucket.set`` -> ``VBucket.upsert``) against the general path (``Bucket.store`` with
``StoreMode.SET`` -> ``VBucket.store``): two buckets with the same seed and clock take the same random history
of sets (new keys, updates, de-duplicated and expelled versions, tombstones, expiries, locks, sync writes in
flight, bad flags / expiries / sizes, a vbucket not active, a full checkpoint quota), deletes, touches, flushes,
DCP streaming, memory recovery and the expiry pager -- one bucket writes every set through ``Bucket.set``, the
other through the general path. Every operation must answer the same (result, or exception and message) and
leave the same state: seqnos, CAS values, hash tables, counters, checkpoints (entries, keys, seqnos, index,
memory, ids), cursors, the dirty set, stats, the DCP messages streamed and the rows persisted."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Bucket, BucketConfig, Item
from engine.dcp.producer import DcpProducer
from engine.kv.durability import Durability, Level, ManualClock
from engine.kv.vbucket import StoreMode, VBucket

KEYS = [b"k%d" % i for i in range(5)]
NVB = 2
VALUES = st.one_of(
    st.sampled_from([b"", b"{}", b' {"a": 1}', b"[1,", b"plain", b"123", b"\t", b"nul", b"x" * 40, b'"s"']),
    st.binary(max_size=8),
)
FLAGS = st.sampled_from([0, 0, 0, 1, 0x02000006, -1, 1 << 32])
EXPIRY = st.sampled_from([0, 0, 0, 0, 3, 100, 1 << 40, -1])
DATATYPE = st.sampled_from([None, None, None, 0, 1])

PLAIN_SET = st.tuples(st.just("set"), st.sampled_from(KEYS), VALUES, st.just(0), st.just(0), st.just(None))
ANY_SET = st.tuples(st.just("set"), st.sampled_from(KEYS), VALUES, FLAGS, EXPIRY, DATATYPE)
EXPIRING_SET = st.tuples(st.just("set"), st.sampled_from(KEYS), VALUES, st.just(0), st.sampled_from([2, 50]),
                         st.just(None))
#: what a plain set meets: new keys, stored values, de-duplicated, expired (in place) and deleted versions
data_op = st.one_of(
    PLAIN_SET, PLAIN_SET, PLAIN_SET, PLAIN_SET, ANY_SET, EXPIRING_SET,
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("touch"), st.sampled_from(KEYS), EXPIRY),
    st.tuples(st.just("flush")),
    st.tuples(st.just("stream")),
    st.tuples(st.just("advance"), st.sampled_from([1, 2, 5, 200])),
    st.tuples(st.just("compact")),
    st.tuples(st.just("restart")),
    st.tuples(st.just("expiry_pager")),
    st.tuples(st.just("recover_memory")),
)
#: and what sends a set to the general path for a while: locks, sync writes in flight, vbucket states
op = st.one_of(
    data_op,
    st.tuples(st.just("lock"), st.sampled_from(KEYS)),
    st.tuples(st.just("unlock"), st.sampled_from(KEYS)),
    st.tuples(st.just("sync_set"), st.sampled_from(KEYS), VALUES),
    st.tuples(st.just("ack"), st.integers(min_value=0, max_value=NVB - 1)),
    st.tuples(st.just("state"), st.integers(min_value=0, max_value=NVB - 1),
              st.sampled_from(["active", "active", "replica", "dead"])),
)


class Side:
    """One bucket and its DCP connection; ``fast`` says through which path its sets go."""

    def __init__(self, data_dir: Path, fast: bool) -> None:
        self.fast = fast
        self.clock = ManualClock()
        self.data_dir = data_dir
        self.bucket = self.open_bucket()
        self.lock_cas: dict[bytes, int] = {}

    def open_bucket(self) -> Bucket:
        b = Bucket(
            BucketConfig(data_dir=self.data_dir, num_vbuckets=NVB, seed=5, checkpoint_max_items=3,
                         checkpoint_max_bytes=1024, max_value_size=32, history_seqnos=2, tombstone_purge_age_s=0,
                         tune_gc=False),
            clock=self.clock, state_cas_rng=random.Random(9))
        # a quota a short history reaches (the configuration's floor is 64 KiB): sets are refused or recover
        b._quota = b.memory_recovery.quota = 6000
        for vb in range(NVB):
            b.set_replication_topology(vb, ["a", "r"])  # a sync write stays in flight until acked
        self.bucket = b
        self.producer = self.open_producer()
        return b

    def open_producer(self) -> DcpProducer:
        p = self.bucket.dcp_producer("p", buffer_size=4096)
        for vb in range(NVB):
            p.stream_request(vb, 0)
        return p

    def apply(self, o: tuple[Any, ...]) -> Any:
        b = self.bucket
        kind = o[0]
        if kind == "set":
            _, key, value, flags, expiry, datatype = o
            if self.fast:
                return b.set(key, value, flags=flags, expiry=expiry, datatype=datatype)
            return b.store(key, value, StoreMode.SET, flags=flags, expiry=expiry, datatype=datatype)
        if kind == "delete":
            return b.delete(o[1])
        if kind == "touch":
            return b.touch(o[1], o[2])
        if kind == "flush":
            return b.flush()
        if kind == "stream":
            msgs = self.producer.step(max_messages=7)
            self.producer.buffer_acknowledge(sum(m.dcp_size for m in msgs))
            return [_entry(m) if type(m) is Item else repr(m) for m in msgs]
        if kind == "advance":
            self.clock.advance(o[1])
            return None
        if kind == "lock":
            g = b.get_locked(o[1], 10)
            self.lock_cas[o[1]] = g.cas
            return g
        if kind == "unlock":
            return b.unlock(o[1], self.lock_cas.get(o[1], 1))
        if kind == "sync_set":
            sw = b.set(o[1], o[2], durability=Durability(Level.MAJORITY))
            return sw.vbucket, sw.prepare_seqno, sw.state
        if kind == "ack":
            vb = b.vbucket(o[1])
            return b.seqno_acknowledged(o[1], "r", vb.high_seqno)
        if kind == "state":
            return b.set_vbucket_state(o[1], o[2])  # each bucket draws its state CAS from an RNG seeded alike
        if kind == "compact":
            return b.compact()
        if kind == "restart":  # a purged tombstone's key is then new, its revision continues (max_deleted_rev)
            b.close()
            self.open_bucket()
            return None
        if kind == "expiry_pager":
            return b.run_expiry_pager()
        if kind == "recover_memory":
            return b.recover_memory()
        raise AssertionError(kind)


def _entry(e: Any) -> Any:
    return e if e is None or type(e) is bytes else ("item", repr(e), e.value, e.flags, e.expiry, e.datatype,
                                                   e.prev_seqno, e.sync)


def vbucket_state(vb: VBucket) -> Any:
    ck = vb.ckpt
    return (
        vb.state, vb.high_seqno, vb.persisted_seqno, vb.max_cas, vb.num_items, sorted(vb.expiring),
        vb.max_deleted_rev, vb.dirty, vb.expirations, vb.purge_seqno,
        {k: _entry(v) for k, v in vb.ht.raw.items()},
        {k: _entry(v) for k, v in vb.prepares.items()}, dict(vb.locks),
        [(c.id, c.start_seqno, c.is_open, c.live, c.mem, c.expelled, list(c.keys), [_entry(e) for e in c.items],
          list(c.seqnos), dict(c.index)) for c in ck.checkpoints],
        {n: (c.ckpt.id, c.pos, c.last_read, c.dropped) for n, c in ck.cursors.items()},
        [(s.queued, s.state) for s in vb.streams], vb.stats(),
    )


def bucket_state(b: Bucket) -> Any:
    return (b.counter.used, sorted(b._dirty), b.stats(), [vbucket_state(vb) for vb in b.vbuckets()])


def outcome(side: Side, o: tuple[Any, ...]) -> Any:
    try:
        return ("ok", side.apply(o))
    except Exception as e:  # the two sides must fail alike
        return ("error", type(e).__name__, str(e))


def check_same(root: Path, ops: list[tuple[Any, ...]]) -> None:
    fast, general = Side(root / "fast", True), Side(root / "general", False)
    try:
        assert bucket_state(fast.bucket) == bucket_state(general.bucket)
        for o in ops:
            assert outcome(fast, o) == outcome(general, o), o
            assert bucket_state(fast.bucket) == bucket_state(general.bucket), o
        fast.bucket.flush_all()
        general.bucket.flush_all()
        for vb in range(NVB):
            assert list(fast.bucket.storage.current(vb)) == list(general.bucket.storage.current(vb))
        assert bucket_state(fast.bucket) == bucket_state(general.bucket)
    finally:
        fast.bucket.close()
        general.bucket.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(data_op, min_size=5, max_size=80))
def test_upsert_fast_path_matches_store(tmp_path_factory, ops) -> None:
    check_same(tmp_path_factory.mktemp("upsert"), ops)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=5, max_size=80))
def test_upsert_matches_store_with_locks_sync_writes_and_states(tmp_path_factory, ops) -> None:
    check_same(tmp_path_factory.mktemp("upsert"), ops)


def test_upsert_matches_store_in_each_case(tmp_path) -> None:
    """Each case of the fast path once, in a fixed history (the random ones above meet them by chance)."""
    k, k2 = KEYS[0], KEYS[1]
    plain = [("set", key, b'{"a": 1}', 0, 0, None) for key in KEYS]  # new keys: appends, a checkpoint rolls over
    check_same(tmp_path, [
        *plain, *plain,                                   # stored values in a closed checkpoint, de-duplicated ones
        ("set", k, b"x", 7, 2, 1), ("flush",), ("stream",), ("recover_memory",),
        ("set", k, b"y", 0, 0, None),                     # a live stored value with an expiry: leaves the index
        ("set", k2, b"z", 0, 2, None), ("flush",), ("stream",), ("recover_memory",), ("advance", 2),
        ("set", k2, b"w", 0, 0, None),                    # expired in place (at its very second): not live
        ("delete", k), ("flush",), ("stream",), ("recover_memory",),
        ("set", k, b"v", 0, 0, None),                     # over a tombstone: the revision continues
        ("delete", k), *plain[1:], ("flush",), ("compact",), ("restart",),
        ("set", k, b"u", 0, 0, None),                     # the tombstone purged: a new key, its revision continues
        ("set", k, b" [1]", 0, 0, None), ("set", k, b"[1", 0, 0, None), ("set", k, b"", 0, 0, None),
        ("set", k, b"x" * 40, 0, 0, None), ("set", k, b"f", -1, 0, None), ("set", k, b"f", 0, -1, None),
    ])


def test_upsert_takes_the_fast_path_for_a_plain_set(tmp_path) -> None:
    """The history above exercises the fast path: a plain set of a new key and an update of a stored value do
    not call ``VBucket.store``; an expiry does."""
    b = Bucket(BucketConfig(data_dir=tmp_path, num_vbuckets=1, tune_gc=False))
    vb = b.vbucket(0)
    calls: list[bytes] = []
    general = vb.store

    def counted(key: bytes, *args: Any) -> Any:
        calls.append(key)
        return general(key, *args)

    vb.store = counted  # type: ignore[method-assign]
    b.set(b"a", b"{}")
    vb.ckpt.create_checkpoint()
    b.set(b"a", b"1")  # the key's version is a stored value: still the fast path
    b.set(b"a", b"2")  # de-duplicated in the open checkpoint: still the fast path
    assert calls == []
    b.set(b"a", b"3", expiry=10)
    assert calls == [b"a"]
    b.close()
