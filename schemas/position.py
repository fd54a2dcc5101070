"""The gateway's per-vbucket publishing position, and how it is recovered from Kafka itself.

Exactly once into Kafka without transactions (issue "Gateway", Delivery): every record says exactly where it
sits in its vbucket's history (headers ``dcp.seqno``, ``dcp.snap.*``, ``dcp.vbuuid``; failover-log and rollback
records carry the log), so the position after the last record *written* can be rebuilt by replaying the
partition tail. A compacted checkpoint topic, written only from delivery reports, bounds how much tail must be
replayed: it never covers an unacknowledged record, and the replay from ``offset + 1`` covers whatever was
acknowledged after it.

Position semantics follow the DCP client rules (dcp-reference.md) with one addition: ``boundary``, the end of
the last snapshot the gateway published *completely*. On ROLLBACK(s) the gateway restarts from the newest
boundary <= s, because the records it published between that boundary and s may not form a consistent state
on their own (seed 002: de-duplication inside a snapshot).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from typing import Any

from schemas.failover_log import FailoverEntry
from schemas.records import DecodedRecord, RecordType

#: how many recent snapshot boundaries are remembered per vbucket
MAX_BOUNDARIES = 512


@dataclass(slots=True)
class PublishPosition:
    """Where a vbucket's published record stream stands (after the last record)."""

    vbucket: int
    seqno: int = 0
    snap_start: int = 0
    snap_end: int = 0
    failover_log: list[FailoverEntry] = field(default_factory=list)
    #: the vbuuid data records are stamped with (newest failover entry at stream start)
    vbuuid: int = 0
    #: end of the last completely published snapshot
    boundary: int = 0
    #: Kafka offset of the last record this position covers (-1: none)
    offset: int = -1
    #: recent complete-snapshot ends, ascending (for rollbacks)
    boundaries: list[int] = field(default_factory=list)
    #: a rollback record was the last record: the stream must restart from ``seqno``
    pending_rollback: bool = False

    # ------------------------------------------------------------------ transitions
    def on_snapshot(self, start: int, end: int) -> None:
        if self.snap_end and start > self.snap_end and self.seqno < self.snap_end:
            # The previous snapshot's tail was filtered out: a new snapshot starting after it means it
            # completed.
            self._complete(self.snap_end)
        self.snap_start = start
        self.snap_end = end

    def on_data(self, seqno: int) -> None:
        self.seqno = seqno
        if seqno >= self.snap_end:
            self._complete(seqno)

    def on_failover_log(self, log: list[FailoverEntry]) -> None:
        self.failover_log = list(log)
        if log:
            self.vbuuid = log[0].vbuuid
        self.pending_rollback = False

    def on_rollback(self, seqno: int) -> int:
        """Apply a ROLLBACK(seqno): restart from the newest known boundary <= seqno. Returns it."""
        i = bisect.bisect_right(self.boundaries, seqno)
        b = self.boundaries[i - 1] if i else 0
        if self.boundary <= seqno:
            b = max(b, self.boundary)
        del self.boundaries[i:]
        self.seqno = self.snap_start = self.snap_end = self.boundary = b
        self.failover_log = [e for e in self.failover_log if e.seqno <= seqno]
        self.pending_rollback = True
        return b

    def _complete(self, end: int) -> None:
        self.seqno = max(self.seqno, end)
        self.boundary = end
        bs = self.boundaries
        if not bs or bs[-1] < end:
            bs.append(end)
            if len(bs) > MAX_BOUNDARIES:
                del bs[: len(bs) - MAX_BOUNDARIES]

    def complete_if_done(self) -> None:
        """The DCP stream delivered the whole current snapshot (its last item may have been filtered)."""
        if self.snap_end and self.seqno < self.snap_end:
            self._complete(self.snap_end)

    def apply(self, rec: DecodedRecord, offset: int) -> None:
        """Replay one record of this vbucket read back from Kafka."""
        t = rec.type
        if t is RecordType.SNAPSHOT:
            self.on_snapshot(rec.snap_start, rec.snap_end)
            self.vbuuid = rec.vbuuid or self.vbuuid
        elif t is RecordType.FAILOVER_LOG:
            self.on_failover_log(list(rec.failover_log or ()))
        elif t is RecordType.ROLLBACK:
            # Our own log, pruned above the rollback seqno, is what the re-request sends; the engine's new log
            # arrives with the failover-log record at stream OK.
            self.on_rollback(rec.seqno)
        elif t is RecordType.STREAM_END:
            pass
        else:
            self.vbuuid = rec.vbuuid
            self.on_data(rec.seqno)
        self.offset = offset

    # ------------------------------------------------------------------ stream request
    def request_args(self) -> dict[str, Any]:
        snap_start, snap_end = self.snap_start, self.snap_end
        if self.seqno < snap_start:
            # A snapshot marker was published but none of its items: the position holds nothing of that
            # snapshot, only the complete one before it (kv_engine needsRollback rule 6 reads start ==
            # snap_start the same way); the marker's range would make the request ERANGE.
            snap_start = snap_end = self.seqno
        return {
            "vbucket": self.vbucket,
            "start_seqno": self.seqno,
            "vbuuid": self.failover_log[0].vbuuid if self.failover_log else 0,
            "snap_start": snap_start,
            "snap_end": snap_end,
            "failover_log": list(self.failover_log) or None,
        }

    @property
    def is_fresh(self) -> bool:
        return self.offset < 0 and not self.failover_log and self.seqno == 0

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> bytes:
        return json.dumps(
            {
                "vbucket": self.vbucket,
                "seqno": self.seqno,
                "snap_start": self.snap_start,
                "snap_end": self.snap_end,
                "failover_log": [[e.vbuuid, e.seqno] for e in self.failover_log],
                "vbuuid": self.vbuuid,
                "boundary": self.boundary,
                "offset": self.offset,
                "boundaries": self.boundaries[-32:],
                "pending_rollback": self.pending_rollback,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> PublishPosition:
        d = json.loads(data)
        return cls(
            vbucket=int(d["vbucket"]),
            seqno=int(d["seqno"]),
            snap_start=int(d["snap_start"]),
            snap_end=int(d["snap_end"]),
            failover_log=[FailoverEntry(int(u), int(s)) for u, s in d["failover_log"]],
            vbuuid=int(d["vbuuid"]),
            boundary=int(d["boundary"]),
            offset=int(d["offset"]),
            boundaries=[int(x) for x in d.get("boundaries", [])],
            pending_rollback=bool(d.get("pending_rollback", False)),
        )

    def copy(self) -> PublishPosition:
        return PublishPosition(
            self.vbucket, self.seqno, self.snap_start, self.snap_end, list(self.failover_log), self.vbuuid,
            self.boundary, self.offset, list(self.boundaries), self.pending_rollback,
        )
