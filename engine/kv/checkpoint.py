"""The checkpoint manager: the per-vbucket in-memory write queue and its cursors (kv_engine ``CheckpointManager``;
docs/engine.md "Snapshots, de-duplication and consistency").

kv_engine (``checkpoint_manager.cc``) rules implemented here:

* Items are queued in seqno order into the single **open** checkpoint; earlier checkpoints are **closed**.
* The open checkpoint **de-duplicates**: queuing a key already present in it removes the older entry (a hole
  is left so cursor positions stay valid; cursors simply skip holes) -- docs/engine.md "Snapshots, de-duplication and consistency".
* A new checkpoint is opened when the open one reaches its item-count or byte limit (closed checkpoints
  never de-duplicate, so a consumer reading a closed checkpoint to its end sees a consistent snapshot).
* **Cursors**: one for persistence, one per DCP stream. A closed checkpoint is freed once every cursor has
  moved past it; the items at the front of the oldest checkpoint that every cursor has read are **expelled**
  (kv_engine ``CheckpointManager::expelUnreferencedCheckpointItems``), so a persisted and streamed item is
  referenced by the hash table alone (docs/engine.md "Item layout and memory"). DCP cursors may be **dropped** under memory pressure; their streams go back to backfilling
  from disk (kv_engine cursor dropping; docs/engine.md "Memory quota").
* A cursor always reads a checkpoint *to its current end* in one go: cutting a checkpoint in the middle could
  split a de-duplicated key from its newer version and expose an inconsistent state (docs/engine.md "Snapshots, de-duplication and consistency").
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from engine.kv.item import ITEM_OVERHEAD, Item, Op
from engine.kv.stored_value import HEADER, meta, unpack, value_size

if TYPE_CHECKING:
    from engine.kv.stored_value import HashTable

#: a checkpoint entry: an Item, the stored value of a plain mutation (engine/kv/stored_value.py: the very object
#: the hash table holds, made an Item when a cursor reads it), or None (a de-duplicated hole)
Entry = Item | bytes | None


def entry_size(key: bytes, e: Item | bytes) -> int:
    """Bytes an entry of ``key`` is charged against the checkpoint memory quota."""
    if isinstance(e, bytes):
        return ITEM_OVERHEAD + len(key) + value_size(e)
    v = e.value
    return ITEM_OVERHEAD + len(key) + (len(v) if v is not None else 0)

PERSISTENCE_CURSOR: Final = "persistence"
#: the cursor that pins what a background flush in flight read (CheckpointManager.pin_persistence)
FLUSH_PIN_CURSOR: Final = "persistence-in-flight"
_pack_header = HEADER.pack
_unpack_header = HEADER.unpack_from
_HEADER_SIZE: Final = HEADER.size
_MUTATION: Final = Op.MUTATION


class MemoryCounter:
    """Checkpoint memory shared by all vbuckets of a bucket (checked against the checkpoint quota)."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used = 0


class Checkpoint:
    """One checkpoint: entries in seqno order (:data:`Entry`: an item, a stored value, ``None`` = de-duplicated
    hole), their keys and their seqnos."""

    __slots__ = ("expelled", "id", "index", "is_open", "items", "keys", "live", "mem", "seqnos", "start_seqno")

    def __init__(self, ckpt_id: int, start_seqno: int) -> None:
        self.id = ckpt_id
        self.start_seqno = start_seqno  # first seqno this checkpoint covers
        self.items: list[Entry] = []
        #: the key of each entry (a stored value holds none), holes included
        self.keys: list[bytes] = []
        #: 8 bytes a seqno, no int object: what the hash table keeps once the items are expelled stays packed
        #: (docs/engine.md "Item layout and memory")
        self.seqnos = array("q")
        self.index: dict[bytes, int] = {}  # key -> position; only kept while open
        self.is_open = True
        self.live = 0
        self.mem = 0
        self.expelled = False  # items were expelled from its front: position 0 is no checkpoint boundary

    def queued_items(self, vbucket: int) -> list[Item]:
        """The items this checkpoint of ``vbucket`` queues, in seqno order (holes skipped; stored values made
        items)."""
        return [unpack(k, it, vbucket) if isinstance(it, bytes) else it
                for k, it in zip(self.keys, self.items, strict=True) if it is not None]

    @property
    def high_seqno(self) -> int:
        """Seqno of the last item queued (start_seqno - 1 when empty)."""
        return self.seqnos[-1] if self.seqnos else self.start_seqno - 1

    def __repr__(self) -> str:
        state = "open" if self.is_open else "closed"
        return f"Checkpoint(id={self.id} {state} [{self.start_seqno}, {self.high_seqno}] live={self.live})"


class Cursor:
    """A reader's position: the checkpoint it is in and the index of the next entry to read."""

    __slots__ = ("ckpt", "droppable", "dropped", "last_read", "name", "pos")

    def __init__(self, name: str, ckpt: Checkpoint, pos: int, last_read: int, droppable: bool) -> None:
        self.name = name
        self.ckpt = ckpt
        self.pos = pos
        self.last_read = last_read
        self.droppable = droppable
        self.dropped = False

    def __repr__(self) -> str:
        return f"Cursor({self.name!r} ckpt={self.ckpt.id} pos={self.pos} last_read={self.last_read})"


@dataclass(slots=True)
class Segment:
    """Items a cursor read from one checkpoint: becomes one memory snapshot (marker + items).

    ``start``/``end`` span every seqno read, holes included; ``new_checkpoint`` is True when the segment
    begins at a checkpoint boundary (the marker gets the CHK flag).
    """

    start: int
    end: int
    items: list[Item]
    new_checkpoint: bool


@dataclass(slots=True)
class EntrySegment:
    """A :class:`Segment` whose items are left as queued (:data:`Entry`, holes dropped) with their keys: the
    flusher's read, which makes rows of stored values without an Item in between."""

    start: int
    end: int
    keys: list[bytes]
    items: list[Item | bytes]
    new_checkpoint: bool


class CheckpointManager:
    """Checkpoints and cursors of one vbucket."""

    __slots__ = (
        "_next_id",
        "checkpoints",
        "counter",
        "cursors",
        "flush_pin",
        "max_bytes",
        "max_items",
        "open",
        "table",
        "vbucket",
    )

    def __init__(
        self,
        vbucket: int,
        high_seqno: int,
        counter: MemoryCounter,
        *,
        max_items: int = 10_000,
        max_bytes: int = 10 * 1024 * 1024,
    ) -> None:
        self.vbucket = vbucket
        self.counter = counter
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._next_id = 1
        self.open = Checkpoint(self._take_id(), high_seqno + 1)
        self.checkpoints: deque[Checkpoint] = deque([self.open])
        self.cursors: dict[str, Cursor] = {}
        self.cursors[PERSISTENCE_CURSOR] = Cursor(PERSISTENCE_CURSOR, self.open, 0, high_seqno, False)
        #: while a background flush of this vbucket is in flight: where the persistence cursor was before it
        #: read the flush's items (:meth:`pin_persistence`), registered as a cursor so that nothing it read is
        #: freed or de-duplicated before the flush lands (docs/engine.md "Background flush")
        self.flush_pin: Cursor | None = None
        #: the vbucket's hash table: told which items the checkpoints drop, so it packs the current versions
        #: among them (engine/kv/stored_value.py; None: a checkpoint manager of its own, in tests)
        self.table: HashTable | None = None

    def _take_id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    # ------------------------------------------------------------------ queueing
    def queue(self, item: Item) -> Item | None:
        """Append ``item`` to the open checkpoint, de-duplicating an older entry of its key.

        Returns the de-duplicated item (or None). Sets ``item.prev_seqno`` to the seqno of the version of the
        key that will be on disk when ``item`` is flushed (the flusher marks that row superseded).
        """
        ck = self.open
        key = item.key
        v = item.value
        size = ITEM_OVERHEAD + len(key) + (len(v) if v is not None else 0)
        index = ck.index
        old_pos = index.get(key)
        old: Item | None = None
        if old_pos is not None:
            entry = ck.items[old_pos]
            assert entry is not None
            old = unpack(key, entry, self.vbucket) if isinstance(entry, bytes) else entry
            assert old is not None
            if item.op >= 3 or old.op >= 3 or item.sync or old.sync:
                # kv_engine: prepares, commits and aborts never de-duplicate (a prepare replaced in the open
                # checkpoint would hide it from replicas): a new checkpoint instead (docs/durability.md "DCP").
                self.create_checkpoint()
                return self.queue(item)
            # The older entry reaches disk only if the persistence cursor already read it.
            pcur = self.cursors[PERSISTENCE_CURSOR]
            if pcur.ckpt is ck and pcur.pos > old_pos:
                if self._in_flight(ck, old_pos):
                    # kept, not de-duplicated: a new checkpoint instead, as for a prepare (_in_flight)
                    self.create_checkpoint()
                    item.prev_seqno = old.seqno
                    return self.queue(item)
                item.prev_seqno = old.seqno
            else:
                item.prev_seqno = old.prev_seqno
            self._dedup(ck, old_pos, key, entry)
        index[key] = len(ck.items)
        ck.items.append(item)
        ck.keys.append(key)
        ck.seqnos.append(item.seqno)
        ck.live += 1
        ck.mem += size
        self.counter.used += size
        if ck.live >= self.max_items or ck.mem >= self.max_bytes:
            self.create_checkpoint()
        return old

    def queue_mutation(self, key: bytes, value: bytes, seqno: int, cas: int, rev: int, prev: int, flags: int,
                       expiry: int, datatype: int) -> bytes:
        """:meth:`queue` for a plain mutation (the ingest path): queues its stored value (engine/kv/stored_value.py)
        and returns it, for the hash table to hold the same object. ``prev`` is the seqno of the key's current
        version; the one the flusher supersedes is worked out here as in :meth:`queue`."""
        ck = self.open
        index = ck.index
        old_pos = index.get(key)
        if old_pos is not None:
            entry = ck.items[old_pos]
            if type(entry) is bytes:
                oseqno, _cas, _rev, oprev, _f, _e, _d, _bits = meta(entry)
            else:
                assert type(entry) is Item
                if entry.op >= 3 or entry.sync:  # never de-duplicated: see queue
                    self.create_checkpoint()
                    return self.queue_mutation(key, value, seqno, cas, rev, prev, flags, expiry, datatype)
                oseqno, oprev = entry.seqno, entry.prev_seqno
            pcur = self.cursors[PERSISTENCE_CURSOR]
            if pcur.ckpt is ck and pcur.pos > old_pos:
                if self._in_flight(ck, old_pos):
                    # kept, not de-duplicated: a new checkpoint instead, as for a prepare (_in_flight)
                    self.create_checkpoint()
                    return self.queue_mutation(key, value, seqno, cas, rev, oseqno, flags, expiry, datatype)
                prev = oseqno
            else:
                prev = oprev
            self._dedup(ck, old_pos, key, entry)
        stored = _pack_header(seqno, cas, rev, prev, flags, expiry, datatype, 0) + value  # pack_mutation, inlined
        size = ITEM_OVERHEAD + len(key) + len(value)
        items = ck.items
        index[key] = len(items)
        items.append(stored)
        ck.keys.append(key)
        ck.seqnos.append(seqno)
        ck.live += 1
        ck.mem += size
        self.counter.used += size
        if ck.live >= self.max_items or ck.mem >= self.max_bytes:
            self.create_checkpoint()
        return stored

    def _in_flight(self, ck: Checkpoint, pos: int) -> bool:
        """The entry at ``pos`` of the open checkpoint ``ck``, read by the persistence cursor, belongs to the
        background flush in flight: it stays queued (not de-duplicated) until that flush lands, so that a
        failed flush reads it again (:meth:`pin_persistence`). The newer version goes into a new checkpoint, as
        kv_engine does for what it may not de-duplicate: a snapshot never holds a key twice."""
        pin = self.flush_pin
        return pin is not None and not (pin.ckpt is ck and pin.pos > pos)

    def _dedup(self, ck: Checkpoint, pos: int, key: bytes, entry: Item | bytes) -> None:
        """Drop the entry at ``pos`` of ``ck``: a newer version of ``key`` replaces it."""
        ck.items[pos] = None
        size = entry_size(key, entry)
        ck.mem -= size
        self.counter.used -= size
        ck.live -= 1

    def pin_persistence(self) -> Cursor:
        """Register :attr:`flush_pin` where the persistence cursor is now, before a background flush reads
        past it. It is a cursor like the others (not droppable): the checkpoints and items it has not passed
        are kept, and expelling moves it with them; :meth:`unpin_persistence` ends it. A pin already there (the
        flush reads the vbucket twice) stays: it marks where the flush began."""
        if self.flush_pin is not None:
            return self.flush_pin
        pcur = self.cursors[PERSISTENCE_CURSOR]
        pin = Cursor(FLUSH_PIN_CURSOR, pcur.ckpt, pcur.pos, pcur.last_read, False)
        self.cursors[FLUSH_PIN_CURSOR] = pin
        self.flush_pin = pin
        return pin

    def unpin_persistence(self, restore: bool) -> None:
        """End :attr:`flush_pin`: the flush landed, or (``restore``) failed -- then the persistence cursor
        goes back to it, to read the same items again."""
        pin = self.flush_pin
        if pin is None:
            return
        if restore:
            pcur = self.cursors[PERSISTENCE_CURSOR]
            pcur.ckpt, pcur.pos, pcur.last_read = pin.ckpt, pin.pos, pin.last_read
        self.flush_pin = None
        self.remove_cursor(FLUSH_PIN_CURSOR)

    def create_checkpoint(self) -> Checkpoint:
        """Close the open checkpoint (if it holds anything) and open a new one."""
        ck = self.open
        if not ck.items:
            return ck
        ck.is_open = False
        ck.index = {}
        new = Checkpoint(self._take_id(), ck.high_seqno + 1)
        self.checkpoints.append(new)
        self.open = new
        return new

    # ------------------------------------------------------------------ cursors
    @property
    def first_seqno(self) -> int:
        """The lowest seqno still readable from memory."""
        return self.checkpoints[0].start_seqno

    @property
    def high_seqno(self) -> int:
        return self.open.high_seqno

    def register_cursor(self, name: str, last_read: int, *, droppable: bool = True) -> Cursor | None:
        """Place cursor ``name`` right after seqno ``last_read``.

        Returns None when ``last_read + 1`` is no longer in memory: the caller must backfill from disk first
        (kv_engine registerCursorBySeqno: "if the first in-memory seqno is not lastRead+1, backfill").
        An existing cursor of that name is replaced.
        """
        self.remove_cursor(name)
        if last_read + 1 < self.first_seqno:
            return None
        target = self.checkpoints[-1]
        for ck in self.checkpoints:
            if ck.start_seqno <= last_read + 1 <= ck.high_seqno + 1 and (
                ck.is_open or last_read + 1 <= ck.high_seqno
            ):
                target = ck
                break
        pos = bisect_right(target.seqnos, last_read)
        cur = Cursor(name, target, pos, last_read, droppable)
        self.cursors[name] = cur
        return cur

    def remove_cursor(self, name: str) -> None:
        cur = self.cursors.pop(name, None)
        if cur is not None:
            cur.dropped = True

    def drop_cursor(self, name: str) -> bool:
        """Drop a DCP cursor under memory pressure. Returns False for undroppable cursors."""
        cur = self.cursors.get(name)
        if cur is None or not cur.droppable:
            return False
        self.remove_cursor(name)
        return True

    # ------------------------------------------------------------------ reading
    def read(self, cursor: Cursor, max_items: int = 10_000) -> list[Segment]:
        """Read whole checkpoint remainders for ``cursor`` until at least ``max_items`` were read.

        Each returned :class:`Segment` covers one checkpoint from the cursor position to its current end.
        """
        return self._read(cursor, max_items, True)  # type: ignore[return-value]

    def read_entries(self, cursor: Cursor, max_items: int = 10_000) -> list[EntrySegment]:
        """:meth:`read`, the entries left as queued (stored values not made items)."""
        return self._read(cursor, max_items, False)  # type: ignore[return-value]

    def _read(self, cursor: Cursor, max_items: int, as_items: bool) -> list[Segment | EntrySegment]:
        segments: list[Segment | EntrySegment] = []
        count = 0
        ck = cursor.ckpt
        pos = cursor.pos
        while True:
            items = ck.items
            n = len(items)
            if pos < n:
                first = pos == 0 and not ck.expelled
                if as_items:
                    vb = self.vbucket
                    chunk: list[Item] = []
                    add = chunk.append
                    for k, it in zip(ck.keys[pos:], items[pos:], strict=True):
                        if it is None:
                            continue
                        if isinstance(it, bytes):
                            # stored_value.unpack, inlined for a plain mutation (a cursor's per-item path)
                            seqno, cas, rev, prev, flags, exp, dt, bits = _unpack_header(it)
                            if bits:
                                add(unpack(k, it, vb))
                            else:
                                add(Item(k, it[_HEADER_SIZE:], vb, seqno, rev, cas, flags, exp, dt, _MUTATION, prev))
                        else:
                            add(it)
                    segments.append(Segment(ck.seqnos[pos], ck.seqnos[-1], chunk, first))
                    count += len(chunk)
                else:
                    entries: list[Item | bytes] = []
                    keys: list[bytes] = []
                    for k, it in zip(ck.keys[pos:], items[pos:], strict=True):
                        if it is not None:
                            keys.append(k)
                            entries.append(it)
                    segments.append(EntrySegment(ck.seqnos[pos], ck.seqnos[-1], keys, entries, first))
                    count += len(entries)
                pos = n
                cursor.last_read = ck.seqnos[-1]
            if pos >= n and not ck.is_open:
                nxt = self._next(ck)
                if nxt is None:
                    break
                ck, pos = nxt, 0
                if count >= max_items:
                    break
                continue
            break
        cursor.ckpt = ck
        cursor.pos = pos
        return segments

    def has_items_for(self, cursor: Cursor) -> bool:
        ck = cursor.ckpt
        if cursor.pos < len(ck.items):
            return True
        if ck.is_open:
            return False
        nxt = self._next(ck)
        while nxt is not None:
            if nxt.items:
                return True
            nxt = self._next(nxt)
        return False

    def _next(self, ck: Checkpoint) -> Checkpoint | None:
        idx = ck.id - self.checkpoints[0].id + 1
        if idx < len(self.checkpoints):
            return self.checkpoints[idx]
        return None

    # ------------------------------------------------------------------ freeing memory
    def remove_unreferenced(self) -> int:
        """Free closed checkpoints that every cursor has passed, then expel the items every cursor has read
        from the front of the oldest checkpoint left (:meth:`expel`). Returns bytes freed."""
        for cur in self.cursors.values():
            ck = cur.ckpt
            while not ck.is_open and cur.pos >= len(ck.items):
                nxt = self._next(ck)
                if nxt is None:
                    break
                cur.ckpt, cur.pos = nxt, 0
                ck = nxt
        lowest = min(c.ckpt.id for c in self.cursors.values()) if self.cursors else self.open.id
        freed = 0
        cks = self.checkpoints
        table = self.table
        while len(cks) > 1 and not cks[0].is_open and cks[0].id < lowest:
            ck = cks.popleft()
            freed += ck.mem
            if table is not None:
                table.expelled(ck.items)
        self.counter.used -= freed
        return freed + self.expel()

    def expel(self) -> int:
        """Drop the items at the front of the oldest checkpoint that every cursor has read (kv_engine item
        expelling). Cursor positions move down with them; the checkpoint then starts at its first item left, so
        a reader wanting an expelled seqno backfills it from disk (the persistence cursor read it: it is
        flushed). Expels only when at least half the checkpoint goes, so the index rebuild of an open
        checkpoint costs no more than what it frees. Returns bytes freed."""
        ck = self.checkpoints[0]
        items = ck.items
        n = len(items)
        if not n:
            return 0
        k = n
        for cur in self.cursors.values():
            if cur.ckpt is ck and cur.pos < k:
                k = cur.pos
        if k == 0 or 2 * k < n:
            return 0
        if k == n:  # the common case (every cursor caught up): everything goes, no per-item work
            freed = ck.mem
            ck.live = 0
        else:
            freed = 0
            for key, it in zip(ck.keys[:k], items[:k], strict=True):
                if it is not None:
                    freed += entry_size(key, it)
                    ck.live -= 1
        high = ck.seqnos[-1]
        if self.table is not None:
            self.table.expelled(items if k == n else items[:k])
        if k == n:
            ck.items = []
            ck.keys = []
            ck.seqnos = array("q")
            ck.start_seqno = high + 1
        else:
            del items[:k]
            del ck.keys[:k]
            del ck.seqnos[:k]
            ck.start_seqno = ck.seqnos[0]
        if ck.is_open:
            ck.index = {key: i for i, (key, it) in enumerate(zip(ck.keys, ck.items, strict=True)) if it is not None}
        ck.expelled = True
        for cur in self.cursors.values():
            if cur.ckpt is ck:
                cur.pos -= k
        ck.mem -= freed
        self.counter.used -= freed
        return freed

    def clear(self, high_seqno: int) -> None:
        """Drop every checkpoint and DCP cursor (rollback / state reset); reopen empty at ``high_seqno``."""
        freed = sum(ck.mem for ck in self.checkpoints)
        self.counter.used -= freed
        if self.table is not None:
            for ck in self.checkpoints:
                self.table.expelled(ck.items)
        for name in [n for n in self.cursors if n != PERSISTENCE_CURSOR]:
            self.remove_cursor(name)
        self.flush_pin = None
        self.open = Checkpoint(self._take_id(), high_seqno + 1)
        self.checkpoints = deque([self.open])
        self.cursors[PERSISTENCE_CURSOR] = Cursor(PERSISTENCE_CURSOR, self.open, 0, high_seqno, False)

    @property
    def mem(self) -> int:
        return sum(ck.mem for ck in self.checkpoints)

