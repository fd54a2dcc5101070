"""An in-process cluster of engine nodes with a cluster manager in ns_server's role.

Each :class:`Node` owns a :class:`~engine.bucket.Bucket` with its own data directory. The :class:`Cluster`
keeps the revisioned :class:`~engine.vbucket_map.VBucketMap`, sets every node's vbucket states from it (with
the partition-state CAS of seed 001), runs one replication connection per (active node -> replica node) pair
(:class:`~engine.replication.DcpConsumer`), routes front-end requests through the map, and performs hard and
graceful failover (seed 001 "How ns_server performs failover", dcp-reference.md "Failover table").

Synchronous and deterministic: nothing moves unless :meth:`Cluster.pump` is called. See docs/cluster.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.bucket import Bucket
from engine.config import BucketConfig
from engine.exceptions import (
    InvalidArgument,
    NotMyVBucket,
    StateCasMismatch,
    TemporaryFailure,
)
from engine.failover_log import FailoverEntry
from engine.producer import DcpProducer
from engine.replication import DcpConsumer
from engine.vbucket import GetResult, MutationResult, MutationToken, VBucketState, vbucket_of
from engine.vbucket_map import VBucketMap

MAP_FILE = "vbucket_map.json"


@dataclass
class Node:
    """One engine node: a name and its bucket (``None`` while the node is down)."""

    name: str
    config: BucketConfig
    bucket: Bucket | None = None

    @property
    def up(self) -> bool:
        return self.bucket is not None and not self.bucket.closed

    def require_bucket(self) -> Bucket:
        if self.bucket is None or self.bucket.closed:
            raise TemporaryFailure(f"node {self.name} is down")
        return self.bucket


@dataclass(frozen=True)
class ObserveResult:
    """Answer of observe-by-seqno (kv_engine OBSERVE_SEQNO; seed 001 "How front end clients ensure
    mutations are persisted / replicated").

    ``replicated_seqnos[node]`` is the end of the last complete snapshot the replica received on the active's
    current history (seed 001: wait for "a complete snapshot ... where the high snapshot sequence # is >=
    the client's"), ``replica_persisted_seqnos[node]`` the same once persisted. When the client's vbuuid is
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


class Cluster:
    """The cluster manager (ns_server's role) over in-process nodes."""

    def __init__(self, base_dir: Path, nodes: dict[str, Node], vbmap: VBucketMap) -> None:
        self.base_dir = base_dir
        self.nodes = nodes
        self._map = vbmap
        self._conns: dict[tuple[str, str], DcpConsumer] = {}
        #: the partition-state CAS the manager last saw per (node, vbucket) (seed 001 step 4)
        self._state_cas: dict[tuple[str, int], int] = {}
        #: vbuckets whose front-end writes are stopped (graceful failover in progress)
        self._blocked: set[int] = set()
        self.failed: list[str] = []
        self.stale_cas_retries = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls, base_dir: Path | str, nodes: int = 3, replicas: int = 1, num_vbuckets: int = 64, *,
        seed: int | None = 0, **bucket_overrides: Any,
    ) -> Cluster:
        """Create ``nodes`` nodes under ``base_dir`` (one data directory each), a balanced map with
        ``replicas`` replicas (0..3) and every node's vbucket states set from it."""
        base = Path(base_dir)
        if type(nodes) is not int or nodes < 1:
            raise InvalidArgument(f"nodes must be >= 1, got {nodes!r}")
        names = [f"n{i}" for i in range(nodes)]
        vbmap = VBucketMap.generate(names, replicas, num_vbuckets)
        members: dict[str, Node] = {}
        for i, name in enumerate(names):
            opts: dict[str, Any] = {"tune_gc": False, "seed": None if seed is None else seed * 1000 + i}
            opts.update(bucket_overrides)
            cfg = BucketConfig(data_dir=base / name, num_vbuckets=num_vbuckets, **opts)
            members[name] = Node(name, cfg, Bucket(cfg))
        cluster = cls(base, members, vbmap)
        for name in names:
            cluster._apply_states(name)
        cluster._save_map()
        return cluster

    @classmethod
    def open(cls, base_dir: Path | str, **bucket_overrides: Any) -> Cluster:
        """Reopen a cluster created under ``base_dir``: the map from ``vbucket_map.json``, every node of the
        map warmed up from its data directory (after an unclean stop its actives get a failover entry) and
        the states set from the map. Nodes failed over earlier stay out."""
        base = Path(base_dir)
        try:
            vbmap = VBucketMap.from_json((base / MAP_FILE).read_text())
        except OSError as e:
            raise InvalidArgument(f"no cluster under {base}: {e}") from e
        members: dict[str, Node] = {}
        for name in vbmap.nodes:
            opts: dict[str, Any] = {"tune_gc": False}
            opts.update(bucket_overrides)
            cfg = BucketConfig(data_dir=base / name, num_vbuckets=vbmap.num_vbuckets, **opts)
            members[name] = Node(name, cfg, Bucket(cfg))
        cluster = cls(base, members, vbmap)
        for name in vbmap.nodes:
            cluster._apply_states(name)
        return cluster

    def _save_map(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        (self.base_dir / MAP_FILE).write_text(self._map.to_json())

    # ------------------------------------------------------------------ access
    def vbucket_map(self) -> VBucketMap:
        """The current map (clients reload it on NOT_MY_VBUCKET)."""
        return self._map

    def node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise InvalidArgument(f"unknown node {name!r}") from None

    @property
    def num_vbuckets(self) -> int:
        return self._map.num_vbuckets

    def vbucket_of(self, key: bytes | str) -> int:
        k = key.encode() if isinstance(key, str) else bytes(key)
        return vbucket_of(k, self._map.num_vbuckets)

    def active_bucket(self, vbucket: int) -> Bucket:
        """The bucket of ``vbucket``'s active node per the map (NotMyVBucket if it has none, TemporaryFailure
        if that node is down)."""
        if type(vbucket) is not int or not 0 <= vbucket < self._map.num_vbuckets:
            raise NotMyVBucket(f"unknown vbucket {vbucket!r}")
        name = self._map.active(vbucket)
        if name is None:
            raise NotMyVBucket(f"vbucket {vbucket} has no active copy")
        return self.nodes[name].require_bucket()

    # ------------------------------------------------------------------ partition states (seed 001 CAS)
    def _set_state(self, name: str, vbucket: int, state: VBucketState) -> None:
        """Send a state command with the CAS last seen; on a stale CAS record the current one and retry
        (seed 001 "How ns_server and ep-engine guarantee ordering of partition state transitions", 4-6)."""
        bucket = self.nodes[name].require_bucket()
        key = (name, vbucket)
        for _ in range(3):
            cas = self._state_cas.get(key)
            if cas is None:
                cas = bucket.state_cas(vbucket)  # step 2: discover the CAS
            try:
                self._state_cas[key] = bucket.set_vbucket_state(vbucket, state, cas=cas)
                return
            except StateCasMismatch as e:
                self.stale_cas_retries += 1
                self._state_cas[key] = e.current_cas
        raise TemporaryFailure(f"node {name}: vbucket {vbucket} state CAS keeps changing")

    def _promote(self, name: str, vbucket: int, *, takeover: bool) -> FailoverEntry | None:
        bucket = self.nodes[name].require_bucket()
        key = (name, vbucket)
        cas = self._state_cas.get(key)
        if cas != bucket.state_cas(vbucket):
            self.stale_cas_retries += cas is not None
            cas = bucket.state_cas(vbucket)
        entry = bucket.promote(vbucket, takeover=takeover, cas=cas)
        self._state_cas[key] = bucket.state_cas(vbucket)
        return entry

    def _apply_states(self, name: str) -> None:
        """Set every vbucket of node ``name`` to the state the map gives it (dead when not in the map)."""
        bucket = self.nodes[name].require_bucket()
        in_map = name in self._map.nodes
        for vb in range(self._map.num_vbuckets):
            chain = self._map.chains[vb]
            if in_map and chain[0] == name:
                want = VBucketState.ACTIVE
            elif in_map and name in chain[1:]:
                want = VBucketState.REPLICA
            else:
                want = VBucketState.DEAD
            if bucket.vbucket(vb).state is not want:
                self._set_state(name, vb, want)

    # ------------------------------------------------------------------ front end (routed by the map)
    def _route(self, key: bytes | str, write: bool) -> tuple[Bucket, int]:
        vb = self.vbucket_of(key)
        if write and vb in self._blocked:
            # kv_engine takeover: the front end gets a temporary failure while the vbucket moves.
            raise TemporaryFailure(f"vbucket {vb} is being failed over gracefully")
        return self.active_bucket(vb), vb

    def write(self, key: bytes | str, value: bytes | str, **kwargs: Any) -> MutationResult:
        """``set`` on the active node of the key's vbucket."""
        bucket, vb = self._route(key, True)
        return bucket.set(key, value, vbucket=vb, **kwargs)

    def get(self, key: bytes | str) -> GetResult:
        bucket, vb = self._route(key, False)
        return bucket.get(key, vbucket=vb)

    def delete(self, key: bytes | str, *, cas: int = 0) -> MutationResult:
        bucket, vb = self._route(key, True)
        return bucket.delete(key, cas=cas, vbucket=vb)

    # ------------------------------------------------------------------ replication
    def _wanted(self) -> dict[tuple[str, str], list[int]]:
        wanted: dict[tuple[str, str], list[int]] = {}
        for vb, chain in enumerate(self._map.chains):
            a = chain[0]
            if a is None or not self.nodes[a].up:
                continue
            for r in chain[1:]:
                if r is not None and self.nodes[r].up:
                    wanted.setdefault((a, r), []).append(vb)
        return wanted

    def _connect(self) -> None:
        """Wire one replication connection per (active node, replica node) with the streams of their
        vbuckets; re-request streams that ended (a replica re-streams from its own position and rolls back
        if it is ahead of the active)."""
        wanted = self._wanted()
        for key in sorted(set(self._conns) - set(wanted)):
            self._conns.pop(key).close()
        for key in sorted(wanted):
            src, dst = key
            conn = self._conns.get(key)
            if conn is not None and conn.closed:
                conn.close()
                conn = None
            if conn is None:
                producer: DcpProducer = self.nodes[src].require_bucket().dcp_producer(
                    f"replication:{src}->{dst}")
                conn = DcpConsumer(f"replication:{src}->{dst}", self.nodes[dst].require_bucket(), producer)
                self._conns[key] = conn
            vbs = set(wanted[key])
            for vb in sorted(set(conn.streams) - vbs):
                conn.close_stream(vb)
            for vb in sorted(vbs):
                if not conn.is_open(vb):
                    try:
                        conn.add_stream(vb)
                    except (NotMyVBucket, TemporaryFailure):
                        continue  # retried on the next pump

    def connections(self) -> list[tuple[str, str]]:
        """The (active node, replica node) pairs replicating now."""
        self._connect()
        return sorted(self._conns)

    def consumer(self, src: str, dst: str) -> DcpConsumer:
        self._connect()
        try:
            return self._conns[(src, dst)]
        except KeyError:
            raise InvalidArgument(f"no replication connection {src}->{dst}") from None

    def pump(
        self, rounds: int = 1, *, only: Iterable[tuple[str, str]] | None = None, flush: bool = True,
        max_messages: int = 4096,
    ) -> int:
        """Drive replication: ``rounds`` times step every connection (or those in ``only``) once and apply
        what it sent; then flush every live node. Returns messages moved. Deterministic (sorted order)."""
        self._connect()
        chosen = None if only is None else set(only)
        moved = 0
        for _ in range(rounds):
            n = 0
            for key in sorted(self._conns):
                if chosen is not None and key not in chosen:
                    continue
                n += self._conns[key].step(max_messages)
            moved += n
            if n == 0:
                break
        if flush:
            for name in sorted(self.nodes):
                node = self.nodes[name]
                if node.up:
                    assert node.bucket is not None
                    node.bucket.flush_all()
        return moved

    def settle(self, max_rounds: int = 100_000) -> int:
        """Pump until nothing moves (every live replica caught up with its live active, all flushed)."""
        total = 0
        for _ in range(max_rounds):
            n = self.pump(rounds=64)
            total += n
            if n == 0:
                return total
        raise TemporaryFailure("replication did not settle")

    # ------------------------------------------------------------------ node lifecycle
    def _drop_connections(self, name: str) -> None:
        for key in sorted(k for k in self._conns if name in k):
            self._conns.pop(key).close()

    def kill(self, name: str) -> None:
        """Crash node ``name``: ``bucket.close(clean=False)`` -- what it had not persisted is lost."""
        node = self.node(name)
        bucket = node.require_bucket()
        self._drop_connections(name)
        bucket.close(clean=False)
        node.bucket = None

    def restart(self, name: str) -> None:
        """Start a down node again (warmup; after a crash its actives get a failover entry) and set its
        vbucket states from the map -- with stale CASes, which the manager detects and retries."""
        node = self.node(name)
        if node.up:
            raise InvalidArgument(f"node {name} is already up")
        node.bucket = Bucket(node.config)
        self._apply_states(name)

    # ------------------------------------------------------------------ failover
    def _caught_up(self, vb: int) -> bool:
        active = self.active_bucket(vb).vbucket(vb)
        if active.persisted_seqno < active.high_seqno:
            return False
        for r in self._map.replicas(vb):
            node = self.nodes[r]
            if not node.up:
                continue
            assert node.bucket is not None
            rvb = node.bucket.vbucket(vb)
            if rvb.snapshot_persisted < active.high_seqno or rvb.high_seqno != active.high_seqno:
                return False
        return True

    def failover(self, name: str, *, graceful: bool = False, max_pump_rounds: int = 10_000) -> FailoverReport:
        """Fail node ``name`` over and remove it from the map.

        Hard (seed 001 "How ns_server performs failover"): each vbucket active on the node is promoted on the
        surviving replica with the highest last complete snapshot; kv_engine adds a failover entry there
        (items of a partial snapshot above it are rolled back first). Graceful: the node must be up; writes
        to its actives stop, replication is pumped until every live replica persisted the active's high
        seqno, the old active is set dead and the first live replica takes over with no failover entry
        (kv_engine takeover, as ns_server's graceful failover moves vbuckets). The other replicas re-stream
        from the new active and roll back if they were ahead. A node that is up gets all its vbuckets dead.
        """
        node = self.node(name)
        if name not in self._map.nodes:
            raise InvalidArgument(f"node {name} is not in the vbucket map (already failed over?)")
        mine = self._map.vbuckets_of(name, slot=0)
        rounds = 0
        if graceful:
            if not node.up:
                raise InvalidArgument(f"graceful failover needs node {name} up; use a hard failover")
            for vb in mine:
                if not any(self.nodes[r].up for r in self._map.replicas(vb)):
                    raise InvalidArgument(f"vbucket {vb} has no live replica: graceful failover impossible")
            self._blocked.update(mine)
            try:
                while not all(self._caught_up(vb) for vb in mine):
                    rounds += 1
                    if rounds > max_pump_rounds:
                        raise TemporaryFailure("replicas did not catch up for a graceful failover")
                    self.pump(rounds=16)
            except BaseException:
                self._blocked.difference_update(mine)
                raise
        if node.up:
            # The failed node stops serving: its active vbuckets become dead (their streams end with
            # STATE_CHANGED; in a takeover the replicas have everything already).
            for vb in mine:
                self._set_state(name, vb, VBucketState.DEAD)
        self._drop_connections(name)  # its replication streams stop before anything is promoted
        chains: list[list[str | None]] = [list(c) for c in self._map.chains]
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
                if r is None or not self.nodes[r].up:
                    continue
                rb = self.nodes[r].bucket
                assert rb is not None
                rvb = rb.vbucket(vb)
                if rvb.state is VBucketState.REPLICA:
                    candidates.append((rvb.snapshot_complete, -i, r))
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
        if node.up:
            self._apply_states(name)  # everything else on the ejected node becomes dead too
        self._drop_connections(name)
        self._save_map()
        self._connect()
        return FailoverReport(name, graceful, self._map.revision, promoted, entries, lost, rounds)

    # ------------------------------------------------------------------ observe (seed 001 durability polling)
    def observe_seqno(self, vbucket: int, vbuuid: int) -> ObserveResult:
        """Observe by seqno on the active of ``vbucket`` (NotMyVBucket / TemporaryFailure like a write).

        kv_engine OBSERVE_SEQNO: with the current vbuuid, the current and persisted seqnos; with an older
        one, ``failed_over`` and the last seqno of that branch still in the history. Per replica: the last
        complete snapshot received / persisted, bounded by where the replica's branch meets the active's.
        """
        bucket = self.active_bucket(vbucket)
        vb = bucket.vbucket(vbucket)
        if vb.state is not VBucketState.ACTIVE:
            raise NotMyVBucket(f"vbucket {vbucket} is {vb.state.value} on its mapped active node")
        entries = vb.failover.entries
        current = entries[0].vbuuid
        failed_over = vbuuid != current
        last: int | None = None
        if failed_over:
            last = _branch_end(entries, vbuuid, vb.high_seqno)
        replicated: dict[str, int] = {}
        persisted: dict[str, int] = {}
        for r in self._map.replicas(vbucket):
            rnode = self.nodes[r]
            if not rnode.up:
                continue
            assert rnode.bucket is not None
            rvb = rnode.bucket.vbucket(vbucket)
            if rvb.state is not VBucketState.REPLICA:
                continue
            bound = _branch_end(entries, rvb.failover.latest.vbuuid, vb.high_seqno)
            replicated[r] = min(rvb.snapshot_complete, bound)
            persisted[r] = min(rvb.snapshot_persisted, bound)
        return ObserveResult(
            vbucket, current, vb.high_seqno, vb.persisted_seqno, replicated, persisted, failed_over,
            vbuuid if failed_over else None, last)

    def is_replicated(self, token: MutationToken, replicas: int | None = None, persisted: bool = False) -> bool:
        """True when the write of ``token`` is still in the active's history and at least ``replicas``
        replicas (default: every replica slot of the chain) hold it in a complete snapshot -- persisted
        there and on the active when ``persisted``. Seed 001 "How front end clients ensure mutations are
        replicated or persisted on a replica"."""
        r = self.observe_seqno(token.vbucket, token.vbuuid)
        if r.failed_over and (r.last_seqno is None or token.seqno > r.last_seqno):
            return False
        if persisted and r.persisted_seqno < token.seqno:
            return False
        need = self._map.num_replicas if replicas is None else replicas
        seqnos = r.replica_persisted_seqnos if persisted else r.replicated_seqnos
        have = sum(1 for s in seqnos.values() if s >= token.seqno)
        return have >= need

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close every live node cleanly."""
        for key in sorted(self._conns):
            self._conns[key].close()
        self._conns.clear()
        for name in sorted(self.nodes):
            node = self.nodes[name]
            if node.up:
                assert node.bucket is not None
                node.bucket.close()
            node.bucket = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _branch_end(entries: tuple[FailoverEntry, ...], vbuuid: int, high: int) -> int:
    """The last seqno of branch ``vbuuid`` kept in the history ``entries`` (newest first): ``high`` for the
    current branch, the next newer entry's seqno for an older one, 0 for an unknown branch."""
    for i, e in enumerate(entries):
        if e.vbuuid == vbuuid:
            return high if i == 0 else entries[i - 1].seqno
    return 0


__all__ = ["Cluster", "FailoverReport", "Node", "ObserveResult"]
