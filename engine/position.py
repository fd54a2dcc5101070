"""A DCP client's resume position for one vbucket (dcp-reference.md "Client rules").

Keep per vbucket: the failover log (replaced on every stream-request OK), the last received seqno and the last
snapshot marker's range. Resume with start = last seqno, vbuuid = newest failover entry, snapshot = the last
marker's range -- never collapse a partial snapshot to ``{start, start}``. On ROLLBACK(s): discard what is above
``s`` back to a snapshot boundary <= s, prune failover entries above s and re-request.

The position after the last item of a complete snapshot is ``start = snap_start = snap_end = that seqno``
(the state a bytewax-style partition snapshot stores: where to resume *after* the last item emitted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.failover_log import FailoverEntry


@dataclass(slots=True)
class StreamPosition:
    """Where a consumer stands in one vbucket's history."""

    vbucket: int
    seqno: int = 0
    snap_start: int = 0
    snap_end: int = 0
    failover_log: list[FailoverEntry] = field(default_factory=list)

    @property
    def vbuuid(self) -> int:
        return self.failover_log[0].vbuuid if self.failover_log else 0

    @property
    def in_complete_snapshot(self) -> bool:
        """True when every item of the last marker's snapshot has been received."""
        return self.seqno >= self.snap_end

    def request_args(self) -> dict[str, Any]:
        """Keyword arguments for ``DcpProducer.stream_request`` resuming from here."""
        return {
            "vbucket": self.vbucket,
            "start_seqno": self.seqno,
            "vbuuid": self.vbuuid,
            "snap_start": self.snap_start,
            "snap_end": self.snap_end,
            "failover_log": list(self.failover_log) or None,
        }

    def on_stream_ok(self, failover_log: Sequence[FailoverEntry]) -> None:
        self.failover_log = list(failover_log)

    def on_marker(self, start: int, end: int) -> None:
        self.snap_start = start
        self.snap_end = end

    def on_item(self, seqno: int) -> None:
        self.seqno = seqno

    def complete_snapshot(self) -> None:
        """The consumer knows the current snapshot is complete (e.g. the next marker arrived)."""
        self.seqno = max(self.seqno, self.snap_end)
        self.snap_start = self.snap_end = self.seqno

    def rollback(self, seqno: int, snapshot_boundary: int) -> None:
        """Apply ROLLBACK(seqno) given the consumer's restored snapshot boundary (<= seqno)."""
        self.seqno = self.snap_start = self.snap_end = snapshot_boundary
        log = [e for e in self.failover_log if e.seqno <= seqno]
        self.failover_log = log

    def to_dict(self) -> dict[str, Any]:
        return {
            "vbucket": self.vbucket,
            "seqno": self.seqno,
            "snap_start": self.snap_start,
            "snap_end": self.snap_end,
            "failover_log": [[e.vbuuid, e.seqno] for e in self.failover_log],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamPosition:
        return cls(
            int(d["vbucket"]),
            int(d["seqno"]),
            int(d["snap_start"]),
            int(d["snap_end"]),
            [FailoverEntry(int(u), int(s)) for u, s in d["failover_log"]],
        )
