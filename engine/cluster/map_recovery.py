"""Rebuilding a lost or damaged vbucket map from the nodes' own persisted vbucket states.

The map is written atomically (engine/kv/durable_file.py), so a crash never leaves it empty; but a map damaged some
other way (an older version's in-place rewrite, a disk error, an operator) must not make the cluster unusable
while every node's data is intact. Every node persists, per vbucket, its state (active / replica / pending /
dead), its failover log and its high seqno (engine/kv/storage.py ``vbstate``) -- what ns_server would learn from
the nodes' ``vbucket-details`` stats. From those:

* **active**: the copy a node holds active. Two nodes claiming one vbucket active (a node hard-failed-over while
  down keeps its old state on disk) are ordered by their failover logs: the copy whose log holds the other's
  newest entry below its own newest one was promoted after it and wins. Claims the logs do not order (a
  replica promoted before it ever received the active's history) go to the newer newest entry (higher
  seqno), then the higher high seqno, then the longer failover log, then the first node in name order. Two
  active copies exist only when a node was hard-failed-over while down (a takeover and a graceful failover
  set the old copy dead before the new one is active), so a node that loses a claim stays out of the map,
  with all its copies.
* **no active** (no node holds the vbucket active, e.g. a crash between a takeover's two state changes, or the
  active's node left out as failed over): the replica with the highest last complete snapshot is promoted, as
  a hard failover would
  (:meth:`engine.cluster.manager.ClusterManager.failover`); ties go to the first node in name order.
* **replicas**: every other node holding the vbucket as a replica, in node-name order, padded with empty slots
  to the replica count (the largest number of replicas found, or the caller's hint).
* **nodes**: every node holding at least one copy in the rebuilt chains, in natural name order (n2 < n10).

What cannot be recovered: the order of the replicas in a chain and of the nodes in the list, where the empty
slots of a failed-over node were, and nodes holding no copy. docs/cluster.md "Map recovery".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.cluster.vbucket_map import MAX_REPLICAS, VBucketMap
from engine.kv.data_dir import STORE_SUFFIX, cluster_node_dirs
from engine.kv.storage import Storage

__all__ = ["CopyState", "MapRebuild", "node_order", "read_node_states", "rebuild_map", "salvage_revision"]


@dataclass(frozen=True, slots=True)
class CopyState:
    """One node's persisted copy of one vbucket."""

    state: str
    #: failover log, newest first: ``(vbuuid, seqno)``
    failover: tuple[tuple[int, int], ...]
    high_seqno: int
    #: end of the last complete snapshot persisted (what a promotion keeps)
    snapshot_complete: int


NodeStates = Mapping[str, Mapping[int, CopyState]]


@dataclass
class MapRebuild:
    """The rebuilt map and what the rebuild had to decide."""

    vbmap: VBucketMap
    #: vbucket -> the replica promoted because no node held it active
    promoted: dict[int, str] = field(default_factory=dict)
    #: vbucket -> the nodes that claimed it active (more than one), winner first
    conflicts: dict[int, list[str]] = field(default_factory=dict)
    #: nodes left out: they lost an active claim to a promotion (failed over)
    failed_over: list[str] = field(default_factory=list)
    #: vbuckets no node holds at all
    lost: list[int] = field(default_factory=list)

    def summary(self) -> str:
        m = self.vbmap
        parts = [f"nodes {', '.join(m.nodes)}", f"{m.num_replicas} replica(s)", f"{m.num_vbuckets} vbuckets"]
        if self.promoted:
            parts.append(f"replicas promoted for vbuckets {sorted(self.promoted)}")
        if self.conflicts:
            parts.append(f"two active copies resolved for vbuckets {sorted(self.conflicts)}")
        if self.failed_over:
            parts.append(f"failed-over nodes left out: {', '.join(self.failed_over)}")
        if self.lost:
            parts.append(f"vbuckets without any copy: {self.lost}")
        return "; ".join(parts)


def node_order(name: str) -> tuple[object, ...]:
    """Natural order of node names (n2 before n10)."""
    return tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", name) if t)


def read_node_states(base_dir: Path | str, bucket: str, num_vbuckets: int | None = None) -> dict[str, dict[int, CopyState]]:
    """Every node directory under ``base_dir`` holding ``<bucket>.sqlite3``: its persisted vbucket states (read
    from the store directly; the node is not started)."""
    out: dict[str, dict[int, CopyState]] = {}
    for d in cluster_node_dirs(base_dir):
        path = d / f"{bucket}{STORE_SUFFIX}"
        if not path.is_file():
            continue
        store = Storage(path)
        try:
            copies: dict[int, CopyState] = {}
            for vb, rec in store.load_states().items():
                if num_vbuckets is not None and vb >= num_vbuckets:
                    continue
                partial = rec.state != "active" and rec.snap_start <= rec.high_seqno < rec.snap_end
                complete = store.snapshot_boundary(vb, rec.high_seqno) if partial else rec.high_seqno
                copies[vb] = CopyState(rec.state, tuple((int(u), int(s)) for u, s in rec.failover),
                                       rec.high_seqno, complete)
        finally:
            store.close()
        out[d.name] = copies
    return out


def _promoted_after(a: CopyState, b: CopyState) -> bool:
    """``a``'s history continues ``b``'s past a promotion: ``b``'s newest entry is in ``a``'s log below its
    newest one."""
    return bool(b.failover) and b.failover[0] in a.failover[1:]


def rebuild_map(states: NodeStates, num_vbuckets: int, *, replicas: int | None = None,
                revision: int = 1) -> MapRebuild:
    """The map the nodes' states describe (see the module doc). ``replicas``: the replica count to pad chains
    to when it is larger than what the copies show (capped by the node count and 3). Deterministic."""
    names = sorted(states, key=node_order)
    order = {n: i for i, n in enumerate(names)}
    claims = {vb: [n for n in names if (c := states[n].get(vb)) is not None and c.state == "active"]
              for vb in range(num_vbuckets)}
    # A node whose active copy another node's history continues past a promotion was failed over: all of it
    # stays out (its other copies are as stale).
    failed: set[str] = set()
    for vb, ns in claims.items():
        for a in ns:
            for b in ns:
                if a != b and _promoted_after(states[a][vb], states[b][vb]):
                    failed.add(b)
    # Two active copies exist only when a node was hard-failed-over while down (a takeover and a graceful
    # failover set the old copy dead first): every loser is such a node.
    conflicts: dict[int, list[str]] = {}
    for vb, ns in claims.items():
        if len(ns) > 1:
            # Not ordered by the logs: the newer newest entry, the higher high seqno, the longer history
            # (promotions and unclean restarts add entries), the first name.
            def rank(n: str, vb: int = vb) -> tuple[object, ...]:
                c = states[n][vb]
                return (n not in failed, c.failover[0][1] if c.failover else -1, c.high_seqno,
                        len(c.failover), -order[n])
            conflicts[vb] = sorted(ns, key=rank, reverse=True)
            failed.update(conflicts[vb][1:])
    winners: dict[int, str] = {}
    for vb, ns in claims.items():
        left = [n for n in conflicts.get(vb, ns) if n not in failed]
        if left:
            winners[vb] = left[0]
    live = [n for n in names if n not in failed]
    chains: list[list[str | None]] = []
    promoted: dict[int, str] = {}
    lost: list[int] = []
    width = 0
    for vb in range(num_vbuckets):
        active = winners.get(vb)
        if active in failed:
            active = None
        reps = [n for n in live if n != active and (c := states[n].get(vb)) is not None and c.state == "replica"]
        if active is None and reps:
            active = max(reps, key=lambda n: (states[n][vb].snapshot_complete, -order[n]))
            reps.remove(active)
            promoted[vb] = active
        if active is None and not reps:
            lost.append(vb)
        chain: list[str | None] = [active, *reps]
        chains.append(chain)
        width = max(width, len(reps))
    holders = sorted({n for ch in chains for n in ch if n is not None}, key=node_order)
    if not holders:
        holders = live[:1] or names[:1]
    want = max(width, min(replicas or 0, MAX_REPLICAS, max(len(holders) - 1, 0)))
    for ch in chains:
        ch.extend([None] * (want + 1 - len(ch)))
    vbmap = VBucketMap(revision=max(revision, 1), nodes=holders, chains=chains)
    return MapRebuild(vbmap, promoted, {vb: r for vb, r in conflicts.items()},
                      sorted(failed, key=node_order), lost)


def salvage_revision(damaged: bytes) -> int:
    """The revision of a damaged map file when its start survived (``{"revision":N,...``), else 0."""
    m = re.match(rb'\s*\{\s*"revision"\s*:\s*(\d+)', damaged)
    return int(m.group(1)) if m else 0
