"""The cluster config clients bootstrap from (CCCP): the bucket config JSON Couchbase Server's memcached serves
over GET_CLUSTER_CONFIG, in the body of NOT_MY_VBUCKET and in CLUSTERMAP_CHANGE_NOTIFICATION (docs/kv-protocol.md
"Cluster map").

:func:`build_cluster_config` is pure: from the engine's :class:`~engine.cluster.vbucket_map.VBucketMap` and the
nodes' addresses it makes the dict ns_server's ``bucket_info_cache`` makes --

* ``vBucketServerMap``: ``serverList`` (``"host:kvport"`` of every node of the map that has a KV address, in the
  map's node order), ``vBucketMap`` (per vbucket the active's index into ``serverList`` then the replicas', ``-1``
  for an empty slot or a node without an address), ``numReplicas``, ``hashAlgorithm: "CRC"``;
* ``nodesExt``: one entry per ``serverList`` node **in the same order** -- the C++ core of the official SDKs
  (couchbase-cxx-client ``core/topology/configuration_json.hxx``) takes its node list from ``nodesExt`` when present
  and indexes it with the ``vBucketMap`` numbers, as ns_server orders the bucket's servers first;
* ``nodes`` (the pre-``nodesExt`` form, for older clients), ``rev`` / ``revEpoch`` (clients keep the config with
  the highest ``(revEpoch, rev)`` and ignore older or equal ones), ``name``, ``uuid``, ``nodeLocator: "vbucket"``,
  ``bucketCapabilities``.

:class:`ClusterConfigTracker` turns a stream of (map, addresses) snapshots into revisions: ``rev`` goes up by one
whenever the map (a failover, a rebalance step, a node added) or a node's address changes, and never down.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.cluster.vbucket_map import VBucketMap
from engine.exceptions import InvalidArgument

#: ns_server's placeholder for "the address the client connected to" (kv_engine / the SDKs substitute it); a
#: :class:`NodeAddress` with this host gets the ``host`` given to :func:`build_cluster_config`.
HOST_PLACEHOLDER = "$HOST"

#: What this engine supports of Couchbase Server's bucket capabilities (ns_server ``bucket_capabilities``); the SDK
#: reads them from the config. ``collections`` is not listed: the KV port serves the default collection only.
DEFAULT_BUCKET_CAPABILITIES: tuple[str, ...] = ("durableWrite", "tombstonedUserXAttrs", "dcp", "cbhello", "touch",
                                                "cccp", "nodesExt")


@dataclass(frozen=True)
class NodeAddress:
    """Where a node's services listen: the host clients connect to, the KV port (plain and / or TLS) and
    optionally the management (HTTP API) ports."""

    host: str
    kv: int | None = None
    kv_tls: int | None = None
    mgmt: int | None = None
    mgmt_tls: int | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise InvalidArgument("a node address needs a host")
        for name in ("kv", "kv_tls", "mgmt", "mgmt_tls"):
            port = getattr(self, name)
            if port is not None and (type(port) is not int or not 0 < port < 65536):
                raise InvalidArgument(f"{name} port must be 1..65535, got {port!r}")
        if self.kv is None and self.kv_tls is None:
            raise InvalidArgument(f"node address {self.host} has no KV port")

    @property
    def server(self) -> str:
        """The ``serverList`` entry: ``host:port`` of the plain KV port (the TLS one when there is no plain one;
        IPv6 hosts in brackets)."""
        port = self.kv if self.kv is not None else self.kv_tls
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{port}"


def build_cluster_config(
    vbmap: VBucketMap, addresses: Mapping[str, NodeAddress], *, rev: int, rev_epoch: int = 1,
    bucket: str = "default", bucket_uuid: str, this_node: str | None = None, host: str | None = None,
    capabilities: Sequence[str] = DEFAULT_BUCKET_CAPABILITIES, with_bucket: bool = True,
    conflict_resolution: str | None = None,
) -> dict[str, Any]:
    """The bucket config of ``vbmap`` with the nodes at ``addresses`` (see the module docstring). ``this_node``:
    the node whose connection the config is sent on (``thisNode: true`` in its ``nodesExt`` / ``nodes`` entry);
    ``host``: the address that connection's client used, written for every address whose host is
    :data:`HOST_PLACEHOLDER`. Nodes of the map without an address are left out of ``serverList``: their slots
    read ``-1``. ``with_bucket=False``: the cluster config without a selected bucket (GCCCP: ``rev``,
    ``revEpoch``, ``nodesExt``). ``conflict_resolution`` (``seqno`` / ``lww``): the bucket's XDCR conflict
    resolution as ``conflictResolutionType`` (what Couchbase's bucket details call it; an XDCR source checks it
    against its own, docs/xdcr.md "Conflict resolution")."""
    if type(rev) is not int or rev < 0 or type(rev_epoch) is not int or rev_epoch < 0:
        raise InvalidArgument(f"rev and revEpoch must be integers >= 0, got {rev!r}, {rev_epoch!r}")
    if host is not None:
        if not host:
            raise InvalidArgument("the client's host must not be empty")
        addresses = {n: replace(a, host=host) if a.host == HOST_PLACEHOLDER else a for n, a in addresses.items()}
    servers = [n for n in vbmap.nodes if n in addresses]
    index = {n: i for i, n in enumerate(servers)}
    vbucket_map = [[index.get(n, -1) if n is not None else -1 for n in chain] for chain in vbmap.chains]
    nodes_ext: list[dict[str, Any]] = []
    nodes: list[dict[str, Any]] = []
    for name in servers:
        a = addresses[name]
        services: dict[str, int] = {}
        for key, port in (("kv", a.kv), ("kvSSL", a.kv_tls), ("mgmt", a.mgmt), ("mgmtSSL", a.mgmt_tls)):
            if port is not None:
                services[key] = port
        ext: dict[str, Any] = {"services": services, "hostname": a.host}
        legacy: dict[str, Any] = {
            "hostname": f"{a.server.rsplit(':', 1)[0]}:{a.mgmt if a.mgmt is not None else 8091}",
            "ports": {"direct": a.kv if a.kv is not None else a.kv_tls},
            "status": "healthy", "clusterMembership": "active", "otpNode": f"ns_1@{name}",
        }
        if name == this_node:
            ext["thisNode"] = True
            legacy["thisNode"] = True
        nodes_ext.append(ext)
        nodes.append(legacy)
    if not with_bucket:
        return {"rev": rev, "revEpoch": rev_epoch, "nodesExt": nodes_ext, "clusterCapabilitiesVer": [1, 0],
                "clusterCapabilities": {}}
    out: dict[str, Any] = {
        "rev": rev,
        "revEpoch": rev_epoch,
        "name": bucket,
        "uuid": bucket_uuid,
        "nodeLocator": "vbucket",
        "bucketType": "membase",
        "bucketCapabilitiesVer": "",
        "bucketCapabilities": list(capabilities),
        "nodes": nodes,
        "nodesExt": nodes_ext,
        "vBucketServerMap": {
            "hashAlgorithm": "CRC",
            "numReplicas": vbmap.num_replicas,
            "serverList": [addresses[n].server for n in servers],
            "vBucketMap": vbucket_map,
        },
    }
    if conflict_resolution is not None:
        out["conflictResolutionType"] = conflict_resolution
    return out


def encode_cluster_config(config: Mapping[str, Any]) -> bytes:
    """The config as the JSON bytes sent on the wire (compact; datatype JSON)."""
    return json.dumps(config, separators=(",", ":")).encode()


class ClusterConfigTracker:
    """Revisions over changing (map, addresses): ``rev`` starts at the map's revision and goes up by one on every
    change of either (the map's own revision is part of what is compared); :meth:`config` builds the current
    config for one node's connection. Not thread-safe: the owner of the cluster calls it (its event loop)."""

    def __init__(self, *, bucket: str = "default", bucket_uuid: str, rev_epoch: int = 1,
                 capabilities: Sequence[str] = DEFAULT_BUCKET_CAPABILITIES,
                 conflict_resolution: str | None = None) -> None:
        self.bucket = bucket
        self.conflict_resolution = conflict_resolution
        self.bucket_uuid = bucket_uuid
        self.rev_epoch = rev_epoch
        self.capabilities = tuple(capabilities)
        self._key: tuple[Any, ...] | None = None
        self._rev = 0
        self._last: tuple[VBucketMap, dict[str, NodeAddress]] | None = None
        self._encoded: dict[tuple[str | None, str | None, bool], bytes] = {}

    def revision(self, vbmap: VBucketMap, addresses: Mapping[str, NodeAddress]) -> int:
        """The ``rev`` of this (map, addresses): unchanged while both are, else the next one."""
        if self._last is not None and self._last[0] is vbmap and self._last[1] == addresses:
            return self._rev  # maps are immutable: the same object is the same map
        key = (vbmap.revision, tuple(vbmap.nodes), tuple(tuple(c) for c in vbmap.chains),
               tuple(sorted(addresses.items())))
        if key != self._key:
            self._rev = vbmap.revision if self._key is None else max(self._rev + 1, vbmap.revision)
            self._key = key
            self._encoded.clear()
        self._last = (vbmap, dict(addresses))
        return self._rev

    def config(self, vbmap: VBucketMap, addresses: Mapping[str, NodeAddress], this_node: str | None = None, *,
               host: str | None = None, with_bucket: bool = True) -> dict[str, Any]:
        """The current config (:func:`build_cluster_config`) for a connection to ``this_node`` made to ``host``."""
        return build_cluster_config(
            vbmap, addresses, rev=self.revision(vbmap, addresses), rev_epoch=self.rev_epoch, bucket=self.bucket,
            bucket_uuid=self.bucket_uuid, this_node=this_node, host=host, capabilities=self.capabilities,
            with_bucket=with_bucket, conflict_resolution=self.conflict_resolution)

    def encoded(self, vbmap: VBucketMap, addresses: Mapping[str, NodeAddress], this_node: str | None = None, *,
                host: str | None = None, with_bucket: bool = True) -> tuple[int, bytes]:
        """``(rev, JSON bytes)`` of :meth:`config`, built once per revision, node, host and kind."""
        rev = self.revision(vbmap, addresses)
        key = (this_node, host, with_bucket)
        body = self._encoded.get(key)
        if body is None:
            if len(self._encoded) > 256:  # clients using many host names: keep the cache bounded
                self._encoded.clear()
            body = self._encoded[key] = encode_cluster_config(
                self.config(vbmap, addresses, this_node, host=host, with_bucket=with_bucket))
        return rev, body


__all__ = ["DEFAULT_BUCKET_CAPABILITIES", "HOST_PLACEHOLDER", "ClusterConfigTracker", "NodeAddress", "build_cluster_config",
           "encode_cluster_config"]
