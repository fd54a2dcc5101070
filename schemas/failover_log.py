"""Per-vbucket failover log (kv_engine ``FailoverTable``) and the rollback decision of a DCP stream request.

A failover log is a list of *partition versions* ``(vbuuid, seqno)``, newest first (docs/rollback.md
"The failover log").  An entry ``(u, s)`` says: "branch ``u`` shares the history of the
entry below it up to and including seqno ``s``; every seqno above ``s`` (up to the next newer entry) was
written on branch ``u``".  A vbuuid is random and never 0.

Rules implemented (kv_engine ``engines/ep/src/failover-table.cc``; docs/rollback.md "The failover log"):

* creation: one entry at seqno 0 (:meth:`FailoverLog.new`);
* ``createEntry(high)``: drop entries above ``high``, push a fresh uuid at ``high``, trim to the cap
  (:meth:`FailoverLog.create_entry`);
* after a rollback to ``s``: drop entries above ``s``; an emptied log gets a fresh entry at ``s``
  (:meth:`FailoverLog.prune_above`);
* loading (``sanitizeFailoverTable``): drop uuid-0 entries and entries whose seqno exceeds the newer
  (kept) entry's seqno; an emptied log gets a fresh entry at the high seqno (constructor, ``from_pairs``);
* a replica adopts the producer's whole log on every stream-request OK (:meth:`FailoverLog.replace`);
* ``needsRollback`` exactly, in kv_engine's order (:meth:`FailoverLog.needs_rollback`);
* the product's extension: a stream request that carries the client's *whole* failover log is answered
  from the newest common ancestor of both logs (the UPR design specification's algorithm, docs/rollback.md) followed by kv_engine's snapshot rules (:meth:`FailoverLog.rollback_point`).

See ``docs/rollback.md`` for the algorithms, the UPR specification's worked examples and where it and
kv_engine differ.  Everything here is synchronous and deterministic given the ``rng``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from schemas.errors import InvalidArgument

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "U64_MAX",
    "VBUUID_BITS",
    "FailoverEntry",
    "FailoverLog",
    "needs_rollback",
    "rollback_point",
    "sanitized",
    "stream_rollback",
]

#: Largest unsigned 64-bit value: vbuuids and seqnos are u64 on the wire.
U64_MAX = (1 << 64) - 1
#: kv_engine keeps 25 failover entries per vbucket (``max_failover_entries``).
DEFAULT_MAX_ENTRIES = 25
#: kv_engine ``FailoverTable::generateUuid`` takes ``random >> 16``: new vbuuids are 48-bit (exact in a
#: JSON double).  Any non-zero u64 is accepted from storage or from the wire.
VBUUID_BITS = 48


def _check_u64(name: str, value: object) -> int:
    """Return ``value`` if it is an int in [0, 2**64); raise :class:`InvalidArgument` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    if value < 0 or value > U64_MAX:
        raise InvalidArgument(f"{name} must be an unsigned 64-bit integer, got {value}")
    return value


def _check_max_entries(max_entries: object) -> int:
    if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
        raise InvalidArgument(f"max_entries must be an integer >= 1, got {max_entries!r}")
    return max_entries


@dataclass(frozen=True, slots=True)
class FailoverEntry:
    """One partition version: branch ``vbuuid`` took over the history at ``seqno``.

    ``vbuuid`` 0 is representable (a client with no log sends uuid 0, and a damaged stored log may hold
    it) but a :class:`FailoverLog` never keeps such an entry.
    """

    vbuuid: int  # random non-zero u64 (kv_engine generates 48-bit values)
    seqno: int

    def __post_init__(self) -> None:
        _check_u64("vbuuid", self.vbuuid)
        _check_u64("seqno", self.seqno)


def _sanitize(entries: Iterable[FailoverEntry]) -> list[FailoverEntry]:
    """kv_engine ``sanitizeFailoverTable``: walk newest -> oldest and drop (1) entries with vbuuid 0 and
    (2) entries whose seqno is greater than the seqno of the newer entry kept before them."""
    kept: list[FailoverEntry] = []
    for e in entries:
        if not isinstance(e, FailoverEntry):
            raise InvalidArgument(f"failover log entries must be FailoverEntry, got {e!r}")
        if e.vbuuid == 0:  # rule 1: uuid 0 is never valid
            continue
        if kept and e.seqno > kept[-1].seqno:  # rule 2: seqnos never grow towards the oldest entry
            continue
        kept.append(e)
    return kept


class FailoverLog:
    """A vbucket's failover table, newest entry first; never empty.

    ``rng`` draws new vbuuids. There is no default RNG: whoever creates entries passes one (the bucket passes
    its own, seeded from ``BucketConfig.seed`` or system randomness; docs/engine.md "Clocks and randomness").
    A log loaded without one (a consumer's copy of a server's log, read for the rollback rule) cannot create
    entries: :class:`InvalidArgument` when it would have to.
    """

    __slots__ = ("_entries", "_max_entries", "_rng", "vbuuid")

    #: the newest entry's vbuuid (:attr:`latest`'s), a plain attribute: every write's mutation token carries it,
    #: so the ingest path reads it without a property call. Kept by every method that changes the entries.
    vbuuid: int

    def __init__(
        self,
        entries: Sequence[FailoverEntry] = (),
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        rng: random.Random | None = None,
        high_seqno: int = 0,
    ) -> None:
        """Load ``entries`` (newest first) as kv_engine loads a stored table.

        Sanitised (uuid-0 entries and out-of-order entries dropped), then trimmed to the ``max_entries``
        newest.  If nothing is left, a fresh entry is created at ``high_seqno`` (kv_engine
        ``sanitizeFailoverTable(highSeqno)``), so ``FailoverLog()`` is a new vbucket's log.
        """
        self._max_entries = _check_max_entries(max_entries)
        self._rng = rng
        _check_u64("high_seqno", high_seqno)
        self._entries: list[FailoverEntry] = _sanitize(entries)[: self._max_entries]
        if not self._entries:
            self._entries.append(FailoverEntry(self._new_vbuuid(), high_seqno))
        self.vbuuid = self._entries[0].vbuuid

    # ------------------------------------------------------------------ construction
    @classmethod
    def new(cls, *, max_entries: int = DEFAULT_MAX_ENTRIES, rng: random.Random | None = None) -> FailoverLog:
        """The log of a newly created vbucket: one entry at seqno 0 (kv_engine ``FailoverTable(capacity)``)."""
        return cls((), max_entries=max_entries, rng=rng, high_seqno=0)

    @classmethod
    def from_pairs(
        cls,
        pairs: Iterable[Sequence[int]],
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        rng: random.Random | None = None,
        high_seqno: int = 0,
    ) -> FailoverLog:
        """Load a log stored as ``(vbuuid, seqno)`` pairs newest first (lists from JSON are accepted)."""
        entries: list[FailoverEntry] = []
        for p in pairs:
            if isinstance(p, (str, bytes)) or len(p) != 2:
                raise InvalidArgument(f"a failover pair must be (vbuuid, seqno), got {p!r}")
            entries.append(FailoverEntry(p[0], p[1]))
        return cls(entries, max_entries=max_entries, rng=rng, high_seqno=high_seqno)

    def to_pairs(self) -> list[tuple[int, int]]:
        """``(vbuuid, seqno)`` pairs newest first, for JSON / storage (inverse of :meth:`from_pairs`)."""
        return [(e.vbuuid, e.seqno) for e in self._entries]

    # ------------------------------------------------------------------ read access
    @property
    def entries(self) -> tuple[FailoverEntry, ...]:
        """All entries, newest first."""
        return tuple(self._entries)

    @property
    def latest(self) -> FailoverEntry:
        """The newest entry: its vbuuid is the vbucket's current vbuuid (mutation tokens carry it)."""
        return self._entries[0]

    @property
    def max_entries(self) -> int:
        return self._max_entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[FailoverEntry]:
        return iter(tuple(self._entries))

    def __eq__(self, other: object) -> bool:
        """Two logs are equal when they hold the same entries in the same order (cap and rng ignored)."""
        if not isinstance(other, FailoverLog):
            return NotImplemented
        return self._entries == other._entries

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        body = ", ".join(f"({e.vbuuid:#x}, {e.seqno})" for e in self._entries)
        return f"FailoverLog([{body}], max_entries={self._max_entries})"

    def vbuuid_at(self, seqno: int) -> int:
        """The vbuuid of the branch that wrote ``seqno``.

        An entry ``(u, s)`` marks "history up to and including ``s`` is shared with the older entry", so
        seqno ``x`` belongs to the newest entry whose seqno is *strictly below* ``x``; a seqno equal to an
        entry's seqno belongs to the older entry's branch.  Seqnos at or below the oldest entry's seqno
        (including 0) are attributed to the oldest entry: older history is no longer tracked.  Seqnos
        above the high seqno belong to the newest entry (they would be written on the current branch).
        """
        _check_u64("seqno", seqno)
        for e in self._entries:
            if e.seqno < seqno:
                return e.vbuuid
        return self._entries[-1].vbuuid

    # ------------------------------------------------------------------ mutation
    def _new_vbuuid(self) -> int:
        # kv_engine generateUuid: random >> 16, regenerated while 0 (uuid 0 marks damaged entries);
        # additionally never reuse a uuid already in this log, so a uuid names exactly one branch here.
        rng = self._rng
        if rng is None:
            raise InvalidArgument("this failover log has no rng to draw a vbuuid from: pass rng= to create "
                                  "entries")
        taken = {e.vbuuid for e in self._entries}
        while True:
            u = rng.getrandbits(VBUUID_BITS)
            if u != 0 and u not in taken:
                return u

    def _trim(self) -> None:
        # kv_engine: "Cap the size of the table" -- drop the oldest entries.
        del self._entries[self._max_entries :]

    def create_entry(self, high_seqno: int) -> FailoverEntry:
        """kv_engine ``createEntry(high)``: a new branch of history starts after ``high_seqno``.

        Entries above ``high_seqno`` are branches this vbucket has diverged from and are removed; the new
        entry (fresh non-zero vbuuid not already in the log, ``high_seqno``) is pushed at the front and the
        log is trimmed to ``max_entries``.
        """
        _check_u64("high_seqno", high_seqno)
        self._entries = [e for e in self._entries if e.seqno <= high_seqno]
        entry = FailoverEntry(self._new_vbuuid(), high_seqno)
        self._entries.insert(0, entry)
        self._trim()
        self.vbuuid = entry.vbuuid
        return entry

    def prune_above(self, seqno: int) -> None:
        """After the vbucket rolled back to ``seqno``: drop entries above it (kv_engine ``pruneEntries``).

        If that empties the log a fresh entry is pushed at ``seqno``.  kv_engine refuses ``seqno == 0``
        (a rollback to 0 resets the whole vbucket instead); here 0 is allowed and keeps entries at 0.
        """
        _check_u64("seqno", seqno)
        self._entries = [e for e in self._entries if e.seqno <= seqno]
        if not self._entries:
            self._entries.append(FailoverEntry(self._new_vbuuid(), seqno))
        self.vbuuid = self._entries[0].vbuuid

    def replace(self, entries: Sequence[FailoverEntry]) -> None:
        """A replica adopts the producer's log on stream-request OK (kv_engine ``replaceFailoverLog``).

        The producer's log is sanitised and trimmed like a loaded one; an empty (or all-uuid-0) log is
        rejected as kv_engine rejects a zero-length failover-log body.
        """
        kept = _sanitize(entries)[: self._max_entries]
        if not kept:
            raise InvalidArgument("cannot replace a failover log with an empty one")
        self._entries = kept
        self.vbuuid = kept[0].vbuuid

    # ------------------------------------------------------------------ rollback decisions
    def needs_rollback(
        self,
        start_seqno: int,
        high_seqno: int,
        vbuuid: int,
        snap_start: int,
        snap_end: int,
        purge_seqno: int,
        *,
        strict_vbuuid: bool = False,
    ) -> int | None:
        """kv_engine ``FailoverTable::needsRollback`` on this log: :func:`needs_rollback`."""
        return needs_rollback(
            log=self._entries, start_seqno=start_seqno, high_seqno=high_seqno, vbuuid=vbuuid,
            snap_start=snap_start, snap_end=snap_end, purge_seqno=purge_seqno, strict_vbuuid=strict_vbuuid)

    def stream_rollback(
        self,
        start_seqno: int,
        high_seqno: int,
        vbuuid: int,
        snap_start: int,
        snap_end: int,
        purge_seqno: int,
        *,
        client_log: Sequence[FailoverEntry] | None = None,
        strict_vbuuid: bool = False,
    ) -> int | None:
        """A stream request's rollback decision on this log: :func:`stream_rollback`."""
        return stream_rollback(
            log=self._entries, start_seqno=start_seqno, high_seqno=high_seqno, vbuuid=vbuuid,
            snap_start=snap_start, snap_end=snap_end, purge_seqno=purge_seqno, client_log=client_log,
            strict_vbuuid=strict_vbuuid)

    def rollback_point(
        self,
        start_seqno: int,
        high_seqno: int,
        client_log: Sequence[FailoverEntry],
        snap_start: int,
        snap_end: int,
        purge_seqno: int,
    ) -> int | None:
        """The product's rollback decision against this log: :func:`rollback_point` with ``server_log`` = it."""
        return rollback_point(
            server_log=self._entries, client_log=client_log, start_seqno=start_seqno, high_seqno=high_seqno,
            snap_start=snap_start, snap_end=snap_end, purge_seqno=purge_seqno)


def sanitized(entries: Iterable[FailoverEntry], *, max_entries: int = DEFAULT_MAX_ENTRIES) -> list[FailoverEntry]:
    """``entries`` (newest first) as a :class:`FailoverLog` keeps them: kv_engine ``sanitizeFailoverTable``
    (uuid-0 entries and out-of-order entries dropped), trimmed to the ``max_entries`` newest. Unlike the
    constructor it never invents an entry: an all-invalid log gives ``[]``."""
    return _sanitize(entries)[: _check_max_entries(max_entries)]


def stream_rollback(
    *,
    log: Sequence[FailoverEntry],
    start_seqno: int,
    high_seqno: int,
    vbuuid: int,
    snap_start: int,
    snap_end: int,
    purge_seqno: int,
    client_log: Sequence[FailoverEntry] | None = None,
    strict_vbuuid: bool = False,
) -> int | None:
    """The decision a stream request gets (engine/dcp/producer.py ``stream_request``; docs/rollback.md):
    with the client's whole failover log (``client_log``, newest first, not empty) the product's
    :func:`rollback_point`, else kv_engine's :func:`needs_rollback` on the request's ``vbuuid``. ``None``:
    stream; else the seqno to roll back to. The one place that chooses between the two, so a gateway asking
    "would the active stream from my position?" gets the answer the request would."""
    if client_log:
        return rollback_point(
            server_log=log, client_log=client_log, start_seqno=start_seqno, high_seqno=high_seqno,
            snap_start=snap_start, snap_end=snap_end, purge_seqno=purge_seqno)
    return needs_rollback(
        log=log, start_seqno=start_seqno, high_seqno=high_seqno, vbuuid=vbuuid, snap_start=snap_start,
        snap_end=snap_end, purge_seqno=purge_seqno, strict_vbuuid=strict_vbuuid)


def needs_rollback(
    *,
    log: Sequence[FailoverEntry],
    start_seqno: int,
    high_seqno: int,
    vbuuid: int,
    snap_start: int,
    snap_end: int,
    purge_seqno: int,
    strict_vbuuid: bool = False,
) -> int | None:
    """kv_engine ``FailoverTable::needsRollback`` exactly: ``None`` (stream) or the seqno to roll back to.

    ``log`` is the vbucket's failover log (newest first); ``start_seqno``/``vbuuid``/``snap_*`` come from
    the stream request, ``high_seqno`` and ``purge_seqno`` from the vbucket.  The stream request has already
    checked ``snap_start <= start_seqno <= snap_end``.
    """
    for name, v in (
        ("start_seqno", start_seqno),
        ("high_seqno", high_seqno),
        ("vbuuid", vbuuid),
        ("snap_start", snap_start),
        ("snap_end", snap_end),
        ("purge_seqno", purge_seqno),
    ):
        _check_u64(name, v)
    # 1. upper starts as the vbucket's high seqno.
    upper = high_seqno
    # 2. start 0: nothing to lose -- no rollback, unless STRICT_VBUUID asks to match a non-zero uuid.
    if start_seqno == 0 and (not strict_vbuuid or vbuuid == 0):
        return None
    # 3. purged tombstones above the client's start could be missed: rollback to 0.
    if start_seqno != 0 and start_seqno < purge_seqno:
        return 0
    # 4. find the client's uuid scanning oldest -> newest; a newer entry bounds the shared history.
    found = False
    for i in range(len(log) - 1, -1, -1):
        if log[i].vbuuid == vbuuid:
            found = True
            if i > 0:
                upper = log[i - 1].seqno
            break
    # 5. uuid unknown: no common history, rollback to 0 (so uuid 0 with start > 0 always gets 0).
    if not found:
        return 0
    return _snapshot_rules(start_seqno, upper, snap_start, snap_end)


def _newest_common_ancestor(
    server_log: Sequence[FailoverEntry], client_log: Sequence[FailoverEntry]
) -> tuple[int, int] | None:
    """(client index, server index) of the newest client entry also in ``server_log`` (same uuid and seqno)."""
    position: dict[tuple[int, int], int] = {}
    for i in range(len(server_log) - 1, -1, -1):  # newest index wins if a pair repeats
        position[(server_log[i].vbuuid, server_log[i].seqno)] = i
    for ci, ce in enumerate(client_log):
        si = position.get((ce.vbuuid, ce.seqno))
        if si is not None:
            return ci, si
    return None


def rollback_point(
    *,
    server_log: Sequence[FailoverEntry],
    client_log: Sequence[FailoverEntry],
    start_seqno: int,
    high_seqno: int,
    snap_start: int,
    snap_end: int,
    purge_seqno: int,
) -> int | None:
    """The product's rollback decision when the stream request carries the client's whole log: a pure
    function of the two logs and the request.

    ``server_log`` is the vbucket's log, ``client_log`` the client's, both newest first.  Steps:

    1. ``start_seqno == 0`` -> ``None`` (kv_engine step 2; the UPR specification's "first connect").
    2. ``start_seqno < purge_seqno`` -> 0 (kv_engine step 3).
    3. Newest common ancestor (UPR specification step 4, docs/rollback.md): the newest client entry that is also in ``server_log`` with
       the same vbuuid *and* seqno.  None -> 0 (its step 6, kv_engine step 5).
    4. Branch point ``upper`` (its steps 4-5): the lower of the server log's next newer entry's seqno (or
       ``high_seqno`` when the ancestor is the server log's newest entry -- kv_engine step 1/4) and the
       client's next newer entry's seqno (unbounded when the ancestor is the client's newest entry).
    5. kv_engine steps 6-9 on ``upper`` (snapshot adjustments, ``min(upper, snap_start)``).

    The UPR specification's elision of client entries above the last complete snapshot is not applied literally:
    step 5 already caps any rollback at the last complete snapshot (``snap_start`` of an incomplete
    snapshot), and dropping those entries would loosen the bound they put on the shared history
    (docs/rollback.md "Elision").  When the client's newest entry is in ``server_log`` the answer equals
    :func:`needs_rollback` with that entry's vbuuid.
    """
    for name, v in (
        ("start_seqno", start_seqno),
        ("high_seqno", high_seqno),
        ("snap_start", snap_start),
        ("snap_end", snap_end),
        ("purge_seqno", purge_seqno),
    ):
        _check_u64(name, v)
    for e in client_log:
        if not isinstance(e, FailoverEntry):
            raise InvalidArgument(f"client failover log entries must be FailoverEntry, got {e!r}")
    # kv_engine step 2 / seed "First connect": a client with nothing needs no rollback.
    if start_seqno == 0:
        return None
    # kv_engine step 3: purged tombstones above the client's start could be missed.
    if start_seqno < purge_seqno:
        return 0
    # Seed step 4: the newest common ancestor, scanning the client's log newest -> oldest.
    ancestor = _newest_common_ancestor(server_log, client_log)
    if ancestor is None:
        # Seed step 6 / kv_engine step 5: no common ancestor, rollback everything.
        return 0
    ci, si = ancestor
    # Seed step 4-5: the shared history ends at the lower of the two next-newer entries.  The server's
    # "sentinel" is its high seqno (kv_engine upper = high); the client's is unbounded here because its
    # last complete snapshot is applied by the snapshot rules below.
    server_bound = server_log[si - 1].seqno if si > 0 else high_seqno
    client_bound: float = client_log[ci - 1].seqno if ci > 0 else math.inf
    upper = server_bound if server_bound <= client_bound else int(client_bound)
    # kv_engine steps 6-9.
    return _snapshot_rules(start_seqno, upper, snap_start, snap_end)


def _snapshot_rules(start_seqno: int, upper: int, snap_start: int, snap_end: int) -> int | None:
    """kv_engine ``needsRollback`` steps 6-9, once ``upper`` (end of the shared history) is known."""
    # 6. start == snapStart: the client holds nothing of that snapshot, it is really at its start.
    if start_seqno == snap_start:
        snap_end = start_seqno
    # 7. the client's snapshot lies within the shared history: no rollback.
    if snap_end <= upper:
        return None
    # 8. start == snapEnd: the client holds the complete snapshot.
    if start_seqno == snap_end:
        snap_start = start_seqno
    # 9. roll back to the shared history, and no further than the start of a partial snapshot
    #    (de-duplication makes a partial snapshot inconsistent).
    return min(upper, snap_start)
