"""The KV port of an in-process cluster (``dcpgw up --nodes N``; docs/kv-protocol.md "Several nodes").

Every node of the :class:`~engine.cluster.local.Cluster` gets its own KV listener
(:class:`~engine.network.kv.frontend.KVServer`) serving that node's bucket, with a
:class:`~engine.network.kv.cluster_nodes.ClusterNodeConfig` as its cluster config provider -- so an SDK bootstraps
from any node, reads the map (``vBucketServerMap`` over every node's KV port) and sends each operation to the
vbucket's node, as against Couchbase Server.

Ports: the node ``nI`` listens on ``kv_port + I`` (node names of another form on the next offset after the
highest in use), so ``--kv-port 11210`` puts ``n0`` on 11210, ``n1`` on 11211, ...; a port already taken (and
every port with ``--kv-port 0``) is replaced by a free one the system picks. ``GET /health`` lists them
(``kv_ports``).

:meth:`ClusterKvPorts.sync` runs on every round of the gateway's pump loop (the event loop that owns the
cluster): it starts listeners for nodes that appeared (a rebalance adding a node), stops those of nodes that
left (ejected by a rebalance), and when the config's revision changed (failover, a rebalance step, a listener
more or less) pushes the new config to the connections that asked for it (HELLO DUPLEX +
CLUSTERMAP_CHANGE_NOTIFICATION). Clients without it get the new map in the body of NOT_MY_VBUCKET, or by polling
GET_CLUSTER_CONFIG (the SDK does every 2.5 s).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.cluster.cluster_config import HOST_PLACEHOLDER, ClusterConfigTracker, NodeAddress
from engine.cluster.local import Cluster
from engine.network.kv.cluster_nodes import ClusterNodeConfig
from engine.network.kv.documents import WriteHooks
from engine.network.kv.frontend import KVServer
from engine.network.kv.sasl import UserDirectory
from engine.security.users import UserStore
from gateway.exceptions import GatewayError
from gateway.kv_port import GatewayWriteHooks

if TYPE_CHECKING:
    from gateway.service import GatewayService

log = logging.getLogger(__name__)

_NODE_NUMBER = re.compile(r"n(\d{1,4})")


class ClusterKvPorts:
    """One KV listener per node of ``cluster`` (see the module docstring)."""

    def __init__(
        self, cluster: Cluster, users: UserDirectory, *, bucket: str, host: str, first_port: int,
        ssl_context: ssl.SSLContext | None = None, hooks: WriteHooks | None = None,
        server_factory: Callable[..., KVServer] = KVServer, conflict_resolution: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.users = users
        self.host = host
        self.first_port = first_port
        self.ssl_context = ssl_context
        self.hooks = hooks
        self._factory = server_factory
        uuid = hashlib.sha256(f"dcpgw:{cluster.base_dir.resolve()}:{bucket}".encode()).hexdigest()[:32]
        #: the one revision counter of every node's config (engine/cluster/cluster_config.py)
        self.tracker = ClusterConfigTracker(bucket=bucket, bucket_uuid=uuid, conflict_resolution=conflict_resolution)
        self.servers: dict[str, KVServer] = {}
        self._offsets: dict[str, int] = {}
        self._pushed_rev: int | None = None
        #: config pushes sent (CLUSTERMAP_CHANGE_NOTIFICATION rounds)
        self.pushes = 0

    # ------------------------------------------------------------------ addresses
    @property
    def ports(self) -> dict[str, int]:
        """node -> its KV port (listening now)."""
        return {n: s.port for n, s in self.servers.items()}

    @property
    def first(self) -> int | None:
        """The port of the node with the lowest port offset (``n0`` on ``kv_port`` while it is in the cluster):
        what ``GET /health`` calls ``kv_port``."""
        if not self.servers:
            return None
        return self.servers[min(self.servers, key=lambda n: self._offsets.get(n, 0))].port

    @property
    def tls(self) -> bool:
        return self.ssl_context is not None

    def addresses(self) -> dict[str, NodeAddress]:
        """Every listening node's address; the host is the one each client connected to (``$HOST``)."""
        if self.tls:
            return {n: NodeAddress(HOST_PLACEHOLDER, kv_tls=s.port) for n, s in self.servers.items()}
        return {n: NodeAddress(HOST_PLACEHOLDER, kv=s.port) for n, s in self.servers.items()}

    def _offset(self, node: str) -> int:
        off = self._offsets.get(node)
        if off is None:
            m = _NODE_NUMBER.fullmatch(node)
            used = set(self._offsets.values())
            off = int(m.group(1)) if m is not None and int(m.group(1)) not in used else \
                max(used | {len(self._offsets) - 1}) + 1
            self._offsets[node] = off
        return off

    # ------------------------------------------------------------------ lifecycle
    async def _start(self, node: str) -> None:
        provider = ClusterNodeConfig(self.cluster, node, self.tracker, self.addresses)
        port = 0 if self.first_port == 0 else self.first_port + self._offset(node)
        if port > 65535:
            port = 0
        server = self._factory(provider, self.users, host=self.host, port=port, ssl_context=self.ssl_context,
                               hooks=self.hooks)
        try:
            await server.start()
        except OSError as e:
            if port == 0 or node == self._first_node():
                raise
            log.warning("kv port %d for node %s is taken (%s): listening on a free port instead", port, node, e)
            server = self._factory(provider, self.users, host=self.host, port=0, ssl_context=self.ssl_context,
                                   hooks=self.hooks)
            await server.start()
        self.servers[node] = server
        log.info("kv port of node %s: %s:%d", node, self.host, server.port)

    def _first_node(self) -> str:
        return next(iter(self.cluster.nodes), "")

    async def start(self) -> None:
        """Listen for every node of the cluster (the first node on ``first_port``: an OSError when taken)."""
        try:
            await self.sync()
        except BaseException:
            await self.stop()
            raise

    async def sync(self) -> None:
        """Listeners for nodes that appeared, none for nodes that left; the new config pushed on a change."""
        nodes = self.cluster.nodes
        if nodes.keys() != self.servers.keys():
            for name in [n for n in self.servers if n not in nodes]:
                server = self.servers.pop(name)
                await server.stop()
                log.info("kv port of node %s closed (the node left the cluster)", name)
            for name in [n for n in nodes if n not in self.servers]:
                await self._start(name)
        rev = self.tracker.revision(self.cluster.vbucket_map(), self.addresses())
        if rev != self._pushed_rev:
            if self._pushed_rev is not None:
                for server in self.servers.values():
                    server.notify_config_change()
                self.pushes += 1
            self._pushed_rev = rev

    async def stop(self) -> None:
        for name in list(self.servers):
            await self.servers.pop(name).stop()


async def start_cluster_kv_ports(svc: GatewayService) -> ClusterKvPorts:
    """The KV listeners of the service's cluster on ``http_host``, the first node on ``kv_port``, with the service's
    user store, TLS context and write hooks; a first port that cannot be bound is one GatewayError."""
    s = svc.settings
    assert svc.cluster is not None
    users: UserDirectory = svc.users if svc.users is not None else UserStore.open(s.data_dir)
    ports = ClusterKvPorts(svc.cluster, users, bucket=s.bucket, host=s.http_host, first_port=s.kv_port,
                           ssl_context=svc.tls_context, hooks=GatewayWriteHooks(svc),
                           conflict_resolution=s.conflict_resolution)
    try:
        await ports.start()
    except OSError as e:
        raise GatewayError(f"cannot listen on {s.http_host}:{s.kv_port} (kv_port): "
                           f"{os.strerror(e.errno) if e.errno else e}") from e
    return ports


__all__ = ["ClusterKvPorts", "start_cluster_kv_ports"]
