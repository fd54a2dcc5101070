"""Where the publisher's DCP streams come from: one :class:`~engine.Bucket`, an in-process
:class:`~engine.cluster.local.Cluster` whose vbuckets move between nodes, or a
:class:`~engine.network.process_cluster.ProcessCluster` of node processes reached over TCP.

The publisher only needs a few things from its source (docs/gateway-cluster.md):

* ``num_vbuckets``;
* ``producer_for(vb)``: the DCP connection to stream ``vb`` from -- for a cluster, the connection on the node the
  vbucket map names active (one named connection per node, as a DCP client opens one per kv node); it raises
  :class:`~engine.NotMyVBucket` (no active copy) or :class:`~engine.TemporaryFailure` (that node is down);
* ``node_of(producer)`` and ``active_node(vb)``: to notice that a vbucket moved;
* ``failover_log(vb)`` and ``high_seqno(vb)``: what the failover-log / rollback records carry;
* ``topology()``: a token that changes whenever the map or the set of live nodes changes (the publisher re-tries
  vbuckets it could not stream when it does: the DCP client rule "on NOT_MY_VBUCKET reload the map");
* ``persisted_everywhere(vb, vbuuid)``: what rollback mitigation waits for (Couchbase Kafka connector: publish a
  change only once observe-by-seqno says it is persisted on the active and on every replica).

A cluster's nodes flush on their own; with one bucket the publisher drives its flush with rollback mitigation
(:meth:`BucketSource.before_step`: a background flush per pump round).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from engine import Bucket, DcpProducer, FailoverEntry, InvalidArgument, NotMyVBucket, TemporaryFailure
from engine.cluster.local import Cluster
from engine.cluster.manager import ClusterManager
from engine.kv.vbucket import VBucketState
from engine.network.process_cluster import ProcessCluster
from engine.network.remote import NodeUnavailable, RemoteDcpProducer, RemoteNode, StatsPoll, connect

#: items per SQLite transaction when the publisher flushes the bucket before a DCP step (rollback mitigation)
MITIGATION_FLUSH_ITEMS = 16_384

__all__ = ["AttachedNodesSource", "BucketSource", "ClusterSource", "DcpConnection", "DcpSource", "ProcessClusterSource", "cluster_summary", "make_source"]

#: a DCP connection: in process, or to a node process over TCP (duck-typing DcpProducer)
DcpConnection = DcpProducer | RemoteDcpProducer

#: a topology token: (map revision, live nodes with their bucket objects -- a restarted node is a new bucket)
Topology = tuple[int, frozenset[tuple[str, object]]]


class BucketSource:
    """A single bucket: one DCP connection carries every vbucket (the gateway's original mode)."""

    is_cluster = False

    def __init__(self, bucket: Bucket, connection_name: str, buffer_size: int) -> None:
        self.bucket = bucket
        self.connection_name = connection_name
        self.buffer_size = buffer_size
        self._producer: DcpProducer | None = None

    @property
    def num_vbuckets(self) -> int:
        return self.bucket.num_vbuckets

    def open(self) -> None:
        self._producer = self.bucket.dcp_producer(self.connection_name, buffer_size=self.buffer_size)

    def producer_for(self, vb: int) -> DcpProducer:
        p = self._producer
        if p is None:
            raise TemporaryFailure("source not opened")
        return p

    def producers(self) -> list[DcpProducer]:
        return [] if self._producer is None else [self._producer]

    def node_of(self, producer: DcpConnection) -> str:
        return self.bucket.config.name

    def active_node(self, vb: int) -> str | None:
        return self.bucket.config.name

    def topology(self) -> Topology:
        return (0, frozenset())

    def failover_log(self, vb: int) -> list[FailoverEntry]:
        return self.bucket.failover_log(vb)

    def high_seqno(self, vb: int) -> int:
        return self.bucket.vbucket(vb).high_seqno

    def seqnos(self, vb: int) -> tuple[int, int]:
        """``(high, persisted)`` of the vbucket's active copy."""
        v = self.bucket.vbucket(vb)
        return v.high_seqno, v.persisted_seqno

    def vbucket_stats(self, vb: int) -> dict[str, int | str]:
        return self.bucket.vbucket_stats(vb)

    def items(self) -> int:
        return sum(v.num_items for v in self.bucket.vbuckets())

    def checkpoint_memory(self) -> int:
        return self.bucket.counter.used

    def before_step(self, wait: bool = False) -> None:
        """Persisted-only publishing (docs/gateway.md "Publishing path"): land the background flush whose
        transaction ended (or, with ``wait``, once it has; raising its error: the pump fails and is retried,
        the items stay queued) and start the next one, of at most MITIGATION_FLUSH_ITEMS -- the flusher builds
        a row per item, so a backlog of a million items flushed at once would be the peak of the process's
        memory (docs/performance.md). The storage's writer thread runs it while this thread publishes what the
        previous one persisted; the publisher holds what a DCP step returns until it is persisted."""
        b = self.bucket
        if b.flush_pending:
            b.complete_flush(wait)
        if b.dirty_vbuckets and not b.flush_pending:
            b.start_flush(MITIGATION_FLUSH_ITEMS)

    @property
    def flush_in_flight(self) -> bool:
        """A background flush of :meth:`before_step` has not landed yet."""
        return self.bucket.flush_pending

    def persisted_everywhere(self, vb: int, vbuuid: int) -> int:
        return self.bucket.vbucket(vb).persisted_seqno

    @property
    def persistence_epoch(self) -> int | None:
        """Changes whenever a flush lands, i.e. whenever :meth:`persisted_everywhere` may answer higher (a
        rollback may lower it: the vbucket's stream ends then). None where that is not known (clusters)."""
        return self.bucket.items_flushed

    @property
    def up(self) -> bool:
        return not self.bucket.closed

    def close(self) -> None:
        p = self._producer
        if p is not None and not self.bucket.closed and self.bucket.producers.get(self.connection_name) is p:
            self.bucket.close_producer(self.connection_name)
        self._producer = None


def persisted_everywhere(manager: ClusterManager, vb: int, vbuuid: int) -> int:
    """The highest seqno of ``vb`` persisted on the active and on every replica of the chain (0 when unknown).

    Couchbase Kafka connector rollback mitigation (java-dcp-client persistence polling): observe-by-seqno on the
    vbucket (docs/cluster.md "Observe by seqno"); a replica counts
    with the end of its last complete snapshot persisted; a replica slot whose node is down (or not yet a
    replica) holds publishing back until it answers or is failed over. A failed-over vbuuid answers 0: the
    stream is about to end and re-request. The same rule for both cluster managers (in-process and node
    processes: there every answer is a ``stats vbucket-details`` round trip).
    """
    try:
        r = manager.observe_seqno(vb, vbuuid)
    except (NotMyVBucket, TemporaryFailure):
        return 0
    if r.failed_over:
        return 0
    safe = r.persisted_seqno
    reps = r.replica_persisted_seqnos
    for name in manager.vbucket_map().replicas(vb):
        safe = min(safe, reps.get(name, 0))
    return safe


class ClusterSource:
    """An in-process cluster: every vbucket is streamed from its active node per the vbucket map."""

    is_cluster = True
    #: replicas persist on their own: no epoch, every pass looks (BucketSource.persistence_epoch)
    persistence_epoch: int | None = None

    def __init__(self, cluster: Cluster, connection_name: str, buffer_size: int) -> None:
        self.cluster = cluster
        self.connection_name = connection_name
        self.buffer_size = buffer_size
        self._producers: dict[str, DcpProducer] = {}
        self._nodes: dict[int, str] = {}

    @property
    def num_vbuckets(self) -> int:
        return self.cluster.num_vbuckets

    def open(self) -> None:
        """Connections are opened lazily, per node, by :meth:`producer_for`."""

    def producer_for(self, vb: int) -> DcpProducer:
        name = self.cluster.vbucket_map().active(vb)
        if name is None:
            raise NotMyVBucket(f"vbucket {vb} has no active copy")
        p = self._producers.get(name)
        if p is None or p.closed:
            bucket = self.cluster.node(name).require_bucket()  # TemporaryFailure while the node is down
            p = bucket.dcp_producer(self.connection_name, buffer_size=self.buffer_size)
            self._producers[name] = p
            self._nodes[id(p)] = name
        return p

    def producers(self) -> list[DcpProducer]:
        return [p for _n, p in sorted(self._producers.items()) if not p.closed]

    def node_of(self, producer: DcpConnection) -> str:
        return self._nodes.get(id(producer), "")

    def active_node(self, vb: int) -> str | None:
        return self.cluster.vbucket_map().active(vb)

    def topology(self) -> Topology:
        c = self.cluster
        return (c.vbucket_map().revision, frozenset((n, node.bucket) for n, node in c.nodes.items() if node.up))

    def failover_log(self, vb: int) -> list[FailoverEntry]:
        return self.cluster.active_bucket(vb).failover_log(vb)

    def high_seqno(self, vb: int) -> int:
        return self.cluster.active_bucket(vb).vbucket(vb).high_seqno

    def seqnos(self, vb: int) -> tuple[int, int]:
        try:
            v = self.cluster.active_bucket(vb).vbucket(vb)
        except (NotMyVBucket, TemporaryFailure):
            return 0, 0
        return v.high_seqno, v.persisted_seqno

    def vbucket_stats(self, vb: int) -> dict[str, int | str]:
        try:
            return self.cluster.active_bucket(vb).vbucket_stats(vb)
        except (NotMyVBucket, TemporaryFailure):
            return {}

    def _live(self) -> list[Bucket]:
        return [n.bucket for _name, n in sorted(self.cluster.nodes.items()) if n.up and n.bucket is not None]

    def items(self) -> int:
        """Live documents in the active vbuckets of every live node."""
        return sum(v.num_items for b in self._live() for v in b.vbuckets() if v.state is VBucketState.ACTIVE)

    def checkpoint_memory(self) -> int:
        return sum(b.counter.used for b in self._live())

    def persisted_everywhere(self, vb: int, vbuuid: int) -> int:
        """The highest seqno persisted on the active and on every replica of the chain (0 when unknown): see
        :func:`persisted_everywhere`."""
        return persisted_everywhere(self.cluster, vb, vbuuid)

    @property
    def up(self) -> bool:
        return any(node.up for node in self.cluster.nodes.values())

    def close(self) -> None:
        for name, p in sorted(self._producers.items()):
            node = self.cluster.nodes.get(name)
            bucket = node.bucket if node is not None else None
            if bucket is not None and not bucket.closed and bucket.producers.get(self.connection_name) is p:
                bucket.close_producer(self.connection_name)
            else:
                p.close()
        self._producers.clear()
        self._nodes.clear()


class ProcessClusterSource:
    """A cluster of node processes (:class:`~engine.network.process_cluster.ProcessCluster`): every vbucket is streamed
    over TCP from its active node per the vbucket map, one :class:`~engine.network.remote.RemoteDcpProducer` connection
    per node (a DCP client opens one connection per kv node), opened lazily.

    Same rules as :class:`ClusterSource` (docs/gateway-cluster.md "Process clusters"); what differs is how a
    dead node shows: its connection drops (SIGKILL) and ``step`` raises
    :class:`~engine.network.remote.NodeUnavailable`. The publisher then forgets that connection's vbuckets; here the
    topology token counts, per node, the connections found dead, so a connection that dropped while its node
    stayed up also makes the publisher reload the map and re-request (DCP client rule: a dead connection is
    like NOT_MY_VBUCKET -- reload the map, re-request with your own position).
    """

    is_cluster = True
    #: replicas persist on their own: no epoch, every pass looks (BucketSource.persistence_epoch)
    persistence_epoch: int | None = None

    def __init__(self, cluster: ProcessCluster, connection_name: str, buffer_size: int, *,
                 poll_timeout: float = 0.002) -> None:
        self.cluster = cluster
        self.connection_name = connection_name
        self.buffer_size = buffer_size
        #: how long one ``step`` waits for a node's first message (the publisher steps every node per pump)
        self.poll_timeout = poll_timeout
        self._producers: dict[str, RemoteDcpProducer] = {}
        self._nodes: dict[int, str] = {}
        #: connections found dead, per node (part of the topology token)
        self._dropped: dict[str, int] = {}

    @property
    def num_vbuckets(self) -> int:
        return self.cluster.num_vbuckets

    def open(self) -> None:
        """Connections are opened lazily, per node, by :meth:`producer_for`."""

    def _forget(self, name: str) -> None:
        p = self._producers.pop(name, None)
        if p is not None:
            self._nodes.pop(id(p), None)
            self._dropped[name] = self._dropped.get(name, 0) + 1
            p.close()

    def producer_for(self, vb: int) -> RemoteDcpProducer:
        name = self.cluster.vbucket_map().active(vb)
        if name is None:
            raise NotMyVBucket(f"vbucket {vb} has no active copy")
        p = self._producers.get(name)
        if p is None or p.closed:
            if p is not None:
                self._forget(name)
            # NodeUnavailable (a TemporaryFailure) while the node is down or refuses the connection
            client = self.cluster.node(name).require()
            p = client.dcp_producer(self.connection_name, buffer_size=self.buffer_size,
                                    poll_timeout=self.poll_timeout)
            self._producers[name] = p
            self._nodes[id(p)] = name
        return p

    def producers(self) -> list[RemoteDcpProducer]:
        out: list[RemoteDcpProducer] = []
        for name, p in sorted(self._producers.items()):
            if p.closed:
                self._forget(name)  # a dead connection changes the topology token: the publisher re-requests
            else:
                out.append(p)
        return out

    def node_of(self, producer: DcpConnection) -> str:
        return self._nodes.get(id(producer), "")

    def active_node(self, vb: int) -> str | None:
        return self.cluster.vbucket_map().active(vb)

    def topology(self) -> Topology:
        """Map revision + the live nodes, each with its start count (a restarted node is a new process) and
        the number of its connections found dead."""
        c = self.cluster
        return (c.vbucket_map().revision,
                frozenset((n, (node.starts, self._dropped.get(n, 0))) for n, node in c.nodes.items() if node.up))

    def failover_log(self, vb: int) -> list[FailoverEntry]:
        return self.cluster.active_client(vb).failover_log(vb)

    def high_seqno(self, vb: int) -> int:
        return self.cluster.active_client(vb).vbucket_info(vb).high_seqno

    def seqnos(self, vb: int) -> tuple[int, int]:
        try:
            info = self.cluster.active_client(vb).vbucket_info(vb)
        except (NotMyVBucket, TemporaryFailure):
            return 0, 0
        return info.high_seqno, info.persisted_seqno

    def vbucket_stats(self, vb: int) -> dict[str, int | str]:
        """The active node's ``stats vbucket-details <vb>`` (numbers as ints)."""
        try:
            raw = self.cluster.active_client(vb).stats(f"vbucket-details {vb}")
        except (NotMyVBucket, TemporaryFailure):
            return {}
        return {k: int(v) if v.lstrip("-").isdigit() else v for k, v in raw.items()}

    def _node_stat(self, stat: str) -> int:
        total = 0
        for name in sorted(self.cluster.nodes):
            node = self.cluster.nodes[name]
            if not node.up:
                continue
            try:
                total += int(node.require().stats().get(stat, 0))
            except TemporaryFailure:
                continue  # went down while asked
        return total

    def items(self) -> int:
        """Documents on every live node -- active and replica copies (a node's ``stats`` has no per-state
        count; the in-process source counts actives only)."""
        return self._node_stat("items")

    def checkpoint_memory(self) -> int:
        return self._node_stat("checkpoint_memory")

    def persisted_everywhere(self, vb: int, vbuuid: int) -> int:
        """Observe-by-seqno over TCP on the active and every replica: see :func:`persisted_everywhere`."""
        return persisted_everywhere(self.cluster, vb, vbuuid)

    @property
    def up(self) -> bool:
        return any(node.up for node in self.cluster.nodes.values())

    def close(self) -> None:
        for p in self._producers.values():
            p.close()  # the node ends every stream of the connection
        self._producers.clear()
        self._nodes.clear()


class AttachedNodesSource:
    """Running node processes (``python -m engine.network.server``) this gateway did not start: ``dcpgw gateway
    --source HOST:PORT[,...]`` (docs/scale-out.md). There is no cluster manager here to ask for the vbucket map,
    so the source learns each vbucket's active node from the nodes themselves (``stats vbucket-states``: the
    node whose copy is ``active``), again every ``refresh_interval`` seconds; a change of an active or of the
    reachable nodes changes the topology token, and the publisher re-requests the moved vbuckets with its own
    position (the DCP client rule "on NOT_MY_VBUCKET reload the map"). Replicas are the nodes whose copy is
    ``replica``: rollback mitigation waits for them as for a managed cluster's chain."""

    is_cluster = True
    #: replicas persist on their own: no epoch, every pass looks (BucketSource.persistence_epoch)
    persistence_epoch: int | None = None

    def __init__(self, addresses: list[str], connection_name: str, buffer_size: int, *,
                 poll_timeout: float = 0.002, refresh_interval: float = 0.5, timeout: float = 10.0,
                 persistence_poll_interval: float = 0.02, clock: Callable[[], float] = time.monotonic) -> None:
        if not addresses:
            raise InvalidArgument("no node address given")
        self.addresses = list(addresses)
        self.connection_name = connection_name
        self.buffer_size = buffer_size
        self.poll_timeout = poll_timeout
        self.refresh_interval = refresh_interval
        self.clock = clock
        self.nodes: dict[str, RemoteNode] = {a: connect(a, timeout=timeout) for a in self.addresses}
        self._producers: dict[str, RemoteDcpProducer] = {}
        self._names: dict[int, str] = {}
        self._num_vbuckets = 0
        #: per vbucket: the node whose copy is active (None: none reachable is), and the replicas' nodes
        self._active: list[str | None] = []
        self._replicas: list[tuple[str, ...]] = []
        self._live: frozenset[str] = frozenset()
        self._revision = 0
        self._next_refresh = 0.0
        self._dropped: dict[str, int] = {}
        #: rollback mitigation's persistence polling: every vbucket's (vbuuid, persisted seqno) per node, read in
        #: one ``stats vbucket-persisted`` at most every ``persistence_poll_interval`` s (java-dcp-client polls
        #: every 100 ms) instead of one OBSERVE_SEQNO round trip per vbucket and pump; None for a node that
        #: does not know the stat group (it is observed per vbucket)
        self.persistence_poll_interval = persistence_poll_interval
        #: per node: (when it was asked, its answer's text, the table parsed from it -- None: an older node)
        self._persisted: dict[str, tuple[float, str, dict[int, tuple[int, int]] | None]] = {}
        #: per node: the persistence poll's own connection (answered without the publishing loop waiting), and
        #: when its socket was last looked at for the answer (at most every quarter interval: mitigation asks
        #: once per held vbucket, and each look is a system call)
        self._polls: dict[str, StatsPoll] = {}
        self._looked: dict[str, float] = {}
        #: per node: False when it does not know ``stats vbucket-states packed`` (asked per vbucket instead)
        self._packed_states: dict[str, bool] = {}

    @property
    def num_vbuckets(self) -> int:
        return self._num_vbuckets

    def open(self) -> None:
        """Ask every node for its vbucket count (they must agree) and learn the actives."""
        counts: dict[str, int] = {}
        for a, node in self.nodes.items():
            with contextlib.suppress(TemporaryFailure, OSError):
                counts[a] = int(node.stats()["vbuckets"])
        if not counts:
            raise NodeUnavailable(f"no node answers at {', '.join(self.addresses)}")
        if len(set(counts.values())) > 1:
            raise InvalidArgument(f"the nodes disagree on the number of vbuckets: {counts}")
        self._num_vbuckets = next(iter(counts.values()))
        self.refresh()

    def refresh(self) -> None:
        """Read every node's vbucket states; bump the revision when an active, a replica or the set of reachable
        nodes changed."""
        n = self._num_vbuckets
        active: list[str | None] = [None] * n
        replicas: list[list[str]] = [[] for _ in range(n)]
        live: set[str] = set()
        for a in sorted(self.nodes):
            try:
                states = self._vbucket_states(a)
            except (TemporaryFailure, OSError):
                continue
            live.add(a)
            for vb, st in states:
                if not 0 <= vb < n:
                    continue
                if st == VBucketState.ACTIVE.value and active[vb] is None:
                    active[vb] = a
                elif st == VBucketState.REPLICA.value:
                    replicas[vb].append(a)
        reps = [tuple(r) for r in replicas]
        if active != self._active or reps != self._replicas or frozenset(live) != self._live:
            self._active, self._replicas, self._live = active, reps, frozenset(live)
            self._revision += 1
        self._next_refresh = self.clock() + self.refresh_interval

    def _vbucket_states(self, name: str) -> Iterator[tuple[int, str]]:
        """(vbucket, state) of every vbucket of node ``name``: ``stats vbucket-states packed`` (one frame), or
        ``stats vbucket-states`` (one frame per vbucket: ~10 ms to read 1024 of them) from a node that does not
        know the packed form."""
        node = self.nodes[name]
        if self._packed_states.get(name, True):
            try:
                text = node.stats("vbucket-states packed").get("vbuckets", "")
            except InvalidArgument:
                self._packed_states[name] = False
            else:
                self._packed_states[name] = True
                return ((int(vb), st) for vb, _, st in (e.partition(":") for e in text.split()))
        return ((int(k), st) for k, st in node.stats("vbucket-states").items())

    def _forget(self, name: str) -> None:
        p = self._producers.pop(name, None)
        if p is not None:
            self._names.pop(id(p), None)
            self._dropped[name] = self._dropped.get(name, 0) + 1
            p.close()

    def producer_for(self, vb: int) -> RemoteDcpProducer:
        name = self._active[vb] if self._active else None
        if name is None:
            raise NotMyVBucket(f"vbucket {vb} has no active copy on a reachable node")
        p = self._producers.get(name)
        if p is None or p.closed:
            if p is not None:
                self._forget(name)
            try:
                p = self.nodes[name].dcp_producer(self.connection_name, buffer_size=self.buffer_size,
                                                  poll_timeout=self.poll_timeout)
            except OSError as e:
                raise NodeUnavailable(f"node {name}: {e}") from e
            self._producers[name] = p
            self._names[id(p)] = name
        return p

    def producers(self) -> list[RemoteDcpProducer]:
        out: list[RemoteDcpProducer] = []
        for name, p in sorted(self._producers.items()):
            if p.closed:
                self._forget(name)
            else:
                out.append(p)
        return out

    def node_of(self, producer: DcpConnection) -> str:
        return self._names.get(id(producer), "")

    def active_node(self, vb: int) -> str | None:
        return self._active[vb] if self._active else None

    def topology(self) -> Topology:
        if self.clock() >= self._next_refresh:
            self.refresh()
        return (self._revision, frozenset((a, self._dropped.get(a, 0)) for a in self._live))

    def _client(self, vb: int) -> RemoteNode:
        name = self.active_node(vb)
        if name is None:
            raise NotMyVBucket(f"vbucket {vb} has no active copy on a reachable node")
        return self.nodes[name]

    def failover_log(self, vb: int) -> list[FailoverEntry]:
        return self._client(vb).failover_log(vb)

    def high_seqno(self, vb: int) -> int:
        return self._client(vb).vbucket_info(vb).high_seqno

    def seqnos(self, vb: int) -> tuple[int, int]:
        try:
            info = self._client(vb).vbucket_info(vb)
        except (NotMyVBucket, TemporaryFailure, OSError):
            return 0, 0
        return info.high_seqno, info.persisted_seqno

    def vbucket_stats(self, vb: int) -> dict[str, int | str]:
        try:
            raw = self._client(vb).stats(f"vbucket-details {vb}")
        except (NotMyVBucket, TemporaryFailure, OSError):
            return {}
        return {k: int(v) if v.lstrip("-").isdigit() else v for k, v in raw.items()}

    def _node_stat(self, stat: str) -> int:
        total = 0
        for a in sorted(self._live):
            with contextlib.suppress(TemporaryFailure, OSError):
                total += int(self.nodes[a].stats().get(stat, 0))
        return total

    def items(self) -> int:
        return self._node_stat("items")

    def checkpoint_memory(self) -> int:
        return self._node_stat("checkpoint_memory")

    def _persisted_table(self, name: str) -> dict[int, tuple[int, int]] | None:
        """The node's (vbuuid, persisted seqno) per vbucket as of its last answer to ``stats vbucket-persisted``
        (docs/scale-out.md "Persistence polling"); None when the node does not know that stat group (an older
        node: observe per vbucket). The poll runs on a connection of its own and is not waited for (a node busy
        flushing answered a member's blocking poll after up to tens of milliseconds: 12 % of its time): an
        answer is taken once it has arrived (its socket looked at no more than every quarter interval), and the
        next request goes out when the last answer is ``persistence_poll_interval`` old. Only the first answer
        is waited for. A persisted seqno only grows for a vbuuid, so an answer one poll old is a lower bound of
        the node's, as a fresh one is."""
        have = self._persisted.get(name)
        if have is not None and have[2] is None:
            return None
        poll = self._polls.get(name)
        if poll is None:
            poll = self._polls[name] = self.nodes[name].stats_poll("vbucket-persisted", clock=self.clock)
        now = self.clock()
        try:
            asked = poll.asked_at
            if have is None:
                poll.ask()
                asked = poll.asked_at
                raw = poll.answer(poll.timeout)
            elif asked is not None and now - self._looked.get(name, -1e300) >= self.persistence_poll_interval / 4:
                self._looked[name] = now
                raw = poll.answer()
            else:
                raw = None
        except InvalidArgument:
            self._persisted[name] = (now, "", None)
            return None
        except (TemporaryFailure, OSError):
            self._persisted.pop(name, None)  # nothing known until the node answers again
            raise
        if raw is not None and asked is not None:
            # "vb:vbuuid:seqno" entries separated by spaces, parsed in one pass; the same text as last time (no
            # flush landed since: most polls during a bulk load) is not parsed again
            text = raw.get("vbuckets", "")
            if have is not None and have[1] == text:
                table = have[2]
            else:
                fields = map(int, text.replace(":", " ").split())
                table = {vb: (uuid, seqno) for vb, uuid, seqno in zip(fields, fields, fields, strict=True)}
            have = self._persisted[name] = (asked, text, table)
        if have is None:
            raise NodeUnavailable(f"{name}: no answer to stats vbucket-persisted")
        if not poll.outstanding and now - have[0] >= self.persistence_poll_interval:
            with contextlib.suppress(TemporaryFailure, OSError):
                poll.ask()  # (a node that cannot be reached: the next call tries again)
        return have[2]

    def persisted_everywhere(self, vb: int, vbuuid: int) -> int:
        """What observe-by-seqno says is persisted on the active and on every node holding a replica copy (0
        when unknown or the vbucket failed over from ``vbuuid``), from the nodes' polled persistence tables."""
        try:
            name = self._active[vb]
            if name is None:
                return 0
            table = self._persisted_table(name)
            if table is not None:
                uuid, safe = table.get(vb, (0, 0))
                if uuid != vbuuid:
                    return 0  # not active there any more, or failed over: as observe's format 1
                for rep in self._replicas[vb]:
                    rt = self._persisted_table(rep)
                    if rt is None:
                        safe = min(safe, self.nodes[rep].observe_seqno(vb, vbuuid).persisted_seqno)
                    else:
                        safe = min(safe, rt.get(vb, (0, 0))[1])
                return safe
        except (TemporaryFailure, OSError):
            return 0
        try:
            r = self._client(vb).observe_seqno(vb, vbuuid)
            if r.failed_over:
                return 0
            safe = r.persisted_seqno
            for name in self._replicas[vb]:
                safe = min(safe, self.nodes[name].observe_seqno(vb, vbuuid).persisted_seqno)
        except (NotMyVBucket, TemporaryFailure, OSError):
            return 0
        return safe

    @property
    def up(self) -> bool:
        return bool(self._live)

    def close(self) -> None:
        for p in self._producers.values():
            p.close()
        self._producers.clear()
        self._names.clear()
        for node in self.nodes.values():
            node.close()
        for poll in self._polls.values():
            poll.close()
        self._polls.clear()
        self._looked.clear()
        self._persisted.clear()


#: what the publisher streams from
DcpSource = BucketSource | ClusterSource | ProcessClusterSource | AttachedNodesSource


def make_source(origin: Bucket | Cluster | ProcessCluster | DcpSource, connection_name: str,
                buffer_size: int) -> DcpSource:
    """Wrap a bucket, a cluster or a cluster of node processes (a source passes through)."""
    if isinstance(origin, (BucketSource, ClusterSource, ProcessClusterSource, AttachedNodesSource)):
        return origin
    if isinstance(origin, Cluster):
        return ClusterSource(origin, connection_name, buffer_size)
    if isinstance(origin, ProcessCluster):
        return ProcessClusterSource(origin, connection_name, buffer_size)
    return BucketSource(origin, connection_name, buffer_size)


def cluster_summary(cluster: Cluster) -> dict[str, Any]:
    """``GET /cluster``: nodes (up / down / failed over), per node its active and replica vbucket counts, the
    map revision (ns_server's ``/pools/default`` in spirit)."""
    vbmap = cluster.vbucket_map()
    nodes: list[dict[str, Any]] = []
    for name in sorted(cluster.nodes):
        node = cluster.nodes[name]
        in_map = name in vbmap.nodes
        active = len(vbmap.vbuckets_of(name, slot=0)) if in_map else 0
        replica = sum(1 for c in vbmap.chains if name in c[1:]) if in_map else 0
        states: dict[str, int] = {}
        if node.up:
            assert node.bucket is not None
            for v in node.bucket.vbuckets():
                states[v.state.value] = states.get(v.state.value, 0) + 1
        nodes.append({
            "name": name,
            "status": "failed_over" if name in cluster.failed else ("up" if node.up else "down"),
            "up": node.up,
            "in_map": in_map,
            "active_vbuckets": active,
            "replica_vbuckets": replica,
            "vbucket_states": states if node.up else None,
        })
    lost = [vb for vb, c in enumerate(vbmap.chains) if c[0] is None]
    return {
        "revision": vbmap.revision,
        "num_vbuckets": vbmap.num_vbuckets,
        "replicas": vbmap.num_replicas,
        "nodes": nodes,
        "failed_over": list(cluster.failed),
        "vbuckets_without_active": lost,
    }
