"""Checkpoint manager: de-duplication, limits, cursors, freeing, cursor dropping."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.checkpoint import PERSISTENCE_CURSOR, CheckpointManager, MemoryCounter
from engine.kv.item import ITEM_OVERHEAD, Item


def _item(key: str, seqno: int) -> Item:
    return Item(key.encode(), b"v", 0, seqno, 1, seqno)


def _mgr(**kw: int) -> CheckpointManager:
    return CheckpointManager(0, 0, MemoryCounter(), **kw)


def test_open_checkpoint_deduplicates() -> None:
    m = _mgr()
    m.queue(_item("A", 1))
    m.queue(_item("B", 2))
    old = m.queue(_item("A", 3))
    assert old is not None and old.seqno == 1
    cur = m.register_cursor("c", 0)
    assert cur is not None
    segs = m.read(cur)
    assert [(s.start, s.end) for s in segs] == [(1, 3)]
    assert [it.seqno for it in segs[0].items] == [2, 3]  # docs/engine.md "Snapshots, de-duplication and consistency": 1 was de-duplicated


def test_dedup_sets_prev_seqno_for_the_flusher() -> None:
    m = _mgr()
    a1 = _item("A", 1)
    m.queue(a1)
    a2 = _item("A", 2)
    a2.prev_seqno = 1
    m.queue(a2)
    assert a2.prev_seqno == 0  # 1 never reaches disk
    pc = m.cursors[PERSISTENCE_CURSOR]
    m.read(pc)  # flusher read seqno 2
    a3 = _item("A", 3)
    a3.prev_seqno = 2
    m.queue(a3)
    assert a3.prev_seqno == 2  # 2 is on disk, 3 supersedes it


def test_checkpoint_closes_on_item_and_byte_limits() -> None:
    m = _mgr(max_items=3)
    for i in range(1, 8):
        m.queue(_item(f"k{i}", i))
    assert len(m.checkpoints) == 3
    assert [c.is_open for c in m.checkpoints] == [False, False, True]
    mb = CheckpointManager(0, 0, MemoryCounter(), max_items=1000, max_bytes=1024)
    for i in range(1, 30):
        mb.queue(Item(f"k{i}".encode(), b"x" * 100, 0, i, 1, i))
    assert len(mb.checkpoints) > 2
    assert all(c.mem < 1024 + 300 for c in mb.checkpoints)


def test_closed_checkpoint_does_not_deduplicate_and_chk_boundaries() -> None:
    m = _mgr(max_items=2)
    m.queue(_item("A", 1))
    m.queue(_item("B", 2))  # closes
    m.queue(_item("A", 3))
    cur = m.register_cursor("c", 0)
    assert cur is not None
    segs = m.read(cur)
    assert [(s.start, s.end, s.new_checkpoint) for s in segs] == [(1, 2, True), (3, 3, True)]
    assert [it.seqno for s in segs for it in s.items] == [1, 2, 3]


def test_cursor_registration_mid_checkpoint_and_backfill_needed() -> None:
    m = _mgr(max_items=3)
    for i in range(1, 10):
        m.queue(_item(f"k{i}", i))
    cur = m.register_cursor("c", 4)
    assert cur is not None
    segs = m.read(cur)
    assert [it.seqno for s in segs for it in s.items] == [5, 6, 7, 8, 9]
    assert segs[0].start == 5 and not segs[0].new_checkpoint
    # free the first checkpoints: both cursors past them
    m.read(m.cursors[PERSISTENCE_CURSOR])
    m.remove_unreferenced()
    assert m.first_seqno > 1
    assert m.register_cursor("late", 0) is None  # must backfill


def test_checkpoints_freed_only_when_all_cursors_passed() -> None:
    counter = MemoryCounter()
    m = CheckpointManager(0, 0, counter, max_items=2)
    slow = m.register_cursor("slow", 0)
    assert slow is not None
    for i in range(1, 7):
        m.queue(_item(f"k{i}", i))
    m.read(m.cursors[PERSISTENCE_CURSOR])
    before = counter.used
    assert m.remove_unreferenced() == 0
    assert counter.used == before
    m.read(slow)
    assert m.remove_unreferenced() > 0
    assert len(m.checkpoints) == 1
    assert counter.used == m.mem


def test_drop_cursor_frees_memory_persistence_cursor_undroppable() -> None:
    counter = MemoryCounter()
    m = CheckpointManager(0, 0, counter, max_items=2)
    assert m.register_cursor("dcp", 0) is not None
    for i in range(1, 11):
        m.queue(_item(f"k{i}", i))
    m.read(m.cursors[PERSISTENCE_CURSOR])
    assert not m.drop_cursor(PERSISTENCE_CURSOR)
    assert m.drop_cursor("dcp")
    assert m.remove_unreferenced() > 0
    assert "dcp" not in m.cursors


def test_items_every_cursor_read_are_expelled() -> None:
    """kv_engine item expelling (docs/engine.md "Item layout and memory"): once the persistence cursor and every
    DCP cursor read the front of the open checkpoint, it no longer references those items."""
    counter = MemoryCounter()
    m = CheckpointManager(0, 0, counter)
    for i in range(1, 7):
        m.queue(_item(f"k{i}", i))
    dcp = m.register_cursor("dcp", 0)
    assert dcp is not None
    pc = m.cursors[PERSISTENCE_CURSOR]
    m.read(pc)
    assert m.remove_unreferenced() == 0  # the DCP cursor has read nothing yet
    assert m.first_seqno == 1
    m.read(dcp)
    before = counter.used
    assert m.remove_unreferenced() == before
    assert counter.used == 0 and m.mem == 0
    assert m.open.items == [] and m.open.index == {}
    assert m.first_seqno == 7 and m.high_seqno == 6
    assert m.register_cursor("late", 3) is None  # expelled: a late reader backfills from disk
    # Writes go on: a key written again after its older version was expelled is not de-duplicated against it.
    a = _item("k2", 7)
    assert m.queue(a) is None
    segs = m.read(dcp)
    assert [(s.start, s.end, s.new_checkpoint) for s in segs] == [(7, 7, False)]
    assert [it.seqno for it in segs[0].items] == [7]
    late = m.register_cursor("late", 6)
    assert late is not None and [it.seqno for s in m.read(late) for it in s.items] == [7]


def test_expel_waits_for_half_and_keeps_positions() -> None:
    m = _mgr()
    for i in range(1, 11):
        m.queue(_item(f"k{i}", i))
    pc = m.cursors[PERSISTENCE_CURSOR]
    m.read(pc)
    slow = m.register_cursor("slow", 3)  # positioned after seqno 3: 3 of 10 read
    assert slow is not None
    assert m.expel() == 0  # under half: kept
    fast = m.register_cursor("slow", 6)  # replaced: 6 of 10 read by every cursor
    assert fast is not None
    assert m.expel() > 0
    assert m.first_seqno == 7 and list(m.open.seqnos) == [7, 8, 9, 10]
    # De-duplication still finds the entries left (the index was rebuilt with the new positions).
    old = m.queue(_item("k9", 11))
    assert old is not None and old.seqno == 9
    assert [it.seqno for s in m.read(fast) for it in s.items] == [7, 8, 10, 11]


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 5)),
        st.tuples(st.just("read"), st.sampled_from([PERSISTENCE_CURSOR, "a", "b"])),
        st.tuples(st.just("read"), st.sampled_from([PERSISTENCE_CURSOR, "a", "b"])),
        st.tuples(st.just("free"), st.just(0)),
        st.tuples(st.just("close"), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(_OPS, st.integers(2, 10))
def test_expelling_changes_nothing_a_cursor_reads(ops: list[tuple[str, object]], max_items: int) -> None:
    """Over random histories, a manager that frees and expels reads every cursor the same items (seqnos and the
    prev_seqno the flusher uses) as one that never frees, and its memory counter matches what it still holds."""
    counter = MemoryCounter()
    m = CheckpointManager(0, 0, counter, max_items=max_items)
    ref = CheckpointManager(0, 0, MemoryCounter(), max_items=max_items)
    for mgr in (m, ref):
        mgr.register_cursor("a", 0)
        mgr.register_cursor("b", 0)
    seqno = 0
    last: dict[bytes, int] = {}
    for op, arg in ops:
        if op == "write":
            seqno += 1
            assert isinstance(arg, int)
            key = b"k%d" % arg
            for mgr in (m, ref):
                it = Item(key, b"v" * seqno, 0, seqno, 1, seqno)
                it.prev_seqno = last.get(key, 0)
                mgr.queue(it)
            last[key] = seqno
        elif op == "read":
            got = [[(it.seqno, it.prev_seqno) for s in mgr.read(mgr.cursors[str(arg)]) for it in s.items]
                   for mgr in (m, ref)]
            assert got[0] == got[1]
            m.remove_unreferenced()  # as the flusher does after each flush
        elif op == "free":
            m.remove_unreferenced()
        else:
            m.create_checkpoint()
            ref.create_checkpoint()
        held = 0
        for ck in m.checkpoints:
            for e in ck.items:
                if e is not None:
                    assert isinstance(e, Item)  # only Items were queued
                    held += ITEM_OVERHEAD + len(e.key) + len(e.value or b"")
        assert counter.used == m.mem == held
        assert m.first_seqno <= m.cursors[PERSISTENCE_CURSOR].last_read + 1
