"""A cluster of engine node *processes* (engine/network/server.py) with a cluster manager in ns_server's role.

The fault-test counterpart of the in-process :class:`engine.cluster.local.Cluster`: every node is a separate
``python -m engine.network.server`` process with its own data directory, killed with SIGKILL by :meth:`ProcessCluster.kill`.
The manager owns the revisioned :class:`~engine.cluster.vbucket_map.VBucketMap`, sets vbucket states with the
partition-state CAS, tells every node which replication streams to pull (SET_REPLICATION; the replica side pulls,
as in kv_engine), and fails nodes over with the same rules as the in-process cluster -- the rules live in
:class:`engine.cluster.manager.ClusterManager`, which both share. See docs/cluster.md "Node processes".

Unlike the in-process cluster this one is not deterministic: replication and the flusher run in the nodes on
their own. Tests make replicas lag with :meth:`ProcessCluster.pause_replication` and keep items unpersisted with
:meth:`ProcessCluster.stop_persistence`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import orjson

import engine
from engine.cluster.manager import ClusterManager, NodeControl
from engine.cluster.rebalance import RebalanceProgress
from engine.cluster.recovery import RecoveryReport, RepairCounts
from engine.cluster.vbucket_map import VBucketMap
from engine.config import BucketConfig
from engine.dcp.stream import StreamEnd
from engine.exceptions import (
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    NotMyVBucket,
    SyncWriteInProgress,
    TemporaryFailure,
)
from engine.kv.data_dir import MAP_FILE, STORE_SUFFIX
from engine.kv.durable_file import write_atomically
from engine.kv.item import Item, Op
from engine.kv.vbucket import GetResult, MutationResult, VBucketState, vbucket_of
from engine.network.process_rebalance import ProcessRebalance
from engine.network.remote import NodeUnavailable, RemoteDcpProducer, RemoteNode
from schemas.failover_log import FailoverEntry, rollback_point

log = logging.getLogger(__name__)

_ROOT = Path(engine.__file__).resolve().parents[1]


@dataclass
class NodeProcess:
    """One ``python -m engine.network.server`` child process and a client of it."""

    name: str
    data_dir: Path
    num_vbuckets: int
    config: dict[str, Any] = field(default_factory=dict)
    flush_interval_ms: float = 10.0
    #: flow-control buffer of the node's replication connections (None: the node's default, 10 MiB)
    replication_buffer_bytes: int | None = None
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    client: RemoteNode | None = None
    starts: int = 0
    #: SIGTERM already sent (:meth:`begin_stop`): :meth:`stop` only waits
    stopping: bool = False

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def require(self) -> RemoteNode:
        if not self.up or self.client is None:
            raise NodeUnavailable(f"node {self.name} is down")
        return self.client

    def start(self, timeout: float = 30.0) -> int:
        """Spawn the node (warmup from its data directory) and wait for its READY line; returns the port."""
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> None:
        """Start the node's process without waiting for it (:meth:`wait_ready`): several nodes then import and
        warm up at the same time."""
        if self.up:
            raise InvalidArgument(f"node {self.name} is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "engine.network.server", "--data-dir", str(self.data_dir), "--port", "0",
               "--host", self.host, "--num-vbuckets", str(self.num_vbuckets), "--name", self.name,
               "--flush-interval-ms", str(self.flush_interval_ms), "--parent-pid", str(os.getpid())]
        if self.config:
            cmd += ["--config-json", orjson.dumps(self.config).decode()]
        if self.replication_buffer_bytes is not None:
            cmd += ["--replication-buffer-bytes", str(self.replication_buffer_bytes)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH", "")]))
        log = open(self.data_dir.parent / f"{self.name}.log", "ab")  # noqa: SIM115 -- handed to the child
        try:
            self.proc = subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=log)
        finally:
            log.close()
        self.stopping = False

    def wait_ready(self, timeout: float = 30.0) -> int:
        """Wait for the READY line of the process :meth:`spawn` started; returns the port."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.kill()
                raise TemporaryFailure(f"node {self.name} did not start (see {self.data_dir.parent}/{self.name}.log)")
            # poll(), not select(): select() refuses a descriptor numbered 1024 or more (FD_SETSIZE), which a
            # long-lived manager process with many connections reaches
            poller = select.poll()
            poller.register(self.proc.stdout.fileno(), select.POLLIN | select.POLLHUP)
            if poller.poll(min(left, 0.5) * 1000):
                chunk = os.read(self.proc.stdout.fileno(), 256)
                if not chunk:
                    continue
                line += chunk
        fields = dict(kv.split("=", 1) for kv in line.decode().split()[1:])
        self.port = int(fields["port"])
        self.client = RemoteNode(self.host, self.port)
        self.starts += 1
        return self.port

    def kill(self) -> None:
        """SIGKILL: nothing is flushed, nothing closed -- a crash."""
        if self.client is not None:
            self.client.close()
            self.client = None
        p = self.proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        if p is not None:
            p.wait()
            if p.stdout is not None:
                p.stdout.close()

    def begin_stop(self) -> None:
        """Send SIGTERM (a clean shutdown) without waiting for the exit: :meth:`stop` then waits (several nodes
        shut down at the same time)."""
        if self.client is not None:
            self.client.close()
            self.client = None
        p = self.proc
        if p is not None and p.poll() is None and not self.stopping:
            p.terminate()
            self.stopping = True

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM: a clean shutdown (flushed, clean-shutdown marker); SIGKILL if it does not exit."""
        self.begin_stop()
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if p.stdout is not None:
            p.stdout.close()
        p.wait()


class ProcessCluster(ClusterManager):
    """The cluster manager over node processes."""

    def __init__(
        self, base_dir: Path, nodes: dict[str, NodeProcess], vbmap: VBucketMap, *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(vbmap, monotonic=monotonic)
        self.base_dir = base_dir
        self.nodes = nodes
        #: nodes whose replication was paused by the test (their replica streams are not requested)
        self.paused: set[str] = set()
        #: nodes a rebalance removed (their processes stopped)
        self.ejected: list[str] = []

    # ------------------------------------------------------------------ construction
    @classmethod
    def start(
        cls, base_dir: Path | str, nodes: int = 3, replicas: int = 1, num_vbuckets: int = 64, *,
        seed: int | None = 0, flush_interval_ms: float = 10.0, replication_buffer_bytes: int | None = None,
        **bucket_overrides: Any,
    ) -> ProcessCluster:
        """Spawn ``nodes`` node processes under ``base_dir`` (one data directory each), generate a balanced
        map with ``replicas`` replicas, set every vbucket state from it and start replication.
        ``bucket_overrides`` are :class:`~engine.config.BucketConfig` fields for every node."""
        base = Path(base_dir)
        if type(nodes) is not int or nodes < 1:
            raise InvalidArgument(f"nodes must be >= 1, got {nodes!r}")
        names = [f"n{i}" for i in range(nodes)]
        vbmap = VBucketMap.generate(names, replicas, num_vbuckets)
        members: dict[str, NodeProcess] = {}
        for i, name in enumerate(names):
            opts: dict[str, Any] = {"seed": None if seed is None else seed * 1000 + i}
            opts.update(bucket_overrides)
            members[name] = NodeProcess(name, base / name, num_vbuckets, opts, flush_interval_ms,
                                        replication_buffer_bytes)
        cluster = cls(base, members, vbmap)
        try:
            for name in names:  # every process imports and warms up at the same time
                members[name].spawn()
            for name in names:
                members[name].wait_ready()
            for name in names:
                cluster._apply_states(name)
            cluster._save_map()
            cluster._rewire()
        except BaseException:
            cluster.close(clean=False)
            raise
        return cluster

    def _save_map(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.base_dir / MAP_FILE, self._map.to_json().encode())

    # ------------------------------------------------------------------ ClusterManager hooks
    def _is_up(self, name: str) -> bool:
        return self.nodes[name].up

    def _control(self, name: str) -> NodeControl:
        return self.nodes[name].require()

    def _stop_replication(self, name: str) -> None:
        # Every stream from or to ``name`` stops before anything is promoted (SET_REPLICATION answers once
        # the links no longer wanted have stopped).
        self._rewire(exclude=name)

    def _rewire(self, exclude: str | None = None) -> None:
        """Send every live node the replication streams the map gives it (a replica pulls from its active)."""
        wanted = self.wanted_streams(exclude=exclude)
        # The rebalance mover's streams (engine/network/process_rebalance.py ProcessRebalance): a copy being built or taken
        # over pulls its vbucket from the current active on the same link.
        for vb, fed in sorted(self._moving.items()):
            src = self._map.active(vb)
            if src is None or src == exclude or not self._is_up(src):
                continue
            for dst in sorted(fed):
                if dst != exclude and self._is_up(dst):
                    wanted.setdefault((src, dst), []).append(vb)
        for name in sorted(self.nodes):
            node = self.nodes[name]
            if not node.up:
                continue
            sources: dict[str, tuple[str, int, Sequence[int]]] = {}
            if name not in self.paused:
                for (src, dst), vbs in wanted.items():
                    if dst == name:
                        s = self.nodes[src]
                        sources[src] = (s.host, s.port, vbs)
            with contextlib.suppress(NodeUnavailable):
                node.require().set_replication(sources)
        # sync replication (docs/durability.md): every live active gets its replication chain from the map (ns_server sends it with
        # setVBucketState), so sync writes count the right majority
        for vb, chain in enumerate(self._map.chains):
            a = chain[0]
            if a is None or not self.nodes[a].up or a == exclude:
                continue
            with contextlib.suppress(NodeUnavailable, NotMyVBucket):
                second = self._second_chains.get(vb)
                self.nodes[a].require().set_replication_topology(
                    vb, list(chain), None if second is None else list(second))

    def _wait_progress(self) -> None:
        if self._rebalance is not None:
            self._rebalance.step()
        time.sleep(0.01)

    def _wire(self) -> None:
        self._rewire()

    def _set_map(self, vbmap: VBucketMap) -> None:
        self._map = vbmap
        self._save_map()

    def _eject(self, name: str) -> None:
        node = self.nodes.get(name)
        if node is None:
            return
        if node.up:
            with contextlib.suppress(NodeUnavailable):
                self._apply_states(name)
        node.stop()
        del self.nodes[name]
        self.ejected.append(name)
        self._rewire()

    # ------------------------------------------------------------------ rebalance (engine/cluster/rebalance.py)
    def add_node(self, name: str) -> NodeProcess:
        """Start a new node process ``name`` (data under ``base_dir/name``, the other nodes' settings), all
        its vbuckets dead until a rebalance moves some to it; a node ejected or failed over earlier can come
        back (its old copies re-stream from their position)."""
        self._check_new_node(name)
        existing = self.nodes.get(name)
        if existing is not None and existing.up:
            return existing
        t = next(iter(self.nodes.values()))
        node = NodeProcess(name, self.base_dir / name, t.num_vbuckets, dict(t.config), t.flush_interval_ms,
                           t.replication_buffer_bytes, t.host)
        node.start()
        self.nodes[name] = node
        if name in self.ejected:
            self.ejected.remove(name)
        self._apply_states(name)
        return node

    def start_rebalance(
        self, add: Sequence[str] = (), remove: Sequence[str] = (), *,
        progress: Callable[[RebalanceProgress], None] | None = None, concurrent_moves: int = 1,
    ) -> ProcessRebalance:
        """As :meth:`engine.cluster.local.Cluster.start_rebalance` over node processes; :meth:`rebalance` drives it
        (the nodes replicate on their own; the manager polls). One move at a time by default: every move
        changes the replication links (SET_REPLICATION restarts a link whose vbucket set changed), which
        would cut another move's takeover stream on the same link."""
        add, remove = self._check_rebalance(add, remove)
        for n in add:
            self.add_node(n)
        if add:
            self._set_map(self._map.with_chains(self._map.chains, list(self._map.nodes) + add))
        reb = ProcessRebalance(self, add, remove, concurrent_moves=concurrent_moves, progress=progress)
        self._rebalance = reb
        for n in add:
            if n in self.failed:
                self.failed.remove(n)
        return reb

    def _after_failover(self, name: str) -> None:
        self._save_map()
        self._rewire()

    # ------------------------------------------------------------------ recovery (docs/cluster.md "Delta recovery")
    def recover(self, name: str, mode: str = "delta") -> RecoveryReport:
        """:meth:`engine.cluster.local.Cluster.recover` over node processes: the node process is started from its
        data directory when down (wiped first for ``full``; a full recovery when the directory is gone), put back
        into the map as a replica of what it held at failover, its copies repaired (below) and then wired: the
        node's replication link makes the stream requests, rolls back (to exactly the branch point within its own
        former active writes, ``Bucket.rollback_vbucket``) and streams the difference.

        The repair runs in the manager before the wiring (a node's replication link cannot write to another
        node): the branch point is the producer's rollback decision (``rollback_point``) on the two copies'
        failover logs; the copy's versions above it and the active's keys changed above it are read by DCP
        streams, and each repair is a CAS-guarded SET / DELETE on the active (a key the active does not hold is
        SET without a CAS). Over the memcached protocol the revision is the active's next one, not the copy's
        (no SET_WITH_META here)."""
        t0 = self._monotonic()
        self._check_recover(name, mode)
        node = self.node(name)
        bucket = str(node.config.get("name", BucketConfig.model_fields["name"].default))
        store = node.data_dir / f"{bucket}{STORE_SUFFIX}"
        requested, message = mode, ""
        if not store.exists():
            if mode == "delta":
                message = (f"the data directory of node {name} ({node.data_dir}) is gone: full recovery "
                           f"(every copy streamed from zero)")
                log.warning("recovery of %s: %s", name, message)
            mode = "full"
            node.kill()
        elif mode == "full":
            node.stop()
        if mode == "full":
            for f in node.data_dir.glob(f"{bucket}{STORE_SUFFIX}*"):
                f.unlink()  # full recovery: the node starts empty (ns_server wipes it)
        if not node.up:
            node.kill()  # reap a process that died on its own
            node.start()
        report = self._place_recovered(name, mode, requested, message)
        self._apply_states(name)
        if mode == "delta":
            for vb in report.replicas:
                try:
                    counts = self._repair_copy(name, vb, repair=report.rollback_repair)
                except (NodeUnavailable, TemporaryFailure, NotMyVBucket) as e:
                    log.warning("recovery of %s: vbucket %d not repaired: %s", name, vb, e)
                    continue
                if counts is None:
                    continue  # on the active's history: no rollback
                report.rollbacks += 1  # carried out by the node's replication link
                report.add(counts)
                self.recovery_counts.add(counts)
        self._rewire()
        report.seconds = self._monotonic() - t0
        log.info("recovery of %s (%s): %s", name, mode, report.to_json())
        return report

    def _read_stream(self, node: str, conn: str, vb: int, start: int, end: int, log_: list[FailoverEntry],
                     timeout: float = 30.0) -> dict[bytes, Item]:
        """The newest version of every key of ``vb`` on ``node`` with a seqno in (``start``, ``end``], by DCP."""
        out: dict[bytes, Item] = {}
        if end <= start:
            return out
        p = self.client(node).dcp_producer(conn)
        try:
            p.stream_request(vb, start, end, log_[0].vbuuid, start, start, failover_log=log_)
            deadline = self._monotonic() + timeout
            while True:
                for m in p.step():
                    if isinstance(m, StreamEnd):
                        return out
                    if type(m) is Item and m.op < Op.PREPARE and m.seqno > start:
                        out[m.key] = m
                if self._monotonic() > deadline:
                    raise TemporaryFailure(f"{conn}: vbucket {vb} not read within {timeout:.0f}s")
        finally:
            p.close()

    def _repair_copy(self, name: str, vb: int, *, repair: bool) -> RepairCounts | None:
        """The rollback repair of ``name``'s copy of ``vb`` against its active (docs/cluster.md "Rollback
        repair"), before the copy's stream request; None when the copy will not roll back."""
        counts = RepairCounts()
        active = self._map.active(vb)
        if active is None or not self._is_up(active):
            return None
        ni = self.client(name).vbucket_info(vb)
        ai = self.client(active).vbucket_info(vb)
        nlog = [FailoverEntry(u, s) for u, s in ni.failover]
        alog = [FailoverEntry(u, s) for u, s in ai.failover]
        start = ni.high_seqno
        snap = min(ni.snapshot_complete, start)
        since = rollback_point(server_log=alog, client_log=nlog, start_seqno=start, high_seqno=ai.high_seqno,
                               snap_start=snap, snap_end=start, purge_seqno=0)
        if since is None or since >= start:
            return None
        mine = self._read_stream(name, f"recovery:{name}", vb, since, start, nlog)
        if not repair:
            counts.discarded = len(mine)
            return counts
        changed = self._read_stream(active, f"recovery:{name}:{active}", vb, since, ai.high_seqno, alog)
        client = self.client(active)
        for key, it in sorted(mine.items(), key=lambda kv: kv[1].seqno):
            if key in changed:
                counts.superseded += 1
                continue
            try:
                cur: GetResult | None = client.get(key, vbucket=vb)
            except KeyNotFound:
                cur = None
            try:
                if it.op is Op.MUTATION:
                    assert it.value is not None
                    client.set(key, it.value, vbucket=vb, cas=0 if cur is None else cur.cas, flags=it.flags,
                               expiry=it.expiry)
                elif cur is not None:
                    client.delete(key, vbucket=vb, cas=cur.cas)
            except (KeyExists, KeyNotFound, SyncWriteInProgress):
                counts.superseded += 1  # changed meanwhile: the active's version wins
                continue
            counts.repaired += 1
        log.info("recovery of %s: vbucket %d above seqno %d: %d repaired, %d superseded", name, vb, since,
                 counts.repaired, counts.superseded)
        return counts

    # ------------------------------------------------------------------ access
    def node(self, name: str) -> NodeProcess:
        try:
            return self.nodes[name]
        except KeyError:
            raise InvalidArgument(f"unknown node {name!r}") from None

    def client(self, name: str) -> RemoteNode:
        """The front-end / admin client of node ``name`` (NodeUnavailable when down)."""
        return self.node(name).require()

    def vbucket_of(self, key: bytes | str) -> int:
        k = key.encode() if isinstance(key, str) else bytes(key)
        return vbucket_of(k, self._map.num_vbuckets)

    def active_client(self, vbucket: int) -> RemoteNode:
        """The client of ``vbucket``'s active node per the map (NotMyVBucket if it has none, NodeUnavailable
        if that node is down)."""
        return self.nodes[self.active_node(vbucket)].require()

    def dcp_producer(self, node: str, name: str, **kwargs: Any) -> RemoteDcpProducer:
        return self.client(node).dcp_producer(name, **kwargs)

    # ------------------------------------------------------------------ front end (routed by the map)
    def _route(self, key: bytes | str, write: bool) -> tuple[RemoteNode, int]:
        vb = self.vbucket_of(key)
        if write:
            self._check_blocked(vb)
        return self.active_client(vb), vb

    def write(self, key: bytes | str, value: bytes | str, **kwargs: Any) -> MutationResult:
        client, vb = self._route(key, True)
        return client.set(key, value, vbucket=vb, **kwargs)

    def get(self, key: bytes | str) -> GetResult:
        client, vb = self._route(key, False)
        return client.get(key, vbucket=vb)

    def delete(self, key: bytes | str, *, cas: int = 0) -> MutationResult:
        client, vb = self._route(key, True)
        return client.delete(key, vbucket=vb, cas=cas)

    # ------------------------------------------------------------------ faults and test controls
    def kill(self, name: str) -> None:
        """SIGKILL node ``name``: what it had not persisted is lost; its connections drop (a running
        rebalance stops, as in ns_server)."""
        self.node(name).kill()
        self._abort_rebalance(f"node {name} down")

    def restart(self, name: str) -> None:
        """Start a down node again (warmup; after a SIGKILL its actives get a failover entry), set its states
        from the map -- with stale CASes the manager detects and retries -- and rewire replication (its port
        changed)."""
        node = self.node(name)
        if node.up:
            raise InvalidArgument(f"node {name} is already up")
        node.kill()  # reap a process that died on its own
        node.start()
        self._apply_states(name)  # the CASes recorded before the crash are stale: detected and retried
        self._rewire()

    def pause_replication(self, nodes: Iterable[str] | None = None) -> None:
        """Stop the replication streams into ``nodes`` (default: all): their replicas lag."""
        self.paused.update(self.nodes if nodes is None else nodes)
        self._rewire()

    def resume_replication(self, nodes: Iterable[str] | None = None) -> None:
        self.paused.difference_update(self.nodes if nodes is None else set(nodes))
        self._rewire()

    def stop_persistence(self, name: str) -> None:
        """STOP_PERSISTENCE on node ``name``: nothing more reaches its disk until started again."""
        self.client(name).stop_persistence()

    def start_persistence(self, name: str) -> None:
        self.client(name).start_persistence()

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until every live replica holds its live active's high seqno in a complete snapshot and both
        persisted it (TemporaryFailure after ``timeout``)."""
        deadline = self.monotonic_time() + timeout
        while True:
            if all(self._caught_up(vb) for vb in range(self._map.num_vbuckets)
                   if self._map.active(vb) is not None and self._is_up(self._map.active(vb) or "")):
                return
            if self.monotonic_time() > deadline:
                raise TemporaryFailure("replication did not settle")
            time.sleep(0.02)

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, clean: bool = True) -> None:
        """Stop every node process (SIGTERM, clean shutdown; SIGKILL with ``clean=False``)."""
        if clean:
            for name in sorted(self.nodes):  # every node shuts down at the same time
                self.nodes[name].begin_stop()
        for name in sorted(self.nodes):
            node = self.nodes[name]
            if clean:
                node.stop()
            else:
                node.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(clean=exc[0] is None)

    def failover_entry(self, name: str, vbucket: int) -> FailoverEntry:
        """The newest failover entry of ``vbucket`` on node ``name``."""
        return self.client(name).failover_log(vbucket)[0]

    def vbucket_state(self, name: str, vbucket: int) -> VBucketState:
        return self.client(name).vbucket_state(vbucket)


__all__ = ["MAP_FILE", "NodeProcess", "ProcessCluster"]
