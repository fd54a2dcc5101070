"""The cluster config provider of one node of an in-process cluster (``dcpgw up --nodes N``; docs/kv-protocol.md
"Several nodes").

Every node of :class:`~engine.cluster.local.Cluster` gets its own KV listener; each listener's front end is given
a :class:`ClusterNodeConfig` for its node. It answers

* the config (engine/cluster/cluster_config.py): the cluster's current vbucket map with every node's KV address,
  ``thisNode`` on this node, revisions from the one :class:`~engine.cluster.cluster_config.ClusterConfigTracker`
  all the node listeners share (so every node serves the same ``rev`` for the same map);
* which bucket serves a vbucket: this node's, if the map makes it the vbucket's active (replica for
  GET_REPLICA), else NOT_MY_VBUCKET -- the front end answers it with the current config as body, and the SDK
  follows the new map; a vbucket whose writes the cluster manager stopped (the last step of a rebalance move, a
  graceful failover) answers writes TMPFAIL, which the SDK retries (kv_engine's takeover answers the same).

Everything here runs on the event loop that owns the cluster (the in-process cluster is not thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine.bucket import Bucket
from engine.cluster.cluster_config import ClusterConfigTracker, NodeAddress
from engine.cluster.local import Cluster
from engine.exceptions import NotMyVBucket, TemporaryFailure


class ClusterNodeConfig:
    """:class:`~engine.network.kv.cluster_config.ClusterConfigProvider` for node ``node`` of ``cluster``;
    ``addresses()`` gives every node's KV address now (nodes without a listener are left out)."""

    def __init__(self, cluster: Cluster, node: str, tracker: ClusterConfigTracker,
                 addresses: Callable[[], Mapping[str, NodeAddress]]) -> None:
        self.cluster = cluster
        self.node = node
        self.tracker = tracker
        self._addresses = addresses

    @property
    def bucket_name(self) -> str:
        return self.tracker.bucket

    @property
    def rev(self) -> int:
        return self.tracker.revision(self.cluster.vbucket_map(), self._addresses())

    def config(self, host: str, *, bucket: bool) -> dict[str, Any]:
        return self.tracker.config(self.cluster.vbucket_map(), self._addresses(), self.node, host=host,
                                   with_bucket=bucket)

    def config_bytes(self, host: str, *, bucket: bool = True) -> tuple[int, bytes]:
        """``(rev, JSON)`` of :meth:`config`, encoded once per revision."""
        return self.tracker.encoded(self.cluster.vbucket_map(), self._addresses(), self.node, host=host,
                                    with_bucket=bucket)

    def _bucket(self, vbucket: int) -> Bucket:
        node = self.cluster.nodes.get(self.node)
        if node is None:  # ejected by a rebalance: nothing is served here any more
            raise NotMyVBucket(f"node {self.node} left the cluster")
        if not 0 <= vbucket < self.cluster.num_vbuckets:
            raise NotMyVBucket(f"unknown vbucket {vbucket} (the cluster has {self.cluster.num_vbuckets})")
        if node.bucket is None or node.bucket.closed:
            raise TemporaryFailure(f"node {self.node} is down")
        return node.bucket

    def bucket_for(self, vbucket: int) -> Bucket:
        """This node's bucket when the map makes it ``vbucket``'s active; NotMyVBucket otherwise."""
        b = self._bucket(vbucket)
        if self.cluster.vbucket_map().active(vbucket) != self.node:
            raise NotMyVBucket(f"vbucket {vbucket} is not active on node {self.node}")
        return b

    def replica_bucket_for(self, vbucket: int) -> Bucket:
        """This node's bucket when the map makes it one of ``vbucket``'s replicas (GET_REPLICA)."""
        b = self._bucket(vbucket)
        if self.node not in self.cluster.vbucket_map().replicas(vbucket):
            raise NotMyVBucket(f"vbucket {vbucket} has no replica on node {self.node}")
        return b

    def admit_write(self, vbucket: int) -> None:
        """TMPFAIL while the cluster manager stops writes to ``vbucket`` (rebalance takeover, graceful
        failover: docs/rebalance.md "The mover")."""
        if self.cluster.writes_blocked(vbucket):
            raise TemporaryFailure(f"vbucket {vbucket} is being moved")


__all__ = ["ClusterNodeConfig"]
