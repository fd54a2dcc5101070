"""The gateway process: engine + publisher + checkpoints + background tasks + HTTP API, on one event loop.

The engine and the publisher are synchronous; this module is the edge where time and I/O live. Every engine
call happens on the event loop thread (the engine is single-threaded by design).

With ``cluster_nodes > 1`` the engine is an in-process :class:`~engine.cluster.local.Cluster`: the pump loop also
drives its replication (``Cluster.pump``), the publisher follows the vbucket map, and the HTTP API can fail a
node over (docs/gateway-cluster.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import ssl
import threading
import time
from typing import Any, Final

from aiohttp import web

from engine import Bucket, InvalidArgument, TemporaryFailure
from engine import compiled as engine_build
from engine.cluster.local import Cluster, FailoverReport
from engine.cluster.rebalance import Rebalance
from engine.cluster.recovery import RecoveryReport
from engine.kv.data_dir import DataDirLock, Layout, check_layout
from engine.network.server import FLUSH_POLL_S
from engine.security import UserStore, server_context
from gateway.config import GatewaySettings
from gateway.exceptions import Backpressure, GatewayError, StartupInterrupted
from gateway.group_host import GroupHost
from gateway.health import Readiness, UnackedWrites
from gateway.kafka.client_log import ClientLog, with_client_log
from gateway.kv_cluster import ClusterKvPorts, start_cluster_kv_ports
from gateway.kv_port import KVServer, start_kv_port
from gateway.metrics import GatewayMetrics
from gateway.publisher import DEFAULT_LARGE_RECORD_BYTES, KeyFilter, ProducerFailed, Publisher, TopicLost
from gateway.resume import (
    CheckpointWriter,
    PublishPosition,
    ensure_topics,
    recover_positions,
    replay_tail,
    topic_record_limit,
    wait_for_kafka,
)
from schemas.codec import RecordEncoder
from schemas.records import ValueFormat
from schemas.topics import topic_name

log = logging.getLogger(__name__)

#: DCP messages one round of the service's loop steps (and as many held ones it releases) at most: ~15-20 ms of
#: the loop's thread, which also serves the HTTP API and the KV port (a landed background flush holds up to
#: 16,384 persisted items: ~0.25 s in one go)
LOOP_PUMP_MESSAGES: Final = 256
#: while records move, the loop drops acknowledged writes from the backpressure count at most this often
UNACKED_RELEASE_S: Final = 0.005


def _close_opened(setup: asyncio.Task[dict[str, Bucket]]) -> None:
    """The engines a rebalance opened for a request that went away."""
    if not setup.cancelled() and setup.exception() is None:
        for b in setup.result().values():
            b.close()


class GatewayService:
    """One bucket streamed into one topic, with its HTTP API."""

    def __init__(self, settings: GatewaySettings, bootstrap_servers: str, *,
                 data_dir_lock: DataDirLock | None = None) -> None:
        self.settings = settings
        #: the exclusive lock on ``settings.data_dir`` (docs/reliability.md "Data directory"): taken by
        #: :meth:`start` unless the caller took it already (``dcpgw up`` does, before starting a broker)
        self.data_dir_lock = data_dir_lock
        self._own_lock = data_dir_lock is None
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic_name(settings.topic_prefix, settings.bucket)
        self.metrics = GatewayMetrics()
        self.bucket: Bucket | None = None
        self.cluster: Cluster | None = None
        #: the rebalance started last through :meth:`rebalance` (running or finished)
        self.last_rebalance: Rebalance | None = None
        #: the engines of a rebalance's new nodes being opened off the event loop (:meth:`rebalance`)
        self._rebalance_setup: asyncio.Task[dict[str, Bucket]] | None = None
        self.publisher: Publisher | None = None
        self.checkpoints: CheckpointWriter | None = None
        #: ``gateways`` > 1: the node server and the gateway child processes (the group's members)
        self.group: GroupHost | None = None
        self.runner: web.AppRunner | None = None  # gateway.api.JsonAppRunner once started
        self.http_port: int = settings.http_port
        #: the KV port's server (docs/kv-protocol.md), started with the HTTP API (single node)
        self.kv: KVServer | None = None
        #: the KV ports of a cluster's nodes (``--nodes N``: gateway/kv_cluster.py), one listener per node
        self.kv_cluster: ClusterKvPorts | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self.started_at = 0.0
        self.recovered_records = 0
        #: write backpressure and readiness (docs/reliability.md "Stalled broker and health")
        self.unacked = UnackedWrites(settings.max_unacked_bytes)
        self.readiness = Readiness(settings.health_delivery_stall_s, settings.health_vbucket_stall_s)
        #: librdkafka's log lines and errors of every client of this process, rate-limited
        self.client_log = ClientLog()
        #: times the topic was found to have lost acknowledged records (and was republished from seqno 0)
        self.truncations = 0
        self._large_record_bytes = DEFAULT_LARGE_RECORD_BYTES
        #: the user store of the data directory, opened by :meth:`start` (docs/security.md)
        self.users: UserStore | None = None
        #: the password generated for ``Administrator`` at the first start (None otherwise): ``dcpgw up`` prints
        #: it once; it is also in ``<data_dir>/admin-password`` (mode 0600)
        self.generated_admin_password: str | None = None
        #: the HTTPS context when ``tls_cert`` / ``tls_key`` are set (the KV port serves TLS with it too)
        self.tls_context: ssl.SSLContext | None = None

    @property
    def http_scheme(self) -> str:
        """``https`` when the HTTP API serves TLS, else ``http``."""
        return "https" if self.tls_context is not None else "http"

    # ------------------------------------------------------------------ config helpers
    def _client_config(self) -> dict[str, Any]:
        conf = dict(self.settings.admin_config())
        conf["bootstrap.servers"] = self.bootstrap_servers
        return with_client_log(conf, self.client_log)

    def _producer_config(self) -> dict[str, Any]:
        conf = dict(self.settings.producer_config())
        conf["bootstrap.servers"] = self.bootstrap_servers
        return with_client_log(conf, self.client_log)

    def _on_kafka_error(self, err: Any) -> None:
        """The publisher's producer's ``error_cb``: logged (rate-limited) and seen by readiness."""
        self.client_log.error_cb(err)
        self.readiness.on_kafka_error(err)

    # ------------------------------------------------------------------ lifecycle
    def open_data_dir(self) -> Layout:
        """Lock the data directory (:class:`~engine.kv.data_dir.DataDirLocked` naming the holder's pid) and check
        that it holds data of this mode (:class:`~engine.kv.data_dir.DataDirMismatch`); before anything in it
        is opened."""
        if self.data_dir_lock is None:
            self.data_dir_lock = DataDirLock.acquire(self.settings.data_dir)
        self.data_dir_lock.lock()
        return check_layout(self.settings.data_dir, cluster=self.settings.cluster_nodes > 1)

    async def start(self) -> None:
        s = self.settings
        try:
            self.open_data_dir()
        except BaseException:
            self._release_data_dir()
            raise
        await self._open_security()
        client = self._client_config()
        # Unreachable Kafka: one BrokerError naming the address within kafka_connect_timeout_s, before
        # anything else waits on it (docs/reliability.md).
        await self._kafka_call(wait_for_kafka, client, s.kafka_connect_timeout_s)
        if s.cluster_nodes > 1:
            self.cluster = self._open_cluster()
        else:
            self.bucket = Bucket(s.engine_config())
        nparts = s.create_topic_partitions or s.num_vbuckets
        needed = s.max_record_bytes()
        partitions = await self._kafka_call(
            ensure_topics, client, self.topic, nparts, s.topic_replication_factor, 30.0, needed)
        # docs/reliability.md "Large documents": an existing topic may refuse large records; records above its
        # limit (or above Kafka's default when the broker does not say) are produced alone on their partition
        topic_limit = await self._kafka_call(topic_record_limit, client, self.topic, needed)
        large = DEFAULT_LARGE_RECORD_BYTES if topic_limit is None else min(topic_limit, needed) - 1024
        lost: dict[int, str] = {}
        positions = await self._kafka_call(recover_positions, client, self.topic, partitions, s.num_vbuckets, lost)
        self._large_record_bytes = max(1, large)
        if lost:
            # the checkpoints say Kafka acknowledged records the topic no longer has: republish from 0
            self._topic_lost(f"{len(lost)} vbucket(s), e.g. {next(iter(lost.values()))}")
            positions = {}
        self.publisher = self._new_publisher(partitions, positions, rollback_to_zero=bool(lost))
        self.checkpoints = CheckpointWriter(self._producer_config(), self.topic)
        self.publisher.open()
        if s.gateways > 1:
            if self.bucket is None:
                raise GatewayError("gateways > 1 needs a single engine node (cluster_nodes = 1)")
            # docs/scale-out.md "dcpgw up --gateways": this process serves the engine to K gateway child
            # processes (the group's members) and publishes nothing itself
            self.group = GroupHost(s, self.bootstrap_servers, self.bucket, self.topic)
            # its lag is the group's over every vbucket from the start (docs/gateway.md "Lag"): the positions
            # recovered here until the members' checkpoints say more
            self.publisher.observe_positions(dict(self.publisher.acked))
            await self.group.start()
        from gateway.api import JsonAppRunner, build_app  # local: api imports this module for typing

        app = build_app(self)
        self.runner = JsonAppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, s.http_host, s.http_port, ssl_context=self.tls_context)
        try:
            await site.start()
        except OSError as e:
            raise GatewayError(f"cannot listen on {s.http_host}:{s.http_port} (http_port): "
                               f"{os.strerror(e.errno) if e.errno else e}") from e
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            self.http_port = server.sockets[0].getsockname()[1]
        if self.bucket is not None:
            self.kv = await start_kv_port(self)
        elif self.cluster is not None:
            self.kv_cluster = await start_cluster_kv_ports(self)
        self.started_at = time.time()
        self._tasks = [
            asyncio.create_task(self._pump_loop(), name="dcpgw-pump"),
            asyncio.create_task(self._every(s.checkpoint_interval_s, self._checkpoint), name="dcpgw-ckpt"),
            asyncio.create_task(self._every(s.expiry_pager_interval_s, self._expiry), name="dcpgw-expiry"),
            asyncio.create_task(self._every(s.compaction_interval_s, self._compact), name="dcpgw-compact"),
            asyncio.create_task(self._watch_health(), name="dcpgw-health"),
        ]
        if not s.rollback_mitigation:
            self._tasks.append(asyncio.create_task(self._every(s.flush_interval_s, self._flush), name="flush"))
        log.info("gateway up: topic %s (%d partitions), %s://%s:%d; engine %s", self.topic, partitions,
                 self.http_scheme, s.http_host, self.http_port, engine_build.mode)

    async def _open_security(self) -> None:
        """The user store (first start: the user ``Administrator``) and the TLS context, before Kafka is waited
        for, so a bad certificate fails the start at once (docs/security.md)."""
        s = self.settings
        if s.tls_cert is not None and s.tls_key is not None:
            self.tls_context = server_context(s.tls_cert, s.tls_key, s.tls_client_ca)
        users = await asyncio.to_thread(UserStore.open, s.data_dir)
        given = s.admin_password.get_secret_value() if s.admin_password is not None else None
        self.generated_admin_password = await asyncio.to_thread(users.ensure_admin, given)
        self.users = users

    def _new_publisher(self, partitions: int, positions: dict[int, PublishPosition], *,
                       rollback_to_zero: bool) -> Publisher:
        s = self.settings
        origin: Bucket | Cluster | None = self.cluster if self.cluster is not None else self.bucket
        assert origin is not None
        return Publisher(
            origin, {**self._producer_config(), "error_cb": self._on_kafka_error}, self.topic, partitions,
            RecordEncoder(ValueFormat(s.value_format)), positions,
            stream_from=s.stream_from,
            key_filter=KeyFilter(s.key_filter_prefix, s.key_filter_regex),
            flow_control_bytes=s.flow_control_buffer_bytes,
            rollback_mitigation=s.rollback_mitigation,
            connection_name=f"dcpgw:{s.bucket}",
            oversize_policy=s.oversize_policy,
            large_record_bytes=self._large_record_bytes,
            rollback_to_zero=rollback_to_zero,
            # gateways > 1: the child processes publish every vbucket; this one streams none
            vbuckets=[] if s.gateways > 1 else None,
        )

    def _topic_lost(self, why: str) -> None:
        """Say loudly that the topic lost records Kafka had acknowledged (docs/reliability.md "Fault campaign",
        topic truncated): a log line, ``/health/ready`` reason ``topic_truncated`` until the republish caught
        up, the counter ``dcpgw_topic_truncations``."""
        self.truncations += 1
        self.metrics.truncations.inc()
        self.readiness.topic_truncated = f"topic_truncated: {why}; republishing every vbucket from seqno 0"
        log.error("topic %s lost records Kafka had acknowledged (%s): republishing every vbucket from seqno 0 "
                  "after a rollback record to 0, so that consumers converge to the engine", self.topic, why)

    async def _reopen(self, e: TopicLost | ProducerFailed) -> None:
        """The running publisher cannot go on: drop it (nothing it still holds is acknowledged), set the topic
        up again (the broker may have recreated it, with another partition count) and open a new publisher.

        * :class:`TopicLost` (the topic lost records Kafka had acknowledged): every vbucket from seqno 0 behind
          a rollback record to 0;
        * :class:`ProducerFailed` (a fatal error of the idempotent producer): from the positions Kafka
          acknowledged, replayed as at a start -- which finds a lost log too (the checkpoint offset beyond
          the partition's end)."""
        old = self.publisher
        assert old is not None
        old.purge()
        old.close(timeout=0)
        if self.checkpoints is not None:
            self.checkpoints.pending.clear()
        self.checkpoints = CheckpointWriter(self._producer_config(), self.topic)  # its producer may be failed too
        s = self.settings
        client = self._client_config()
        partitions = await self._kafka_call(
            ensure_topics, client, self.topic, s.create_topic_partitions or s.num_vbuckets,
            s.topic_replication_factor, 30.0, s.max_record_bytes())
        positions: dict[int, PublishPosition] = {}
        if isinstance(e, TopicLost):
            self._topic_lost(str(e))
        else:
            log.error("the Kafka producer failed (%s): a new one resumes from the positions Kafka acknowledged", e)
            lost: dict[int, str] = {}
            acked = {vb: p.copy() for vb, p in old.acked.items()}
            positions = await self._kafka_call(replay_tail, client, self.topic, partitions, s.num_vbuckets, acked,
                                               lost)
            if lost:
                self._topic_lost(f"{len(lost)} vbucket(s), e.g. {next(iter(lost.values()))}")
                positions = {}
        pub = self._new_publisher(partitions, positions, rollback_to_zero=not positions)
        pub.open()
        self.publisher = pub
        self.metrics.new_publisher()

    async def _kafka_call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` -- a blocking Kafka call of the start-up (metadata, topic creation, reading the
        checkpoints and partition tails) -- on a daemon thread, abandoned when a stop is requested first
        (SIGTERM / SIGINT during start-up): :class:`StartupInterrupted`. A daemon thread, not the loop's
        executor: the process exits without joining it (docs/reliability.md "Fault campaign", bounded stop)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

        def run() -> None:
            try:
                value, ok = fn(*args), True
            except BaseException as e:  # handed to the awaiting coroutine
                value, ok = e, False
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(settle, ok, value)

        if self._stopping.is_set():
            raise StartupInterrupted("stopped during start-up")
        threading.Thread(target=run, name=f"dcpgw-{getattr(fn, '__name__', 'kafka')}", daemon=True).start()
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({fut, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not fut.done():
            fut.cancel()
            raise StartupInterrupted("stopped during start-up")
        return fut.result()

    def _open_cluster(self) -> Cluster:
        """The cluster under ``data_dir``: reopened when its map is there, else created with
        ``cluster_nodes`` nodes and ``cluster_replicas`` replicas."""
        s = self.settings
        self.settings.engine_config()  # validates the bucket name / vbucket count the nodes will use
        if check_layout(s.data_dir, cluster=True) is Layout.CLUSTER:
            # a missing or damaged map next to node data is rebuilt from the nodes' states (engine/cluster/map_recovery.py)
            cluster = Cluster.open(s.data_dir, replicas=s.cluster_replicas, name=s.bucket,
                                   conflict_resolution=s.conflict_resolution)
            if cluster.num_vbuckets != s.num_vbuckets:
                cluster.close()
                raise InvalidArgument(f"the cluster under {s.data_dir} has {cluster.num_vbuckets} vbuckets, "
                                      f"not {s.num_vbuckets}")
        else:
            cluster = Cluster.create(s.data_dir, nodes=s.cluster_nodes, replicas=s.cluster_replicas,
                                     num_vbuckets=s.num_vbuckets, seed=None, name=s.bucket,
                                     conflict_resolution=s.conflict_resolution)
        cluster.rollback_repair = s.rollback_repair  # docs/cluster.md "Rollback repair"
        return cluster

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

    async def recover(self, node: str, mode: str) -> RecoveryReport:
        """Recover failed-over ``node`` (``delta`` or ``full``; docs/cluster.md "Delta recovery"): it rejoins the
        map, its copies roll back (after the rollback repair) and stream the difference in the pump loop; a
        rebalance restores the map's balance. A node engine that must be (re)opened -- the node is down, or a
        full recovery wiped it -- is opened on a worker thread, like a rebalance's new nodes.
        :class:`InvalidArgument` for an unknown node, a node never failed over, a bad mode or a rebalance
        running or starting."""
        c = self.cluster
        if c is None:
            raise InvalidArgument("the gateway runs a single bucket, not a cluster (dcpgw up --nodes N)")
        if self._rebalance_setup is not None:
            raise InvalidArgument("a rebalance is starting: recover the node after it")
        c.prepare_recovery(node, mode)
        opened: Bucket | None = None
        try:
            if not c.nodes[node].up:
                opened = await asyncio.get_running_loop().run_in_executor(None, c.open_recovery_bucket, node)
            report = c.recover(node, mode, bucket=opened)
        except BaseException:
            c.abandon_recovery(node)
            raise
        self.wake()
        return report

    @property
    def rebalance_preparing(self) -> bool:
        """A rebalance's new nodes are being opened (it is not running yet, a second one is refused)."""
        return self._rebalance_setup is not None

    async def rebalance(self, add: list[str], remove: list[str]) -> Rebalance:
        """Start a rebalance (engine/cluster/rebalance.py, docs/rebalance.md): ``add`` nodes in, ``remove`` nodes out.

        The request is checked first (nothing done when refused). The new nodes' engines (a data directory,
        SQLite, every vbucket each) are then opened on a worker thread, one at a time, so the event loop keeps
        serving: they touch nothing of the cluster until :meth:`~engine.cluster.local.Cluster.start_rebalance`
        takes them over on the loop's thread. The moves then run **step-wise inside the pump loop**: every
        ``Cluster.pump`` advances it a bounded amount (add-stream handshakes, one batch per mover connection,
        the moves' checks), interleaved with ``Publisher.pump`` on the same event-loop thread, so publishing
        never waits for it and the in-process cluster (not thread-safe) is never touched from another thread.
        Progress: :attr:`last_rebalance`. :class:`InvalidArgument` for bad node sets or a rebalance already
        running; TemporaryFailure when the service is stopping."""
        c = self.cluster
        if c is None:
            raise InvalidArgument("the gateway runs a single bucket, not a cluster (dcpgw up --nodes N)")
        if self._rebalance_setup is not None:
            raise InvalidArgument("a rebalance is already starting")
        c.check_rebalance(add, remove)
        setup = asyncio.create_task(self._open_nodes(c, add), name="dcpgw-rebalance-setup")
        self._rebalance_setup = setup
        try:
            try:
                # shielded: a request that goes away does not leave half-opened engines behind
                opened = await asyncio.shield(setup)
            except asyncio.CancelledError:
                setup.add_done_callback(_close_opened)
                raise
            try:
                if self._stopping.is_set():
                    raise TemporaryFailure("the gateway is stopping: rebalance not started")
                self.last_rebalance = c.start_rebalance(add, remove, buckets=opened)
            finally:
                for b in opened.values():  # the engines start_rebalance did not take over
                    b.close()
        finally:
            self._rebalance_setup = None
        self.wake()
        return self.last_rebalance

    async def _open_nodes(self, c: Cluster, add: list[str]) -> dict[str, Bucket]:
        """The engines of the nodes ``add`` that are not up yet, opened one by one on a worker thread."""
        loop = asyncio.get_running_loop()
        opened: dict[str, Bucket] = {}
        try:
            for n in add:
                node = c.nodes.get(n)
                if node is not None and node.up:
                    continue
                if self._stopping.is_set():
                    raise TemporaryFailure("the gateway is stopping: rebalance not started")
                opened[n] = await loop.run_in_executor(None, c.open_node_bucket, n)
        except BaseException:
            for b in opened.values():
                b.close()
            raise
        return opened

    def wake(self) -> None:
        """Writes happened: the pump loop should run now (and, in ``dcpgw up --gateways K``, the node server's
        DCP connections to the gateway processes)."""
        self._wake.set()
        if self.group is not None:
            self.group.server.kick()

    async def _pump_loop(self) -> None:
        """Pump publisher (and cluster) in bounded rounds, yielding to the loop between them: a round steps at
        most one DCP batch, never waits for Kafka (a full librdkafka queue keeps the records for the next
        round) and flushes only what was written since the last round (docs/reliability.md)."""
        pub = self.publisher
        assert pub is not None
        cluster = self.cluster
        # With mitigation the cluster's nodes are flushed on every round (the replicas' persistence is what
        # publishing waits for); without it the flush task does it every flush_interval_s.
        flush = self.settings.rollback_mitigation
        idle = 0
        acked = pub.records_acked
        release_at = 0.0
        while not self._stopping.is_set():
            try:
                # never blocks the loop on a background flush, nor for long on publishing
                n = pub.pump(LOOP_PUMP_MESSAGES, wait_for_flush=False)
                if cluster is not None:
                    n += cluster.pump(rounds=1, flush=flush)  # replication: active -> replica DCP streams
                    if cluster.rebalance_running is not None:
                        n += 1  # pump() stepped the rebalance: keep going (yielding to the loop each round)
                    if self.kv_cluster is not None:
                        await self.kv_cluster.sync()  # listeners follow the nodes; a new map is pushed to clients
            except (TopicLost, ProducerFailed) as e:
                try:
                    await self._reopen(e)
                except StartupInterrupted:
                    return  # stopping
                except Exception:
                    log.exception("republishing after the topic lost its log failed; retried in a second")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), timeout=1.0)
                    continue
                pub = self.publisher
                assert pub is not None
                acked = pub.records_acked
                continue
            except Exception as e:
                if pub.error is not None:
                    log.error("publishing stopped: %s", pub.error)
                    return  # a record was lost: /health/ready says publish_failed; restart resumes
                if self.readiness.pump_error is None:
                    log.exception("pump failed (retried every second; /health/ready is 503 meanwhile)")
                self.readiness.on_pump_error(e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), timeout=1.0)
                continue
            if self.readiness.pump_error is not None:
                log.info("pump recovered")
                self.readiness.pump_error = None
            if pub.records_acked != acked and (n == 0 or time.monotonic() >= release_at):
                # every UNACKED_RELEASE_S while records move (it scans every vbucket with unacknowledged writes:
                # 3.8 % of the process during a bulk load when it ran after every round), at once when idle
                acked = pub.records_acked
                self.unacked.release(pub)
                release_at = time.monotonic() + UNACKED_RELEASE_S
            if n:
                idle = 0
                await asyncio.sleep(0)
                continue
            if pub.waiting_for_flush:
                # what was stepped waits for the flush the storage's writer thread commits: the loop serves the
                # API and the KV port meanwhile and looks again soon (as the node server's flusher does)
                idle = 0
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=FLUSH_POLL_S)
                continue
            idle = min(idle + 1, 10)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=0.001 * idle)

    async def _watch_health(self) -> None:
        """Refresh the stalled-vbucket view; while librdkafka says every broker is down, probe the broker
        (a metadata request, off the loop's thread) so readiness returns when it answers again."""
        interval = min(1.0, self.settings.health_vbucket_stall_s / 4)
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=interval)
            pub = self.publisher
            if self._stopping.is_set() or pub is None:
                return
            if self.group is not None and self.group.progress is not None:
                # the members' acknowledged positions: /stats lag, /streams, dcpgw status (docs/scale-out.md)
                pub.observe_positions(self.group.progress.positions)
            self.readiness.observe(pub)
            self.unacked.release(pub)
            # librdkafka's repeat counts whose window ended (else logged only when the message recurs)
            self.client_log.flush_due()
            if self.readiness.topic_truncated is not None and not pub.lost and pub.lag()[0] == 0 \
                    and not pub.inflight:
                log.info("topic %s: republished every vbucket from seqno 0", self.topic)
                self.readiness.topic_truncated = None
            if self.readiness.broker_error is not None:
                kafka = pub.kafka
                try:
                    await loop.run_in_executor(None, functools.partial(kafka.list_topics, self.topic, timeout=2.0))
                except Exception:
                    continue
                self.readiness.broker_reachable()

    def admit_write(self) -> None:
        """Backpressure: :class:`~gateway.exceptions.Backpressure` once ``max_unacked_bytes`` of accepted
        writes wait for Kafka's acknowledgement."""
        if self.unacked.over_limit():
            raise Backpressure(self.unacked.total, self.unacked.limit)

    def note_write(self, vbucket: int, seqno: int, nbytes: int) -> None:
        """A write the engine accepted (counted until Kafka acknowledges its record)."""
        pub = self.publisher
        if pub is not None and vbucket in pub.assigned:  # another gateway process's vbucket: not counted here
            self.unacked.add(vbucket, seqno, nbytes, pub.sent[vbucket].seqno)

    def ready_view(self) -> tuple[int, dict[str, Any]]:
        """``GET /health/ready`` (and ``/health``): 200 ``{"status": "ok", "reasons": []}`` or 503 with why."""
        pub = self.publisher
        reasons = self.readiness.reasons(pub, bool(self.buckets()))
        body: dict[str, Any] = {"status": "failing" if reasons else "ok", "reasons": reasons}
        return (503 if reasons else 200), body

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
        try:
            n = sum(b.flush() for b in self.buckets())
        except Exception as e:
            self.readiness.on_pump_error(e)
            raise
        self.readiness.pump_error = None
        if n:
            self.wake()

    async def stop(self) -> None:
        if self.group is not None:
            await self.group.stop()  # the children leave the group while the node server serves their streams
        self._stopping.set()
        self._wake.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        setup = self._rebalance_setup
        if setup is not None:  # its worker thread finishes the engine it opens (bounded); rebalance() closes it
            with contextlib.suppress(BaseException):
                await asyncio.wait([setup])
        # Bounded whatever the broker does (docs/reliability.md "Fault campaign"): the deliveries get most of
        # shutdown_timeout_s, the last checkpoints the rest; then what librdkafka still holds is dropped, so
        # destroying the clients waits for no broker.
        budget = self.settings.shutdown_timeout_s
        deadline = time.monotonic() + budget
        if self.runner is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.runner.cleanup(), timeout=max(0.1, budget * 0.2))
        if self.kv is not None:
            await self.kv.stop()
        if self.kv_cluster is not None:
            await self.kv_cluster.stop()
        if self.publisher is not None:
            self.publisher.close(timeout=max(0.0, deadline - time.monotonic() - budget * 0.2))
            self._checkpoint()
        if self.checkpoints is not None:
            self.checkpoints.flush(timeout=max(0.0, deadline - time.monotonic()))
        if self.bucket is not None and not self.bucket.closed:
            self.bucket.close(clean=True)
        if self.cluster is not None:
            self.cluster.close()
        # Drop the Kafka clients now (librdkafka handles are destroyed with their last reference).
        self.publisher = None
        self.checkpoints = None
        self.client_log.flush()  # the last repeat counts of librdkafka's messages
        self._release_data_dir()

    def _release_data_dir(self) -> None:
        if self._own_lock and self.data_dir_lock is not None:
            self.data_dir_lock.release()
            self.data_dir_lock = None

    async def run_until_stopped(self) -> None:
        await self._stopping.wait()

    def request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()
