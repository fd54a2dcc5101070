"""Checkpoint manager: de-duplication, limits, cursors, freeing, cursor dropping."""

from __future__ import annotations

from engine.kv.checkpoint import PERSISTENCE_CURSOR, CheckpointManager, MemoryCounter
from engine.kv.item import Item


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
