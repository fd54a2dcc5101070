"""Recovery of a failed-over node (ns_server's delta / full recovery) and rollback repair.

docs/cluster.md "Delta recovery" and "Rollback repair". The cluster manager (engine/cluster/local.py
``Cluster.recover``) puts a failed-over node back into the map as a replica of the vbuckets it held at failover
(and as the active of a vbucket that lost every other copy). Each of those copies rejoins by the ordinary
replication stream request from its own position with its whole failover log (engine/dcp/replication.py): the
producer's rollback decision (``FailoverLog.rollback_point``) says what the new active's history does not share,
the copy rolls back only that and streams the difference.

Rollback repair is the UPR design's rule 5 of the rollback handling ("replica C repairs master and rolls back to
the common snapshot sequence"), which Couchbase Server never shipped: before such a copy rolls back from its
stream request answered ROLLBACK(s), each document version it holds above ``s`` whose key the active has not
changed above ``s`` is written to the active as a normal write (:meth:`engine.kv.vbucket.VBucket.restore_version`:
new seqno, new CAS, revision kept -- an ordinary mutation for every DCP client, the gateway's Kafka topic
included); every other one is superseded by the active's version. The rollback then drops the copy's own
versions and the stream brings back the active's. Prepares are never repaired (docs/durability.md decides them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum

from engine.exceptions import SyncWriteInProgress
from engine.kv.vbucket import VBucket

log = logging.getLogger(__name__)


class RecoveryMode(StrEnum):
    """ns_server's recovery types."""

    DELTA = "delta"
    FULL = "full"


@dataclass
class RepairCounts:
    """What the rollback repair of one vbucket copy did (docs/cluster.md "Rollback repair")."""

    #: document versions above the rollback point written to the active
    repaired: int = 0
    #: document versions above the rollback point whose key the active changed after it (the active's kept)
    superseded: int = 0
    #: document versions above the rollback point dropped without repair (``rollback_repair`` off)
    discarded: int = 0
    #: prepares above the rollback point (never repaired: the durability rules decide them)
    prepares: int = 0

    def add(self, c: RepairCounts) -> None:
        self.repaired += c.repaired
        self.superseded += c.superseded
        self.discarded += c.discarded
        self.prepares += c.prepares


def repair_before_rollback(active: VBucket, copy: VBucket, since: int, *, repair: bool = True) -> RepairCounts:
    """Rollback repair of ``copy`` (a recovering replica copy about to roll back from ROLLBACK(``since``))
    against ``active`` (the vbucket's active copy). Every document version of ``copy`` with a seqno above
    ``since`` -- a mutation, deletion or expiration -- is written to ``active`` unless ``active`` changed the
    key above ``since`` (a document, tombstone or prepare with a higher seqno). With ``repair`` False only the
    counts are taken (the versions are discarded by the rollback, as without repair). When ``active`` purged
    tombstones above ``since`` it cannot tell which keys it changed, and nothing is repaired (superseded)."""
    counts = RepairCounts()
    counts.prepares = sum(1 for p in copy.prepares.values() if p.seqno > since)
    at_risk = sorted((it for it in copy.ht.values() if it.seqno > since), key=lambda it: it.seqno)
    if not repair:
        counts.discarded = len(at_risk)
        return counts
    blind = active.purge_seqno > since
    for it in at_risk:
        p = active.prepares.get(it.key)
        cur = active.ht.get(it.key)
        if blind or (p is not None and p.seqno > since) or (cur is not None and cur.seqno > since):
            counts.superseded += 1
            continue
        try:
            active.restore_version(it, since)
        except SyncWriteInProgress:  # a prepare from before the branch point holds the key: the active decides
            counts.superseded += 1
            continue
        counts.repaired += 1  # written, or a deletion of a key the active does not hold (already absent)
    return counts


@dataclass
class RecoveryReport:
    """What ``Cluster.recover`` did (the admin API's answer, docs/cluster.md "Delta recovery").

    The counts of the rollbacks and repairs grow while the node's copies make their stream requests: all of
    them happen inside ``recover`` when every active is up; a copy whose active is down is handled on a
    later pump (``pending``)."""

    node: str
    mode: str
    requested_mode: str
    revision: int
    #: vbuckets the node rejoined as a replica / as the active (it held the only copy)
    replicas: list[int] = field(default_factory=list)
    actives: list[int] = field(default_factory=list)
    #: vbuckets the node held at failover whose chain has no free slot any more (a rebalance refilled it)
    skipped: list[int] = field(default_factory=list)
    #: why the mode differs from the one asked for (the data directory is gone)
    message: str = ""
    rollback_repair: bool = True
    rollbacks: int = 0
    counts: RepairCounts = field(default_factory=RepairCounts)
    #: copies whose stream request has not happened yet (their active is down)
    pending: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, c: RepairCounts) -> None:
        self.counts.add(c)

    def to_json(self) -> dict[str, object]:
        return {
            "node": self.node, "mode": self.mode, "requested_mode": self.requested_mode, "message": self.message,
            "revision": self.revision, "replicas": list(self.replicas), "actives": list(self.actives),
            "skipped": list(self.skipped), "rollback_repair": self.rollback_repair, "rollbacks": self.rollbacks,
            "repaired": self.counts.repaired, "superseded": self.counts.superseded,
            "discarded": self.counts.discarded, "prepares": self.counts.prepares, "pending": sorted(self.pending),
            "seconds": round(self.seconds, 6), "rebalance_needed": True,
        }


@dataclass
class RecoveringCopy:
    """A vbucket copy of a recovering node until its first stream request succeeds."""

    report: RecoveryReport


__all__ = ["RecoveringCopy", "RecoveryMode", "RecoveryReport", "RepairCounts", "repair_before_rollback"]
