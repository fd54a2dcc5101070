"""Where a DCP client stands in one vbucket's history: the ONE position type of the contract.

A DCP client keeps per vbucket (docs/rollback.md, docs/record-format.md "What consumers must do"): the failover
log (replaced on every stream-request OK, newest first), the vbuuid of the branch its data belongs to, the last
seqno it holds and the last snapshot marker's range. It resumes with start = that seqno, vbuuid = the newest
failover entry, snapshot = the marker's range -- never collapsing a partial snapshot to ``{start, start}`` --,
and on ROLLBACK(s) it returns to a snapshot boundary <= s, prunes the failover entries above s and re-requests.

The position after the last item of a complete snapshot is ``seqno = snap_start = snap_end = that seqno``.

:class:`VBucketPosition` holds exactly that, with one serialization (:meth:`VBucketPosition.to_dict`: the
failover log as ``[[vbuuid, seqno], ...]`` newest first). The gateway's publishing position
(``gateway.resume.PublishPosition``) and the consumers' (``connectors.client.replay.ConsumerPosition``) extend
it with what only they need (the Kafka offset, the gateway's completed-snapshot boundaries); they do not
redefine it. :meth:`VBucketPosition.from_dict` also reads the forms persisted before this type existed
(the consumers' ``applied_seqno`` key, a position without ``vbuuid``), so stored state still loads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from schemas.failover_log import FailoverEntry

__all__ = ["VBucketPosition"]


@dataclass(slots=True)
class VBucketPosition:
    """Where a client stands in one vbucket's history (after the last item it holds)."""

    vbucket: int
    #: the branch the position's data belongs to (the newest failover entry's vbuuid when the stream started)
    vbuuid: int = 0
    #: the last seqno held
    seqno: int = 0
    #: the range of the last snapshot marker
    snap_start: int = 0
    snap_end: int = 0
    #: the vbucket's failover log, newest first
    failover_log: list[FailoverEntry] = field(default_factory=list)

    # ------------------------------------------------------------------ transitions
    def on_failover_log(self, log: Sequence[FailoverEntry]) -> None:
        """Stream-request OK (or a failover-log record): adopt the producer's ``log``; its newest vbuuid is the
        branch from now on."""
        self.failover_log = list(log)
        if log:
            self.vbuuid = log[0].vbuuid

    def on_snapshot(self, start: int, end: int) -> None:
        """A snapshot marker [start, end]."""
        self.snap_start = start
        self.snap_end = end

    def on_item(self, seqno: int) -> None:
        """An item (mutation, deletion, expiration) at ``seqno``."""
        self.seqno = seqno

    @property
    def in_complete_snapshot(self) -> bool:
        """True when every item of the last marker's snapshot has been received."""
        return self.seqno >= self.snap_end

    def complete_snapshot(self) -> None:
        """The client knows the current snapshot is complete (e.g. the next marker arrived): the position is
        that snapshot's end."""
        self.seqno = max(self.seqno, self.snap_end)
        self.snap_start = self.snap_end = self.seqno

    def rollback(self, seqno: int, boundary: int) -> None:
        """Apply ROLLBACK(``seqno``) given the client's restored snapshot ``boundary`` (<= seqno): the position
        is that boundary, and the failover entries above ``seqno`` are gone."""
        self.seqno = self.snap_start = self.snap_end = boundary
        self.failover_log = [e for e in self.failover_log if e.seqno <= seqno]

    # ------------------------------------------------------------------ stream request
    def request_args(self) -> dict[str, Any]:
        """Keyword arguments for ``DcpProducer.stream_request`` resuming from here."""
        snap_start, snap_end = self.snap_start, self.snap_end
        if self.seqno < snap_start:
            # A snapshot marker arrived but none of its items: the position holds nothing of that snapshot, only
            # the complete one before it (kv_engine needsRollback rule 6 reads start == snap_start the same
            # way); the marker's range would make the request ERANGE.
            snap_start = snap_end = self.seqno
        return {
            "vbucket": self.vbucket,
            "start_seqno": self.seqno,
            "vbuuid": self.failover_log[0].vbuuid if self.failover_log else 0,
            "snap_start": snap_start,
            "snap_end": snap_end,
            "failover_log": list(self.failover_log) or None,
        }

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        """The serialization: ``vbucket``, ``vbuuid``, ``seqno``, ``snap_start``, ``snap_end`` and
        ``failover_log`` as ``[[vbuuid, seqno], ...]`` newest first (extensions add their own keys)."""
        return {
            "vbucket": self.vbucket,
            "vbuuid": self.vbuuid,
            "seqno": self.seqno,
            "snap_start": self.snap_start,
            "snap_end": self.snap_end,
            "failover_log": [[e.vbuuid, e.seqno] for e in self.failover_log],
        }

    @staticmethod
    def fields_from(d: Mapping[str, Any]) -> dict[str, Any]:
        """The :class:`VBucketPosition` fields of a serialized position, as keyword arguments.

        Reads :meth:`to_dict`'s form and those persisted before it: the consumers' state (``applied_seqno``
        for ``seqno``) and positions without ``vbuuid`` (the newest failover entry's, else 0). Raises
        KeyError / ValueError / TypeError for a malformed one."""
        log = [FailoverEntry(int(u), int(s)) for u, s in d["failover_log"]]
        seqno = d["seqno"] if "seqno" in d else d["applied_seqno"]
        vbuuid = d.get("vbuuid")
        if vbuuid is None:
            vbuuid = log[0].vbuuid if log else 0
        return {
            "vbucket": int(d["vbucket"]),
            "vbuuid": int(vbuuid),
            "seqno": int(seqno),
            "snap_start": int(d["snap_start"]),
            "snap_end": int(d["snap_end"]),
            "failover_log": log,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        """The position :meth:`to_dict` serialized (or an earlier persisted form, see :meth:`fields_from`)."""
        return cls(**cls.fields_from(d))

    def to_json(self) -> bytes:
        """:meth:`to_dict` as compact JSON (the gateway's checkpoint records, the consumers' state rows)."""
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        return cls.from_dict(json.loads(data))

    def copy(self) -> Self:
        """An independent copy (the failover log is not shared)."""
        return self._copy_with()

    def _copy_with(self, *extra: Any) -> Self:
        return type(self)(self.vbucket, self.vbuuid, self.seqno, self.snap_start, self.snap_end,
                          list(self.failover_log), *extra)
