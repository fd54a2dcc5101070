"""Stored values: the hash table's packed form of an item (kv_engine ``StoredValue``), and the table itself.

An :class:`~engine.kv.item.Item` costs 128 bytes of object plus its seqno and CAS integers (32 bytes each) on top
of its key and value; for the engine's typical small documents that alone is more than half the raw bytes
(docs/engine.md "Item layout and memory"). kv_engine keeps one ``StoredValue`` per key in its hash table -- the
metadata and the value in one allocation -- and makes the item a DCP stream or the flusher reads only when it is
needed. Here the same: a key's current version is one ``bytes`` object, a fixed header (seqno, CAS, rev seqno,
prev seqno, flags, expiry, datatype, op bits) then the value. A front-end set packs it once and the checkpoint
queues that very object (``CheckpointManager.queue_mutation``); a cursor makes an :class:`Item` of it when it reads
it, the flusher a row. Other writes (deletes, touches, expirations, replica, with-meta and sync writes) queue an
:class:`Item` shared by the checkpoint and the table as before; when the checkpoints expel or free one that is still
its key's current version, the table packs it (:meth:`HashTable.expelled`). Why at the write and not later: CPython
keeps the arenas that long-lived objects filled (docs/engine.md "Item layout and memory").

Readers go through :class:`HashTable`, a mapping of key -> :class:`Item` that unpacks a stored value on
demand; the vbucket's own hot paths use its ``raw`` dict directly.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Final

from engine.kv.item import Item
from schemas.dcp import Op

#: seqno, cas, rev seqno, prev seqno (unsigned 64-bit), flags, expiry (unsigned 32-bit), datatype, op bits (the op,
#: :data:`NO_VALUE`, :data:`HAS_SYNC`): little-endian, no padding. Then the sync-write field (``prepared << 2 |
#: level``, unsigned 64-bit) if :data:`HAS_SYNC`, then the value. The key is not in it: the hash table's key, and
#: the checkpoint keeps its entries' keys alongside them (42 + 33 bytes of object header + a 256-byte value fit
#: CPython's 336-byte size class).
HEADER: Final = struct.Struct("<QQQQIIBB")
HEADER_SIZE: Final = HEADER.size
_SYNC: Final = struct.Struct("<Q")
#: op bits: the item's value is ``None`` (a tombstone without a body), not ``b""``
NO_VALUE: Final = 0x80
#: op bits: an 8-byte sync-write field follows the header (commits and aborts; never on the ingest path)
HAS_SYNC: Final = 0x40

_pack = HEADER.pack
_unpack = HEADER.unpack_from
_OPS: Final = {int(op): op for op in Op}


def pack(item: Item) -> bytes:
    """``item``'s stored value (the key and the vbucket are the table's)."""
    v = item.value
    bits = int(item.op) | (NO_VALUE if v is None else 0)
    sync = item.sync
    head = _pack(item.seqno, item.cas, item.rev_seqno, item.prev_seqno, item.flags, item.expiry, item.datatype,
                 bits | (HAS_SYNC if sync else 0))
    if sync:
        head += _SYNC.pack(sync)
    return head + v if v is not None else head


def pack_mutation(value: bytes, seqno: int, cas: int, rev: int, prev: int, flags: int, expiry: int,
                  datatype: int) -> bytes:
    """The stored value of a plain mutation (a front-end set: no sync write)."""
    return _pack(seqno, cas, rev, prev, flags, expiry, datatype, 0) + value


def unpack(key: bytes, stored: bytes, vbucket: int) -> Item:
    """The :class:`Item` a stored value of ``key`` in ``vbucket`` holds."""
    seqno, cas, rev, prev, flags, expiry, datatype, bits = _unpack(stored)
    at = HEADER_SIZE
    sync = 0
    if bits & HAS_SYNC:
        sync = _SYNC.unpack_from(stored, at)[0]
        at += 8
    value = None if bits & NO_VALUE else stored[at:]
    it = Item(key, value, vbucket, seqno, rev, cas, flags, expiry, datatype, _OPS[bits & 0x3F], prev)
    if sync:
        it.sync = sync
    return it


def meta(stored: bytes) -> tuple[int, int, int, int, int, int, int, int]:
    """The header of a stored value: seqno, cas, rev seqno, prev seqno, flags, expiry, datatype, op bits."""
    return _unpack(stored)


def value_size(stored: bytes) -> int:
    """The value bytes of a stored value (what checkpoint memory charges besides the key and the overhead)."""
    return len(stored) - HEADER_SIZE - (8 if stored[HEADER_SIZE - 1] & HAS_SYNC else 0)


class HashTable:
    """One vbucket's documents: key -> current version (kv_engine ``HashTable``), mutations and tombstones.

    ``raw`` maps a key to its :class:`Item` while a checkpoint still queues it, else to its packed stored value
    (:func:`pack`). Every read through this class returns an :class:`Item` (a new one for a packed value: compare
    items with ``==``, not ``is``).
    """

    __slots__ = ("raw", "vbucket")

    def __init__(self, vbucket: int) -> None:
        self.vbucket = vbucket
        self.raw: dict[bytes, Item | bytes] = {}

    def _item(self, key: bytes, v: Item | bytes) -> Item:
        return unpack(key, v, self.vbucket) if isinstance(v, bytes) else v

    def get(self, key: bytes, default: Item | None = None) -> Item | None:
        v = self.raw.get(key)
        if v is None:
            return default
        if isinstance(v, bytes):
            return unpack(key, v, self.vbucket)
        return v

    def __getitem__(self, key: bytes) -> Item:
        return self._item(key, self.raw[key])

    def __setitem__(self, key: bytes, item: Item) -> None:
        self.raw[key] = item

    def __delitem__(self, key: bytes) -> None:
        del self.raw[key]

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def __len__(self) -> int:
        return len(self.raw)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.raw)

    def keys(self) -> Iterable[bytes]:
        return self.raw.keys()

    def values(self) -> Iterator[Item]:
        vb = self.vbucket
        for k, v in self.raw.items():
            yield unpack(k, v, vb) if isinstance(v, bytes) else v

    def items(self) -> Iterator[tuple[bytes, Item]]:
        vb = self.vbucket
        for k, v in self.raw.items():
            yield k, (unpack(k, v, vb) if isinstance(v, bytes) else v)

    def pop(self, key: bytes, default: Item | None = None) -> Item | None:
        v = self.raw.pop(key, None)
        return default if v is None else self._item(key, v)

    def store_packed(self, item: Item) -> None:
        """Hold ``item`` as the current version of its key, packed (warmup and rollback load persisted
        versions that no checkpoint queues)."""
        self.raw[item.key] = pack(item)

    def expelled(self, items: Iterable[Item | bytes | None]) -> None:
        """The checkpoints dropped ``items`` (``None``: a de-duplicated hole; a stored value is the table's
        already): each item still its key's
        current version is packed, so the table alone holds it, in one object (kv_engine item expelling
        leaves the ``StoredValue``)."""
        raw = self.raw
        get = raw.get
        for it in items:
            if type(it) is Item and get(it.key) is it:
                raw[it.key] = pack(it)

    def __repr__(self) -> str:
        return f"HashTable(vb={self.vbucket} items={len(self.raw)})"


__all__ = ["HEADER", "HashTable", "meta", "pack", "pack_mutation", "unpack", "value_size"]
