"""An in-process cluster of engine nodes with a cluster manager in ns_server's role.

Each :class:`Node` owns a :class:`~engine.bucket.Bucket` with its own data directory. The :class:`Cluster`
keeps the revisioned :class:`~engine.cluster.vbucket_map.VBucketMap`, sets every node's vbucket states from it (with
the partition-state CAS, docs/cluster.md "Partition-state CAS"), runs one replication connection per (active node -> replica node) pair
(:class:`~engine.dcp.replication.DcpConsumer`), routes front-end requests through the map, and performs hard and
graceful failover (docs/cluster.md "Hard failover", "Graceful failover").

Synchronous and deterministic: nothing moves unless :meth:`Cluster.pump` is called. See docs/cluster.md.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from engine.bucket import Bucket
from engine.cluster.manager import ClusterManager, FailoverReport, ObserveResult
from engine.cluster.map_recovery import MapRebuild, read_node_states, rebuild_map, salvage_revision
from engine.cluster.rebalance import Rebalance, RebalanceProgress
from engine.cluster.recovery import RecoveringCopy, RecoveryReport, repair_before_rollback
from engine.cluster.vbucket_map import VBucketMap
from engine.config import BucketConfig
from engine.dcp.producer import DcpProducer
from engine.dcp.replication import DcpConsumer
from engine.exceptions import (
    InvalidArgument,
    NotMyVBucket,
    TemporaryFailure,
)
from engine.kv.conflict_resolution import ItemMeta
from engine.kv.data_dir import MAP_FILE, STORE_SUFFIX
from engine.kv.durability import Durability, ManualClock, SyncWrite
from engine.kv.durable_file import write_atomically
from engine.kv.vbucket import GetResult, MutationResult, vbucket_of

log = logging.getLogger(__name__)


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


class Cluster(ClusterManager):
    """The cluster manager (ns_server's role) over in-process nodes; the failover, observe and
    partition-state rules are :class:`engine.cluster.manager.ClusterManager`'s."""

    def __init__(
        self, base_dir: Path, nodes: dict[str, Node], vbmap: VBucketMap, *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(vbmap, monotonic=monotonic)
        self.base_dir = base_dir
        self.nodes = nodes
        self._conns: dict[tuple[str, str], DcpConsumer] = {}
        #: nodes a rebalance removed from the cluster
        self.ejected: list[str] = []
        #: every node's bucket clock (durability timeouts, docs/durability.md); a ManualClock makes them deterministic
        self.clock: Callable[[], float] = time.time
        #: (node, vbucket) -> a copy of a recovering node until its first stream request succeeds
        self._recovering: dict[tuple[str, int], RecoveringCopy] = {}
        #: node -> (requested mode, mode, message) between prepare_recovery and recover
        self._recovery_prep: dict[str, tuple[str, str, str]] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls, base_dir: Path | str, nodes: int = 3, replicas: int = 1, num_vbuckets: int = 64, *,
        seed: int | None = 0, clock: Callable[[], float] | None = None,
        monotonic: Callable[[], float] | None = None, **bucket_overrides: Any,
    ) -> Cluster:
        """Create ``nodes`` nodes under ``base_dir`` (one data directory each), a balanced map with
        ``replicas`` replicas (0..3) and every node's vbucket states set from it. ``seed`` seeds every node's
        vbuuids, ``clock`` (seconds, default the wall clock) drives the nodes' CAS values, expiry and
        durability timeouts, ``monotonic`` the manager's timeouts (docs/engine.md "Clocks and randomness")."""
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
            members[name] = Node(name, cfg, Bucket(cfg, clock=clock or time.time))
        cluster = cls(base, members, vbmap, monotonic=monotonic or time.monotonic)
        cluster.clock = clock or time.time
        for name in names:
            cluster._apply_states(name)
        cluster._save_map()
        return cluster

    @classmethod
    def open(cls, base_dir: Path | str, *, replicas: int | None = None, **bucket_overrides: Any) -> Cluster:
        """Reopen a cluster created under ``base_dir``: the map from ``vbucket_map.json``, every node of the
        map warmed up from its data directory (after an unclean stop its actives get a failover entry) and
        the states set from the map. Nodes failed over earlier stay out.

        A map file that is missing (with node data present), empty or unreadable is rebuilt from the nodes'
        persisted vbucket states (engine/cluster/map_recovery.py; ``replicas``: the replica count when the copies show
        fewer), logged as a warning and saved; :class:`InvalidArgument` when there is neither
        a map nor node data."""
        base = Path(base_dir)
        path = base / MAP_FILE
        problem = ""
        vbmap: VBucketMap | None = None
        raw = b""
        try:
            raw = path.read_bytes()
            vbmap = VBucketMap.from_json(raw)
        except FileNotFoundError:
            problem = "missing"
        except OSError as e:
            raise InvalidArgument(f"cannot read the vbucket map {path}: {e}") from e
        except InvalidArgument:
            problem = "empty" if not raw.strip() else "damaged"
        rebuilt: MapRebuild | None = None
        if vbmap is None:
            name = str(bucket_overrides.get("name", BucketConfig.model_fields["name"].default))
            states = read_node_states(base, name)
            if not states:
                raise InvalidArgument(f"no cluster under {base}: the vbucket map is {problem} and no node holds "
                                      f"data of bucket {name!r}")
            nvb = 1 + max((vb for copies in states.values() for vb in copies), default=0)
            rebuilt = rebuild_map(states, nvb, replicas=replicas, revision=salvage_revision(raw) + 1)
            vbmap = rebuilt.vbmap
            log.warning("the vbucket map %s was %s: rebuilt from the nodes' vbucket states: %s", path, problem,
                        rebuilt.summary())
        members: dict[str, Node] = {}
        for name in vbmap.nodes:
            opts: dict[str, Any] = {"tune_gc": False}
            opts.update(bucket_overrides)
            cfg = BucketConfig(data_dir=base / name, num_vbuckets=vbmap.num_vbuckets, **opts)
            members[name] = Node(name, cfg, Bucket(cfg))
        cluster = cls(base, members, vbmap)
        for name in vbmap.nodes:
            cluster._apply_states(name)  # a replica the rebuild made active is promoted here (failover entry)
        if rebuilt is not None:
            cluster.failed.extend(rebuilt.failed_over)
            cluster._save_map()
        return cluster

    def _wire(self) -> None:
        self._connect()

    def _set_map(self, vbmap: VBucketMap) -> None:
        self._map = vbmap
        self._save_map()

    def _save_map(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.base_dir / MAP_FILE, self._map.to_json().encode())

    # ------------------------------------------------------------------ access
    def node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise InvalidArgument(f"unknown node {name!r}") from None

    def vbucket_of(self, key: bytes | str) -> int:
        k = key.encode() if isinstance(key, str) else bytes(key)
        return vbucket_of(k, self._map.num_vbuckets)

    def active_bucket(self, vbucket: int) -> Bucket:
        """The bucket of ``vbucket``'s active node per the map (NotMyVBucket if it has none, TemporaryFailure
        if that node is down)."""
        return self.nodes[self.active_node(vbucket)].require_bucket()

    # ------------------------------------------------------------------ ClusterManager hooks
    def _is_up(self, name: str) -> bool:
        return self.nodes[name].up

    def _control(self, name: str) -> Bucket:
        return self.nodes[name].require_bucket()

    def _stop_replication(self, name: str) -> None:
        self._drop_connections(name)

    def _wait_progress(self) -> None:
        self.pump(rounds=16)

    def _after_failover(self, name: str) -> None:
        self._drop_connections(name)
        self._save_map()
        self._connect()

    # ------------------------------------------------------------------ front end (routed by the map)
    def _route(self, key: bytes | str, write: bool) -> tuple[Bucket, int]:
        vb = self.vbucket_of(key)
        if write:
            self._check_blocked(vb)
        return self.active_bucket(vb), vb

    def write(
        self, key: bytes | str, value: bytes | str, *, durability: Durability | None = None, **kwargs: Any,
    ) -> MutationResult:
        """``set`` on the active node of the key's vbucket. With ``durability`` a sync write (docs/durability.md): the
        cluster is pumped until it is committed (the commit's result) or timed out / made ambiguous
        (:class:`~engine.exceptions.SyncWriteAmbiguous`) -- see :meth:`wait`."""
        if durability is not None and durability.level:
            return self.wait(self.submit(key, value, durability=durability, **kwargs))
        bucket, vb = self._route(key, True)
        res: MutationResult = bucket.set(key, value, vbucket=vb, **kwargs)
        return res

    def get(self, key: bytes | str) -> GetResult:
        bucket, vb = self._route(key, False)
        return bucket.get(key, vbucket=vb)

    def delete(self, key: bytes | str, *, cas: int = 0, durability: Durability | None = None) -> MutationResult:
        if durability is not None and durability.level:
            return self.wait(self.submit(key, None, cas=cas, durability=durability))
        bucket, vb = self._route(key, True)
        return bucket.delete(key, cas=cas, vbucket=vb)

    # ------------------------------------------------------------------ XDCR target (docs/xdcr.md "Target side")
    def get_meta(self, key: bytes | str) -> ItemMeta:
        bucket, vb = self._route(key, False)
        return bucket.get_meta(key, vbucket=vb)

    def set_with_meta(self, key: bytes | str, value: bytes | str, meta: ItemMeta, options: int = 0, *,
                      cas: int = 0) -> MutationResult:
        """SET_WITH_META on the active node of the key's vbucket (conflict resolution by that node's bucket)."""
        bucket, vb = self._route(key, True)
        return bucket.set_with_meta(key, value, meta, options, cas=cas, vbucket=vb)

    def add_with_meta(self, key: bytes | str, value: bytes | str, meta: ItemMeta, options: int = 0, *,
                      cas: int = 0) -> MutationResult:
        bucket, vb = self._route(key, True)
        return bucket.add_with_meta(key, value, meta, options, cas=cas, vbucket=vb)

    def del_with_meta(self, key: bytes | str, value: bytes | str | None, meta: ItemMeta, options: int = 0, *,
                      cas: int = 0) -> MutationResult:
        bucket, vb = self._route(key, True)
        return bucket.del_with_meta(key, value, meta, options, cas=cas, vbucket=vb)

    # ------------------------------------------------------------------ synchronous replication (docs/durability.md)
    def push_topologies(self) -> None:
        """Tell every live active its replication chain from the map (ns_server sends the topology with
        ``setVBucketState``); a no-op while neither the map nor the live buckets changed."""
        key = (self._map.revision, tuple((n, id(node.bucket)) for n, node in sorted(self.nodes.items())
                                         if node.up),
               tuple((vb, tuple(ch)) for vb, ch in sorted(self._second_chains.items())))
        if key == getattr(self, "_topology_key", None):
            return
        self._topology_key = key
        for vb, chain in enumerate(self._map.chains):
            a = chain[0]
            if a is None or not self.nodes[a].up:
                continue
            bucket = self.nodes[a].bucket
            assert bucket is not None
            if bucket.vbucket(vb).state.value == "active":
                second = self._second_chains.get(vb)
                bucket.set_replication_topology(vb, list(chain), None if second is None else list(second))

    def submit(
        self, key: bytes | str, value: bytes | str | None, *, durability: Durability, **kwargs: Any,
    ) -> SyncWrite:
        """Start a sync write (``value`` None: a durable delete) on the key's active node without pumping;
        returns its pending handle (poll ``done``, then ``result()``)."""
        if not durability.level:
            raise InvalidArgument("submit needs a durability level above none")
        bucket, vb = self._route(key, True)
        self.push_topologies()
        if value is None:
            sw = bucket.delete(key, vbucket=vb, durability=durability, **kwargs)
        else:
            sw = bucket.set(key, value, vbucket=vb, durability=durability, **kwargs)
        assert isinstance(sw, SyncWrite)
        return sw

    def wait(self, sw: SyncWrite, max_rounds: int = 100_000) -> MutationResult:
        """Pump until ``sw`` completes. When nothing moves any more and the cluster clock is a
        :class:`ManualClock`, the clock jumps to the write's deadline (deterministic timeouts); with the wall
        clock the pumping goes on until the deadline passes. Returns the commit's result or raises
        :class:`~engine.exceptions.SyncWriteAmbiguous`."""
        for _ in range(max_rounds):
            if sw.done:
                return sw.result()
            moved = self.pump(rounds=4)
            if sw.done:
                break
            if not moved and sw.deadline is not None and isinstance(self.clock, ManualClock):
                if self.clock() < sw.deadline:
                    self.clock.advance(sw.deadline - self.clock())
                self.process_durability_timeouts()
            elif not moved and sw.deadline is None:
                break  # infinite timeout and nothing moves: it cannot complete now
        return sw.result()

    def process_durability_timeouts(self) -> int:
        """Run the durability timeout task of every live node."""
        n = 0
        for name in sorted(self.nodes):
            node = self.nodes[name]
            if node.up:
                assert node.bucket is not None
                n += node.bucket.process_durability_timeouts()
        return n

    # ------------------------------------------------------------------ replication
    def _connect(self) -> None:
        """Wire one replication connection per (active node, replica node) with the streams of their
        vbuckets; re-request streams that ended (a replica re-streams from its own position and rolls back
        if it is ahead of the active)."""
        self.push_topologies()
        wanted = self.wanted_streams()
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
                conn = DcpConsumer(f"replication:{src}->{dst}", self.nodes[dst].require_bucket(), producer,
                                   consumer_name=dst)
                conn.rollback_handler = functools.partial(self._replica_rollback, src, dst)
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
                    rec = self._recovering.pop((dst, vb), None)
                    if rec is not None and vb in rec.report.pending:
                        rec.report.pending.remove(vb)

    def _replica_rollback(self, src: str, dst: str, vb: int, seqno: int) -> int:
        """A replication stream request of ``dst``'s copy of ``vb`` was answered ROLLBACK(``seqno``): a copy of a
        recovering node is repaired first (engine/cluster/recovery.py), then rolled back (a copy that was
        active at failover to exactly ``seqno``); any other copy just rolls back."""
        bucket = self.nodes[dst].require_bucket()
        rec = self._recovering.get((dst, vb))
        if rec is None:
            return bucket.rollback_vbucket(vb, seqno)
        active = self.nodes[src].require_bucket()
        counts = repair_before_rollback(active.vbucket(vb), bucket.vbucket(vb), seqno, repair=rec.report.rollback_repair)
        rec.report.add(counts)
        self.recovery_counts.add(counts)
        target = bucket.rollback_vbucket(vb, seqno)
        rec.report.rollbacks += 1
        log.info("recovery of %s: vbucket %d rolled back to %d (asked %d): %d repaired, %d superseded, "
                 "%d discarded, %d prepares not repaired", dst, vb, target, seqno, counts.repaired,
                 counts.superseded, counts.discarded, counts.prepares)
        return target

    # ------------------------------------------------------------------ recovery (engine/cluster/recovery.py)
    def prepare_recovery(self, name: str, mode: str = "delta") -> str:
        """The first half of :meth:`recover`: the checks, then the node's engine is closed when it must be
        reopened (a full recovery wipes its files; a data directory that is gone makes a delta recovery a full
        one). Returns the mode that will run. When the node is down afterwards, its engine may be opened off the
        caller's thread (:meth:`open_recovery_bucket`, as the gateway does) and handed to :meth:`recover`."""
        self._check_recover(name, mode)
        if name in self._recovery_prep:
            raise InvalidArgument(f"a recovery of node {name} is already starting")
        node = self.nodes.get(name)
        cfg = node.config if node is not None else self.node_config(name)
        store = Path(cfg.data_dir) / f"{cfg.name}{STORE_SUFFIX}"
        requested = mode
        message = ""
        if not store.exists():
            if mode == "delta":
                message = (f"the data directory of node {name} ({cfg.data_dir}) is gone: full recovery "
                           f"(every copy streamed from zero)")
                log.warning("recovery of %s: %s", name, message)
            mode = "full"
            if node is not None and node.up:
                assert node.bucket is not None
                node.bucket.close(clean=False)  # its files are gone: nothing to flush
                node.bucket = None
        elif mode == "full" and node is not None and node.up:
            assert node.bucket is not None
            node.bucket.close()
            node.bucket = None
        if mode == "full":
            for f in Path(cfg.data_dir).glob(f"{cfg.name}{STORE_SUFFIX}*"):
                f.unlink()  # full recovery: the node starts empty (ns_server wipes it)
        if node is None:
            self.nodes[name] = Node(name, cfg)
        self._recovery_prep[name] = (requested, mode, message)
        return mode

    def open_recovery_bucket(self, name: str) -> Bucket:
        """Open (warm up) the engine of node ``name`` prepared by :meth:`prepare_recovery`; touches nothing of
        the cluster, so it may run on another thread."""
        return Bucket(self.node(name).config, clock=self.clock)

    def abandon_recovery(self, name: str) -> None:
        """Forget a :meth:`prepare_recovery` that will not be completed (the node stays failed over; an engine
        it closed stays closed)."""
        self._recovery_prep.pop(name, None)

    def recover(self, name: str, mode: str = "delta", *, bucket: Bucket | None = None) -> RecoveryReport:
        """Bring failed-over node ``name`` back (ns_server's recovery; docs/cluster.md "Delta recovery").

        ``delta``: the node keeps its data (started from its data directory when down); it rejoins the map as a
        replica of every vbucket it held at failover whose chain has a free slot (and as the active of one
        that lost every other copy); each copy stream-requests from its own position and failover log, rolls
        back only what the active's history does not share -- after the rollback repair when
        :attr:`rollback_repair` is on -- and streams the difference. ``full``: its data is wiped first and
        the same copies are streamed from zero. When the node's data directory is gone a delta recovery
        becomes a full one (``message`` says so). The node then holds no active copy of the other vbuckets:
        a rebalance (run by the user) restores the map's balance. :class:`InvalidArgument` for an unknown
        node, a node in the map (never failed over), a node a rebalance removed, a bad mode or a rebalance
        running."""
        t0 = self._monotonic()
        if name not in self._recovery_prep:
            self.prepare_recovery(name, mode)
        elif self._recovery_prep[name][0] != mode:
            raise InvalidArgument(f"node {name} was prepared for a {self._recovery_prep[name][0]} recovery")
        try:
            self._check_recover(name, mode)
            requested, mode, message = self._recovery_prep[name]
            node = self.nodes[name]
            if not node.up:
                node.bucket = bucket if bucket is not None else self.open_recovery_bucket(name)
                bucket = None
        finally:
            self._recovery_prep.pop(name, None)
            if bucket is not None:
                bucket.close()  # not needed: the node was up
        report = self._place_recovered(name, mode, requested, message)
        for vb in report.replicas:
            self._recovering[(name, vb)] = RecoveringCopy(report)
        report.pending = list(report.replicas)
        self._apply_states(name)
        self._connect()  # the copies' stream requests: rollbacks and repairs happen here
        report.seconds = self._monotonic() - t0
        log.info("recovery of %s (%s): %s", name, mode, report.to_json())
        return report

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
        if self._rebalance is not None and only is None:
            self._rebalance.step()  # a bounded step of the rebalance in progress (engine/cluster/rebalance.py)
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
                    # the commits this flush makes possible (persist-level sync writes) are flushed with the
                    # next round's prepares, not in a second transaction now (docs/durability.md "Flushing")
                    node.bucket.flush_round()
                    if node.bucket.dirty_vbuckets:
                        moved += 1  # they still have to be persisted
        # sync replication: replicas seqno-ack what a flush made durable (persist levels; the flush may also be the
        # service's own flush task); timeouts run. Acks and aborts count as movement: the commits / aborts they
        # queue still have to be sent.
        for key in sorted(self._conns):
            if chosen is None or key in chosen:
                moved += self._conns[key].acknowledge_seqnos()
        moved += self.process_durability_timeouts()
        if not moved and any(
                getattr(conn.producer, "has_work", False) for k, conn in self._conns.items()
                if chosen is None or k in chosen):
            moved = 1  # a flush committed prepares (persist levels): their commits wait to be sent
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
        self._abort_rebalance(f"node {name} down")  # ns_server: a node going down stops the rebalance

    def restart(self, name: str) -> None:
        """Start a down node again (warmup; after a crash its actives get a failover entry) and set its
        vbucket states from the map -- with stale CASes, which the manager detects and retries."""
        node = self.node(name)
        if node.up:
            raise InvalidArgument(f"node {name} is already up")
        node.bucket = Bucket(node.config, clock=self.clock)
        self._apply_states(name)

    # ------------------------------------------------------------------ rebalance (engine/cluster/rebalance.py)
    def node_config(self, name: str) -> BucketConfig:
        """The bucket settings a new node ``name`` gets: the other nodes', data under ``base_dir/name``."""
        self._check_new_node(name)
        template = next(iter(self.nodes.values())).config
        return template.model_copy(update={"data_dir": self.base_dir / name})

    def open_node_bucket(self, name: str) -> Bucket:
        """Open (warm up) the engine of a new node ``name`` without adding it: the slow part of
        :meth:`add_node` (a data directory, SQLite, every vbucket), which touches nothing of the cluster and so
        may run on another thread (the gateway does, docs/gateway.md "Limits"); hand it to :meth:`add_node`."""
        return Bucket(self.node_config(name), clock=self.clock)

    def add_node(self, name: str, bucket: Bucket | None = None) -> Node:
        """Start a new node ``name`` (data under ``base_dir/name``, the other nodes' bucket settings); it
        holds no vbucket (all dead) until a rebalance moves some to it. A node ejected or failed over earlier
        can be added again: its old copies are streamed from their position (rolled back if they diverged).
        ``bucket``: its engine opened already by :meth:`open_node_bucket` (used only when the node is started
        here)."""
        cfg = self.node_config(name)
        existing = self.nodes.get(name)
        if existing is not None and existing.up:
            if bucket is not None:
                bucket.close()
            return existing
        if bucket is not None and Path(bucket.config.data_dir) != Path(cfg.data_dir):
            raise InvalidArgument(f"the bucket given for node {name} is not under {cfg.data_dir}")
        node = Node(name, cfg, bucket if bucket is not None else Bucket(cfg, clock=self.clock))
        self.nodes[name] = node
        if name in self.ejected:
            self.ejected.remove(name)
        self._apply_states(name)
        return node

    def start_rebalance(
        self, add: Sequence[str] = (), remove: Sequence[str] = (), *,
        progress: Callable[[RebalanceProgress], None] | None = None, concurrent_moves: int = 4,
        buckets: dict[str, Bucket] | None = None,
    ) -> Rebalance:
        """Start a rebalance (docs/rebalance.md; engine/cluster/rebalance.py): nodes ``add`` in (started with :meth:`add_node`
        when new), ``remove`` out; a new map over the new node set moving as few copies as possible; every
        :meth:`pump` advances it while writes continue. With neither, the current nodes are rebalanced (empty
        slots left by failovers refilled). :class:`InvalidArgument` for unknown / duplicate nodes, removing
        every node, too few nodes for the replicas, or a rebalance already running; TemporaryFailure when a
        node of the map is down (fail it over first). ``buckets``: engines of added nodes opened already
        (:meth:`open_node_bucket`); the ones used are taken out of the dict, the caller closes the rest."""
        add, remove = self._check_rebalance(add, remove)
        for n in add:
            self.add_node(n, None if buckets is None else buckets.pop(n, None))
        if add:
            self._set_map(self._map.with_chains(self._map.chains, list(self._map.nodes) + add))
        self._rebalance = Rebalance(self, add, remove, concurrent_moves=concurrent_moves, progress=progress)
        for n in add:
            if n in self.failed:
                self.failed.remove(n)
        return self._rebalance

    def _eject(self, name: str) -> None:
        """A node the rebalance removed: every vbucket dead, connections dropped, the node closed and gone."""
        node = self.nodes.get(name)
        if node is None:
            return
        if node.up:
            self._apply_states(name)
        self._drop_connections(name)
        if node.bucket is not None and not node.bucket.closed:
            node.bucket.close()
        node.bucket = None
        del self.nodes[name]
        self.ejected.append(name)

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MAP_FILE", "Cluster", "FailoverReport", "Node", "ObserveResult"]
