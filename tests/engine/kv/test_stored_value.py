"""Stored values (engine/kv/stored_value.py): the packed encoding round-trips every item field the hash table
keeps, and a bucket reads, updates, deletes and warms up documents whose checkpoints were expelled (held packed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from engine import Bucket
from engine.kv.item import Item, Op
from engine.kv.stored_value import HEADER_SIZE, HashTable, pack, pack_mutation, unpack

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)


@st.composite
def items(draw: st.DrawFn) -> Item:
    op = draw(st.sampled_from(list(Op)))
    value = draw(st.none() | st.binary(max_size=300))
    it = Item(draw(st.binary(min_size=1, max_size=250)), value, draw(st.integers(0, 1023)), draw(U64), draw(U64),
              draw(U64), draw(U32), draw(U32), draw(st.integers(0, 7)), op)
    it.sync = draw(st.integers(0, 2**62))
    it.prev_seqno = draw(U64)
    return it


@given(items())
def test_pack_unpack_round_trip(it: Item) -> None:
    stored = pack(it)
    assert len(stored) == HEADER_SIZE + (8 if it.sync else 0) + (len(it.value) if it.value is not None else 0)
    back = unpack(it.key, stored, it.vbucket)
    assert back == it
    assert back.value is None if it.value is None else back.value == it.value
    assert back.op is it.op and back.prev_seqno == it.prev_seqno and back.sync == it.sync


@given(st.binary(max_size=300), U64, U64, U64, U64, U32, U32, st.integers(0, 7))
def test_pack_mutation_is_the_items_stored_value(value: bytes, seqno: int, cas: int, rev: int, prev: int,
                                                 flags: int, expiry: int, datatype: int) -> None:
    stored = pack_mutation(value, seqno, cas, rev, prev, flags, expiry, datatype)
    it = Item(b"k", value, 2, seqno, rev, cas, flags, expiry, datatype, Op.MUTATION, prev)
    assert stored == pack(it) and unpack(b"k", stored, 2) == it


@given(st.lists(items(), max_size=20))
def test_table_expels_only_current_versions(its: list[Item]) -> None:
    t = HashTable(3)
    for it in its:
        it.vbucket = 3
        t[it.key] = it
    t.expelled([*its, None])
    last = {it.key: it for it in its}
    assert len(t) == len(last)
    for key, it in last.items():
        assert type(t.raw[key]) is bytes
        assert t[key] == it and t.get(key) == it and key in t
    assert dict(t.items()) == last
    assert sorted(t.keys()) == sorted(last)
    assert t.get(b"\xff" * 251) is None and t.pop(b"\xff" * 251) is None


def _expel_all(b: Bucket) -> None:
    b.flush_all()
    for vb in b.vbuckets():
        vb.ckpt.create_checkpoint()
        vb.ckpt.remove_unreferenced()


def test_bucket_reads_and_overwrites_packed_documents(make_bucket: Callable[..., Bucket], clock: Any) -> None:
    b = make_bucket(clock)
    r1 = b.set(b"a", b'{"x": 1}', flags=5, expiry=100)
    b.set(b"b", b"raw")
    b.set(b"c", b"gone")
    b.delete(b"c")
    _expel_all(b)
    vb = b.vbucket(r1.vbucket)
    assert type(vb.ht.raw[b"a"]) is bytes
    g = b.get(b"a")
    assert (g.value, g.flags, g.cas, g.seqno, g.datatype) == (b'{"x": 1}', 5, r1.cas, r1.seqno, 1)
    tomb = b.vbucket(b.set(b"c", b"x").vbucket).ht[b"c"]
    assert tomb.op is Op.MUTATION and tomb.rev_seqno == 3  # continues the packed tombstone's revision
    r2 = b.replace(b"a", b"2", cas=r1.cas)
    assert vb.ht[b"a"].rev_seqno == 2 and vb.ht[b"a"].prev_seqno == r1.seqno
    assert b.get(b"a").cas == r2.cas
    b.touch(b"b", 0)
    re = b.set(b"e", b"soon", expiry=100)
    _expel_all(b)
    assert b.get(b"b").value == b"raw" and b.get(b"b").expiry == 0
    clock.now += 200
    assert b.run_expiry_pager() == 1  # "e" (packed, expiry 100 s) becomes an expiration
    assert b.state_snapshot().keys() == {b"a", b"b", b"c"}
    assert b.vbucket(re.vbucket).ht[b"e"].op is Op.EXPIRATION


def test_warmup_holds_documents_packed(make_bucket: Callable[..., Bucket]) -> None:
    b = make_bucket()
    b.set(b"k", b"v1")
    b.set(b"k", b"v2")
    b.set(b"d", b"x")
    b.delete(b"d")
    b.close()
    b2 = make_bucket()
    vbk = b2.vbucket(b2.set(b"other", b"o").vbucket)
    for vb in b2.vbuckets():
        for key in (b"k", b"d"):
            if key in vb.ht:
                assert type(vb.ht.raw[key]) is bytes
    assert b2.get(b"k").value == b"v2"
    assert vbk.ht[b"other"].value == b"o"
    assert b"d" not in b2.state_snapshot()
