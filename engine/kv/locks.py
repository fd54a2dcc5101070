"""Document locks (kv_engine ``GET_LOCKED`` / ``UNLOCK_KEY``, docs/kv-protocol.md "Locks").

A lock lives in memory only, on the active vbucket (``VBucket.locks``: key -> (lock CAS, deadline)); it is not
persisted, not replicated and not a mutation (no seqno, nothing in DCP), as in kv_engine. While a document is
locked:

* a read answers its value with CAS ``0xffff_ffff_ffff_ffff`` (the lock CAS is only handed to the locker);
* a write (set / replace / append / counter / delete / touch, plain or durable) succeeds only with the lock's
  CAS, and then unlocks; without it: LOCKED (:class:`~engine.exceptions.DocumentLocked`);
* ``GET_LOCKED`` again: LOCKED; ``UNLOCK`` with the lock's CAS unlocks, with another CAS: LOCKED, of a document
  not locked (or whose lock expired): NOT_LOCKED.

Difference from kv_engine: kv_engine gives the document itself the lock CAS; here the document keeps its CAS
and the lock CAS stands for it while the lock holds (an unlock without a write leaves the old CAS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from engine.exceptions import DocumentLocked, InvalidArgument, KeyNotFound, NotLocked, SyncWriteInProgress

if TYPE_CHECKING:
    from engine.kv.vbucket import GetResult, VBucket

#: kv_engine defaults: a lock without a time (or above the maximum) lasts 15 s; the maximum is 30 s
DEFAULT_LOCK_S: Final = 15
MAX_LOCK_S: Final = 30
#: the CAS a read of a locked document answers with
LOCKED_CAS: Final = 0xFFFF_FFFF_FFFF_FFFF


def _current(vb: VBucket, key: bytes) -> tuple[int, float] | None:
    lk = vb.locks.get(key)
    if lk is not None and lk[1] <= vb.clock():
        del vb.locks[key]  # expired
        return None
    return lk


def check_lock(vb: VBucket, key: bytes, cas: int) -> int:
    """The CAS to compare with the document for a write of ``key`` carrying ``cas``: ``cas`` itself when the key
    is not locked, the document's own CAS when ``cas`` is the lock's; DocumentLocked otherwise. The caller drops
    the lock (:func:`release`) once its write succeeded."""
    lk = _current(vb, key)
    if lk is None:
        return cas
    if cas != lk[0]:
        raise DocumentLocked(f"key {key!r} is locked")
    live = vb.ht.get(key)
    return live.cas if live is not None else cas


def release(vb: VBucket, key: bytes) -> None:
    """A write of ``key`` succeeded: its lock (if any) is gone."""
    vb.locks.pop(key, None)


def locked(vb: VBucket, key: bytes) -> bool:
    return _current(vb, key) is not None


def lock_time(seconds: int) -> int:
    """kv_engine: 0 = the default lock time; above the maximum: the default."""
    if type(seconds) is not int or seconds < 0:
        raise InvalidArgument(f"invalid lock time {seconds!r}")
    if seconds == 0 or seconds > MAX_LOCK_S:
        return DEFAULT_LOCK_S
    return seconds


def get_locked(vb: VBucket, key: bytes, seconds: int) -> GetResult:
    """Read ``key`` and lock it for ``seconds`` (:func:`lock_time`); the result carries the lock CAS."""
    from dataclasses import replace

    vb.check_active()
    s = lock_time(seconds)
    if key in vb.prepares:
        raise SyncWriteInProgress(f"key {key!r} has a sync write in progress")
    g = vb.get(key)
    if _current(vb, key) is not None:
        raise DocumentLocked(f"key {key!r} is already locked")
    lock_cas = vb.next_cas()
    vb.locks[key] = (lock_cas, vb.clock() + s)
    return replace(g, cas=lock_cas)


def unlock(vb: VBucket, key: bytes, cas: int) -> None:
    """UNLOCK_KEY: KeyNotFound for a missing document, NotLocked when it is not locked, DocumentLocked for a
    CAS that is not the lock's."""
    vb.check_active()
    vb.get(key)  # KeyNotFound
    lk = _current(vb, key)
    if lk is None:
        raise NotLocked(f"key {key!r} is not locked")
    if cas != lk[0]:
        raise DocumentLocked(f"key {key!r}: cas {cas} is not the lock's")
    del vb.locks[key]


def check_readable(vb: VBucket, key: bytes) -> None:
    """KeyNotFound unless ``key`` is live (used before a lock check so a missing key says so first)."""
    if vb.ht.get(key) is None:
        raise KeyNotFound(f"key {key!r} not found in vbucket {vb.id}")
