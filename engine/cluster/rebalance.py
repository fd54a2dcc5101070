"""Rebalance: moving vbuckets between nodes with DCP takeover (docs/rebalance.md; ns_server's vbucket mover
and EBucketMigrator; kv_engine takeover streams in engine/dcp/takeover.py).

Pieces, named for the vbucket-move design's nouns:

* :class:`RebalanceCluster` -- everything the mover uses of the cluster manager (a Protocol that
  :class:`~engine.cluster.manager.ClusterManager` implements with public methods; docs/rebalance.md "The cluster
  interface").
* :func:`plan_rebalance` -- the planner, pure: the current map and the node changes give a
  :class:`RebalancePlan` (node set, target chains, the moves); no cluster, clock or RNG.
* :func:`plan_chains` -- the new map over the new node set, moving as few copies as possible (ns_server's
  ``mb_map``: keep what can stay, balance actives and replicas to within one vbucket per node).
* :class:`MigratorConnection` -- one **named connection** between the mover and both sides (docs/rebalance.md "The
  mover", handshake step 1): a producer connection on the source node and a consumer on the destination, with
  the same name; opening a name that exists closes the old connection first (its messages are refused).
  ``add_stream`` requests are **pipelined with opaques and answered out of order** (step 2): each one runs the
  stream request / rollback loop (steps 3-6) one request per :meth:`MigratorConnection.process` round, so a
  stream that must roll back completes after one submitted later; results are matched by opaque.
  ``close_stream`` closes both sides at once and answers immediately ("Closing Streams").
* :class:`VBucketMove` -- one vbucket's move (docs/rebalance.md "The mover": moving data, takeover): build the new copies
  from the current active over the mover's connections; poll the takeover estimate until fewer than 1000 items
  are left; wait until the new copies persisted the active's seqno ("Wait For Persistence"); stop front-end
  writes (TMPFAIL, as kv_engine answers during a takeover) and wait until every copy of the new chain holds the
  active's high seqno in a complete, persisted snapshot; then a TAKEOVER stream (markers with ACK, set-vbucket-
  state pending, old active dead and drained, active). Afterwards both sides' states are checked; on a
  mismatch both are put back to their original states (old active, new replica) and the takeover is retried.
  No failover entry is created (kv_engine ``transfer``). Then the map gets the new chain (revision + 1), the old
  copies become dead and the new replicas replicate from the new active like any other.
* :class:`Rebalance` -- the mover: carries a plan out, driven step-wise by :meth:`Rebalance.step` (a few moves at a time
  while writes continue); :class:`RebalanceProgress` reports vbuckets moved / total and items left.
  :class:`ProcessRebalance` runs the same phases over node processes, where each node's replication link is
  the consumer side (DCP_ADD_STREAM with TAKEOVER, acks as DCP responses, ``stats dcp-vbtakeover``).

See docs/rebalance.md for the differences from ns_server.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, Protocol

from engine.bucket import Bucket
from engine.cluster.manager import NodeControl
from engine.cluster.vbucket_map import VBucketMap
from engine.dcp.replication import DcpConsumer, PassiveState
from engine.dcp.stream import StreamEndReason
from engine.dcp.takeover import ALMOST_CAUGHT_UP_ITEMS
from engine.exceptions import EngineError, InvalidArgument, NotMyVBucket, TemporaryFailure
from engine.kv.vbucket import VBucketState
from schemas.failover_log import FailoverEntry

#: moves running at once (ns_server ``rebalance_moves_per_node`` defaults to 4)
DEFAULT_CONCURRENT_MOVES: Final = 4
#: DCP messages per mover connection per step (in process the mover shares the thread with the front end)
DEFAULT_MESSAGES_PER_STEP: Final = 512
#: a takeover whose states do not match afterwards is reverted and retried this many times
MAX_TAKEOVER_ATTEMPTS: Final = 5


# ---------------------------------------------------------------------- what the mover needs of the cluster
class RebalanceCluster(Protocol):
    """What the rebalance mover needs from the cluster manager, and all it uses of it
    (:class:`~engine.cluster.manager.ClusterManager` implements it; docs/rebalance.md "The cluster interface")."""

    def vbucket_map(self) -> VBucketMap:
        """The current map."""
        ...

    def commit_map(self, vbmap: VBucketMap) -> None:
        """Adopt and persist a new map revision (clients follow it on NOT_MY_VBUCKET)."""
        ...

    def node_up(self, name: str) -> bool: ...

    def node_control(self, name: str) -> NodeControl:
        """The node's state commands and ``vbucket_info`` (seqnos, persistence); TemporaryFailure when down.
        The in-process mover needs a :class:`~engine.bucket.Bucket` here, the process mover a
        :class:`~engine.network.remote.RemoteNode`."""
        ...

    def set_vbucket_state(self, name: str, vbucket: int, state: VBucketState) -> None:
        """Set a vbucket's state on a node with the partition-state CAS (retried on a stale CAS)."""
        ...

    def refresh_state_cas(self, name: str, vbucket: int) -> None:
        """The node changed the vbucket's state itself (a takeover): read its partition-state CAS afresh."""
        ...

    def begin_move(self, vbucket: int, nodes: Iterable[str]) -> None:
        """The mover feeds ``vbucket``'s streams into ``nodes``: the map's replication leaves them alone."""
        ...

    def block_writes(self, vbucket: int) -> None:
        """Front-end writes to ``vbucket`` answer TMPFAIL until :meth:`end_move`."""
        ...

    def set_second_chain(self, vbucket: int, chain: Sequence[str | None]) -> None:
        """The active's second replication chain (the post-move chain) for sync writes."""
        ...

    def clear_second_chain(self, vbucket: int) -> None: ...

    def end_move(self, vbucket: int) -> None:
        """The move of ``vbucket`` is over (done or stopped): map replication again, writes allowed, no
        second chain."""
        ...

    def rewire(self) -> None:
        """Wire replication (and the topologies) from the current map and moves."""
        ...

    def eject_node(self, name: str) -> None:
        """A node the rebalance removed: its vbuckets dead, the node stopped and forgotten."""
        ...

    def rebalance_ended(self, rebalance: Rebalance) -> None:
        """``rebalance`` finished or stopped: the manager no longer drives it."""
        ...

    def monotonic_time(self) -> float:
        """The manager's injected monotonic clock (seconds): takeover timeouts of the process mover."""
        ...


# ---------------------------------------------------------------------- the plan (pure)
@dataclass(frozen=True)
class PlannedMove:
    """One vbucket whose chain changes: ``old`` (the map's) -> ``new``."""

    vbucket: int
    old: tuple[str | None, ...]
    new: tuple[str | None, ...]


@dataclass(frozen=True)
class RebalancePlan:
    """What a rebalance will do: the node set after it, the target chains, and the moves (vbucket order)."""

    nodes: tuple[str, ...]
    chains: tuple[tuple[str | None, ...], ...]
    moves: tuple[PlannedMove, ...]


def plan_rebalance(current: VBucketMap, add: Sequence[str] = (), remove: Sequence[str] = ()) -> RebalancePlan:
    """The rebalance planner: a pure function of the current map and the node changes (no cluster, clock
    or RNG; the same inputs give the same plan). The nodes after it are the map's nodes without ``remove``,
    then ``add`` (those not in the map yet); the target chains are :func:`plan_chains` over them."""
    removed = set(remove)
    final = [n for n in current.nodes if n not in removed]
    final += [n for n in add if n not in final]
    target = plan_chains(current, final)
    moves = tuple(
        PlannedMove(vb, tuple(old), tuple(new))
        for vb, (old, new) in enumerate(zip(current.chains, target, strict=True)) if list(old) != list(new))
    return RebalancePlan(tuple(final), tuple(tuple(c) for c in target), moves)


# ---------------------------------------------------------------------- the new map
def plan_chains(current: VBucketMap, nodes: Sequence[str], replicas: int | None = None) -> list[list[str | None]]:
    """Chains over ``nodes`` that keep as many current copies as possible: a surviving active stays unless its
    node holds too many; a vbucket whose active leaves goes preferably to a node that already holds a replica
    (no data to build); replicas likewise. Actives, and replica copies, are balanced to within one per node.
    A vbucket with no copy at all (lost in a failover) keeps its empty chain."""
    names = list(nodes)
    n = len(names)
    if n == 0 or len(set(names)) != n:
        raise InvalidArgument(f"need unique node names, got {names}")
    width = current.num_replicas if replicas is None else replicas
    if width >= n:
        raise InvalidArgument(f"{width} replicas need at least {width + 1} nodes, got {n}")
    keep = set(names)
    order = {name: i for i, name in enumerate(names)}
    old = [list(c) for c in current.chains]
    live = [vb for vb, c in enumerate(old) if c[0] is not None]

    # Actives.
    active: dict[int, str] = {}
    count = dict.fromkeys(names, 0)
    cap = -(-len(live) // n)
    orphans: list[int] = []
    for vb in live:
        a = old[vb][0]
        if a in keep and count[a] < cap:
            active[vb] = a
            count[a] += 1
        else:
            orphans.append(vb)

    def prefer(vb: int, load: dict[str, int], exclude: Iterable[str] = ()) -> str | None:
        held = set(old[vb])
        banned = set(exclude)
        cands = [m for m in names if m not in banned]
        if not cands:
            return None
        return min(cands, key=lambda m: (load[m], m not in held, order[m]))

    for vb in orphans:
        best = prefer(vb, count)
        assert best is not None
        active[vb] = best
        count[best] += 1
    _balance(live, active, count, old, order)

    # Replicas: keep surviving replicas (and a former active) that are not the new active, fill the rest.
    chains: list[list[str | None]] = [[None] * (width + 1) for _ in old]
    rcount = dict.fromkeys(names, 0)
    reps: dict[int, list[str]] = {}
    for vb in live:
        a = active[vb]
        kept = [m for m in old[vb][1:] + old[vb][:1] if m is not None and m in keep and m != a]
        reps[vb] = list(dict.fromkeys(kept))[:width]
        for m in reps[vb]:
            rcount[m] += 1
    for vb in live:
        while len(reps[vb]) < width:
            best = prefer(vb, rcount, [active[vb], *reps[vb]])
            assert best is not None
            reps[vb].append(best)
            rcount[best] += 1
    # Balance replica copies: move one from the most loaded node to the least loaded where allowed.
    for _ in range(len(live) * max(width, 1) * n):
        hi = max(names, key=lambda m: (rcount[m], -order[m]))
        lo = min(names, key=lambda m: (rcount[m], order[m]))
        if rcount[hi] - rcount[lo] <= 1:
            break
        moved = False
        for vb in live:
            if hi in reps[vb] and lo not in reps[vb] and active[vb] != lo:
                reps[vb][reps[vb].index(hi)] = lo
                rcount[hi] -= 1
                rcount[lo] += 1
                moved = True
                break
        if not moved:
            break
    for vb in live:
        chains[vb] = [active[vb], *reps[vb]]
    for vb, c in enumerate(old):
        if c[0] is None:  # no active copy: nothing to move; nodes leaving are dropped from the chain
            chains[vb] = [m if m in keep else None for m in c][: width + 1]
            chains[vb] += [None] * (width + 1 - len(chains[vb]))
    return chains


def _balance(live: list[int], active: dict[int, str], count: dict[str, int], old: list[list[str | None]],
             order: dict[str, int]) -> None:
    """Move actives from the most to the least loaded node until they differ by at most one, preferring a
    vbucket the receiving node already holds a copy of."""
    names = list(count)
    for _ in range(len(live) * len(names)):
        hi = max(names, key=lambda m: (count[m], -order[m]))
        lo = min(names, key=lambda m: (count[m], order[m]))
        if count[hi] - count[lo] <= 1:
            return
        mine = [vb for vb in live if active[vb] == hi]
        vb = min(mine, key=lambda v: (lo not in old[v], v))
        active[vb] = lo
        count[hi] -= 1
        count[lo] += 1


# ---------------------------------------------------------------------- named connections
@dataclass(frozen=True)
class AddStreamResult:
    """The answer to one ``add_stream`` (matched to its request by ``opaque``)."""

    opaque: int
    vbucket: int
    takeover: bool
    ok: bool
    failover_log: list[FailoverEntry] = field(default_factory=list)
    rollbacks: int = 0
    error: EngineError | None = None


@dataclass
class _PendingAdd:
    opaque: int
    vbucket: int
    takeover: bool
    rollbacks: int = 0


class MigratorConnection:
    """A named connection between the mover and both sides (module docstring; docs/rebalance.md "The mover")."""

    def __init__(self, name: str, source: Bucket, destination: Bucket, opaques: Iterable[int],
                 consumer_name: str | None = None) -> None:
        self.name = name
        # A name stands for one connection: opening an existing name closes the old connection first
        # (docs/rebalance.md "The mover") -- Bucket.dcp_producer closes a producer of the same name.
        self.producer = source.dcp_producer(name)
        # Sync replication (docs/durability.md "Sync writes during a rebalance"): with ``consumer_name`` (the destination node) the connection enables sync writes like the
        # map's replication: prepares / commits / aborts reach the new copies and they seqno-ack as that node
        # (the acks count once the node is in the vbucket's second chain).
        self.consumer = DcpConsumer(name, destination, self.producer, consumer_name=consumer_name)
        self._opaques = iter(opaques)
        self._pending: dict[int, _PendingAdd] = {}
        self._done: list[AddStreamResult] = []
        self.closed = False

    def __repr__(self) -> str:
        return f"MigratorConnection({self.name!r} pending={sorted(self._pending)})"

    def _check(self) -> None:
        if self.closed or self.consumer.closed:
            raise TemporaryFailure(f"connection {self.name!r} is closed")

    def add_stream(self, vbucket: int, *, takeover: bool = False) -> int:
        """Submit an add-stream (docs/rebalance.md "The mover", handshake step 2); returns its opaque. The answer comes later from
        :meth:`completions`, possibly after answers to requests submitted after it."""
        self._check()
        opaque = next(self._opaques)
        self._pending[opaque] = _PendingAdd(opaque, vbucket, takeover)
        return opaque

    def process(self) -> None:
        """One handshake round for every pending add-stream: one stream request each (steps 3-6); an OK
        completes it, a ROLLBACK (the replica rolled back) keeps it pending for the next round."""
        if self.closed:
            return
        for opaque in list(self._pending):
            req = self._pending[opaque]
            try:
                entries = self.consumer.request_stream(req.vbucket, takeover=req.takeover)
            except EngineError as e:
                del self._pending[opaque]
                self._done.append(AddStreamResult(opaque, req.vbucket, req.takeover, False, [], req.rollbacks, e))
                continue
            if entries is None:
                req.rollbacks += 1
                continue
            del self._pending[opaque]
            self._done.append(AddStreamResult(opaque, req.vbucket, req.takeover, True, entries, req.rollbacks))

    def completions(self) -> list[AddStreamResult]:
        """Answers in completion order (take them: each is returned once)."""
        out, self._done = self._done, []
        return out

    def answer(self, opaque: int) -> AddStreamResult | None:
        """Take the answer to request ``opaque`` if it came (the others stay for :meth:`completions`)."""
        for i, r in enumerate(self._done):
            if r.opaque == opaque:
                return self._done.pop(i)
        return None

    def pending(self) -> list[int]:
        return sorted(self._pending)

    def close_stream(self, vbucket: int) -> None:
        """Closing a stream (docs/rebalance.md "The mover"): both sides close at once (the consumer refuses anything still on the
        wire for it); the answer is immediate."""
        for opaque in [o for o, r in self._pending.items() if r.vbucket == vbucket]:
            del self._pending[opaque]
        if not self.closed:
            self.consumer.close_stream(vbucket)

    def stream_state(self, vbucket: int) -> tuple[bool, StreamEndReason | None]:
        """(open, end reason) of the consumer side's stream for ``vbucket``."""
        s = self.consumer.streams.get(vbucket)
        if s is None:
            return False, None
        return s.state is PassiveState.READING, s.end_reason

    def takeover_estimate(self, vbucket: int) -> int:
        """kv_engine ``stats dcp-vbtakeover``: items left to send on this connection's stream."""
        self._check()
        return int(self.producer.takeover_stats(vbucket)["estimate"])

    def step(self, max_messages: int = 4096) -> int:
        if self.closed:
            return 0
        n = self.consumer.step(max_messages)
        # sync replication: what a flush made durable is acked too (persist levels), as the map's connections do
        self.consumer.acknowledge_seqnos()
        return n

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._pending.clear()
            self.consumer.close()


# ---------------------------------------------------------------------- one vbucket move
class MovePhase(Enum):
    BUILD = "build"  # streams to the new copies being added
    BACKFILL = "backfill"  # waiting for the takeover estimate < 1000
    PERSIST = "persist"  # waiting for persistence on the new copies
    SETTLE = "settle"  # writes stopped: every new copy catches up with the active's high seqno
    TAKEOVER = "takeover"  # the takeover stream runs
    DONE = "done"


@dataclass
class VBucketMove:
    """One vbucket's move from ``old`` to ``new`` chain (module docstring)."""

    vbucket: int
    old: list[str | None]
    new: list[str | None]
    phase: MovePhase = MovePhase.BUILD
    #: nodes the mover feeds (new copies, and the takeover target): node -> opaque of its add-stream, or
    #: None once the stream is open
    fed: dict[str, int | None] = field(default_factory=dict)
    persist_target: int = 0
    takeover_opaque: int | None = None
    takeover_attempts: int = 0
    takeover_deadline: float = 0.0
    reverts: int = 0
    items_left: int = 0

    @property
    def source(self) -> str:
        a = self.old[0]
        assert a is not None
        return a

    @property
    def target(self) -> str:
        a = self.new[0]
        assert a is not None
        return a

    @property
    def takeover(self) -> bool:
        return self.source != self.target


@dataclass(frozen=True)
class RebalanceProgress:
    """Where a rebalance stands: ``status`` running / done / failed, vbuckets moved of ``total``, the moves
    in flight with their phase, items left to send on the mover's streams (the takeover estimates)."""

    status: str
    total: int
    moved: int
    moving: dict[int, str]
    items_left: int
    revision: int
    nodes: list[str]
    reverts: int = 0
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"status": self.status, "total": self.total, "moved": self.moved,
                "moving": {str(k): v for k, v in self.moving.items()}, "items_left": self.items_left,
                "revision": self.revision, "nodes": self.nodes, "reverts": self.reverts, "error": self.error}


class Rebalance:
    """A running rebalance (ns_server's orchestrator + vbucket mover) over an in-process
    :class:`~engine.cluster.local.Cluster`: the mover holds the named connections itself. :meth:`step` does a bounded
    amount of work; the cluster's ``pump`` calls it. :class:`ProcessRebalance` is the node-process variant."""

    def __init__(
        self, cluster: RebalanceCluster, add: Sequence[str], remove: Sequence[str], *,
        concurrent_moves: int = DEFAULT_CONCURRENT_MOVES,
        progress: Callable[[RebalanceProgress], None] | None = None,
        messages_per_step: int = DEFAULT_MESSAGES_PER_STEP,
    ) -> None:
        if concurrent_moves < 1:
            raise InvalidArgument("concurrent_moves must be >= 1")
        if messages_per_step < 1:
            raise InvalidArgument("messages_per_step must be >= 1")
        #: DCP messages each mover connection moves per step: bounds the work a step adds to the pump loop
        self.messages_per_step = messages_per_step
        self.cluster = cluster
        self.add = list(add)
        self.remove = list(remove)
        self.concurrent_moves = concurrent_moves
        self.on_progress = progress
        #: the planner's answer (pure, :func:`plan_rebalance`); this object is the mover that carries it out
        self.plan = plan_rebalance(cluster.vbucket_map(), self.add, self.remove)
        self.final_nodes = list(self.plan.nodes)
        self.queue: list[VBucketMove] = [VBucketMove(m.vbucket, list(m.old), list(m.new)) for m in self.plan.moves]
        self.total = len(self.queue)
        self.running: list[VBucketMove] = []
        self.moved = 0
        self.reverts = 0
        self.status = "running"
        self.error: str | None = None
        self.connections: dict[str, MigratorConnection] = {}
        self._opaques = itertools.count(1)
        self.rounds = 0

    # ------------------------------------------------------------------ connections (in process)
    def connection(self, src: str, dst: str) -> MigratorConnection:
        """The mover's connection ``rebalance:<src>-><dst>`` (one per node pair, many streams on it)."""
        name = f"rebalance:{src}->{dst}"
        conn = self.connections.get(name)
        if conn is None or conn.closed or conn.consumer.closed:
            if conn is not None:
                conn.close()
            src_bucket, dst_bucket = self.cluster.node_control(src), self.cluster.node_control(dst)
            if not isinstance(src_bucket, Bucket) or not isinstance(dst_bucket, Bucket):
                raise InvalidArgument("the in-process mover needs in-process nodes")
            conn = MigratorConnection(name, src_bucket, dst_bucket, self._opaques, consumer_name=dst)
            self.connections[name] = conn
        return conn

    def _feed(self, move: VBucketMove) -> None:
        """Submit the add-streams of the fed copies (docs/rebalance.md "The mover", the stream handshake)."""
        for n in move.fed:
            move.fed[n] = self.connection(move.source, n).add_stream(move.vbucket)

    def _pump_connections(self) -> None:
        for conn in list(self.connections.values()):
            conn.process()
        for conn in sorted(self.connections.values(), key=lambda x: x.name):
            try:
                conn.step(self.messages_per_step)
            except EngineError:
                # A message the consumer could not apply (e.g. a takeover state change refused): the
                # connection is replaced (same name: the old one is closed) and the moves re-add their
                # streams; takeover moves check both sides' states and revert (docs/rebalance.md "The mover").
                conn.close()

    def _collect(self, move: VBucketMove) -> bool:
        """Take the add-stream answers for this move; True when every fed stream is open."""
        ok = True
        for n, opaque in list(move.fed.items()):
            conn = self.connection(move.source, n)
            if opaque is None:
                is_open, reason = conn.stream_state(move.vbucket)
                if not is_open and reason is not StreamEndReason.OK:
                    move.fed[n] = conn.add_stream(move.vbucket)  # connection replaced or stream ended: again
                    ok = False
                continue
            ok = False
            if opaque not in conn.pending():
                # Answered (completions are matched by opaque; answers of other moves are kept for them).
                res = conn.answer(opaque)
                if res is None:
                    move.fed[n] = conn.add_stream(move.vbucket)  # lost with a replaced connection
                elif res.ok:
                    move.fed[n] = None
                elif isinstance(res.error, (NotMyVBucket, TemporaryFailure)):
                    move.fed[n] = conn.add_stream(move.vbucket)
                else:
                    raise res.error if res.error is not None else TemporaryFailure("add stream failed")
        return ok and all(o is None for o in move.fed.values())

    def _estimates(self, move: VBucketMove) -> list[int]:
        return [self.connection(move.source, n).takeover_estimate(move.vbucket) for n in move.fed]

    def _begin_takeover(self, move: VBucketMove) -> None:
        conn = self.connection(move.source, move.target)
        conn.close_stream(move.vbucket)
        move.takeover_opaque = conn.add_stream(move.vbucket, takeover=True)
        move.fed[move.target] = None

    def _takeover_result(self, move: VBucketMove) -> bool | None:
        """None while the takeover stream runs; else whether it ended OK."""
        vb = move.vbucket
        conn = self.connection(move.source, move.target)
        if move.takeover_opaque is not None:
            if move.takeover_opaque in conn.pending():
                return None
            res = conn.answer(move.takeover_opaque)
            move.takeover_opaque = None
            if res is None or not res.ok:
                return False
        is_open, reason = conn.stream_state(vb)
        if is_open:
            move.items_left = conn.takeover_estimate(vb) if not conn.consumer.closed else 0
            return None
        return reason is StreamEndReason.OK

    def _cancel_takeover(self, move: VBucketMove) -> None:
        conn = self.connection(move.source, move.target)
        conn.close_stream(move.vbucket)
        with contextlib.suppress(NotMyVBucket):
            conn.producer.discard_stream(move.vbucket)

    def _refeed_target(self, move: VBucketMove) -> None:
        move.fed[move.target] = self.connection(move.source, move.target).add_stream(move.vbucket)

    def _release(self, move: VBucketMove) -> None:
        for n in move.fed:
            self.connection(move.source, n).close_stream(move.vbucket)

    def _close_connections(self) -> None:
        for conn in self.connections.values():
            conn.close()

    # ------------------------------------------------------------------ progress
    @property
    def done(self) -> bool:
        return self.status != "running"

    def progress(self) -> RebalanceProgress:
        vbmap = self.cluster.vbucket_map()
        return RebalanceProgress(
            self.status, self.total, self.moved, {m.vbucket: m.phase.value for m in self.running},
            sum(m.items_left for m in self.running), vbmap.revision, list(vbmap.nodes), self.reverts, self.error)

    # ------------------------------------------------------------------ driving
    def step(self) -> RebalanceProgress:
        """Advance every running move by what is possible now, start new moves, and finish when all moved."""
        if self.done:
            return self.progress()
        self.rounds += 1
        c = self.cluster
        down = [n for n in self._involved() if not c.node_up(n)]
        if down:
            self.abort(f"node(s) {', '.join(sorted(down))} down: rebalance stopped")
            return self.progress()
        try:
            while self.queue and len(self.running) < self.concurrent_moves:
                move = self.queue.pop(0)
                self.running.append(move)
                self._start(move)
            self._pump_connections()
            for move in list(self.running):
                self._advance(move)
                if move.phase is MovePhase.DONE:
                    self.running.remove(move)
                    self.moved += 1
            if not self.queue and not self.running:
                self._finish()
        except EngineError as e:
            self.abort(f"{type(e).__name__}: {e}")
        p = self.progress()
        if self.on_progress is not None:
            self.on_progress(p)
        return p

    def _involved(self) -> set[str]:
        out: set[str] = set(self.add)
        for m in itertools.chain(self.running, self.queue):
            out.update(n for n in m.old if n is not None)
            out.update(n for n in m.new if n is not None)
        return out

    def _start(self, move: VBucketMove) -> None:
        c = self.cluster
        vb = move.vbucket
        if move.old[0] is None:
            self._switch(move)  # no active copy to move data from: only the chain changes
            return
        fed = [n for n in move.new if n is not None and n not in move.old]
        if move.takeover and move.target not in fed:
            fed.append(move.target)  # an existing replica becomes the active: the takeover stream feeds it
        for n in fed:
            info = c.node_control(n).vbucket_info(vb)
            if info.state is not VBucketState.REPLICA:
                c.set_vbucket_state(n, vb, VBucketState.REPLICA)
            move.fed[n] = None
        c.begin_move(vb, move.fed)  # the map's replication leaves these streams to the mover
        c.rewire()
        self._feed(move)

    def _advance(self, move: VBucketMove) -> None:
        if move.phase is MovePhase.DONE:
            return
        c = self.cluster
        vb = move.vbucket
        src = c.node_control(move.source)
        if move.phase is MovePhase.TAKEOVER:
            self._advance_takeover(move)
            return
        if not self._collect(move):
            return
        estimates = self._estimates(move)
        move.items_left = sum(estimates)
        if move.phase is MovePhase.BUILD:
            move.phase = MovePhase.BACKFILL
        if move.phase is MovePhase.BACKFILL:
            # docs/rebalance.md "The mover", backfill phase: fewer than 1000 items left -> almost up to date.
            if any(e >= ALMOST_CAUGHT_UP_ITEMS for e in estimates):
                return
            move.persist_target = src.vbucket_info(vb).high_seqno
            move.phase = MovePhase.PERSIST
            self._set_second_chain(move)
        if move.phase is MovePhase.PERSIST:
            # Persist phase (ns_server's "wait for persistence"): the new copies persist up to that seqno.
            if any(c.node_control(n).vbucket_info(vb).snapshot_persisted < move.persist_target for n in move.fed):
                return
            c.block_writes(vb)  # front-end writes answer TMPFAIL from here to the map change
            move.phase = MovePhase.SETTLE
        if move.phase is MovePhase.SETTLE:
            # Every copy of the new chain holds the active's high seqno, complete and persisted: a write
            # acknowledged as replicated before the move is on every copy after it.
            info = src.vbucket_info(vb)
            if info.persisted_seqno < info.high_seqno:
                return
            for n in move.new[1:] + ([move.target] if move.takeover else []):
                if n is None or n == move.source:
                    continue
                ri = c.node_control(n).vbucket_info(vb)
                if ri.high_seqno != info.high_seqno or ri.snapshot_persisted < info.high_seqno:
                    return
            if not move.takeover:
                self._switch(move)
                return
            move.takeover_attempts += 1
            self._begin_takeover(move)
            move.phase = MovePhase.TAKEOVER

    def _advance_takeover(self, move: VBucketMove) -> None:
        c = self.cluster
        vb = move.vbucket
        ended_ok = self._takeover_result(move)
        if ended_ok is None:
            return
        # The stream ended (OK after the active message) or failed: the mover checks the states of both
        # sides; anything but (dead, active) goes back to the original states.
        old = c.node_control(move.source).vbucket_info(vb).state
        new = c.node_control(move.target).vbucket_info(vb).state
        if ended_ok and old is VBucketState.DEAD and new is VBucketState.ACTIVE:
            # The nodes changed their own states: the manager's recorded state CASes are stale; read afresh.
            c.refresh_state_cas(move.source, vb)
            c.refresh_state_cas(move.target, vb)
            self._switch(move)
            return
        self._revert(move)

    def _revert(self, move: VBucketMove) -> None:
        """Put both sides back to their original states (old active, new replica) and retry (docs/rebalance.md
        "The mover", takeover phase)."""
        c = self.cluster
        vb = move.vbucket
        self.reverts += 1
        move.reverts += 1
        self._cancel_takeover(move)
        if c.node_control(move.source).vbucket_info(vb).state is not VBucketState.ACTIVE:
            c.set_vbucket_state(move.source, vb, VBucketState.ACTIVE)
        if c.node_control(move.target).vbucket_info(vb).state is not VBucketState.REPLICA:
            c.set_vbucket_state(move.target, vb, VBucketState.REPLICA)
        if move.takeover_attempts >= MAX_TAKEOVER_ATTEMPTS:
            raise TemporaryFailure(f"vbucket {vb}: takeover failed {move.takeover_attempts} times")
        self._refeed_target(move)
        move.phase = MovePhase.BACKFILL  # writes stay stopped; SETTLE is reached again once caught up

    def _set_second_chain(self, move: VBucketMove) -> None:
        """kv_engine / ns_server: in the later stages of a move the active gets a topology of two chains, the
        map's and the post-move one, so a sync write acknowledged from now on is durable on the new chain too
        (the new copies seqno-ack over the mover's streams). Kept across a reverted takeover; dropped when the
        map changes (switch) or the move is stopped."""
        c = self.cluster
        if list(move.new) != list(move.old):
            c.set_second_chain(move.vbucket, move.new)
            c.rewire()

    def _switch(self, move: VBucketMove) -> None:
        """The map gets the new chain (revision + 1: clients follow), old copies become dead, the new copies
        replicate from the new active through the map's connections."""
        c = self.cluster
        vb = move.vbucket
        c.clear_second_chain(vb)
        self._release(move)
        chains = [list(ch) for ch in c.vbucket_map().chains]
        chains[vb] = list(move.new)
        c.commit_map(c.vbucket_map().with_chains(chains))
        for old in move.old:
            if (old is not None and old not in move.new and c.node_up(old)
                    and c.node_control(old).vbucket_info(vb).state is not VBucketState.DEAD):
                c.set_vbucket_state(old, vb, VBucketState.DEAD)
        for rep in move.new[1:]:
            # e.g. the old active kept as a replica: dead after its takeover, it replicates from the new one
            if (rep is not None and c.node_up(rep)
                    and c.node_control(rep).vbucket_info(vb).state is not VBucketState.REPLICA):
                c.set_vbucket_state(rep, vb, VBucketState.REPLICA)
        c.end_move(vb)
        c.rewire()
        move.items_left = 0
        move.phase = MovePhase.DONE

    def _finish(self) -> None:
        c = self.cluster
        self._close_connections()
        vbmap = c.vbucket_map()
        c.commit_map(vbmap.with_chains(vbmap.chains, self.final_nodes))
        for name in self.remove:
            c.eject_node(name)
        self.status = "done"
        c.rebalance_ended(self)
        c.rewire()

    def abort(self, reason: str) -> None:
        """Stop: every move in flight goes back to its original states (takeovers reverted, copies built
        for it but not in the map dead); the map keeps the moves already done."""
        c = self.cluster
        with contextlib.suppress(EngineError):
            self._close_connections()
        for move in self.running:
            vb = move.vbucket
            chain = c.vbucket_map().chains[vb]
            with contextlib.suppress(EngineError):
                if (move.phase is MovePhase.TAKEOVER and c.node_up(move.source)
                        and c.node_control(move.source).vbucket_info(vb).state is not VBucketState.ACTIVE):
                    c.set_vbucket_state(move.source, vb, VBucketState.ACTIVE)
            for n in move.fed:
                if not c.node_up(n):
                    continue
                with contextlib.suppress(EngineError):
                    want = VBucketState.REPLICA if n in chain else VBucketState.DEAD
                    if c.node_control(n).vbucket_info(vb).state is not want:
                        c.set_vbucket_state(n, vb, want)
            c.end_move(vb)
        self.running.clear()
        self.queue.clear()
        self.status = "failed"
        self.error = reason
        c.rebalance_ended(self)
        with contextlib.suppress(EngineError):
            c.rewire()


__all__ = [
    "AddStreamResult", "MigratorConnection", "MovePhase", "PlannedMove", "Rebalance",
    "RebalanceCluster", "RebalancePlan", "RebalanceProgress", "VBucketMove", "plan_chains", "plan_rebalance",
]
