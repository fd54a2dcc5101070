"""XDCR target conflict resolution (engine/kv/conflict_resolution.py, engine/kv/with_meta.py; docs/xdcr.md
"Target side"): the rules against a straightforward model (both modes, every option), random histories of
writes with meta and local writes on a bucket against a model of the documents' metadata, and the engine
behaviours (tombstones, the HLC, counters, the mode fixed at creation)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Bucket, BucketConfig
from engine.exceptions import InvalidArgument, KeyExists, KeyNotFound
from engine.kv.conflict_resolution import (
    FORCE_ACCEPT_WITH_META_OPS,
    FORCE_WITH_META_OP,
    IS_EXPIRATION,
    REGENERATE_CAS,
    SKIP_CONFLICT_RESOLUTION_FLAG,
    ConflictRejected,
    ConflictResolutionMismatch,
    ConflictResolutionMode,
    ItemMeta,
    Resolution,
    parse_options,
    resolve,
)
from engine.kv.durability import ManualClock
from engine.kv.item import Datatype, Item, Op

XATTR = Datatype.XATTR
MODES = list(ConflictResolutionMode)


def model_wins(mode: ConflictResolutionMode, local: ItemMeta, inc: ItemMeta, is_delete: bool) -> bool:
    """The rules as docs/xdcr.md states them: a lexicographic comparison, larger incoming wins."""
    if mode is ConflictResolutionMode.SEQNO:
        lk, ik = (local.rev_seqno, local.cas), (inc.rev_seqno, inc.cas)
    else:
        lk, ik = (local.cas, local.rev_seqno), (inc.cas, inc.rev_seqno)
    if lk != ik:
        return ik > lk
    if is_delete:
        return False  # an incoming deletion loses a full tie on rev seqno and CAS
    return ((inc.expiry, inc.flags, bool(inc.datatype & XATTR))
            > (local.expiry, local.flags, bool(local.datatype & XATTR)))


small = st.integers(min_value=0, max_value=3)
metas = st.builds(ItemMeta, cas=small, rev_seqno=small, flags=small, expiry=small,
                  datatype=st.sampled_from([0, 1, XATTR, XATTR | 1]), deleted=st.booleans())


@settings(max_examples=2000, deadline=None)
@given(st.sampled_from(MODES), st.none() | metas, metas, st.booleans())
def test_resolve_matches_the_model(mode: ConflictResolutionMode, local: ItemMeta | None, inc: ItemMeta,
                                   is_delete: bool) -> None:
    r = resolve(mode, local, inc, is_delete=is_delete)
    if local is None:
        assert r is Resolution.ACCEPT
        return
    assert (r is Resolution.ACCEPT) == model_wins(mode, local, inc, is_delete)
    if r is not Resolution.ACCEPT:
        echo = (local.rev_seqno, local.cas, local.deleted) == (inc.rev_seqno, inc.cas, is_delete) and (
            is_delete or (local.expiry, local.flags) == (inc.expiry, inc.flags))
        assert (r is Resolution.IDENTICAL) == echo


def test_resolve_examples() -> None:
    seqno, lww = ConflictResolutionMode.SEQNO, ConflictResolutionMode.LWW
    a = ItemMeta(cas=100, rev_seqno=5)
    assert resolve(seqno, a, ItemMeta(cas=1, rev_seqno=6), is_delete=False) is Resolution.ACCEPT
    assert resolve(lww, a, ItemMeta(cas=1, rev_seqno=6), is_delete=False) is Resolution.BEHIND
    assert resolve(lww, a, ItemMeta(cas=101, rev_seqno=1), is_delete=False) is Resolution.ACCEPT
    assert resolve(seqno, a, ItemMeta(cas=100, rev_seqno=5, expiry=9), is_delete=False) is Resolution.ACCEPT
    assert resolve(seqno, a, ItemMeta(cas=100, rev_seqno=5, expiry=9), is_delete=True) is Resolution.BEHIND
    assert resolve(seqno, a, ItemMeta(cas=100, rev_seqno=5), is_delete=False) is Resolution.IDENTICAL
    assert resolve(seqno, a, ItemMeta(cas=100, rev_seqno=5, datatype=XATTR), is_delete=False) is Resolution.ACCEPT


OPTION_BITS = [0, FORCE_WITH_META_OP, FORCE_ACCEPT_WITH_META_OPS, REGENERATE_CAS, SKIP_CONFLICT_RESOLUTION_FLAG,
               IS_EXPIRATION, 0x20, 1 << 31]


def model_options(options: int, mode: ConflictResolutionMode, deletion: bool) -> tuple[bool, bool, bool] | None:
    known = (FORCE_WITH_META_OP | FORCE_ACCEPT_WITH_META_OPS | REGENERATE_CAS | SKIP_CONFLICT_RESOLUTION_FLAG
             | IS_EXPIRATION)
    skip = options & (SKIP_CONFLICT_RESOLUTION_FLAG | FORCE_WITH_META_OP)  # FORCE_WITH_META_OP: MB-67207
    if options & ~known:
        return None
    if options & REGENERATE_CAS and not skip:
        return None
    if options & FORCE_ACCEPT_WITH_META_OPS and mode is not ConflictResolutionMode.LWW:
        return None
    if options & IS_EXPIRATION and not deletion:
        return None
    return (not skip, bool(options & REGENERATE_CAS),
            bool(options & IS_EXPIRATION))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(OPTION_BITS), max_size=4), st.sampled_from(MODES), st.booleans())
def test_options_match_the_model(bits: list[int], mode: ConflictResolutionMode, deletion: bool) -> None:
    options = 0
    for b in bits:
        options |= b
    want = model_options(options, mode, deletion)
    if want is None:
        with pytest.raises(InvalidArgument):
            parse_options(options, mode, deletion=deletion)
    else:
        o = parse_options(options, mode, deletion=deletion)
        assert (o.check_conflicts, o.regenerate_cas, o.is_expiration) == want


# ---------------------------------------------------------------------- random histories on a bucket
NOW = 1_700_000_000.0
HLC = int(NOW * 1_000_000_000) & ~0xFFFF
KEYS = [b"a", b"b", b"c"]
FAR = 4_000_000_000  # an expiry that never passes during the test (u32)
cas_values = st.sampled_from([1, 2, HLC - 1, HLC, HLC + 1, HLC + 2, HLC + 5, 1 << 62])
incoming = st.builds(ItemMeta, cas=cas_values, rev_seqno=st.integers(1, 6), flags=st.integers(0, 2),
                     expiry=st.sampled_from([0, FAR, FAR + 1]), datatype=st.sampled_from([0, XATTR]))
options = st.sampled_from([0, 0, 0, SKIP_CONFLICT_RESOLUTION_FLAG, SKIP_CONFLICT_RESOLUTION_FLAG | REGENERATE_CAS,
                           FORCE_ACCEPT_WITH_META_OPS, REGENERATE_CAS, IS_EXPIRATION, FORCE_WITH_META_OP])
history_op = st.one_of(
    st.tuples(st.sampled_from(["set_with_meta", "add_with_meta", "del_with_meta"]), st.sampled_from(KEYS),
              incoming, options),
    st.tuples(st.just("set"), st.sampled_from(KEYS)),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
)


class Model:
    """Each key's metadata (document or tombstone) and the vbucket's HLC, computed the plain way."""

    def __init__(self, mode: ConflictResolutionMode) -> None:
        self.mode = mode
        self.docs: dict[bytes, ItemMeta] = {}
        self.max_cas = 0
        self.max_deleted_rev = 0
        self.counts = {"accepted": 0, "rejected_behind": 0, "rejected_identical": 0}

    def next_cas(self) -> int:
        self.max_cas = HLC if self.max_cas < HLC else self.max_cas + 1
        return self.max_cas

    def local_set(self, key: bytes) -> bool:
        old = self.docs.get(key)
        rev = old.rev_seqno + 1 if old is not None else self.max_deleted_rev + 1
        self.docs[key] = ItemMeta(self.next_cas(), rev, 0, 0, Datatype.RAW, False)
        return True

    def local_delete(self, key: bytes) -> bool:
        old = self.docs.get(key)
        if old is None or old.deleted:
            return False
        # (the engine's front-end delete leaves the vbucket's max deleted rev seqno to warmup)
        self.docs[key] = ItemMeta(self.next_cas(), old.rev_seqno + 1, old.flags, int(NOW), Datatype.RAW, True)
        return True

    def with_meta(self, op: str, key: bytes, meta: ItemMeta, opts: int) -> str:
        deletion = op == "del_with_meta"
        parsed = model_options(opts, self.mode, deletion)
        if parsed is None:
            return "einval"
        check, regen, _exp = parsed
        old = self.docs.get(key)
        if op == "add_with_meta" and old is not None and not old.deleted:
            return "exists"
        if check and old is not None and not model_wins(self.mode, old, meta, deletion):
            identical = (old.rev_seqno, old.cas, old.deleted) == (meta.rev_seqno, meta.cas, deletion) and (
                deletion or (old.expiry, old.flags) == (meta.expiry, meta.flags))
            self.counts["rejected_identical" if identical else "rejected_behind"] += 1
            return "rejected"
        self.counts["accepted"] += 1
        if regen:
            cas = self.next_cas()
        else:
            cas = meta.cas
            self.max_cas = max(self.max_cas, cas)
        if deletion:
            self.docs[key] = ItemMeta(cas, meta.rev_seqno, meta.flags, meta.expiry or int(NOW), Datatype.RAW, True)
            self.max_deleted_rev = max(self.max_deleted_rev, meta.rev_seqno)
        else:
            self.docs[key] = ItemMeta(cas, meta.rev_seqno, meta.flags, meta.expiry, meta.datatype, False)
        return "accepted"


def _bucket(path: Path, mode: ConflictResolutionMode) -> Bucket:
    return Bucket(BucketConfig(data_dir=path, num_vbuckets=1, seed=3, conflict_resolution=mode.value,
                               tune_gc=False), clock=ManualClock(NOW))


def _run(b: Bucket, op: tuple[Any, ...]) -> str:
    name, key = op[0], op[1]
    try:
        if name == "set":
            b.set(key, b"local")
        elif name == "delete":
            b.delete(key)
        else:
            meta, opts = op[2], op[3]
            value = None if name == "del_with_meta" else b"v"
            getattr(b, name)(key, value, meta, opts)
    except ConflictRejected:
        return "rejected"
    except InvalidArgument:
        return "einval"
    except KeyNotFound:
        return "absent"
    except KeyExists:
        return "exists"
    return "accepted"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(MODES), st.lists(history_op, min_size=1, max_size=40))
def test_histories_match_the_model(mode: ConflictResolutionMode, ops: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        b = _bucket(Path(d), mode)
        m = Model(mode)
        for op in ops:
            got = _run(b, op)
            if op[0] == "set":
                want = "accepted" if m.local_set(op[1]) else "?"
            elif op[0] == "delete":
                want = "accepted" if m.local_delete(op[1]) else "absent"
            else:
                want = m.with_meta(op[0], op[1], op[2], op[3])
            assert got == want, op
            for k in KEYS:
                exp = m.docs.get(k)
                if exp is None:
                    with pytest.raises(KeyNotFound):
                        b.get_meta(k)
                else:
                    meta = b.get_meta(k)
                    assert (meta.cas, meta.rev_seqno, meta.flags, meta.expiry, meta.deleted) == (
                        exp.cas, exp.rev_seqno, exp.flags, exp.expiry, exp.deleted), (ops, k)
                    if not exp.deleted:
                        assert meta.datatype == exp.datatype
            stats = b.stats()
            assert {k: stats[k] for k in m.counts} == m.counts
        # everything survives a restart (tombstones keep their meta; the HLC restarts past every CAS)
        b.close()
        b = _bucket(Path(d), mode)
        for k, exp in m.docs.items():
            meta = b.get_meta(k)
            assert (meta.cas, meta.rev_seqno, meta.deleted) == (exp.cas, exp.rev_seqno, exp.deleted)
        assert b.set(b"z", b"after").cas > max((e.cas for e in m.docs.values()), default=0)
        b.close()


# ---------------------------------------------------------------------- engine behaviours
def test_tombstone_meta_survives_restart_and_rejects_older_writes(tmp_path: Path) -> None:
    b = _bucket(tmp_path, ConflictResolutionMode.SEQNO)
    b.set_with_meta("k", b"v", ItemMeta(HLC + 10, 3, flags=5))
    b.del_with_meta("k", None, ItemMeta(HLC + 11, 4, expiry=1_600_000_000))
    assert b.stats()["items"] == 0
    b.close()
    b = _bucket(tmp_path, ConflictResolutionMode.SEQNO)
    m = b.get_meta("k")
    assert (m.deleted, m.rev_seqno, m.cas, m.expiry) == (True, 4, HLC + 11, 1_600_000_000)
    with pytest.raises(ConflictRejected) as older:
        b.set_with_meta("k", b"old", ItemMeta(HLC + 50, 3))
    assert not older.value.identical
    with pytest.raises(KeyNotFound):
        b.get("k")
    # a local write over the tombstone continues its rev seqno
    assert b.set("k", b"new").cas > HLC + 11 and b.get_meta("k").rev_seqno == 5
    b.close()


def test_expiration_with_meta_is_an_expiration_item(tmp_path: Path) -> None:
    b = _bucket(tmp_path, ConflictResolutionMode.SEQNO)
    p = b.dcp_producer("x")
    b.del_with_meta("k", None, ItemMeta(HLC, 2, expiry=1_650_000_000), IS_EXPIRATION)
    p.stream_request(0, 0, 2**64 - 1, b.failover_log(0)[0].vbuuid, 0, 0)
    items = [m for m in p.step(10) if isinstance(m, Item)]  # the only message with an op
    assert [(i.op, i.cas, i.rev_seqno, i.expiry) for i in items] == [(Op.EXPIRATION, HLC, 2, 1_650_000_000)]
    b.close()


def test_lww_accepting_a_future_cas_moves_the_hlc(tmp_path: Path) -> None:
    b = _bucket(tmp_path, ConflictResolutionMode.LWW)
    future = HLC + (10 << 30)
    b.set_with_meta("f", b"v", ItemMeta(future, 1))
    r = b.set("other", b"local")
    assert r.cas == future + 1  # kv_engine setMaxCasAndTrackDrift: the clock never goes behind an accepted CAS
    # a local write to the same key then wins an LWW comparison against the accepted version
    r2 = b.set("f", b"mine")
    assert r2.cas > future
    with pytest.raises(ConflictRejected):
        b.set_with_meta("f", b"theirs", ItemMeta(future, 99))
    b.close()


def test_mode_is_fixed_at_creation(tmp_path: Path) -> None:
    b = _bucket(tmp_path, ConflictResolutionMode.LWW)
    assert b.stats()["conflict_resolution"] == "lww"
    b.close()
    with pytest.raises(ConflictResolutionMismatch) as e:
        _bucket(tmp_path, ConflictResolutionMode.SEQNO)
    assert e.value.stored == "lww" and e.value.requested == "seqno" and "fixed" in str(e.value)
    b = _bucket(tmp_path, ConflictResolutionMode.LWW)  # the same mode reopens, and the failed open left no lock
    b.close()
    with pytest.raises(ValueError):
        BucketConfig(data_dir=tmp_path, conflict_resolution="newest")


def test_bad_arguments(tmp_path: Path) -> None:
    b = _bucket(tmp_path, ConflictResolutionMode.SEQNO)
    with pytest.raises(InvalidArgument):
        b.set_with_meta("k", b"v", (1, 2))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        b.set_with_meta("k", b"v", ItemMeta(1, -1))
    with pytest.raises(InvalidArgument):
        b.set_with_meta("k", b"v", ItemMeta(1, 1, flags=1 << 32))
    with pytest.raises(InvalidArgument):
        b.set_with_meta("k", b"v", ItemMeta(1, 1, expiry=-5))
    with pytest.raises(InvalidArgument):
        b.set_with_meta("k", b"v", ItemMeta(1, 1), cas=-1)
    with pytest.raises(InvalidArgument):
        b.set_with_meta("", b"v", ItemMeta(1, 1))
    with pytest.raises(KeyExists):
        b.set_with_meta("k", b"v", ItemMeta((1 << 64) - 1, 1))
    assert b.stats()["accepted"] == 0
    b.close()


def test_in_process_cluster_routes_writes_with_meta_and_replicas_keep_the_meta(tmp_path: Path) -> None:
    from engine.cluster.local import Cluster

    c = Cluster.create(tmp_path, nodes=3, replicas=1, num_vbuckets=8, clock=ManualClock(NOW),
                       conflict_resolution="lww")
    try:
        keys = [f"x{i}" for i in range(20)]
        for i, k in enumerate(keys):
            c.set_with_meta(k, b"v", ItemMeta(HLC + i + 1, 3, flags=i))
        c.del_with_meta(keys[0], None, ItemMeta(HLC + 100, 4, expiry=1_650_000_000))
        with pytest.raises(ConflictRejected):
            c.set_with_meta(keys[1], b"old", ItemMeta(HLC, 9))  # lww: CAS first
        c.settle()
        victim = c.vbucket_map().chains[c.vbucket_of(keys[1])][0]
        assert victim is not None
        c.kill(victim)
        c.failover(victim)
        for i, k in enumerate(keys[1:], 1):
            m = c.get_meta(k)
            assert (m.cas, m.rev_seqno, m.flags, m.deleted) == (HLC + i + 1, 3, i, False)
        m = c.get_meta(keys[0])
        assert (m.cas, m.rev_seqno, m.deleted) == (HLC + 100, 4, True)
        assert all(n.require_bucket().conflict_resolution.value == "lww" for n in c.nodes.values() if n.up)
    finally:
        c.close()
