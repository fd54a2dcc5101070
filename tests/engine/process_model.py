"""Test helpers for the cluster of node processes: a DCP client following the map over TCP, and checks."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from types import TracebackType

from engine import NotMyVBucket, RollbackRequired, TemporaryFailure
from engine.network.process_cluster import ProcessCluster
from engine.network.remote import RemoteDcpProducer
from tests.engine.cluster_model import MapFollower
from tests.engine.dcp_model import SnapshotConsumer


class ProcessClusterClient(MapFollower):
    """``cluster_model.ClusterClient`` over the network: a snapshot-aware DCP client (``SnapshotConsumer``)
    streaming every vbucket from its active node process. When a stream ends other than OK, or its node's
    connection drops (SIGKILL), it falls back to its last committed snapshot boundary, reloads the map and
    re-requests from the new active with its own position, rolling back as often as told."""

    def __init__(self, cluster: ProcessCluster, name: str = "client", *, use_client_log: bool = True) -> None:
        self.cluster = cluster
        self.name = name
        self.consumer = SnapshotConsumer(list(range(cluster.num_vbuckets)), use_client_log=use_client_log)
        self.producers: dict[str, RemoteDcpProducer] = {}
        #: vbucket -> (node, producer) it streams from now
        self.source: dict[int, tuple[str, RemoteDcpProducer]] = {}

    def _reset(self, vb: int) -> None:
        src = self.source.pop(vb, None)
        if src is not None and not src[1].closed:
            with contextlib.suppress(NotMyVBucket, TemporaryFailure):
                src[1].close_stream(vb)
            src[1].discard_stream(vb)
        self._rewind(vb)

    def _drop(self, node: str) -> None:
        p = self.producers.pop(node, None)
        if p is not None:
            p.close()
        for vb in [vb for vb, (n, _p) in self.source.items() if n == node]:
            self._reset(vb)

    def _producer(self, node: str) -> RemoteDcpProducer | None:
        if not self.cluster.node(node).up:
            return None
        p = self.producers.get(node)
        if p is None or p.closed:
            try:
                p = self.cluster.client(node).dcp_producer(self.name, poll_timeout=0.005)
            except TemporaryFailure:
                return None
            self.producers[node] = p
        return p

    def open_streams(self) -> None:
        vbmap = self.cluster.vbucket_map()
        for node in list(self.producers):
            if self.producers[node].closed or node not in self.cluster.nodes or not self.cluster.node(node).up:
                self._drop(node)
        for vb, st, node in self._streams_to_open(vbmap):
            p = self._producer(node)
            if p is None:
                continue
            while True:
                args = st.position.request_args()
                if not self.consumer.use_client_log:
                    args["failover_log"] = None
                try:
                    log = p.stream_request(**args)
                except RollbackRequired as rb:
                    self.consumer.rollback(vb, rb.seqno)
                    continue
                except NotMyVBucket:
                    break
                except TemporaryFailure:
                    self._drop(node)
                    break
                st.position.on_failover_log(log)
                st.open = True
                self.source[vb] = (node, p)
                break

    def poll_once(self) -> int:
        self.open_streams()
        moved = 0
        for node in sorted(self.producers):
            p = self.producers[node]
            try:
                msgs = p.step()
            except TemporaryFailure:
                self._drop(node)
                continue
            self._deliver(p, msgs)
            moved += len(msgs)
        return moved

    def poll(self, quiet_rounds: int = 3, timeout: float = 20.0) -> int:
        """Stream until nothing arrived for ``quiet_rounds`` rounds in a row."""
        n = 0
        quiet = 0
        deadline = time.monotonic() + timeout
        while quiet < quiet_rounds:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: still receiving after {timeout}s")
            k = self.poll_once()
            n += k
            quiet = quiet + 1 if k == 0 else 0
        return n

    def converge(self, expected: dict[bytes, tuple[bytes, int]], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.state() != expected:
            assert time.monotonic() < deadline, self.diff(expected)
            self.poll_once()

    def diff(self, expected: dict[bytes, tuple[bytes, int]]) -> str:
        got = self.state()
        bad = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
        return f"{self.name}: {len(bad)} keys differ, e.g. {[(k, got.get(k), expected.get(k)) for k in bad[:5]]}"

    def rollbacks(self) -> int:
        return sum(len(s.rollbacks) for s in self.consumer.vbs.values())

    def state(self) -> dict[bytes, tuple[bytes, int]]:
        return self.consumer.state()

    def close(self) -> None:
        for p in self.producers.values():
            p.close()
        self.producers.clear()


def actives_state(cluster: ProcessCluster, name: str = "actives-reader") -> dict[bytes, tuple[bytes, int]]:
    """The actives' state, read by a fresh client streaming every vbucket from 0 to its current end."""
    reader = ProcessClusterClient(cluster, name)
    try:
        reader.poll()
        return reader.state()
    finally:
        reader.close()


def assert_replicas_equal_actives(cluster: ProcessCluster) -> None:
    """Every live replica holds its active's high seqno and failover log (after ``settle``)."""
    vbmap = cluster.vbucket_map()
    for vb in range(vbmap.num_vbuckets):
        a = vbmap.active(vb)
        if a is None or not cluster.node(a).up:
            continue
        ai = cluster.client(a).vbucket_info(vb)
        for r in vbmap.replicas(vb):
            if not cluster.node(r).up:
                continue
            ri = cluster.client(r).vbucket_info(vb)
            assert ri.state.value == "replica", (vb, r, ri)
            assert (ri.high_seqno, ri.failover) == (ai.high_seqno, ai.failover), (vb, r, ri, ai)


class BackgroundWriter:
    """A thread writing key ``{prefix}{i % keys}`` = ``value(i)`` through the map while the ``with`` block runs.
    A write refused with TMPFAIL or NOT_MY_VBUCKET (its vbucket blocked while it moves, or the map changed) is
    not acknowledged: counted in ``refused`` and not retried. ``acked`` is the last acknowledged value of every key,
    ``done`` how many writes were acknowledged, ``errors`` what else the thread raised (for the test to check)."""

    def __init__(self, cluster: ProcessCluster, prefix: str, keys: int,
                 value: Callable[[int], bytes] = lambda i: f'{{"i": {i}}}'.encode()) -> None:
        self.cluster = cluster
        self.prefix, self.keys, self.value = prefix, keys, value
        self.acked: dict[str, bytes] = {}
        self.refused = 0
        self.done = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        try:
            while not self._stop.is_set():
                k = f"{self.prefix}{i % self.keys}"
                v = self.value(i)
                try:
                    self.cluster.write(k, v)
                except (TemporaryFailure, NotMyVBucket):
                    self.refused += 1
                    time.sleep(0.002)
                    continue
                self.acked[k] = v
                self.done += 1
                i += 1
        except BaseException as e:  # surfaced by the test
            self.errors.append(e)

    def __enter__(self) -> BackgroundWriter:
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(10)
