"""The gateway process: engine + publisher + checkpoints + background tasks + HTTP API, on one event loop.

The engine and the publisher are synchronous; this module is the edge where time and I/O live. Every engine
call happens on the event loop thread (the engine is single-threaded by design).

With ``cluster_nodes > 1`` the engine is an in-process :class:`~engine.cluster.Cluster`: the pump loop also
drives its replication (``Cluster.pump``), the publisher follows the vbucket map, and the HTTP API can fail a
node over (docs/gateway-cluster.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiohttp import web

from engine import Bucket, InvalidArgument
from engine.cluster import MAP_FILE, Cluster, FailoverReport
from engine.rebalance import Rebalance
from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics
from gateway.publisher import KeyFilter, Publisher
from gateway.records import RecordEncoder, ValueFormat, topic_name
from gateway.resume import CheckpointWriter, ensure_topics, recover_positions

log = logging.getLogger(__name__)


class GatewayService:
    """One bucket streamed into one topic, with its HTTP API."""

    def __init__(self, settings: GatewaySettings, bootstrap_servers: str) -> None:
        self.settings = settings
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic_name(settings.topic_prefix, settings.bucket)
        self.metrics = GatewayMetrics()
        self.bucket: Bucket | None = None
        self.cluster: Cluster | None = None
        #: the rebalance started last through :meth:`rebalance` (running or finished)
        self.last_rebalance: Rebalance | None = None
        self.publisher: Publisher | None = None
        self.checkpoints: CheckpointWriter | None = None
        self.runner: web.AppRunner | None = None
        self.http_port: int = settings.http_port
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self.started_at = 0.0
        self.recovered_records = 0
        #: the error of the last publishing round while rounds fail (e.g. storage full), else None
        self.pump_error: str | None = None

    # ------------------------------------------------------------------ config helpers
    def _client_config(self) -> dict[str, Any]:
        conf = dict(self.settings.admin_config())
        conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    def _producer_config(self) -> dict[str, Any]:
        conf = dict(self.settings.producer_config())
        conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        s = self.settings
        if s.cluster_nodes > 1:
            self.cluster = self._open_cluster()
        else:
            self.bucket = Bucket(s.engine_config())
        nparts = s.create_topic_partitions or s.num_vbuckets
        client = self._client_config()
        loop = asyncio.get_running_loop()
        partitions = await loop.run_in_executor(
            None, ensure_topics, client, self.topic, nparts, s.topic_replication_factor)
        positions = await loop.run_in_executor(
            None, recover_positions, client, self.topic, partitions, s.num_vbuckets)
        origin: Bucket | Cluster | None = self.cluster if self.cluster is not None else self.bucket
        assert origin is not None
        self.publisher = Publisher(
            origin, self._producer_config(), self.topic, partitions,
            RecordEncoder(ValueFormat(s.value_format)), positions,
            stream_from=s.stream_from,
            key_filter=KeyFilter(s.key_filter_prefix, s.key_filter_regex),
            flow_control_bytes=s.flow_control_buffer_bytes,
            rollback_mitigation=s.rollback_mitigation,
            connection_name=f"dcpgw:{s.bucket}",
        )
        self.checkpoints = CheckpointWriter(self._producer_config(), self.topic)
        self.publisher.open()
        from gateway.api import build_app  # local: api imports this module for typing

        app = build_app(self)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, s.http_host, s.http_port)
        await site.start()
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            self.http_port = server.sockets[0].getsockname()[1]
        self.started_at = time.time()
        self._tasks = [
            asyncio.create_task(self._pump_loop(), name="dcpgw-pump"),
            asyncio.create_task(self._every(s.checkpoint_interval_s, self._checkpoint), name="dcpgw-ckpt"),
            asyncio.create_task(self._every(s.expiry_pager_interval_s, self._expiry), name="dcpgw-expiry"),
            asyncio.create_task(self._every(s.compaction_interval_s, self._compact), name="dcpgw-compact"),
        ]
        if not s.rollback_mitigation:
            self._tasks.append(asyncio.create_task(self._every(s.flush_interval_s, self._flush), name="flush"))
        log.info("gateway up: topic %s (%d partitions), http://%s:%d", self.topic, partitions, s.http_host,
                 self.http_port)

    def _open_cluster(self) -> Cluster:
        """The cluster under ``data_dir``: reopened when its map is there, else created with
        ``cluster_nodes`` nodes and ``cluster_replicas`` replicas."""
        s = self.settings
        self.settings.engine_config()  # validates the bucket name / vbucket count the nodes will use
        if (s.data_dir / MAP_FILE).exists():
            cluster = Cluster.open(s.data_dir, name=s.bucket)
            if cluster.num_vbuckets != s.num_vbuckets:
                cluster.close()
                raise InvalidArgument(f"the cluster under {s.data_dir} has {cluster.num_vbuckets} vbuckets, "
                                      f"not {s.num_vbuckets}")
            return cluster
        return Cluster.create(s.data_dir, nodes=s.cluster_nodes, replicas=s.cluster_replicas,
                              num_vbuckets=s.num_vbuckets, seed=None, name=s.bucket)

    def buckets(self) -> list[Bucket]:
        """The live engine buckets (one, or every live node of the cluster)."""
        if self.cluster is not None:
            return [n.bucket for _k, n in sorted(self.cluster.nodes.items()) if n.up and n.bucket is not None]
        return [self.bucket] if self.bucket is not None and not self.bucket.closed else []

    def failover(self, node: str, graceful: bool) -> FailoverReport:
        """Fail ``node`` over (ns_server's hard / graceful failover); the publisher follows on its next pump.
        :class:`InvalidArgument` for an unknown node, a node already failed over, or the last node."""
        c = self.cluster
        if c is None:
            raise InvalidArgument("the gateway runs a single bucket, not a cluster (dcpgw up --nodes N)")
        if node not in c.nodes:
            raise InvalidArgument(f"unknown node {node!r} (nodes: {', '.join(sorted(c.nodes))})")
        vbmap = c.vbucket_map()
        if node in vbmap.nodes and len(vbmap.nodes) <= 1:
            raise InvalidArgument(f"node {node} is the last node of the cluster: it cannot be failed over")
        report = c.failover(node, graceful=graceful)
        self.wake()
        return report

    def rebalance(self, add: list[str], remove: list[str]) -> Rebalance:
        """Start a rebalance (engine/rebalance.py, seed 003): ``add`` nodes in, ``remove`` nodes out.

        It runs **step-wise inside the pump loop**: every ``Cluster.pump`` advances it a bounded amount
        (add-stream handshakes, one batch per mover connection, the moves' checks), interleaved with
        ``Publisher.pump`` on the same event-loop thread, so publishing never waits for it and the in-process
        cluster (not thread-safe) is never touched from another thread. Progress: :attr:`last_rebalance`.
        :class:`InvalidArgument` for bad node sets or a rebalance already running."""
        c = self.cluster
        if c is None:
            raise InvalidArgument("the gateway runs a single bucket, not a cluster (dcpgw up --nodes N)")
        self.last_rebalance = c.start_rebalance(add, remove)
        self.wake()
        return self.last_rebalance

    def wake(self) -> None:
        """Writes happened: the pump loop should run now."""
        self._wake.set()

    async def _pump_loop(self) -> None:
        pub = self.publisher
        assert pub is not None
        cluster = self.cluster
        # With mitigation the cluster's nodes are flushed on every round (the replicas' persistence is what
        # publishing waits for); without it the flush task does it every flush_interval_s.
        flush = self.settings.rollback_mitigation
        idle = 0
        failures = 0
        while not self._stopping.is_set():
            try:
                n = pub.pump()
                if cluster is not None:
                    n += cluster.pump(rounds=1, flush=flush)  # replication: active -> replica DCP streams
                    if cluster.rebalance_running is not None:
                        n += 1  # pump() stepped the rebalance: keep going (yielding to the loop each round)
            except Exception as e:
                # A failed round -- a full disk failing the flush (the engine keeps the items queued and
                # restores its cursors) -- is retried with a backoff; it never ends the loop that publishes
                # (docs/reliability.md "Fault campaign"). Logged once per failure spell.
                if self.pump_error is None:
                    log.error("publishing round failed (retrying until it succeeds): %s: %s", type(e).__name__, e)
                self.pump_error = f"{type(e).__name__}: {e}"
                failures += 1
                await asyncio.sleep(min(1.0, 0.01 * 2 ** min(failures, 7)))
                continue
            if self.pump_error is not None:
                log.warning("publishing round succeeded again after %d failed rounds", failures)
                self.pump_error = None
                failures = 0
            if n:
                idle = 0
                await asyncio.sleep(0)
                continue
            idle = min(idle + 1, 10)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=0.001 * idle)

    async def _every(self, interval: float, fn: Any) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=interval)
            if self._stopping.is_set():
                return
            try:
                fn()
            except Exception:  # a background task must not die silently
                log.exception("background task %s failed", getattr(fn, "__name__", fn))

    def _checkpoint(self) -> None:
        assert self.publisher is not None and self.checkpoints is not None
        cps = self.publisher.take_checkpoints()
        if cps:
            self.checkpoints.write(cps)

    def _expiry(self) -> None:
        if sum(b.run_expiry_pager() for b in self.buckets()):
            self.wake()

    def _compact(self) -> None:
        for b in self.buckets():
            b.compact()

    def _flush(self) -> None:
        if sum(b.flush() for b in self.buckets()):
            self.wake()

    async def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.runner is not None:
            await self.runner.cleanup()
        if self.publisher is not None:
            self.publisher.close(timeout=10)
            self._checkpoint()
        if self.checkpoints is not None:
            self.checkpoints.flush()
        if self.bucket is not None:
            self.bucket.close(clean=True)
        if self.cluster is not None:
            self.cluster.close()
        # Drop the Kafka clients now (librdkafka handles are destroyed with their last reference).
        self.publisher = None
        self.checkpoints = None

    async def run_until_stopped(self) -> None:
        await self._stopping.wait()

    def request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()
