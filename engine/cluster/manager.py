"""Cluster-manager rules shared by the in-process cluster (engine/cluster/local.py) and the cluster of node
processes (engine/network/process_cluster.py): ns_server's role.

:class:`ClusterManager` holds the revisioned vbucket map and implements, over any node that answers the
:class:`NodeControl` commands (an in-process :class:`~engine.bucket.Bucket` or a
:class:`~engine.network.remote.RemoteNode`):

* vbucket states from the map with the partition-state CAS (docs/cluster.md "Partition-state CAS": discover
  the CAS, send it with every command, on a mismatch record the current one and retry);
* which replication streams the map asks for (one connection per active node -> replica node);
* hard and graceful failover (docs/cluster.md "Hard failover", "Graceful failover"; kv_engine
  ``FailoverTable::createEntry`` on promotion);
* observe by seqno and "is this write replicated" (docs/cluster.md "Observe by seqno").

Subclasses provide the node access and the replication plumbing (the ``_`` hooks).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.cluster.recovery import RecoveryReport, RepairCounts
from engine.cluster.vbucket_map import VBucketMap
from engine.exceptions import (
    InvalidArgument,
    NotMyVBucket,
    StateCasMismatch,
    TemporaryFailure,
    UnknownCommand,
)
from engine.kv.vbucket import MutationToken, VBucketInfo, VBucketState
from schemas.failover_log import FailoverEntry

if TYPE_CHECKING:
    from engine.cluster.rebalance import Rebalance, RebalanceProgress


class NodeControl(Protocol):
    """The state commands a cluster manager sends a node (kv_engine SET_VBUCKET_STATE / GET_VBUCKET_STATE /
    ``stats vbucket-details``)."""

    def state_cas(self, vbucket: int) -> int: ...

    def set_vbucket_state(self, vbucket: int, state: VBucketState, *, cas: int | None = None) -> int: ...

    def promote(self, vbucket: int, *, takeover: bool = False, cas: int | None = None) -> FailoverEntry | None: ...

    def vbucket_info(self, vbucket: int) -> VBucketInfo: ...


@dataclass(frozen=True)
class ObserveResult:
    """Answer of observe-by-seqno (kv_engine OBSERVE_SEQNO; docs/cluster.md "Observe by seqno").

    ``replicated_seqnos[node]`` is the end of the last complete snapshot the replica received on the active's
    current history (a replica holds a write once it holds a complete snapshot ending at or above its seqno),
    ``replica_persisted_seqnos[node]`` the same once persisted. When the client's vbuuid is
    not the current one, ``failed_over`` is True, ``old_vbuuid`` is the client's vbuuid and ``last_seqno``
    the last seqno of that branch kept in the current history (kv_engine format 1; 0 when the branch is
    unknown): a write above it was lost -- "re-check the document".
    """

    vbucket: int
    vbuuid: int
    current_seqno: int
    persisted_seqno: int
    replicated_seqnos: dict[str, int] = field(default_factory=dict)
    replica_persisted_seqnos: dict[str, int] = field(default_factory=dict)
    failed_over: bool = False
    old_vbuuid: int | None = None
    last_seqno: int | None = None


@dataclass(frozen=True)
class FailoverReport:
    """What a failover did: new map revision, vbucket -> promoted node, entries created, vbuckets left
    without any copy."""

    node: str
    graceful: bool
    revision: int
    promoted: dict[int, str]
    entries: dict[int, FailoverEntry | None]
    lost: list[int]
    pump_rounds: int = 0


def branch_end(entries: Sequence[FailoverEntry], vbuuid: int, high: int) -> int:
    """The last seqno of branch ``vbuuid`` kept in the history ``entries`` (newest first): ``high`` for the
    current branch, the next newer entry's seqno for an older one, 0 for an unknown branch."""
    for i, e in enumerate(entries):
        if e.vbuuid == vbuuid:
            return high if i == 0 else entries[i - 1].seqno
    return 0


class ClusterManager(ABC):
    """ns_server's rules over the nodes a subclass reaches (see the module docstring)."""

    def __init__(self, vbmap: VBucketMap, *, monotonic: Callable[[], float]) -> None:
        self._map = vbmap
        #: the monotonic clock (seconds) of the manager's timeouts, chosen by whoever builds the cluster
        #: (docs/engine.md "Clocks and randomness")
        self._monotonic = monotonic
        #: the partition-state CAS the manager last saw per (node, vbucket) (docs/cluster.md "Partition-state CAS" step 4)
        self._state_cas: dict[tuple[str, int], int] = {}
        #: vbuckets whose front-end writes are stopped (graceful failover in progress)
        self._blocked: set[int] = set()
        self.failed: list[str] = []
        self.stale_cas_retries = 0
        #: vbuckets a graceful failover made active again because a write slipped in after the catch-up
        self.graceful_reactivations = 0
        #: vbucket -> nodes whose stream of it the rebalance mover drives (engine/cluster/rebalance.py), not the map
        self._moving: dict[int, set[str]] = {}
        #: vbucket -> its post-move chain while a rebalance moves it (kv_engine's second replication chain:
        #: a sync write then needs a majority of the map's chain and of this one; docs/durability.md "Sync writes during a rebalance")
        self._second_chains: dict[int, list[str | None]] = {}
        #: the rebalance in progress, if any
        self._rebalance: Rebalance | None = None
        #: node -> {vbucket: was it the active copy} held when the node was failed over (ns_server keeps the
        #: failed-over node's vbuckets for a delta recovery; docs/cluster.md "Delta recovery")
        self.failover_copies: dict[str, dict[int, bool]] = {}
        #: rollback repair of recovering copies (setting ``rollback_repair``; docs/cluster.md "Rollback repair")
        self.rollback_repair = True
        #: totals over every recovery (metrics): document versions repaired / superseded / discarded
        self.recovery_counts = RepairCounts()

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _is_up(self, name: str) -> bool: ...

    @abstractmethod
    def _control(self, name: str) -> NodeControl:
        """The node's state commands; TemporaryFailure when it is down."""

    @abstractmethod
    def _stop_replication(self, name: str) -> None:
        """Stop every replication stream from or to node ``name`` (before a promotion)."""

    @abstractmethod
    def _wait_progress(self) -> None:
        """Let replication move (graceful failover waits for the replicas to catch up)."""

    @abstractmethod
    def _after_failover(self, name: str) -> None:
        """Persist the new map and wire replication from it."""

    @abstractmethod
    def _wire(self) -> None:
        """Wire replication from the current map (and the rebalance mover's streams)."""

    @abstractmethod
    def _set_map(self, vbmap: VBucketMap) -> None:
        """Adopt and persist a new map revision."""

    @abstractmethod
    def _eject(self, name: str) -> None:
        """A node a rebalance removed: its vbuckets dead, the node stopped and forgotten."""

    def _abort_rebalance(self, reason: str) -> None:
        """Stop a running rebalance (ns_server stops a rebalance on failover): its moves go back to their
        original states."""
        if self._rebalance is not None:
            self._rebalance.abort(reason)

    # ------------------------------------------------------------------ rebalance (engine/cluster/rebalance.py)
    def start_rebalance(
        self, add: Sequence[str] = (), remove: Sequence[str] = (), *,
        progress: Callable[[RebalanceProgress], None] | None = None,
    ) -> Rebalance:
        """Start moving vbuckets to the map over the new node set (docs/rebalance.md); see :meth:`rebalance`."""
        raise UnknownCommand(f"{type(self).__name__}: rebalance is implemented for the in-process cluster")

    @property
    def rebalance_running(self) -> Rebalance | None:
        """The rebalance in progress, if any."""
        return self._rebalance

    # ------------------------------------------------------------------ the rebalance's cluster interface
    # engine.cluster.rebalance.RebalanceCluster: all the mover uses of the manager (docs/rebalance.md).
    def node_up(self, name: str) -> bool:
        return self._is_up(name)

    def node_control(self, name: str) -> NodeControl:
        return self._control(name)

    def set_vbucket_state(self, name: str, vbucket: int, state: VBucketState) -> None:
        """Set ``vbucket``'s state on node ``name`` with the partition-state CAS (:meth:`_set_state`)."""
        self._set_state(name, vbucket, state)

    def refresh_state_cas(self, name: str, vbucket: int) -> None:
        """Record the node's current partition-state CAS of ``vbucket`` (the node changed the state itself)."""
        self._state_cas[(name, vbucket)] = self._control(name).state_cas(vbucket)

    def commit_map(self, vbmap: VBucketMap) -> None:
        self._set_map(vbmap)

    def begin_move(self, vbucket: int, nodes: Iterable[str]) -> None:
        self._moving[vbucket] = set(nodes)

    def block_writes(self, vbucket: int) -> None:
        self._blocked.add(vbucket)

    def set_second_chain(self, vbucket: int, chain: Sequence[str | None]) -> None:
        self._second_chains[vbucket] = list(chain)

    def clear_second_chain(self, vbucket: int) -> None:
        self._second_chains.pop(vbucket, None)

    def end_move(self, vbucket: int) -> None:
        self._moving.pop(vbucket, None)
        self._blocked.discard(vbucket)
        self._second_chains.pop(vbucket, None)

    def rewire(self) -> None:
        self._wire()

    def eject_node(self, name: str) -> None:
        self._eject(name)

    def rebalance_ended(self, rebalance: Rebalance) -> None:
        if self._rebalance is rebalance:
            self._rebalance = None

    def monotonic_time(self) -> float:
        return self._monotonic()

    def _check_new_node(self, name: str) -> None:
        """``add_node``'s argument check: a valid node name (letters, digits, ``_.-``, at most 64) not in the
        map yet (:class:`InvalidArgument` otherwise)."""
        if type(name) is not str or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise InvalidArgument(f"invalid node name {name!r}")
        if name in self._map.nodes:
            raise InvalidArgument(f"node {name} is already in the cluster")

    def check_rebalance(self, add: Sequence[str], remove: Sequence[str]) -> None:
        """Would ``start_rebalance(add, remove)`` be refused? Raises what it would raise, does nothing else."""
        self._check_rebalance(add, remove)
        for n in add:
            self._check_new_node(n)

    def _check_rebalance(self, add: Sequence[str], remove: Sequence[str]) -> tuple[list[str], list[str]]:
        """Validate a rebalance request (InvalidArgument / TemporaryFailure, see ``start_rebalance``)."""
        if self._rebalance is not None:
            raise InvalidArgument("a rebalance is already running")
        add_l, remove_l = list(add), list(remove)
        for n in add_l + remove_l:
            if type(n) is not str or not n:
                raise InvalidArgument(f"invalid node name {n!r}")
        if len(set(add_l)) != len(add_l) or len(set(remove_l)) != len(remove_l) or set(add_l) & set(remove_l):
            raise InvalidArgument("a node is named twice in add / remove")
        for n in add_l:
            if n in self._map.nodes:
                raise InvalidArgument(f"node {n} is already in the cluster")
        for n in remove_l:
            if n not in self._map.nodes:
                raise InvalidArgument(f"unknown node {n!r}: not in the cluster")
        final = [n for n in self._map.nodes if n not in remove_l] + add_l
        if not final:
            raise InvalidArgument("cannot remove every node")
        if self._map.num_replicas >= len(final):
            raise InvalidArgument(
                f"{self._map.num_replicas} replicas need at least {self._map.num_replicas + 1} nodes")
        for n in self._map.nodes:
            if not self._is_up(n):
                raise TemporaryFailure(f"node {n} is down: fail it over before rebalancing")
        return add_l, remove_l

    def rebalance(
        self, add: Sequence[str] = (), remove: Sequence[str] = (), *,
        progress: Callable[[RebalanceProgress], None] | None = None, max_rounds: int = 1_000_000,
    ) -> RebalanceProgress:
        """Rebalance ``add`` in and ``remove`` out, moving vbuckets by DCP takeover while writes continue
        (docs/rebalance.md; engine/cluster/rebalance.py), and wait until it is done. ``progress`` is called after every step.
        TemporaryFailure when it stopped (a node went down, a takeover kept failing)."""
        reb = self.start_rebalance(add, remove, progress=progress)
        for _ in range(max_rounds):
            if reb.done:
                break
            self._wait_progress()
        else:
            reb.abort("did not finish")
        if reb.status != "done":
            raise TemporaryFailure(f"rebalance failed: {reb.error}")
        return reb.progress()

    # ------------------------------------------------------------------ recovery (engine/cluster/recovery.py)
    def _check_recover(self, name: str, mode: str) -> None:
        """``recover``'s argument checks (docs/cluster.md "Delta recovery" step 1)."""
        if mode not in ("delta", "full"):
            raise InvalidArgument(f"recovery mode must be 'delta' or 'full', got {mode!r}")
        if type(name) is not str or not name:
            raise InvalidArgument(f"invalid node name {name!r}")
        if name in self._map.nodes:
            raise InvalidArgument(f"node {name} was never failed over: it is in the cluster")
        if name not in self.failed:
            if name in getattr(self, "ejected", ()):
                raise InvalidArgument(f"node {name} was removed by a rebalance, not failed over: add it back "
                                      f"with a rebalance")
            raise InvalidArgument(f"unknown node {name!r} (failed over: {', '.join(self.failed) or 'none'})")
        if self._rebalance is not None:
            raise InvalidArgument("a rebalance is running: recover the node after it")

    def _place_recovered(self, name: str, mode: str, requested: str, message: str) -> RecoveryReport:
        """Put recovered node ``name`` (up) back into the map (docs/cluster.md "Delta recovery" step 3): a
        replica in the empty slot of every chain it held at failover, the active of a chain left without a
        copy (delta only); revision + 1. Returns the report (counts still 0)."""
        held = dict(self.failover_copies.get(name, {}))
        if not held:
            # failed over before this manager ran (a rebuilt map): the vbuckets it holds data of
            node = self._control(name)
            held = {vb: False for vb in range(self._map.num_vbuckets) if node.vbucket_info(vb).high_seqno > 0}
        chains: list[list[str | None]] = [list(c) for c in self._map.chains]
        report = RecoveryReport(name, mode, requested, 0, message=message,
                                rollback_repair=self.rollback_repair and mode == "delta")
        for vb in sorted(held):
            chain = chains[vb]
            if chain[0] is None and mode == "delta":
                chain[0] = name
                report.actives.append(vb)
            elif chain[0] is not None and None in chain[1:]:
                chain[chain.index(None, 1)] = name
                report.replicas.append(vb)
            else:
                report.skipped.append(vb)
        self._set_map(self._map.with_chains(chains, [*self._map.nodes, name]))
        self.failed.remove(name)
        self.failover_copies.pop(name, None)
        report.revision = self._map.revision
        return report

    # ------------------------------------------------------------------ map
    def vbucket_map(self) -> VBucketMap:
        """The current map (clients reload it on NOT_MY_VBUCKET)."""
        return self._map

    @property
    def num_vbuckets(self) -> int:
        return self._map.num_vbuckets

    def writes_blocked(self, vbucket: int) -> bool:
        """Whether front-end writes to ``vbucket`` are stopped now (a move's takeover, a graceful failover)."""
        return vbucket in self._blocked

    def _check_blocked(self, vbucket: int) -> None:
        if vbucket in self._blocked:
            # kv_engine takeover: the front end gets a temporary failure while the vbucket moves.
            raise TemporaryFailure(f"vbucket {vbucket} is being moved (graceful failover or rebalance takeover)")

    def wanted_streams(self, exclude: str | None = None) -> dict[tuple[str, str], list[int]]:
        """``(active node, replica node) -> vbuckets``: the replication connections the map asks for between
        live nodes (kv_engine names them ``replication:<src>-><dst>``), leaving out ``exclude``."""
        wanted: dict[tuple[str, str], list[int]] = {}
        for vb, chain in enumerate(self._map.chains):
            a = chain[0]
            if a is None or a == exclude or not self._is_up(a):
                continue
            moving = self._moving.get(vb, ())
            for r in chain[1:]:
                if r is not None and r != exclude and r not in moving and self._is_up(r):
                    wanted.setdefault((a, r), []).append(vb)
        return wanted

    def active_node(self, vbucket: int) -> str:
        """The node holding ``vbucket``'s active copy per the map (NotMyVBucket if it has none)."""
        if type(vbucket) is not int or not 0 <= vbucket < self._map.num_vbuckets:
            raise NotMyVBucket(f"unknown vbucket {vbucket!r}")
        name = self._map.active(vbucket)
        if name is None:
            raise NotMyVBucket(f"vbucket {vbucket} has no active copy")
        return name

    def _active_control(self, vbucket: int) -> NodeControl:
        return self._control(self.active_node(vbucket))

    # ------------------------------------------------------------------ partition states (state CAS)
    def _set_state(self, name: str, vbucket: int, state: VBucketState) -> None:
        """Send a state command with the CAS last seen; on a stale CAS record the current one and retry
        (docs/cluster.md "Partition-state CAS", steps 4-6)."""
        node = self._control(name)
        key = (name, vbucket)
        for _ in range(3):
            cas = self._state_cas.get(key)
            if cas is None:
                cas = node.state_cas(vbucket)  # step 2: discover the CAS
            try:
                self._state_cas[key] = node.set_vbucket_state(vbucket, state, cas=cas)
                return
            except StateCasMismatch as e:
                self.stale_cas_retries += 1
                self._state_cas[key] = e.current_cas
        raise TemporaryFailure(f"node {name}: vbucket {vbucket} state CAS keeps changing")

    def _promote(self, name: str, vbucket: int, *, takeover: bool) -> FailoverEntry | None:
        node = self._control(name)
        key = (name, vbucket)
        cas = self._state_cas.get(key)
        current = node.state_cas(vbucket)
        if cas != current:
            self.stale_cas_retries += cas is not None
            cas = current
        entry = node.promote(vbucket, takeover=takeover, cas=cas)
        self._state_cas[key] = node.state_cas(vbucket)
        return entry

    def _apply_states(self, name: str) -> None:
        """Set every vbucket of node ``name`` to the state the map gives it (dead when not in the map)."""
        node = self._control(name)
        in_map = name in self._map.nodes
        for vb in range(self._map.num_vbuckets):
            chain = self._map.chains[vb]
            if in_map and chain[0] == name:
                want = VBucketState.ACTIVE
            elif in_map and name in chain[1:]:
                want = VBucketState.REPLICA
            else:
                want = VBucketState.DEAD
            if node.vbucket_info(vb).state is not want:
                self._set_state(name, vb, want)

    # ------------------------------------------------------------------ failover
    def _caught_up(self, vb: int) -> bool:
        """The active persisted its high seqno and every live replica holds it, persisted, in a complete
        snapshot -- of the active's branch: a copy with as many items of a lost branch (a recovered node whose
        replication link has not rolled it back yet) has the same high seqno but not the active's newest
        failover entry, and is not caught up (the history, not the count, is what a replica must hold)."""
        active = self._active_control(vb).vbucket_info(vb)
        if active.persisted_seqno < active.high_seqno:
            return False
        for r in self._map.replicas(vb):
            if not self._is_up(r):
                continue
            ri = self._control(r).vbucket_info(vb)
            if (ri.snapshot_persisted < active.high_seqno or ri.high_seqno != active.high_seqno
                    or ri.failover[:1] != active.failover[:1]):
                return False
        return True

    def failover(self, name: str, *, graceful: bool = False, max_pump_rounds: int = 10_000) -> FailoverReport:
        """Fail node ``name`` over and remove it from the map.

        Hard (docs/cluster.md "Hard failover"): each vbucket active on the node is promoted on the
        surviving replica with the highest last complete snapshot; kv_engine adds a failover entry there
        (items of a partial snapshot above it are rolled back first). Graceful: the node must be up; writes
        to its actives stop, replication runs until every live replica persisted the active's high seqno,
        the old active is set dead and the first live replica takes over with no failover entry (kv_engine
        takeover, as ns_server's graceful failover moves vbuckets). The other replicas re-stream from the new
        active and roll back if they were ahead. A node that is up gets all its vbuckets dead.
        """
        if name not in self._map.nodes:
            raise InvalidArgument(f"node {name} is not in the vbucket map (already failed over?)")
        self._abort_rebalance(f"failover of {name}")  # its moves go back to their original states first
        mine = self._map.vbuckets_of(name, slot=0)
        rounds = 0
        if graceful:
            if not self._is_up(name):
                raise InvalidArgument(f"graceful failover needs node {name} up; use a hard failover")
            for vb in mine:
                if not any(self._is_up(r) for r in self._map.replicas(vb)):
                    raise InvalidArgument(f"vbucket {vb} has no live replica: graceful failover impossible")
            self._blocked.update(mine)
            try:
                pending = list(mine)
                while pending:
                    while not all(self._caught_up(vb) for vb in pending):
                        rounds += 1
                        if rounds > max_pump_rounds:
                            raise TemporaryFailure("replicas did not catch up for a graceful failover")
                        self._wait_progress()
                    # The node stops accepting writes (dead), then the manager checks that nothing slipped in
                    # since the replicas caught up: a write already on its way when the manager blocked the
                    # vbucket (possible with node processes) would be lost. Such a vbucket is made active again
                    # (no failover entry: dead -> active is not a promotion) so the replicas stream the rest --
                    # kv_engine's takeover drains the tail after marking the vbucket dead to the same effect.
                    for vb in pending:
                        self._set_state(name, vb, VBucketState.DEAD)
                    moved = [vb for vb in pending if not self._caught_up(vb)]
                    for vb in moved:
                        self._set_state(name, vb, VBucketState.ACTIVE)
                    self.graceful_reactivations += len(moved)
                    pending = moved
            except BaseException:
                self._blocked.difference_update(mine)
                if self._is_up(name):
                    for vb in mine:
                        self._set_state(name, vb, VBucketState.ACTIVE)
                raise
        if self._is_up(name):
            # The failed node stops serving: its active vbuckets become dead (their streams end with
            # STATE_CHANGED; in a takeover the replicas have everything already).
            for vb in mine:
                self._set_state(name, vb, VBucketState.DEAD)
        self._stop_replication(name)  # its replication streams stop before anything is promoted
        chains: list[list[str | None]] = [list(c) for c in self._map.chains]
        self.failover_copies[name] = {vb: c[0] == name for vb, c in enumerate(chains) if name in c}
        promoted: dict[int, str] = {}
        entries: dict[int, FailoverEntry | None] = {}
        lost: list[int] = []
        for vb, chain in enumerate(chains):
            if name not in chain:
                continue
            if chain[0] != name:
                chain[chain.index(name)] = None
                continue
            candidates = []
            for i, r in enumerate(chain[1:]):
                if r is None or not self._is_up(r):
                    continue
                info = self._control(r).vbucket_info(vb)
                if info.state is VBucketState.REPLICA:
                    candidates.append((info.snapshot_complete, -i, r))
            if not candidates:
                chain[0] = None
                lost.append(vb)
                continue
            best = max(candidates)[2]  # highest last complete snapshot; ties: first in the chain
            entries[vb] = self._promote(best, vb, takeover=graceful)
            promoted[vb] = best
            rest = [r for r in chain[1:] if r != best]
            chains[vb] = [best, *rest, None]
        self._map = self._map.with_chains(chains, [n for n in self._map.nodes if n != name])
        self.failed.append(name)
        self._blocked.difference_update(mine)
        if self._is_up(name):
            self._apply_states(name)  # everything else on the ejected node becomes dead too
        self._after_failover(name)
        return FailoverReport(name, graceful, self._map.revision, promoted, entries, lost, rounds)

    # ------------------------------------------------------------------ observe (docs/cluster.md "Observe by seqno")
    def observe_seqno(self, vbucket: int, vbuuid: int) -> ObserveResult:
        """Observe by seqno on the active of ``vbucket`` (NotMyVBucket / TemporaryFailure like a write).

        kv_engine OBSERVE_SEQNO: with the current vbuuid, the current and persisted seqnos; with an older
        one, ``failed_over`` and the last seqno of that branch still in the history. Per replica: the last
        complete snapshot received / persisted, bounded by where the replica's branch meets the active's.
        """
        vb = self._active_control(vbucket).vbucket_info(vbucket)
        if vb.state is not VBucketState.ACTIVE:
            raise NotMyVBucket(f"vbucket {vbucket} is {vb.state.value} on its mapped active node")
        entries = [FailoverEntry(u, s) for u, s in vb.failover]
        current = entries[0].vbuuid
        failed_over = vbuuid != current
        last: int | None = None
        if failed_over:
            last = branch_end(entries, vbuuid, vb.high_seqno)
        replicated: dict[str, int] = {}
        persisted: dict[str, int] = {}
        for r in self._map.replicas(vbucket):
            if not self._is_up(r):
                continue
            try:
                rvb = self._control(r).vbucket_info(vbucket)
            except TemporaryFailure:
                continue  # went down while we asked
            if rvb.state is not VBucketState.REPLICA:
                continue
            bound = branch_end(entries, rvb.vbuuid, vb.high_seqno)
            replicated[r] = min(rvb.snapshot_complete, bound)
            persisted[r] = min(rvb.snapshot_persisted, bound)
        return ObserveResult(
            vbucket, current, vb.high_seqno, vb.persisted_seqno, replicated, persisted, failed_over,
            vbuuid if failed_over else None, last)

    def is_replicated(self, token: MutationToken, replicas: int | None = None, persisted: bool = False) -> bool:
        """True when the write of ``token`` is still in the active's history and at least ``replicas``
        replicas (default: every replica slot of the chain) hold it in a complete snapshot -- persisted
        there and on the active when ``persisted`` (docs/cluster.md "Observe by seqno")."""
        r = self.observe_seqno(token.vbucket, token.vbuuid)
        if r.failed_over and (r.last_seqno is None or token.seqno > r.last_seqno):
            return False
        if persisted and r.persisted_seqno < token.seqno:
            return False
        need = self._map.num_replicas if replicas is None else replicas
        seqnos = r.replica_persisted_seqnos if persisted else r.replicated_seqnos
        have = sum(1 for s in seqnos.values() if s >= token.seqno)
        return have >= need


__all__ = ["ClusterManager", "FailoverReport", "NodeControl", "ObserveResult", "branch_end"]
